"""pack()/unpack(): validate, choose an implementation, launch.

The launchers sit between the planner (which decides *what* moves: :class:`~kvtriton.plan.Segment`
lists and their staging offsets) and the kernels (which only move words). They hold no topology
math: they check that the arguments describe memory that exists (:mod:`.validate`), turn them
into one int64 table per launch (its columns are named once, in ``kernels/segment_table.py``),
pick a word width and a tile shape from the geometry (:mod:`.heuristics`), and launch once for
the whole request. :func:`pack` and :func:`unpack` share that path; only the kernel's direction
differs.

Dispatch (``impl=`` keyword, overridden by the environment variable ``KVTRITON_IMPL`` when it
is set to ``torch``, ``triton`` or ``auto``):

* ``"auto"``: CUDA tensors run the Triton kernels; CPU tensors run the torch reference, or the
  Triton kernels when the interpreter is on (``TRITON_INTERPRET=1`` before ``kvtriton.kernels``
  is imported).
* ``"triton"``: the kernels (CUDA, or CPU under the interpreter).
* ``"torch"``: :mod:`kvtriton.ops.reference`, on any device.

A token-mapped request (``tiles=``) that touches a stream with a dim-major row part
(``RegionSpec.dim_major``: vLLM's CPU attention cache) runs the torch path under ``"auto"`` and
raises :class:`~kvtriton.errors.LaunchError` under ``"triton"``, before anything is launched:
the kernels regroup whole token rows only (CUDA attention backends are token-major).

Every check runs before anything is launched or written, and no check synchronises a device
(see :mod:`.validate`).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import LaunchError
from ..kernels import segment_table as col
from ..plan import Segment
from ..regions import Region
from .heuristics import INT_OF_WIDTH, LaunchConfig, launch_config
from .reference import pack_reference, unpack_reference
from .validate import Checked, validate

__all__ = ["launch_config_for", "pack", "unpack"]

_IMPLS = ("auto", "torch", "triton")
_OPS = ("pack", "unpack")


# --------------------------------------------------------------------------- dispatch
def _kernel(op: str):
    """The Triton kernel of ``op``, imported on first use: Triton picks the interpreter when the
    kernels are decorated, so importing them with kvtriton would fix the choice too early."""
    if op == "pack":
        from ..kernels.pack import _pack_kernel as kernel
    else:
        from ..kernels.unpack import _unpack_kernel as kernel
    return kernel


@functools.cache
def _interpreting() -> bool:
    """True when the kernels were decorated under ``TRITON_INTERPRET=1`` (Triton decides at
    decoration time, so the environment variable alone is not enough). Asked once per process:
    the first answer imports Triton and decorates the kernels (~20 ms inside a busy engine), which
    :func:`resolve_impl` at an agent's construction pays, not its first repack. False when Triton
    cannot be imported: nothing is interpreted then, and an agent that repacks on the torch path
    (``"auto"`` on CPU) or never repacks (zero-copy regions only) needs no Triton, as before this
    was asked at construction; a Triton launch still raises the ImportError when it is tried."""
    try:
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(_kernel("pack"), InterpretedFunction)
    except ImportError:
        return False


def resolve_impl(impl: str, device: torch.device) -> str:
    """What ``impl`` (``"auto"``, ``"triton"`` or ``"torch"``; ``KVTRITON_IMPL`` overrides it) runs
    on ``device``'s tensors: ``"triton"`` or ``"torch"``; :class:`LaunchError` when it is not a
    known implementation or cannot run there (``"triton"`` on CPU tensors without the Triton
    interpreter, or on CUDA tensors with it)."""
    env = os.environ.get("KVTRITON_IMPL", "").strip().lower()
    if env and env not in _IMPLS:
        raise LaunchError(f"KVTRITON_IMPL={env!r} is not a known implementation: expected one of {_IMPLS}")
    if not isinstance(impl, str) or impl not in _IMPLS:
        raise LaunchError(f"impl={impl!r} is not a known implementation: expected one of {_IMPLS}")
    choice = env or impl
    on_cuda = device.type == "cuda"
    if choice == "auto":
        if on_cuda:
            return "torch" if _interpreting() else "triton"
        return "triton" if _interpreting() else "torch"
    if choice == "triton":
        if on_cuda and _interpreting():
            raise LaunchError(
                "impl='triton' on CUDA tensors, but the kernels were decorated under "
                "TRITON_INTERPRET=1 (interpreter, host memory only): unset it, or use impl='torch'"
            )
        if not on_cuda and not _interpreting():
            raise LaunchError(
                f"impl='triton' on {device.type} tensors needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before kvtriton.kernels is imported, or use impl='torch'"
            )
    return choice




# --------------------------------------------------------------------------- launch
def _segment_table(chk: Checked, staging: torch.Tensor) -> tuple[np.ndarray, LaunchConfig]:
    """The launch's segment table in words (columns: ``kernels/segment_table.py``) and its
    constexpr geometry: the word width is the widest the addresses, strides, row lengths,
    staging base and offsets all allow."""
    rows = chk.static.rows.copy()
    rows[:, col.STG_OFF] = chk.offsets
    lowbits = chk.static.lowbits | int(np.bitwise_or.reduce(chk.offsets, initial=0)) | staging.data_ptr()
    cfg = launch_config(lowbits, int((rows[:, col.NUM_HEADS] * rows[:, col.BLOCK_SIZE]).max()),
                        int(rows[:, col.ROW_WORDS].max()))
    rows[:, col.WORD_COLUMNS] //= cfg.word_bytes
    return rows, cfg


#: Triton's interpreter patches ``triton.language`` for the length of each interpreted launch and
#: restores it afterwards, so two launches on two threads (two agents' progress threads in one
#: process, as the tests run them) break each other; compiled launches need no lock.
_INTERPRETER_LOCK = threading.Lock()


def _launch(op: str, chk: Checked, staging: torch.Tensor) -> None:
    rows, cfg = _segment_table(chk, staging)
    usable = staging.numel() - staging.numel() % cfg.word_bytes
    words = staging[:usable].view(INT_OF_WIDTH[cfg.word_bytes])
    table = torch.from_numpy(rows)
    device = staging.device
    grid = (chk.n, rows.shape[0])
    on_cuda = device.type == "cuda"
    with torch.cuda.device(device) if on_cuda else _INTERPRETER_LOCK:
        if on_cuda:
            # Pinned + non_blocking: ordered on the caller's current stream, the host never waits.
            table = table.pin_memory().to(device, non_blocking=True)
        _kernel(op)[grid](
            staging_ptr=words, seg_ptr=table, block_ids_ptr=chk.ids,
            tiles_ptr=chk.tiles if chk.tiles is not None else chk.ids, num_tokens=chk.num_tokens,
            TOKEN_MAP=chk.tiles is not None, BLOCK_R=cfg.block_r, BLOCK_W=cfg.block_w, VEC=cfg.vec, ALIGN=cfg.align,
            num_warps=cfg.num_warps,
        )


def _run(op: str, regions, segments, offsets, block_ids, staging, impl: str, pair_ids=None, tiles=None,
         num_tokens=None, groups=None) -> None:
    """The one path of :func:`pack` and :func:`unpack`: validate, choose, launch or run the
    reference. Nothing is written unless every check passed. ``groups``: one launch per KV
    cache group (:func:`_group_launches`), every one checked before the first runs."""
    if groups is None or len(groups) <= 1:
        chk = validate(op, regions, segments, offsets, block_ids, staging, pair_ids=pair_ids, tiles=tiles,
                        num_tokens=num_tokens)
        _execute(op, regions, segments, chk, staging, impl)
        return
    if tiles is not None:
        raise LaunchError(f"{op}: groups= and tiles= do not combine: a token-mapped request has one group")
    checked = [(segs, validate(op, regions, segs, offs, ids, staging, pair_ids=pair))
               for segs, offs, ids, pair in _group_launches(op, segments, offsets, block_ids, pair_ids, groups)]
    for segs, chk in checked:
        _execute(op, regions, segs, chk, staging, impl)


# the segments of each KV cache group of a launch's segment tuple: the same tuples each time (the
# launcher checks a segment tuple once and then reuses the check, keyed by the tuple)
_GROUP_SPLITS: dict[int, tuple[Sequence[Segment], list[tuple[int, np.ndarray, tuple[Segment, ...]]]]] = {}
_GROUP_SPLITS_SIZE = 64


def _group_launches(op: str, segments, offsets, block_ids, pair_ids, groups) -> list[tuple]:
    """One launch per KV cache group with segments and positions: its segments, their offsets,
    and the group's slice of the ids (``groups[g]`` positions of group ``g``, in group order)."""
    try:
        counts = [int(c) for c in groups]
        offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
        if not isinstance(block_ids, torch.Tensor):
            block_ids = np.asarray(block_ids)
        n = len(block_ids)
    except (TypeError, ValueError) as e:
        raise LaunchError(f"{op}: groups, offsets or block ids are not integer lists ({e})") from None
    if offs.size != len(segments):
        raise LaunchError(f"{op}: {offs.size} offsets for {len(segments)} segments")
    if any(c < 0 for c in counts) or sum(counts) != n:
        raise LaunchError(f"{op}: groups {counts[:8]} must be non-negative and add up to the {n} block ids")
    if pair_ids is not None and not isinstance(pair_ids, torch.Tensor):
        pair_ids = np.asarray(pair_ids)
    hit = _GROUP_SPLITS.get(id(segments))
    if hit is None or hit[0] is not segments:
        split: dict[int, list[int]] = {}
        for i, seg in enumerate(segments):
            split.setdefault(getattr(seg, "group", 0), []).append(i)
        parts = [(g, np.asarray(ix, dtype=np.int64), tuple(segments[i] for i in ix)) for g, ix in sorted(split.items())]
        if len(_GROUP_SPLITS) >= _GROUP_SPLITS_SIZE:
            _GROUP_SPLITS.pop(next(iter(_GROUP_SPLITS)))
        _GROUP_SPLITS[id(segments)] = hit = (segments, parts)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64).tolist()
    out = []
    for g, ix, segs in hit[1]:
        if g >= len(counts):
            raise LaunchError(f"{op}: a segment of group {g}, but groups= names {len(counts)} groups")
        lo, hi = starts[g], starts[g + 1]
        if hi > lo:
            out.append((segs, offs[ix], block_ids[lo:hi], None if pair_ids is None else pair_ids[lo:hi]))
    return out


