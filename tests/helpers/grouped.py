"""A hybrid-like model of three KV cache groups over real NIXL, and its independent byte oracle.

Group 0: a sliding-window-like attention layer (SPLIT, its request list shorter than group 1's);
group 1: a full attention layer (SPLIT); group 2: one block per request of state-like regions
(block_size 1): one SPLIT by heads, one REPLICATE. 6 KV heads, so P1->D2, P2->D1 and P2->D3 all
plan. Caches are filled with fresh random bytes (replicated regions alike on every prefill rank);
the oracle reads the expected bytes of a decode block straight from the prefill caches (global
head ``h`` lives on prefill rank ``h // (H / p_tp)``), independently of the planner.
"""

from __future__ import annotations

import time

import torch

from kvtriton import Region, TransferAgent
from kvtriton.regions import Kind

HEADS = 6
# name, group, kind, block_size, head_dim, streams, dtype
LAYERS = (("swa", 0, Kind.SPLIT, 4, 8, 2, torch.float16),
          ("full", 1, Kind.SPLIT, 4, 16, 2, torch.bfloat16),
          ("ssm", 2, Kind.SPLIT, 1, 32, 1, torch.float32),
          ("conv", 2, Kind.REPLICATE, 1, 24, 1, torch.float32))
GROUPS = 3


def rank_regions(rank: int, tp: int, num_blocks: int, layout: str, gen: torch.Generator,
                 replicated: dict[str, torch.Tensor] | None = None, layers=LAYERS) -> list[Region]:
    """One rank's regions, random-filled (``replicated``: the REPLICATE regions' data to copy)."""
    out = []
    for name, group, kind, bs, hd, streams, dtype in layers:
        if kind is Kind.REPLICATE:
            t = torch.empty(num_blocks, bs, hd, dtype=dtype)
            if replicated is not None and name in replicated:
                t.copy_(replicated[name])
            else:
                t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen,
                                                        dtype=torch.uint8))
            out.append(Region.mla(name, t, block_size=bs, group=group))
            continue
        heads = HEADS // tp
        shape = (num_blocks, bs, heads, hd) if layout == "NHD" else (num_blocks, heads, bs, hd)
        ts = []
        for _ in range(streams):
            t = torch.empty(shape, dtype=dtype)
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen,
                                                    dtype=torch.uint8))
            ts.append(t)
        out.append(Region.attention(name, ts[0], ts[1] if streams == 2 else None, layout=layout, block_size=bs,
                                    total_heads=HEADS, group=group))
    return out


class Grouped:
    """Prefill engine "P" (``p_tp`` ranks, NHD) and decode engine "D" (``d_tp`` ranks, HND) of the
    model above, connected all-to-all; ``before``: the decode caches' bytes as built."""

    def __init__(self, p_tp: int, d_tp: int, *, p_blocks: int = 32, d_blocks: int = 24, seed: int = 0,
                 staging_bytes: int = 256 << 10, slot_bytes: int = 4096, mode: str = "pull", layers=LAYERS,
                 **agent_kw):
        gen = torch.Generator().manual_seed(seed)
        self.p_tp, self.d_tp = p_tp, d_tp
        self.P = [rank_regions(0, p_tp, p_blocks, "NHD", gen, layers=layers)]
        rep = {r.spec.name: r.streams[0].squeeze(2) for r in self.P[0] if r.spec.kind is Kind.REPLICATE}
        self.P += [rank_regions(r, p_tp, p_blocks, "NHD", gen, rep, layers) for r in range(1, p_tp)]
        self.D = [rank_regions(r, d_tp, d_blocks, "HND", gen, layers=layers) for r in range(d_tp)]
        kw = dict(staging_bytes=staging_bytes, slot_bytes=slot_bytes, mode=mode, timeout_s=5.0, impl="torch",
                  **agent_kw)
        self.pa: list[TransferAgent] = []
        self.da: list[TransferAgent] = []
        try:
            self.pa += [TransferAgent("P", r, p_tp, self.P[r], **kw) for r in range(p_tp)]
            self.da += [TransferAgent("D", r, d_tp, self.D[r], **kw) for r in range(d_tp)]
            for d in self.da:
                for p in self.pa:
                    d.add_remote(p.metadata())
                    p.add_remote(d.metadata())
        except BaseException:
            self.close()
            raise
        self.before = [[[t.clone() for t in r.streams] for r in regs] for regs in self.D]

    @property
    def agents(self) -> list[TransferAgent]:
        return self.pa + self.da

    def drive(self, timeout_s: float = 20.0) -> dict[int, list]:
        got: dict[int, list] = {i: [] for i in range(self.d_tp)}
        deadline = time.monotonic() + timeout_s
        while any(not v for v in got.values()):
            assert time.monotonic() < deadline, f"no results after {timeout_s} s: {got}"
            for a in self.agents:
                a.progress()
            for i, d in enumerate(self.da):
                got[i] += d.results()
        return got

    def expected(self, region: int, stream: int, d_rank: int, src_block: int) -> torch.Tensor:
        """What decode rank ``d_rank`` must hold of prefill block ``src_block`` (NHD, its heads)."""
        spec = self.D[d_rank][region].spec
        if spec.kind is Kind.REPLICATE:
            return self.P[0][region].nhd(stream)[src_block]
        per_p, per_d = HEADS // self.p_tp, HEADS // self.d_tp
        heads = [self.P[h // per_p][region].nhd(stream)[src_block, :, h % per_p]
                 for h in range(d_rank * per_d, (d_rank + 1) * per_d)]
        return torch.stack(heads, dim=1)

    def check(self, src: list[list[int]], dst: list[list[int]]) -> int:
        """Every decode rank's every region: the blocks of its group's list hold the prefill's
        bytes (per position, -1 on either side skipped), every other block is as built. Returns
        the bytes checked."""
        checked = 0
        for d_rank, regs in enumerate(self.D):
            for i, r in enumerate(regs):
                g = r.spec.group
                moved = {dd: ss for ss, dd in zip(src[g], dst[g]) if ss >= 0 and dd >= 0}
                for j in range(r.spec.num_streams):
                    got = r.nhd(j)
                    before = self.before[d_rank][i][j]
                    before = before if r.spec.layout.value == "NHD" else before.transpose(1, 2)
                    for b in range(r.spec.num_blocks):
                        want = self.expected(i, j, d_rank, moved[b]) if b in moved else before[b]
                        if not torch.equal(got[b].contiguous().view(torch.uint8),
                                           want.contiguous().view(torch.uint8)):
                            what = f"moved from P block {moved[b]}" if b in moved else "untouched"
                            raise AssertionError(f"D{d_rank} {r.spec.name} (group {g}) stream {j} block {b}: "
                                                 f"{what} differs")
                        checked += got[b].numel() * got.element_size() if b in moved else 0
        return checked

    def close(self) -> None:
        for a in self.agents:
            a.close()
