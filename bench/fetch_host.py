"""Host time of one small zero-copy fetch: what decides the small real-engine cells.

A small request (a few hundred tokens: ~1-2 MB) loads within one or two engine steps whichever
connector moves it, so its time to KV loaded is the host work around the READs: planning the
request, posting, polling, the protocol's messages. This times exactly that, in one process
over NIXL (UCX on this host), P2 -> D1, for the three small models of ``bench/pd_vllm.py``'s
cells: a DeepSeek-V2-like MLA cache (REPLICATE latents, DIRECT runs), the small Llama on vLLM's
CPU cache (one K||V stream per layer, K dim-major: DIRECT_SLICE head slices) and that Llama with
an MLA draft layer in the same blocks (both). 22 blocks of 16 tokens, ids scattered; REPLICATE
regions read from one prefill replica, as the vLLM connector does by default.

* ``kvtriton``: the decode rank's own time in ``fetch()`` and every ``progress()``/``results()``
  call until its result, through real agents, the prefill ranks' holds offered ahead
  (``consumer`` named, what the vLLM connector does) and the prefill ranks progressed between
  its polls (untimed: their own processes when serving); checked byte for byte against the
  global-head oracle once. The result comes when the bytes landed; the Done to each source rank
  and the fence go in the decode's next ``progress()`` (``Fetches.finish``), timed too: the
  ``kvtriton_all`` column is both together, its ratio to ``floor+done`` the agent's whole cost;
* ``floor``: the same READs posted raw over lists prepared once (what NixlConnector posts per
  request: one READ per source rank, indices into per-block descriptor lists), the time in
  its own post and poll calls: no agent, no messages, no protocol. The ratio kvtriton / floor
  is the agent's per-request overhead on the decode's thread, the engine's;
* ``floor+notif``: the same, each source rank's READ carrying a completion notice (the request's
  id) as NixlConnector's READs do (its prefill frees the blocks on it): what any correct transfer
  tells its source, a message the plain floor leaves out. A separate column; ``floor`` is as
  before. (A READ that carries a notice leaves the endpoint waiting on the peer's next progress,
  as a message does: the next request's READ completes at that progress, its polls timed.)
* ``floor+done``: the raw READs, then what kvtriton's protocol itself sends once they landed,
  posted raw too: a Done message to every source rank (``send_notif``) and a fence (one 64-byte
  READ re-posted to each source rank READ from, :mod:`kvtriton.transport.fence`, which keeps the
  next request's READs from waiting on the peer). ``kvtriton_all`` / floor+done is the agent's
  Python alone: its plan, parts, rows and bookkeeping.

A READ's completion here also waits for the source's UCX worker to progress once the decode has
sent that source any message (NIXL completes a transfer with an endpoint flush, which then needs
the peer's answer): the prefill's progress cadence bounds it in serving (its agent's thread,
``progress_interval_s``; NixlConnector's prefill spins NIXL's own progress thread instead).

``--cold``: before each timed request (kvtriton's and every floor's), an untimed copy of
:data:`COLD_BYTES` through this thread evicts the caches, as the large READ before a fetch (the
e2e's rows) or the engine's forward pass between steps (serving) does. Every call after it runs
slower until its code and data are back in cache, the floor's posts as well as the agent's Python;
``bench/fetch_phases.py --cold`` splits kvtriton's side by phase.

Requests alternate between kvtriton and the floors, so load on a shared host hits both alike. Run alone:
``python bench/fetch_host.py [--reps 40] [--cold]``; an older kvtriton (a checkout on ``PYTHONPATH``)
with ``--no-floor``.
"""

from __future__ import annotations

if not __package__:  # `python bench/fetch_host.py`: run as `python -m bench.fetch_host` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import argparse
import time

import numpy as np
import torch

from bench.timing import qfields, quantiles_of  # bench/timing.py

NUM_BLOCKS, BLOCK, BLOCKS_PER_REQUEST = 136, 16, 22
P_TP, D_TP = 2, 1
#: what the decode's calls are timed by: wall time, or (``--cpu``) the thread's CPU time, which a
#: host shared with other work inflates far less (the ratio of both sides alike)
_clock = time.perf_counter
#: ``--cold``: bytes copied (untimed) before each timed request: this host's whole L3 (32 MiB) and 32x
#: a core's L2 (a 16 MiB READ is what precedes a fetch in the e2e's block-64 rows)
COLD_BYTES = 32 << 20
_cold: list[np.ndarray] = []  # (source, destination) of the copy, when --cold


