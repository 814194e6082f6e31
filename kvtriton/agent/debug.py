"""A plain snapshot of an agent's state, for tests and operators (:meth:`TransferAgent.debug_state`).

The snapshot is the contract, not the internals it is read from: tests observe an agent only
through it (and ``stats`` and the public API), so the roles behind the facade may be recut
freely as long as :func:`debug_state` keeps returning these keys with these meanings. Every value
is a dict, list, str, int, float, bool or None (``json.dumps`` takes it as is); a peer rank is
named ``"engine:rank"`` wherever it is a key.

Schema (top level)::

    engine, rank, tp      this rank (str, int, int)
    flow                  "pull" or "push" (the agent's ``mode=``)
    settings              {"chunk_bytes", "inflight_chunks", "slot_bytes", "timeout_s",
                           "eager_bytes", "eager_guess"}: the values the agent runs with
    peers                 {"E:r": {"engine", "rank", "tp", "agent" (NIXL name),
                           "staging_slots", "slot_bytes", "chunk_bytes" (the peer's largest chunk),
                           "cost" (its cost model as a dict, or None), "authenticated" (added
                           with authenticated=True), "generation" (its registration generation),
                           "silent_s" (seconds since its last message), "row_lists" (sets of
                           cache-to-cache lists prepared with it and kept: DIRECT runs, slices),
                           "fences" (fence READs posted to it), "fencing" (one in flight now),
                           "unflushed" (messages sent since its last fence)}}: ranks connected now
    holds                 {req: {"block_ids" (held ids, in order), "consumer" (the engine the hold
                           is bound to, named or bound on first use; None: unbound),
                           "lease_s", "expires_in_s" (seconds to the end of the lease, < 0: past
                           it), "done_from" (["E:r", ...] whose done arrived)}}
    serves                [{"xid", "req", "peer" ("E:r"), "engine", "rank", "flow",
                            "offered" (an eager pack offered, untouched by the peer yet),
                            "staged" (it sends a staged payload), "chunks" (staged chunks),
                            "blocks_per_chunk" (0 without a staged payload), "next_chunk",
                            "acked", "inflight" (chunks reserved and not acked/landed),
                            "reads_cache" (the peer reads our cache until its RunsDone),
                            "waiting_local", "waiting_engine"}]: transfers this rank serves
    serve_counts          {"by_peer": {"E:r": n}, "by_engine": {E: n}, "by_flow": {flow: n}}
    offered               {req: ["E:r", ...]}: requests whose eager pack is offered to (and not
                           yet taken by) these peer ranks (each is also one of ``serves``)
    eager                 {req: {"r" (destination rank, str): {"engine", "chunks" (of the
                           pack), "packed" (chunks reserved and packed or packing),
                           "blocks_per_chunk", "slots"}}}: packs made ahead of their pull
                           and not offered yet
    staging               {"num_slots", "free_slots", "share" (slots one peer engine may keep),
                           "engine_slots" ({E: slots its transfers and packs keep, quarantined
                           ones included}), "eager_slots" (slots all eager packs keep, offered
                           ones included), "eager_budget_slots", "retired" (transfers and slot
                           runs waiting out a quarantine or a kernel before their memory is reused)}
    plans                 [{"engine", "rank", "cost" (the destination's cost model as a dict, or
                            None: ours), "routes" (route per region, in region order), "ways"
                            ({"src rank": [ways of its staged payload]}), "source_ranks",
                            "staged_from_me" (this rank sends it a staged payload), "digest"}]:
                           one entry per plan this rank made for a destination it serves
    reading               {E: {"routes", "ways", "source_ranks", "digest"}}: the plan this rank
                           reads each source engine by (``plan_for``); {E: {"error": str}} when a
                           forced mode rules reading from it out
    fetches               {req: {"engine", "parts" ([xid, ...]), "error" (str or None)}}
    parts                 {xid: {"req", "src_rank", "way", "chunks", "chunks_done",
                           "offered" (read from an offer, no pull sent), "reads_cache",
                           "runs_pending"}}: what each source rank sends a fetch in flight
    parts_by_way          {way: n}: ``parts`` counted by way
    offers                {"E:r": {req: {"xid", "chunks", "blocks_per_chunk", "runs"}}}: offers
                           received from source ranks and not used or declined yet
    warmed                [{"op": "pack" | "unpack", "config": LaunchConfig as a dict}]: kernel
                           specialisations compiled by warmup, sorted
    inbox                 {"senders", "messages"}: received messages not handled yet
    stalls                {"count", "seconds"}: gaps in the progress thread's calls (this process
                           did not run) and their total; each moved every deadline (.stalls)
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["debug_state"]


def _name(engine: str, rank: int) -> str:
    return f"{engine}:{rank}"


def _cost(cost) -> dict | None:
    return None if cost is None else cost.as_dict()


def _plan(plan) -> dict:
    return {"routes": [m.value for m in plan.modes],
            "ways": {str(r.src_rank): [w.value for w in r.ways] for r in plan.staged},
            "source_ranks": list(plan.source_ranks), "digest": plan.digest()}


def debug_state(agent) -> dict[str, Any]:
    """A plain, JSON-able snapshot of what ``agent`` (a :class:`~kvtriton.agent.TransferAgent`)
    holds, serves, stages, packed ahead, was offered, fetches, knows, planned and warmed; the keys
    are described in :mod:`kvtriton.agent.debug`. Read under the agent's lock, no side effect
    (no event is queried, nothing progresses). ``TransferAgent.debug_state()`` is this function."""
    with agent._lock:
        return _snapshot(agent)


def _snapshot(agent) -> dict[str, Any]:
    src, dst, links, s = agent._source, agent._destination, agent._links, agent._s
    now = time.monotonic()
    serves = [{"xid": v.xid, "req": v.req_id, "peer": _name(*v.peer.key), "engine": v.peer.md.engine,
               "rank": v.peer.md.rank, "flow": v.flow.value, "offered": src.serves.offers.offered(v),
               "staged": v.read is not None,
               "chunks": v.n_chunks, "blocks_per_chunk": v.chunks.blocks_per_chunk if v.chunks is not None else 0,
               "next_chunk": v.next_chunk, "acked": v.acked, "inflight": len(v.inflight),
               "reads_cache": getattr(v, "runs_reader", False), "waiting_local": v.waiting_local,
               "waiting_engine": v.waiting_engine}
              for v in src.serves.by_key.values()]
    counts: dict[str, dict[str, int]] = {"by_peer": {}, "by_engine": {}, "by_flow": {}}
    for v in serves:
        for key, what in (("by_peer", v["peer"]), ("by_engine", v["engine"]), ("by_flow", v["flow"])):
            counts[key][what] = counts[key].get(what, 0) + 1
    offered: dict[str, list[str]] = {}
    for (_, req), v in src.serves.offers.untouched.items():
        offered.setdefault(req, []).append(_name(*v.peer.key))
    parts = {xid: {"req": p.fetch.req_id, "src_rank": p.src_rank, "way": p.way.value, "chunks": p.n_chunks,
                   "chunks_done": p.chunks_done, "offered": p.offered, "reads_cache": p.lease is not None,
                   "runs_pending": p.runs_pending}
             for xid, p in dst.fetches.parts.items()}
    by_way: dict[str, int] = {}
    for p in parts.values():
        by_way[p["way"]] = by_way.get(p["way"], 0) + 1
    reading: dict[str, dict] = {eng: _plan(plan) for eng, plan in agent._plans.reads.items()}
    reading.update({eng: {"error": str(e)} for eng, e in agent._plans.unreadable.items()})
    return {
        "engine": agent.engine_id, "rank": agent.rank, "tp": agent.tp, "flow": s.flow.value,
        "settings": {"chunk_bytes": s.chunk_bytes, "inflight_chunks": s.inflight, "slot_bytes": s.pool.slot_bytes,
                     "timeout_s": s.timeout_s, "eager_bytes": s.eager_bytes, "eager_guess": s.eager_guess},
        "peers": {_name(*key): {"engine": p.md.engine, "rank": p.md.rank, "tp": p.md.tp, "agent": p.agent,
                                "staging_slots": p.md.staging.num_slots, "slot_bytes": p.md.staging.slot_bytes,
                                "chunk_bytes": p.md.staging.chunk_bytes, "cost": _cost(p.md.cost),
                                "authenticated": p.authenticated, "generation": p.md.generation,
                                "silent_s": now - p.heard, "row_lists": len(p.row_lists),
                                **links.transport.fences.state(p.agent)}
                  for key, p in links.peers.items()},
        "holds": {req: {"block_ids": h.block_ids.tolist(), "consumer": h.consumer, "lease_s": h.lease_s,
                        "expires_in_s": h.deadline - now, "done_from": sorted(_name(*k) for k in h.done_from)}
                  for req, h in src.holds.held.items()},
        "serves": serves,
        "serve_counts": counts,
        "offered": offered,
        "eager": {req: {str(rank): {"engine": pk.peer.md.engine, "chunks": pk.chunks.count,
                                    "packed": len(pk.inflight), "blocks_per_chunk": pk.chunks.blocks_per_chunk,
                                    "slots": pk.nslots}
                        for rank, pk in by_rank.items()}
                  for req, by_rank in src.eager.packs.items()},
        "staging": {"num_slots": s.pool.num_slots, "free_slots": s.pool.free_slots, "share": src.share.limit(),
                    "engine_slots": dict(src.share.engine_slots), "eager_slots": src.eager.slots,
                    "eager_budget_slots": src.eager.budget_slots, "retired": len(links.zombies)},
        "plans": [{"engine": key[0], "rank": key[1], "cost": _cost(key[2]) if len(key) > 2 else None, **_plan(plan),
                   "staged_from_me": plan.payload(s.rank) is not None}
                  for key, plan in agent._plans.served.items()],
        "reading": reading,
        "fetches": {req: {"engine": f.engine, "parts": [p.xid for p in f.parts.values()],
                          "error": None if f.error is None else str(f.error)}
                    for req, f in dst.fetches.by_req.items()},
        "parts": parts,
        "parts_by_way": by_way,
        "offers": {_name(*key): {req: {"xid": o.xid, "chunks": len(o.slots) // 2, "blocks_per_chunk": o.chunk_blocks,
                                       "runs": bool(o.runs)}
                                 for req, o in by_req.items()}
                   for key, by_req in dst.offers.by_peer.items()},
        "warmed": [{"op": op, "config": cfg._asdict()} for op, cfg in sorted(agent._warmed)],
        "inbox": {"senders": len(agent._inbox.queues),
                  "messages": sum(len(q) for q in agent._inbox.queues.values())},
        "stalls": {"count": agent._stalls.count, "seconds": agent._stalls.seconds},
    }
