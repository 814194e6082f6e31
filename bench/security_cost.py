"""What the memory-model options cost: one request end to end, each option against the default.

Two processes over NIXL (UCX on 127.0.0.1): the prefill rank in a child process
(:mod:`kvtriton.testing.child`), the decode rank here. Llama-like layers (8 KV heads, head_dim
128, bf16, K and V separate, 16-token blocks), P1 -> D1, cut down to ``--layers`` layers and
``--tokens`` tokens so it fits a 2-core machine. Variants, every one its own pair of agents,
timed in the same run, interleaved rep by rep:

* ``default``: ``register="all"``, ``integrity=False``;
* ``staging``: ``register="staging"`` (only staging registered; every region STAGED);
* ``integrity``: ``integrity=True`` (blake2b of each chunk after pack and before unpack;
  every region STAGED);
* ``staging+integrity``: both.

Cases: ``same-layout`` (HND on both sides: the default reads whole blocks DIRECT from the
source's cache, zero-copy, so the STAGED options add a pack and an unpack pass) and
``relayout`` (NHD prefill, HND decode: the default region route is STAGED, and its cost model
may pick the one-sided ``pack_place`` way, READ straight into the cache blocks with no unpack,
which both options rule out). Timed from ``fetch`` to its result, the hold
placed before the clock starts; no eager packing (``eager_bytes=0``), so every variant packs
after the pull. Each variant's bytes are checked against the oracle once. Ratios are p50 over
the default's p50, same case, same run.

Run alone: ``python bench/security_cost.py [--layers 4] [--tokens 1024] [--reps 7]``.
"""

from __future__ import annotations

if not __package__:  # `python bench/security_cost.py`: run as `python -m bench.security_cost` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import argparse
import time

import numpy as np
import torch

from bench.timing import quantiles_of  # bench/timing.py

HEADS, HEAD_DIM, BLOCK = 8, 128, 16
VARIANTS = {"default": {}, "staging": {"register": "staging"}, "integrity": {"integrity": True},
            "staging+integrity": {"register": "staging", "integrity": True}}
CASES = {"same-layout": ("HND", "HND"), "relayout": ("NHD", "HND")}
SEED = 18


def _models(layers: int):
    from kvtriton.testing.oracle import RegionModel

    return [RegionModel.gqa(f"layer.{i}", HEADS, HEAD_DIM) for i in range(layers)]