def arm_cold(cold: bool) -> None:
    """Hold the copy's buffers (``cold``) or none; :func:`_evict` copies through them."""
    _cold[:] = [np.ones(COLD_BYTES, dtype=np.uint8), np.zeros(COLD_BYTES, dtype=np.uint8)] if cold else []


def _evict() -> None:
    """The untimed copy before a timed request (``--cold``); nothing otherwise."""
    if _cold:
        np.copyto(_cold[1], _cold[0])


def _models(kind: str):
    from kvtriton.testing.oracle import RegionModel

    gqa = [RegionModel.gqa(f"layer.{i}", 2, 32, torch.float32) for i in range(2)]
    mla = [RegionModel.mla(f"mla.{i}", 576, torch.float32) for i in range(2)]
    return {"mla": mla, "gqa": gqa, "gqa+mla-draft": gqa + mla[:1]}[kind]


CASES = ("mla", "gqa", "gqa+mla-draft")


class Case:
    """Two prefill ranks and one decode rank of one model kind, in this process."""

    def __init__(self, kind: str, seed: int, stripe: int | None = 1, sealed: bool = False):
        from kvtriton.agent import TransferAgent
        from kvtriton.testing.oracle import make_global_kv, make_rank_regions

        self.kind, self.models = kind, _models(kind)
        gen = torch.Generator().manual_seed(seed)
        self.src = [make_rank_regions(self.models, r, P_TP, NUM_BLOCKS, BLOCK, layout="HND", storage="vllm_cpu",
                                      gen=gen) for r in range(P_TP)]
        self.dst = make_rank_regions(self.models, 0, D_TP, NUM_BLOCKS, BLOCK, layout="HND", storage="vllm_cpu",
                                     gen=gen)
        self.kv = make_global_kv(self.models, BLOCKS_PER_REQUEST, BLOCK, gen)
        # REPLICATE regions from ``stripe`` replicas: 1, the vLLM connector's default (as
        # NixlConnector reads an MLA latent); None, the agent's (every replica serves)
        self.stripe = stripe
        kw = dict(staging_bytes=8 << 20, timeout_s=30.0, impl="torch", replicate_stripe=stripe)
        self.p = [TransferAgent(f"P-{kind}", r, P_TP, self.src[r], **kw) for r in range(P_TP)]
        self.d = TransferAgent(f"D-{kind}", 0, D_TP, self.dst, **kw)
        for a in self.p:  # sealed: each pair with the keys a meeting with the shared secret gives
            dk, pk = _pair_keys() if sealed else (None, None)
            self.d.add_remote(a.metadata(), keys=dk)
            a.add_remote(self.d.metadata(), keys=pk)
        self.rng = np.random.default_rng(seed)
        self.count = 0
        self.after_ms = 0.0  # the last request's host time after its result (its Dones and fence)
        self.descriptors = 0
        self.ways = ""

    def ids(self) -> tuple[np.ndarray, np.ndarray]:
        return (self.rng.permutation(NUM_BLOCKS)[:BLOCKS_PER_REQUEST],
                self.rng.permutation(NUM_BLOCKS)[:BLOCKS_PER_REQUEST])

    def fetch_ms(self, check: bool = False) -> float:
        """One request: holds offered ahead (untimed), then fetch() to its result (timed)."""
        from kvtriton.testing.oracle import check_destination, load_source, snapshot

        src, dst = self.ids()
        req = f"{self.kind}-{self.count}"
        self.count += 1
        if check:
            for r, regs in enumerate(self.src):
                load_source(regs, r, P_TP, self.kv, src)
            before = snapshot(self.dst)
        for a in self.p:
            a.hold(req, src, lease_s=30, consumer=f"D-{self.kind}")
        deadline = time.monotonic() + 10
        while not self.d.has_offer(f"P-{self.kind}", req):  # what an engine step later finds in place
            for a in (*self.p, self.d):
                a.progress()
            if time.monotonic() > deadline:
                raise TimeoutError(f"fetch_host: no offer of {req} in 10 s")
        for _ in range(8):  # every offer (one per prefill rank) taken in
            for a in (*self.p, self.d):
                a.progress()
        # the decode rank's own time: its fetch() and every progress() and results() call until the
        # result; the prefill ranks (their own processes when serving) progress between its polls,
        # untimed, as promptly as the floor's peers do
        _evict()
        spent, start = 0.0, time.perf_counter()
        t0 = _clock()
        self.d.fetch(req, f"P-{self.kind}", src, dst)
        spent += _clock() - t0
        while True:
            t1 = _clock()
            self.d.progress()
            res = self.d.results()
            spent += _clock() - t1
            if res:
                break
            for a in self.p:
                a.progress()
            if time.perf_counter() - start > 10:
                raise TimeoutError(f"fetch_host: {req} did not finish in 10 s")
        ms = spent * 1e3
        if not res[0].ok:
            raise res[0].error
        self.descriptors = res[0].descriptors
        self.ways = ",".join(f"{w} {n}" for w, n in res[0].ways)
        # what the decode does for this request after its result: its next progress() sends the Done to
        # each source rank and the fence (Fetches.finish): timed apart (``after_ms``), not hidden
        t2 = _clock()
        self.d.progress()
        self.after_ms = (_clock() - t2) * 1e3
        if check:
            check_destination(self.dst, 0, D_TP, self.kv, dst, before)
        for _ in range(8):  # the prefill ranks take the Done in and free the hold
            for a in (*self.p, self.d):
                a.progress()
        for a in self.p:
            a.freed()
        return ms

    def close(self) -> None:
        for a in (*self.p, self.d):
            a.close()


