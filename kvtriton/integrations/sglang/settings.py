"""The backend's settings (no SGLang import): ``KVTRITON_SGLANG_CONFIG``, checked at start.

SGLang's command line has no free-form options for a transfer backend, so the settings come from
the environment of every SGLang process: ``KVTRITON_SGLANG_CONFIG`` holds a JSON object (or
``@path`` of a file holding one) with the keys of the vLLM connector's
``kv_connector_extra_config`` (the shared :class:`~kvtriton.integrations.settings.TransferSettings`:
``staging_bytes``, ``timeout_s``, ``lease_s``, ``auth_secret_file``, TLS files, ``modes``...),
minus the two SGLang decides (``host``: the address SGLang's bootstrap registered for each rank;
``kv_cache_layout``: SGLang's pool is token-major), plus ``handshake_port_offset``. Every key is
optional; an unknown key, a value of the wrong type or range fails the engine at start.

Handshake ports: rank ``r`` of a prefill engine serves its metadata on ``bootstrap_port +
handshake_port_offset + r`` (default offset 1), so a decode reaches it knowing only the
``bootstrap_host:bootstrap_port`` a request names. Give each prefill engine on a host a bootstrap
port ``tp + 1`` apart from the next one.

The credential is the project's (:mod:`kvtriton.protocol.auth`), read as the vLLM connector reads
it: ``auth_secret_file`` (default: ``KVTRITON_AUTH_SECRET_FILE``) and/or the TLS files. With one,
metadata moves only after the peer proved it, and control messages carry a seal
(:mod:`kvtriton.protocol.seal`) under the keys each meeting gives the pair (with the shared
secret or over mutual TLS alone).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import KVTritonError
from ...protocol.auth import Credential
from ...protocol.seal import ControlSigner
from ..settings import SettingsError, TransferSettings

__all__ = ["ENV", "BackendSettings", "SettingsError", "UnsupportedSetupError", "control_signer",
           "hybrid_missing"]

ENV = "KVTRITON_SGLANG_CONFIG"
_SGLANG_DECIDES = ("host", "port", "kv_cache_layout", "consumer")


class UnsupportedSetupError(KVTritonError, ValueError):
    """The SGLang engine runs a case this backend does not move (named in the message)."""


#: what this backend would need to move each of SGLang's hybrid state pools (issue 32: vLLM's
#: connector moves Mamba2/GDN states and sliding-window groups; this backend maps only the MHA pool)
_HYBRID_POOLS = {
    "mamba": "a Mamba/GDN state pool (one slot per request: conv sub-projections x/B/C or q/k/v split over TP, "
             "SSM state by heads) is not mapped to state regions",
    "swa": "a sliding-window pool (its own page table, the window's pages only) is not mapped to a KV cache group",
    "dsa": "a DSA indexer pool is not mapped to a region",
}


def hybrid_missing(states: list[str]) -> str:
    """Per state type, what this backend lacks to move it."""
    said = [f"{s}: {_HYBRID_POOLS.get(s, 'a state pool kvtriton has no region for')}" for s in dict.fromkeys(states)]
    return ("; ".join(said) + ". kvtriton's vLLM connector moves Mamba2, Gated DeltaNet and sliding-window models "
            "(docs/vllm.md, Hybrid models)")


@dataclass(frozen=True)
class BackendSettings:
    """The connector settings every rank uses, and where prefill ranks serve handshakes."""

    agent: TransferSettings
    handshake_port_offset: int = 1

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> BackendSettings:
        values = dict(values or {})
        offset = values.pop("handshake_port_offset", 1)
        if not isinstance(offset, int) or isinstance(offset, bool) or not 0 < offset < 65536:
            raise SettingsError(f"{ENV}['handshake_port_offset'] = {offset!r}: expected an int in 1..65535 "
                                f"(rank r of a prefill serves handshakes on bootstrap_port + offset + r)")
        decided = sorted(set(values) & set(_SGLANG_DECIDES))
        if decided:
            raise SettingsError(f"{ENV}: {decided} are decided by SGLang (bootstrap addresses, its pool layout, "
                                f"the decode that registers a request); remove them")
        return cls(TransferSettings.from_mapping(values, source=ENV), offset)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BackendSettings:
        environ = os.environ if environ is None else environ
        raw = environ.get(ENV, "").strip()
        if not raw:
            return cls.from_mapping({})
        if raw.startswith("@"):
            try:
                with open(raw[1:], encoding="utf-8") as f:
                    raw = f.read()
            except OSError as e:
                raise SettingsError(f"{ENV} names {raw[1:]!r}, which cannot be read: {e}") from None
        try:
            values = json.loads(raw)
        except ValueError as e:
            raise SettingsError(f"{ENV} must be a JSON object (or @file holding one): {e}") from None
        if not isinstance(values, dict):
            raise SettingsError(f"{ENV} must be a JSON object, got {type(values).__name__}")
        return cls.from_mapping(values)

    def handshake_port(self, bootstrap_port: int, rank: int) -> int:
        port = bootstrap_port + self.handshake_port_offset + rank
        if not 0 < port < 65536:
            raise SettingsError(f"handshake port {port} (bootstrap port {bootstrap_port} + offset "
                                f"{self.handshake_port_offset} + rank {rank}) is not a TCP port")
        return port


def control_signer(credential: Credential | None, *, agent: str) -> ControlSigner | None:
    """The signer for a manager's credential: None without one (dev mode, unsealed).
    ``agent``: the rank's NIXL agent name (its incarnation, see :mod:`kvtriton.protocol.seal`);
    it seals under the keys of each pair met, which a meeting gives with the shared secret and
    over mutual TLS alone."""
    if credential is None:
        return None
    return ControlSigner(agent=agent)
