"""The sweep's output format: long-form rows with p20/p50/p80, the cost-model summary line."""

import os
import sys
from pathlib import Path

import pytest


def test_long_rows_one_row_per_metric_with_quantiles():
    from bench.report import long_rows

    rows = [dict(section="e2e", case="c", transport="tcp", bytes=64, method="m", descriptors=3, ms=2.0,
                 ms_p20=1.5, ms_p80=2.5, gbps="", note="")]
    got = {r["metric"]: r for r in long_rows(rows)}
    assert set(got) == {"descriptors", "ms"}  # an empty gbps is no measurement
    assert (got["ms"]["p20"], got["ms"]["p50"], got["ms"]["p80"], got["ms"]["unit"]) == (1.5, 2.0, 2.5, "ms")
    assert (got["descriptors"]["p20"], got["descriptors"]["p80"], got["descriptors"]["unit"]) == (3, 3, "count")
    for r in got.values():  # parameters stay columns of every long row
        assert (r["section"], r["case"], r["transport"], r["bytes"], r["method"]) == ("e2e", "c", "tcp", 64, "m")


def test_costmodel_summary_line():
    from bench.report import summary_line

    rows = [dict(ratio=1.0), dict(ratio=1.2), dict(ratio=1.05), dict(transport="tcp", chosen="failed")]
    assert summary_line(rows) == "cost model: chosen/best worst 1.20, median 1.05 over 3 cells"
    assert summary_line([]) == "cost model: no cells ran"
    from bench.report import noise_line

    rows[1]["miss_beyond_noise"] = "yes"
    assert noise_line(rows).endswith("1 of 3 cells, worst 1.20")