def _execute(op: str, regions, segments, chk: Checked, staging, impl: str) -> None:
    """Run one checked launch: the kernels or the torch reference."""
    which = _impl_for(op, chk, impl, staging.device)
    if chk.n == 0 or len(segments) == 0:
        return
    if which == "torch":
        reference = pack_reference if op == "pack" else unpack_reference
        if chk.tiles is None:
            reference(regions, segments, chk.offsets, chk.ids, staging)
        else:
            reference(regions, segments, chk.offsets, chk.ids, staging, tiles=chk.tiles, num_tokens=chk.num_tokens)
    else:
        _launch(op, chk, staging)


def _impl_for(op: str, chk: Checked, impl: str, device: torch.device) -> str:
    """The implementation that runs this request: the kernels do not regroup tokens of a
    dim-major row part (no CUDA attention backend stores one), so a token-mapped request that
    touches one runs the torch path under ``"auto"`` and is refused under ``"triton"``."""
    which = resolve_impl(impl, device)
    if which == "triton" and chk.tiles is not None and chk.static.dim_major:
        env = os.environ.get("KVTRITON_IMPL", "").strip().lower()
        if (env or impl) == "auto":
            return "torch"
        raise LaunchError(
            f"{op}: impl='triton' cannot remap tokens of a dim-major row part (RegionSpec.dim_major, "
            "e.g. vLLM's CPU attention cache) across block sizes: use impl='torch' or 'auto'"
        )
    return which


