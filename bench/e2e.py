"""End-to-end time of one request between two processes over NIXL (UCX on 127.0.0.1).

Llama-3-70B-like geometry (8 KV heads, head_dim 128, bf16, K and V separate, 16-token blocks),
prefill TP4 -> decode TP8, seen from decode rank 0: it needs head 0 of prefill rank 0's two heads
for every layer, K/V and block. ``layers`` is cut down from 80 so the run fits a 2-core machine;
the descriptor sizes are the real ones. Methods, all moving the same bytes into decode rank 0:

* ``kvtriton staged``: TransferAgent pull: the prefill packs from an **NHD** cache into staging,
  decode READs one descriptor per chunk and unpacks into its HND cache; control messages included.
  Timed from ``fetch`` to its result; the prefill's ``hold`` is placed before the clock starts.
* ``kvtriton staged, pull eager``: the hold names the decode engine, so the prefill packs at hold
  time and offers the pack to the decode rank (kvtriton.agent.source.eager); the clock starts once the
  decode has the offer, as when it asks some time after the prefill finished: it READs at once,
  no pull and no wait for the prefill process.
* ``kvtriton pack_place``: one-sided staging (:mod:`kvtriton.plan.ways`): the prefill packs as for
  staged, the decode READs the packed tiles straight into its cache blocks (its rank's one head
  is its whole HND block), one descriptor per (layer, K/V, run of consecutive destination blocks),
  no unpack pass; with ``eager`` the pack is done at hold time and offered. ``kvtriton auto``:
  nothing forced: the decode's cost model picks the way per request (the row says which).
* ``connector hold`` (**the judged ``auto`` rows: what a user of the vLLM connector gets**): the hold
  names no consumer, as the connector's worker holds (unless its ``consumer`` setting is given), and
  the prefill packs ahead and offers for the only decode engine connected (``eager_guess``); the
  clock starts when the decode fetches right after the prefill's ``hold()`` returned, so a pack not
  done by then is timed (the pull takes it over, or, when the pull is handled first, packs it
  then). Run for auto and each way that packs, from each source layout. ``eager, asked at once``:
  the same with the consumer named (a cache read is offered at hold time too). The lazy ``auto``
  rows (no eager packs) stay beside them, judged separately against the lazy ways only.
  (read_unpack, the P > D mirror, needs a source rank whose heads all go to one decode rank;
  this P4->D8 case has none: bench/costgrid.py times it.)
* ``kvtriton staged, pull eager-guess``: as ``eager``, but the hold names no consumer (as the vLLM
  connector's holds): the prefill packs for the only decode engine connected to it
  (``eager_guess``) and offers it; the note gives lazy pull (same chunks) / this.
* ``vLLM-style direct``: one 8 KiB K||V descriptor per (layer, block) head slice, read from a copy
  of the cache in vLLM's own layout (K||V of a (head, token) side by side, head-major blocks: one
  head of one block is one range), prepared lists; and one 4 KiB descriptor per (layer, K/V,
  block) from an HND copy with K and V separate.
* Source layouts: each kvtriton way is also run from the HND copy (``HND source``) and from the
  K||V copy, registered as vLLM's connector registers it (one stream per layer, on both sides:
  ``vLLM K||V layout``), every way the plan allows forced beside ``auto``. ``auto / best`` of a
  layout (:func:`bench.report.auto_vs_best`) compares the planner's way with every kvtriton way
  and the raw reads *of the same memory* (per-token reads are the only head-slice reads an NHD
  block allows; the rows timed after the offer are left out: their clock starts after the pack).
* ``per-token``: one 256 B descriptor per (layer, K/V, token), read from the NHD cache.
* ``single descriptor``: the same payload as one contiguous READ (the transport's floor).

Plus the staged path's parts timed alone: pack (in the prefill process), the one-descriptor
transfer, unpack (in the decode process). Every method's result is checked byte for byte once.
Block ids (``--ids``): ``random`` (a permutation: no runs, the per-block worst case) or ``runs``
(consecutive ids on both sides, as a fresh allocation gives; every method reads the same ids).
Both processes run their agents without NIXL's progress thread (``KVTRITON_NIXL_PROGRESS_THREAD=0``
unless set): with one per agent, identical variants on different agent pairs of one run differed by
up to 1.85x; one pair per process (serving) runs the same either way (docs/results.md).
Run alone: ``python bench/e2e.py [--layers N] [--ids runs]``.
"""

from __future__ import annotations

if not __package__:  # `python bench/e2e.py`: run as `python -m bench.e2e` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

from bench.timing import qfields, quantiles_ms, quantiles_of  # bench/timing.py

HEADS, HEAD_DIM = 8, 128
# tokens per block: 16 unless the matrix's block dimension sets it (run_e2e_matrix ``blocks``: the
# environment reaches each configuration's process and its spawned children; 64: vLLM 0.34's default)
BLOCK = int(os.environ.get("KVTRITON_E2E_BLOCK", "16"))
# (prefill TP, decode TP): decode rank 0 reads global heads 0..dst_heads-1, from source ranks 0..k-1.
# p4d8: one source rank's head 0 of its two (D > P: pack_place applies); p8d4: two source ranks'
# single heads (P > D: read_unpack applies, vLLM's P2->D1 shape)
CASES = {"p4d8": (4, 8), "p8d4": (8, 4)}


