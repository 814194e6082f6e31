"""``kvtriton plan``: what kvtriton would do for a model and a TP pair, per decode rank.

Pure planning, no tensors, no torch, no NIXL: the regions come from :mod:`kvtriton.plan.models`
(a ``config.json`` or a preset), the plan from :func:`~kvtriton.plan.build_plan` with the cost
model given (the cached one of this host, else the default; measured only when asked), and a
request of ``tokens`` tokens whose block ids come in runs of ``run`` consecutive blocks on both
engines (the sweep's fragmented pattern, ``bench/presets.py``). For each decode rank it reports
the source ranks and heads, each region's route, each payload's ways with their descriptors,
bytes per descriptor and estimated time, the way the cost model chooses, and what vLLM's
NixlConnector posts for the same request: every count from :func:`~kvtriton.plan.count.count_descriptors`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..errors import KVTritonError, PlanError
from ..plan import CostModel, build_plan, ceil_div, check_tp, compact_request, head_range, split_sources
from ..plan.count import count_descriptors, nixl_connector_descriptors
from ..plan.ids import fragmented_ids as block_ids
from ..plan.models import ModelKV, load_model, rank_specs
from ..spec import Kind, Layout

__all__ = ["VLLM_DEFAULT_BLOCK", "nixl_connector_descriptors", "block_ids", "explain", "format_text",
           "add_arguments", "run"]

#: vLLM's default block size per release the plan models (``config/cache.py``): 0.34 raised it to 64,
#: so NixlConnector's reads of one request became 4x fewer and 4x larger (32 KiB for Llama-3-70B P4->D8).
VLLM_DEFAULT_BLOCK = {"0.32": 16, "0.33": 16, "0.34": 64}


def _heads(lo: int, hi: int) -> str:
    return f"head {lo}" if hi - lo == 1 else f"heads {lo}-{hi - 1}"


def _sources(model: ModelKV, d: int, p_tp: int, d_tp: int) -> list[dict]:
    """Per distinct SPLIT head count: the decode rank's global heads and, per source rank, which
    of them it reads there (global head numbers, ``[lo, hi)``)."""
    out = []
    for total in sorted({x.total_heads for x in model.layers if x.kind is Kind.SPLIT}):
        regions = sum(1 for x in model.layers if x.kind is Kind.SPLIT and x.total_heads == total)
        reads = []
        for sl in split_sources(d, d_tp, p_tp, total):
            s0 = head_range(sl.src_rank, p_tp, total)[0]
            reads.append(dict(src_rank=sl.src_rank, heads=[s0 + sl.src_head, s0 + sl.src_head + sl.num_heads],
                              holds=list(head_range(sl.src_rank, p_tp, total))))
        out.append(dict(total_heads=total, regions=regions, decode_heads=list(head_range(d, d_tp, total)),
                        reads=reads))
    return out


def explain(model: ModelKV, prefill_tp: int, decode_tp: int, *, block_size: int | None = None, tokens: int = 8192,
            layout: Layout | str = Layout.HND, prefill_layout: Layout | str | None = None,
            cost: CostModel | None = None, run: int = 8, chunk_bytes: int | None = None,
            ranks: list[int] | None = None, vllm: str = "0.34") -> dict:
    """The report ``kvtriton plan`` prints (``--json`` prints exactly this): see the module
    docstring; ``vllm`` names the vLLM release whose NixlConnector is the baseline (its default block
    size is :data:`VLLM_DEFAULT_BLOCK`: ``block_size`` defaults to it). Raises the
    planner's typed errors (:class:`~kvtriton.errors.TopologyError` when a
    TP size cannot shard a region's heads, :class:`~kvtriton.errors.PlanError`, ...)."""
    cost = cost or CostModel()
    if vllm not in VLLM_DEFAULT_BLOCK:
        raise PlanError(f"vllm must be one of {sorted(VLLM_DEFAULT_BLOCK)}, got {vllm!r}")
    if block_size is None:
        block_size = VLLM_DEFAULT_BLOCK[vllm]
    for what, v in (("tokens", tokens), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"{what} must be a positive integer, got {v!r}")
    if chunk_bytes is not None and chunk_bytes < 1:
        raise PlanError(f"chunk_bytes must be positive, got {chunk_bytes}")
    for x in model.layers:
        if x.kind is Kind.SPLIT:
            for engine, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
                check_tp(tp, x.total_heads, f"{engine} engine, region {x.name!r}")
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= r < decode_tp]
        if bad:
            raise PlanError(f"decode ranks {bad} are out of range for decode TP {decode_tp}")
    n = ceil_div(tokens, block_size)
    ids = block_ids(n, run)
    num_blocks = int(ids[-1]) + 1
    src = rank_specs(model, 0, prefill_tp, num_blocks, block_size, prefill_layout or layout)
    split = [x for x in model.layers if x.kind is Kind.SPLIT]
    out_ranks = []
    for d in range(decode_tp) if ranks is None else ranks:
        dst = rank_specs(model, d, decode_tp, num_blocks, block_size, layout)
        plan = build_plan(d, decode_tp, dst, prefill_tp, src, cost=cost)
        s, t = compact_request(ids, ids, num_blocks, num_blocks)
        count = count_descriptors(plan, src, dst, s, t, n, cost=cost, chunk_bytes=chunk_bytes)
        payloads = []
        for read, pc in zip(plan.staged, count.payloads):
            nbytes = read.payload_bytes(n)
            ways = {way.value: dict(descriptors=k, bytes_per_descriptor=round(nbytes / k),
                                    est_ms=round(cost.way_us(way, nbytes, k, segments=len(read.segments),
                                                             chunks=pc.chunks) / 1e3, 3))
                    for way, k in pc.ways.items()}
            payloads.append(dict(src_rank=read.src_rank, bytes=nbytes, segments=len(read.segments),
                                 regions=len({g.region for g in read.segments}), chunks=pc.chunks,
                                 ways=ways, chosen=pc.chosen.value))
        moved = sum(n * sum(spec.tile_bytes(j, spec.local_heads) for j in range(spec.num_streams)) for spec in dst)
        theirs = count.nixl_connector
        out_ranks.append(dict(
            decode_rank=d, sources=_sources(model, d, prefill_tp, decode_tp),
            replicate_sources=sorted({r for dr in plan.direct if not dr.sliced for r in dr.src_ranks}
                                     | {p.src_rank for p in plan.staged
                                        if any(dst[g.region].kind is Kind.REPLICATE for g in p.segments)}),
            routes=[dict(region=spec.name, route=r.value) for spec, r in zip(dst, plan.routes)],
            payloads=payloads,
            direct=dict(regions=len(plan.direct), descriptors=count.direct, bytes=count.direct_bytes,
                        bytes_per_descriptor=round(count.direct_bytes / count.direct) if count.direct else 0),
            kvtriton=dict(staged_descriptors=count.staged, descriptors=count.total, bytes=moved),
            vllm=dict(descriptors=theirs, bytes_per_descriptor=round(moved / theirs) if theirs else 0,
                      descriptors_kv_separate=count.nixl_connector_kv_separate)))
    return dict(
        model=model.name, regions=len(model.layers), split_regions=len(split),
        replicate_regions=len(model.layers) - len(split), dtypes=sorted({x.dtype for x in model.layers}),
        prefill_tp=prefill_tp, decode_tp=decode_tp, block_size=block_size, tokens=tokens, blocks=n, run=run,
        vllm=vllm, vllm_default_block=VLLM_DEFAULT_BLOCK[vllm],
        layout=Layout(layout).value, prefill_layout=Layout(prefill_layout or layout).value, chunk_bytes=chunk_bytes,
        cost_model=dict(cost.as_dict(), crossover_bytes=round(cost.crossover_bytes()), source=cost.source),
        ranks=out_ranks)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} B"


