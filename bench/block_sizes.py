"""Block-size change rows of the sweep: prefill and decode engines with different block sizes.

Llama-3-70B-like geometry (8 KV heads, head_dim 128, bf16, K/V separate; layers cut down to fit
the machine), prefill TP4 (NHD) -> decode TP8 (HND), one 8192-token request. Each block-size
change (16 -> 64 and 64 -> 16) is timed against the same transfer with equal block sizes (the
destination's, so the staged payload is the same tiles and bytes: only the source paging
changes), in the same process, and reported as a ratio (goal: within 1.2x):

* :func:`kernel_rows` (sweep section ``kernels``): source rank 0's pack for every destination it
  serves, destination rank 0's unpack, one launch each; kvtriton's Triton kernels on CUDA, the
  torch path on CPU (the Triton interpreter is no speed measurement).
* :func:`e2e_rows` (sweep section ``e2e``): one request end to end through two TransferAgents in
  two processes over NIXL (UCX on 127.0.0.1), pull, one chunk, checked byte for byte per token.

Descriptors are the READs decode rank 0 posts; a block-size change stays one per (source,
chunk). Run alone: ``python bench/block_sizes.py [--quick]``.

* :func:`cpu_cache_rows` (section ``cpu_cache``, this script only): vLLM's CPU-build cache (one
  K‖V stream per layer, K dim-major per (block, head) tile, ``RegionSpec.dim_major``), prefill
  TP2 -> decode TP1 at 32 -> 64 and 64 -> 32, torch path, against equal block sizes of the same
  cache and against the same remap of a token-major cache of equal geometry.
"""

from __future__ import annotations

if not __package__:  # `python bench/block_sizes.py`: run as `python -m bench.block_sizes` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import argparse
import os
import time

import numpy as np

HEADS, HEAD_DIM, P_TP, D_TP, TOKENS = 8, 128, 4, 8, 8192
PAIRS = ((16, 64), (64, 64), (64, 16), (16, 16))  # (prefill, decode) block sizes; equal = baselines


def _models(layers: int):
    import torch

    from kvtriton.testing.oracle import RegionModel

    return [RegionModel.gqa(f"layers.{i}", HEADS, HEAD_DIM, torch.bfloat16) for i in range(layers)]


