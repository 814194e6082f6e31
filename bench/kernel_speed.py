"""Pack/unpack kernel throughput: kvtriton's Triton kernels against three baselines.

For every case (a model's regions, a TP pair, a block size, a number of blocks) it measures one
source rank's pack (every destination it serves, in one launch) and one destination rank's
unpack (every source it assembles from, in one launch), reporting GB/s = (bytes read + bytes
written) / time for:

* ``kvtriton``: :func:`kvtriton.ops.pack` / :func:`~kvtriton.ops.unpack` with ``impl="triton"``
  (validation, table upload and launch included: what a caller pays);
* ``torch-ref``: :mod:`kvtriton.ops.reference` (vectorised ``index_select`` / ``index_put_``);
* ``naive-triton``: an element-per-lane Triton gather/scatter that looks the block table up for
  every element, one launch per (region, stream, peer) segment: the approach of SGLang's
  staging kernel, written here from its description;
* ``copy``: a plain device copy of as many bytes (the roofline; ``pct_of_copy`` is relative to it).

Every row has p20/p50/p80 (``ms`` is the median): on CUDA ``triton.testing.do_bench`` quantiles,
on CPU the torch rows are ``time.perf_counter`` samples; Triton only runs under the interpreter, so
its rows come from one tiny case (2 blocks) and are labelled "interpreter: not a speed measurement" (without
``TRITON_INTERPRET=1`` they are skipped and one row says so).
"""

from __future__ import annotations

if not __package__:  # `python bench/kernel_speed.py`: run as `python -m bench.kernel_speed` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import time
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from bench.timing import qfields, quantiles_ms, quantiles_of  # bench/timing.py
from kvtriton import ops
from kvtriton.errors import KVTritonError
from kvtriton.ops import pack_reference, unpack_reference
from kvtriton.ops.heuristics import INT_OF_WIDTH
from kvtriton.plan import build_plan
from kvtriton.regions import Layout
from kvtriton.testing.oracle import RegionModel, make_rank_regions

__all__ = ["run_kernel_bench"]

Case = tuple  # (name, list[RegionModel], src_tp, dst_tp, block_size, n_blocks)

_NAIVE_BLOCK = 1024  # elements per program of the naive kernels (one element per lane)