def launch_config_for(
    op: str,
    regions: Sequence[Region],
    segments: Sequence[Segment],
    offsets: Sequence[int] | np.ndarray,
    block_ids: torch.Tensor | np.ndarray | Sequence[int],
    staging: torch.Tensor,
    *,
    pair_ids=None,
    tiles=None,
    num_tokens: int | None = None,
) -> LaunchConfig:
    """The word width, vector length and tile shape ``ops.<op>`` would launch its kernel with
    for these arguments (validated as :func:`pack`/:func:`unpack` do; nothing is launched).

    Raises
    ------
    LaunchError
        On an unknown ``op``, an empty request, or any argument :func:`pack`/:func:`unpack`
        would reject.
    """
    if op not in _OPS:
        raise LaunchError(f"launch_config_for: op {op!r} is not one of {_OPS}")
    chk = validate(op, regions, segments, offsets, block_ids, staging, pair_ids=pair_ids, tiles=tiles,
                    num_tokens=num_tokens)
    if chk.n == 0 or len(segments) == 0:
        raise LaunchError(f"launch_config_for: an empty {op} request launches nothing")
    return _segment_table(chk, staging)[1]


# --------------------------------------------------------------------------- public API
def pack(
    regions: Sequence[Region],
    segments: Sequence[Segment],
    offsets: Sequence[int] | np.ndarray,
    block_ids: torch.Tensor | np.ndarray | Sequence[int],
    staging: torch.Tensor,
    *,
    impl: str = "auto",
    pair_ids: torch.Tensor | np.ndarray | Sequence[int] | None = None,
    tiles: np.ndarray | Sequence[int] | None = None,
    num_tokens: int | None = None,
    groups: Sequence[int] | None = None,
) -> torch.Tensor:
    """Gather head slices of blocks ``block_ids`` from this rank's caches into ``staging``.

    One launch covers every segment (every staged region and stream, for every destination
    rank being served: concatenate the destinations' segment lists and offsets) and every
    block. Tile ``j`` of segment ``s`` is written at byte ``offsets[s] + j * tile_bytes`` in
    ``segments[s].dst_layout``; see :mod:`kvtriton.plan` for the wire format.

    Parameters
    ----------
    regions : Sequence[Region]
        This rank's regions, indexed by ``Segment.region``. Stream ``k`` of a region is
        ``[num_blocks, block_size, local_heads, head_dim]`` (NHD) or
        ``[num_blocks, local_heads, block_size, head_dim]`` (HND), any strides with head_dim
        stride 1 (separate K/V tensors, joint ``[num_blocks, 2, ...]``/``[2, num_blocks, ...]``
        views, and padded, non-contiguous blocks all work). Any dtype (fp8, bf16, fp16, fp32...):
        the bits are copied.
    segments : Sequence[Segment]
        What to gather: heads ``[src_head, src_head + num_heads)`` of ``regions[region]``'s
        stream ``stream``; tiles written in ``dst_layout``. Typically ``read.segments`` of one
        :class:`~kvtriton.plan.Payload` per destination, concatenated.
    offsets : Sequence[int] | np.ndarray
        ``[n_segments]`` byte offset of each segment's first tile in ``staging``
        (``read.segment_offsets(n, base)``).
    block_ids : torch.Tensor | np.ndarray | Sequence[int]
        ``[n]`` int32/int64 source block of each request position; ``-1`` skips the position
        (its staging bytes are left as they were) and needs ``pair_ids``. Repeats are allowed.
    staging : torch.Tensor
        ``[staging_bytes]`` uint8, contiguous, on the regions' device, caller-owned (e.g. a
        registered staging slot). Tile ``j`` of segment ``s`` is ``[block_size, num_heads,
        head_dim]`` (NHD) or ``[num_heads, block_size, head_dim]`` (HND) at
        ``staging[offsets[s] + j * tile_bytes:][:tile_bytes]``.
    impl : str
        ``"auto"``, ``"triton"`` or ``"torch"``; the ``KVTRITON_IMPL`` environment variable, if
        set, overrides it (see the module docstring).
    pair_ids : optional
        ``[n]`` the destination's ids for the same positions (what :func:`unpack` gets). A
        position is skipped when either list has -1 there; give it to both calls, so a tile one
        side skips is never unpacked from stale staging. Required when ``block_ids`` (on the
        CPU) holds a -1; lists compacted with :func:`~kvtriton.plan.compact_request` need none.
    tiles, num_tokens : optional
        A token-mapped request (the engines' block sizes differ; segments with
        ``src_block_size`` set need it): ``block_ids`` is then the source block of each *source
        position* (``kvtriton.plan.TokenMap.src_ids``, -1 where not read), ``tiles`` ``[n]`` the
        ascending destination positions to stage, and tile ``j`` holds request tokens
        ``[tiles[j] * block_size, ...)`` below ``num_tokens``, each read from block
        ``block_ids[t // src_block_size]`` at token ``t % src_block_size``. Rows past
        ``num_tokens`` are left as they were.
    groups : optional
        A request of several KV cache groups (:attr:`~kvtriton.plan.Segment.group`): the
        positions of each group among ``block_ids`` (the groups' ids concatenated in group
        order, e.g. ``RequestPayload.launch_groups(chunk)``); a segment of group ``g`` packs only
        its group's positions, tile ``j`` being the group's ``j``-th. One launch per group that
        has segments and positions, every one checked before the first runs.

    Returns
    -------
    torch.Tensor
        ``staging``. On CUDA the kernel is queued on the current stream and nothing waits for it.

    Raises
    ------
    LaunchError
        On any inconsistent argument (devices, dtypes, strides, indices, head ranges, geometry,
        block ids, staging too small or tiles overlapping); nothing is launched or written.

    Note
    ----
    ``staging`` must hold ``offsets[s] + n * segments[s].tile_bytes`` bytes for every ``s``, and
    the segments' staging ranges must not overlap. Block ids given on the CPU are range-checked
    here; ids already on a CUDA device are not (that would synchronise): the planner
    (:func:`~kvtriton.plan.compact_request`) checked them.

    Example
    -------
    >>> import torch
    >>> from kvtriton import Region, build_plan, ops
    >>> k = torch.randn(8, 16, 4, 64)                    # P rank 1 of TP2: heads 4-7 of 8, NHD
    >>> src = [Region.attention("l0", k, k.clone(), block_size=16, total_heads=8)]
    >>> kd = torch.zeros(8, 2, 16, 64)                   # D rank 3 of TP4: heads 6-7, HND
    >>> dst = [Region.attention("l0", kd, kd.clone(), layout="HND", block_size=16, total_heads=8)]
    >>> read = build_plan(3, 4, [d.spec for d in dst], 2, [s.spec for s in src]).staged[0]
    >>> ids = torch.tensor([5, 2])                       # 2 blocks x 2 streams x (16*2*64*4 B)
    >>> staging = torch.empty(read.payload_bytes(2), dtype=torch.uint8)
    >>> _ = ops.pack(src, read.segments, read.segment_offsets(2), ids, staging)
    >>> staging.numel()                                  # 2 blocks * 2 streams * 8 KiB
    32768
    """
    _run("pack", regions, segments, offsets, block_ids, staging, impl, pair_ids, tiles, num_tokens, groups)
    return staging