def _ids(n: int, num_blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(num_blocks)[:n].astype(np.int64)


def _ratios(rows: list[dict], key: str) -> None:
    by = {(r["src_block"], r["dst_block"], r.get("op", "")): r for r in rows}
    for r in rows:
        base = by.get((r["dst_block"], r["dst_block"], r.get("op", "")))
        if base is not None and r["src_block"] != r["dst_block"] and base[key]:
            r["vs_equal_blocks"] = round(r[key] / base[key], 2)


# --------------------------------------------------------------------------- kernels
def kernel_rows(device: str = "cpu", quick: bool = False, layers: int | None = None) -> list[dict]:
    """Pack and unpack times of each block-size pair (see the module docstring)."""
    import torch

    from kvtriton import ops
    from kvtriton.plan import build_plan, compact_request, compact_tokens, staged_descriptor_count
    from kvtriton.testing.oracle import make_rank_regions

    layers = layers or (4 if quick else 8)
    impl = "triton" if device == "cuda" else "torch"
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # one thread: on a small shared box a second one mostly adds noise
    models = _models(layers)
    cases = []
    for bs, bd in PAIRS:
        gen = torch.Generator().manual_seed(0)
        ns, nd = TOKENS // bs, TOKENS // bd
        src = make_rank_regions(models, 0, P_TP, ns + 8, bs, layout="NHD", gen=gen, device=device)
        dst = make_rank_regions(models, 0, D_TP, nd + 8, bd, layout="HND", gen=gen, device=device)
        src_ids, dst_ids = _ids(ns, ns + 8, 1), _ids(nd, nd + 8, 2)
        dst_specs = [[r.spec for r in make_rank_regions(models, d, D_TP, nd + 8, bd, layout="HND", gen=gen,
                                                       device="meta")] for d in range(D_TP)]
        src_specs = [r.spec for r in src]
        plans = [build_plan(d, D_TP, dst_specs[d], P_TP, src_specs) for d in range(D_TP)]
        if bs != bd:
            m = compact_tokens(src_ids, dst_ids, ns + 8, nd + 8, bs, bd, TOKENS)
            n, kw = m.num_tiles, dict(tiles=m.tiles, num_tokens=m.num_tokens)
            p_ids, u_ids = m.src_ids, m.dst_ids
        else:
            p_ids, u_ids = compact_request(src_ids, dst_ids, ns + 8, nd + 8)
            n, kw = p_ids.size, {}
        segs, offs, base = [], [], 0
        for plan in plans:  # source rank 0 packs for every destination it serves, in one launch
            read = plan.payload(0)
            if read is not None:
                segs += read.segments
                offs += read.segment_offsets(n, base).tolist()
                base += read.payload_bytes(n)
        staging = torch.zeros(base, dtype=torch.uint8, device=device)
        p_t, u_t = torch.as_tensor(p_ids, device=device), torch.as_tensor(u_ids, device=device)
        read0 = plans[0].staged[0]
        segs, offs = tuple(segs), np.asarray(offs)
        u_offs = read0.segment_offsets(n)
        ops_ = {
            "pack": (lambda src=src, segs=segs, offs=offs, p_t=p_t, staging=staging, kw=kw:
                     ops.pack(src, segs, offs, p_t, staging, impl=impl, **kw), base),
            "unpack": (lambda dst=dst, read0=read0, u_offs=u_offs, u_t=u_t, staging=staging, kw=kw:
                       ops.unpack(dst, read0.segments, u_offs, u_t, staging, impl=impl, **kw), read0.payload_bytes(n)),
        }
        cases.append((bs, bd, ops_, staged_descriptor_count(plans[0], n)))
    # rounds interleave the cases, so that a neighbour's load on a shared machine hits all alike
    times = {(bs, bd, op): [] for bs, bd, o, _ in cases for op in o}
    for _ in range(3 if quick else 7):
        for bs, bd, o, _ in cases:
            for op, (fn, _) in o.items():
                times[(bs, bd, op)].append(_time_ms(fn, device, quick=True))
    rows = []
    for bs, bd, o, descs in cases:
        for op, (_, nbytes) in o.items():
            ms = float(np.median(times[(bs, bd, op)]))
            rows.append(dict(case=f"llama3-70b-like ({layers} layers) P4->D8 block {bs}->{bd}, {TOKENS} tokens",
                             op=op, provider=f"kvtriton ({impl})", src_block=bs, dst_block=bd, bytes=2 * nbytes,
                             ms=round(ms, 3), gbps=round(2 * nbytes / ms / 1e6, 2), descriptors=descs))
    torch.set_num_threads(threads)
    _ratios(rows, "ms")
    for r in rows:
        r["note"] = (f"{r['vs_equal_blocks']}x the time of equal blocks ({r['dst_block']}->{r['dst_block']})"
                     if "vs_equal_blocks" in r else "baseline: equal block sizes")
    return rows


def _time_ms(fn, device: str, quick: bool) -> float:
    if device == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, warmup=10, rep=30 if quick else 100, return_mode="median"))
    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


