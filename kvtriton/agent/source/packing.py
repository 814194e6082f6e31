"""Batched pack: the chunks a source rank packs in one step go out in as few launches as the
kernel allows, one per group of chunks that read the same block ids.

Why: a source rank serving several decode ranks of one request (P1 -> D4: four) packs the same
blocks once per destination, only the head slices and the staging slots differ. Each
:func:`~kvtriton.ops.pack` call costs Python validation and, on CUDA, a kernel launch: small
requests are launch-bound. The kernel's grid already covers several destinations (its segment
table is the concatenation of their segment lists, each at its own staging offset), so the
chunks of one step that share their block ids become one launch.

How: a step first *reserves* each chunk (:meth:`~.share.StagingShare.reserve`: slots
allocated and counted to the engine's share, the :class:`~..links.Chunk` in its owner with no
kernel yet) and queues a :class:`PackJob`; :meth:`PackBatch.launch` then groups the queued jobs
by what one launch shares (block ids of the chunk's positions, token map, the hold's event) and
launches each group once. Every chunk of a group gets the same completion, so announcing it,
WRITing it and retiring its slots (:meth:`~..links.Links.retire` with ``kernel=``) all wait for
the launch that wrote it.

Failures stay per destination: :func:`~kvtriton.ops.pack` validates a whole launch before it
writes a byte, so when a group's launch is refused nothing was written, and each member is
launched alone: only the members whose own arguments are refused fail (their owner is told),
the others are packed.

Invariant: reserve and launch happen in one step of ``progress()`` with no message handled in
between, so no peer sees a reserved chunk before it is packed. A job whose owner ended meanwhile
(dropped, evicted: its chunk left the owner's ``inflight`` and its slots were retired at once,
nothing being queued into them) is skipped.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

import numpy as np

from ...errors import KVTritonError
from ...ops import pack
from ...plan import ChunkGeometry, Payload, TokenMap
from ..links import Chunk
from ..settings import Settings
from ..stats import Stats

_JOINED_CACHE_SIZE = 64  # concatenated segment lists kept (the launcher's validation cache keys on them)


@dataclass(eq=False)
class PackJob:
    """One reserved chunk of one destination, waiting for its launch."""

    read: Payload  # the destination's segments from this rank
    chunk: Chunk  # its reserved slots (``kernel`` is set by the launch)
    tiles_n: int | tuple[int, ...]  # tiles per segment in this chunk (several KV cache groups: per group)
    ids: np.ndarray  # the launch's block ids: the chunk's positions, or the token map's source ids
    tiles: np.ndarray | None  # token map: the chunk's destination positions
    num_tokens: int | None  # token map: the request's tokens
    ready: object  # the hold's event: the launch waits for it on the device
    alive: Callable[[], bool]  # False once the owner no longer keeps ``chunk`` (then it is skipped)
    failed: Callable[[KVTritonError], None]  # the launch refused this job's arguments
    groups: tuple[int, ...] | None = None  # several KV cache groups: each one's positions among ``ids``

    @classmethod
    def for_chunk(cls, read: Payload, chunks: ChunkGeometry, ch: Chunk, ids: np.ndarray,
                  tokens: TokenMap | None, ready, alive, failed) -> PackJob:
        lo, hi = chunks.bounds(ch.index)
        if chunks.grouped:
            counts = chunks.group_counts(ch.index)
            return cls(read, ch, counts, ids[lo:hi], None, None, ready, alive, failed, counts)
        if tokens is None:
            return cls(read, ch, hi - lo, ids[lo:hi], None, None, ready, alive, failed)
        return cls(read, ch, hi - lo, tokens.src_ids, tokens.tiles[lo:hi], tokens.num_tokens, ready, alive, failed)

    def key(self) -> tuple:
        """What every job of one launch must share."""
        tiles = None if self.tiles is None else np.ascontiguousarray(self.tiles, dtype=np.int64).tobytes()
        return (id(self.ready), self.ids.dtype.str, np.ascontiguousarray(self.ids).tobytes(), tiles,
                self.num_tokens, self.groups)


class PackBatch:
    """The pack jobs of one source rank queued in the current step."""

    def __init__(self, settings: Settings, stats: Stats | MutableMapping[str, int]):
        """``stats``: the rank's :class:`~..stats.Stats`, or (tests) a plain dict of the two
        counters a batch keeps, ``pack_launches`` and ``packed_chunks``. Either way a launch is
        counted through one callback, chosen here (:meth:`Stats.packed`)."""
        self.s, self.stats = settings, stats
        self._counted: Callable[[int], None] = (stats.packed if isinstance(stats, Stats)
                                                else functools.partial(_count_in, stats))
        self.jobs: list[PackJob] = []
        self._joined: OrderedDict[tuple, tuple] = OrderedDict()  # ids of reads' segments -> (reads, joined)

    def add(self, job: PackJob) -> None:
        self.jobs.append(job)

    def launch(self) -> None:
        """Launch every queued job: one launch per group that shares its block ids."""
        jobs, self.jobs = self.jobs, []
        groups: dict[tuple, list[PackJob]] = {}
        for job in jobs:
            groups.setdefault(job.key(), []).append(job)
        for group in groups.values():
            group = [j for j in group if j.alive()]  # an earlier group's failure may have ended an owner
            if len(group) == 1:
                self._launch_one(group[0])
            elif group:
                self._launch_group(group)

    def _launch_group(self, group: list[PackJob]) -> None:
        pool = self.s.pool
        segments = self._joined_segments(tuple(j.read for j in group))
        offsets = np.concatenate([j.read.segment_offsets(j.tiles_n, base=pool.offset(j.chunk.slot)) for j in group])
        try:
            self._pack(group[0], segments, offsets, len(group))
        except KVTritonError:  # refused before anything was written: find out whose arguments
            for job in group:
                if job.alive():
                    self._launch_one(job)
            return
        done = self.s.lanes.completion()
        for job in group:
            job.chunk.kernel = done

    def _launch_one(self, job: PackJob) -> None:
        try:
            self._pack(job, job.read.segments, job.read.segment_offsets(job.tiles_n,
                                                                        base=self.s.pool.offset(job.chunk.slot)), 1)
        except KVTritonError as e:
            job.failed(e)
            return
        job.chunk.kernel = self.s.lanes.completion()

    def _pack(self, job: PackJob, segments, offsets: np.ndarray, chunks: int) -> None:
        """One launch packing ``chunks`` chunks (counted once it was accepted)."""
        with self.s.lanes.launching(after=job.ready):  # after the engine's writes, on our stream
            pack(self.s.regions, segments, offsets, job.ids, self.s.pool.tensor, impl=self.s.impl,
                 tiles=job.tiles, num_tokens=job.num_tokens, groups=job.groups)
        self._counted(chunks)

    def _joined_segments(self, reads: tuple[Payload, ...]) -> tuple:
        """The reads' segment lists concatenated, the same tuple each time for the same reads (the
        launcher checks a segment tuple once and then reuses the check)."""
        key = tuple(id(r.segments) for r in reads)
        hit = self._joined.get(key)
        if hit is not None:  # the cached reads keep those segment tuples alive: the ids are theirs
            self._joined.move_to_end(key)
            return hit[1]
        joined = tuple(itertools.chain.from_iterable(r.segments for r in reads))
        self._joined[key] = (reads, joined)  # keeps the reads, so their ids are not reused while cached
        if len(self._joined) > _JOINED_CACHE_SIZE:
            self._joined.popitem(last=False)
        return joined


def _count_in(counts: MutableMapping[str, int], chunks: int) -> None:
    """:meth:`Stats.packed` for a plain dict of the two counters."""
    counts["pack_launches"] += 1
    counts["packed_chunks"] += chunks