def _agent_kw(nbytes: int) -> dict:
    # staging: a quarter of a request per chunk (four chunks, two in flight), same on both sides
    slot = 256 << 10
    pool = max(4 * slot, -(-nbytes // slot) * slot)
    return dict(staging_bytes=pool, slot_bytes=slot, timeout_s=60.0, impl="torch", eager_bytes=0)


def _source_regions(case: str, layers: int, blocks: int, variant_index: int):
    """The prefill cache of one (case, variant), and the global KV loaded into blocks 0..n-1:
    rebuilt identically in both processes (same seed), so the parent knows the bytes."""
    from kvtriton.testing.oracle import load_source, make_global_kv, make_rank_regions

    gen = torch.Generator().manual_seed(SEED + 97 * variant_index + (0 if case == "same-layout" else 7))
    models = _models(layers)
    regs = make_rank_regions(models, 0, 1, blocks, BLOCK, layout=CASES[case][0], gen=gen)
    kv = make_global_kv(models, blocks, BLOCK, gen)
    load_source(regs, 0, 1, kv, np.arange(blocks))
    return regs, kv


def _prefill(conn, case: str, layers: int, blocks: int, nbytes: int) -> None:
    from kvtriton.agent import TransferAgent
    from kvtriton.testing.child import AgentChild

    agents = {}
    for i, (name, kw) in enumerate(VARIANTS.items()):
        regs, _ = _source_regions(case, layers, blocks, i)
        agents[name] = TransferAgent(f"P-{name}", 0, 1, regs, **_agent_kw(nbytes), **kw)

    def hold(name, req, ids):
        agents[name].hold(req, np.asarray(ids), lease_s=60.0)

    child = AgentChild(conn, agents.values(), {
        "add_remote": lambda name, md: agents[name].add_remote(md),
        "hold": hold,
    }, busy_sleep_s=0.0)
    child.ready({name: a.metadata() for name, a in agents.items()})
    child.run()


def run_security_cost(layers: int = 4, tokens: int = 1024, reps: int = 7, cases=tuple(CASES)) -> list[dict]:
    """One row per (case, variant): p20/p50/p80 ms from fetch to result, the ratio of p50 to the
    default's, and the plan's routes. Every variant's result is checked byte for byte once."""
    from kvtriton.agent import TransferAgent
    from kvtriton.testing.child import ChildProcess
    from kvtriton.testing.oracle import check_destination, make_rank_regions

    blocks = -(-tokens // BLOCK)
    nbytes = layers * 2 * blocks * BLOCK * HEADS * HEAD_DIM * 2
    rows = []
    for case in cases:
        with ChildProcess(_prefill, case, layers, blocks, nbytes, name=f"security-P-{case}") as child:
            mds = child.ready(timeout_s=300)
            decodes, kvs = {}, {}
            for i, (name, kw) in enumerate(VARIANTS.items()):
                gen = torch.Generator().manual_seed(SEED + 1000 + i)
                regs = make_rank_regions(_models(layers), 0, 1, blocks, BLOCK, layout=CASES[case][1], gen=gen)
                d = decodes[name] = TransferAgent(f"D-{name}", 0, 1, regs, **_agent_kw(nbytes), **kw)
                d.add_remote(mds[name])
                child.call("add_remote", name, d.metadata())
                kvs[name] = _source_regions(case, layers, blocks, i)[1]
            times: dict[str, list[float]] = {name: [] for name in VARIANTS}
            ids = np.arange(blocks)
            try:
                for rep in range(reps + 1):  # rep 0 warms up (first touch, connection) and is checked
                    for name, d in decodes.items():
                        req = f"r{rep}"
                        child.call("hold", name, req, ids.tolist())
                        t0 = time.perf_counter()
                        d.fetch(req, f"P-{name}", ids, ids)
                        res = _wait(d, 120.0)
                        dt = (time.perf_counter() - t0) * 1e3
                        if not res.ok:
                            raise RuntimeError(f"{case} {name}: {res.error}")
                        if rep == 0:
                            check_destination(d.regions, 0, 1, kvs[name], ids)
                        else:
                            times[name].append(dt)
                base = quantiles_of(times["default"])[1]
                for name, d in decodes.items():
                    q = quantiles_of(times[name])
                    plan = d.plan_for(f"P-{name}")
                    rows.append(dict(section="security_cost", case=case, variant=name, layers=layers, tokens=tokens,
                                     mib=round(nbytes / 2**20, 1), ms=round(q[1], 2), ms_p20=round(q[0], 2),
                                     ms_p80=round(q[2], 2), ratio=round(q[1] / base, 2),
                                     routes="+".join(sorted({r.value for r in plan.routes})),
                                     path=_path(d.stats), digested=d.stats["digested_chunks"]))
            finally:
                for d in decodes.values():
                    d.close()
    return rows


def _path(stats: dict) -> str:
    """How the bytes moved, from the decode's counters: zero-copy DIRECT runs, a one-sided way
    (pack_place here: the READ lands in the cache, no unpack) or pack-READ-unpack."""
    if stats["direct_descriptors"]:
        return "direct"
    return "one-sided" if stats["one_sided_descriptors"] else "staged"


def _wait(agent, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        agent.progress()
        got = agent.results()
        if got:
            return got[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no result within {timeout_s} s")


def format_rows(rows: list[dict]) -> str:
    out = ["| case | variant | path | MiB | ms p50 (p20-p80) | / default |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['case']} | {r['variant']} | {r['path']} | {r['mib']} | {r['ms']:.1f} "
                   f"({r['ms_p20']:.1f}-{r['ms_p80']:.1f}) | {r['ratio']:.2f}x |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--case", choices=list(CASES), action="append")
    a = ap.parse_args()
    rows = run_security_cost(a.layers, a.tokens, a.reps, tuple(a.case or CASES))
    print(format_rows(rows))


if __name__ == "__main__":
    main()
