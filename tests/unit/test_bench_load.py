"""The real-engine load cells' bookkeeping (bench/pd_vllm_load.py) and how the sweep reports them:
percentiles, mixed prompt lengths, the ours/theirs table, the sweep's rows and headline. No engines."""

import random


def test_pct_is_nearest_rank():
    from bench.pd_vllm_load import pct

    values = [5.0, 1.0, None, 3.0, 2.0, 4.0]  # None: not measured, left out
    assert pct(values, 50) == 3.0
    assert pct(values, 99) == 5.0  # with 5 values the p99 is the slowest
    assert pct(values, 0) == 1.0
    assert pct([None], 50) is None
    big = list(range(1, 201))
    assert pct(big, 99) == 198  # nearest rank: ceil(0.99 * 200)


def test_cells_and_mixed_prompts():
    from bench.pd_vllm_load import cells_from, load_prompts

    assert cells_from((8, 32)) == [{"in_flight": 8}, {"in_flight": 32}]
    # a count given again is another run of it, its own row (else the table kept the last run only and
    # set it against the other connector's other run)
    assert cells_from((8, 8, 32)) == [{"in_flight": 8}, {"in_flight": 8, "repeat": 1}, {"in_flight": 32}]
    assert cells_from((), rate=20, rate_count=16) == [{"rate": 20.0, "in_flight": 16}]
    prompts = load_prompts(random.Random(1), 8, 333, 64, 512)
    lengths = [len(p) for p in prompts]
    assert len(set(lengths)) == 8  # mixed, none block-aligned twice
    assert min(lengths) >= 83 and max(lengths) <= 666 + 63
    assert all(0 <= t < 512 for p in prompts for t in p)
    assert load_prompts(random.Random(1), 8, 333, 64, 512) == prompts  # seeded: both connectors get these


def _cell(n, kv50, kv99, tt50, tt99, ok=None):
    return {"in_flight": n, "rate": None, "ok": n if ok is None else ok, "n": n, "recomputed": 0,
            "kv_loaded_ms_p50": kv50, "kv_loaded_ms_p99": kv99, "kv_ready_ms_p50": kv50 + 1,
            "kv_ready_ms_p99": kv99 + 1, "ttft_ms_p50": tt50, "ttft_ms_p99": tt99, "step_base_ms": 2.0,
            "step_loading_ms_p50": 3.0, "step_loading_ms_p99": 4.0, "summary": "s"}


def test_load_table_ratios():
    from bench.report import load_table

    results = [{"connector": "kvtriton", "prefill_tp": 2, "decode_tp": 1, "block_size": 64,
                "load": [_cell(8, 5.0, 20.0, 10.0, 40.0)]},
               {"connector": "nixl", "prefill_tp": 2, "decode_tp": 1, "block_size": 64,
                "load": [_cell(8, 10.0, 10.0, 20.0, 20.0)]}]
    lines = load_table(results)
    ours = next(x for x in lines if "| kvtriton |" in x)
    assert "| 0.50 / 2.00 | 0.50 / 2.00 |" in ours  # p50 ours/theirs, p99 ours/theirs
    assert "| 2->1 | 64 | 8 in flight |" in ours
    theirs = next(x for x in lines if "| nixl |" in x)
    assert theirs.endswith("|  |  |")
    # two runs of one cell: each its own row, each against the other connector's same run
    results[0]["load"].append({**_cell(8, 30.0, 30.0, 30.0, 30.0), "repeat": 1})
    results[1]["load"].append({**_cell(8, 15.0, 15.0, 15.0, 15.0), "repeat": 1})
    lines = load_table(results)
    ours = [x for x in lines if "| kvtriton |" in x]
    assert len(ours) == 2 and "| 0.50 / 2.00 |" in ours[0] and "| 8 in flight (run 2) |" in ours[1]
    assert "| 2.00 / 2.00 | 2.00 / 2.00 |" in ours[1]


def test_sweep_rows_reach_summary_and_headline():
    from bench.report import headline_lines, summary_lines
    from bench.sweep import load_row

    rows = []
    for conn, cell in (("kvtriton", _cell(8, 5.0, 20.0, 10.0, 40.0, ok=7)), ("nixl", _cell(8, 10.0, 10.0, 20.0, 20.0))):
        key = {"section": "pd_vllm", "connector": conn, "prefill_tp": 2, "decode_tp": 1, "pd_size": "small",
               "model_kind": "llama", "block_size": 64, "model": "m"}
        rows.append({**key, "request": 0, "ttft_ms": 3.0, "kv_loaded_ms": 2.0 if conn == "kvtriton" else 4.0,
                     "kv_ready_ms": 2.5, "identical": True, "prompt_computed": 1, "descriptors": 4, "kv_bytes": 100,
                     "summary": "x"})
        rows.append(load_row(key, cell))
    head = next(x for x in headline_lines(rows, {}) if x.startswith("- **real engines**"))
    assert "block 64" in head and "P2->D1 0.50x" in head
    assert "8 in flight KV loaded p50 0.50x p99 2.00x, TTFT p50 0.50x p99 2.00x (7/8 identical)" in head
    meta = {"command": "c", "device": "cpu", "timestamp": "t", "torch": "2", "git_sha": "g"}
    text = "\n".join(summary_lines(rows, meta))
    assert "| 2->1 | 64 | 8 in flight | kvtriton | 7/8 | 0 |" in text
    assert "| 2->1 | kvtriton | 1/1 |" in text  # the one-at-a-time table counts no load row