# --------------------------------------------------------------------------- end to end
def _prefill(conn, layers: int, chunk: int) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(1)
    from kvtriton.agent import TransferAgent
    from kvtriton.testing.child import AgentChild
    from kvtriton.testing.oracle import load_source_tokens, make_global_tokens, make_rank_regions

    models = _models(layers)
    agents = {}
    for bs in sorted({p for p, _ in PAIRS}):
        regions = make_rank_regions(models, 0, P_TP, TOKENS // bs + 8, bs, layout="NHD",
                                    gen=torch.Generator().manual_seed(bs))
        load_source_tokens(regions, 0, P_TP, make_global_tokens(models, TOKENS, torch.Generator().manual_seed(7)),
                           _ids(TOKENS // bs, TOKENS // bs + 8, bs))
        agents[bs] = TransferAgent(f"P{bs}", 0, P_TP, regions, staging_bytes=chunk, slot_bytes=256 << 10,
                                   chunk_bytes=chunk, impl="torch", timeout_s=60)

    def add_remote(mds) -> None:
        for a in agents.values():
            for md in mds:
                a.add_remote(md)

    def hold(req, bs) -> None:
        agents[bs].hold(req, _ids(TOKENS // bs, TOKENS // bs + 8, bs), lease_s=120)

    child = AgentChild(conn, agents.values(), {"add_remote": add_remote, "hold": hold}, idle_wait_s=0.0005)
    child.ready({bs: a.metadata() for bs, a in agents.items()})
    child.run()


def e2e_rows(quick: bool = False, layers: int | None = None) -> list[dict]:
    """One request end to end per block-size pair (see the module docstring)."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from kvtriton.agent import TransferAgent
    from kvtriton.plan import ceil_div
    from kvtriton.testing.child import ChildProcess
    from kvtriton.testing.oracle import check_destination_tokens, make_global_tokens, make_rank_regions, snapshot

    layers = layers or (4 if quick else 16)
    reps = 3 if quick else 5
    models = _models(layers)
    payload = layers * 2 * TOKENS * HEAD_DIM * 2  # decode rank 0: one head of every layer, K and V
    chunk = ceil_div(payload, 256 << 10) * (256 << 10)
    prefill = ChildProcess(_prefill, layers, chunk, name="prefill")
    agents: dict = {}
    rows: list[dict] = []
    try:
        p_md = prefill.ready(120)
        regions = {}
        for bd in sorted({d for _, d in PAIRS}):
            regions[bd] = make_rank_regions(models, 0, D_TP, TOKENS // bd + 8, bd, layout="HND",
                                            gen=torch.Generator().manual_seed(100 + bd))
            agents[bd] = TransferAgent(f"D{bd}", 0, D_TP, regions[bd], staging_bytes=chunk, slot_bytes=256 << 10,
                                       chunk_bytes=chunk, impl="torch", timeout_s=60)
            for md in p_md.values():
                agents[bd].add_remote(md)
        prefill.call("add_remote", [a.metadata() for a in agents.values()], timeout_s=None)
        tokens = make_global_tokens(models, TOKENS, torch.Generator().manual_seed(7))
        counter = [0]
        runs = []
        for bs, bd in PAIRS:
            src_ids = _ids(TOKENS // bs, TOKENS // bs + 8, bs)
            dst_ids = _ids(TOKENS // bd, TOKENS // bd + 8, 200 + bd)
            runs.append((bs, bd, src_ids, dst_ids, [], [0]))

        def one(bs, bd, src_ids, dst_ids, descs) -> float:
            req = f"r{counter[0]}"
            counter[0] += 1
            prefill.call("hold", req, bs, timeout_s=None)
            agent = agents[bd]
            t0 = time.perf_counter()
            agent.fetch(req, f"P{bs}", src_ids, dst_ids, num_tokens=TOKENS if bs != bd else None)
            while True:
                agent.progress()
                res = agent.results()
                if res:
                    if not res[0].ok:
                        raise res[0].error
                    descs[0] = res[0].descriptors
                    return (time.perf_counter() - t0) * 1e3

        for bs, bd, src_ids, dst_ids, _, descs in runs:  # first transfer of each pair: warm-up and byte check
            before = snapshot(regions[bd])
            one(bs, bd, src_ids, dst_ids, descs)
            check_destination_tokens(regions[bd], 0, D_TP, tokens, dst_ids, before)
        for _ in range(reps):  # rounds interleave the pairs (a shared machine's noise hits all alike)
            for bs, bd, src_ids, dst_ids, ts, descs in runs:
                ts.append(one(bs, bd, src_ids, dst_ids, descs))
        for bs, bd, _, _, ts, descs in runs:
            ms = float(np.median(ts))
            rows.append(dict(case=f"llama3-70b-like ({layers} layers) P4->D8, NHD -> HND, {TOKENS} tokens",
                             method=f"kvtriton staged pull, block {bs}->{bd}", src_block=bs, dst_block=bd,
                             bytes=payload, descriptors=descs[0], ms=round(ms, 2),
                             gbps=round(payload / ms / 1e6, 2)))
        prefill.request_exit()
    finally:
        for a in agents.values():
            a.close()
        prefill.close()
    _ratios(rows, "ms")
    for r in rows:
        r["note"] = (f"{r['vs_equal_blocks']}x the time of equal blocks ({r['dst_block']}->{r['dst_block']}), "
                     "checked per token" if "vs_equal_blocks" in r
                     else "baseline: equal block sizes, checked per token")
    return rows


def cpu_cache_rows(quick: bool = False, layers: int = 4) -> list[dict]:
    """Pack/unpack times of a vLLM-CPU-like cache across block sizes (see the module docstring)."""
    import torch

    from kvtriton import ops
    from kvtriton.plan import build_plan, compact_request, compact_tokens
    from kvtriton.regions import Kind
    from kvtriton.testing.oracle import RegionModel, make_rank_regions

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokens = 2048 if quick else 4096
    models = [RegionModel(f"layers.{i}", Kind.SPLIT, HEADS, (2 * HEAD_DIM,), torch.bfloat16) for i in range(layers)]
    cases = []
    for storage, what in (("vllm_cpu", "K dim-major"), ("separate", "token-major")):
        for bs, bd in ((32, 64), (64, 64), (64, 32), (32, 32)):
            gen = torch.Generator().manual_seed(0)
            ns, nd = tokens // bs, tokens // bd
            src = make_rank_regions(models, 0, 2, ns + 8, bs, layout="HND", storage=storage, gen=gen)
            dst = make_rank_regions(models, 0, 1, nd + 8, bd, layout="HND", storage=storage, gen=gen)
            read = build_plan(0, 1, [r.spec for r in dst], 2, [r.spec for r in src]).payload(0)
            src_ids, dst_ids = _ids(ns, ns + 8, 1), _ids(nd, nd + 8, 2)
            if bs != bd:
                m = compact_tokens(src_ids, dst_ids, ns + 8, nd + 8, bs, bd, tokens)
                n, kw, p_ids, u_ids = m.num_tiles, dict(tiles=m.tiles, num_tokens=tokens), m.src_ids, m.dst_ids
            else:
                p_ids, u_ids = compact_request(src_ids, dst_ids, ns + 8, nd + 8)
                n, kw = p_ids.size, {}
            staging = torch.zeros(read.payload_bytes(n), dtype=torch.uint8)
            offs = read.segment_offsets(n)
            # defaults bind this iteration's tensors (the lambdas are timed after the loop)
            fns = {"pack": lambda src=src, read=read, offs=offs, p=torch.as_tensor(p_ids), st=staging, kw=kw:  # noqa: B008
                   ops.pack(src, read.segments, offs, p, st, impl="torch", **kw),
                   "unpack": lambda dst=dst, read=read, offs=offs, u=torch.as_tensor(u_ids), st=staging, kw=kw:  # noqa: B008
                   ops.unpack(dst, read.segments, offs, u, st, impl="torch", **kw)}
            cases.append((what, bs, bd, fns, staging.numel()))
    times = {(w, bs, bd, op): [] for w, bs, bd, f, _ in cases for op in f}
    for _ in range(3 if quick else 7):  # interleaved rounds, as kernel_rows
        for w, bs, bd, f, _ in cases:
            for op, fn in f.items():
                times[(w, bs, bd, op)].append(_time_ms(fn, "cpu", quick=True))
    med = {k: float(np.median(v)) for k, v in times.items()}
    rows = []
    for w, bs, bd, f, nbytes in cases:
        for op in f:
            ms = med[(w, bs, bd, op)]
            note = "baseline: equal block sizes"
            if bs != bd:
                note = f"{ms / med[(w, bd, bd, op)]:.2f}x equal blocks ({bd}->{bd})"
                if w != "token-major":
                    note += f", {ms / med[('token-major', bs, bd, op)]:.2f}x the token-major remap"
            rows.append(dict(case=f"vLLM CPU cache ({w}, {layers} layers, {HEADS} heads x {HEAD_DIM}) P2->D1, {tokens} "
                                  "tokens", op=f"{op} ({w})", provider="kvtriton (torch)", src_block=bs, dst_block=bd,
                             bytes=2 * nbytes, ms=round(ms, 3), gbps=round(2 * nbytes / ms / 1e6, 2), descriptors=1,
                             note=note))
    torch.set_num_threads(threads)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="kernels,e2e", help="any of kernels, e2e, cpu_cache")
    args = ap.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    if "kernels" in args.sections:
        rows += kernel_rows(device, args.quick)
    if "e2e" in args.sections:
        rows += e2e_rows(args.quick)
    if "cpu_cache" in args.sections:
        rows += cpu_cache_rows(args.quick)
    for r in rows:
        print(f"{r.get('op', r.get('method')):<40} {r['src_block']:>3}->{r['dst_block']:<3} {r['descriptors']:>4} desc "
              f"{r['ms']:>9.2f} ms {r['gbps']:>7} GB/s  {r['note']}")


if __name__ == "__main__":
    main()
