"""The classes SGLang gets for ``--disaggregation-transfer-backend kvtriton`` (imports SGLang).

Built on SGLang's ``Common*`` classes, which SGLang's scheduler relies on beyond the abstract
bases (``decode.py`` calls ``try_ensure_parallel_info`` and reads ``prefill_info_table``): the
bootstrap server, the topology registration and the ``/route`` queries, the ``KVPoll`` state of
each room (``request_status``, ``failure_records``), timeouts, heartbeats and the ABORT message
are SGLang's own. What moves, and how, is kvtriton's: one
:class:`~kvtriton.agent.TransferAgent` per TP rank over views of SGLang's K/V pool (:mod:`.caches`),
made from the settings as the vLLM connector's are (:func:`~kvtriton.integrations.core.make_agent`),
the prefill and decode parts in :mod:`.prefill_role` / :mod:`.decode_role`, their messages in
:mod:`.messages`.

A case the backend does not move is refused when the manager is built, before anything is
registered, with :class:`~.settings.UnsupportedSetupError` naming it (:func:`refuse_unsupported`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import requests
import torch
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_disagg, get_parallel, get_serving
from sglang.srt.utils.network import NetworkAddress

from ...errors import AuthenticationError, KVTritonError, ProtocolError
from ...protocol import wire
from ...protocol.auth import PairKeys
from ...protocol.handshake import Meeting as HandshakeMeeting
from ...protocol.handshake import MetadataServer
from ...protocol.seal import ControlSigner
from ..core import make_agent
from .caches import aux_views, kv_regions, local_heads
from .decode_role import DecodeRole
from .inline import InlineProgress
from .messages import ABORT_SEALED_TAG, READY_TAG, STATUS_TAG, WANT_TAG, Abort, Ready, Want
from .prefill_role import PrefillRole
from .settings import BackendSettings, UnsupportedSetupError, control_signer, hybrid_missing

__all__ = ["KVTritonKVBootstrapServer", "KVTritonKVManager", "KVTritonKVReceiver", "KVTritonKVSender",
           "refuse_unsupported", "total_kv_heads"]

logger = logging.getLogger(__name__)

#: tags of our control messages: sealed when the credential has a secret (:mod:`kvtriton.protocol.seal`)
_SIGNED_TAGS = (WANT_TAG, READY_TAG, STATUS_TAG, ABORT_SEALED_TAG)
_REFUSED_LOG_EVERY_S = 5.0
_MAX_AGENTS_KNOWN = 4096  # ZMQ addresses whose rank's incarnation is kept (the least recent goes)


def refuse_unsupported(args, is_mla_backend: bool) -> None:
    """Raise :class:`UnsupportedSetupError` naming the first case this backend does not move."""
    p = get_parallel()
    cases = []
    if is_mla_backend:
        cases.append("an MLA KV pool (a latent cache replicated over TP)")
    states = [getattr(s, "value", str(s)) for s in (getattr(args, "state_types", None) or [])]
    if any(s in ("block_scale", "block_scale_swa") for s in states):
        cases.append(f"fp8 KV with block-scale pools (state types {states})")
    elif states:
        cases.append(f"hybrid state pools ({hybrid_missing(states)})")
    if p.pp_size > 1:
        cases.append(f"pipeline parallelism (pp_size={p.pp_size})")
    if getattr(args, "num_draft_entries", 0):
        cases.append(f"a draft model's KV (speculative decoding: {args.num_draft_entries} draft buffers)")
    if p.attn_cp_size > 1 or p.attn_dcp_size > 1:
        cases.append(f"context parallelism (attn_cp_size={p.attn_cp_size}, attn_dcp_size={p.attn_dcp_size})")
    if p.attn_dp_size > 1:
        cases.append(f"data-parallel attention (attn_dp_size={p.attn_dp_size})")
    if p.enable_kv_cache_sharding:
        cases.append("--enable-kv-cache-sharding")
    if getattr(args, "kv_layout", None) is not None:
        cases.append(f"a KV layout other than the token-major MHA pool (kv_layout={args.kv_layout!r})")
    if get_disagg().disaggregation_decode_allocation_policy != "early":
        cases.append("--disaggregation-decode-allocation-policy prefill_complete")
    if cases:
        raise UnsupportedSetupError("the kvtriton transfer backend does not support " + "; ".join(cases) +
                                    " (SGLang's own backends: --disaggregation-transfer-backend nixl or mooncake)")


def total_kv_heads(args, server_args) -> int:
    """The model's KV heads: what SGLang's prefill states, else the model's config (a decode's
    ``KVArgs`` carries head counts only with SGLang's own staging on)."""
    total = int(getattr(args, "total_kv_head_num", 0) or 0)
    if total > 0:
        return total
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(server_args.model_path, trust_remote_code=server_args.trust_remote_code)
    except (OSError, ValueError) as e:
        raise UnsupportedSetupError(f"the KV head count: the model config at {server_args.model_path!r} cannot be "
                                    f"read ({e})") from None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    total = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    if not total:
        raise UnsupportedSetupError(f"the model config at {server_args.model_path!r} states no KV head count "
                                    f"(num_key_value_heads / num_attention_heads)")
    return int(total)