def _route_runs(routes: list[dict]) -> list[str]:
    """``layers.0 .. layers.79 (80): staged``: consecutive regions of one route, one line each."""
    lines, i = [], 0
    while i < len(routes):
        j = i
        while j + 1 < len(routes) and routes[j + 1]["route"] == routes[i]["route"]:
            j += 1
        names = routes[i]["region"] if i == j else f"{routes[i]['region']} .. {routes[j]['region']}"
        lines.append(f"{names} ({j - i + 1}): {routes[i]['route']}")
        i = j + 1
    return lines


def _block_note(rep: dict) -> str:
    if rep["block_size"] == rep["vllm_default_block"]:
        return f" (vLLM {rep['vllm']}'s default)"
    return f" (vLLM {rep['vllm']}'s default is {rep['vllm_default_block']})"


def format_text(rep: dict) -> str:
    """The report as text, one block per decode rank."""
    c = rep["cost_model"]
    ids = "contiguous ids" if rep["run"] <= 0 else f"ids in runs of {rep['run']}"
    layout = rep["layout"] if rep["layout"] == rep["prefill_layout"] else f"{rep['prefill_layout']} -> {rep['layout']}"
    out = [f"kvtriton plan: {rep['model']}, {rep['regions']} regions ({rep['split_regions']} split, "
           f"{rep['replicate_regions']} replicate), {'/'.join(rep['dtypes'])}",
           f"  P{rep['prefill_tp']} -> D{rep['decode_tp']}, block {rep['block_size']}{_block_note(rep)}, "
           f"{rep['tokens']:,} tokens = "
           f"{rep['blocks']:,} blocks ({ids}), layout {layout}"
           + (f", staging chunks of {_mib(rep['chunk_bytes'])}" if rep["chunk_bytes"] else ""),
           f"  cost model: {c['source']}: {c['desc_us']} us/descriptor, pack {c['pack_gbps']} GB/s, unpack "
           f"{c['unpack_gbps']} GB/s, a pass {c['pass_us']} us + {c['segment_us']} us a segment (DIRECT above "
           f"{c['crossover_bytes']:,} B per descriptor)"]
    for r in rep["ranks"]:
        out.append("")
        out.append(f"decode rank {r['decode_rank']}:")
        for g in r["sources"]:
            reads = ", ".join(f"P{x['src_rank']} {_heads(*x['heads'])} (of its {_heads(*x['holds'])})"
                              for x in g["reads"])
            out.append(f"  {g['regions']} split regions of {g['total_heads']} KV heads: "
                       f"{_heads(*g['decode_heads'])} from {reads}")
        if r["replicate_sources"]:
            out.append(f"  replicate regions from P{', P'.join(map(str, r['replicate_sources']))}")
        out.extend(f"  route {line}" for line in _route_runs(r["routes"]))
        for p in r["payloads"]:
            out.append(f"  payload from P{p['src_rank']}: {_mib(p['bytes'])}, {p['segments']} segments of "
                       f"{p['regions']} regions" + (f", {p['chunks']} chunks" if p["chunks"] > 1 else ""))
            out.append(f"    {'way':<12}{'descriptors':>12}{'bytes/descriptor':>18}{'est. ms':>10}")
            for way, w in p["ways"].items():
                mark = "  <- chosen" if way == p["chosen"] else ""
                out.append(f"    {way:<12}{w['descriptors']:>12,}{w['bytes_per_descriptor']:>18,}"
                           f"{w['est_ms']:>10}{mark}")
        if r["direct"]["regions"]:
            dr = r["direct"]
            out.append(f"  direct: {dr['regions']} regions, {dr['descriptors']:,} descriptors of "
                       f"{dr['bytes_per_descriptor']:,} B (coalesced block runs)")
        k, v = r["kvtriton"], r["vllm"]
        out.append(f"  kvtriton: {k['staged_descriptors']:,} staged descriptor{'s' * (k['staged_descriptors'] != 1)}"
                   f" + {r['direct']['descriptors']:,} direct; {k['descriptors']:,} by the chosen ways; "
                   f"{_mib(k['bytes'])}")
        out.append(f"  vLLM {rep['vllm']} NixlConnector: {v['descriptors']:,} descriptors of "
                   f"{v['bytes_per_descriptor']:,} B "
                   f"(one per source rank, region and block, a block's K and V together; "
                   f"{v['descriptors_kv_separate']:,} with K and V separate)")
    return "\n".join(out)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True, help="a config.json, a directory holding one, or a preset "
                    "(llama3-8b, llama3-70b, qwen2.5-7b, deepseek-v3, llama3-8b+mla-draft; hybrid: "
                    "Qwen3-Next-80B-A3B, Nemotron-H-8B, gpt-oss-120b, Gemma-3-27B)")
    ap.add_argument("--prefill-tp", type=int, required=True)
    ap.add_argument("--decode-tp", type=int, required=True)
    ap.add_argument("--vllm", choices=sorted(VLLM_DEFAULT_BLOCK), default="0.34",
                    help="the vLLM release modelled: its default block size and its NixlConnector as the "
                    "baseline (default 0.34: block 64; 0.32 and 0.33: block 16)")
    ap.add_argument("--block-size", type=int, help="tokens per block (default: the --vllm release's default)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the request (default 8192)")
    ap.add_argument("--layout", choices=[x.value for x in Layout], default="HND", help="the caches' layout")
    ap.add_argument("--prefill-layout", choices=[x.value for x in Layout], help="the prefill's, when it differs")
    ap.add_argument("--dtype", help="the KV cache dtype, when it is not the config's (e.g. float8_e4m3fn)")
    ap.add_argument("--run", type=int, default=8, help="block ids come in runs of this many consecutive "
                    "blocks (0: one run; default 8)")
    ap.add_argument("--chunk-mib", type=float, help="staging chunk size: staged descriptors per chunk "
                    "(default: unchunked, one per source rank)")
    ap.add_argument("--rank", type=int, action="append", help="only this decode rank (repeatable)")
    ap.add_argument("--cost", default="auto", help="auto (this host's cached model, else the default), "
                    "default, or measure (measure now when none is cached; imports torch and NIXL)")
    ap.add_argument("--device", default="cpu", help="the device whose cached cost model is used (default cpu)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--conv-layout", choices=["SD", "DS"], default="SD", help="hybrid models: vLLM's conv state "
                    "layout (VLLM_SSM_CONV_STATE_LAYOUT; default SD)")


