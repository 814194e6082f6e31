"""A multi-process prefill/decode cluster on this machine: real NIXL (UCX on 127.0.0.1), CPU caches
(or CUDA ones: ``ClusterConfig.device``).

The parent starts ``p_tp`` prefill and ``d_tp`` decode processes (``spawn``), routes their
metadata all-to-all, and drives them with short commands over pipes (each process is an agent
child of :mod:`kvtriton.testing.child`; its commands are :meth:`_Rank.commands`). Every process rebuilds the
same global KV of each request from the seed, so the decode processes check every block they
receive byte for byte against the global heads their rank owns, and at the end check that no
byte outside the received blocks changed. Everything is bounded in time, and every child is
killed when the cluster exits, whatever happened.

Example::

    cfg = ClusterConfig(models=[RegionModel.gqa("l0", 4, 16)], p_tp=2, d_tp=4)
    with Cluster(cfg) as c:
        reqs = c.requests(8, n_blocks=6)
        c.hold(reqs); c.fetch(reqs)
        report = c.wait(timeout_s=60)      # {decode rank: {req_id: outcome}}
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from dataclasses import dataclass

import numpy as np

from ..plan import ceil_div
from .child import AgentChild, ChildProcess
from .oracle import RegionModel

__all__ = ["ClusterConfig", "Request", "Cluster"]


@dataclass(frozen=True)
class Request:
    req_id: str
    index: int
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]
    mode: str = "pull"
    num_tokens: int = 0  # block sizes differ: the request's tokens (0: block pairs)


@dataclass
class ClusterConfig:
    models: list[RegionModel]
    p_tp: int = 1
    d_tp: int = 1
    block_size: int = 4
    d_block_size: int | None = None  # the decode engine's block size when it differs (token-mapped requests)
    p_blocks: int = 256
    d_blocks: int = 256
    p_layout: str = "NHD"
    d_layout: str = "NHD"
    p_storage: str = "separate"
    d_storage: str = "separate"
    mode: str = "pull"  # "pull", "push" or "both" (one agent per mode in every process)
    staging_bytes: int = 1 << 20
    slot_bytes: int = 4096
    timeout_s: float = 10.0
    lease_s: float = 60.0
    seed: int = 0
    modes: object = None
    max_inflight: int = 64
    impl: str = "torch"  # pack/unpack path of the agents ("auto" would use the Triton interpreter on CPU)
    device: str = "cpu"  # where the caches and staging live ("cuda": every process on the current GPU)
    warmup: bool = False  # TransferAgent(warmup=...): kernels compiled before the first request

    @property
    def dst_block_size(self) -> int:
        return self.block_size if self.d_block_size is None else self.d_block_size

    @property
    def transfer_modes(self) -> tuple[str, ...]:
        return ("pull", "push") if self.mode == "both" else (self.mode,)


def _request_kv(cfg: ClusterConfig, req: Request):
    import torch

    from .oracle import make_global_kv, make_global_tokens

    gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + zlib.crc32(req.req_id.encode())) & 0x7FFFFFFF)
    if req.num_tokens:
        return make_global_tokens(cfg.models, req.num_tokens, gen)
    return make_global_kv(cfg.models, len(req.src_ids), cfg.block_size, gen)


# --------------------------------------------------------------------------- child process
def _engine(role: str, mode: str) -> str:
    return f"{role}-{mode}"


def _child(conn, role: str, rank: int, cfg: ClusterConfig) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(1)
    me = _Rank(role, rank, cfg)
    child = AgentChild(conn, me.agents.values(), me.commands(), step=me.step, busy=lambda: not me.idle(),
                       busy_sleep_s=0.0001)
    child.ready({m: a.metadata() for m, a in me.agents.items()})
    child.run()


class _Rank:
    """One rank of the cluster in its child process: its cache, one agent per transfer mode over
    it, the requests it fetches and their outcomes, and the commands the parent sends."""

    def __init__(self, role: str, rank: int, cfg: ClusterConfig):
        import torch

        from ..agent import TransferAgent
        from .oracle import make_rank_regions, snapshot

        self.role, self.rank, self.cfg = role, rank, cfg
        self.tp = cfg.p_tp if role == "P" else cfg.d_tp
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + (0 if role == "P" else 104729) + rank)
        self.regions = make_rank_regions(
            cfg.models, rank, self.tp, cfg.p_blocks if role == "P" else cfg.d_blocks,
            cfg.block_size if role == "P" else cfg.dst_block_size,
            layout=cfg.p_layout if role == "P" else cfg.d_layout,
            storage=cfg.p_storage if role == "P" else cfg.d_storage, gen=gen, device=cfg.device)
        self.before = snapshot(self.regions)
        # one agent per transfer mode, over the same cache (one process start covers pull and push)
        self.agents = {m: TransferAgent(_engine(role, m), rank, self.tp, self.regions,
                                        staging_bytes=cfg.staging_bytes, slot_bytes=cfg.slot_bytes, mode=m,
                                        timeout_s=cfg.timeout_s, modes=cfg.modes, impl=cfg.impl, warmup=cfg.warmup)
                       for m in cfg.transfer_modes}
        self.outcomes: dict[str, dict] = {}
        self.pending: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.inflight = 0
        self.freed: list[tuple[str, str]] = []
        self.announced = 0
        self.kill_at: int | None = None
        for a in self.agents.values():
            a.transport.send_notif = self._counting(a.transport.send_notif)

    def _counting(self, send):
        from ..protocol import wire

        def counting_send(name, msg):  # the fault hook: die after N chunk announcements
            send(name, msg)
            if isinstance(wire.decode_message(msg), (wire.Ready, wire.Data)):
                self.announced += 1
                if self.kill_at is not None and self.announced >= self.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
        return counting_send

    def idle(self) -> bool:
        return all(a.idle() for a in self.agents.values()) and not self.pending

    def commands(self) -> dict:
        return {"add_remote": self.add_remote, "hold": self.hold, "fetch": self.fetch, "kill_after": self.kill_after,
                "status": self.status, "canary": self.canary}

    # ------------------------------------------------------------------ commands
    def add_remote(self, mode: str, md: bytes) -> None:
        self.agents[mode].add_remote(md)

    def hold(self, reqs: list[Request], lease_s: float) -> None:
        from .oracle import load_source, load_source_tokens

        for req in reqs:
            load = load_source_tokens if req.num_tokens else load_source
            load(self.regions, self.rank, self.tp, _request_kv(self.cfg, req), list(req.src_ids))
            self.agents[req.mode].hold(req.req_id, list(req.src_ids), lease_s=lease_s)

    def fetch(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.requests[req.req_id] = req
            self.outcomes.pop(req.req_id, None)  # a retry replaces the earlier outcome
            self.pending.append(req)

    def kill_after(self, announcements: int) -> None:
        self.kill_at = announcements

    def status(self) -> dict:
        agents = self.agents.values()
        return dict(outcomes=dict(self.outcomes), freed=list(self.freed), idle=self.idle(),
                    free_slots=sum(a.pool.free_slots for a in agents), num_slots=sum(a.pool.num_slots for a in agents),
                    stats={m: dict(a.stats) for m, a in self.agents.items()})

    def canary(self) -> str | None:
        ok_reqs = [self.requests[r] for r, o in self.outcomes.items() if o["ok"]]
        try:
            _check_all(self.regions, self.rank, self.tp, self.cfg, ok_reqs, self.before)
        except AssertionError as e:
            return str(e)
        return None

    # ------------------------------------------------------------------ between commands
    def step(self) -> None:
        from ..errors import KVTritonError

        while self.pending and self.inflight < self.cfg.max_inflight:
            req = self.pending.pop(0)
            try:
                self.agents[req.mode].fetch(req.req_id, _engine("P", req.mode), list(req.src_ids), list(req.dst_ids),
                                            num_tokens=req.num_tokens or None)
                self.inflight += 1
            except KVTritonError as e:
                self.outcomes[req.req_id] = dict(ok=False, error=type(e).__name__, msg=str(e), seconds=0.0)
        for a in self.agents.values():
            a.progress()
            for res in a.results():
                self.inflight -= 1
                out = dict(ok=res.ok, error=type(res.error).__name__ if res.error else None,
                           msg=str(res.error) if res.error else None, seconds=res.seconds,
                           descriptors=res.descriptors, bytes=res.bytes)
                if res.ok:
                    out["mismatch"] = _check_one(self.regions, self.rank, self.tp, self.cfg,
                                                 self.requests[res.req_id])
                self.outcomes[res.req_id] = out
            self.freed.extend((f.req_id, f.reason) for f in a.freed())


def _check_one(regions, rank, tp, cfg, req) -> str | None:
    """Byte-compare one request's destination blocks (other blocks are checked at the end)."""
    from .oracle import check_destination, check_destination_tokens

    try:
        check = check_destination_tokens if req.num_tokens else check_destination
        check(regions, rank, tp, _request_kv(cfg, req), list(req.dst_ids))
    except AssertionError as e:
        return f"{req.req_id}: {e}"
    return None


