"""Fault bench: engines dying and restarting under a stream of requests (issue 35, point 6).

2 prefill x 2 decode engines, TP2 each, every rank an agent in its own process over real NIXL
(UCX on 127.0.0.1; :mod:`kvtriton.testing.faults`), every decode rank meeting every prefill rank
over a kept handshake connection (its lifeline). Each decode engine fetches requests held by
either prefill engine, fresh random data per request, every loaded request checked byte-exact
(``view(torch.uint8)``) against a reference rebuilt independently from the request's seed.
Agents run with ``timeout_s`` and ``lease_s`` 30 s, so a death known in about a second is known
by liveness, not by a timeout. In order:

1. **prefill kill**: prefill rank P0:0 stops progressing (its pulls stay unanswered: they are in
   flight), a wave of requests of every pair goes out, P0:0 is SIGKILLed and the stream goes on
   to P1 for a while. Measured: kill to the typed error (p50/p99 over the fetches it failed, and
   the error types), requests lost that did not involve P0 (must be 0).
2. **prefill restart**: P0:0 started again under the same engine id, met again by every decode
   rank; seconds until it is built and met, and until a request of P0 loads byte-exact on both
   decode engines (its process start included).
3. **decode kill**: decode rank D0:1 (D0:0 at TP1) pauses once its pulls of a wave are out (the prefill ranks
   packed them into staging), is SIGKILLed, the stream goes on to D1. Measured: kill to each
   hold it was to read freed as ``consumer_lost`` (p50/p99), requests lost that did not involve
   D0 (must be 0).
4. **decode restart**: it is started again, meets every prefill rank; seconds until a request of
   each prefill engine loads byte-exact on D0.

After settling: holds, fetches in flight and staging slots still taken on every rank (all 0),
wrong bytes (0).

**On real vLLM engines** (``--vllm``, alone: the two engines' start is most of its ~2-3 min; the
vLLM test bed, ``make vllm-bed``): P1->D1 with kvtriton's connector (:mod:`beds.vllm_faults`),
lease 5 s, decode ``timeout_s`` 30 s. 2 requests queued in the decode for twice the lease: loaded,
nothing recomputed. Then a second prefill engine (nothing packed ahead) is stopped with the
decode's loads of 4 requests in flight, then SIGKILLed: kill to each load's typed end as the
decode's scheduler learned it, requests recomputed (``kv_load_failure_policy="recompute"``) with
tokens identical to the decode computing them itself, the decode engine alive and loading the
next requests from the surviving prefill.
Writes ``bench/results/faults_vllm.md``.

Reproduce: ``.venv/bin/python bench/faults.py [--small]`` (or the ``faults`` section of
bench/sweep.py, at ``--small``: TP1 engines, shorter waves and streams); writes
``bench/results/faults.md``. Exit status 1 when a survivor's request was lost, a byte was wrong,
a restarted engine did not serve or something leaked. Bounded: every wait has a deadline, every
child process is reaped on the way out; ~2 min on a loaded 2-core VM, most of it starting
processes (``--small``: ~1 min).
"""

from __future__ import annotations

if not __package__:  # `python bench/faults.py`: run as `python -m bench.faults` (bench/_as_module.py)
    import _as_module  # type: ignore[import-not-found]

    _as_module.run_as_module(__file__)

import argparse
import logging
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from bench.report import faults_summary  # bench/report.py
from kvtriton.testing.faults import BedConfig, FaultBed

HERE = Path(__file__).resolve().parent

#: requests per (prefill, decode) pair in each wave, and seconds of stream after each kill
#: (the main job's small size runs TP1 engines: half the processes to start on a 2-core box)
SIZES: dict[str, dict] = {"small": dict(tp=1, wave=2, stream_s=1.0), "default": dict(tp=2, wave=4, stream_s=3.0)}
SERVE_TIMEOUT_S = 30.0  # a restarted engine that serves nothing in this long is reported as not serving


