"""The connector's transfer statistics, as vLLM's KV-connector stats path carries them (no vLLM
import: :mod:`.metrics` wraps this in vLLM's ``KVConnectorStats`` and Prometheus classes).

One step's statistics are a plain dict (it crosses processes: worker -> executor -> scheduler ->
stats loggers), built by :class:`WorkerStats` on each rank from the agent's documented
structures (:mod:`kvtriton.agent.stats`):

``transfer_duration``, ``post_duration``, ``bytes_transferred``, ``num_descriptors``
    one entry per transfer that loaded its KV on this rank (a decode rank's fetch of one
    request): seconds from the load's start to the KV loaded, seconds in NIXL's post calls,
    bytes moved, descriptors posted. Failed transfers are counted in ``failures`` only.
``ways``
    ``{way: payloads}``: how the source-rank payloads of those transfers travelled
    (``staged``, ``read_unpack``, ``pack_place``, ``direct_slice``: :class:`~kvtriton.plan.Way` values;
    ``direct``: DIRECT runs).
``failures``
    ``{kind: loads}``: loads that failed (their blocks recomputed), by
    :func:`~kvtriton.agent.stats.failure_kind`.
``events``
    ``{name: count}``: agent counters that moved since the last step (:data:`EVENTS`).

Drain semantics: :meth:`WorkerStats.take` returns what accrued since its previous call and starts
over, so each transfer and event is reported once; a window keeps at most :data:`MAX_RECORDS`
transfers (beyond, they are counted in ``events["records_dropped"]``), so memory stays bounded
even if nobody takes.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

from ...agent.stats import StatsCursor, failure_kind

if TYPE_CHECKING:
    from ...agent import RequestResult

__all__ = ["WorkerStats", "count_result", "EVENTS", "HISTOGRAMS", "MAX_RECORDS", "empty", "merge", "is_empty", "reduce",
           "from_payload"]

#: the per-transfer lists, in the order of one record
HISTOGRAMS = ("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors")
#: agent counter -> event name in ``events`` (what the Prometheus counters of :mod:`.metrics` read)
EVENTS = {
    "eager_hits": "eager_hits",  # source: a pull or offer served by a pack made ahead
    "eager_misses": "eager_misses",  # source: a pack made ahead that was not what came
    "offers_taken": "offers_taken",  # destination: offers read without a pull
    "leases_expired": "leases_expired",  # source: holds freed by their lease, not by their consumers
    "refused": "refused_messages",  # source: well-formed requests from a peer not entitled to them
    "bad_messages": "bad_messages",  # malformed, unknown sender, beyond a sender's inbox bound
    "peers_refused": "peers_refused",  # registrations refused (identity held, stale, table full)
    "peers_expired": "peers_expired",  # peers dropped for silence
    "peers_disconnected": "peers_disconnected",  # peers dropped when their lifeline closed (process died)
}
#: transfers one window (one step, or one merge of several ranks' steps) keeps
MAX_RECORDS = 4096
_MAX_LABELS = 64  # distinct keys of one count dict (labels are ours, but a bound costs nothing)


def empty() -> dict[str, Any]:
    return {**{k: [] for k in HISTOGRAMS}, "ways": {}, "failures": {}, "events": {}}


def is_empty(data: dict[str, Any]) -> bool:
    return not (data["transfer_duration"] or data["ways"] or data["failures"] or data["events"])


def _add(counts: dict[str, int], key: str, n: int) -> None:
    if key in counts or len(counts) < _MAX_LABELS:
        counts[key] = counts.get(key, 0) + n
    else:
        counts["other"] = counts.get("other", 0) + n


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Add ``other`` (another rank's or step's window) to ``into``; returns ``into``."""
    room = MAX_RECORDS - len(into["transfer_duration"])
    take = min(room, len(other["transfer_duration"]))
    for k in HISTOGRAMS:
        into[k].extend(other[k][:take])
    dropped = len(other["transfer_duration"]) - take
    for key in ("ways", "failures", "events"):
        for name, n in other[key].items():
            _add(into[key], name, n)
    if dropped:
        _add(into["events"], "records_dropped", dropped)
    return into


