"""The transport's typed handles (registrations, prepared lists, transfers) and the checks of
what callers pass it (descriptor arrays, indices, memory types), apart from the NIXL calls."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = ["MemType", "Op", "XferStatus", "Registration", "PreppedList", "Xfer"]

MemType = Literal["DRAM", "VRAM"]
Op = Literal["READ", "WRITE"]
MEM_TYPES = ("DRAM", "VRAM")
OPS = ("READ", "WRITE")


class XferStatus(enum.Enum):
    """State of a posted transfer, as NIXL reports it."""

    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


@dataclass(eq=False)
class Registration:
    """Memory registered with the agent; pass it to :meth:`NixlTransport.deregister`.

    ``descs`` is the ``(addr, len, dev)`` of each region, as an ``Nx3`` uint64 array. Tensors given
    to :meth:`NixlTransport.register` are kept alive here until deregistration.
    """

    mem_type: MemType
    descs: np.ndarray
    _dlist: Any = field(repr=False)
    _keepalive: tuple = field(default=(), repr=False)
    released: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.descs[:, 1].sum())


@dataclass(eq=False)
class PreppedList:
    """A prepared descriptor list: transfers address its descriptors by index.

    ``agent`` is ``""`` for a local list, otherwise the remote agent's name (or our own name
    for a loopback list). ``count`` is the number of descriptors, after expanding strided rows.
    """

    agent: str
    mem_type: MemType
    count: int
    _handle: Any = field(repr=False)
    released: bool = False

    @property
    def is_local(self) -> bool:
        return self.agent == ""


@dataclass(eq=False)
class Xfer:
    """A transfer request made by :meth:`NixlTransport.post`; release it when done.

    ``status`` is the last state seen by :meth:`NixlTransport.post`, :meth:`~NixlTransport.poll`
    or :meth:`~NixlTransport.repost`. ``n`` is the number of index pairs requested (NIXL may
    merge adjacent ones into fewer descriptors).
    """

    op: Op
    remote: str
    n: int
    _handle: Any = field(repr=False)
    _notif: bytes = field(default=b"", repr=False)
    status: XferStatus = XferStatus.PROC
    released: bool = False


# ---- argument checks ---------------------------------------------------------------------------


def check_mem_type(mem_type: object, what: str) -> MemType:
    if mem_type not in MEM_TYPES:
        raise ValueError(f"{what}: mem_type must be 'DRAM' or 'VRAM', got {mem_type!r}")
    return mem_type  # type: ignore[return-value]


def as_bytes(msg: object, what: str) -> bytes:
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return bytes(msg)
    raise TypeError(f"{what} must be bytes, got {type(msg).__name__}")


def _is_tensor(obj: object) -> bool:
    import torch

    return isinstance(obj, torch.Tensor)


def region_descs(regions: object) -> tuple[np.ndarray, MemType | None, tuple]:
    """(Nx3 uint64 descs, mem type inferred from tensors or None, tensors to keep alive)."""
    if _is_tensor(regions):
        regions = [regions]
    if isinstance(regions, np.ndarray):
        arr, _ = xfer_array(regions, "register", allow_strided=False)
        if (arr[:, 1] == 0).any():
            raise ValueError("register: zero-length region")
        return arr, None, ()
    if not isinstance(regions, Iterable) or isinstance(regions, (bytes, str)):
        raise TypeError(
            "register: expected tensors, (addr, len[, dev]) tuples or an Nx3 array, "
            f"got {type(regions).__name__}"
        )
    items = list(regions)
    if not items:
        raise ValueError("register: nothing to register")
    if all(_is_tensor(t) for t in items):
        devs = {t.device for t in items}
        if len(devs) != 1:
            raise ValueError(
                f"register: tensors span several devices {sorted(map(str, devs))}; register each separately"
            )
        dev = devs.pop()
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"register: unsupported device {dev}")
        rows = []
        for i, t in enumerate(items):
            if not t.is_contiguous():
                raise ValueError(
                    f"register: tensor {i} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()})"
                )
            n = t.numel() * t.element_size()
            if n == 0:
                raise ValueError(f"register: tensor {i} is empty")
            rows.append((t.data_ptr(), n, (dev.index or 0) if dev.type == "cuda" else 0))
        return np.array(rows, dtype=np.uint64), ("VRAM" if dev.type == "cuda" else "DRAM"), tuple(items)
    if all(isinstance(r, tuple) and len(r) in (2, 3) for r in items):
        rows = [(int(r[0]), int(r[1]), int(r[2]) if len(r) == 3 else 0) for r in items]
        for i, (a, n, d) in enumerate(rows):
            if a <= 0 or n <= 0 or d < 0:
                raise ValueError(f"register: region {i} = {items[i]} must have addr > 0, len > 0, dev >= 0")
        return np.array(rows, dtype=np.uint64), None, ()
    raise TypeError("register: expected a list of tensors or of (addr, len[, dev]) tuples, not a mix")


def xfer_array(descs: object, what: str, *, allow_strided: bool) -> tuple[np.ndarray, int]:
    """Validate an Nx3 (or Nx5 strided) integer array; return it as C-contiguous uint64 and the
    number of descriptors it stands for."""
    if not isinstance(descs, np.ndarray):
        raise TypeError(
            f"{what}: descriptors must be an Nx3 numpy array (addr, len, dev), got {type(descs).__name__}"
        )
    cols = (3, 5) if allow_strided else (3,)
    if descs.ndim != 2 or descs.shape[1] not in cols or descs.shape[0] == 0:
        shapes = " or ".join(map(str, cols))
        raise ValueError(f"{what}: descriptors must have shape (N>0, {shapes}), got {descs.shape}")
    if not np.issubdtype(descs.dtype, np.integer):
        raise TypeError(f"{what}: descriptors must be integers, got dtype {descs.dtype}")
    if np.issubdtype(descs.dtype, np.signedinteger) and (descs < 0).any():
        raise ValueError(f"{what}: negative address, length or device")
    arr = np.ascontiguousarray(descs, dtype=np.uint64)
    if (arr[:, 1] == 0).any():
        raise ValueError(f"{what}: zero-length descriptor")
    if arr.shape[1] == 5:
        if (arr[:, 4] == 0).any():
            raise ValueError(f"{what}: strided row with count 0")
        return arr, int(arr[:, 4].sum())
    return arr, arr.shape[0]


def indices(idx: object, count: int, what: str) -> np.ndarray:
    """``idx`` as a 1-D int64 array of indices into a list of ``count`` descriptors, each checked in
    ``[0, count)`` here: NIXL's own check sees them as 32-bit ints (an index of ``2**32 + k`` would
    pass as ``k``). ``ValueError``, ``TypeError`` or ``IndexError`` saying what is wrong."""
    arr = np.asarray(idx)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == np.int64:  # what every caller of ours passes: one reduction (a negative id reads as
        # past 2**63 unsigned), no dtype-hierarchy walk; ~3 us less a post of two lists
        if int(arr.view(np.uint64).max()) < count:
            return np.ascontiguousarray(arr)
    elif not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= count:
        raise IndexError(f"{what} out of range: values in [{lo}, {hi}] for a list of {count} descriptors")
    return np.ascontiguousarray(arr, dtype=np.int64)