# --------------------------------------------------------------------------- naive baseline
@triton.jit
def _naive_gather_kernel(
    out_ptr,  # [n * BS * NH * HD] elements: the segment's tiles, destination layout
    cache_ptr,  # [num_blocks, ...] elements with strides (s_blk, s_tok, s_head, 1)
    block_ids_ptr,  # [n] int64, -1 = skip
    total, s_blk, s_tok, s_head, head0,
    BS: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr, DST_HND: tl.constexpr, BLOCK: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = e < total
    j = e // (BS * NH * HD)
    r = e % (BS * NH * HD)
    if DST_HND:
        h = r // (BS * HD)
        t = (r // HD) % BS
    else:
        t = r // (NH * HD)
        h = (r // HD) % NH
    d = r % HD
    blk = tl.load(block_ids_ptr + j, mask=m, other=-1).to(tl.int64)  # a table lookup per element
    ok = m & (blk >= 0)
    v = tl.load(cache_ptr + blk * s_blk + t * s_tok + (head0 + h) * s_head + d, mask=ok)
    tl.store(out_ptr + e, v, mask=ok)


@triton.jit
def _naive_scatter_kernel(
    in_ptr,  # [n * BS * NH * HD] elements: the segment's tiles, local layout
    cache_ptr,  # [num_blocks, ...] elements with strides (s_blk, s_tok, s_head, 1)
    block_ids_ptr,  # [n] int64, -1 = skip
    total, s_blk, s_tok, s_head, head0,
    BS: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr, DST_HND: tl.constexpr, BLOCK: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = e < total
    j = e // (BS * NH * HD)
    r = e % (BS * NH * HD)
    if DST_HND:
        h = r // (BS * HD)
        t = (r // HD) % BS
    else:
        t = r // (NH * HD)
        h = (r // HD) % NH
    d = r % HD
    blk = tl.load(block_ids_ptr + j, mask=m, other=-1).to(tl.int64)
    ok = m & (blk >= 0)
    v = tl.load(in_ptr + e, mask=ok)
    tl.store(cache_ptr + blk * s_blk + t * s_tok + (head0 + h) * s_head + d, v, mask=ok)


def _naive(op: str, regions, segments, offsets, ids: torch.Tensor, staging: torch.Tensor) -> None:
    """One element-per-lane launch per segment, elements as same-width integers."""
    kernel = _naive_gather_kernel if op == "pack" else _naive_scatter_kernel
    n = ids.numel()
    for seg, off in zip(segments, offsets):
        t = regions[seg.region].nhd(seg.stream)
        t = t.view(INT_OF_WIDTH[t.element_size()])
        flat = staging[int(off):int(off) + n * seg.tile_bytes].view(t.dtype)
        total = flat.numel()
        head0 = seg.src_head if op == "pack" else seg.dst_head
        kernel[(triton.cdiv(total, _NAIVE_BLOCK),)](
            flat, t, ids, total, t.stride(0), t.stride(1), t.stride(2), head0,
            BS=seg.block_size, NH=seg.num_heads, HD=seg.head_dim,
            DST_HND=seg.dst_layout is Layout.HND, BLOCK=_NAIVE_BLOCK,
        )


# --------------------------------------------------------------------------- one case
class _Setup:
    """Source rank 0's pack request (all its destinations) and destination rank 0's unpack
    request (all its sources), NHD source caches, HND destination caches."""

    def __init__(self, models: Sequence[RegionModel], src_tp: int, dst_tp: int, block_size: int,
                 n_blocks: int, device: str, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        num_blocks = n_blocks + max(8, n_blocks // 8)
        self.n = n_blocks
        self.src = make_rank_regions(models, 0, src_tp, num_blocks, block_size, layout="NHD", gen=gen,
                                     device=device)
        self.dst = make_rank_regions(models, 0, dst_tp, num_blocks, block_size, layout="HND", gen=gen,
                                     device=device)
        src_specs = [r.spec for r in self.src]
        dst_rank_specs = [
            [r.spec for r in make_rank_regions(models, d, dst_tp, 1, block_size, layout="HND", gen=gen,
                                               device="meta")]
            for d in range(dst_tp)
        ]
        self.note = ""
        modes = None
        if not self._pack_segments(src_specs, dst_rank_specs, src_tp, dst_tp, None)[0]:
            modes, self.note = "staged", "forced STAGED (the default plan moves every region DIRECT); "
        segs, offs, nbytes = self._pack_segments(src_specs, dst_rank_specs, src_tp, dst_tp, modes)
        self.pack_args = (tuple(segs), np.asarray(offs, np.int64), nbytes)
        plan = build_plan(0, dst_tp, dst_rank_specs[0], src_tp, src_specs, modes=modes)
        segs, offs, base = [], [], 0
        for read in plan.staged:
            segs += read.segments
            offs += read.segment_offsets(self.n, base).tolist()
            base += read.payload_bytes(self.n)
        self.unpack_args = (tuple(segs), np.asarray(offs, np.int64), base)
        rng = np.random.default_rng(seed)
        self.src_ids = torch.as_tensor(rng.permutation(num_blocks)[:n_blocks], device=device)
        self.dst_ids = torch.as_tensor(rng.permutation(num_blocks)[:n_blocks], device=device)
        self.note += (f"{len(self.pack_args[0])} pack / {len(self.unpack_args[0])} unpack segments, "
                      f"{n_blocks} blocks, NHD->HND")

    def _pack_segments(self, src_specs, dst_rank_specs, src_tp, dst_tp, modes):
        segs, offs, base = [], [], 0
        self.pack_parts = []  # per destination: (segments, offsets), at the same staging offsets
        for d in range(dst_tp):
            read = build_plan(d, dst_tp, dst_rank_specs[d], src_tp, src_specs, modes=modes).payload(0)
            if read is not None:
                segs += read.segments
                offs += read.segment_offsets(self.n, base).tolist()
                self.pack_parts.append((tuple(read.segments), read.segment_offsets(self.n, base)))
                base += read.payload_bytes(self.n)
        return segs, offs, base


def _time_ms(fn, device: str, quick: bool) -> tuple[float, float, float]:
    """p20/p50/p80 ms: ``do_bench`` quantiles on CUDA, perf_counter samples on CPU."""
    return quantiles_ms(fn, 3 if quick else 7, device)


def _row(case, op, provider, nbytes, q, copy_ms, note):
    if not isinstance(q, tuple):
        q = (q, q, q)
    ms = q[1]
    traffic = 2 * nbytes  # every payload byte is read once and written once
    return dict(case=case, op=op, provider=provider, bytes=traffic, **qfields("ms", q, 4),
                gbps=round(traffic / ms / 1e6, 2) if ms > 0 else None,
                pct_of_copy=round(100 * copy_ms / ms, 1) if (ms > 0 and copy_ms) else None, note=note)


def _bench_case(name, setup: _Setup, device: str, quick: bool, providers: Sequence[str], note: str = "",
                check: bool = True) -> list[dict]:
    rows = []
    for op in ("pack", "unpack"):
        segs, offs, nbytes = setup.pack_args if op == "pack" else setup.unpack_args
        regions = setup.src if op == "pack" else setup.dst
        ids = setup.src_ids if op == "pack" else setup.dst_ids
        if not segs:
            rows.append(_row(name, op, "kvtriton", 0, 0.0, None, "skipped: nothing staged"))
            continue
        staging = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        copy_q = _time_ms(lambda: b.copy_(a), device, quick)
        copy_ms = copy_q[1]
        rows.append(_row(name, op, "copy", nbytes, copy_q, copy_ms, "roofline: device copy of the same bytes"))
        ref = pack_reference if op == "pack" else unpack_reference
        fns = {
            "torch-ref": lambda: ref(regions, segs, offs, ids, staging),
            "kvtriton": lambda: getattr(ops, op)(regions, segs, offs, ids, staging, impl="triton"),
            "naive-triton": lambda: _naive(op, regions, segs, offs, ids, staging),
        }
        if check and op == "pack" and "kvtriton" in providers:
            _check_pack_providers(regions, segs, offs, ids, nbytes, device, providers)
        for provider in providers:
            ms = _time_ms(fns[provider], device, quick) if provider == "torch-ref" or device == "cuda" \
                else _once_ms(fns[provider])
            extra = note if provider != "torch-ref" else ""
            rows.append(_row(name, op, provider, nbytes, ms, copy_ms, (extra + setup.note).strip("; ")))
    return rows


def _once_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _check_pack_providers(regions, segs, offs, ids, nbytes, device, providers) -> None:
    """Every provider must produce the reference's bytes before it is timed."""
    want = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    pack_reference(regions, segs, offs, ids, want)
    for provider in providers:
        if provider == "torch-ref":
            continue
        got = torch.zeros_like(want)
        if provider == "kvtriton":
            ops.pack(regions, segs, offs, ids, got, impl="triton")
        else:
            _naive("pack", regions, segs, offs, ids, got)
        if not torch.equal(got, want):
            raise AssertionError(f"bench: {provider} pack differs from the reference")


# --------------------------------------------------------------------------- batched pack
def batched_pack_rows(name: str, models: Sequence[RegionModel], block_size: int, device: str, quick: bool,
                      dests: Sequence[int] = (4, 8), blocks: Sequence[int] = (8, 64)) -> list[dict]:
    """One source rank (TP1) packing a request for ``N`` decode ranks: every destination in one
    launch (what the agent does, :mod:`kvtriton.agent.source.packing`) against one launch per
    destination, same process, same bytes (checked equal first).

    On CUDA (``impl="triton"``) the difference is launch overhead and per-call validation; on
    CPU the rows time the agent's CPU path (``impl="torch"``, the reference gather), so they
    show the per-call Python overhead only: neither Triton's launch cost nor the interpreter's
    speed means anything there."""
    impl = "triton" if device == "cuda" else "torch"
    what = ("CUDA: launch-bound for small requests" if device == "cuda"
            else "CPU torch path: per-call Python overhead only, not launch overhead")
    rows = []
    for n_dst in dests:
        for n_blocks in blocks:
            try:
                setup = _Setup(models, 1, n_dst, block_size, n_blocks, device)
            except KVTritonError:
                continue  # this pair is not plannable for these heads
            segs, offs, nbytes = setup.pack_args
            if not segs:
                continue
            staging = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
            ids = setup.src_ids

            def batched():
                ops.pack(setup.src, segs, offs, ids, staging, impl=impl)

            def per_destination():
                for part_segs, part_offs in setup.pack_parts:
                    ops.pack(setup.src, part_segs, part_offs, ids, staging, impl=impl)

            want = torch.zeros_like(staging)
            pack_reference(setup.src, segs, offs, ids, want)
            for fn in (batched, per_destination):
                staging.zero_()
                fn()
                if not torch.equal(staging, want):
                    raise AssertionError(f"bench: {fn.__name__} pack differs from the reference")
            qb, qp = _interleaved_ms(batched, per_destination, device, quick)
            note = (f"{n_dst} destinations, {n_blocks} blocks, {len(segs)} segments: per-destination / batched "
                    f"= {qp[1] / qb[1]:.2f}x ({what})")
            case = f"{name} P1->D{n_dst} batched pack"
            rows.append(_row(case, "pack", f"batched (1 launch, {impl})", nbytes, qb, None, note))
            rows.append(_row(case, "pack", f"per destination ({len(setup.pack_parts)} launches, {impl})", nbytes, qp,
                             None, note))
    return rows


def _interleaved_ms(a, b, device: str, quick: bool):
    """p20/p50/p80 ms of ``a`` and of ``b``: on CUDA ``do_bench`` each; on CPU in alternating
    calls, so that a shared host's load falls on both alike."""
    if device == "cuda":
        return _time_ms(a, device, quick), _time_ms(b, device, quick)
    a(), b()  # warm-up
    ta, tb = [], []
    for _ in range(5 if quick else 21):
        for fn, ts in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return quantiles_of(ta), quantiles_of(tb)


# --------------------------------------------------------------------------- entry point
def run_kernel_bench(cases: Sequence[Case], device: str, quick: bool) -> list[dict]:
    """Rows ``{case, op, provider, bytes, ms, gbps, pct_of_copy, note}`` for every case.

    ``bytes`` is read + written (twice the staged payload). On CPU the kernel section stays
    well under 30 s: the torch rows run on every case, Triton rows (interpreter) only on the
    first case cut to 2 blocks.
    """
    device = str(torch.device(device).type)
    rows: list[dict] = []
    on_cuda = device == "cuda"
    interp = ops.launch._interpreting()
    for k, (name, models, src_tp, dst_tp, block_size, n_blocks) in enumerate(cases):
        setup = _Setup(models, src_tp, dst_tp, block_size, n_blocks, device)
        providers = ["torch-ref", "kvtriton", "naive-triton"] if on_cuda else ["torch-ref"]
        rows += _bench_case(name, setup, device, quick, providers, check=on_cuda)
        if on_cuda or k:
            continue
        if not interp:
            rows.append(_row(name, "pack", "kvtriton", 0, 0.0, None,
                             "skipped: Triton on CPU needs TRITON_INTERPRET=1 (interpreter, not a speed measurement)"))
            continue
        tiny = _Setup(models, src_tp, dst_tp, block_size, 2, device)
        rows += _bench_case(f"{name}@2blk", tiny, device, quick=True,
                            providers=["torch-ref", "kvtriton", "naive-triton"],
                            note="interpreter: not a speed measurement; ", check=True)
    if cases:  # CUDA: the kernels; CPU: the torch path (the interpreter is never timed here)
        name, models, _, _, block_size, _ = cases[0]
        rows += batched_pack_rows(name, models, block_size, device, quick)
    return rows


if __name__ == "__main__":
    # python bench/kernel_speed.py [preset]: the batched-pack rows alone (the sweep's kernels section has
    # them too)
    import sys

    from bench.presets import PRESETS  # bench/presets.py

    preset = PRESETS[sys.argv[1] if len(sys.argv) > 1 else "llama3-70b"].truncated(8)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for r in batched_pack_rows(preset.name, list(preset.regions), 16, dev, quick=False):
        print(f"{r['case']:<40} {r['provider']:<34} {r['ms']:>9.4f} ms [{r['ms_p20']}-{r['ms_p80']}]  {r['note']}")
