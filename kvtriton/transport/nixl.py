"""A thin, typed wrapper over NIXL's Python agent (``nixl._api.nixl_agent``, UCX backend).

This module moves bytes and nothing else: it registers memory, prepares descriptor lists, posts
READ/WRITE requests by index, polls them and carries notifications. It knows nothing about heads,
layers or blocks; the planner computes every descriptor.

Behaviour of the installed NIXL (1.5.1, UCX 1.23, CPU, two processes on 127.0.0.1) that shapes
this wrapper, measured (see ``shared/reference/nixl_api_and_costs.md``):

* **Progress.** NIXL's progress thread runs by default, asleep on UCX's events (:mod:`.progress`),
  so a peer's READ after our message completes without our Python. Off (``progress_thread=False``,
  ``KVTRITON_NIXL_PROGRESS_THREAD=0``), **every agent, the passive side included, must call
  :meth:`NixlTransport.poll_notifs` regularly**: a READ from a peer asleep 1 s took 1,004 ms.
* **Costs.** A post (``transfer()``) costs ~2.3 µs per descriptor on top of its bytes (one
  ``process_vm_readv`` per descriptor over UCX's ``cma``); building and preparing lists adds
  ~0.05 µs per descriptor. ``make_prepped_xfer`` merges descriptors that are adjacent on both
  sides into one, so consecutive indices over contiguous slots cost one descriptor.
* **Connection.** ``add_remote_agent`` takes ~10 ms; the first post to a peer then returns
  ``PROC`` and completes after ~11-25 ms of wire-up (the peer polling every 0.5 ms). Later posts
  of up to tens of MiB usually complete inside ``transfer()`` (``DONE``), but callers must not
  rely on it: always :meth:`poll` until ``DONE``.
* **Failures.** A dead peer is reported by *raising* ``nixlRemoteDisconnectError`` from
  ``transfer()``, ``check_xfer_state()`` and ``send_notif()``, never by an ``"ERR"`` status; it
  is re-raised here as :class:`PeerDisconnectedError`. After such a failure UCX must be driven
  once more, or the process aborts at exit (``ucs_arbiter_group_is_empty`` assertion); the
  wrapper does that itself. Most ``_api.py`` helpers return ``None`` on bad input instead of
  raising: the wrapper validates its inputs up front and treats ``None`` as an error.
* **Notifications.** Sending needs the receiver's metadata loaded (:meth:`add_remote`) on the
  *sender*; receiving needs nothing. A notification sent to a peer that died since the last
  progress call can be accepted silently and lost, so liveness needs acknowledgements or
  deadlines above this layer.

An instance is not thread-safe: use it from one thread (NIXL's sync mode is NONE without the
listener).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

# --- errors -------------------------------------------------------------------------------------
# The typed errors live in kvtriton.errors; this is the only place the transport names them.
from ..errors import PeerDisconnectedError, TransportError
from .fence import Fences
from .handles import (
    OPS,
    MemType,
    Op,
    PreppedList,
    Registration,
    Xfer,
    XferStatus,
    as_bytes,
    check_mem_type,
    indices,
    region_descs,
    xfer_array,
)
from .progress import PROGRESS_WAIT_US, make_agent, thread_wanted

if TYPE_CHECKING:
    import torch

__all__ = ["MemType", "NixlTransport", "Op", "PeerDisconnectedError", "PreppedList", "Registration", "TransportError",
           "Xfer", "XferStatus"]

logger = logging.getLogger(__name__)


class NixlTransport:
    """One NIXL agent with the UCX backend, and the memory, lists and peers it owns.

    Parameters
    ----------
    name
        Agent name; must be unique among the agents that talk to each other.
    progress_thread
        Run NIXL's progress thread, waiting on UCX's events up to ``progress_wait_us`` between
        wake-ups (:mod:`.progress`). ``None``: on unless ``KVTRITON_NIXL_PROGRESS_THREAD=0``. Off,
        **call** :meth:`poll_notifs` **regularly on every agent**. :attr:`progress_thread` says which.
    listen_port
        If given, start NIXL's metadata listener on this TCP port (cheap: ~4 ms of CPU per
        second). The listener switches NIXL to its STRICT thread-sync mode. Metadata can always be
        exchanged out of band with :meth:`metadata` / :meth:`add_remote` instead.

    Examples
    --------
    >>> with NixlTransport("decode-0") as t:          # doctest: +SKIP
    ...     peer = t.add_remote(prefill_metadata)
    ...     reg = t.register([buf])
    ...     loc = t.prep_local(local_descs, "DRAM")   # Nx3 uint64 (addr, len, dev)
    ...     rem = t.prep_remote(peer, remote_descs, "DRAM")
    ...     x = t.post("READ", loc, [0, 1], rem, [4, 5], notif=b"req-7")
    ...     while t.poll(x) is XferStatus.PROC:
    ...         t.poll_notifs()
    ...     t.release(x)
    """

    def __init__(self, name: str, *, progress_thread: bool | None = None, listen_port: int | None = None,
                 progress_wait_us: int = PROGRESS_WAIT_US) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"agent name must be a non-empty str, got {name!r}")
        if listen_port is not None and not (0 < int(listen_port) < 65536):
            raise ValueError(f"listen_port must be in 1..65535, got {listen_port}")
        try:
            from nixl import _api as nixl_api
            from nixl import _bindings as nixl_bindings
            from nixl._api import nixl_agent_config
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "kvtriton's NIXL transport needs the 'nixl' package: pip install 'kvtriton[nixl]'"
            ) from e

        # Every status NIXL raises is its own class in the bindings (nixlNotFoundError, ...).
        self._nixl_errors: tuple[type[BaseException], ...] = tuple(
            obj
            for attr, obj in vars(nixl_bindings).items()
            if attr.startswith("nixl") and attr.endswith("Error") and isinstance(obj, type)
            and issubclass(obj, Exception)
        )
        self._disconnect_error: type[BaseException] = nixl_bindings.nixlRemoteDisconnectError

        conf = nixl_agent_config(
            enable_prog_thread=thread_wanted(progress_thread),
            enable_listen_thread=listen_port is not None,
            listen_port=int(listen_port) if listen_port is not None else 0,
            backends=["UCX"],
        )
        try:
            agent, self.progress_thread = make_agent(nixl_api, name, conf, progress_wait_us)
        except self._nixl_errors as e:
            raise TransportError(f"cannot create NIXL agent {name!r}: {_describe(e)}") from e
        if "UCX" not in agent.backends:
            raise TransportError(
                f"NIXL agent {name!r} has no UCX backend (available plugins: {agent.plugin_list})"
            )
        self._agent = agent
        self.name = name
        self.listen_port = listen_port
        self._regs: list[Registration] = []
        self._lists: list[PreppedList] = []
        self._xfers: dict[int, Xfer] = {}
        self._remotes: set[str] = set()
        self._pending: dict[str, list[bytes]] = {}
        self._closed = False
        # the UCX flush workaround (see .fence): this transport's sends and posts mark its peers
        self.fences = Fences(self)

    # ---- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._remotes)} remotes, {len(self._regs)} registrations"
        return f"NixlTransport({self.name!r}, {state})"

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release every transfer and prepared list, deregister all memory, forget every peer.

        Idempotent and safe after a peer died: failures are logged, not raised. Drives progress
        first so that UCX settles requests that failed on a dead peer. Notifications not yet
        collected are dropped.
        """
        if self._closed:
            return
        self._closed = True
        self._quiet(self._progress)
        for x in list(self._xfers.values()):
            self._quiet(self._release_xfer, x)
        for pl in self._lists:
            self._quiet(self._release_list, pl)
        self._lists.clear()
        for name in sorted(self._remotes):
            self._quiet(self._agent.remove_remote_agent, name)
        self._remotes.clear()
        for reg in self._regs:
            self._quiet(self._deregister, reg)
        self._regs.clear()
        self._quiet(self._progress)
        self._pending.clear()
        self._agent = None  # the C++ agent is destroyed once the last NIXL handle drops it

    def _quiet(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # close() must not raise because a peer is gone
            logger.warning("NixlTransport(%r).close: %s failed: %s", self.name, getattr(fn, "__name__", fn), e)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"NixlTransport {self.name!r} is closed")

    # ---- memory ---------------------------------------------------------------------------------

    def register(
        self,
        regions: torch.Tensor | Sequence[torch.Tensor] | Sequence[tuple[int, ...]] | np.ndarray,
        mem_type: MemType | None = None,
    ) -> Registration:
        """Register memory with the UCX backend and return the handle to deregister it with.

        ``regions`` is a contiguous tensor, a list of contiguous tensors (all CPU, or all on one
        CUDA device), a list of ``(addr, len)`` or ``(addr, len, dev)`` tuples, or an ``Nx3``
        integer array ``(addr, len, dev)``. ``mem_type`` is inferred from tensors (CPU: ``DRAM``,
        CUDA: ``VRAM``) and required for raw addresses.

        Register large slabs once (a cache, a staging pool); registration pins and maps memory
        and costs far more than a transfer setup. Registered tensors are kept alive until
        :meth:`deregister`. VRAM is refused without a CUDA device: on this NIXL a failed VRAM
        registration leaves the agent's metadata unloadable by peers, so it is never probed.
        """
        self._check_open()
        descs, inferred, keep = region_descs(regions)
        mem_type = check_mem_type(mem_type if mem_type is not None else inferred, "register")
        if inferred is not None and inferred != mem_type:
            raise ValueError(f"register: tensors are {inferred} memory but mem_type={mem_type!r}")
        if mem_type == "VRAM" and inferred is None:
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    "register: VRAM needs a CUDA device; this process has none (would break the agent)"
                )
        try:
            dlist = self._agent.register_memory(descs, mem_type)
        except self._nixl_errors as e:
            raise TransportError(f"register of {len(descs)} {mem_type} regions failed: {_describe(e)}") from e
        if dlist is None:
            raise TransportError(f"register: NIXL rejected the {mem_type} descriptors (see its log)")
        descs.flags.writeable = False
        reg = Registration(mem_type, descs, dlist, keep)
        self._regs.append(reg)
        return reg

    def deregister(self, reg: Registration) -> None:
        """Deregister memory registered by :meth:`register`. Idempotent.

        Release the prepared lists and transfers that use it first.
        """
        self._check_open()
        self._deregister(reg)
        if reg in self._regs:
            self._regs.remove(reg)

    def _deregister(self, reg: Registration) -> None:
        if reg.released:
            return
        try:
            self._agent.deregister_memory(reg._dlist)
        except self._nixl_errors as e:
            raise TransportError(f"deregister failed: {_describe(e)}") from e
        reg.released = True
        reg._keepalive = ()

    # ---- peers ----------------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered regions), ~0.5 KB.

        Send it to peers out of band; call again after (de)registering memory, since it
        describes the registrations at the time of the call.
        """
        self._check_open()
        try:
            md = self._agent.get_agent_metadata()
        except self._nixl_errors as e:
            raise TransportError(f"get_agent_metadata failed: {_describe(e)}") from e
        if not md:
            raise TransportError("get_agent_metadata returned nothing")
        return bytes(md)

    def add_remote(self, md: bytes) -> str:
        """Load a peer's :meth:`metadata` and return the peer's agent name (as ``str``).

        Needed before preparing lists on the peer's memory and before sending it notifications
        (not to receive from it). Loading again for a known peer updates its regions. Costs
        ~10 ms here; the connection itself is made lazily by the first transfer or
        notification, or ahead of time by :meth:`connect`.
        """
        self._check_open()
        if not isinstance(md, (bytes, bytearray, memoryview)) or len(md) == 0:
            raise ValueError(f"add_remote: metadata must be non-empty bytes, got {type(md).__name__}")
        try:
            name = self._agent.add_remote_agent(bytes(md))
        except self._nixl_errors as e:
            raise TransportError(f"add_remote: cannot load peer metadata ({len(md)} B): {_describe(e)}") from e
        if name is None:
            raise TransportError("add_remote: NIXL returned no agent name")
        name = name.decode() if isinstance(name, (bytes, bytearray)) else str(name)
        self._remotes.add(name)
        return name

    def has_remote(self, name: str, descs: np.ndarray | None = None, mem_type: MemType = "DRAM") -> bool:
        """Whether the peer's metadata is loaded and, if ``descs`` (Nx3) is given, whether those
        exact ranges lie inside regions the peer registered."""
        self._check_open()
        dl = None
        if descs is not None:
            arr, _ = xfer_array(descs, "has_remote", allow_strided=False)
            dl = self._agent.get_xfer_descs(arr, check_mem_type(mem_type, "has_remote"))
            if dl is None:
                raise TransportError("has_remote: NIXL rejected the descriptors")
        return bool(self._agent.check_remote_metadata(name, dl))

    def connect(self, name: str) -> None:
        """Start connecting to a peer ahead of the first transfer (``make_connection``).

        Returns at once; the wire-up proceeds while both sides poll. With ~0.1 s of polling in
        between, a first 4 KiB READ took 3 ms instead of 19 ms.
        """
        self._check_open()
        try:
            self._agent.make_connection(name)
        except self._nixl_errors as e:
            raise self._translate(e, f"connect to {name!r}", name) from e

    def remove_remote(self, name: str) -> None:
        """Forget a peer: release the lists prepared on it, unload its metadata, disconnect.

        Release transfers that target it first. Idempotent.
        """
        self._check_open()
        for pl in [pl for pl in self._lists if pl.agent == name]:
            self._release_list(pl)
            self._lists.remove(pl)
        if name in self._remotes:
            self._remotes.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except self._nixl_errors as e:
                raise TransportError(f"remove_remote {name!r} failed: {_describe(e)}") from e

    @property
    def remotes(self) -> frozenset[str]:
        """Names of the peers whose metadata is loaded."""
        return frozenset(self._remotes)

    # ---- descriptor lists -----------------------------------------------------------------------

    def prep_local(self, descs: np.ndarray, mem_type: MemType) -> PreppedList:
        """Prepare a list of local descriptors, for the local side of :meth:`post`.

        ``descs`` is an ``Nx3`` integer array ``(addr, len, dev)`` (``dev`` = 0 for DRAM, the
        CUDA ordinal for VRAM), or an ``Nx5`` array ``(addr, len, dev, stride, count)`` whose row
        stands for ``count`` descriptors of ``len`` bytes ``stride`` apart (indices expand row by
        row). Every descriptor must lie inside memory this agent registered.

        Prepare once and address by index: preparing costs ~25 ns per descriptor (Nx5: ~0.1 ms
        whatever N), against ~2.3 µs per descriptor for each post.
        """
        return self._prep("", descs, mem_type, "prep_local")

    def prep_remote(self, agent_name: str, descs: np.ndarray, mem_type: MemType) -> PreppedList:
        """Prepare a list of a peer's descriptors, for the remote side of :meth:`post`.

        ``descs`` as in :meth:`prep_local`, in the peer's address space; every descriptor must lie
        inside a region the peer registered (as of the metadata loaded by :meth:`add_remote`).
        Passing this agent's own name prepares a loopback list.
        """
        if not isinstance(agent_name, str) or not agent_name:
            raise ValueError(f"prep_remote: agent_name must be a non-empty str, got {agent_name!r}")
        return self._prep(agent_name, descs, mem_type, "prep_remote")

    def _prep(self, agent: str, descs: np.ndarray, mem_type: MemType, what: str) -> PreppedList:
        self._check_open()
        mem_type = check_mem_type(mem_type, what)
        arr, count = xfer_array(descs, what, allow_strided=True)
        if agent and agent != self.name and agent not in self._remotes:
            raise TransportError(f"{what}: unknown peer {agent!r}; call add_remote() with its metadata first")
        try:
            if arr.shape[1] == 3:
                dl = self._agent.get_xfer_descs(arr, mem_type)
                if dl is None:
                    raise TransportError(f"{what}: NIXL rejected the descriptor array (see its log)")
                h = self._agent.prep_xfer_dlist(agent, dl, mem_type)
            else:
                h = self._agent.prep_xfer_dlist(agent, arr, mem_type)
        except self._nixl_errors as e:
            where = f"peer {agent!r} (or the peer is gone)" if agent else "this agent"
            msg = f"{what}: {count} {mem_type} descriptors are not all inside memory registered by {where}"
            raise self._translate(e, msg, agent) from e
        if h is None:
            raise TransportError(f"{what}: NIXL returned no prepared list")
        pl = PreppedList(agent, mem_type, count, h)
        self._lists.append(pl)
        return pl

    def release_list(self, pl: PreppedList) -> None:
        """Release a prepared list. Idempotent. Release the transfers made from it first."""
        self._check_open()
        self._release_list(pl)
        if pl in self._lists:
            self._lists.remove(pl)

    def _release_list(self, pl: PreppedList) -> None:
        if pl.released:
            return
        try:
            pl._handle.release()
        except self._nixl_errors as e:
            raise TransportError(f"release of a prepared list failed: {_describe(e)}") from e
        pl.released = True

    # ---- transfers ------------------------------------------------------------------------------

    def post(
        self,
        op: Op,
        local: PreppedList,
        local_idx: Sequence[int] | np.ndarray,
        remote: PreppedList,
        remote_idx: Sequence[int] | np.ndarray,
        notif: bytes = b"",
    ) -> Xfer:
        """Create a transfer from prepared lists and post it.

        ``op`` is ``"READ"`` (remote -> local) or ``"WRITE"`` (local -> remote); descriptor
        ``local_idx[i]`` of ``local`` pairs with ``remote_idx[i]`` of ``remote`` (same lengths).
        ``notif``, if non-empty, is delivered to the peer once the data has landed.

        Cost: ~45 ns per index pair to create, then ~2.3 µs per descriptor plus the bytes
        (~7.3 GB/s on CPU) to post. Pairs adjacent on both sides are merged into one descriptor
        first (e.g. consecutive indices over contiguous equal slots post as one).

        Returns an :class:`Xfer` whose ``status`` may already be ``DONE``; otherwise :meth:`poll`
        it. Raises :class:`PeerDisconnectedError` if the peer is gone, :class:`TransportError` on
        other NIXL failures, ``ValueError`` on bad arguments.
        """
        self._check_open()
        if op not in OPS:
            raise ValueError(f"post: op must be 'READ' or 'WRITE', got {op!r}")
        if not isinstance(local, PreppedList) or not local.is_local:
            raise ValueError("post: 'local' must be a list from prep_local()")
        if not isinstance(remote, PreppedList) or remote.is_local:
            raise ValueError("post: 'remote' must be a list from prep_remote()")
        if local.released or remote.released:
            raise ValueError("post: a prepared list was already released")
        li = indices(local_idx, local.count, "local_idx")
        ri = indices(remote_idx, remote.count, "remote_idx")
        if len(li) != len(ri):
            raise ValueError(f"post: local_idx has {len(li)} entries but remote_idx has {len(ri)}")
        if len(li) == 0:
            raise ValueError("post: no descriptors to transfer")
        notif = as_bytes(notif, "notif")
        try:
            h = self._agent.make_prepped_xfer(op, local._handle, li, remote._handle, ri, notif)
        except self._nixl_errors as e:
            raise self._translate(e, f"{op} request to {remote.agent!r}", remote.agent) from e
        if h is None:
            raise TransportError(f"post: NIXL created no {op} request")
        x = Xfer(op, remote.agent, len(li), h, notif)
        self._xfers[id(x)] = x
        try:
            x.status = self._post(x, notif)
        except BaseException:
            self._quiet(self._release_xfer, x)
            raise
        self.fences.posted(remote.agent)
        if notif:  # a notification on a transfer leaves the endpoint as a message does (see fence.py)
            self.fences.sent(remote.agent)
        return x

    def repost(self, x: Xfer, notif: bytes | None = None) -> XferStatus:
        """Post a finished transfer again (same descriptors, data copied again).

        Saves the ~45 ns per descriptor of creating the request, not the post cost. ``notif``
        replaces the notification given at creation, for this post only.
        """
        self._check_open()
        if x.released:
            raise ValueError("repost: transfer was released")
        if x.status is XferStatus.PROC:
            raise ValueError("repost: transfer is still in progress")
        x.status = XferStatus.PROC
        notif = x._notif if notif is None else as_bytes(notif, "notif")
        x.status = self._post(x, notif)
        self.fences.posted(x.remote)
        if notif:
            self.fences.sent(x.remote)
        return x.status

    def _post(self, x: Xfer, notif: bytes) -> XferStatus:
        try:
            st = self._agent.transfer(x._handle, notif)
        except self._nixl_errors as e:
            x.status = XferStatus.ERR
            raise self._translate(e, f"posting {x.op} to {x.remote!r}", x.remote) from e
        return XferStatus(st)

    def poll(self, x: Xfer) -> XferStatus:
        """State of a posted transfer; also drives its progress.

        Returns ``DONE`` at once when already seen done. Raises :class:`PeerDisconnectedError`
        if the peer died (NIXL raises rather than reporting ``ERR`` then).
        """
        self._check_open()
        if x.released:
            raise ValueError("poll: transfer was released")
        if x.status is XferStatus.DONE:
            return x.status
        try:
            x.status = XferStatus(self._agent.check_xfer_state(x._handle))
        except self._nixl_errors as e:
            x.status = XferStatus.ERR
            raise self._translate(e, f"{x.op} to {x.remote!r}", x.remote) from e
        return x.status

    def release(self, x: Xfer) -> None:
        """Free a transfer request. Idempotent.

        A transfer still in progress is aborted if UCX can, otherwise :class:`TransportError`.
        """
        self._check_open()
        self._release_xfer(x)

    def _release_xfer(self, x: Xfer) -> None:
        if x.released:
            return
        try:
            x._handle.release()
        except self._nixl_errors as e:
            raise TransportError(f"release of a {x.op} request to {x.remote!r} failed: {_describe(e)}") from e
        x.released = True
        self._xfers.pop(id(x), None)

    # ---- notifications --------------------------------------------------------------------------

    def send_notif(self, agent_name: str, msg: bytes) -> None:
        """Send a short message to a peer, outside any transfer (UCX active message, tcp/lo).

        The peer's metadata must be loaded here (:meth:`add_remote`). Drives progress first so a
        peer that has died is detected (:class:`PeerDisconnectedError`); even so, a message sent
        right after a peer died may be accepted and lost. ~20-40 µs per call once connected; the
        first one to a peer also connects (~1.5 ms).
        """
        self._check_open()
        msg = as_bytes(msg, "msg")
        self._progress()
        try:
            self._agent.send_notif(agent_name, msg)
        except self._nixl_errors as e:
            if agent_name not in self._remotes and not isinstance(e, self._disconnect_error):
                raise TransportError(
                    f"send_notif: no metadata for {agent_name!r}; the sender must add_remote() the receiver"
                ) from e
            raise self._translate(e, f"send_notif to {agent_name!r}", agent_name) from e
        self.fences.sent(agent_name)

    def poll_notifs(self) -> dict[str, list[bytes]]:
        """New notifications, keyed by sender name (``str``), in arrival order per sender.

        Also drives the agent's progress (connection wire-up, pending transfers). Without the
        progress thread every agent must call this regularly. Cheap: ~1-3 µs when idle.
        """
        self._check_open()
        self._progress()
        out, self._pending = self._pending, {}
        return out

    def _progress(self) -> None:
        new = self._agent.get_new_notifs()
        for sender, msgs in new.items():
            if msgs:
                key = sender.decode() if isinstance(sender, (bytes, bytearray)) else str(sender)
                self._pending.setdefault(key, []).extend(bytes(m) for m in msgs)

    # ---- errors ---------------------------------------------------------------------------------

    def _translate(self, e: BaseException, what: str, peer: str | None) -> TransportError:
        """Map a NIXL exception to a typed error. On a disconnect, drive progress once so UCX
        settles the failed request (otherwise the process aborts at exit)."""
        if isinstance(e, self._disconnect_error):
            try:
                self._progress()
            except Exception:  # progress on a broken endpoint must not mask the real error
                pass
            err = PeerDisconnectedError(f"{what}: peer {peer!r} disconnected ({_describe(e)})")
            err.peer = peer  # type: ignore[attr-defined]
            return err
        return TransportError(f"{what}: {_describe(e)}")


# ---- helpers ------------------------------------------------------------------------------------


def _describe(e: BaseException) -> str:
    msg = str(e)
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__
