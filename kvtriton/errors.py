"""Typed errors raised by kvtriton.

Every error a caller can provoke is a :class:`KVTritonError`. Errors about bad arguments also
derive from :class:`ValueError` (or :class:`TypeError`) so generic handlers keep working. Messages
name the offending object (region, rank, request) and say what was expected and what was found.
"""

from __future__ import annotations

__all__ = [
    "KVTritonError",
    "RegionError",
    "TopologyError",
    "PlanError",
    "LaunchError",
    "StagingError",
    "ProtocolError",
    "IncompatibleRemoteError",
    "PeerRefusedError",
    "TransportError",
    "PeerDisconnectedError",
    "TransferTimeoutError",
    "RequestRejectedError",
    "RequestAbortedError",
    "IntegrityError",
    "AuthenticationError",
]


class KVTritonError(Exception):
    """Base class of every error kvtriton raises on purpose."""


class RegionError(KVTritonError, ValueError):
    """A KV region's tensors do not match its declared layout, kind or geometry."""


class TopologyError(KVTritonError, ValueError):
    """A TP size cannot shard a region's KV heads, or a rank is out of range."""


class PlanError(KVTritonError, ValueError):
    """A transfer cannot be planned: incompatible regions, bad block ids, unknown mode."""


class LaunchError(KVTritonError, ValueError):
    """pack()/unpack() arguments are invalid; raised before anything is launched or written."""


class StagingError(KVTritonError):
    """The staging pool cannot satisfy a request (e.g. one block is larger than a slot)."""


class ProtocolError(KVTritonError, ValueError):
    """A peer's metadata or control message is malformed, truncated, of another version,
    or refers to memory outside what that peer registered."""


class IncompatibleRemoteError(ProtocolError):
    """A remote engine's regions cannot be paired with ours (count, kind, dtype, geometry...)."""


class PeerRefusedError(ProtocolError):
    """A peer's registration was refused (:meth:`~kvtriton.agent.TransferAgent.add_remote`): its
    (engine, rank) belongs to a live agent, its agent already stands for another engine or rank,
    its generation is not newer than the one it would replace, or the peer table is full."""


class TransportError(KVTritonError):
    """The NIXL layer failed (registration, preparation, posting)."""


class PeerDisconnectedError(TransportError):
    """The remote agent went away while a transfer or notification was in flight."""


class UnregisteredError(TransportError):
    """This rank dropped its NIXL registration (:meth:`~kvtriton.agent.TransferAgent.unregister`,
    e.g. its engine went to sleep): its fetches in flight failed, and nothing is held, fetched or
    met until :meth:`~kvtriton.agent.TransferAgent.restore`."""


class TransferTimeoutError(KVTritonError, TimeoutError):
    """A request did not complete within its deadline."""


class RequestRejectedError(KVTritonError):
    """The peer refused a request (unknown request id, expired lease, bad block ids)."""


class RequestAbortedError(KVTritonError):
    """The request was cancelled locally (:meth:`~kvtriton.agent.TransferAgent.abort`) or its
    hold was released by the source engine before the transfer finished."""


class IntegrityError(KVTritonError):
    """A staged chunk's bytes differ from the digest its source took after packing it
    (``TransferAgent(integrity=True)``): changed in flight or in staging. The fetch fails and
    its blocks are reported undefined (to be recomputed); nothing of the chunk is unpacked."""


class AuthenticationError(KVTritonError):
    """A peer on the handshake side channel did not prove the cluster credential (shared secret
    or mutual TLS), or the local credential files cannot be used."""
