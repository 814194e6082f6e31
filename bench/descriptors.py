"""Descriptors per decode rank for one request: kvtriton's plan against other systems' reads.

Pure planning, no data: for every preset x TP pair x block size, the plan of every decode rank is
built from region specs (meta tensors), a request of ``TOKENS`` tokens is laid out in fragmented
block ids (runs of 8), and the worst decode rank's counts are kept: kvtriton's route, staged (one
per source->destination pair, unchunked and in 64 MiB chunks) plus its coalesced DIRECT runs,
against vLLM NixlConnector's head-slice reads (K||V packed, and K/V separate; both counted by
:func:`kvtriton.plan.count.count_descriptors`, as ``kvtriton plan`` counts them) and per-token
slices (bench/baselines.py). The sweep's ``descriptors`` section; ``python bench/descriptors.py`` prints it.
"""

from __future__ import annotations

if not __package__:  # `python bench/descriptors.py`: run as `python -m bench.descriptors` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

from bench.baselines import per_token_descriptor_count, vllm_direct_descriptor_count  # bench/baselines.py
from bench.presets import fragmented_block_ids, specs_for  # bench/presets.py
from kvtriton.errors import KVTritonError
from kvtriton.plan import build_plan, compact_request
from kvtriton.plan.count import count_descriptors

CHUNK_BYTES = 64 << 20  # the default staging chunk the "chunked" column assumes


#: which vLLM releases default to a block size (kvtriton.cli.plan.VLLM_DEFAULT_BLOCK): 0.34 moved to 64,
#: so its NixlConnector reads are 4x fewer and 4x larger than 0.33's for the same request.
VLLM_DEFAULT_OF = {16: "0.32-0.33", 64: "0.34"}


def descriptor_rows(presets, pairs, block_sizes, tokens) -> list[dict]:
    """One row per (preset, TP pair, block size): the worst decode rank's counts, kvtriton's and the
    baselines', and their ratios; a pair the planner refuses gets a ``note`` instead."""
    rows = []
    for preset in presets:
        for bs in block_sizes:
            n = tokens // bs
            num_blocks = 4 * n
            src_ids = fragmented_block_ids(n, num_blocks, 8, seed=1)
            dst_ids = fragmented_block_ids(n, num_blocks, 8, seed=2)
            for p_tp, d_tp in pairs:
                row = dict(section="descriptors", preset=preset.name, p_tp=p_tp, d_tp=d_tp,
                           block_size=bs, tokens=tokens, vllm_default_of=VLLM_DEFAULT_OF.get(bs, ""))
                try:
                    src = specs_for(preset, 0, p_tp, num_blocks, bs)
                    worst = None
                    for d in range(d_tp):
                        dst = specs_for(preset, d, d_tp, num_blocks, bs)
                        plan = build_plan(d, d_tp, dst, p_tp, src)
                        s, t = compact_request(src_ids, dst_ids, num_blocks, num_blocks)
                        count = count_descriptors(plan, src, dst, s, t, n)  # kvtriton plan's count
                        chunked = count_descriptors(plan, src, dst, s, t, n, chunk_bytes=CHUNK_BYTES)
                        # per-token slices: the source ranks holding this rank's SPLIT heads
                        k = max(1, len({x.src_rank for x in plan.staged}
                                       | {r for d in plan.direct if d.sliced for r in d.src_ranks}))
                        counts = dict(
                            kvtriton_staged=count.staged,
                            kvtriton_direct=count.direct,
                            kvtriton_staged_chunked=chunked.staged,
                            vllm_kv_packed=count.nixl_connector,
                            vllm_kv_separate=count.nixl_connector_kv_separate,
                            per_token=per_token_descriptor_count(k, preset.split_layers, tokens)
                            + vllm_direct_descriptor_count(1, preset.replicate_layers, n),
                        )
                        counts["kvtriton"] = counts["kvtriton_staged"] + counts["kvtriton_direct"]
                        counts["kvtriton_chosen"] = count.total  # by the ways the default cost model chooses
                        moved = sum(n * spec.tile_bytes(j, spec.local_heads) for spec in dst
                                    for j in range(spec.num_streams))
                        counts["vllm_read_bytes"] = round(moved / count.nixl_connector) if count.nixl_connector else 0
                        if worst is None or counts["kvtriton"] > worst["kvtriton"]:
                            worst = counts
                    row.update(worst)
                    row["vllm_packed_per_kvtriton"] = _ratio(worst["vllm_kv_packed"], worst["kvtriton"])
                    row["vllm_separate_per_kvtriton"] = _ratio(worst["vllm_kv_separate"], worst["kvtriton"])
                except KVTritonError as e:
                    row["note"] = f"skipped: {e}"
                rows.append(row)
    return rows


def model_kind_rows(kinds: dict, pairs) -> list[dict]:
    """Per pd_vllm model kind (``presets.PD_MODEL_KINDS``: preset, engine block size, prompt
    tokens) and TP pair: descriptors and bytes one request needs on the worst decode rank,
    kvtriton's plan (its default cost model) against NixlConnector's reads (one per source rank,
    layer and block: K and V in one block tensor, as vLLM CPU's caches; what bench/pd_vllm.py
    counts on real engines), planned without engines. Block ids: consecutive on both sides, as the
    engines' fresh allocations give."""
    import numpy as np

    rows = []
    for kind, (preset, bs, tokens) in kinds.items():
        n = -(-tokens // bs)
        num_blocks = n + 8
        src_ids, dst_ids = np.arange(n) + 1, np.arange(n) + 3
        for p_tp, d_tp in pairs:
            row = dict(section="model_kinds", model_kind=kind, p_tp=p_tp, d_tp=d_tp,
                       block_size=bs, tokens=tokens)
            try:
                src = specs_for(preset, 0, p_tp, num_blocks, bs)
                worst = None
                for d in range(d_tp):
                    dst = specs_for(preset, d, d_tp, num_blocks, bs)
                    plan = build_plan(d, d_tp, dst, p_tp, src)
                    s, t = compact_request(src_ids, dst_ids, num_blocks, num_blocks)
                    count = count_descriptors(plan, src, dst, s, t, n)  # kvtriton plan's count
                    ours, theirs = count.route, count.nixl_connector
                    payload = n * sum(r.tile_bytes(j, r.local_heads) for r in dst for j in range(r.num_streams))
                    if worst is None or ours > worst[0]:
                        worst = (ours, theirs, payload, "+".join(sorted({m.value for m in plan.modes})))
                ours, theirs, payload, modes = worst
                row.update(kvtriton=ours, nixl_connector=theirs, bytes_per_request=payload, modes=modes,
                           nixl_per_kvtriton=round(theirs / max(1, ours), 1))
            except KVTritonError as e:
                row["note"] = f"skipped: {e}"
            rows.append(row)
    return rows



def _ratio(theirs: int, ours: int) -> float:
    """theirs / ours: whole above 10, two decimals below (0.5 where the cost model moves large head
    slices zero-copy, DIRECT_SLICE, one descriptor per K and V block, instead of repacking them)."""
    r = theirs / max(1, ours)
    return round(r) if r >= 10 else round(r, 2)


if __name__ == "__main__":
    from bench.presets import BLOCK_SIZES, PRESETS, TOKENS, TP_PAIRS  # bench/presets.py
    from bench.report import print_table  # bench/report.py

    print_table(descriptor_rows(PRESETS.values(), TP_PAIRS, BLOCK_SIZES, TOKENS))