def _cost(how: str, device: str) -> CostModel:
    if how == "default":
        return CostModel()
    if how == "measure":
        from ..costmodel import load_or_measure

        return load_or_measure(device)
    if how != "auto":
        raise PlanError(f"--cost must be auto, default or measure, got {how!r}")
    from ..costmodel import find_cached

    found = find_cached(device)
    if found is None:
        return CostModel()
    model, path = found
    age_h = (time.time() - path.stat().st_mtime) / 3600
    return CostModel(**model.as_dict(), source=f"cached {path} ({age_h:.1f} h old)")


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 planned, 2 the pair (or the model, or an argument) cannot be planned: the
    planner's typed error on stderr."""
    try:
        from .hybrid_plan import explain_hybrid, format_hybrid, load_hybrid

        hybrid = load_hybrid(args.model)
        if hybrid is not None:  # sliding-window, Mamba2 or GDN groups: kvtriton.cli.hybrid_plan
            block_size = args.block_size if args.block_size is not None else VLLM_DEFAULT_BLOCK[args.vllm]
            rep = explain_hybrid(hybrid, args.prefill_tp, args.decode_tp, block_size=block_size,
                                 tokens=args.tokens, layout=args.layout, conv_layout=args.conv_layout,
                                 cost=_cost(args.cost, args.device), run=args.run,
                                 chunk_bytes=int(args.chunk_mib * 2**20) if args.chunk_mib else None, ranks=args.rank)
            print(json.dumps(rep, indent=1) if args.json else format_hybrid(rep), file=getattr(args, "stdout", None))
            return 0
        model = load_model(args.model, args.dtype)
        rep = explain(model, args.prefill_tp, args.decode_tp, block_size=args.block_size, tokens=args.tokens,
                      layout=args.layout, prefill_layout=args.prefill_layout, cost=_cost(args.cost, args.device),
                      run=args.run, chunk_bytes=int(args.chunk_mib * 2**20) if args.chunk_mib else None,
                      ranks=args.rank, vllm=args.vllm)
    except KVTritonError as e:
        print(f"kvtriton plan: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=1) if args.json else format_text(rep), file=getattr(args, "stdout", None))
    return 0