def unpack(
    regions: Sequence[Region],
    segments: Sequence[Segment],
    offsets: Sequence[int] | np.ndarray,
    block_ids: torch.Tensor | np.ndarray | Sequence[int],
    staging: torch.Tensor,
    *,
    impl: str = "auto",
    pair_ids: torch.Tensor | np.ndarray | Sequence[int] | None = None,
    tiles: np.ndarray | Sequence[int] | None = None,
    num_tokens: int | None = None,
    groups: Sequence[int] | None = None,
) -> None:
    """Scatter staged tiles into blocks ``block_ids`` of this rank's caches.

    The inverse of :func:`pack`: tile ``j`` of segment ``s`` (at byte ``offsets[s] + j *
    tile_bytes`` of ``staging``) lands in local block ``block_ids[j]``, heads ``[dst_head,
    dst_head + num_heads)`` of ``regions[region]``'s stream ``stream``. Segments from several
    source ranks (each a :class:`~kvtriton.plan.Payload` at its own staging offset) may be
    given together: with D < P one launch assembles each local block from all its sources.

    Parameters
    ----------
    regions : Sequence[Region]
        This rank's regions (shapes as in :func:`pack`), written in place.
    segments : Sequence[Segment]
        Segments to scatter; ``dst_layout`` must equal the local region's layout (tiles are
        staged in the destination's layout).
    offsets : Sequence[int] | np.ndarray
        ``[n_segments]`` byte offset of each segment's first tile in ``staging``.
    block_ids : torch.Tensor | np.ndarray | Sequence[int]
        ``[n]`` int32/int64 local block of each request position; ``-1`` skips the position
        and needs ``pair_ids``. Non-negative ids must be distinct (two tiles would race for one
        block).
    staging : torch.Tensor
        ``[staging_bytes]`` uint8, contiguous, on the regions' device: the received payloads.
        Tile ``j`` of segment ``s`` is ``[block_size, num_heads, head_dim]`` (NHD) or
        ``[num_heads, block_size, head_dim]`` (HND).
    impl : str
        ``"auto"``, ``"triton"`` or ``"torch"`` (``KVTRITON_IMPL`` overrides).
    pair_ids : optional
        ``[n]`` the source's ids for the same positions (what :func:`pack` got): a position
        either list skips is skipped. Required when ``block_ids`` (on the CPU) holds a -1.
    tiles, num_tokens : optional
        A token-mapped request (see :func:`pack`): ``block_ids`` is then the local block of
        each *destination position* (``TokenMap.dst_ids``), tile ``j`` lands in block
        ``block_ids[tiles[j]]``, and only its tokens below ``num_tokens`` are written.
    groups : optional
        A request of several KV cache groups, as in :func:`pack`.

    Raises
    ------
    LaunchError
        As :func:`pack`, plus: a tile layout other than the local one, repeated block ids (ids
        given on the CPU), or two segments writing the same heads of one stream.

    Note
    ----
    Only the listed heads of the listed blocks are written; every other cache byte keeps its
    value. On CUDA the kernel is queued on the current stream and nothing waits for it; ids
    already on the device are neither range- nor uniqueness-checked (see :func:`pack`).

    Example
    -------
    >>> import torch
    >>> from kvtriton import Region, build_plan, ops
    >>> kd = torch.zeros(8, 16, 2, 64)                   # D rank 0 of TP4 (heads 0-1 of 8), NHD
    >>> dst = [Region.attention("l0", kd, kd.clone(), block_size=16, total_heads=8)]
    >>> k = torch.randn(8, 16, 4, 64)                    # P TP2 rank 0 holds heads 0-3
    >>> src = [Region.attention("l0", k, k.clone(), block_size=16, total_heads=8)]
    >>> read = build_plan(0, 4, [d.spec for d in dst], 2, [s.spec for s in src]).staged[0]
    >>> staging = torch.empty(read.payload_bytes(1), dtype=torch.uint8)
    >>> offs = read.segment_offsets(1)
    >>> _ = ops.pack(src, read.segments, offs, [3], staging)     # P block 3 ...
    >>> ops.unpack(dst, read.segments, offs, [6], staging)       # ... -> D block 6
    >>> bool(torch.equal(kd[6], k[3, :, 0:2]))
    True
    """
    _run("unpack", regions, segments, offsets, block_ids, staging, impl, pair_ids, tiles, num_tokens, groups)