def test_two_blocks_of_one_model_stay_apart_in_headline_and_tables():
    """The default sweep runs the small model at blocks 16 and 64 (one engine pair each): each block
    gets its own headline cell, one-at-a-time rows and load rows, its ratio from its own rows."""
    from bench.report import headline_lines, summary_lines
    from bench.sweep import load_row

    rows = []
    for block, ours in ((16, 3.0), (64, 1.0)):
        for conn in ("kvtriton", "nixl"):
            key = {"section": "pd_vllm", "connector": conn, "prefill_tp": 2, "decode_tp": 1, "pd_size": "small",
                   "model_kind": "llama", "block_size": block, "model": "m"}
            rows.append({**key, "request": 0, "ttft_ms": 3.0, "kv_loaded_ms": ours if conn == "kvtriton" else 4.0,
                         "kv_ready_ms": 2.5, "identical": True, "prompt_computed": 1, "descriptors": 4,
                         "kv_bytes": 100, "summary": f"{conn} {block}"})
            rows.append(load_row(key, _cell(8, ours, 20.0, 10.0, 40.0) if conn == "kvtriton"
                                 else _cell(8, 4.0, 10.0, 20.0, 20.0)))
    head = next(x for x in headline_lines(rows, {}) if x.startswith("- **real engines**"))
    b16, b64 = head.split("; small model block 64: ")
    assert "small model block 16: P2->D1 0.75x" in b16 and "8 in flight KV loaded p50 0.75x" in b16
    assert b64.startswith("P2->D1 0.25x") and "8 in flight KV loaded p50 0.25x" in b64
    meta = {"command": "c", "device": "cpu", "timestamp": "t", "torch": "2", "git_sha": "g"}
    text = "\n".join(summary_lines(rows, meta))
    assert "block 16 and 64" in text
    assert "| 2->1 block 16 | kvtriton | 1/1 | 3.0 |" in text and "| 2->1 block 64 | kvtriton | 1/1 | 1.0 |" in text
    assert "| 2->1 | 16 | 8 in flight | kvtriton |" in text and "| 2->1 | 64 | 8 in flight | kvtriton |" in text


def test_headline_takes_each_connectors_median_run_of_a_cell():
    """The sweep runs each load cell three times: the headline sets each connector's median run of each
    figure against the other's (one stall decided a single run: 81x), the table keeps every run."""
    from bench.pd_vllm_load import cells_from
    from bench.report import headline_lines, summary_lines
    from bench.sweep import PD_LOAD_SMALL, load_row

    cells = cells_from(**PD_LOAD_SMALL)
    assert [c["in_flight"] for c in cells] == [8, 32, 8, 32, 8, 32]  # alternated
    assert [c.get("repeat", 0) for c in cells if c["in_flight"] == 8] == [0, 1, 2]
    rows = []
    runs = {"kvtriton": (5.0, 530.0, 6.0), "nixl": (10.0, 12.0, 8.0)}  # ours stalled once
    for conn, kvs in runs.items():
        key = {"section": "pd_vllm", "connector": conn, "prefill_tp": 2, "decode_tp": 1, "pd_size": "small",
               "model_kind": "llama", "block_size": 16, "model": "m"}
        rows.append({**key, "request": 0, "ttft_ms": 3.0, "kv_loaded_ms": 2.0, "kv_ready_ms": 2.5,
                     "identical": True, "prompt_computed": 1, "descriptors": 4, "kv_bytes": 100, "summary": "x"})
        for k, kv in enumerate(kvs):
            rows.append(load_row(key, {**_cell(8, kv, kv, 2 * kv, 2 * kv), **({"repeat": k} if k else {})}))
    head = next(x for x in headline_lines(rows, {}) if x.startswith("- **real engines**"))
    # medians 6.0 against 10.0 (not the last run's 6/8, nor the stall's 530/12)
    assert "8 in flight, median of 3 runs, KV loaded p50 0.60x p99 0.60x, TTFT p50 0.60x p99 0.60x " \
           "(24/24 identical)" in head
    meta = {"command": "c", "device": "cpu", "timestamp": "t", "torch": "2", "git_sha": "g"}
    text = "\n".join(summary_lines(rows, meta))
    assert "| 2->1 | 16 | 8 in flight (run 2) | kvtriton | 8/8 | 0 | 530.0 / 530.0 |" in text
    assert "| 2->1 | 16 | 8 in flight (run 3) | nixl |" in text
