"""What a rank counts, in two documented structures a serving integration reads (the vLLM
connector's Prometheus metrics are made of them, :mod:`kvtriton.integrations.vllm.stats`):

* **counters** (:class:`Stats`, reported by :attr:`TransferAgent.stats`): one per event, counted
  since the agent started. A reader that reports deltas (a metrics exporter) keeps a
  :class:`StatsCursor` and takes what accrued since its last call.
* **per-transfer records**: each fetch that ended on a destination rank, as a
  :class:`~kvtriton.agent.RequestResult` from :meth:`TransferAgent.results` (drained by each call:
  the caller takes each record once). A record has the time from ``fetch()`` to the KV loaded
  (``seconds``), the time spent in NIXL's post calls of its transfers (``post_seconds``), the descriptors it
  posted and the bytes they moved, and ``ways``: how many source-rank payloads travelled each way
  (the :class:`~kvtriton.plan.Way` values, ``"direct"`` for DIRECT runs). A failed one has its
  ``error``; :func:`failure_kind` names the error's kind as a short stable label.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..errors import (
    AuthenticationError,
    IncompatibleRemoteError,
    IntegrityError,
    PeerDisconnectedError,
    PeerRefusedError,
    PlanError,
    ProtocolError,
    RequestAbortedError,
    RequestRejectedError,
    StagingError,
    TransferTimeoutError,
    TransportError,
)

__all__ = ["Stats", "StatsCursor", "failure_kind", "FAILURE_KINDS", "DIRECT_WAY"]

#: the ``ways`` label of DIRECT runs (zero-copy, cache to cache), beside the Way values of payloads
DIRECT_WAY = "direct"

# most derived first: the first class of an error's MRO found here names its kind
_KINDS: dict[type, str] = {
    TransferTimeoutError: "timeout", PeerDisconnectedError: "peer_lost", TransportError: "transport",
    RequestRejectedError: "rejected", RequestAbortedError: "aborted", IntegrityError: "integrity",
    AuthenticationError: "authentication", PeerRefusedError: "peer_refused",
    IncompatibleRemoteError: "incompatible", ProtocolError: "protocol", StagingError: "staging", PlanError: "plan",
}
#: every label :func:`failure_kind` returns
FAILURE_KINDS = (*_KINDS.values(), "other")


def failure_kind(error: BaseException | None) -> str:
    """A short stable label of a failed transfer's error (``"timeout"``, ``"rejected"``...): the
    most derived kvtriton error class it is; ``"other"`` for anything else."""
    for cls in type(error).__mro__:
        kind = _KINDS.get(cls)
        if kind is not None:
            return kind
    return "other"


@dataclass
class Stats:
    """The counters of one rank, each one kind of event, counted by attribute
    (``stats.offers_taken += 1``). :meth:`as_dict` is what :attr:`TransferAgent.stats` returns:
    these names, plus ``eager_hits``, the sum of the three kinds of eager hit (its meaning before
    they were told apart)."""

    bad_messages: int = 0
    """Malformed or inconsistent messages (and messages from unknown agents, or beyond a
    sender's inbox bound)."""
    forged_messages: int = 0
    """Of those, messages refused by the pair's seal (:mod:`kvtriton.protocol.channel`): from a
    peer met with a credential, one not sealed under its pair key (another agent's name, a forged
    or changed message), a replay, or one reordered past the window; or a sealed one from a peer
    met without keys. Refused before anything reads them."""
    refused: int = 0
    """Well-formed requests from a peer not entitled to them: another engine's hold, beyond its
    transfer count, a done or renew for what it may not read."""
    peers_refused: int = 0
    """Registrations :meth:`TransferAgent.add_remote` refused (:mod:`.peers`: an identity held by
    a live agent, an agent standing for a second engine or rank, a stale generation, a full table)."""
    peers_replaced: int = 0
    """Peers replaced by their restart (a newer generation, the old agent gone)."""
    peers_expired: int = 0
    """Peers dropped because they stopped answering (silent past the expiry, or unreachable)."""
    peers_disconnected: int = 0
    """Peers dropped because the connection they met this rank over closed (their process died:
    :mod:`.lifelines`)."""
    staged_descriptors: int = 0
    """Staged chunks posted (one descriptor each), READ or WRITE."""
    direct_descriptors: int = 0
    """Zero-copy descriptors posted, cache to cache: DIRECT runs and head slices alike (a
    region's, fixed by the plan, or a payload's, chosen per request: one row type, one post
    per source rank)."""
    one_sided_descriptors: int = 0
    """Pieces posted by a one-sided way through staging (read_unpack, pack_place)."""
    eager_chunks: int = 0
    """Chunks packed ahead of their pull (:mod:`.source.eager`)."""
    eager_pull_hits: int = 0
    """A pull found its payload packed ahead, not offered yet: answered with ready at once."""
    eager_offer_pulls: int = 0
    """A pull took over the chunks its peer had been offered (a late offer, or a suffix)."""
    eager_offer_reads: int = 0
    """An offer was read by its destination without a pull (its first ack or RunsDone)."""
    eager_misses: int = 0
    """A pack made ahead was not what came: a pull asking something else, an offer declined or
    withdrawn, a guessed pack freed because the hold bound to another engine."""
    eager_evicted: int = 0
    """Packs made ahead given up so that a pull gets the staging."""
    eager_offers: int = 0
    """Offers sent (packs made ahead, and read_unpack offers of the cache blocks)."""
    eager_guessed: int = 0
    """Holds without a consumer packed (or their cache blocks offered) for the only connected engine."""
    offers_taken: int = 0
    """Destination side: offers this rank READ without pulling."""
    deferred_fetches: int = 0
    """Destination side: ``fetch(wait=False)`` calls deferred while another thread held the agent
    (:mod:`.destination.deferred`)."""
    pack_launches: int = 0
    """Pack launches of this rank as a source."""
    packed_chunks: int = 0
    """Chunks those launches packed (several destinations' chunks of one step share a launch:
    :mod:`.source.packing`)."""
    digested_chunks: int = 0
    """``integrity=True``: staged chunks digested (as a source after packing, as a destination
    before unpacking)."""
    integrity_failures: int = 0
    """Destination side: chunks whose bytes did not match their source's digest (fetch failed)."""
    leases_expired: int = 0
    """Source side: holds that ended by their lease, not by every consumer's done (a reader that
    never came, or came too late)."""

    @property
    def eager_hits(self) -> int:
        """Every pull or offer served by a pack made ahead (the three kinds of hit)."""
        return self.eager_pull_hits + self.eager_offer_pulls + self.eager_offer_reads

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "eager_hits": self.eager_hits}

    def packed(self, chunks: int) -> None:
        """One pack launch of ``chunks`` chunks (:class:`~.source.packing.PackBatch`)."""
        self.pack_launches += 1
        self.packed_chunks += chunks


class StatsCursor:
    """Deltas of :attr:`TransferAgent.stats` between calls: :meth:`take` returns what each counter
    gained since the previous :meth:`take` (each event reported once, however often it is asked)."""

    NAMES = tuple(f.name for f in fields(Stats)) + ("eager_hits",)

    def __init__(self) -> None:
        self._seen = dict.fromkeys(self.NAMES, 0)

    def take(self, now: dict[str, int]) -> dict[str, int]:
        """``now`` (a :attr:`TransferAgent.stats` snapshot) less the last one taken; counters
        that did not move are left out."""
        out = {}
        for k in self.NAMES:
            v = int(now.get(k, 0))
            if v != self._seen[k]:
                out[k] = v - self._seen[k]
                self._seen[k] = v
        return out
