"""A decode step of N loads P2->D1 over real NIXL, agents on their own threads as in the vLLM
connector, the prefill's agent progressing every ``--source-interval`` seconds (a prefill process
scheduled late): what each load of the step waits (issue 36 point 2).

    .venv/bin/python bench/step_loads.py --source-interval 0.5            # fetches issued in a batch
    .venv/bin/python bench/step_loads.py --source-interval 0.5 --no-batch  # as before the fix
    .venv/bin/python bench/step_loads.py --steps 8 [--no-nixl-thread]      # loads of 8 steps, 10 ms apart

Each round: every prefill rank holds N requests (mixed lengths, block 64, named consumer, so
they are offered), the decode receives the offers, then issues the N fetches at once (inside
``TransferAgent.batch()`` unless ``--no-batch``) and reports when each finished. Round 0 also
wires UCX up (its first READs wait for the prefill). Timing only: the bytes are checked by
tests/agent/test_step_loads.py.

``--steps K``: the N loads are issued over K decode steps ``--step-ms`` apart (a batch each), as
under a steady arrival rate: the loads of a step after the first go out after earlier loads'
RunsDone/Done reached the prefill, so their READs' flush waits for the prefill's worker to
progress (:mod:`kvtriton.transport.progress`). Each load is timed from its own step.
``--no-nixl-thread``: every agent without NIXL's progress thread (progress from Python only,
kvtriton's default before issue 36's cross-step fix).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import numpy as np
import torch

from kvtriton.testing.oracle import RegionModel
from kvtriton.testing.pair import EnginePair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--source-interval", type=float, default=0.5, help="prefill agent's progress interval (s)")
    ap.add_argument("--no-batch", action="store_true", help="issue the fetches without TransferAgent.batch()")
    ap.add_argument("--layout", default="HND", help="both engines' cache layout (HND: the vLLM bed's DIRECT reads)")
    ap.add_argument("--steps", type=int, default=1, help="decode steps the loads are issued over")
    ap.add_argument("--step-ms", type=float, default=10.0, help="time between two steps (ms)")
    ap.add_argument("--no-nixl-thread", action="store_true", help="agents without NIXL's progress thread")
    a = ap.parse_args()
    if a.no_nixl_thread:
        os.environ["KVTRITON_NIXL_PROGRESS_THREAD"] = "0"
    models = [RegionModel.gqa("l0", 2, 32, torch.float32), RegionModel.gqa("l1", 2, 32, torch.float32)]
    e = EnginePair(2, 1, models=models, block_size=64, p_blocks=512, d_blocks=512, p_layout=a.layout,
                   d_layout=a.layout, p_storage="separate", d_storage="separate", staging_bytes=64 << 20,
                   slot_bytes=4096, timeout_s=30.0)
    rng = np.random.default_rng(1)
    lengths = [-(-int(333 * f) // 64) for f in (0.25, 0.5, 1, 2)]  # the bed's prompts, in blocks of 64
    src_perm, dst_perm = rng.permutation(512), rng.permutation(512)
    reqs, used = [], 0
    for i in range(a.loads):
        n = lengths[i % 4]
        reqs.append((f"r{i}", src_perm[used:used + n], dst_perm[used:used + n]))
        used += n
    for _, s, _ in reqs:
        e.request(s)
    for p in e.pa:
        p.start(a.source_interval)
    d = e.da[0]
    d.start(0.001)

    def pump(seconds: float) -> None:  # the engine thread's own progress calls, one per 2 ms step
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            d.progress(wait=False)
            time.sleep(0.002)

    try:
        for rnd in range(a.rounds):
            for p in e.pa:
                for r, s, _ in reqs:
                    p.hold(f"{rnd}-{r}", s, consumer="D", lease_s=60)
            # the offers arrive and the last round's fences land; the prefill's next progress
            # comes at a random point of its interval after the step
            pump((2 + rng.uniform()) * a.source_interval + 0.1)
            t0 = time.monotonic()
            issued: dict[str, float] = {}
            done: dict[str, float] = {}

            def collect() -> None:
                d.progress(wait=False)
                for res in d.results():
                    if not res.ok:
                        raise SystemExit(f"{res.req_id}: {res.error}")
                    done[res.req_id] = time.monotonic() - issued[res.req_id]

            per_step = -(-a.loads // a.steps)
            for k in range(0, a.loads, per_step):
                step_end = time.monotonic() + a.step_ms / 1e3
                with contextlib.nullcontext() if a.no_batch else d.batch():
                    for r, s, dst in reqs[k:k + per_step]:
                        issued[f"{rnd}-{r}"] = time.monotonic()
                        d.fetch(f"{rnd}-{r}", "P", s, dst)
                while time.monotonic() < step_end:  # the step's forward; its progress() calls
                    collect()
                    time.sleep(0.002)
            while len(done) < a.loads and time.monotonic() - t0 < 60:
                collect()
                time.sleep(0.002)
            ms = np.sort(np.array(list(done.values()))) * 1e3
            late = int((ms > a.step_ms + 40).sum())
            print(f"round {rnd}: {len(ms)} loads over {a.steps} steps, first {ms[0]:.1f} ms, p50 {np.median(ms):.1f} "
                  f"ms, last {ms[-1]:.1f} ms, {late} over {a.step_ms + 40:.0f} ms (offers taken "
                  f"{d.stats['offers_taken']}, NIXL thread {d.transport.progress_thread})", flush=True)
    finally:
        e.close()


if __name__ == "__main__":
    main()
