"""Planning cost per request: what the planner adds to every fetch, in microseconds.

A plan is built once per (destination rank, source engine) at handshake, and a
:class:`PairPlan` per source rank when its peer is added (the pair's geometry); a request only
adds its block ids. Per request a decode rank checks and compacts the ids
(:func:`compact_request`), cuts each staged payload into chunks (:meth:`ChunkGeometry.fit`) with
its segment offsets, chooses the way each payload travels by its runs
(:meth:`PairPlan.choose_way`; the head slices of a DIRECT_SLICE way are its descriptors,
:meth:`PairPlan.slice_runs`), and turns the DIRECT regions into coalesced runs
(:func:`runs_of_groups` over the groups found once), and puts the plan's digest in every
message (:meth:`TransferPlan.digest`, hashed once per plan). This times exactly that, on one
thread (``us``), for 1k-, 8k- and 128k-token requests (block ids in shuffled runs of 8 blocks, as
a paged allocator hands them out after some churn), for a staged model (Llama-3-70B, P4->D8, HND
caches, and NHD at 8k tokens) and a direct one (DeepSeek-V3 MLA, P8->D4: zero-copy runs); and
the same request made as an agent's ``fetch()`` makes it (``fetch_us``:
:meth:`RequestPlan.for_fetch` from the engine's Python lists, every pair's way chosen, each
payload's segment offsets, the DIRECT runs). Goal (issue 36): <= 50 us at 8k tokens for
Llama-3-70B HND and NHD; flat in block count where the work allows. What cannot be flat:
checking and compacting the ids is a few O(blocks) numpy passes (~20 us at 8,192 blocks; the
engine's lists converted too in ``fetch_us``), and DIRECT's output is one descriptor per (run,
region) (61 x 1,024 at 128k tokens here), written once per request; finding the runs is done
once per group of regions with equal geometry, not per region.
"""

from __future__ import annotations

from bench.presets import PRESETS, fragmented_block_ids, specs_for  # bench/presets.py
from bench.timing import qfields, quantiles_ms  # bench/timing.py
from kvtriton.plan import ChunkGeometry, CostModel, PairPlan, RequestPlan, Way, build_plan, compact_request
from kvtriton.plan.runs import direct_groups, runs_of_groups
from kvtriton.spec import Layout

CHUNK_BYTES = 64 << 20


def planning_rows(quick: bool = False) -> list[dict]:
    """One row per (model, request size): the per-request planning time in us (p20/p50/p80)."""
    rows = []
    plan_cost = CostModel()  # the default model: what a connector plans by unless told otherwise
    cases = [("llama3-70b", (4, 8), Layout.HND, t) for t in (1024, 8192, 131072)]
    cases += [("llama3-70b", (4, 8), Layout.NHD, 8192)]
    cases += [("deepseek-v3", (8, 4), Layout.HND, t) for t in (1024, 131072)]
    for preset, (p_tp, d_tp), layout, tokens in cases:
        bs = 16
        n = tokens // bs
        num_blocks = 2 * n
        src = specs_for(PRESETS[preset], 0, p_tp, num_blocks, bs, layout)
        dst = specs_for(PRESETS[preset], 0, d_tp, num_blocks, bs, layout)
        plan = build_plan(0, d_tp, dst, p_tp, src, cost=plan_cost)
        src_ids = fragmented_block_ids(n, num_blocks, 8, seed=1)
        dst_ids = fragmented_block_ids(n, num_blocks, 8, seed=2)
        out = {}
        pairs = {r: PairPlan(plan, r, src, dst, plan_cost) for r in plan.source_ranks}  # at add_remote
        groups = direct_groups(plan, src, dst)

        def per_request():
            plan.digest()
            s, t = compact_request(src_ids, dst_ids, num_blocks, num_blocks)
            ways, slices = [], 0
            for read in plan.staged:
                g = ChunkGeometry.fit(read.bytes_per_block, s.size, CHUNK_BYTES)
                read.segment_offsets(g.bounds(0)[1] - g.bounds(0)[0])
                pair = pairs[read.src_rank]
                way = pair.choose_way(s, t, chunks=g.count)
                if way is Way.DIRECT_SLICE:
                    slices += len(pair.slice_runs(s, t))
                ways.append(way.value)
            out["runs"] = len(runs_of_groups(groups, s, t)) if plan.direct else 0
            out["ways"], out["slices"] = "+".join(sorted(set(ways))), slices

        src_list, dst_list = src_ids.tolist(), dst_ids.tolist()  # what an engine hands fetch()

        def as_fetch():
            rp = RequestPlan.for_fetch(plan, src_list, dst_list, src_num_blocks=num_blocks,
                                       dst_num_blocks=num_blocks, chunk_bytes=CHUNK_BYTES, pairs=pairs)
            for p in rp.payloads.values():
                p.segment_offsets(0)
            if plan.direct:
                runs_of_groups(groups, rp.src_ids, rp.dst_ids)

        reps = (200 if tokens < 10_000 else 20) // (4 if quick else 1)
        q = quantiles_ms(per_request, reps)
        q_fetch = quantiles_ms(as_fetch, reps)
        rows.append(dict(preset=preset, p_tp=p_tp, d_tp=d_tp, layout=layout.value, block_size=bs, tokens=tokens,
                         blocks=n, modes="+".join(sorted({m.value for m in plan.modes})), ways=out["ways"] or "-",
                         direct_runs=out["runs"], slice_descriptors=out["slices"],
                         **qfields("us", tuple(x * 1e3 for x in q), 1),
                         **qfields("fetch_us", tuple(x * 1e3 for x in q_fetch), 1)))
    return rows