def _check_all(regions, rank, tp, cfg, reqs, before) -> None:
    """Every received block right, every other byte as it was before the first transfer."""
    from .oracle import check_destination, check_destination_tokens, concat_global_kv

    if cfg.d_block_size is not None and cfg.d_block_size != cfg.block_size:
        kvs = [(_request_kv(cfg, r), list(r.dst_ids)) for r in reqs]
        if not kvs:
            return
        check_destination_tokens(regions, rank, tp, *kvs[0], before, more=kvs[1:])
        return
    probe = Request("none", 0, (0,), (0,))
    kvs = [_request_kv(cfg, r) for r in reqs] or [[[s[:0] for s in streams] for streams in _request_kv(cfg, probe)]]
    check_destination(regions, rank, tp, concat_global_kv(kvs), [b for r in reqs for b in r.dst_ids], before)


# --------------------------------------------------------------------------- parent
class Cluster:
    """Parent side; see the module docstring. Use as a context manager."""

    def __init__(self, cfg: ClusterConfig, start_timeout_s: float = 60.0):
        self.cfg = cfg
        self._procs: dict[tuple[str, int], ChildProcess] = {}
        self._md: dict[tuple[str, int], bytes] = {}
        self._start_timeout = start_timeout_s
        self._next_req = 0
        rng = np.random.default_rng(cfg.seed)
        # every request gets blocks no other request of this cluster uses, in shuffled order
        self._free_src = rng.permutation(cfg.p_blocks)
        self._free_dst = rng.permutation(cfg.d_blocks)

    def __enter__(self) -> Cluster:
        try:
            for r in range(self.cfg.p_tp):
                self._spawn("P", r)
            for r in range(self.cfg.d_tp):
                self._spawn("D", r)
            for key in self._procs:
                self._md[key] = self._procs[key].ready(self._start_timeout)
            for key in self._procs:
                for other, mds in self._md.items():
                    if other[0] != key[0]:
                        for mode, md in mds.items():
                            self._call(key, "add_remote", mode, md)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, role: str, rank: int) -> None:
        self._procs[(role, rank)] = ChildProcess(_child, role, rank, self.cfg, name=f"{role}{rank}")

    def _call(self, key, cmd: str, *args, timeout_s: float = 30.0):
        return self._procs[key].call(cmd, *args, timeout_s=timeout_s)

    # ------------------------------------------------------------------ scenario helpers
    def requests(self, count: int, n_blocks: int = 0, mode: str | None = None, *,
                 num_tokens: int | None = None) -> list[Request]:
        """``count`` requests of ``n_blocks`` blocks on disjoint, shuffled block ids; with
        ``mode=None`` they alternate over the cluster's transfer modes. With ``num_tokens`` (engines
        of different block sizes) each side gets the blocks that many tokens take."""
        n_src = n_dst = n_blocks
        if num_tokens is not None:
            n_src, n_dst = ceil_div(num_tokens, self.cfg.block_size), ceil_div(num_tokens, self.cfg.dst_block_size)
        if count * n_src > self._free_src.size or count * n_dst > self._free_dst.size:
            raise ValueError(f"{count} x {n_src}/{n_dst} more blocks do not fit the caches ({self._free_src.size} "
                             f"source and {self._free_dst.size} destination blocks left)")
        src, self._free_src = self._free_src[:count * n_src].reshape(count, n_src), self._free_src[count * n_src:]
        dst, self._free_dst = self._free_dst[:count * n_dst].reshape(count, n_dst), self._free_dst[count * n_dst:]
        modes = self.cfg.transfer_modes
        out = [Request(f"req{self._next_req + i}", self._next_req + i, tuple(map(int, s)), tuple(map(int, d)),
                       mode or modes[i % len(modes)], num_tokens or 0)
               for i, (s, d) in enumerate(zip(src, dst))]
        self._next_req += count
        return out

    def prefill_ranks(self):
        return [k for k in self._procs if k[0] == "P"]

    def decode_ranks(self):
        return [k for k in self._procs if k[0] == "D"]

    def hold(self, reqs: list[Request], lease_s: float | None = None, ranks=None) -> None:
        for key in ranks or self.prefill_ranks():
            self._call(key, "hold", reqs, lease_s or self.cfg.lease_s)

    def fetch(self, reqs: list[Request], ranks=None) -> None:
        for key in ranks or self.decode_ranks():
            self._call(key, "fetch", reqs)

    def status(self, key) -> dict:
        return self._call(key, "status")

    def wait(self, reqs: list[Request] | None = None, timeout_s: float = 60.0, ranks=None) -> dict[int, dict]:
        """Wait until every decode rank reports an outcome for every request (or raise)."""
        keys = ranks or self.decode_ranks()
        want = {r.req_id for r in reqs} if reqs is not None else None
        deadline = time.monotonic() + timeout_s
        while True:
            report = {k[1]: self.status(k)["outcomes"] for k in keys}
            if all((want or set()) <= set(o) and (want is not None or o) for o in report.values()):
                return report
            if time.monotonic() > deadline:
                missing = {k: sorted((want or set()) - set(o))[:5] for k, o in report.items()}
                raise TimeoutError(f"decode ranks still waiting after {timeout_s} s: {missing}")
            time.sleep(0.05)

    def wait_freed(self, count: int, timeout_s: float = 30.0) -> dict[int, list]:
        deadline = time.monotonic() + timeout_s
        while True:
            out = {k[1]: self.status(k)["freed"] for k in self.prefill_ranks()}
            if all(len(v) >= count for v in out.values()):
                return out
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill ranks freed {out} after {timeout_s} s, expected {count} each")
            time.sleep(0.05)

    @staticmethod
    def check_outcomes(report: dict[int, dict], reqs: list[Request]) -> None:
        """Raise AssertionError unless every decode rank in ``report`` (from :meth:`wait`) got every
        request ``ok`` and byte-exact against the oracle."""
        for rank, outcomes in report.items():
            for r in reqs:
                o = outcomes[r.req_id]
                if not o["ok"]:
                    raise AssertionError(f"decode rank {rank} {r.req_id} ({r.mode}): {o['error']}: {o['msg']}")
                if o["mismatch"] is not None:
                    raise AssertionError(o["mismatch"])

    def transfer_exact(self, reqs: list[Request], timeout_s: float = 120.0) -> dict[int, list]:
        """Hold and fetch ``reqs`` on every rank, check every request byte-exact on every decode
        rank (:meth:`check_outcomes`) and no byte outside them changed (:meth:`canary`); returns
        each prefill rank's freed holds once ``len(reqs)`` were freed (:meth:`wait_freed`)."""
        self.hold(reqs)
        self.fetch(reqs)
        self.check_outcomes(self.wait(reqs, timeout_s=timeout_s), reqs)
        changed = {rank: c for rank, c in self.canary().items() if c is not None}
        if changed:
            raise AssertionError(f"bytes outside the received blocks changed: {changed}")
        return self.wait_freed(len(reqs))

    def canary(self) -> dict[int, str | None]:
        """Per decode rank: None if no byte outside successfully received blocks changed."""
        return {k[1]: self._call(k, "canary", timeout_s=60) for k in self.decode_ranks()}

    def kill_after(self, key, announcements: int) -> None:
        """Make a prefill process SIGKILL itself after it has announced ``announcements`` chunks."""
        self._call(key, "kill_after", announcements)

    def is_alive(self, key) -> bool:
        return self._procs[key].is_alive()

    def restart(self, key) -> None:
        """Start a fresh process for ``key`` (new NIXL agent) and re-run the handshake both ways."""
        self._procs.pop(key).stop(0.0)  # killed at once
        self._spawn(*key)
        self._md[key] = self._procs[key].ready(self._start_timeout)
        for other, mds in self._md.items():
            if other[0] != key[0]:
                for mode, md in mds.items():
                    self._call(key, "add_remote", mode, md)
                    self._call(other, "add_remote", mode, self._md[key][mode])

    def close(self) -> None:
        for child in self._procs.values():
            child.request_exit()
        deadline = time.monotonic() + 5
        for child in self._procs.values():  # one deadline for all: they stop in parallel
            child.stop(deadline - time.monotonic())
        self._procs.clear()

