"""The connector's settings as vLLM gives them: ``kv_connector_extra_config`` (no vLLM import).

The keys and their checks are the integrations' shared :class:`~..settings.TransferSettings`;
this names them as vLLM's users write them, so an error points at ``kv_connector_extra_config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..settings import SettingsError, TransferSettings

__all__ = ["EXTRA_CONFIG", "ConnectorSettings", "SettingsError"]

EXTRA_CONFIG = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorSettings(TransferSettings):
    """:class:`~..settings.TransferSettings` read from ``kv_connector_extra_config``."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        return cls.from_mapping(extra, source=EXTRA_CONFIG)
