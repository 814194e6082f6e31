"""The connector's settings as vLLM gives them: ``kv_connector_extra_config`` (no vLLM import).

The keys and their checks are the integrations' shared :class:`~..settings.TransferSettings`;
read from here, an error names ``kv_connector_extra_config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..settings import SettingsError, TransferSettings

__all__ = ["EXTRA_CONFIG", "SettingsError", "TransferSettings", "from_extra_config"]

EXTRA_CONFIG = "kv_connector_extra_config"


def from_extra_config(extra: Mapping[str, Any] | None) -> TransferSettings:
    """``kv_connector_extra_config`` checked (an unknown key or a bad value: :class:`SettingsError`)."""
    return TransferSettings.from_mapping(extra, source=EXTRA_CONFIG)
