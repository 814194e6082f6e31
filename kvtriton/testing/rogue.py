"""A rogue peer next to an honest decode engine, in one process over real NIXL (UCX).

:class:`RogueRig` builds a prefill engine P, an honest decode engine D and a rogue engine R
whose handshake with P is genuine; the rogue then sends whatever control messages a test or
benchmark forges (tests/agent/test_rogue.py, bench/rogue.py). Everything is driven by hand from one
thread; nothing here is used by the library itself."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..agent import TransferAgent
from ..plan import CostModel
from ..protocol import wire
from .oracle import RegionModel, check_destination, load_source, make_global_kv, make_rank_regions, snapshot

__all__ = ["RogueRig", "PACKING_MODEL"]

BS = 4

#: the rigs' planning model: a repack pass costs its bytes only, at 10 GB/s both ways, so the
#: few-block holds these tests and benches place are packed (eager, guessed, pulled: the staging a
#: rogue goes after); with the default model's pass cost and 5 GB/s unpack such a small request
#: reads the source's cache instead and nothing is packed
PACKING_MODEL = CostModel(unpack_gbps=10.0, pass_us=0.01, segment_us=0.01,
                          source="test: a repack pass costs its bytes only")


class RogueRig:
    """Prefill engine P (tp ``p_tp``), honest decode D (tp ``d_tp``) and rogue engine R (tp 1),
    each rank its own NIXL agent; R's handshake with P is genuine."""

    def __init__(self, p_tp=1, d_tp=1, *, models: Sequence[RegionModel], staging_bytes=8 << 10, slot_bytes=1024,
                 timeout_s=5.0, p_blocks=64, d_blocks=64, seed=0, d_kw=None, **kw):
        self.gen = torch.Generator().manual_seed(seed)
        self.p_tp, self.d_tp, self.models = p_tp, d_tp, list(models)
        base = dict(staging_bytes=staging_bytes, slot_bytes=slot_bytes, timeout_s=timeout_s, impl="torch",
                    **{"cost": PACKING_MODEL, **kw})
        self.P = [make_rank_regions(self.models, r, p_tp, p_blocks, BS, gen=self.gen) for r in range(p_tp)]
        self.D = [make_rank_regions(self.models, r, d_tp, d_blocks, BS, layout="HND", gen=self.gen)
                  for r in range(d_tp)]
        self.R = make_rank_regions(self.models, 0, 1, d_blocks, BS, gen=self.gen)
        self.pa = [TransferAgent("P", r, p_tp, self.P[r], **base) for r in range(p_tp)]
        self.da = [TransferAgent("D", r, d_tp, self.D[r], **{**base, **(d_kw or {})}) for r in range(d_tp)]
        self.rogue = TransferAgent("R", 0, 1, self.R, **base)
        for p in self.pa:
            for x in self.da + [self.rogue]:
                x.add_remote(p.metadata())
                p.add_remote(x.metadata())
        self.before = [snapshot(x) for x in self.D]
        self.p_before = [snapshot(x) for x in self.P]
        self._xid = 0
        self.max_progress_s = 0.0  # the longest single progress() call of an honest agent

    def connect_rogue_to_decode(self) -> None:
        """Genuine handshakes between the rogue and every decode rank too (it may then send to
        them as a known peer)."""
        for d in self.da:
            self.rogue.add_remote(d.metadata())
            d.add_remote(self.rogue.metadata())

    @property
    def honest(self):
        return self.pa + self.da

    def request(self, src_ids):
        kv = make_global_kv(self.models, len(src_ids), BS, self.gen)
        for r, regs in enumerate(self.P):
            load_source(regs, r, self.p_tp, kv, src_ids)
        self.p_before = [snapshot(x) for x in self.P]
        return kv

    def forge(self, msg: wire.Message | bytes, to: int = 0) -> None:
        raw = msg if isinstance(msg, bytes) else msg.encode()
        self.rogue.transport.send_notif(self.pa[to].transport.name, raw)

    def rogue_pull(self, req, ids, chunk_blocks=2, to: int = 0) -> str:
        """A genuine-looking pull (right plan digest) the rogue never READs or acks."""
        self._xid += 1
        xid = f"rogue#{self._xid}"
        plan = self.rogue.plan_for("P").digest()
        self.forge(wire.Pull(xid, req, 0, tuple(int(i) for i in ids), chunk_blocks, plan), to)
        return xid

    def rogue_inbox(self) -> list[wire.Message]:
        """Drive the rogue's transport (UCX needs it) and decode what P sent it."""
        out = []
        for msgs in self.rogue.transport.poll_notifs().values():
            out += [wire.decode_message(m) for m in msgs]
        return out

    def step(self) -> None:
        for a in self.honest:
            t0 = time.perf_counter()
            a.progress()
            self.max_progress_s = max(self.max_progress_s, time.perf_counter() - t0)
        self.rogue_inbox()

    def settle(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.step()

    def drive(self, want: int = 1, timeout_s: float = 20.0) -> list:
        got, deadline = [], time.monotonic() + timeout_s
        while len(got) < want:
            assert time.monotonic() < deadline, f"no results after {timeout_s} s"
            self.step()
            for d in self.da:
                got += d.results()
        return got

    def check_honest(self, kv, dst) -> None:
        for r in range(self.d_tp):
            check_destination(self.D[r], r, self.d_tp, kv, dst, self.before[r])

    def check_prefill_untouched(self) -> None:
        for regs, before in zip(self.P, self.p_before):
            for now, was in zip(snapshot(regs), before):
                assert all(torch.equal(a, b) for a, b in zip(now, was))

    def close(self):
        for a in self.honest + [self.rogue]:
            a.close()
