"""A rank's fixed configuration, made once by :class:`~kvtriton.agent.TransferAgent` and read by
every role (nothing copies its fields)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import PlanError
from ..ops.launch import resolve_impl
from ..plan import CostModel, ModesArg, check_compatible, parse_modes
from ..regions import Region
from ..spec import RegionSpec
from ..staging import StagingPool
from .device import Lanes

__all__ = ["Flow", "Settings", "make_settings", "one_sided_forced"]


class Flow(str, enum.Enum):
    """Which side moves the staged bytes (the agent's ``flow=``; both engines must agree)."""

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
    modes: ModesArg  # what the planner forces: the caller's modes, or "staged" under register/integrity
    cost: CostModel  # this rank's own model: its reading plans (a source serves by the peer's)
    stripe: int | None
    lanes: Lanes  # the device and the stream pack/unpack run on (see .device)
    renew_s: float = 1.0  # a decode renews the holds of its outstanding fetches this often
    eager_bytes: int = 0  # staging all eager packs may keep (see .source.eager); 0: none
    eager_guess: bool = True  # pack a hold without a consumer for the only connected engine
    register: str = "all"  # what NIXL may reach: "all" (cache and staging) or "staging" (see docs/security.md)
    integrity: bool = False  # digest each staged chunk after its pack, check it before unpack
    modes_arg: ModesArg = None  # the caller's modes= (compared at the handshake; ``modes`` is what plans)
    # a credential is configured: only peers added with authenticated=True are trusted (bind an
    # unbound hold, get an eager guess, replace a silent restart, read full refusal reasons)
    require_authenticated: bool = False

    @property
    def cache_registered(self) -> bool:
        """Whether this rank's cache is registered with NIXL (peers may then READ/WRITE it)."""
        return self.register == "all"

    def planning(self) -> tuple[tuple[str, str], ...]:
        """The settings both engines must share to compute the same plans, as (name, canonical
        value) pairs for the handshake (:meth:`TransferAgent.add_remote` compares them). The
        cost model is not one of them: the destination's travels in its metadata and the source
        plans that destination's transfers with it (:class:`~.plan_book.PlanBook`)."""
        return (("modes", parse_modes(self.modes_arg).canonical()), ("replicate_stripe", repr(self.stripe)),
                ("register", self.register), ("integrity", "on" if self.integrity else "off"))

    @property
    def name(self) -> str:
        return f"{self.engine_id}:{self.rank}"


def make_settings(*, engine_id: str, rank: int, tp: int, regions: Sequence[Region], staging_bytes: int,
                  slot_bytes: int, flow: str | None, mode: str | None, chunk_bytes: int | None,
                  inflight_chunks: int, timeout_s: float,
                  modes: ModesArg, cost: CostModel, replicate_stripe: int | None,
                  renew_interval_s: float, impl: str, eager_bytes: int | None, eager_guess: bool,
                  require_authenticated_peers: bool = False, register: str = "all",
                  integrity: bool = False) -> Settings:
    """Check :class:`~kvtriton.agent.TransferAgent`'s arguments (same names) and make its
    settings: the staging pool, the chunk size, the device and its stream. Raises ``ValueError``
    on bad arguments, :class:`~kvtriton.errors.LaunchError` on an ``impl`` that is not one or
    cannot run on the regions' device, :class:`~kvtriton.errors.PlanError` on modes a push cannot do, the
    validation gate's errors on a geometry that does not fit ``tp``."""
    flow = flow_of(flow, mode)
    modes_arg, modes = modes, restricted_modes(modes, register, integrity)
    if not regions:
        raise ValueError("a TransferAgent needs at least one region")
    one_sided = one_sided_forced(modes)
    if one_sided and flow is Flow.PUSH:
        raise PlanError(f"modes force {one_sided}, which only a pull can do (the reader skips the pass); "
                        f"use flow='pull' or force 'staged'")
    devices = {r.device for r in regions}
    if len(devices) != 1:
        raise ValueError(f"all regions must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    # a name that is not an implementation, or one that cannot run here, fails now; and "auto" is decided
    # now: it imports Triton's kernels (~20 ms in a busy engine), which the first repack paid before
    resolve_impl(impl, device)
    regions, specs = tuple(regions), tuple(r.spec for r in regions)
    # validate our own geometry against our own TP once (a bad shard fails here, not later)
    check_compatible(specs, tp, specs, tp)
    slot_bytes = int(slot_bytes)
    pool = StagingPool(max(1, staging_bytes // slot_bytes), slot_bytes, device)
    if inflight_chunks < 1:
        raise ValueError(f"inflight_chunks must be >= 1, got {inflight_chunks}")
    # default: a quarter of the pool, so two transfers can each keep two chunks in flight
    chunk = min(pool.nbytes, int(chunk_bytes or max(1, pool.num_slots // 4) * slot_bytes))
    if chunk < slot_bytes:
        raise ValueError(f"chunk_bytes {chunk} is smaller than one slot ({slot_bytes})")
    return Settings(
        engine_id=engine_id, rank=rank, tp=tp, flow=flow, regions=regions, specs=specs, device=device, pool=pool,
        chunk_bytes=chunk, inflight=int(inflight_chunks), timeout_s=float(timeout_s), impl=impl, modes=modes,
        cost=cost, stripe=replicate_stripe, lanes=Lanes(device), renew_s=float(renew_interval_s),
        eager_bytes=pool.nbytes // 2 if eager_bytes is None else int(eager_bytes), eager_guess=bool(eager_guess),
        register=register, integrity=bool(integrity), modes_arg=modes_arg,
        require_authenticated=bool(require_authenticated_peers))


def restricted_modes(modes: ModesArg, register: str, integrity: bool) -> ModesArg:
    """The modes the planner forces given ``register=`` and ``integrity=``: with
    ``register="staging"`` no peer can reach the cache (no DIRECT region, no one-sided way) and
    with ``integrity=True`` every byte must travel in a digested staged chunk, so both force
    ``"staged"`` everywhere; ``modes`` forcing anything else then raises
    :class:`~kvtriton.errors.PlanError` naming the option. ``ValueError`` on a ``register``
    that is neither ``"all"`` nor ``"staging"``."""
    if register not in ("all", "staging"):
        raise ValueError(f"register must be 'all' (cache and staging) or 'staging' (staging only), got {register!r}")
    if not isinstance(integrity, bool):
        raise ValueError(f"integrity must be True or False, got {integrity!r}")
    option = "register='staging'" if register == "staging" else "integrity=True" if integrity else None
    if option is None:
        return modes
    forced = parse_modes(modes)
    values = [forced.every] if forced.every is not None else [m for _, m in forced.by_name or ()]
    other = sorted({m.value for m in values if m is not None and m.value != "staged"})
    if other:
        why = ("peers may reach only the staging pool" if register == "staging"
               else "every byte must travel in a digested staged chunk")
        raise PlanError(f"modes force {other}, which {option} rules out ({why}: every region is STAGED, "
                        f"packed and unpacked); drop modes= or force 'staged'")
    return "staged"


def flow_of(flow: str | None, mode: str | None) -> Flow:
    """The :class:`Flow` of ``flow=``, or of ``mode=`` (its name before release 0.2, kept as an
    alias for one release); ``"pull"`` when neither is given. ``ValueError`` when both are given
    and differ, or the value is neither ``"pull"`` nor ``"push"``."""
    if flow is not None and mode is not None and flow != mode:
        raise ValueError(f"flow={flow!r} and mode={mode!r} disagree: mode is the old name of flow, give one")
    name, value = ("flow", flow) if flow is not None else ("mode", mode if mode is not None else "pull")
    try:
        return Flow(value)
    except ValueError:
        raise ValueError(f"{name} must be 'pull' or 'push', got {value!r}") from None


def one_sided_forced(modes) -> list[str]:
    """The one-sided modes ``modes`` forces (pull-only), by value."""
    return parse_modes(modes).one_sided()