def from_payload(data: Any) -> dict[str, Any]:
    """A window rebuilt from the dict vLLM hands back (``build_kv_connector_stats``): only the
    known keys, numbers and short string labels; anything else is left out, never raised on."""
    out = empty()
    if not isinstance(data, dict):
        return out
    lists = [data.get(k) for k in HISTOGRAMS]
    if all(isinstance(v, list) for v in lists):
        n = min(min(len(v) for v in lists), MAX_RECORDS)
        for i in range(n):
            rec = [v[i] for v in lists]
            if all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                   for x in rec):
                for k, x in zip(HISTOGRAMS, rec):
                    out[k].append(x)
    for key in ("ways", "failures", "events"):
        counts = data.get(key)
        if isinstance(counts, dict):
            for name, n in counts.items():
                if isinstance(name, str) and 0 < len(name) <= 64 and isinstance(n, int) and not isinstance(n, bool) \
                        and n > 0:
                    _add(out[key], name, n)
    return out


def reduce(data: dict[str, Any]) -> dict[str, int | float]:
    """One interval's summary for vLLM's logging stats logger (``KV Transfer metrics: ...``)."""
    n = len(data["transfer_duration"])
    out: dict[str, int | float] = {"Num successful transfers": n}
    if n:
        secs, posts = sorted(data["transfer_duration"]), data["post_duration"]
        total_b, total_s = sum(data["bytes_transferred"]), sum(secs)
        out.update({
            "Avg xfer time (ms)": round(1e3 * total_s / n, 3),
            "P90 xfer time (ms)": round(1e3 * secs[min(n - 1, math.ceil(0.9 * n) - 1)], 3),
            "Avg post time (ms)": round(1e3 * sum(posts) / n, 3),
            "Avg MB per transfer": round(total_b / n / 2**20, 3),
            "Throughput (MB/s)": round(total_b / 2**20 / total_s, 3) if total_s > 0 else 0,
            "Avg number of descriptors": round(sum(data["num_descriptors"]) / n, 1),
        })
    out.update({f"Payloads {w}": c for w, c in sorted(data["ways"].items())})
    out["Num failed transfers"] = sum(data["failures"].values())
    out.update({f"Failed {k}": c for k, c in sorted(data["failures"].items())})
    out.update({name: c for name, c in sorted(data["events"].items())})
    return out


class WorkerStats:
    """One rank's window of statistics since the last :meth:`take` (thread-safe: loads end on
    the engine thread and on handshake threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty()
        self._cursor = StatsCursor()

    def transfer(self, result) -> None:
        """A load that ended well (a :class:`~kvtriton.agent.RequestResult` with ``ok``)."""
        with self._lock:
            d = self._data
            if len(d["transfer_duration"]) >= MAX_RECORDS:
                _add(d["events"], "records_dropped", 1)
                return
            for k, v in zip(HISTOGRAMS, (float(result.seconds), float(result.post_seconds), int(result.bytes),
                                         int(result.descriptors))):
                d[k].append(v)
            for way, n in result.ways:
                _add(d["ways"], way, n)

    def failed(self, error: BaseException) -> None:
        """A load that failed (its blocks are recomputed)."""
        with self._lock:
            _add(self._data["failures"], failure_kind(error), 1)

    def take(self, agent_stats: dict[str, int]) -> dict[str, Any] | None:
        """What accrued since the previous call (None: nothing), with the agent counters that
        moved since then (``agent_stats``: :attr:`TransferAgent.stats` now)."""
        moved = self._cursor.take(agent_stats)
        with self._lock:
            data, self._data = self._data, empty()
        for name, event in EVENTS.items():
            if moved.get(name, 0) > 0:
                _add(data["events"], event, moved[name])
        return None if is_empty(data) else data


def count_result(counts: dict[str, int], r: RequestResult) -> None:
    """A load's result in the worker's plain counters: loads (a failed one is counted with every
    other failed load, the refused and unmet ones too, where it ends), descriptors, bytes, and its
    source ranks' payloads by the way they travelled (``payloads_<way>``)."""
    if r.ok:
        counts["loads"] += 1
    counts["descriptors"] += r.descriptors
    counts["bytes"] += r.bytes
    for way, n in r.ways:
        counts[f"payloads_{way}"] = counts.get(f"payloads_{way}", 0) + n
