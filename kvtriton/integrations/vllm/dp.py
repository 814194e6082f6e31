"""Names and handshake ports of an engine's ranks under vLLM data parallelism (no vLLM import).

With ``data_parallel_size`` > 1 each DP rank is an engine of its own (its own engine core,
scheduler and KV cache), with ``tp_size`` workers. vLLM names it ``{engine_id}_dp{d}`` (its
engine core appends the suffix before the connector is built); it keeps the DP rank in
``parallel_config.data_parallel_index`` (``data_parallel_rank`` is reset to 0 for a dense
model, whose DP ranks are independent engines). Each kvtriton worker serves its own handshake
port, so DP rank ``d``'s TP rank ``r`` listens on ``port + d * tp_size + r``: the ranges of a
host's DP ranks never overlap, as NixlConnector laid them out while each of its workers
served its own port (``VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_rank * tp_size``, plus the
TP rank). A prefill DP rank's ``kv_transfer_params`` carry its own engine id and base port, so
a decode rank (of any DP rank) loads from the prefill engine the params name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .settings import EXTRA_CONFIG, SettingsError, TransferSettings

__all__ = ["dp_identity", "dp_settings"]


def dp_identity(engine_id: str, port: int, tp_size: int, parallel_config: Any) -> tuple[str, int]:
    """``(engine id, base handshake port)`` of this DP rank's engine: ``engine_id`` with
    vLLM's ``_dp{d}`` suffix (added when vLLM has not, e.g. a config built without its engine
    core), and ``port + d * tp_size``. One engine without DP: both as given."""
    index = getattr(parallel_config, "data_parallel_index", None)
    if index is None:  # a vLLM without the field
        index = getattr(parallel_config, "data_parallel_rank", 0)
    d, size = int(index or 0), int(getattr(parallel_config, "data_parallel_size", 1) or 1)
    if d == 0 and size <= 1:
        return engine_id, port
    suffix = f"_dp{d}"
    return (engine_id if engine_id.endswith(suffix) else engine_id + suffix), port + d * tp_size


def dp_settings(settings: TransferSettings, engine_id: str, tp_size: int,
                parallel_config: Any) -> tuple[TransferSettings, str]:
    """``settings`` with ``port`` this DP rank's base port, and this DP rank's engine id
    (:func:`dp_identity`); :class:`SettingsError` when its range passes port 65535."""
    engine, port = dp_identity(engine_id, settings.port, tp_size, parallel_config)
    if port + tp_size - 1 > 65535:
        raise SettingsError(f"{EXTRA_CONFIG}['port'] = {settings.port}: DP rank {engine!r} would listen on "
                            f"{port}..{port + tp_size - 1} (port + dp_rank * tp_size + rank), past 65535")
    return (settings if port == settings.port else dataclasses.replace(settings, port=port)), engine
