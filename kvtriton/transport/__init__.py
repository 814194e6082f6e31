"""Transfer backends (NIXL). Importing this package does not import ``nixl``."""

from .nixl import (
    MemType,
    NixlTransport,
    Op,
    PeerDisconnectedError,
    PreppedList,
    Registration,
    TransportError,
    Xfer,
    XferStatus,
)

__all__ = [
    "MemType",
    "NixlTransport",
    "Op",
    "PeerDisconnectedError",
    "PreppedList",
    "Registration",
    "TransportError",
    "Xfer",
    "XferStatus",
]
