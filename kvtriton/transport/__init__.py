"""Transfer backends (NIXL). Importing this package does not import ``nixl``."""

from .fence import FENCE_BYTES, Fence, Fences
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
    "FENCE_BYTES",
    "Fence",
    "Fences",
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