class KVTritonKVManager(CommonKVManager):
    """SGLang's KV manager of one TP rank, moving KV with a :class:`~kvtriton.agent.TransferAgent`."""

    kv_status_msg_tag = STATUS_TAG
    kv_status_msg_carries_reason = True

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        refuse_unsupported(args, bool(is_mla_backend))
        self.settings = BackendSettings.from_env()  # a bad one fails here, before registering
        self.credential = self.settings.agent.credential()
        total = total_kv_heads(args, server_args)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        heads = local_heads(total, self.attn_tp_size)
        stated = int(getattr(args, "kv_head_num", 0) or 0)
        if stated and stated != heads:
            raise UnsupportedSetupError(f"a pool of {stated} KV heads on rank {self.attn_tp_rank} of TP "
                                        f"{self.attn_tp_size}: expected {heads} of the model's {total}")
        device = torch.device("cpu") if str(getattr(server_args, "device", "cuda")).startswith("cpu") else \
            torch.device("cuda", int(getattr(args, "gpu_id", 0) or 0))
        regions = kv_regions(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, page_size=args.page_size,
                             heads=heads, total_heads=total, device=device)
        aux = aux_views(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)
        self.is_prefill = disaggregation_mode == DisaggregationMode.PREFILL
        # one id for every TP rank of the engine, unique in the cluster
        port = self.bootstrap_port if self.is_prefill else get_serving().port
        where = self.dist_init_addr or f"{self.local_ip}:{port}"
        s = self.settings.agent
        self.agent = make_agent(s, f"sglang-{'prefill' if self.is_prefill else 'decode'}@{where}", self.attn_tp_rank,
                                self.attn_tp_size, regions, self.credential)
        self.signer: ControlSigner | None = control_signer(self.credential, agent=self.agent.transport.name)
        self._agents_at: OrderedDict[tuple[str, int], str] = OrderedDict()  # ZMQ address -> the agent there
        self._agents_lock = threading.Lock()
        self.refused_messages = 0  # control messages refused (bad or missing seal, wrong sender)
        self._refused_logged = float("-inf")
        self.server: MetadataServer | None = None
        self.prefill: PrefillRole | None = None
        self.decode: DecodeRole | None = None
        self._stop = threading.Event()
        try:
            if self.is_prefill:
                self.prefill = PrefillRole(self, self.agent, aux, lease_s=s.lease_s, poll=KVPoll)
                port = self.settings.handshake_port(self.bootstrap_port, self.attn_tp_rank)
                self.server = MetadataServer(self.local_ip, port, self.agent.metadata, on_meeting=self._met,
                                             credential=self.credential, io_timeout_s=s.handshake_timeout_s,
                                             on_kept=self.agent.add_lifeline).start()
            else:
                self.decode = DecodeRole(self, self.agent, aux, self.settings, self.credential, poll=KVPoll,
                                         handshake_port=self.settings.handshake_port)
        except BaseException:
            self.agent.close()
            raise
        self.inline = InlineProgress(self.agent, on_result=self.decode.on_result if self.decode else None,
                                     on_freed=self.prefill.on_freed if self.prefill else None)
        self.agent.start(s.progress_interval_s)
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"kvtriton-sgl-{self.attn_tp_rank}")
        self._thread.start()
        if not self.is_prefill:
            self._start_heartbeat_checker_thread()

    # ------------------------------------------------------------------ what the roles call
    def _met(self, meeting: HandshakeMeeting) -> str:
        """A decode rank met this prefill rank's handshake server: added to the agent (with its
        pair keys: NIXL messages sealed both ways), and its ZMQ messages sealed under the same
        pair's keys."""
        name = self.agent.add_remote(meeting.metadata, authenticated=self.credential is not None, keys=meeting.keys)
        if meeting.keys is not None:
            md = wire.decode_metadata(meeting.metadata)
            self.learn_pair(md.agent, md.engine, md.rank, meeting.keys)
        return name

    def learn_pair(self, agent: str, engine: str, rank: int, keys: PairKeys | None) -> None:
        """The rank ``agent`` (``engine`` rank ``rank``) was met with ``keys``: our control
        messages with it are sealed under them (:mod:`kvtriton.protocol.seal`)."""
        if self.signer is not None and keys is not None:
            self.signer.learn(agent, engine, rank, keys)

    def learn_agent(self, ip: str, port: int, agent: str) -> None:
        """The rank at ``ip:port`` is the incarnation ``agent`` (a prefill rank met, or the sender
        of a verified WANT): what our seals to that address are bound to."""
        with self._agents_lock:
            self._agents_at[(ip, int(port))] = agent
            self._agents_at.move_to_end((ip, int(port)))
            while len(self._agents_at) > _MAX_AGENTS_KNOWN:
                self._agents_at.popitem(last=False)

    def send(self, ip: str, port: int, frames: list[bytes]) -> None:
        if self.signer is not None:
            with self._agents_lock:
                to = self._agents_at.get((ip, int(port)))
            if to is None:  # a seal names its receiver: nothing is sent to a rank never met nor heard
                logger.warning("kvtriton: no known rank at %s:%s to seal a message for; not sent", ip, port)
                return
            try:
                frames = self.signer.seal(frames, to)
            except AuthenticationError as e:  # no pair keys with it (not met, or forgotten)
                logger.warning("kvtriton: a message to %s:%s not sent: %s", ip, port, e)
                return
        na = NetworkAddress(ip, int(port))
        try:
            self._send_multipart_locked(na.to_tcp(), frames, is_ipv6=na.is_ipv6)
        except zmq.ZMQError as e:
            logger.warning("kvtriton: a message to %s:%s failed: %s", ip, port, e)

    def send_kv_status_message(self, *, targets, bootstrap_room, status, failure_reason=None) -> None:
        """SGLang's status message (tagged ``STATUS_TAG``), sealed like ours for each target: the
        decode acts on a failure only when a prefill rank of the cluster sent it to it."""
        if self.signer is None:
            return super().send_kv_status_message(targets=targets, bootstrap_room=bootstrap_room, status=status,
                                                  failure_reason=failure_reason)
        parts = self._encode_kv_status_message(bootstrap_room=bootstrap_room, status=status,
                                               failure_reason=failure_reason)
        for ip, port in targets:
            self.send(ip, port, parts)

    def tell_failed(self, room: int, reason: str | None, targets) -> None:
        self.send_kv_status_message(targets=list(targets), bootstrap_room=room, status=KVPoll.Failed,
                                    failure_reason=reason or "kvtriton: transfer failed")

    def failure_reason(self, room: int) -> str | None:
        with self.failure_lock:
            return self.failure_records.get(room)

    def set_decode_prefix_len(self, room: int, n: int) -> None:
        self.req_to_decode_prefix_len[room] = n

    def route(self, addr: str, rank: int) -> dict:
        """The bootstrap's row for prefill TP rank ``rank`` (its ZMQ address)."""
        url = (f"http://{addr}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={rank}"
               f"&target_pp_rank=0")
        try:
            r = requests.get(url, timeout=5)
        except requests.RequestException as e:
            raise ProtocolError(f"the bootstrap at {addr} did not answer for prefill rank {rank}: {e}") from None
        if r.status_code != 200:
            raise ProtocolError(f"the bootstrap at {addr} has no prefill rank {rank}: HTTP {r.status_code}")
        row = r.json()
        if not isinstance(row, dict) or not isinstance(row.get("rank_ip"), str) or not isinstance(
                row.get("rank_port"), int):
            raise ProtocolError(f"the bootstrap at {addr} answered {str(row)[:120]!r} for prefill rank {rank}")
        return row

    # ------------------------------------------------------------------ SGLang's calls
    def add_transfer_request(self, bootstrap_room, kv_indices, index_slice, is_last_chunk, aux_index=None,
                             state_indices=None, num_kv_tokens=None, *, wait_event=None, indices_event=None,
                             trace_ctx=None):
        if self.prefill is None:
            raise UnsupportedSetupError("add_transfer_request on a decode rank")
        self.prefill.add_chunk(bootstrap_room, kv_indices, index_slice.start, is_last_chunk, aux_index,
                               lambda: self.request_status.get(bootstrap_room))

    def _handle_node_failure(self, failed_bootstrap_addr: str):
        with self.connection_lock:
            rooms = list(self.addr_to_rooms_tracker.get(failed_bootstrap_addr, []))
        super()._handle_node_failure(failed_bootstrap_addr)
        if self.decode is not None:
            self.decode.forget_engine(failed_bootstrap_addr)
            for room in rooms:
                if self.request_status.get(room) == KVPoll.Failed:
                    self.record_failure(room, f"PeerDisconnectedError: lost the prefill engine at "
                                              f"{failed_bootstrap_addr} (SGLang's heartbeat)")
                    self.decode.abort(room)

    # ------------------------------------------------------------------ the event loop
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(1):
                    self._on_message(self.server_socket.recv_multipart(zmq.NOBLOCK))
                self.inline.drain()
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                logger.warning("kvtriton: socket error: %s", e)
                time.sleep(0.01)
            except Exception:  # noqa: BLE001 - one bad event must not stop every transfer of this rank
                logger.exception("kvtriton: event loop")

    def _refuse(self, why: str) -> None:
        """Count a refused control message; log at most one line per few seconds (a flood must
        not flood the log)."""
        self.refused_messages += 1
        now = time.monotonic()
        if now - self._refused_logged >= _REFUSED_LOG_EVERY_S:
            self._refused_logged = now
            logger.warning("kvtriton: refused a control message (%d so far on rank %d): %s", self.refused_messages,
                           self.attn_tp_rank, why)

    def _on_message(self, msg: list[bytes]) -> None:
        tag = msg[0] if msg else b""
        sender = None
        if self.signer is not None and tag in _SIGNED_TAGS:
            try:  # the seal first: nothing else of an unverified payload is parsed
                sender = self.signer.open(msg)
            except AuthenticationError as e:
                self._refuse(f"{tag[:24]!r}: {e}")
                return
            msg = sender.frames
        try:
            if self.prefill is not None and tag == WANT_TAG:
                want = Want.from_zmq(msg)
                if sender is not None and (want.engine, want.rank) != (sender.engine, sender.rank):
                    self._refuse(f"a WANT naming {want.engine!r} rank {want.rank}, sealed by {sender.engine!r} "
                                 f"rank {sender.rank}")
                    return
                if sender is not None:  # our answers to its address are sealed for it
                    self.learn_agent(want.ip, want.port, sender.agent)
                self.prefill.on_want(want)
            elif self.prefill is not None and tag == ABORT_SEALED_TAG:
                abort = Abort.from_zmq(msg)
                consumer = self.prefill.consumer(abort.room)
                by = (sender.engine, sender.rank) if sender is not None else (abort.engine, abort.rank)
                if (abort.engine, abort.rank) != by or consumer not in (None, abort.engine):
                    self._refuse(f"an abort of room {abort.room} (held for {consumer!r}) from {by[0]!r} rank {by[1]}")
                    return
                self.prefill.on_abort(abort.room)
            elif self.prefill is not None and tag == ABORT_TAG and self.signer is not None:
                self._refuse("SGLang's unsealed ABORT: with a cluster secret a decode aborts with a sealed KVT_ABORT")
            elif self.prefill is not None and tag == ABORT_TAG:
                note = AbortNotification.from_zmq(msg)
                if note is not None:
                    self.prefill.on_abort(note.room)
            elif self.decode is not None and tag == READY_TAG:
                ready = Ready.from_zmq(msg, list(self.kv_args.aux_item_lens))
                if sender is not None and (ready.engine, ready.rank) != (sender.engine, sender.rank):
                    self._refuse(f"a READY naming {ready.engine!r} rank {ready.rank}, sealed by {sender.engine!r} "
                                 f"rank {sender.rank}")
                    return
                self.decode.on_ready(ready)  # it checks the room's WANT went to that rank
            elif self.decode is not None and tag == STATUS_TAG:
                parsed = self.parse_kv_status_message(msg)
                if parsed is not None and parsed[1] == KVPoll.Failed:
                    room, status, rank, reason = parsed
                    if sender is not None and (rank != sender.rank or
                                               not self.decode.reads_from(room, sender.engine, sender.rank)):
                        self._refuse(f"a failure of room {room} sealed by {sender.engine!r} rank {sender.rank}, "
                                     f"which this room does not read")
                        return
                    self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank,
                                              failure_reason=reason)
                    self.decode.abort(room)
            else:
                self._refuse(f"a message tagged {tag[:24]!r}, not one this rank takes")
        except KVTritonError as e:
            logger.warning("kvtriton: dropped a malformed message: %s", e)

    def close(self) -> None:
        """Stop this rank's transfers (tests; SGLang ends the process instead)."""
        self._stop.set()
        self._thread.join(5)
        if self.decode is not None:
            self._heartbeat_shutdown.set()
            self.decode.close()
        if self.server is not None:
            self.server.close()
        self.agent.close()