class Floor:
    """The same READs posted raw: per source rank, lists over both caches prepared once (one
    strided row per region, stream and slice: the blocks' ranges) and one READ per request of
    the indices its blocks name, as NixlConnector posts; no agent, no message."""

    def __init__(self, case: Case, name: str = "floor"):
        from kvtriton.plan import build_plan, direct_block_rows, slice_block_rows
        from kvtriton.transport.fence import FENCE_BYTES
        from kvtriton.transport.nixl import NixlTransport

        self.case, self.count = case, 0
        self.a = NixlTransport(f"{name}-d-{case.kind}")
        self.b = [NixlTransport(f"{name}-p{r}-{case.kind}") for r in range(P_TP)]
        self.fence_buf = torch.zeros(FENCE_BYTES, dtype=torch.uint8)  # what fences READ into (floor+done)
        self.a.register([t for r in case.dst for t in r.streams] + [self.fence_buf])
        fence_local = self.a.prep_local(np.array([[self.fence_buf.data_ptr(), FENCE_BYTES, 0]]), "DRAM")
        self.names: dict[object, str] = {}  # source transport -> its agent name, what messages go to
        self.fences: dict[object, list] = {}  # source transport -> [local list, remote list, its fence READ]
        dst_specs = [r.spec for r in case.dst]
        plan = build_plan(0, D_TP, dst_specs, P_TP, [r.spec for r in case.src[0]], modes="direct_slice",
                          replicate_stripe=case.stripe)
        self.sides = []
        for r, b in enumerate(self.b):
            b.register([t for reg in case.src[r] for t in reg.streams])
            peer = self.names[b] = self.a.add_remote(b.metadata())
            b.add_remote(self.a.metadata())
            at = np.array([[case.src[r][0].streams[0].data_ptr(), FENCE_BYTES, 0]])  # its first stream's start
            self.fences[b] = [fence_local, self.a.prep_remote(peer, at, "DRAM"), None]
            src_specs = [x.spec for x in case.src[r]]
            rows = [direct_block_rows(plan, src_specs, dst_specs, r)]
            if plan.staged:  # a payload read as head slices (forced above: every region of the plan is zero-copy)
                rows += [slice_block_rows(p, src_specs, dst_specs) for p in plan.staged if p.src_rank == r]
            for rw in (x for x in rows if len(x)):
                local = self._rows(case.dst, rw, rw.dst_offset, rw.dst_stride, rw.dst_blocks)
                remote = self._rows(case.src[r], rw, rw.src_offset, rw.src_stride, rw.src_blocks)
                self.sides.append((b, rw, self.a.prep_local(local, "DRAM"), self.a.prep_remote(peer, remote, "DRAM")))

    @staticmethod
    def _rows(regions, rows, offset, stride, blocks) -> np.ndarray:
        addr = np.array([regions[g].streams[j].data_ptr() for g, j in zip(rows.region.tolist(), rows.stream.tolist())],
                        dtype=np.int64)
        return np.stack([addr + offset, rows.tile, np.zeros_like(offset), stride, blocks], axis=1)

    def fetch_ms(self, notif: bool = False, done: bool = False) -> float:
        """One request's posts and polls; ``notif``: each source rank's last READ carries the
        request's completion notice (the floor+notif column); ``done``: once they landed, a Done
        to every source rank and a fence to each one READ from (the floor+done column)."""
        from kvtriton.protocol import wire
        from kvtriton.transport.nixl import XferStatus

        src, dst = self.case.ids()
        self.count += 1
        tag = f"floor-{self.case.kind}-{self.count}".encode()
        spent = 0.0
        _evict()
        t0 = _clock()
        reads = []
        for b, rows, local, remote in self.sides:
            s_idx, d_idx, _, _ = rows.select(src, dst)
            if s_idx.size:
                reads.append((b, local, d_idx, remote, s_idx))
        xfers = []
        for k, (b, local, d_idx, remote, s_idx) in enumerate(reads):
            last = notif and not any(r[0] is b for r in reads[k + 1:])  # this source's last READ
            xfers.append((b, self.a.post("READ", local, d_idx, remote, s_idx, tag if last else b"")))
        spent += _clock() - t0
        for b, x in xfers:
            while True:
                t1 = _clock()
                landed = self.a.poll(x) is XferStatus.DONE
                spent += _clock() - t1
                if landed:
                    break
                b.poll_notifs()  # the peer's own progress (untimed), as its process would
            self.a.release(x)
        if done:
            t2 = _clock()
            msg = wire.Done(tag.decode(), 0, D_TP).encode()
            for b in self.b:  # every rank of the source engine, as Fetches.finish tells them
                self.a.send_notif(self.names[b], msg)
            for b in dict.fromkeys(b for b, _ in xfers):  # each rank READ from, once
                fence = self.fences[b]
                if fence[2] is None:
                    fence[2] = self.a.post("READ", fence[0], [0], fence[1], [0])
                else:
                    self.a.repost(fence[2])
            spent += _clock() - t2
        for b in self.b:  # the sources take their notices in (their own processes when serving)
            b.poll_notifs()
        if done:  # the fences land in the background (untimed), before the next request
            for b, fence in self.fences.items():
                deadline = time.monotonic() + 5
                while fence[2] is not None and self.a.poll(fence[2]) is not XferStatus.DONE:
                    b.poll_notifs()
                    if time.monotonic() > deadline:
                        raise TimeoutError("fetch_host: a floor's fence did not land in 5 s")
            for _ in range(8):  # both sides' UCX workers progress between requests, as Case's agents do
                for t in (self.a, *self.b):
                    t.poll_notifs()
        return spent * 1e3

    def close(self) -> None:
        for fence in self.fences.values():
            if fence[2] is not None:
                self.a.release(fence[2])
        for t in (self.a, *self.b):
            t.close()