def test_quantiles_of():
    from bench.timing import qfields, quantiles_of

    assert quantiles_of([5.0]) == (5.0, 5.0, 5.0)
    q = quantiles_of([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert q == pytest.approx((2.0, 3.5, 5.0))
    assert qfields("ms", q, 1) == {"ms": 3.5, "ms_p20": 2.0, "ms_p80": 5.0}


def test_costgrid_judge_and_tie_line():
    from bench.costgrid import judge
    from bench.report import tie_line

    assert judge({"staged": (4.0, 5.0, 6.0), "direct": (4.5, 5.5, 6.5)}, "staged") == ("staged", 1.0, "hit")
    best, ratio, verdict = judge({"staged": (4.0, 5.0, 6.0), "direct": (3.0, 4.0, 4.5)}, "staged")
    assert (best, verdict) == ("direct", "tie") and ratio == pytest.approx(1.25)
    assert judge({"staged": (4.6, 5.0, 6.0), "direct": (3.0, 4.0, 4.5)}, "staged")[2] == "miss"
    rows = [dict(ratio=1.0, verdict="hit"), dict(ratio=1.3, verdict="tie"), dict(ratio=1.2, verdict="miss")]
    assert tie_line(rows).endswith("worst 1.20, median 1.00 over 3 cells (1 ties)")  # a miss stays a miss


def test_costgrid_sampling_alternates_and_extends_only_close_calls(monkeypatch):
    from bench import costgrid

    # a fake fetch returns the ms it "took"; the sampler's timer is replaced by that value
    monkeypatch.setattr(costgrid, "quantiles_ms", lambda fn, reps, warmup=0: (0.0, fn(), 0.0))
    calls = []

    def fetch(mode, times):
        it = iter(times)

        def fn():
            calls.append(mode)
            return next(it)
        return fn

    far = costgrid.sample_interleaved({"a": [fetch("a", [1.0] * 8)], "b": [fetch("b", [5.0] * 8)]}, reps=4, extra=4)
    assert len(far["a"]) == len(far["b"]) == 4  # clearly apart: no extra rounds
    assert calls[:4] == ["a", "b", "b", "a"]  # the order alternates between rounds
    jitter = [1.0, 1.2, 1.1, 0.9] * 2
    close = costgrid.sample_interleaved({"a": [fetch("a", jitter)], "b": [fetch("b", jitter[::-1])]}, reps=4, extra=4)
    assert len(close["a"]) == len(close["b"]) == 8  # overlapping spreads: the extra rounds ran
    rot = []
    costgrid.sample_interleaved({"a": [lambda: rot.append(0) or 1.0, lambda: rot.append(1) or 1.0]}, reps=4)
    assert rot == [0, 1, 0, 1]  # a mode's runs rotate over its connections


def test_summary_writes_one_table_per_section_that_ran(tmp_path):
    """bench/report.py formats rows only: the outputs exist and each section that ran has its heading."""
    from bench.report import write_outputs

    rows = [dict(section="descriptors", preset="p", p_tp=4, d_tp=8, block_size=16, tokens=8192, kvtriton=1,
                 kvtriton_staged=1, kvtriton_direct=0, kvtriton_staged_chunked=6, vllm_kv_packed=40960,
                 vllm_kv_separate=81920, per_token=1310720, vllm_packed_per_kvtriton=40960,
                 vllm_separate_per_kvtriton=81920),
            dict(section="planning", preset="p", p_tp=4, d_tp=8, us=9.0, us_p20=8.0, us_p80=10.0),
            dict(section="rogue", part="scenario", scenario="flood", honest_ok=True, outside_bytes_changed=0,
                 staging_leaked_slots=0, max_progress_ms=10, bad_messages=3, refused=1)]
    meta = dict(device="cpu", torch="t", git_sha="g", timestamp="ts", command="python bench/sweep.py")
    write_outputs(rows, tmp_path, meta)
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# kvtriton sweep (cpu, ts)") and "`python bench/sweep.py`" in summary
    for heading in ("## Descriptors per decode rank", "## Planning cost per request", "## Rogue peer"):
        assert heading in summary
    assert "| p | 4->8 | 16 |  | 1 |" in summary and "9.0 [8.0-10.0]" in summary
    assert "## Cost model" not in summary and "end to end" not in summary  # sections that did not run
    assert (tmp_path / "sweep.csv").read_text().startswith("section,")


def test_summary_starts_with_a_six_line_headline(tmp_path):
    """summary.md: the title, then six lines (descriptors, e2e ratio, grid verdict, real-engine
    ratio, host time, GPU or not) computed from the rows, before any table; a section that did not run says so."""
    from bench.report import HEADLINE, headline_lines, write_outputs

    base = "vLLM 0.33 direct 8 KiB K||V reads"
    cell = dict(section="costmodel", grid="small", transport="shm", p_tp=2, d_tp=4, heads_per_rank=1, block_size=16,
                layout="HND", bytes_per_descriptor=4096, chosen="staged", best="staged", chosen_ms=1.0, best_ms=1.0)
    rows = [dict(section="descriptors", preset="p", p_tp=4, d_tp=8, block_size=16, tokens=8192, kvtriton=2,
                 kvtriton_staged=2, kvtriton_direct=0, kvtriton_staged_chunked=6, vllm_kv_packed=8192,
                 vllm_kv_separate=16384, per_token=1, vllm_packed_per_kvtriton=4096, vllm_separate_per_kvtriton=8192),
            dict(section="descriptors", preset="q", p_tp=1, d_tp=2, block_size=64, tokens=8192, kvtriton=1,
                 kvtriton_staged=1, kvtriton_direct=0, kvtriton_staged_chunked=6, vllm_kv_packed=4,
                 vllm_kv_separate=8, per_token=1, vllm_packed_per_kvtriton=4, vllm_separate_per_kvtriton=8),
            dict(section="e2e", pair="p4d8", transport="shm", host="idle", ids="random", method=base, ms=10.0,
                 descriptors=4096),
            dict(section="e2e", pair="p4d8", transport="shm", host="idle", ids="random",
                 method="kvtriton staged, pull, 1 chunk(s) x 1 in flight", ms=8.0, descriptors=2),
            dict(cell, ratio=1.0, miss_beyond_noise="no"), dict(cell, ratio=1.25, miss_beyond_noise="yes"),
            dict(section="pd_vllm", connector="kvtriton", prefill_tp=2, decode_tp=1, pd_size="small", request=0,
                 kv_loaded_ms=30.0, summary="s"),
            dict(section="pd_vllm", connector="nixl", prefill_tp=2, decode_tp=1, pd_size="small", request=0,
                 kv_loaded_ms=60.0, summary="s"),
            # --full: the realistic geometry, its own cells, with NixlConnector's READ size
            dict(section="pd_vllm", connector="kvtriton", prefill_tp=1, decode_tp=2, pd_size="scaled", request=0,
                 model_kind="llama hd128", kv_loaded_ms=8.0, descriptors=2, kv_bytes=1 << 20, summary="s"),
            dict(section="pd_vllm", connector="nixl", prefill_tp=1, decode_tp=2, pd_size="scaled", request=0,
                 model_kind="llama hd128", kv_loaded_ms=20.0, descriptors=128, kv_bytes=1 << 20, summary="s"),
            dict(section="pd_vllm", connector="nixl", prefill_tp=2, decode_tp=1, pd_size="small", request=0,
                 model_kind="deepseek", kv_loaded_ms=1.0, summary="s"),  # MLA: its own table rows, not here
            dict(section="planning", preset="llama3-70b", layout="HND", tokens=8192, us=30.8),
            dict(section="planning", preset="llama3-70b", layout="HND", tokens=1024, us=29.1),
            dict(section="fetch_host", case="gqa", ratio=1.54, ratio_notif=1.41, ratio_done=1.12),  # an older row
            dict(section="fetch_host", case="mla", ratio=1.6, ratio_notif=1.3),  # older still: no floor+done
            # now: its Dones and fence after the result, their ratio to the floor+done with them
            dict(section="fetch_host", case="both", ratio=1.4, ratio_notif=1.2, ratio_done=1.1, ratio_all_done=1.3),
            dict(section="fetch_host", case="gqa", caches="cold", ratio=1.9, ratio_notif=1.5, ratio_done=1.4,
                 kvtriton_ms=1.637)]  # after a 32 MiB copy: its own clause, not judged
    meta = dict(device="cpu (2 cores, x86_64)", torch="t", git_sha="g", timestamp="ts",
                command="python bench/sweep.py", wall_s="281", section_s="descriptors 3 s", load_avg="1.0 2.0 3.0")
    head = headline_lines(rows, meta)
    assert [h.split("**")[1] for h in head] == list(HEADLINE) and len(head) == 6
    assert "4x to 4,096x" in head[0] and "over 2 preset" in head[0]
    assert "shm idle random ids: pull 0.80" in head[1] and "P4->D8" in head[1]
    assert "worst 1.25, median 1.12 over 2 cells (small grid); 1 miss(es) beyond noise; NOT met" in head[2]
    assert "small model: P2->D1 0.50x; llama hd128 model: P1->D2 0.40x (8 KiB per NixlConnector READ)" in head[3]
    assert "deepseek" not in head[3]
    assert head[4] == ("- **host time**: planning Llama-3-70B P4->D8 8k tokens HND 31 us (goal <= 50); small "
                       "zero-copy fetch to its result / raw posts gqa 1.54 (1.41 with the completion notice, 1.12 "
                       "with our Dones and fence, here and posted raw), mla 1.60 (1.30 with the completion notice), "
                       "both 1.40 (1.20 with the completion notice, 1.30 with our Dones and fence, here and posted "
                       "raw) (goal <= 1.3); the "
                       "same with the caches evicted before each fetch (as after a large READ or a forward pass): "
                       "gqa 1.90 (1.64 ms)")
    assert head[5].startswith("- **GPU**: none")
    write_outputs(rows, tmp_path, meta)
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert lines[0].startswith("# kvtriton sweep") and lines[1] == "" and lines[2:8] == head
    assert "Took 281 s" in lines[9] and "load average at the end 1.0 2.0 3.0" in lines[9]
    empty = headline_lines([], dict(device="NVIDIA H200"))
    assert [h.split(": ", 1)[1] for h in empty[:3]] == ["not run"] * 3 and "not run" in empty[3]
    assert empty[4] == "- **host time**: not run" and empty[5] == "- **GPU**: NVIDIA H200"
def test_security_cost_rows_get_their_table():
    from bench.report import summary_lines

    rows = [dict(section="security_cost", case="same-layout", variant=v, layers=1, tokens=16, mib=0.1, ms=ms,
                 ms_p20=ms, ms_p80=ms, ratio=ms / 2.0, routes="staged", digested=0)
            for v, ms in (("default", 2.0), ("staging", 3.0))]
    text = "\n".join(summary_lines(rows, dict(device="cpu", timestamp="t", command="c", torch="t", git_sha="g")))
    assert "Memory-model options" in text and "| same-layout | staging |" in text and "| 1.5 |" in text


def test_peak_memory_counts_the_children_a_bench_starts():
    """bench/memory.py: a child holding ~300 MB shows in the tree's peak (sampled by a process of
    its own, which leaves itself out), not in this process's RSS; the largest process is named."""
    import subprocess
    import time

    from bench.memory import PeakMemory, process_memory, tree

    if not Path("/proc/self/statm").exists():
        pytest.skip("no /proc: the sampler reports 'not measured' there")
    code = "import sys, time; b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); print(1, flush=True); " \
           "time.sleep(30)"
    with PeakMemory(interval_s=0.1) as mem:
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "1"  # its pages are touched now
            assert child.pid in tree(os.getpid())
            time.sleep(0.6)  # several samples while it holds them
        finally:
            child.kill()
            child.wait(timeout=10)
    fig = mem.figures()
    assert fig["tree_pss_gb"] >= 0.28 and fig["largest_rss_gb"] >= 0.28, fig
    # the child is the largest process only when this one is smaller (a whole pytest run is ~0.8 GB)
    own_rss = process_memory(os.getpid())[1]
    if own_rss < (250 << 20):
        assert "python" in fig["largest"] and "-c" in fig["largest"], fig
    else:
        assert fig["largest_rss_gb"] >= round(min(own_rss, 300 << 20) / (1 << 30), 2) - 0.01, fig


def test_sweep_reports_sections_over_budget_or_memory_goal(tmp_path):
    """Each section's own row: wall time against its budget and peak memory; an overrun is said in
    summary.md (never silent), the --full sweep has no budget."""
    from bench.report import write_outputs
    from bench.sweep import BUDGET_S, section_row

    assert sum(BUDGET_S.values()) <= 300  # the default sweep's 5-minute goal, section by section
    ok = section_row("planning", 1.0, {"tree_pss_gb": 0.3, "largest_rss_gb": 0.3, "largest": "python"}, False)
    slow = section_row("pd_vllm", BUDGET_S["pd_vllm"] + 30.0, {"tree_pss_gb": 5.0, "largest_rss_gb": 2.0,
                                                                "largest": "python -m vllm"}, False)
    full = section_row("pd_vllm", 900.0, {"tree_pss_gb": 1.0, "largest_rss_gb": 1.0, "largest": "x"}, True)
    assert ok["within"] == "yes" and not ok["note"]
    assert slow["within"] == "no" and "over its budget by 30 s" in slow["note"] and "4 GB goal" in slow["note"]
    assert full["budget_s"] is None and full["within"] == "yes"
    meta = dict(device="cpu", torch="t", git_sha="g", timestamp="ts", command="python bench/sweep.py")
    write_outputs([ok, slow], tmp_path, meta)
    summary = (tmp_path / "summary.md").read_text()
    assert "## Sections: wall time against budget, peak memory" in summary
    assert "Sections over budget or memory goal: pd_vllm" in summary
    assert "| planning | 1.0 | 5 | 0.3 | 0.3 | python |" in summary
    assert "tree_pss_gb" in (tmp_path / "sweep.csv").read_text()


def test_pd_vllm_rows_keep_model_kinds_apart(tmp_path):
    """A deepseek row at the same pair as the llama one gets its own table line (with bytes per
    request); the headline's ratio reads the llama rows only."""
    from bench.report import headline_lines, summary_lines

    def row(connector, kind, ms, desc, nbytes):
        return dict(section="pd_vllm", connector=connector, prefill_tp=2, decode_tp=1, pd_size="small",
                    model_kind=kind, request=0, ttft_ms=2 * ms, kv_loaded_ms=ms, kv_ready_ms=ms, descriptors=desc,
                    kv_bytes=nbytes, identical=True, summary=f"pd_vllm: {connector}: {kind}")

    rows = [row("kvtriton", "llama", 10.0, 2, 1000), row("nixl", "llama", 20.0, 44, 0),
            row("kvtriton", "deepseek", 90.0, 4, 5000), row("nixl", "deepseek", 30.0, 42, 0)]
    meta = dict(device="cpu", torch="t", git_sha="g", timestamp="ts", command="c")
    text = "\n".join(summary_lines(rows, meta))
    assert "| 2->1 | kvtriton | 1/1 | 10.0 |" in text and "| 2->1 deepseek | kvtriton | 1/1 | 90.0 |" in text
    assert "| 2 | 1,000 | 0.50 |" in text and "| 4 | 5,000 | 3.00 |" in text  # descriptors, bytes, ours/theirs
    assert "| 44 | n/a |" in text  # NixlConnector's byte count is not reported: n/a, not 0
    assert "P2->D1 0.50x" in headline_lines(rows, meta)[3]


def test_pd_vllm_compare_starts_the_next_engines_while_the_last_close(monkeypatch, tmp_path):
    """compare(): each run's engines close in the background while the next run's start, and are
    gone (their closer joined) before the next run measures; one model folder for all runs."""
    import threading
    import time

    from bench import pd_vllm

    events, closed = [], threading.Event()

    def fake_run(connector, p_tp, d_tp, *, before_measure, closing, model_cache, log_dir, say, **kw):
        events.append(("start", connector, model_cache))
        before_measure()
        events.append(("measure", connector, closed.is_set() or connector == "kvtriton"))
        if connector == "nixl":
            raise RuntimeError("handshake refused")  # a failing run is a result with no rows, not an abort

        def close():
            time.sleep(0.3)  # engines take a while to exit: a measure that did not wait would see them
            events.append(("closing", connector))
            closed.set()

        t = threading.Thread(target=close)
        t.start()
        closing.append(t)
        return {"rows": [], "ok": 0, "n": 0, "recomputed": 0, "summary": f"pd_vllm: {connector}: ok"}

    monkeypatch.setattr(pd_vllm, "run", fake_run)
    out = pd_vllm.compare(((2, 1),), say=lambda *a: None, log_dir=str(tmp_path))
    assert [(r["connector"], r["prefill_tp"], r["decode_tp"]) for r in out] == [("kvtriton", 2, 1), ("nixl", 2, 1)]
    assert "failed (RuntimeError: handshake refused)" in out[1]["summary"]
    assert ("measure", "nixl", True) in events  # kvtriton's engines were closed before nixl measured
    assert {e[2] for e in events if e[0] == "start"} == {str(tmp_path)}


def test_costgrid_paired_ratios_cancel_load_shared_by_a_round():
    """Two ways timed back to back per round: a load burst that slows a whole round cancels in the
    same-round ratio; the paired line names a cell whose chosen way lost in >= 80% of rounds."""
    from bench.costgrid import paired_ratios
    from bench.report import paired_line, rss_line

    load = [1.0, 3.0, 1.0, 5.0, 1.0, 2.0]  # the host's slowdown in each round
    samples = {"staged": [1.1 * x for x in load], "direct": [1.0 * x for x in load]}
    assert paired_ratios(samples, "staged", "direct") == pytest.approx([1.1] * 6)
    cell = dict(transport="shm", p_tp=4, d_tp=2, heads_per_rank=4, block_size=16, layout="HND", chosen="staged",
                best="direct", ratio=1.3, paired_ratio=1.1, paired_ratio_p20=1.05, paired_ratio_p80=1.2,
                peak_rss_gb=0.8)
    even = dict(cell, chosen="direct", paired_ratio=1.0, paired_ratio_p20=0.9, paired_ratio_p80=1.1, peak_rss_gb=1.5,
                block_size=128)
    line = paired_line([cell, even])
    assert "worst median 1.10, median 1.05 over 2 cells; chosen slower in >= 80% of rounds: 1" in line
    assert "(shm P4->D2 h4 b16 HND (staged vs direct, 1.10))" in line
    assert "1.50 GB (P4->D2 h4 b128, shm)" in rss_line([cell, even])


def test_pd_vllm_start_order():
    """Both connectors' engines start at once by default; one after the other on request, more
    ranks (the TP engine spawning workers) first."""
    from bench.pd_vllm import _start_order

    p2d1 = {"prefill": {"tp": 2}, "decode": {"tp": 1}}
    p1d2 = {"prefill": {"tp": 1}, "decode": {"tp": 2}}
    assert _start_order("kvtriton", p2d1, None) == (["prefill", "decode"], True)
    assert _start_order("nixl", p2d1, None) == (["prefill", "decode"], True)
    assert _start_order("nixl", p1d2, False) == (["decode", "prefill"], False)
    assert _start_order("kvtriton", p2d1, False)[1] is False


def test_e2e_auto_is_judged_against_the_best_of_the_same_memory():
    """Issue 36: each auto row of bench/e2e.py against every method reading the same source
    layout in the same run (kvtriton's forced ways and the raw reads of that memory), never
    against another layout's reads nor eager rows (their clock starts after the pack)."""
    from bench.report import auto_vs_best, headline_lines

    def row(method, ms, source, role, way="", host="idle"):
        return dict(section="e2e", pair="p4d8", transport="shm", host=host, ids="random", method=method, ms=ms,
                    descriptors=1, source=source, role=role, way=way)

    rows = [row("vLLM 0.33 direct 8 KiB K||V reads", 8.0, "KV", "raw"),
            row("direct 4 KiB reads, K/V separate", 12.0, "HND", "raw"),
            row("kvtriton staged, pull, 1 chunk(s) x 1 in flight", 16.0, "NHD", "way", "staged"),
            row("kvtriton staged, pull eager, 1 chunk(s) x 1 in flight", 10.0, "NHD", "eager", "staged"),
            row("kvtriton auto, pull, 1 chunk(s) x 1 in flight", 16.5, "NHD", "auto", "staged"),
            row("kvtriton auto, pull, 1 chunk(s) x 1 in flight, HND source", 15.0, "HND", "auto", "staged"),
            row("kvtriton direct_slice, pull, 1 chunk(s) x 1 in flight, HND source", 13.0, "HND", "way",
                "direct_slice"),
            row("kvtriton auto, pull, 1 chunk(s) x 1 in flight, vLLM K||V layout", 8.4, "KV", "auto",
                "direct_slice"),
            row("kvtriton auto, pull, 1 chunk(s) x 1 in flight", 99.0, "NHD", "auto", "staged", host="busy")]
    rows[4].update(ms_p20=15.5, ms_p80=17.0)  # NHD auto: its spread reaches the best's median (no p80 given)
    got = {j["source"]: (round(j["ratio"], 3), j["best_way"], j["verdict"])
           for j in auto_vs_best(rows, ("shm", "idle", "random"))}
    # NHD: the only faster row is staged forced, the way auto ran (the same work): it is the best, its gap shown
    assert got == {"NHD": (1.031, "staged", "tie"), "HND": (1.25, "direct 4 KiB reads, K/V separate", "miss"),
                   "KV": (1.05, "vLLM 0.33 direct 8 KiB K||V reads", "miss")}
    head = headline_lines(rows, dict(device="cpu"))[1]
    assert "worst 1.25, 2 miss(es) beyond noise, NOT met (goal <= 1.10)" in head
    assert "HND 1.25 (staged / direct 4 KiB reads, K/V separate, miss)" in head
    assert "NHD 1.03 (staged / staged, tie; / staged forced 1.03)" in head
    assert auto_vs_best([dict(r, source=None) for r in rows], ("shm", "idle", "random")) == []


def test_e2e_judges_auto_under_the_connectors_holds_and_shows_the_lazy_ones():
    """Issue 36: the judged `auto` of a layout is the one held as the vLLM connector holds (no
    consumer, packed ahead for the only decode engine, the decode asking at once: what a user gets),
    against every way whose clock starts at the fetch (lazy or connector holds) and the raw reads;
    the lazy auto (eager packs off) is shown beside it, judged against lazy ways and raw reads only;
    rows timed after the offer never count; rows at another block size are judged too."""
    from bench.report import auto_vs_best, headline_lines

    def row(method, ms, source, role, way="", hold=None, block=16):
        r = dict(section="e2e", pair="p4d8" if block == 16 else f"p4d8 block {block}", transport="shm",
                 host="idle", ids="random", method=method, ms=ms, descriptors=1, source=source, role=role, way=way,
                 block=block)
        return r if hold is None else dict(r, hold=hold)

    rows = [row("vLLM 0.33 direct 8 KiB K||V reads", 10.0, "KV", "raw"),
            row("kvtriton auto, pull, 1 chunk(s) x 1 in flight, vLLM K||V layout", 13.0, "KV", "auto",
                "direct_slice", "lazy"),
            row("kvtriton auto, pull connector hold, 1 chunk(s) x 1 in flight, vLLM K||V layout", 10.5, "KV", "auto",
                "direct_slice", "connector"),
            row("kvtriton staged, pull connector hold, 1 chunk(s) x 1 in flight, vLLM K||V layout", 9.0, "KV", "way",
                "staged", "connector"),
            row("kvtriton auto, pull eager, 1 chunk(s) x 1 in flight, vLLM K||V layout", 5.0, "KV", "eager",
                "direct_slice", "offered"),
            row("kvtriton staged, pull, 1 chunk(s) x 1 in flight", 20.0, "NHD", "way", "staged", "lazy"),
            row("kvtriton auto, pull, 1 chunk(s) x 1 in flight", 20.0, "NHD", "auto", "staged", "lazy"),
            row("kvtriton auto, pull connector hold, 1 chunk(s) x 1 in flight", 16.0, "NHD", "auto", "staged",
                "connector"),
            row("kvtriton staged, pull eager-guess, asked after the pack, 1 chunk(s) x 1 in flight", 8.0, "NHD",
                "eager", "staged", "offered"),
            row("vLLM 0.33 direct 8 KiB K||V reads", 10.0, "KV", "raw", block=64),
            row("kvtriton auto, pull connector hold, 1 chunk(s) x 1 in flight, vLLM K||V layout", 13.0, "KV", "auto",
                "direct_slice", "connector", block=64)]
    cfg = ("shm", "idle", "random")
    got = {j["source"]: (round(j["ratio"], 3), j["best_way"], j["hold"]) for j in auto_vs_best(rows[:9], cfg)}
    # the connector's auto against a connector way (staged packed ahead) and the raw reads; never an eager row
    assert got == {"KV": (1.167, "staged", "connector"), "NHD": (1.0, "staged", "connector")}
    faster_lazy = [dict(r, ms=15.0) if r["method"] == "kvtriton staged, pull, 1 chunk(s) x 1 in flight" else r
                   for r in rows[:9]]  # the same way under another hold is other work: named with its hold
    assert [j["best_way"] for j in auto_vs_best(faster_lazy, cfg) if j["source"] == "NHD"] == ["staged (lazy hold)"]
    lazy = {j["source"]: (round(j["ratio"], 3), j["best_way"]) for j in auto_vs_best(rows[:9], cfg, "lazy")}
    # lazy: the connector's ways are not what it could have taken
    assert lazy == {"KV": (1.3, "vLLM 0.33 direct 8 KiB K||V reads"), "NHD": (1.0, "staged")}
    head = headline_lines(rows, dict(device="cpu"))[1]
    assert "auto (the connector's holds, decode asking at once: what a user of the vLLM connector gets)" in head
    assert "worst 1.30, 2 miss(es) beyond noise, NOT met" in head  # block 64's 1.30 counts (no spreads given)
    assert "block 64: shm idle: vLLM K||V 1.30 (direct_slice / vLLM 0.33 direct 8 KiB K||V reads, miss)" in head
    assert "Not judged: auto with lazy holds (eager packs off) / best lazy way or raw reads: worst 1.30" in head


def test_costgrid_has_the_e2e_request_and_judges_the_default_model_too():
    """Issue 36: every grid size times bench/e2e.py's exact request (P4->D8, 2 -> 1 heads per rank,
    block 16, 4 layers, 8,192 tokens; K/V separate and vLLM's K||V cache), and the headline says
    what the default model (the e2e's `auto`) chose there, so the grid cannot pass while the e2e misses."""
    from bench import costgrid
    from bench.report import _headline_grid

    for size in costgrid.GRIDS:
        cells = list(costgrid._cells(size))
        assert set(costgrid.E2E_CELLS) <= set(cells)
        assert any(g == cell[:len(g)] for g in costgrid._groups(size) for cell in costgrid.E2E_CELLS)
    assert [costgrid._tokens(*c) for c in costgrid.E2E_CELLS] == [8192, 8192]
    assert costgrid._tokens(2, 4, 1, 16, "HND") == costgrid.TOKENS
    [kv] = {tuple(m.head_dims) for m in costgrid._models(8, 4, "KV")}
    assert kv == (256,) and costgrid._cache_layout("KV") == "HND"
    cell = dict(transport="shm", p_tp=4, d_tp=8, heads_per_rank=2, block_size=16, layout="HND", tokens=8192,
                chosen="direct_slice", ratio=1.0, miss_beyond_noise="no", default_chosen="staged",
                default_ratio=1.2, default_verdict="miss")
    line = _headline_grid([cell, dict(cell, layout="KV", default_chosen="direct_slice", default_ratio=1.0,
                                      default_verdict="hit")])
    assert "default model: worst 1.20, 1 miss(es)" in line
    assert "P4->D8 HND 8,192 tokens: direct_slice 1.00, default staged 1.20" in line


def test_grid_and_e2e_agreement_is_in_the_grid_headline():
    """Issue 36: the grid's e2e-shaped cells say beside the e2e's judged auto of the same layout
    which way each picked, so a grid that passes while the e2e's way differs shows DISAGREE."""
    from bench.report import grid_e2e_agreement, headline_lines

    def e2e(method, ms, source, role, way, hold):
        return dict(section="e2e", pair="p4d8", transport="shm", host="idle", ids="random", block=16,
                    method=method, ms=ms, descriptors=1, source=source, role=role, way=way, hold=hold)

    rows = [e2e("vLLM 0.33 direct 8 KiB K||V reads", 10.0, "KV", "raw", "", None),
            e2e("kvtriton auto, pull connector hold, 1 chunk(s) x 1 in flight, vLLM K||V layout", 10.5, "KV",
                "auto", "direct_slice", "connector"),
            e2e("kvtriton staged, pull connector hold, 1 chunk(s) x 1 in flight, vLLM K||V layout", 12.0, "KV",
                "way", "staged", "connector"),
            e2e("kvtriton auto, pull connector hold, 1 chunk(s) x 1 in flight, HND source", 20.0, "HND", "auto",
                "staged", "connector"),
            e2e("kvtriton direct_slice, pull, 1 chunk(s) x 1 in flight, HND source", 15.0, "HND", "way",
                "direct_slice", "lazy")]
    grid = [dict(section="costmodel", transport="shm", p_tp=4, d_tp=8, heads_per_rank=2, block_size=16, layout=lay,
                 tokens=8192, chosen=c, best=b, default_chosen=c, ratio=1.0, default_ratio=1.0)
            for lay, c, b in (("KV", "direct_slice", "direct_slice"), ("HND", "direct_slice", "direct_slice"))]
    got = {a["layout"]: (a["grid_chose"], a["e2e_ran"], a["agree"]) for a in grid_e2e_agreement(grid, rows)}
    assert got == {"KV": ("direct_slice", "direct_slice", True), "HND": ("direct_slice", "staged", False)}
    head = headline_lines(rows + grid, dict(device="cpu"))[2]
    assert "vLLM K||V shm: default model chose direct_slice (grid's fastest direct_slice) / auto ran direct_slice " \
           "(fastest kvtriton way direct_slice) agree" in head
    assert "HND shm: default model chose direct_slice" in head and "DISAGREE" in head
