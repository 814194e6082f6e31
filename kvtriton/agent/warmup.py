"""Compiling an agent's kernel specialisations before its first request.

A pack or unpack compiles its Triton kernel on first use for each set of constexprs
(:class:`~kvtriton.ops.heuristics.LaunchConfig`: word width, vector length, tile shape), 0.5-2 s on a
GPU; inside :meth:`TransferAgent.progress` that stalls every transfer of the rank. The
specialisations an agent will launch follow from its plans: the staged segments of each (peer,
direction) pair, and the staging offsets of a chunk, whose alignment depends only on the
2-adic part of the chunk's block count (offsets are ``base + n * tile_bytes``, ``base`` a
multiple of the slot size), so chunks of 1, 2, 4, 8 and 16 blocks cover every alignment up to
the 16 bytes that matter.

Each specialisation is launched once with every block id -1 (padding: the kernel loads its
table row and copies nothing), on the agent's stream, so no cache or staging byte changes. Under
the torch implementation there is nothing to compile and nothing is launched; under
``TRITON_INTERPRET=1`` the same launches run in the interpreter (that is how CPU tests check it).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..errors import KVTritonError
from ..ops import LaunchConfig, launch_config_for, pack, unpack
from ..ops.launch import resolve_impl
from ..plan import Payload
from .links import Peer
from .plan_book import PlanBook
from .settings import Settings

__all__ = ["own_reads", "peer_reads", "warm"]

_BLOCK_COUNTS = (1, 2, 4, 8, 16)  # one of each power of two: every staging-offset alignment


def own_reads(book: PlanBook) -> list[tuple[str, Payload]]:
    """What a peer engine with this rank's own geometry (same TP, same regions) makes it launch."""
    own = book.own_geometry()
    reads = [("pack", own.payload(book.s.rank))] + [("unpack", r) for r in own.staged]
    return [(op, r) for op, r in reads if r is not None]


def peer_reads(book: PlanBook, peers: Iterable[Peer]) -> list[tuple[str, Payload]]:
    """What serving ``peers`` (pack, by the plan each is served by: the peer's cost model) and
    fetching from them (unpack, by the plan the book keeps for reading their engine) makes this
    rank launch."""
    plans_from = book.reads
    reads = []
    for p in peers:
        try:
            reads.append(("pack", book.serving(p.md).payload(book.s.rank)))
        except KVTritonError:  # this pairing cannot be served; a request for it is rejected anyway
            pass
        if p.md.engine in plans_from:
            reads.append(("unpack", plans_from[p.md.engine].payload(p.md.rank)))
    return [(op, r) for op, r in reads if r is not None]


def warm(s: Settings, reads: Iterable[tuple[str, Payload]], done: set) -> list[tuple[str, LaunchConfig]]:
    """Launch each ``(op, LaunchConfig)`` of ``reads`` (``("pack" | "unpack", staged read)``
    pairs) not in ``done`` yet, add it there, wait for the launches; returns the new ones."""
    if resolve_impl(s.impl, s.device) == "torch":
        return []
    staging = s.pool.tensor
    new: list[tuple[str, LaunchConfig]] = []
    with s.lanes.launching():
        for op, read in reads:
            if not read.segments:
                continue
            fits = max(1, min(s.chunk_bytes, staging.numel()) // max(1, read.bytes_per_block))
            for n in _BLOCK_COUNTS:
                if n > fits:
                    break
                ids = np.full(n, -1, dtype=np.int64)
                pair_ids: np.ndarray | None = ids  # both sides skip every position: nothing moves
                tiles: np.ndarray | None = None
                num_tokens: int | None = None
                seg = read.segments[0]
                if seg.src_block_size is not None:  # token-mapped (block sizes differ): n whole tiles
                    pair_ids, tiles, num_tokens = None, np.arange(n), n * seg.block_size
                    if op == "pack":  # ids per source position covering those tokens
                        ids = np.full(-(-n * seg.block_size // seg.src_block_size), -1, dtype=np.int64)
                offs = read.segment_offsets(n)
                key = (op, launch_config_for(op, s.regions, read.segments, offs, ids, staging, pair_ids=pair_ids,
                                             tiles=tiles, num_tokens=num_tokens))
                if key in done:
                    continue
                (pack if op == "pack" else unpack)(s.regions, read.segments, offs, ids, staging, impl=s.impl,
                                                   pair_ids=pair_ids, tiles=tiles, num_tokens=num_tokens)
                done.add(key)
                new.append(key)
    s.lanes.synchronize()
    return new