def _quantiles(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    a = np.asarray(xs) * 1e3
    return round(float(np.percentile(a, 50)), 1), round(float(np.percentile(a, 99)), 1)


def _stream(bed: FaultBed, pairs, seconds: float) -> list:
    """One request per pair every 0.1 s for ``seconds``, outcomes collected as they come."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        reqs = [r for p, d in pairs for r in bed.new_requests(p, d, 1)]
        bed.submit(reqs)
        out += reqs
        bed.poll()
        time.sleep(0.1)
    return out


def _serves_again(bed: FaultBed, pairs, t0: float) -> float | None:
    """Seconds from ``t0`` until one request of every pair in ``pairs`` loaded byte-exact on every
    rank (retried: the first may race the meeting); None after :data:`SERVE_TIMEOUT_S`."""
    left = set(pairs)
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while left and time.monotonic() < deadline:
        reqs = [r for p, d in sorted(left) for r in bed.new_requests(p, d, 1)]
        bed.submit(reqs)
        try:
            bed.wait([r.req_id for r in reqs], timeout_s=max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            break
        left -= {(r.prefill, r.decode) for r in reqs if not bed.lost(r.req_id)}
    return None if left else round(time.monotonic() - t0, 2)


def _lost(bed: FaultBed, reqs) -> list[str]:
    return [r.req_id for r in reqs if bed.lost(r.req_id)]


def run_faults(size: str = "default", say=print) -> list[dict]:
    """Run the four steps (module docstring); one row per step."""
    sz = SIZES[size]
    cfg = BedConfig(p_engines=2, d_engines=2, tp=sz["tp"], blocks=256, timeout_s=30.0, lease_s=30.0)
    rows: list[dict] = []
    with FaultBed(cfg) as bed:
        pairs = [(p, d) for p in bed.prefills for d in bed.decodes]
        warm = [r for p, d in pairs for r in bed.new_requests(p, d, sz["wave"])]
        bed.submit(warm)
        bed.wait([r.req_id for r in warm], timeout_s=60)
        warm_lost = _lost(bed, warm)
        say(f"faults: warm-up {len(warm)} requests, lost {len(warm_lost)}")

        # 1. prefill kill
        victim = ("P0", 0)
        bed.call(victim, "pause")
        wave = [r for p, d in pairs for r in bed.new_requests(p, d, sz["wave"])]
        bed.submit(wave)
        time.sleep(0.3)
        t_kill = bed.kill(victim)
        survive_pairs = [(p, d) for p, d in pairs if p != "P0"]
        stream = _stream(bed, survive_pairs, sz["stream_s"])
        bed.wait([r.req_id for r in wave + stream], timeout_s=60)
        failed = [o for r in wave if r.prefill == "P0" for o in bed.outcomes[r.req_id].values() if not o.ok]
        p50, p99 = _quantiles([o.t_end - t_kill for o in failed])
        survivors = [r for r in wave + stream if r.prefill != "P0"]
        rows.append(dict(part="prefill kill", victim="P0:0", requests=len(wave + stream),
                         involved=sum(r.prefill == "P0" for r in wave), typed_errors=len(failed),
                         error_types=" ".join(f"{k} x{v}" for k, v in Counter(o.error for o in failed).items()),
                         error_p50_ms=p50, error_p99_ms=p99, survivors=len(survivors),
                         survivors_lost=len(_lost(bed, survivors))))
        say(f"faults: {rows[-1]}")

        # 2. prefill restart
        t0 = time.monotonic()
        met_s = bed.restart(victim)
        served = _serves_again(bed, [("P0", d) for d in bed.decodes], t0)
        rows.append(dict(part="prefill restart", victim="P0:0", restart_met_s=round(met_s, 2), serves_again_s=served,
                         first_load_after_met_s=None if served is None else round(served - met_s, 2)))
        say(f"faults: {rows[-1]}")

        # 3. decode kill
        victim = ("D0", cfg.tp - 1)
        wave = [r for p, d in pairs for r in bed.new_requests(p, d, sz["wave"])]
        bed.submit(wave, pause_after=victim)
        time.sleep(0.3)
        bed.poll()
        t_kill = bed.kill(victim)
        dead = {victim}
        survive_pairs = [(p, d) for p, d in pairs if d != "D0"]
        stream = _stream(bed, survive_pairs, sz["stream_s"])
        bed.wait([r.req_id for r in wave + stream], timeout_s=60, dead_decodes=dead)
        involved = {r.req_id for r in wave if r.decode == "D0"}
        # the holds the dead rank was to read: on the prefill ranks it reads from (equal TP: its own rank)
        readers = [k for p in bed.prefills for k in bed.ranks(p) if k[1] == victim[1]]
        deadline = time.monotonic() + 20
        freed: dict[str, tuple[str, float]] = {}
        while time.monotonic() < deadline:
            bed.poll()
            freed = {q: (why, t) for k in readers for q, why, t in bed.freed.get(k, []) if q in involved}
            if len(freed) >= len(involved):
                break
            time.sleep(0.05)
        lost_hold = [t - t_kill for why, t in freed.values() if why == "consumer_lost"]
        p50, p99 = _quantiles(lost_hold)
        survivors = [r for r in wave + stream if r.decode != "D0"]
        rows.append(dict(part="decode kill", victim=f"D0:{victim[1]}", requests=len(wave + stream),
                         involved=len(involved), holds_freed=len(freed),
                         freed_reasons=" ".join(f"{k} x{v}" for k, v in Counter(w for w, _ in freed.values()).items()),
                         freed_p50_ms=p50, freed_p99_ms=p99, survivors=len(survivors),
                         survivors_lost=len(_lost(bed, survivors))))
        say(f"faults: {rows[-1]}")

        # 4. decode restart
        t0 = time.monotonic()
        met_s = bed.restart(victim)
        served = _serves_again(bed, [(p, "D0") for p in bed.prefills], t0)
        rows.append(dict(part="decode restart", victim=f"D0:{victim[1]}", restart_met_s=round(met_s, 2),
                         serves_again_s=served,
                         first_load_after_met_s=None if served is None else round(served - met_s, 2)))
        say(f"faults: {rows[-1]}")

        # settle: leaks and wrong bytes over the whole run
        leaks = bed.leaks(timeout_s=20)
        wrong = [o.mismatch for q in bed.outcomes.values() for o in q.values() if o.mismatch]
        rows.append(dict(part="settled", requests=len(bed.requests), warmup_lost=len(warm_lost),
                         wrong_bytes_requests=len(wrong),
                         holds_left=sum(v["holds"] for v in leaks.values()),
                         fetches_left=sum(bool(v["fetches_in_flight"]) for v in leaks.values()),
                         staging_slots_left=sum(v["staging_taken"] for v in leaks.values())))
        say(f"faults: {rows[-1]}")
        for w in wrong[:3]:
            say(f"faults: wrong bytes: {w}")
    return [{"size": size, "tp": cfg.tp, **r} for r in rows]


def bad_rows(rows: list[dict]) -> list[dict]:
    """The rows that break a goal: a survivor lost, a restarted engine not serving, wrong bytes, a leak."""
    bad = [r for r in rows if r.get("survivors_lost")]
    bad += [r for r in rows if "serves_again_s" in r and r["serves_again_s"] is None]
    bad += [r for r in rows if r["part"] == "settled" and (r["warmup_lost"] or r["wrong_bytes_requests"] or
                                                           r["holds_left"] or r["fetches_left"] or
                                                           r["staging_slots_left"])]
    return bad


def run_vllm(say=print) -> dict:
    """The real-vLLM row (module docstring): one P1->D1 pair, a queued wave, then the kill."""
    import os
    import random
    import subprocess
    import tempfile

    from beds import child_env
    from beds.vllm_bed import close_all
    from beds.vllm_faults import (
        LEASE_S,
        launch_pair,
        launch_victim,
        prefill,
        prefill_killed_mid_load,
        queued_past_lease,
        reference,
    )

    python = os.environ.get("KVTRITON_VLLM_PYTHON") or str(HERE.parent / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        raise RuntimeError(f"no vLLM test bed at {python}: make vllm-bed (or set KVTRITON_VLLM_PYTHON)")
    work = Path(tempfile.mkdtemp(prefix="faults-vllm-"))
    subprocess.run([python, "-c", "import sys; from beds.vllm_bed import make_tiny_llama; make_tiny_llama(sys.argv[1])",
                    str(work / "model")], check=True, timeout=300, env=child_env(),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rng = random.Random(7)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in VLLM_LENGTHS]
    t_start = time.monotonic()
    p, d = launch_pair(python, work / "model", work)
    say(f"faults --vllm: engines up in {time.monotonic() - t_start:.0f} s (logs in {work})")
    try:
        ref = reference(d, prompts, "ref")
        q = queued_past_lease(p, d, prompts[:2], blocker=prompts[3], tag="q")
        victim = launch_victim(python, work / "model", work)
        try:
            k = prefill_killed_mid_load(victim, d, prompts, tag="k")
        finally:
            victim.kill()
        params = prefill(p, prompts[:2], "next-p")  # the decode serves on: KV from the surviving prefill
        after = d.call("generate", requests=[{"id": f"next{i}", "prompt": x, "max_tokens": 8, "kv_transfer_params": kp}
                                             for i, (x, kp) in enumerate(zip(prompts[:2], params))])["outputs"]
    finally:
        close_all([p, d])
    typed = [t for t in k["typed_s"] if t is not None]
    row = dict(part="vllm prefill kill", requests=len(prompts), lease_s=LEASE_S,
               queued_s=None if q["queued_s"] is None else round(q["queued_s"], 1),
               queued_loaded=sum(c <= 1 for c in q["prompt_computed"]), queued=len(q["prompt_computed"]),
               queued_tokens_identical=q["tokens"] == ref[:2],
               typed_min_ms=round(1e3 * min(typed)) if typed else None,
               typed_max_ms=round(1e3 * max(typed)) if typed else None, typed=len(typed),
               recomputed=sum(c == len(x) for c, x in zip(k["prompt_computed"], prompts)),
               tokens_identical=k["tokens"] == ref, decode_alive=k["decode_alive"],
               serves_after=[o["tokens"] for o in after] == ref[:2] and all(o["prompt_computed"] <= 1 for o in after),
               log=(k["log"] or [""])[0].split("WARNING")[-1][:240])
    say(f"faults --vllm: {row}")
    return row


#: prompt lengths of the real-vLLM row (as tests/engines: not multiples of the block, up to 21 blocks)
VLLM_LENGTHS = (37, 100, 333, 650)


def vllm_summary(row: dict) -> list[str]:
    """The real-vLLM row as a table, and whether it met its goals."""
    ok = not vllm_bad(row)
    return ["## Faults on real vLLM engines (bench/faults.py --vllm)", "",
            f"P1->D1 (vLLM CPU 0.32, kvtriton's connector), lease_s {row['lease_s']} s, decode timeout_s 30 s, "
            "kv_load_failure_policy recompute. Queued: decode requests waiting behind a running one (one slot) "
            "longer than the prefill's lease. Kill: a second prefill engine (nothing packed ahead: its loads wait on "
            "it) SIGSTOPped with the decode's loads in flight, then SIGKILLed; kill to each load's typed end as the "
            "decode's scheduler learned it; then the decode loads KV from the surviving prefill.", "",
            "| queued (s) | queued loaded, nothing recomputed | kill to typed end min / max (ms) | recomputed "
            "| tokens identical | decode alive, serves next | goals met |",
            "|---|---|---|---|---|---|---|",
            f"| {row['queued_s']} | {row['queued_loaded']}/{row['queued']} "
            f"| {row['typed_min_ms']} / {row['typed_max_ms']} ({row['typed']}) | {row['recomputed']}/{row['requests']} "
            f"| {row['tokens_identical'] and row['queued_tokens_identical']} "
            f"| {row['decode_alive'] and row['serves_after']} | {ok} |", "",
            f"The decode's log: `{row['log'].strip()}`", ""]


def vllm_bad(row: dict) -> bool:
    """Whether the real-vLLM row missed a goal (a typed end at 10 s is a third of timeout_s: no lifeline)."""
    return not (row["queued_loaded"] == row["queued"] and row["typed"] == row["requests"]
                and row["typed_max_ms"] is not None and row["typed_max_ms"] < 10_000
                and row["recomputed"] == row["requests"] and row["tokens_identical"]
                and row["queued_tokens_identical"] and row["decode_alive"] and row["serves_after"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="smaller waves and streams (the main job's size)")
    ap.add_argument("--vllm", action="store_true", help="only the real-vLLM row (P1->D1, one prefill kill)")
    ap.add_argument("--out", default=None, help="default: bench/results/faults.md (--vllm: faults_vllm.md)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    t0 = time.time()
    if args.vllm:
        row = run_vllm()
        out = Path(args.out or HERE / "results" / "faults_vllm.md")
        out.parent.mkdir(parents=True, exist_ok=True)
        lines = vllm_summary(row)
        out.write_text("\n".join(["# kvtriton fault bench, real vLLM engines", "",
                                  f"Reproduce: `.venv/bin/python bench/faults.py --vllm` ({time.time() - t0:.0f} s, "
                                  f"cpu, torch {torch.__version__}).", ""] + lines))
        print("\n".join(lines))
        print(f"wrote {out}")
        return 1 if vllm_bad(row) else 0
    size = "small" if args.small else "default"
    rows = run_faults(size)
    out = Path(args.out or HERE / "results" / "faults.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = "bench/faults.py" + (" --small" if args.small else "")
    out.write_text("\n".join(["# kvtriton fault bench", "",
                              f"Reproduce: `.venv/bin/python {cmd}` ({time.time() - t0:.0f} s, cpu, "
                              f"torch {torch.__version__}).", ""] + faults_summary(rows)))
    print("\n".join(faults_summary(rows)))
    print(f"wrote {out}")
    return 1 if bad_rows(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
