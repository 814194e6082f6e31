"""A prefill engine and a decode engine in one process over real NIXL (UCX), driven by hand.

:class:`EnginePair` builds ``p_tp`` prefill ranks (engine ``"P"``) and ``d_tp`` decode ranks
(engine ``"D"``), each its own :class:`~kvtriton.agent.TransferAgent` over random-filled caches
from :mod:`kvtriton.testing.oracle`, and (by default) connects every decode rank with every
prefill rank both ways. The caller loads a request's global KV with :meth:`EnginePair.request`,
holds and fetches through the agents (or :meth:`EnginePair.start`), then :meth:`~EnginePair.drive`
until results arrive and checks the bytes with the oracle against :attr:`EnginePair.before`.
Nothing here is used by the library itself; the multi-process counterpart is
:mod:`kvtriton.testing.cluster`.

Example::

    e = EnginePair(1, 2, models=[RegionModel.gqa("l0", 4, 16)])
    src, dst = np.array([3, 4]), np.array([0, 1])
    kv = e.request(src)
    e.pa[0].hold("r", src)
    for d in e.da:
        d.fetch("r", "P", src, dst)
    got = e.drive(1)                    # {decode rank: [RequestResult]}
    check_destination(e.D[0], 0, 2, kv, dst, e.before[0])
    e.close()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..agent import TransferAgent
from ..plan import meeting_ranks
from .oracle import RegionModel, load_source, make_global_kv, make_rank_regions, snapshot

__all__ = ["EnginePair"]


class EnginePair:
    """Prefill engine ``"P"`` (``p_tp`` ranks, ``p_blocks`` blocks of ``block_size`` tokens, caches
    in ``p_layout``/``p_storage``) and decode engine ``"D"`` (``d_tp`` ranks, ``d_blocks`` blocks of
    ``d_block_size`` tokens (default: ``block_size``), ``d_layout``/``d_storage``, ``d_pad_blocks``
    as in :func:`~kvtriton.testing.oracle.make_rank_regions`). Every agent gets ``mode``,
    ``staging_bytes``, ``slot_bytes``, ``timeout_s``, ``impl`` (default the torch path: the Triton
    interpreter would crawl) and ``agent_kw``. ``connect``: exchange metadata all-to-all now.

    Attributes: ``P``/``D`` (each rank's regions), ``pa``/``da`` (their agents), ``gen`` (the
    generator every cache and request is drawn from, seeded by ``seed``), ``before`` (snapshots of
    the decode caches as built: what no transfer may touch)."""

    def __init__(self, p_tp: int, d_tp: int, *, models: Sequence[RegionModel], mode: str = "pull",
                 staging_bytes: int = 64 << 10, slot_bytes: int = 1024, p_blocks: int = 64, d_blocks: int = 48,
                 block_size: int = 4, d_block_size: int | None = None, p_layout: str = "NHD",
                 d_layout: str = "HND", p_storage: str = "joint", d_storage: str = "separate",
                 d_pad_blocks: int = 0, timeout_s: float = 5.0, seed: int = 0, connect: bool = True,
                 impl: str = "torch", **agent_kw):
        self.gen = torch.Generator().manual_seed(seed)
        self.models, self.p_tp, self.d_tp, self.block_size = list(models), p_tp, d_tp, block_size
        d_bs = block_size if d_block_size is None else d_block_size
        self.P = [make_rank_regions(self.models, r, p_tp, p_blocks, block_size, layout=p_layout, storage=p_storage,
                                    gen=self.gen) for r in range(p_tp)]
        self.D = [make_rank_regions(self.models, r, d_tp, d_blocks, d_bs, layout=d_layout, storage=d_storage,
                                    gen=self.gen, pad_blocks=d_pad_blocks) for r in range(d_tp)]
        kw = dict(staging_bytes=staging_bytes, slot_bytes=slot_bytes, mode=mode, timeout_s=timeout_s, impl=impl,
                  **agent_kw)
        self.pa: list[TransferAgent] = []
        self.da: list[TransferAgent] = []
        try:
            self.pa += [TransferAgent("P", r, p_tp, self.P[r], **kw) for r in range(p_tp)]
            self.da += [TransferAgent("D", r, d_tp, self.D[r], **kw) for r in range(d_tp)]
            if connect:
                self.connect()
        except BaseException:
            self.close()
            raise
        self.before = [snapshot(x) for x in self.D]

    @property
    def agents(self) -> list[TransferAgent]:
        return self.pa + self.da

    def connect(self, meeting: bool = False) -> None:
        """Every decode rank and every prefill rank add each other's metadata; ``meeting``: only
        the pairs a decode rank of the vLLM connector meets (:func:`~kvtriton.plan.meeting_ranks`:
        the ranks it reads from, and those no rank reads that it tells when it is done)."""
        for i, d in enumerate(self.da):
            ranks = (meeting_ranks(i, self.d_tp, [r.spec for r in self.D[i]], self.p_tp) if meeting
                     else range(self.p_tp))
            for j in ranks:
                p = self.pa[j]
                d.add_remote(p.metadata())
                p.add_remote(d.metadata())

    def request(self, src_ids) -> list:
        """Draw a request's global KV (one block per entry of ``src_ids``) and load every prefill
        rank's heads of it into blocks ``src_ids``; returns the global KV for the oracle."""
        kv = make_global_kv(self.models, len(src_ids), self.block_size, self.gen)
        for r, regs in enumerate(self.P):
            load_source(regs, r, self.p_tp, kv, src_ids)
        return kv

    def start(self, src_ids, dst_ids, req: str = "r", lease_s: float = 30.0) -> tuple[list, list]:
        """:meth:`request`, then every prefill rank holds it and every decode rank fetches it
        into ``dst_ids``; returns (global KV, snapshots of the decode caches before the fetch)."""
        kv = self.request(src_ids)
        before = [snapshot(x) for x in self.D]
        for p in self.pa:
            p.hold(req, src_ids, lease_s=lease_s)
        for d in self.da:
            d.fetch(req, "P", src_ids, dst_ids)
        return kv, before

    def drive(self, want: int = 1, timeout_s: float = 20.0, agents=None) -> dict[int, list]:
        """Progress ``agents`` (default: all) until each decode rank has ``want`` results;
        returns them per decode rank. Fails (AssertionError) after ``timeout_s``."""
        got: dict[int, list] = {i: [] for i in range(self.d_tp)}
        deadline = time.monotonic() + timeout_s
        while any(len(v) < want for v in got.values()):
            assert time.monotonic() < deadline, f"no results after {timeout_s} s: {got}"
            for a in agents or self.agents:
                a.progress()
            for i, d in enumerate(self.da):
                got[i] += d.results()
        return got

    def settle(self, seconds: float = 0.3) -> None:
        """Progress every agent for ``seconds``."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for a in self.agents:
                a.progress()

    def settle_until(self, done: Callable[[], bool], what: Callable[[], str], timeout_s: float = 10.0,
                     first_s: float = 0.05) -> None:
        """Progress every agent until ``done()`` holds (checked first after ``first_s`` of
        progress, so what is under way gets sent); fails (AssertionError with ``what()``, the
        state waited on) after ``timeout_s``. A test waits for the state it means, not for a
        fixed time a loaded host may not keep."""
        deadline = time.monotonic() + timeout_s
        self.settle(first_s)
        while not done():
            assert time.monotonic() < deadline, f"not within {timeout_s} s: {what()}"
            self.settle(0.01)

    def offers_held(self, *req_ids: str) -> int:
        """How many offers of ``req_ids`` the decode ranks hold (one per offering prefill rank each)."""
        return sum(req in by_req for d in self.da for by_req in d.debug_state()["offers"].values() for req in req_ids)

    def settle_offers(self, *req_ids: str, timeout_s: float = 10.0) -> None:
        """Progress until every offer the prefill ranks sent (``stats.eager_offers``: ``req_ids``
        are every request held) is held by a decode rank. An offer goes once its pack is done:
        0.1 s of progress first (what the tests waited in all before), then until they arrive."""
        def sent() -> list[int]:
            return [p.stats["eager_offers"] for p in self.pa]

        self.settle_until(lambda: self.offers_held(*req_ids) >= sum(sent()),
                          lambda: f"offers of {req_ids} held {self.offers_held(*req_ids)}, sent {sent()}", timeout_s,
                          first_s=0.1)

    def settle_done(self, timeout_s: float = 10.0) -> None:
        """Progress until no prefill rank holds a request and every agent's staging is back: every
        consumer's done (and what it counts) has arrived. :meth:`freed` reports are left unread."""
        self.settle_until(lambda: not any(p.debug_state()["holds"] for p in self.pa)
                          and all(a.pool.free_slots == a.pool.num_slots for a in self.agents),
                          lambda: f"holds {[sorted(p.debug_state()['holds']) for p in self.pa]}, free slots "
                                  f"{[(a.pool.free_slots, a.pool.num_slots) for a in self.agents]}", timeout_s)

    def settle_freed(self, holds: int, timeout_s: float = 10.0) -> list:
        """Progress until ``holds`` holds are freed and every staging slot is back; returns the
        freed requests (``FreedRequest``) of every prefill rank."""
        freed: list = []
        deadline = time.monotonic() + timeout_s
        while len(freed) < holds or any(a.pool.free_slots != a.pool.num_slots for a in self.agents):
            assert time.monotonic() < deadline, f"freed {freed}; staging {[a.pool.free_slots for a in self.pa]}"
            for a in self.agents:
                a.progress()
            freed += [f for p in self.pa for f in p.freed()]
        return freed

    def close(self) -> None:
        for a in self.agents:
            a.close()

    def __enter__(self) -> EnginePair:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
