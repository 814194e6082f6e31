"""Per-chunk integrity digests (``TransferAgent(integrity=True)``; threat model: docs/security.md).

A source digests each staged chunk once its pack has completed and sends the digest with the
chunk's announcement (``Ready``, ``Offer``: pull) or its landing notice (``Data``: push); the
destination digests the bytes that landed in its staging and compares before it unpacks. A
chunk changed between the pack and the unpack (in the source's staging, on the wire, in ours)
fails its fetch with :class:`~kvtriton.errors.IntegrityError`; nothing of it is unpacked.

The digest is BLAKE2b (:mod:`hashlib`) over the chunk's bytes, 256 bits. It guards against
bytes changed by someone who cannot also change the control message that carries the digest
(a member with one-sided access to registered memory, a faulty NIC or link); it is not a MAC:
whoever can forge the source's notifications can forge its digests too. On CUDA the chunk is
copied to the host first (a synchronous device-to-host copy of each chunk, on both sides):
correct, and as slow as that copy plus hashing (a few GB/s); a device-side checksum would be
cheaper and is not implemented.
"""

from __future__ import annotations

import hashlib

from ..errors import IntegrityError
from ..protocol.wire import DIGEST_BYTES
from .links import Chunk
from .settings import Settings
from .stats import Stats

__all__ = ["chunk_digest", "seal", "verify"]


def chunk_digest(s: Settings, slot: int, nbytes: int) -> bytes:
    """BLAKE2b of ``nbytes`` of our staging from ``slot`` (a device-to-host copy first on CUDA)."""
    view = s.pool.view(slot, nbytes)
    if view.device.type != "cpu":
        view = view.cpu()  # synchronous: the pack (or the landed READ) is complete before this runs
    return hashlib.blake2b(view.numpy().data, digest_size=DIGEST_BYTES).digest()


def seal(s: Settings, stats: Stats, ch: Chunk) -> bytes:
    """A source's digest of packed chunk ``ch`` (taken once, after its pack completed), or
    ``b""`` when integrity is off."""
    if s.integrity and not ch.digest:
        ch.digest = chunk_digest(s, ch.slot, ch.nbytes)
        stats.digested_chunks += 1
    return ch.digest


def verify(s: Settings, stats: Stats, ch: Chunk, where: str) -> None:
    """Before unpacking ``ch`` (landed in our slots): its bytes must match the digest its
    source sent; :class:`IntegrityError` otherwise (also when integrity is on and the source
    sent none). A no-op when integrity is off."""
    if not s.integrity:
        return
    if len(ch.digest) != DIGEST_BYTES:
        stats.integrity_failures += 1
        raise IntegrityError(f"{where}: chunk {ch.index} came without a digest (integrity=True on both "
                             f"engines: expected {DIGEST_BYTES} bytes, got {len(ch.digest)})")
    stats.digested_chunks += 1
    if chunk_digest(s, ch.slot, ch.nbytes) != ch.digest:
        stats.integrity_failures += 1
        raise IntegrityError(f"{where}: chunk {ch.index} ({ch.nbytes} bytes) does not match the digest its source "
                             f"took after packing it: its bytes changed in flight or in staging; its blocks "
                             f"are undefined (recompute them)")