class KVTritonKVSender(CommonKVSender):
    """SGLang's prefill sender; the pages go to :meth:`KVTritonKVManager.add_transfer_request`."""

    def poll(self):
        self.kv_mgr.inline.step()  # the scheduler's thread progresses the agent (see .inline)
        return super().poll()

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.prefill.forget(self.bootstrap_room)


class KVTritonKVReceiver(CommonKVReceiver):
    """SGLang's decode receiver over :class:`~.decode_role.DecodeRole` (any pair of TP sizes)."""

    def poll(self):
        self.kv_mgr.inline.step()  # the scheduler's thread progresses the agent (see .inline)
        return super().poll()

    def init(self, prefill_dp_rank: int):
        if self.conclude_state == KVPoll.Failed:
            return
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        if info is None:
            self.kv_mgr.record_failure(self.bootstrap_room, f"PeerDisconnectedError: the prefill at "
                                                            f"{self.bootstrap_addr} is not known (down?)")
            self.conclude_state = KVPoll.Failed
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        self.prefill_info, self.prefill_dp_rank = info, prefill_dp_rank
        self.required_prefill_response_num = 1
        self.kv_mgr.required_prefill_response_num_table[self.bootstrap_room] = 1
        self.kv_mgr.decode.begin(self.bootstrap_room, self.bootstrap_addr, info.attn_tp_size)

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None,
                      destination=KVTransferDestination.DEVICE, device_kv_indices=None):
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("kvtriton: host KV destinations are not supported")
        infos = self.kv_mgr.decode.want(self.bootstrap_room, kv_indices, aux_index, decode_prefix_len)
        if not infos:
            self.kv_mgr.record_failure(self.bootstrap_room, f"ProtocolError: the prefill at {self.bootstrap_addr} "
                                                            f"was not met before send_metadata")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        self.bootstrap_infos = infos
        self.init_time = time.time()

    def abort(self):
        self.kv_mgr.decode.abort(self.bootstrap_room)
        super().abort()

    def _send_abort_notification(self, *, force_arm: bool = False):
        """SGLang's one place that tells the prefill ranks (abort, timeout): with a cluster secret
        our sealed ``KVT_ABORT`` instead of its unsealed ``ABORT`` (which the prefill refuses then).
        Nothing to arm: this backend leaves SGLang's deferred decode KV release off."""
        if self.kv_mgr.signer is None:
            return super()._send_abort_notification(force_arm=force_arm)
        msg = Abort(self.bootstrap_room, self.kv_mgr.agent.engine_id, self.kv_mgr.agent.rank).to_zmq()
        for info in self.bootstrap_infos:
            self.kv_mgr.send(info["rank_ip"], info["rank_port"], msg)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.decode.forget(self.bootstrap_room)


class KVTritonKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own bootstrap server: the backend needs nothing more from it."""
