"""Compile the pack and unpack kernels for sm_90 and check their global accesses are 16 bytes wide.

Needs Triton only (no GPU, no torch): it compiles the kernels of the package it is given, so it
runs from a bare checkout (``scripts/ptx_check.py`` hands it the checkout's ``kvtriton/kernels/``: the
small Triton-only venv ``make test`` builds for the oldest Triton we check, and a GPU machine
before anything is installed, ``bench/gpu_check.sh``) and from an installed kvtriton
(``kvtriton doctor`` hands it ``kvtriton.kernels``).

A dropped or misplaced alignment hint compiles fine and runs correctly, just at a fraction of the
bandwidth, which is why it is checked in the PTX. The geometry is ``ops.launch_config``'s for
256-byte rows (head_dim 128 bf16) on 16-byte aligned memory: int64 words, two per access.

:func:`check` returns one line per kernel (``name: N x op, ...``) and a status: 0 when every store
is 16 bytes wide and the only narrower loads are the per-program scalars (the table row and the
block id; in the token-mapped variant also the per-row block ids), 1 when not, 2 when this Triton
has no CUDA backend able to compile.
"""

from __future__ import annotations

import collections
import importlib
import re
from types import ModuleType

__all__ = ["WIDE", "accesses", "narrow", "check"]

BLOCK_R, BLOCK_W, VEC, ALIGN, NUM_WARPS = 32, 32, 2, 16, 4
WIDE = ("ld.global.v2.b64", "st.global.v2.b64")  # 16-byte accesses of int64 words


def accesses(kernels: ModuleType) -> tuple[dict[str, collections.Counter], int]:
    """``{kernel name: Counter of global load/store forms}`` in each kernel's sm_90 PTX, and how
    many scalar loads a program makes before its copy loop (the table row and the block id).
    ``kernels``: the kernel package (``kvtriton.kernels``, or a checkout's ``kernels``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pack = importlib.import_module(f"{kernels.__name__}.pack")._pack_kernel
    unpack = importlib.import_module(f"{kernels.__name__}.unpack")._unpack_kernel
    num_fields = importlib.import_module(f"{kernels.__name__}.segment_table").NUM_FIELDS

    found = {}
    for kernel in (pack, unpack):
        for token_map in (False, True):  # whole blocks; tokens remapped between block sizes
            sig = {"staging_ptr": "*i64", "seg_ptr": "*i64", "block_ids_ptr": "*i64", "tiles_ptr": "*i64",
                   "num_tokens": "i64", "TOKEN_MAP": "constexpr", "BLOCK_R": "constexpr", "BLOCK_W": "constexpr",
                   "VEC": "constexpr", "ALIGN": "constexpr"}
            consts = {"TOKEN_MAP": token_map, "BLOCK_R": BLOCK_R, "BLOCK_W": BLOCK_W, "VEC": VEC, "ALIGN": ALIGN}
            attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # what a launch on torch tensors passes
            src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS}).asm["ptx"]
            name = kernel.__name__ + ("[token map]" if token_map else "")
            found[name] = collections.Counter(re.findall(r"(?:ld|st)\.global[\w.]*", ptx))
    return found, num_fields + 1


def narrow(seen: collections.Counter, scalar_loads: int, token_map: bool = False) -> list[str]:
    """Why ``seen`` is not a 16-byte copy (empty when it is). A token-mapped kernel also loads
    one block id per row (a gather of 8-byte ids), so only its stores and its data loads count."""
    why = []
    if not all(seen[op] for op in WIDE):
        why.append(f"no {' / '.join(op for op in WIDE if not seen[op])}")
    stores = [op for op in seen if op.startswith("st.") and op != WIDE[1]]
    if stores:
        why.append(f"narrower stores {stores}")
    loads = sum(n for op, n in seen.items() if op.startswith("ld.") and op != WIDE[0])
    if loads > scalar_loads and not token_map:
        why.append(f"{loads} narrower loads, more than the {scalar_loads} per-program scalars")
    return why


def check(kernels: ModuleType) -> tuple[int, list[str]]:
    """``(status, lines)``: 0 every kernel copies in 16-byte accesses, 1 one does not, 2 this
    Triton cannot compile for CUDA here (no backend, or no ``ptxas``); the last line says which."""
    import triton

    try:
        import triton.backends.nvidia.compiler  # noqa: F401 - the CUDA backend, bundled with Triton's wheels
    except ImportError as e:
        return 2, [f"ptx_check: Triton {triton.__version__} has no CUDA backend here: {e}"]
    try:
        found, scalar_loads = accesses(kernels)
    except (RuntimeError, OSError) as e:  # compiling the PTX to a cubin needs the bundled ptxas
        if "ptxas" not in str(e):
            raise
        return 2, [f"ptx_check: Triton {triton.__version__} cannot run ptxas here: {str(e).splitlines()[0]}"]
    failed, lines = False, []
    for name, seen in found.items():
        why = narrow(seen, scalar_loads, token_map=name.endswith("[token map]"))
        failed |= bool(why)
        forms = ", ".join(f"{n} x {op}" for op, n in sorted(seen.items()))
        lines.append(f"{name}: {forms}" + (f"  NOT 16-byte: {'; '.join(why)}" if why else "  (16-byte)"))
    lines.append(f"ptx_check: Triton {triton.__version__}, sm_90: {'FAILED' if failed else 'ok'}")
    return (1 if failed else 0), lines
