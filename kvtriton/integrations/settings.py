"""The settings both integrations share, parsed and checked (no engine import).

vLLM gives them as ``kv_connector_extra_config`` (:mod:`.vllm.settings`), SGLang as the
``KVTRITON_SGLANG_CONFIG`` object (:mod:`.sglang.settings`); :func:`~.core.make_agent` turns them
into one :class:`~kvtriton.agent.TransferAgent`, so a setting an engine accepts reaches its agent.
Every key is optional; an unknown key is an error (a typo must not silently fall back to a
default), and so is a value of the wrong type or range. Errors name where the settings came from.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from ..errors import KVTritonError
from ..plan import CostModel
from ..protocol.allowlist import AllowlistError, PeerAllowlist
from ..protocol.auth import Credential

__all__ = ["MAX_IDLE_WAIT_S", "SettingsError", "TransferSettings"]

_Settings = TypeVar("_Settings", bound="TransferSettings")

#: the longest ``idle_wait_s``: what a request arriving at an idle decode engine may wait for a step
MAX_IDLE_WAIT_S = 0.1


class SettingsError(KVTritonError, ValueError):
    """The settings hold an unknown key or a bad value."""


@dataclass(frozen=True)
class TransferSettings:
    """What an engine's kvtriton settings may set (all optional; SGLang decides ``host``,
    ``port``, ``kv_cache_layout`` and ``consumer`` itself and refuses them).

    host:                address this engine's ranks listen on for handshakes and advertise to
                         decode engines (prefill side).
    port:                base handshake port: rank ``r`` of the prefill engine listens on
                         ``port + r``; give each prefill engine on a host its own range. vLLM
                         DP: rank ``r`` of DP rank ``d`` on ``port + d * tp_size + r``.
    flow:                ``"pull"`` (decode READs; default) or ``"push"`` (prefill WRITEs);
                         both engines must agree.
    mode:                the old name of ``flow`` (kept for one release; give one of them).
    staging_bytes:       registered staging pool per rank.
    slot_bytes:          staging slot size (equal on both engines).
    chunk_bytes:         largest staged chunk (default: a quarter of the pool).
    inflight_chunks:     chunks of one transfer in flight at once.
    lease_s:             how long a prefill rank keeps a finished request's blocks for decode
                         ranks that have not fetched them.
    timeout_s:           a fetch without progress for this long fails (its blocks are recomputed).
    max_queued_s:        vLLM decode side: how long at most the prefill's holds of a request
                         waiting in this engine's queue (for a slot, for KV blocks) are renewed,
                         every ``lease_s / 6`` (give both engines the same ``lease_s``); its load
                         renews them from then on. ``0``: never (a hold ends at its lease).
                         Default 300.
    handshake_timeout_s: per attempt, to reach a prefill rank's handshake port.
    handshake_attempts:  attempts before the requests waiting on that engine fail.
    progress_interval_s: pause of the background progress thread between polls.
    idle_wait_s:         decode side: in a step with no tokens scheduled (every running request
                         waits for its KV), ``get_finished`` waits up to this long for the loads
                         in flight, polling the agent, so a small load is reported in the step
                         that started it rather than the next one (one engine step sooner to the
                         scheduler). Never in a step that runs a forward (its output would wait);
                         a request arriving meanwhile is scheduled at most this much later.
                         ``0``: never wait. Default 0.002.
    forget_idle_s:       vLLM decode side: a prefill engine none of this rank's loads used for
                         this long is forgotten: its ranks are dropped (NIXL state, peer table,
                         lifelines; the prefill drops this rank in turn) and met again on a
                         later request that names it. Checked on engine steps. Keep it above
                         the prefill's lease and how long a request may wait queued. ``0``:
                         never. Default 600 (vLLM's NixlConnector: ``engine_ttl`` 3600).
    impl:                repack implementation (``"auto"``, ``"triton"``, ``"torch"``).
    kv_cache_layout:     layout asked of vLLM for attention caches (``"LBHNC"``: head-major
                         blocks, so a head slice of a block is contiguous); ``""`` asks for none.
    cost_model:          ``"default"`` (the hand-calibrated CPU constants), ``"measured"``: the
                         decode ranks plan STAGED/DIRECT with a model measured on this host,
                         transport and device (:mod:`kvtriton.costmodel`, ~2 s once, then cached),
                         or pinned numbers, ``"desc_us=1.8,pass_us=90"`` (the
                         :class:`~kvtriton.plan.CostModel` fields named, the rest default: a model
                         measured elsewhere, the same on every engine); prefill ranks follow what
                         each decode rank's metadata carries.
    consumer:            prefill side: the engine id of the decode engine every hold is for
                         (a fixed P/D pairing). Only that engine may read the holds, and each
                         rank packs a finished request for its ranks ahead of their pull
                         (eager packing), so a load finds its data staged and READs it without
                         a round trip to this engine. ``""`` (default): a hold belongs to the
                         first engine that asks, packed when asked.
    eager_guess:         a prefill rank packs a finished request ahead of its pull for the only
                         decode engine connected to it, if exactly one is (1P1D; the hold is not
                         bound by the guess, see :mod:`kvtriton.agent.source.eager`). Default true.
    register:            ``"all"`` (default: cache and staging registered with NIXL) or
                         ``"staging"``: only the staging pool, so a peer holding this rank's
                         metadata can read only what was packed for a transfer; every region is
                         STAGED (docs/security.md). Both engines must agree.
    integrity:           digest each staged chunk after its pack and check it before unpack; a
                         chunk changed in flight or in staging fails its load (recomputed).
                         Every region is STAGED. Both engines must agree. Default false.
    auth_secret_file:    path of the cluster's shared secret (at least 16 bytes; every engine
                         of the cluster reads the same one). Default: the environment variable
                         ``KVTRITON_AUTH_SECRET_FILE``. With a secret (and/or TLS), handshakes
                         are answered and sent only after the peer proved it. Set but empty,
                         an empty file, or a file group or others can read: an error at start.
    auth_secret_strict_modes: refuse a secret file that group or others can read or write (as
                         ssh does; default true). False: only a warning.
    tls_cert_file:       mutual TLS on the handshake: this engine's certificate (PEM), its
    tls_key_file:        private key and the CA that signs every engine of the cluster; give
    tls_ca_file:         all three or none. A prefill's certificate must name its ``host``.
    tls_bind_engines:    with mutual TLS: a peer is met only as an engine id its certificate
                         names (URI SAN ``kvtriton:engine/<id>``; default false: any member may
                         claim any engine id).
    allowed_peers:       decode side: the prefill engines a request may name, as addresses,
                         networks, ``host:port`` and/or ``engine:<id>`` entries
                         (:class:`~kvtriton.protocol.allowlist.PeerAllowlist`); a request
                         naming another is computed locally, before any connection. Empty
                         (default): any.
    modes:               force a route for every region (``"staged"``, ``"direct"``...) or per
                         region (``"name=staged,name2=direct"``), as the agent's ``modes=``; both
                         engines must give the same. ``""`` (default): the planner chooses.
    replicate_stripe:    over how many prefill replicas a decode rank splits each request's
                         REPLICATE regions (an MLA latent): ``1`` (default) reads them from one
                         prefill rank, as vLLM's NixlConnector does: the decode's own link bounds
                         the load either way, and each replica more costs a small load a post,
                         a poll and an ack. ``0``: every prefill rank serves (``P_TP // D_TP``
                         replicas, the agent's default: spreads the prefill's egress). Both
                         engines must give the same.
    """

    host: str = "127.0.0.1"
    port: int = 5710
    flow: str = ""
    mode: str = ""
    staging_bytes: int = 64 << 20
    slot_bytes: int = 256 << 10
    chunk_bytes: int = 0
    inflight_chunks: int = 2
    lease_s: float = 30.0
    timeout_s: float = 30.0
    max_queued_s: float = 300.0
    handshake_timeout_s: float = 5.0
    handshake_attempts: int = 3
    progress_interval_s: float = 0.001
    idle_wait_s: float = 0.002
    forget_idle_s: float = 600.0
    impl: str = "auto"
    kv_cache_layout: str = "LBHNC"
    cost_model: str = "default"
    consumer: str = ""
    eager_guess: bool = True
    register: str = "all"
    integrity: bool = False
    auth_secret_file: str = ""
    auth_secret_strict_modes: bool = True
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    tls_bind_engines: bool = False
    allowed_peers: tuple = ()
    modes: str = ""
    replicate_stripe: int = 1

    @property
    def agent_stripe(self) -> int | None:
        """``replicate_stripe`` as the agent takes it (None: its default, every replica serves)."""
        return self.replicate_stripe or None

    @property
    def transfer_flow(self) -> str:
        """``flow``, or its old name ``mode``, or ``"pull"``."""
        return self.flow or self.mode or "pull"

    @property
    def agent_modes(self) -> str | dict[str, str] | None:
        """``modes`` as the agent takes it: None, one mode for all regions, or region -> mode."""
        if not self.modes:
            return None
        if "=" not in self.modes:
            return self.modes
        return dict(item.split("=", 1) for item in self.modes.split(","))

    def pinned_cost(self) -> CostModel | None:
        """The model ``cost_model`` pins (``"desc_us=1.8,pass_us=90"``: those fields, the rest
        the defaults); None for ``"default"`` and ``"measured"``. :class:`ValueError` saying what
        is wrong: an unknown field, a field twice, a number that is not finite and positive."""
        if self.cost_model in ("default", "measured"):
            return None
        known, vals = CostModel().as_dict(), {}
        for item in self.cost_model.split(","):
            name, eq, text = (x.strip() for x in item.partition("="))
            if not eq or name not in known:
                raise ValueError(f"{item.strip()!r} is not one of {sorted(known)} = a number")
            if name in vals:
                raise ValueError(f"{name} is given twice")
            try:
                v = float(text)
            except ValueError:
                v = math.nan
            if not (math.isfinite(v) and 0 < v < 1e9):
                raise ValueError(f"{name} = {text!r} is not a number in (0, 1e9)")
            vals[name] = v
        return CostModel(**vals, source=f"pinned: cost_model {self.cost_model!r}")

    @classmethod
    def from_mapping(cls: type[_Settings], values: Mapping[str, Any] | None, *, source: str = "settings") -> _Settings:
        """``values`` checked; ``source`` names them in errors (``kv_connector_extra_config``...)."""
        values = dict(values or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise SettingsError(f"{source}: unknown keys {unknown}; known keys are {sorted(known)}")
        if "auth_secret_file" in values and isinstance(values["auth_secret_file"], str) \
                and not values["auth_secret_file"].strip():  # set but empty: not "no credential" by accident
            raise SettingsError(f"{source}['auth_secret_file'] is set but empty: name the shared "
                                "secret file, or leave the key out to run without a secret")
        if "auth_secret_file" not in values and "KVTRITON_AUTH_SECRET_FILE" in os.environ:
            if not os.environ["KVTRITON_AUTH_SECRET_FILE"].strip():
                raise SettingsError("KVTRITON_AUTH_SECRET_FILE is set but empty: name the shared secret file, or "
                                    "unset it to run without a secret")
            values["auth_secret_file"] = os.environ["KVTRITON_AUTH_SECRET_FILE"]
        checked: dict[str, Any] = {}
        for name, value in values.items():
            want = type(known[name].default)
            if want is tuple and isinstance(value, list):
                value = tuple(value)
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
                raise SettingsError(f"{source}[{name!r}] must be {want.__name__}, "
                                    f"got {type(value).__name__} {value!r}")
            checked[name] = value
        s = cls(**checked)
        s._check(source)
        return s

    def _check(self, source: str) -> None:
        def bad(name: str, expected: str) -> SettingsError:
            return SettingsError(f"{source}[{name!r}] = {getattr(self, name)!r}: expected {expected}")

        for name in ("flow", "mode"):
            if getattr(self, name) not in ("", "pull", "push"):
                raise bad(name, "'pull' or 'push'")
        if self.flow and self.mode and self.flow != self.mode:
            raise bad("mode", f"the old name of 'flow', equal to it ({self.flow!r}) or absent")
        if not 0 < self.port < 65536:
            raise bad("port", "a TCP port in 1..65535 (rank r listens on port + r)")
        if not self.host:
            raise bad("host", "a host name or address")
        for name in ("staging_bytes", "slot_bytes", "inflight_chunks", "handshake_attempts"):
            if getattr(self, name) < 1:
                raise bad(name, ">= 1")
        if self.chunk_bytes < 0:
            raise bad("chunk_bytes", ">= 0 (0: a quarter of the staging pool)")
        for name in ("lease_s", "timeout_s", "handshake_timeout_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "> 0 seconds")
        if not 0 <= self.max_queued_s <= 86400:
            raise bad("max_queued_s", "0 to 86400 seconds (0: holds of queued requests are not renewed)")
        if self.progress_interval_s < 0:
            raise bad("progress_interval_s", ">= 0 seconds")
        if self.replicate_stripe < 0:
            raise bad("replicate_stripe", ">= 0 (1: one prefill replica per decode rank; 0: every one serves)")
        if not 0 <= self.idle_wait_s <= MAX_IDLE_WAIT_S:
            raise bad("idle_wait_s", f"0 to {MAX_IDLE_WAIT_S} seconds (an idle step's wait for its loads)")
        if not 0 <= self.forget_idle_s <= 1e9:
            raise bad("forget_idle_s", ">= 0 seconds (0: a prefill engine met is never forgotten)")
        if self.impl not in ("auto", "triton", "torch"):
            raise bad("impl", "'auto', 'triton' or 'torch'")
        if self.cost_model not in ("default", "measured"):
            try:
                self.pinned_cost()
            except ValueError as e:
                raise bad("cost_model", f"'default', 'measured' or 'field=number' items separated by commas ({e})"
                          ) from None
        if "=" in self.modes and not all(a and b and "=" not in b for a, _, b in
                                         (item.partition("=") for item in self.modes.split(","))):
            raise bad("modes", "one mode, or 'region=mode' items separated by commas")
        if self.register not in ("all", "staging"):
            raise bad("register", "'all' (cache and staging) or 'staging' (staging only)")
        try:
            self.peer_allowlist()
        except AllowlistError as e:
            raise SettingsError(f"{source}['allowed_peers']: {e}") from None
        tls = (self.tls_cert_file, self.tls_key_file, self.tls_ca_file)
        if any(tls) and not all(tls):
            raise bad("tls_cert_file", "tls_cert_file, tls_key_file and tls_ca_file all given, or none")
        if self.tls_bind_engines and not all(tls):
            raise bad("tls_bind_engines", "mutual TLS (tls_cert_file, tls_key_file, tls_ca_file): engine ids are "
                                          "bound to certificates")

    def peer_allowlist(self) -> PeerAllowlist:
        """``allowed_peers`` parsed."""
        return PeerAllowlist(self.allowed_peers)

    def credential(self) -> Credential | None:
        """The cluster credential the files name (read now), or None when none is configured."""
        return Credential.from_files(secret_file=self.auth_secret_file or None, cert_file=self.tls_cert_file or None,
                                     key_file=self.tls_key_file or None, ca_file=self.tls_ca_file or None,
                                     strict_modes=self.auth_secret_strict_modes,
                                     setting="auth_secret_file (or KVTRITON_AUTH_SECRET_FILE)",
                                     bind_engines=self.tls_bind_engines)