def _pair_keys():
    """Both sides' :class:`~kvtriton.protocol.auth.PairKeys` of one meeting (the dialler's first)."""
    import secrets

    from kvtriton.protocol.auth import PairKeys

    a, b = secrets.token_bytes(32), secrets.token_bytes(32)
    return PairKeys(a, b, dialled=True), PairKeys(b, a)


def run_fetch_host(reps: int = 40, progress=None, floor: bool = True, stripe: int | None = 1,
                   sealed: bool = False, cold: bool = False) -> list[dict]:
    """One row per model kind: the decode's host time in kvtriton's fetch() to its result and in
    the raw floor's posts and polls, ms (p20/p50/p80); ``stripe``: see :class:`Case`.
    ``floor=False``: kvtriton's rows only (the floor is built with planner functions an older
    kvtriton lacks: how a checkout of one is timed against this one). ``cold``: the caches
    evicted before each timed request (see the module docstring)."""
    torch.set_num_threads(1)
    arm_cold(cold)
    try:
        return _rows(reps, progress, floor, stripe, sealed, cold)
    finally:
        _cold.clear()  # the copy's 64 MiB are not kept past the run


def _rows(reps: int, progress, floor: bool, stripe: int | None, sealed: bool, cold: bool) -> list[dict]:
    rows = []
    for i, kind in enumerate(CASES):
        case = Case(kind, seed=40 + i, stripe=stripe, sealed=sealed)
        raw_floor = Floor(case) if floor else None
        # its own agents: a notice leaves their endpoints waiting on the peer, which the plain floor's must not see
        notif_floor = Floor(case, "floor-n") if floor else None
        done_floor = Floor(case, "floor-d") if floor else None
        try:
            for _ in range(3):
                case.fetch_ms()
                if raw_floor is not None:
                    raw_floor.fetch_ms()
                    notif_floor.fetch_ms(notif=True)
                    done_floor.fetch_ms(done=True)
            case.fetch_ms(check=True)  # byte for byte, once (its time is not counted)
            ours, after, raw, raw_notif, raw_done = [], [], [], [], []
            for k in range(reps):  # alternating which goes first
                if raw_floor is not None and k % 2:
                    raw.append(raw_floor.fetch_ms())
                    raw_notif.append(notif_floor.fetch_ms(notif=True))
                    raw_done.append(done_floor.fetch_ms(done=True))
                ours.append(case.fetch_ms())
                after.append(case.after_ms)
                if raw_floor is not None and not k % 2:
                    raw_done.append(done_floor.fetch_ms(done=True))
                    raw_notif.append(notif_floor.fetch_ms(notif=True))
                    raw.append(raw_floor.fetch_ms())
            q_ours, q_all = quantiles_of(ours), quantiles_of([a + b for a, b in zip(ours, after)])
            row = dict(case=kind, p_tp=P_TP, d_tp=D_TP, blocks=BLOCKS_PER_REQUEST, descriptors=case.descriptors,
                       ways=case.ways, caches="cold" if cold else "warm", **qfields("kvtriton_ms", q_ours),
                       **qfields("kvtriton_all_ms", q_all))
            if raw:
                q_raw = quantiles_of(raw)
                q_notif = quantiles_of(raw_notif)
                q_done = quantiles_of(raw_done)
                row.update(qfields("floor_ms", q_raw), ratio=round(q_ours[1] / q_raw[1], 2),
                           **qfields("floor_notif_ms", q_notif), ratio_notif=round(q_ours[1] / q_notif[1], 2),
                           **qfields("floor_done_ms", q_done), ratio_done=round(q_ours[1] / q_done[1], 2),
                           ratio_all_done=round(q_all[1] / q_done[1], 2))
            rows.append(row)
        finally:
            if raw_floor is not None:
                raw_floor.close()
            if notif_floor is not None:
                notif_floor.close()
            if done_floor is not None:
                done_floor.close()
            case.close()
        if progress is not None:
            progress(kind)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--no-floor", action="store_true",
                    help="kvtriton's rows only (to time a checkout of an older kvtriton on PYTHONPATH)")
    ap.add_argument("--replicate-stripe", type=int, default=1,
                    help="replicas a REPLICATE region is read from (1: the vLLM connector's default; 0: every one)")
    ap.add_argument("--sealed", action="store_true",
                    help="control messages sealed under pair keys, as after a meeting with the shared secret")
    ap.add_argument("--cpu", action="store_true",
                    help="time the decode's calls (and the floor's) by the thread's CPU time, not wall time")
    ap.add_argument("--cold", action="store_true",
                    help="evict the caches (an untimed 32 MiB copy) before each timed request, as a large READ does")
    args = ap.parse_args()
    if args.cpu:
        global _clock
        _clock = time.thread_time
    for r in run_fetch_host(args.reps, floor=not args.no_floor, stripe=args.replicate_stripe or None,
                            sealed=args.sealed, cold=args.cold):
        floor = (f", floor {r['floor_ms']:.3f} ms, ratio {r['ratio']:.2f}; floor+notif {r['floor_notif_ms']:.3f} ms, "
                 f"ratio {r['ratio_notif']:.2f}; floor+done {r['floor_done_ms']:.3f} ms, ratio {r['ratio_done']:.2f}, "
                 f"with kvtriton's Dones and fence after the result {r['ratio_all_done']:.2f}"
                 if "floor_ms" in r else "")
        print(f"fetch_host {r['case']} ({r['caches']} caches): kvtriton {r['kvtriton_ms']:.3f} ms "
              f"[{r['kvtriton_ms_p20']:.3f}-{r['kvtriton_ms_p80']:.3f}] to the result, {r['kvtriton_all_ms']:.3f} "
              f"with its Dones and fence after it{floor}; {r['descriptors']} descriptors "
              f"({r['ways']})")


if __name__ == "__main__":
    main()
