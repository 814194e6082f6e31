"""kvtriton's statistics in vLLM's KV-connector stats path: the ``KVConnectorStats`` subclass a
worker returns from ``get_kv_connector_stats()`` (vLLM merges the ranks' with ``aggregate``, its
logging stats logger summarises an interval with ``reduce``), and the Prometheus metrics vLLM's
``PrometheusStatLogger`` registers through ``build_prom_metrics`` and feeds each step.

The window's contents are :mod:`.stats`'s (no vLLM there); the metric list, with units and
meanings, is in docs/operations.md ("Prometheus metrics"): :data:`HISTOGRAMS`,
:data:`LABELED_COUNTERS` and :data:`EVENT_COUNTERS` below are its source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ...agent.stats import DIRECT_WAY, FAILURE_KINDS
from ...plan import Way
from . import stats

__all__ = ["KVTritonConnectorStats", "KVTritonPromMetrics", "HISTOGRAMS", "LABELED_COUNTERS", "EVENT_COUNTERS"]

#: window list -> (metric name, help, buckets); one observation per successful transfer
HISTOGRAMS: dict[str, tuple[str, str, list[float]]] = {
    "transfer_duration": (
        "vllm:kvtriton_xfer_time_seconds",
        "Seconds from a kvtriton load's fetch on a decode rank to its KV loaded (successful transfers).",
        [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]),
    "post_duration": (
        "vllm:kvtriton_post_time_seconds",
        "Seconds a kvtriton transfer spent in NIXL's post calls on the decode rank.",
        [1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0]),
    "bytes_transferred": (
        "vllm:kvtriton_bytes_transferred",
        "Bytes one kvtriton transfer moved to a decode rank.",
        [float(2 ** (12 + 2 * i)) for i in range(13)]),  # 4 KiB .. 64 GiB
    "num_descriptors": (
        "vllm:kvtriton_num_descriptors",
        "NIXL descriptors one kvtriton transfer posted (staged chunks, DIRECT runs, one-sided pieces).",
        [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536]),
}
#: window count dict -> (metric name, help, label, label values created up front)
LABELED_COUNTERS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "ways": ("vllm:kvtriton_payloads", "Source-rank payloads of successful kvtriton transfers, by the way they "
             "travelled (staged, read_unpack, pack_place, direct_slice; direct: DIRECT runs).", "way",
             (*(w.value for w in Way), DIRECT_WAY)),
    "failures": ("vllm:kvtriton_num_failed_transfers", "kvtriton loads that failed (blocks recomputed), by kind.",
                 "kind", FAILURE_KINDS),
}
#: window event -> (metric name, help)
EVENT_COUNTERS: dict[str, tuple[str, str]] = {
    "eager_hits": ("vllm:kvtriton_eager_hits", "Prefill side: pulls or offers served by a pack made ahead."),
    "eager_misses": ("vllm:kvtriton_eager_misses", "Prefill side: packs made ahead that were not what came."),
    "offers_taken": ("vllm:kvtriton_offers_taken", "Decode side: offers of packed KV read without a pull."),
    "leases_expired": ("vllm:kvtriton_num_expired_leases",
                       "Prefill side: holds freed because their lease ended before every consumer was done."),
    "refused_messages": ("vllm:kvtriton_num_refused_messages",
                         "Well-formed requests from a peer not entitled to them (another engine's hold...)."),
    "bad_messages": ("vllm:kvtriton_num_bad_messages",
                     "Malformed or inconsistent peer messages, from unknown agents or beyond a sender's bound."),
    "peers_refused": ("vllm:kvtriton_num_refused_peers", "Peer registrations refused."),
    "peers_expired": ("vllm:kvtriton_num_expired_peers", "Peers dropped because they stopped answering."),
    "peers_disconnected": ("vllm:kvtriton_num_disconnected_peers",
                           "Peers dropped because the connection they met over closed (their process died)."),
    "records_dropped": ("vllm:kvtriton_num_dropped_records",
                        "Transfers left out of the histograms because a window was full."),
}
_LABEL = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_MAX_LABEL_VALUES = 32


@dataclass
class KVTritonConnectorStats(KVConnectorStats):
    """One window of kvtriton statistics (see :mod:`.stats` for ``data``)."""

    def __post_init__(self):
        # vLLM hands back what to_dict() gave (over msgpack between processes): rebuilt, not trusted
        self.data = stats.from_payload(self.data) if self.data else stats.empty()

    def reset(self) -> None:
        self.data = stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if isinstance(other, KVTritonConnectorStats) and not other.is_empty():
            stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.reduce(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)

    def clone_and_reset(self) -> KVTritonConnectorStats:
        old = KVTritonConnectorStats()
        old.data, self.data = self.data, stats.empty()
        return old


class KVTritonPromMetrics(KVConnectorPromMetrics):
    """kvtriton's Prometheus metrics, one child per engine with vLLM's labels (``model_name``,
    ``engine``) and, for labeled counters, the way or kind."""

    def __init__(self, vllm_config, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._histograms = {key: self._per_engine(self._histogram_cls(name=name, documentation=doc, buckets=buckets,
                                                                      labelnames=labelnames))
                            for key, (name, doc, buckets) in HISTOGRAMS.items()}
        self._labeled: dict[str, Any] = {}
        self._children: dict[tuple[str, int, str], Any] = {}
        for key, (name, doc, label, values) in LABELED_COUNTERS.items():
            metric = self._labeled[key] = self._counter_cls(name=name, documentation=doc,
                                                             labelnames=[*labelnames, label])
            for idx, engine_values in per_engine_labelvalues.items():
                for v in values:  # present (at 0) before the first event: dashboards see every series
                    self._children[(key, idx, v)] = metric.labels(*engine_values, v)
        self._events = {key: self._per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames))
                        for key, (name, doc) in EVENT_COUNTERS.items()}

    def _per_engine(self, metric) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def _child(self, key: str, engine_idx: int, value: str):
        child = self._children.get((key, engine_idx, value))
        if child is None:  # a label this release does not list (a new way): bounded, and well-formed only
            known = sum(1 for k, i, _ in self._children if k == key and i == engine_idx)
            if not _LABEL.match(value) or known >= _MAX_LABEL_VALUES:
                value = "other"
            child = self._children.get((key, engine_idx, value))
            if child is None:
                child = self._children[(key, engine_idx, value)] = self._labeled[key].labels(
                    *self.per_engine_labelvalues[engine_idx], value)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if engine_idx not in self.per_engine_labelvalues:
            return
        data = stats.from_payload(transfer_stats_data)
        for key, per_engine in self._histograms.items():
            for x in data[key]:
                per_engine[engine_idx].observe(x)
        for key in LABELED_COUNTERS:
            for value, n in data[key].items():
                self._child(key, engine_idx, value).inc(n)
        for event, n in data["events"].items():
            per_engine = self._events.get(event)
            if per_engine is not None:
                per_engine[engine_idx].inc(n)

