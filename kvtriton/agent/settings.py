"""A rank's fixed configuration, made once by :class:`~kvtriton.agent.TransferAgent` and read by
every role (nothing copies its fields)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping

import torch

from ..plan import CostModel, Mode
from ..regions import Region, RegionSpec
from ..staging import StagingPool
from .device import Lanes

__all__ = ["Flow", "Settings"]


class Flow(str, enum.Enum):
    """Which side moves the staged bytes (the agent's ``mode=``; both engines must agree)."""

    PULL = "pull"  # the destination READs what the source announces
    PUSH = "push"  # the source WRITEs into slots the destination grants


@dataclass(frozen=True, kw_only=True)
class Settings:
    """This rank's fixed configuration, read by every role. Keyword-only: nineteen fields of
    close types are too easy to pass in the wrong order."""

    engine_id: str
    rank: int
    tp: int
    flow: Flow
    regions: tuple[Region, ...]
    specs: tuple[RegionSpec, ...]
    device: torch.device
    pool: StagingPool
    chunk_bytes: int  # the largest chunk this rank packs or receives
    inflight: int  # chunks of one transfer in flight at once
    timeout_s: float
    impl: str
    modes: Mode | str | Mapping[str, Mode | str] | None
    cost: CostModel  # this rank's own model: its reading plans (a source serves by the peer's)
    stripe: int | None
    lanes: Lanes  # the device and the stream pack/unpack run on (see .device)
    renew_s: float = 1.0  # a decode renews the holds of its outstanding fetches this often
    eager_bytes: int = 0  # staging all eager packs may keep (see .source.eager); 0: none
    eager_guess: bool = True  # pack a hold without a consumer for the only connected engine

    def planning(self) -> tuple[tuple[str, str], ...]:
        """The settings both engines must share to compute the same plans, as (name, canonical
        value) pairs for the handshake (:meth:`TransferAgent.add_remote` compares them). The
        cost model is not one of them: the destination's travels in its metadata and the source
        plans that destination's transfers with it (:class:`~.plan_book.PlanBook`)."""
        def mode(v) -> str:
            return v.value if isinstance(v, Mode) else str(v)

        if self.modes is None or isinstance(self.modes, (str, Mode)):
            modes = "all:" + ("auto" if self.modes is None else mode(self.modes))
        else:
            modes = ",".join(f"{k}={mode(v)}" for k, v in sorted(self.modes.items()))
        return (("modes", modes or "none"), ("replicate_stripe", repr(self.stripe)))

    @property
    def name(self) -> str:
        return f"{self.engine_id}:{self.rank}"