def _geometry(case: str) -> tuple[int, int, tuple[int, ...], int, int]:
    """(P_TP, D_TP, source ranks read, heads per source rank, heads of decode rank 0)."""
    p_tp, d_tp = CASES[case]
    src_heads, dst_heads = HEADS // p_tp, HEADS // d_tp
    ranks = tuple(range(max(1, dst_heads // src_heads)))
    return p_tp, d_tp, ranks, src_heads, dst_heads


def _caches(layers: int, num_blocks: int, seed: int):
    """Global heads 0-1 of the model's cache, NHD (K, V per layer): prefill rank 0's two heads
    of P4, or ranks 0 and 1's one head each of P8."""
    import torch

    from kvtriton.testing.oracle import random_bits

    gen = torch.Generator().manual_seed(seed)
    nhd = [[random_bits((num_blocks, BLOCK, 2, HEAD_DIM), torch.bfloat16, gen) for _ in range(2)]
           for _ in range(layers)]
    return nhd


def _agent_kw(kw: dict) -> dict:
    """A variant's TransferAgent keywords (``src_layout`` is the bench's: which cache the prefill registers)."""
    return {k: v for k, v in kw.items() if k != "src_layout"}


def _busy_neighbor(deadline: float) -> None:
    """A CPU-bound neighbor (a busy serving process): spins until ``deadline`` (monotonic), so a
    bench that dies cannot leave it running for long."""
    x = 0
    while time.monotonic() < deadline:
        x += 1


def _prefill(conn, layers: int, num_blocks: int, variants: list[dict], reps: int, case: str = "p4d8") -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(1)
    from kvtriton import Region
    from kvtriton.agent import TransferAgent
    from kvtriton.ops import pack
    from kvtriton.plan import build_plan
    from kvtriton.testing.child import AgentChild
    from kvtriton.transport.nixl import NixlTransport

    p_tp, d_tp, ranks, src_heads, dst_heads = _geometry(case)
    both = _caches(layers, num_blocks, seed=1)
    # each source rank's own heads, contiguous (P8: one head per rank)
    nhd = {r: [[t[:, :, r * src_heads:(r + 1) * src_heads].contiguous() for t in kv] for kv in both] for r in ranks}
    hnd = {r: [[t.transpose(1, 2).contiguous() for t in kv] for kv in nhd[r]] for r in ranks}  # bench-only copy
    # bench-only vLLM 0.33 layout: K||V together per (head, token), head-major blocks
    joint = {r: [torch.cat(kv, -1).transpose(1, 2).contiguous() for kv in nhd[r]] for r in ranks}
    regions = {(r, lay): [Region.attention(f"layer.{i}", k, v, layout=lay, block_size=BLOCK, total_heads=HEADS)
                          for i, (k, v) in enumerate(caches[r])] for r in ranks for lay, caches in (("NHD", nhd),
                                                                                                   ("HND", hnd))}
    # KV: the same joint cache vLLM's direct reads read, registered as vLLM's connector registers it
    # (one K||V stream per layer, head-major: kvtriton.integrations.vllm.caches)
    regions.update({(r, "KV"): [Region.attention(f"layer.{i}", t, layout="HND", block_size=BLOCK, total_heads=HEADS)
                                for i, t in enumerate(joint[r])] for r in ranks})
    agents = [[TransferAgent(f"P{i}", r, p_tp, regions[r, kw.get("src_layout", "NHD")], **_agent_kw(kw))
               for r in ranks] for i, kw in enumerate(variants)]
    every = [a for group in agents for a in group]
    raw = NixlTransport(f"P-raw-{os.getpid()}")
    flat = [t for r in ranks for kv in nhd[r] + hnd[r] for t in kv] + [t for r in ranks for t in joint[r]]
    payload = torch.randint(0, 256, (layers * 2 * num_blocks * BLOCK * HEAD_DIM * 2 * dst_heads,), dtype=torch.uint8)
    raw.register(flat + [payload])

    def add_remote(agent_mds, raw_md) -> None:
        for group, md in zip(agents, agent_mds):
            for a in group:
                a.add_remote(md)
        raw.add_remote(raw_md)

    def hold(req, ids, variant, consumer, chunks, drain, offered) -> dict:  # consumer None: not named
        group = agents[variant]
        end = time.monotonic() + 30
        while drain and any(a.pool.free_slots < a.pool.num_slots for a in group) and time.monotonic() < end:
            for a in group:
                a.progress()  # the last request's ack: its staging is back (one request at a time)
        offers = [a.stats["eager_offers"] for a in group]
        for a in group:
            a.hold(req, ids, lease_s=120, consumer=consumer)
        end = time.monotonic() + 30
        while offered and any(a.stats["eager_offers"] == o for a, o in zip(group, offers)) and time.monotonic() < end:
            for a in group:
                a.progress()  # packed (or, read_unpack, nothing to pack) and offered to the decode
        # else: hold() has returned and nothing more: the pack (if any) runs in the next progress(),
        # racing the decode's fetch, as in an engine whose decode asks the moment the prefill is done
        return dict(packed=sum(a.packed_ahead(req) for a in group), hits=sum(a.stats["eager_hits"] for a in group),
                    pull_hits=sum(a.stats["eager_pull_hits"] for a in group))

    def time_pack(src_ids, dst_specs) -> tuple:  # every source rank's pack for D0, back to back (one process)
        reads = [(r, build_plan(0, d_tp, dst_specs, p_tp, agents[0][k].specs).payload(r))
                 for k, r in enumerate(ranks)]
        ids = np.asarray(src_ids)
        staging = torch.empty(reads[0][1].payload_bytes(ids.size), dtype=torch.uint8)

        def pack_all():
            for r, read in reads:
                pack(regions[r, "NHD"], read.segments, read.segment_offsets(ids.size), ids, staging, impl="torch")
        return quantiles_ms(pack_all, reps)

    def settle(variant) -> bool:  # its last request's Done taken in by each rank, before the next method
        group = agents[variant]

        def waiting() -> bool:  # a hold decode rank 0 (the only one fetching here) is not done with yet
            return any(not h["done_from"] for a in group for h in a.debug_state()["holds"].values())
        end = time.monotonic() + 10
        while waiting() and time.monotonic() < end:
            for a in group:
                a.progress()
        return not waiting()

    def step() -> None:
        for a in every:
            a.progress()
        raw.poll_notifs()  # the passive side of the raw READs must be driven too

    child = AgentChild(conn, every, {"add_remote": add_remote, "hold": hold, "time_pack": time_pack, "settle": settle},
                       step=step, idle_wait_s=0.0005)
    child.ready(dict(agent_md=[[a.metadata() for a in group] for group in agents], raw_md=raw.metadata(),
                     raw_name=raw.name,
                     nhd={r: [[t.data_ptr() for t in kv] for kv in nhd[r]] for r in ranks},
                     hnd={r: [[t.data_ptr() for t in kv] for kv in hnd[r]] for r in ranks},
                     joint={r: [t.data_ptr() for t in joint[r]] for r in ranks}, payload=payload.data_ptr()))
    try:
        child.run()  # closes the agents
    finally:
        raw.close()


# The holds a variant's request is held by (the 4th field, ``eager``), and where its clock starts:
# * False, lazy: no eager packs (``eager_bytes=0``): the decode's pull is served when it arrives;
# * "connector": the hold names no consumer and the prefill packs (and offers) ahead for the only
#   decode engine connected (``eager_guess``): the vLLM connector's holds (its worker's hold() has no
#   consumer unless the ``consumer`` setting is given), so **what a user gets**; the clock starts when
#   the decode fetches right after the prefill's hold() returned: the pack is timed when it is not
#   done by then (the pull takes it over once done), as when the decode asks at once;
# * "named": as "connector" with the consumer named (the connector's ``consumer`` setting), same clock
#   (a way that reads the source's cache is offered from hold() itself under both: nothing to pack);
# * True / "guess": named / guessed as above, but the clock starts once the decode holds the offer:
#   the decode asks after the pack (the prefill finished some time before), never judged.
HOLDS = {False: "lazy", "connector": "connector", "named": "named", True: "offered", "guess": "offered"}
# auto from an HND source, vLLM's own layout (its direct reads here read an HND copy): where a head
# slice is one contiguous range of a block, the planner may take the one-pass way vLLM takes
AUTO_HND = ("pull", 1, 1, False, None, "HND")
# the same with this host's measured cost model (kvtriton.costmodel.load_or_measure, what a connector
# started with cost_model="measured" runs by), the connector's holds: the default model's constants
# are a hand-calibrated CPU guess, and where they misjudge the repack here the measured one picks the way
AUTO_HND_MEASURED = ("pull", 1, 1, "connector", None, "HND", "measured")
# every way the plan allows from each source layout, forced, beside auto (lazy holds, and the ways
# that pack under the connector's holds too: a pack made ahead changes which way is fastest):
# `auto / best` of a layout is then judged against what kvtriton could have done with the same memory,
# same run (NHD: a head slice of an NHD block is not one range, so no zero-copy way)
WAYS_NHD_CONNECTOR = [("pull", 1, 1, "connector", w) for w in ("staged", "pack_place")]
WAYS_HND = [("pull", 1, 1, False, w, "HND") for w in ("staged", "pack_place", "direct_slice")] + \
    [("pull", 1, 1, "connector", w, "HND") for w in ("staged", "pack_place")]
# vLLM's own layout on both sides (K||V one stream, head-major): the memory its direct reads read
AUTO_KV = ("pull", 1, 1, False, None, "KV")
# the hold names its consumer (a connector's `consumer` setting, a fixed P/D pairing): a way that
# reads the source's cache is offered from hold() itself, so a load that finds the offer READs at
# once with no round trip to the prefill first, as vLLM's reads do (the connector's unnamed holds are
# offered so to the guessed engine too: kvtriton.agent.source.eager); clock after the offer (decode
# asks after the prefill) and at once
AUTO_KV_EAGER = ("pull", 1, 1, True, None, "KV")
AUTO_KV_NAMED = ("pull", 1, 1, "named", None, "KV")
WAYS_KV = [("pull", 1, 1, False, w, "KV") for w in ("staged", "pack_place", "direct_slice")] + \
    [("pull", 1, 1, "connector", w, "KV") for w in ("staged", "pack_place")]
#: auto under the connector's holds, per source layout: the rows the main job judges
AUTO_CONNECTOR = [("pull", 1, 1, "connector", None, lay) for lay in ("NHD", "HND", "KV")]
VARIANTS = [("pull", 1, 1, False, "staged"), ("push", 1, 1, False, "staged"), ("pull", 8, 2, False, "staged"),
            ("pull", 1, 1, True, "staged"), ("pull", 1, 1, False, "pack_place"), ("pull", 1, 1, True, "pack_place"),
            ("pull", 1, 1, False, None), ("pull", 1, 1, "guess", "staged"), AUTO_CONNECTOR[0], *WAYS_NHD_CONNECTOR,
            AUTO_HND, AUTO_CONNECTOR[1], AUTO_HND_MEASURED, *WAYS_HND,
            AUTO_KV, AUTO_CONNECTOR[2], AUTO_KV_EAGER, AUTO_KV_NAMED, *WAYS_KV]
# P > D: read_unpack instead of pack_place (lazy: the pull is answered by RunsReady, no pack; eager:
# the hold is offered for reading straight from the cache, no pull at all)
VARIANTS_BY_CASE = {"p4d8": VARIANTS,
                    "p8d4": [("pull", 1, 1, False, "staged"), ("push", 1, 1, False, "staged"),
                             ("pull", 1, 1, True, "staged"), ("pull", 1, 1, False, "read_unpack"),
                             ("pull", 1, 1, True, "read_unpack"), ("pull", 1, 1, False, None), AUTO_CONNECTOR[0],
                             ("pull", 1, 1, "connector", "staged"), AUTO_HND, AUTO_CONNECTOR[1], AUTO_HND_MEASURED,
                             *[("pull", 1, 1, False, w, "HND") for w in ("staged", "read_unpack", "direct_slice")],
                             ("pull", 1, 1, "connector", "staged", "HND"),
                             AUTO_KV, AUTO_CONNECTOR[2], AUTO_KV_EAGER, AUTO_KV_NAMED,
                             *[("pull", 1, 1, False, w, "KV") for w in ("staged", "read_unpack", "direct_slice")],
                             ("pull", 1, 1, "connector", "staged", "KV")]}
#: timed rounds of a quick run (the sweep's): rounds interleave every method, so a burst of load on a
#: shared host hits them alike; fewer rounds leave a median one burst away from the next method's
QUICK_REPS = 9  # 5 before issue 36 point 1: ~10 s more per configuration (of ~60) on a 2-core host
#: a run with a busy neighbour times this many times an idle run's rounds: there one fetch takes ~10 ms or ~18 ms
#: (whether the neighbour shares its core for a time slice), flipping from one fetch to the next, so a
#: median of 9 lands in either mode: identical work differed by up to 1.24x between two such medians;
#: with 27 rounds the same pairs agreed within 3% (docs/results.md); ~15 s more on a 2-core host
BUSY_ROUNDS = 3
#: how each source layout is named in a method (KV: vLLM's joint K||V cache on both sides)
SOURCE_LABEL = {"NHD": "", "HND": ", HND source", "KV": ", vLLM K||V layout"}


def _method(mode: str, chunks: int, inflight: int, eager, way: str | None, src_layout: str = "NHD",
            cost: str = "default") -> str:
    return (f"kvtriton {way or 'auto'}, {mode}{_eager_label(eager)}, {chunks} chunk(s) x {inflight}"
            " in flight" + SOURCE_LABEL[src_layout]
            + ("" if cost == "default" else f", {cost} model"))


def _eager_label(eager) -> str:
    """How a variant's hold is packed (:data:`HOLDS`): lazily (''), ahead for its named consumer or
    for the only engine connected (no consumer named: the vLLM connector's holds), the decode asking
    at once or after the offer."""
    return {False: "", True: " eager", "guess": " eager-guess, asked after the pack",
            "connector": " connector hold", "named": " eager, asked at once"}[eager]


def run_e2e_bench(quick: bool = False, layers: int | None = None, tokens: int = 8192,
                  variants: list[tuple] | None = None, busy: int = 0,
                  per_token: bool = True, transport: str = "", ids: str = "random", case: str = "p4d8",
                  reps: int | None = None) -> list[dict]:
    """One process pair, one transport (whatever ``UCX_TLS`` this process started with).

    ``variants``: kvtriton configurations as (mode, chunks per request, chunks in flight[, eager[,
    way]]), ``way`` the mode forced on every region (None: the cost model's choice per request);
    default :data:`VARIANTS`: staged with one chunk (pull and push), 8 pipelined chunks (pull) and
    one chunk packed at hold time (pull, eager: True, the hold names its consumer; ``"guess"``,
    it names none and the prefill guesses its only connected engine; staging and
    ``eager_bytes`` fit the whole request), pack_place lazy and eager, and auto. ``busy``: CPU-bound
    neighbor processes spinning on the same cores for the whole measurement (bounded: they stop
    by themselves after 300 s). ``per_token``: time the (slow) per-token baseline too.
    """
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from kvtriton.transport.progress import ENV as NIXL_THREAD_ENV

    # No NIXL progress thread in either process (the prefill child inherits this): each process holds
    # one agent per variant (~28), and with a thread each, identical work on two agent pairs of one run
    # differed by up to 1.85x, disjoint p20-p80, a different pair slow each run: auto / best then judged
    # which pair was slow. One pair per process (serving) ran the same median with or without it. The
    # prefill's loop progresses its agents between its calls, so its flush answers stay prompt.
    # (docs/results.md, "The e2e's agent pairs"); this process's own setting comes back at the end
    thread_env = os.environ.get(NIXL_THREAD_ENV)
    os.environ.setdefault(NIXL_THREAD_ENV, "0")
    from kvtriton import Region
    from kvtriton.agent import TransferAgent
    from kvtriton.ops import unpack
    from kvtriton.plan import ceil_div
    from kvtriton.testing.child import ChildProcess
    from kvtriton.transport.nixl import NixlTransport

    layers = layers or (4 if quick else 16)
    reps = reps or (QUICK_REPS if quick else 9) * (BUSY_ROUNDS if busy else 1)
    n = tokens // BLOCK
    num_blocks = n + 8
    p_tp, d_tp, ranks, src_heads, dst_heads = _geometry(case)
    h_read = min(src_heads, dst_heads)  # heads decode rank 0 reads from each source rank
    payload = layers * 2 * n * BLOCK * HEAD_DIM * 2 * dst_heads  # bytes decode rank 0 receives
    variants = [tuple(v) + (False, "staged", "NHD", "default")[len(v) - 3:]
                for v in (variants or VARIANTS_BY_CASE[case])]
    if any(v[6] == "measured" for v in variants):
        from kvtriton.costmodel import load_or_measure

        measured = load_or_measure("cpu", "torch")  # cached per host; measured once otherwise
    slot = 256 << 10
    agent_kw = []
    for mode, chunks, inflight, eager, way, src_layout, cost in variants:
        chunk = ceil_div(payload // len(ranks) // chunks, slot) * slot  # one source rank's payload
        # eager: the whole request packed ahead, plus the staging its engine's lazy pulls keep
        staging = ((chunks + inflight) if eager else inflight) * chunk
        agent_kw.append(dict(staging_bytes=staging, slot_bytes=slot, chunk_bytes=chunk, mode=mode,
                             inflight_chunks=inflight, impl="torch", timeout_s=60,
                             eager_bytes=chunks * chunk if eager else 0,
                             eager_guess=eager in ("guess", "connector"),
                             modes=way, src_layout=src_layout, **({"cost": measured} if cost == "measured" else {})))
    prefill = ChildProcess(_prefill, layers, num_blocks, agent_kw, reps, case, name="prefill")
    ctx = mp.get_context("spawn")
    neighbors = [ctx.Process(target=_busy_neighbor, args=(time.monotonic() + 300,), daemon=True)
                 for _ in range(busy)]
    rows: list[dict] = []
    agents: list = []
    raw = None
    try:
        info = prefill.ready(120)
        rng = np.random.default_rng(0)
        if ids == "runs":  # a fresh allocation: consecutive blocks on both sides
            src_ids, dst_ids = np.arange(n) + 3, np.arange(n) + 5
        else:
            src_ids = rng.permutation(num_blocks)[:n]
            dst_ids = rng.permutation(num_blocks)[:n]
        k_caches = [[torch.empty(num_blocks, dst_heads, BLOCK, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
                    for _ in range(layers)]
        # the vLLM 0.33 layout on the decode side: K||V per (head, token), head-major blocks
        joint = [torch.empty(num_blocks, dst_heads, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16) for _ in range(layers)]
        regions = [Region.attention(f"layer.{i}", k, v, layout="HND", block_size=BLOCK, total_heads=HEADS)
                   for i, (k, v) in enumerate(k_caches)]
        kv_regions = [Region.attention(f"layer.{i}", t, layout="HND", block_size=BLOCK, total_heads=HEADS)
                      for i, t in enumerate(joint)]  # vLLM's layout: the variants with a KV source land here
        agents = [TransferAgent(f"D{i}", 0, d_tp, kv_regions if kw["src_layout"] == "KV" else regions,
                                **_agent_kw(kw)) for i, kw in enumerate(agent_kw)]
        raw = NixlTransport(f"D-raw-{os.getpid()}")
        flat = [t for kv in k_caches for t in kv]
        landing = torch.empty(payload, dtype=torch.uint8)
        raw.register(flat + joint + [landing])
        for a, mds in zip(agents, info["agent_md"]):
            for md in mds:
                a.add_remote(md)
        raw_peer = raw.add_remote(info["raw_md"])
        prefill.call("add_remote", [a.metadata() for a in agents], raw.metadata(), timeout_s=None)
        for nb in neighbors:
            nb.start()

        expected = _expected(layers, num_blocks, src_ids, dst_heads)

        def check(what: str) -> None:
            for i, (k, v) in enumerate(k_caches):
                for j, t in enumerate((k, v)):
                    got = t[torch.as_tensor(dst_ids)].view(torch.uint8)
                    if not torch.equal(got, expected[i][j]):
                        raise AssertionError(f"{what}: layer {i} stream {j} differs from the source head")

        def check_joint(what: str = "direct K||V") -> None:
            for i, t in enumerate(joint):
                got = t[torch.as_tensor(dst_ids)].view(torch.uint8)
                if not torch.equal(got, torch.cat(expected[i], -1)):
                    raise AssertionError(f"{what}: layer {i} differs from the source head")

        def clear() -> None:
            for t in flat + joint:
                t.view(torch.uint8).fill_(0xA5)

        def post_and_wait(op, local, li, remote, ri) -> None:
            x = raw.post(op, local, li, remote, ri)
            while raw.poll(x).name != "DONE":
                pass
            raw.release(x)

        def prep(l_rows, r_rows):
            ll = raw.prep_local(np.concatenate(l_rows).astype(np.int64), "DRAM")
            rl = raw.prep_remote(raw_peer, np.concatenate(r_rows).astype(np.int64), "DRAM")
            return ll, rl, np.arange(ll.count)

        def descs(addrs, size):
            return np.stack([addrs, np.full(addrs.size, size), np.zeros(addrs.size, np.int64)], 1)

        # -- one descriptor: the same bytes, one READ (the pull floor) and one WRITE (the push floor)
        one_l = raw.prep_local(np.array([[landing.data_ptr(), payload, 0]]), "DRAM")
        one_r = raw.prep_remote(raw_peer, np.array([[info["payload"], payload, 0]]), "DRAM")
        # every timed method is run once and checked here, then timed in interleaved rounds below
        timed = {"read": lambda: post_and_wait("READ", one_l, [0], one_r, [0]),
                 "write": lambda: post_and_wait("WRITE", one_l, [0], one_r, [0])}
        timed["read"]()
        timed["write"]()

        # -- vLLM 0.33 direct reads: one K||V head slice per (source rank, layer, block), HND joint cache
        kv_bytes = BLOCK * 2 * HEAD_DIM * 2  # one head's K||V tile
        size = h_read * kv_bytes
        l_rows = [descs(joint[i].data_ptr() + dst_ids * dst_heads * kv_bytes + k * size, size)
                  for k in range(len(ranks)) for i in range(layers)]
        r_rows = [descs(info["joint"][r][i] + src_ids * src_heads * kv_bytes, size)
                  for r in ranks for i in range(layers)]
        p_l, p_r, pidx = prep(l_rows, r_rows)
        clear()
        timed["packed"] = lambda: post_and_wait("READ", p_l, pidx, p_r, pidx)
        timed["packed"]()
        check_joint()

        # -- K/V as separate streams: one head slice per (source rank, layer, K/V, block), HND copy
        head_bytes = BLOCK * HEAD_DIM * 2
        blk_bytes = src_heads * head_bytes  # one HND block of a source rank
        slice_bytes = h_read * head_bytes
        l_rows = [descs(k_caches[i][j].data_ptr() + dst_ids * dst_heads * head_bytes + k * slice_bytes, slice_bytes)
                  for k in range(len(ranks)) for i in range(layers) for j in range(2)]
        r_rows = [descs(info["hnd"][r][i][j] + src_ids * blk_bytes, slice_bytes)
                  for r in ranks for i in range(layers) for j in range(2)]
        d_l, d_r, idx = prep(l_rows, r_rows)
        clear()
        timed["direct"] = lambda: post_and_wait("READ", d_l, idx, d_r, idx)
        timed["direct"]()
        check("direct")

        # -- per-token reads from the NHD cache: 256 B rows of head 0
        token_q = None
        if per_token:
            tok = np.arange(BLOCK)
            r_rows, l_rows = [], []
            for k, r in enumerate(ranks):
                for i in range(layers):
                    for j in range(2):
                        src = info["nhd"][r][i][j] + (src_ids[:, None] * blk_bytes
                                                      + tok[None, :] * src_heads * HEAD_DIM * 2).reshape(-1)
                        for h in range(h_read):  # HND destination: one row per (token, head)
                            dst = k_caches[i][j].data_ptr() + (dst_ids[:, None] * dst_heads * head_bytes
                                                               + (k * h_read + h) * head_bytes
                                                               + tok[None, :] * HEAD_DIM * 2).reshape(-1)
                            r_rows.append(descs(src + h * HEAD_DIM * 2, HEAD_DIM * 2))
                            l_rows.append(descs(dst, HEAD_DIM * 2))
            t_l, t_r, tidx = prep(l_rows, r_rows)
            clear()
            token_q = quantiles_ms(lambda: post_and_wait("READ", t_l, tidx, t_r, tidx), 3)
            check("per-token")

        # -- the staged path's parts, each alone
        # the parts of the K/V-separate caches (the first such variant's plan: a KV variant's caches differ)
        sep = next((j for j, v in enumerate(variants) if v[5] != "KV"), None)
        if sep is None:
            raise ValueError("e2e: the staged parts are timed on the K/V-separate caches; give one variant of them")
        pack_q = prefill.call("time_pack", src_ids.tolist(), agents[sep].specs, timeout_s=None)
        reads = [agents[sep].plan_for(f"P{sep}").payload(r) for r in ranks]
        stage = torch.empty(reads[0].payload_bytes(n), dtype=torch.uint8)

        def unpack_all():
            for read in reads:
                unpack(regions, read.segments, read.segment_offsets(n), dst_ids, stage, impl="torch")
        unpack_q = quantiles_ms(unpack_all, reps)

        # -- kvtriton staged, end to end through the agents, per variant
        counter = [0]
        title = (f"llama3-70b-like ({layers} layers) P{p_tp}->D{d_tp} block {BLOCK}, NHD source, {tokens} tokens, "
                 f"{ids} block ids")
        # a block size other than 16 is its own table in the summary (bench/report.py tables by pair)
        common = dict(case=title, pair=case if BLOCK == 16 else f"{case} block {BLOCK}",
                      transport=transport or _transport_label(),
                      host="busy" if busy else "idle", bytes=payload, ids=ids, block=BLOCK)
        ndescs = [[0] for _ in variants]
        setups, held = {}, {}  # untimed: the hold (and for eager its pack) before each timed fetch
        tails = {}  # untimed: what each fetch sends and frees after its result, before the next method
        for i, (mode, chunks, inflight, eager, way, src_layout, cost) in enumerate(variants):

            def hold(i=i, eager=eager, chunks=chunks, way=way, agent=agents[i]) -> None:
                req = f"r{counter[0]}"
                counter[0] += 1
                offered = HOLDS[eager] == "offered"  # else the clock starts right after hold() returned
                held[i] = dict(prefill.call("hold", req, src_ids.tolist(), i,
                                            f"D{i}" if eager in (True, "named") else None, chunks, bool(eager),
                                            offered, timeout_s=None), req=req)
                # auto may take a way that reads the cache itself: offered at hold time, nothing packed
                if offered and way not in ("read_unpack", "direct_slice", None) and \
                        held[i]["packed"] < chunks * len(ranks):
                    raise AssertionError(f"eager {way}: {held[i]['packed']} of {chunks * len(ranks)} chunks "
                                         "packed at hold time")
                end = time.monotonic() + 30
                while offered and _offers(agent, req) < len(ranks) and time.monotonic() < end:
                    agent.progress()  # the decode has the offer before it fetches

            def staged(i=i, agent=agents[i], ndesc=ndescs[i]) -> None:
                req = held.pop(i)["req"]
                agent.fetch(req, f"P{i}", src_ids, dst_ids)
                while True:
                    agent.progress()
                    res = agent.results()
                    if res:
                        if not res[0].ok:
                            raise res[0].error
                        ndesc[0] = res[0].descriptors
                        return

            def tail(i=i, agent=agents[i]) -> None:
                agent.progress()  # its Dones and fence: the connector's thread sends them right after the result
                if not prefill.call("settle", i, timeout_s=None):  # and the prefill takes them in
                    raise AssertionError(f"e2e: variant {i}'s Dones were not taken in within 10 s")

            clear()
            hold()
            staged()
            (check_joint if src_layout == "KV" else check)(_method(mode, chunks, inflight, eager, way, src_layout,
                                                                   cost))
            tail()
            timed[f"staged{i}"] = staged
            setups[f"staged{i}"] = hold
            tails[f"staged{i}"] = tail

        # interleaved rounds: a burst of load on this shared machine hits every method alike. Each kvtriton
        # fetch's end (its Dones and fence, the prefill taking them in) runs untimed right after it, as the
        # connector's thread sends them after the result: left to the next round, it ran inside the same
        # variant's next fetch and, in the prefill, beside the next method's, and two identical variants
        # differed by up to 1.22x by their place in the round (docs/results.md)
        samples: dict[str, list[float]] = {k: [] for k in timed}
        for _ in range(reps):
            for k, fn in timed.items():
                if k in setups:
                    setups[k]()
                samples[k].append(quantiles_ms(fn, 1, warmup=0)[1])
                if k in tails:
                    tails[k]()
        for i, v in enumerate(variants):  # every eager fetch found its pack (the source counts hits)
            if v[3]:
                setups[f"staged{i}"]()  # and at once: how they were served (the row's note)
            if HOLDS[v[3]] == "offered":
                want = (reps + 1) * len(ranks)
                if held[i]["hits"] < reps or agents[i].stats["offers_taken"] != want:
                    raise AssertionError(f"eager: {agents[i].stats['offers_taken']} of {want} fetch parts took "
                                         f"the offer, {held[i]['hits']} hits at the source")
        qs = {k: quantiles_of(v) for k, v in samples.items()}
        read_q, write_q, packed_q, direct_q = qs["read"], qs["write"], qs["packed"], qs["direct"]
        staged_rows = []
        for i, (mode, chunks, inflight, eager, way, src_layout, cost) in enumerate(variants):
            q = qs[f"staged{i}"]
            floor = read_q[1] if mode == "pull" else write_q[1]
            st = agents[i].stats
            used = way or ("one-sided" if st["one_sided_descriptors"] else "staged" if st["staged_descriptors"]
                           else "direct")
            one = (("pack_place" if case == "p4d8" else "read_unpack") if used == "one-sided" else used)
            place, read_ru = one == "pack_place", one == "read_unpack"
            hold_kind = HOLDS[eager]
            ahead = hold_kind == "offered"  # the pack ran before the clock started
            parts = (0 if ahead or read_ru else pack_q[1]) + floor + (0 if place else unpack_q[1])
            lazy = [j for j, w in enumerate(variants) if w == (mode, chunks, inflight, False, way, src_layout, cost)]
            vs_lazy = f"; lazy/this = {qs[f'staged{lazy[0]}'][1] / q[1]:.2f}x" if eager and lazy else ""
            if hold_kind in ("connector", "named"):  # asked at once: what served the fetches
                vs_lazy += (f"; of {reps + 1} fetches, {agents[i].stats['offers_taken'] // len(ranks)} took an offer, "
                            f"{held[i]['pull_hits'] // len(ranks)} pulled a pack made ahead, "
                            f"{(held[i]['hits'] - held[i]['pull_hits']) // len(ranks)} took an offer over by a pull "
                            f"or read it (the source's count)")
            if one in ("direct", "direct_slice"):  # no pass to sum; the same reads without the protocol: the floor
                same = packed_q if src_layout == "KV" else direct_q  # the raw reads of the same memory
                how = (f"{'' if way else 'ran direct_slice; '}the same head-slice reads posted raw / this = "
                       f"{same[1] / q[1]:.2f}x")
            else:
                how = (f"{'' if way else f'ran {one}; '}{q[1] / parts:.2f}x the sum of its parts "
                       f"({'' if ahead or read_ru else 'pack + '}one {'READ' if mode == 'pull' else 'WRITE'}"
                       f"{'' if place else ' + unpack'})")
            staged_rows.append(dict(
                common, method=_method(mode, chunks, inflight, eager, way, src_layout, cost), descriptors=ndescs[i][0],
                **qfields("ms", q, 2), source=src_layout, hold=hold_kind,
                role="eager" if ahead else "auto" if way is None else "way",
                way="direct_slice" if one == "direct" else one,  # SPLIT heads only here: a slice, not DIRECT
                note=(f"{how}; vLLM K||V direct/this = {packed_q[1] / q[1]:.2f}x; "
                      f"K/V-separate direct/this = {direct_q[1] / q[1]:.2f}x{vs_lazy}")))
        rows += staged_rows
        rows += [
            dict(common, method="vLLM 0.33 direct 8 KiB K||V reads", descriptors=p_l.count,
                 **qfields("ms", packed_q, 2), source="KV", role="raw",
                 note="headline baseline: one read per (layer, block)"),
            dict(common, method="direct 4 KiB reads, K/V separate", descriptors=d_l.count,
                 **qfields("ms", direct_q, 2), source="HND", role="raw", note="one read per (layer, K/V, block)"),
        ]
        if token_q is not None:  # the only reads of a head slice an NHD block allows
            rows.append(dict(common, method="per-token 256 B reads", descriptors=t_l.count,
                             **qfields("ms", token_q, 2), source="NHD", role="raw", note=""))
        rows += [
            dict(common, method="single descriptor READ (pull floor)", descriptors=1, **qfields("ms", read_q, 2),
                 note=""),
            dict(common, method="single descriptor WRITE (push floor)", descriptors=1, **qfields("ms", write_q, 2),
                 note=""),
            dict(common, method="part: pack alone", descriptors=0, **qfields("ms", pack_q, 2), note="prefill process"),
            dict(common, method="part: unpack alone", descriptors=0, **qfields("ms", unpack_q, 2),
                 note="decode process"),
        ]
        for r in rows:
            r["gbps"] = round(r["bytes"] / r["ms"] / 1e6, 2) if r["ms"] else ""
        prefill.request_exit()
    finally:
        for nb in neighbors:
            if nb.is_alive():
                nb.terminate()
            nb.join(5)
        for a in agents:
            a.close()
        if raw is not None:
            raw.close()
        if thread_env is None:
            os.environ.pop(NIXL_THREAD_ENV, None)
        prefill.close()
    return rows


def _transport_label() -> str:
    tls = os.environ.get("UCX_TLS", "")
    return f"UCX_TLS={tls}" if tls else "UCX default (shared memory)"


# (label, UCX_TLS or None for UCX's default choice, busy neighbors). NIXL's UCX backend does not
# start with UCX_TLS limited to shared memory (it needs tcp for its wireup), so shared memory is
# UCX's default choice on one host (cma/posix for the bytes).
CONFIGS = [("shm", None, 0), ("tcp", "tcp", 0), ("shm", None, 1), ("tcp", "tcp", 1)]
IDS = ("random", "runs")  # block-id patterns the matrix runs each config with
PAIRS = ("p4d8", "p8d4")  # the geometries (CASES) the matrix runs


def run_e2e_matrix(quick: bool = False, configs=CONFIGS, timeout_s: float = 240, ids=IDS,
                   pairs=PAIRS, progress=None, blocks=(16,)) -> list[dict]:
    """:func:`run_e2e_bench` per (pair, block ids, transport, host load), each in fresh processes:
    UCX reads ``UCX_TLS`` once, when the first agent starts. Per-token reads run only in the
    first config of each pair. ``progress(what)``: called as each configuration finishes.
    ``blocks``: the block sizes (tokens) each configuration runs at."""
    import json
    import subprocess
    import tempfile

    rows: list[dict] = []
    for k, (pair, block, id_kind, (label, tls, busy)) in enumerate(
            (p, b, i, c) for p in pairs for b in blocks for i in ids for c in configs):
        env = {**os.environ, "KVTRITON_E2E_BLOCK": str(block)}
        env.pop("UCX_TLS", None)
        if tls:
            env["UCX_TLS"] = tls
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, os.path.abspath(__file__), "--json", f.name, "--transport", label,
                   "--busy", str(busy), "--ids", id_kind, "--case", pair] + (["--quick"] if quick else []) + \
                ([] if k % (len(ids) * len(configs)) == 0 else ["--no-per-token"])
            print(f"e2e: {pair}, block {block}, {label}, {'busy' if busy else 'idle'} host, {id_kind} ids ...",
                  flush=True)
            try:
                res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
                ok = res.returncode == 0
                err = res.stderr[-300:]
            except subprocess.TimeoutExpired:
                ok, err = False, f"timed out after {timeout_s} s"
            if progress is not None:
                progress(f"{pair} b{block} {label} {'busy' if busy else 'idle'} {id_kind}")
            if not ok:
                rows.append(dict(case="e2e", pair=pair, transport=label, host="busy" if busy else "idle", ids=id_kind,
                                 block=block, method="failed", note=err.replace("\n", " ")))
                continue
            rows += json.load(open(f.name))
    return rows


def _expected(layers: int, num_blocks: int, src_ids: np.ndarray, dst_heads: int = 1):
    """Global heads ``[0, dst_heads)`` of the prefill's blocks ``src_ids``, as HND tiles, per
    layer and stream (bytes)."""
    import torch

    nhd = _caches(layers, num_blocks, seed=1)  # the prefill's content, regenerated from its seed
    ids = torch.as_tensor(src_ids)
    return [[t[ids][:, :, 0:dst_heads].transpose(1, 2).contiguous().view(torch.uint8) for t in kv] for kv in nhd]


def _offers(agent, req: str) -> int:
    """Source ranks whose offer of ``req`` the decode agent holds."""
    return sum(req in offers for offers in agent.debug_state()["offers"].values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound neighbor processes on the same cores")
    ap.add_argument("--transport", default="", help="label of this run's transport (UCX_TLS sets it)")
    ap.add_argument("--no-per-token", action="store_true")
    ap.add_argument("--ids", default="random", choices=["random", "runs"], help="block ids: a permutation or runs")
    ap.add_argument("--case", default="p4d8", choices=sorted(CASES), help="P->D geometry (see CASES)")
    ap.add_argument("--json", default=None, help="write the rows here as JSON (used by the sweep)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed rounds (default: 9, --quick: QUICK_REPS; BUSY_ROUNDS times that with --busy)")
    args = ap.parse_args()
    rows = run_e2e_bench(args.quick, args.layers, busy=args.busy, per_token=not args.no_per_token,
                         transport=args.transport, ids=args.ids, case=args.case, reps=args.reps)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(rows, f)
    for r in rows:
        print(f"{r['method']:<48} {r['descriptors']:>9} desc {r['ms']:>9.2f} ms "
              f"[{r['ms_p20']:.2f}-{r['ms_p80']:.2f}] {r['gbps']:>7} GB/s  {r['note']}")


if __name__ == "__main__":
    main()
