"""The cost model the planner decides by: numbers it is given, never measures."""

from __future__ import annotations

from dataclasses import dataclass, field

from .types import Way

__all__ = ["CostModel", "UNMEASURED"]

#: :class:`CostModel` numbers no probe measures (``kvtriton.costmodel``): a cached or a peer's model
#: without them takes the default
UNMEASURED = frozenset({"pull_us"})


@dataclass(frozen=True)
class CostModel:
    """Direct-vs-staged decision for whole-block SPLIT regions, from numbers the planner is given.

    Direct costs ``desc_us`` per descriptor on top of the wire time; staged costs a pack and an
    unpack pass over the bytes (both move the same bytes over the wire, so the wire time cancels
    out of the choice). Direct wins once a descriptor carries more than
    ``desc_us / (1/pack_gbps + 1/unpack_gbps)`` bytes. The defaults are CPU values measured once
    by hand (NIXL 1.5.1 UCX/cma on a 2-core VM: 2.3 us per descriptor, ~10 GB/s torch pack; the
    unpack, a scatter into the cache, and a pass's fixed cost from the probe there: ~5 GB/s, ~75 us
    a call and 12 us a segment);
    :func:`kvtriton.costmodel.load_or_measure` measures this host, transport and device instead
    (on a GPU the repack runs ~100x faster and the crossover moves to megabytes). The planner
    never measures: it only reads these numbers. ``read_gbps``/``write_gbps`` (the transport's
    one-descriptor bandwidth, pull and push) only feed the estimates :meth:`staged_us` and
    :meth:`direct_us`; ``source`` says where the numbers came from.

    A repack pass also costs a fixed ``pass_us`` per call plus ``segment_us`` per segment it walks,
    whatever its bytes (Python validation and dispatch on a CPU, a launch on a GPU):
    :meth:`pass_fixed_us`. The per-request estimates add it once per chunk and pass. It decides
    small requests: a 2-layer payload of ~1 MB repacked in one pass costs ~0.1 ms fixed on this
    CPU, as much as its bytes, which priced at bytes / GB/s alone lost to 110 zero-copy slices
    (the Llama with an MLA draft of issue 21, real engines). The per-descriptor choices of
    :meth:`prefers_direct` and :meth:`direct_slice_wins` leave it out: it only ever favours the
    zero-copy ways, which the per-request choice then takes.

    ``pull_us`` is what a pull's round trip adds before any byte moves (our Pull, the source's
    next progress, its answer), which a source's offer in hand saves: a destination holding an
    offer of the source's cache blocks adds it to the ways that would pull instead
    (:func:`~kvtriton.plan.cheapest_way`). Not measured (it is the source's progress cadence in
    serving, ``progress_interval_s`` and its engine's GIL, not this host's copy speed): the default
    is the agent's progress interval, a lower bound; :data:`UNMEASURED` names it.
    """

    desc_us: float = 2.3
    pack_gbps: float = 10.0
    unpack_gbps: float = 5.0
    read_gbps: float = 8.0
    write_gbps: float = 8.0
    pass_us: float = 75.0
    segment_us: float = 12.0
    pull_us: float = 500.0
    source: str = field(default="default (CPU, calibrated by hand)", compare=False)

    def crossover_bytes(self) -> float:
        """Bytes per descriptor above which DIRECT beats STAGED."""
        return self.desc_us * 1e3 / (1.0 / self.pack_gbps + 1.0 / self.unpack_gbps)

    def prefers_direct(self, bytes_per_descriptor: int) -> bool:
        """Whether descriptors of ``bytes_per_descriptor`` bytes are cheaper moved DIRECT."""
        return bytes_per_descriptor >= self.crossover_bytes()

    def direct_slice_wins(self, bytes_per_descriptor: int, *, read_unpack: bool = False,
                          pack_place: bool = False) -> bool:
        """Whether a zero-copy descriptor of ``bytes_per_descriptor`` bytes (DIRECT_SLICE: one per
        block, whatever the runs) costs less than repacking those bytes by the cheapest way
        available: both passes (STAGED), or the one pass READ_UNPACK (unpack) or PACK_PLACE (pack)
        leaves when feasible, their descriptors counted free (their best case: ids in long runs)."""
        per_byte_us = [1e-3 / self.pack_gbps + 1e-3 / self.unpack_gbps]
        if read_unpack:
            per_byte_us.append(1e-3 / self.unpack_gbps)
        if pack_place:
            per_byte_us.append(1e-3 / self.pack_gbps)
        return self.desc_us <= bytes_per_descriptor * min(per_byte_us)

    def wire_us(self, nbytes: int, op: str = "READ") -> float:
        """Estimated time of ``nbytes`` on the wire by ``op`` (READ or WRITE)."""
        return nbytes / 1e3 / (self.read_gbps if op == "READ" else self.write_gbps)

    def pass_fixed_us(self, segments: int, passes: int = 1) -> float:
        """The fixed cost of ``passes`` repack passes over ``segments`` segments each."""
        return passes * (self.pass_us + segments * self.segment_us)

    def staged_us(self, nbytes: int, descriptors: int = 1, op: str = "READ", *, segments: int = 0) -> float:
        """Estimated time of ``nbytes`` staged: pack + ``descriptors`` transfers (one per chunk,
        each chunk its own pack and unpack pass over ``segments`` segments) + unpack."""
        return (nbytes / 1e3 * (1.0 / self.pack_gbps + 1.0 / self.unpack_gbps)
                + self.pass_fixed_us(segments, 2 * descriptors) + descriptors * self.desc_us
                + self.wire_us(nbytes, op))

    def direct_us(self, nbytes: int, descriptors: int, op: str = "READ") -> float:
        """Estimated time of ``nbytes`` moved zero-copy in ``descriptors`` pieces."""
        return descriptors * self.desc_us + self.wire_us(nbytes, op)

    def read_unpack_us(self, nbytes: int, descriptors: int, *, segments: int = 0, chunks: int = 1) -> float:
        """Estimated time of ``nbytes`` READ from the source's cache in ``descriptors`` runs into
        local staging, then unpacked (no pack pass; one unpack pass per chunk)."""
        return (nbytes / 1e3 / self.unpack_gbps + self.pass_fixed_us(segments, chunks)
                + descriptors * self.desc_us + self.wire_us(nbytes))

    def pack_place_us(self, nbytes: int, descriptors: int, *, segments: int = 0, chunks: int = 1) -> float:
        """Estimated time of ``nbytes`` packed by the source (one pass per chunk), then READ from
        its staging straight into the local cache blocks in ``descriptors`` runs (no unpack pass)."""
        return (nbytes / 1e3 / self.pack_gbps + self.pass_fixed_us(segments, chunks)
                + descriptors * self.desc_us + self.wire_us(nbytes))

    def way_us(self, way: Way, nbytes: int, descriptors: int, *, segments: int = 0, chunks: int = 1) -> float:
        """:meth:`staged_us` (its descriptors being the ``chunks``), :meth:`read_unpack_us`,
        :meth:`pack_place_us` or (DIRECT_SLICE, no pass at all) :meth:`direct_us` by ``way``, for
        a payload of ``segments`` segments cut into ``chunks`` staging chunks."""
        if way is Way.READ_UNPACK:
            return self.read_unpack_us(nbytes, descriptors, segments=segments, chunks=chunks)
        if way is Way.PACK_PLACE:
            return self.pack_place_us(nbytes, descriptors, segments=segments, chunks=chunks)
        if way is Way.DIRECT_SLICE:
            return self.direct_us(nbytes, descriptors)
        return self.staged_us(nbytes, descriptors, segments=segments)

    def as_dict(self) -> dict[str, float]:
        """The numbers (``source`` aside), as keyword arguments of the constructor."""
        return dict(desc_us=self.desc_us, pack_gbps=self.pack_gbps, unpack_gbps=self.unpack_gbps,
                    read_gbps=self.read_gbps, write_gbps=self.write_gbps, pass_us=self.pass_us,
                    segment_us=self.segment_us, pull_us=self.pull_us)
