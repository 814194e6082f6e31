"""Timing for every bench section: p20/p50/p80 of repeated runs, in milliseconds.

On CUDA :func:`quantiles_ms` is ``triton.testing.do_bench`` with ``quantiles=[0.2, 0.5, 0.8]``
(it flushes L2 and syncs around each run); on CPU it is ``time.perf_counter`` around each call
after one warm-up call (first touch of pages), quantiles by linear interpolation. Why quantiles:
this 2-core machine is shared, and one median hides whether a ratio held across the runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

QUANTILES = (0.2, 0.5, 0.8)
Q = tuple[float, float, float]


def quantiles_of(samples_ms: Sequence[float]) -> Q:
    """p20, p50, p80 of ``samples_ms`` (one sample gives it three times)."""
    a = np.asarray(samples_ms, dtype=np.float64)
    return tuple(float(x) for x in np.quantile(a, QUANTILES))  # type: ignore[return-value]


def quantiles_ms(fn: Callable[[], object], reps: int, device: str = "cpu", warmup: int = 1) -> Q:
    """p20/p50/p80 in ms of ``reps`` calls of ``fn`` (on CUDA: ``do_bench``'s, ``reps`` ignored)."""
    if device == "cuda":
        import triton

        q = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=list(QUANTILES))
        return tuple(float(x) for x in q)  # type: ignore[return-value]
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return quantiles_of(ts)


def qfields(name: str, q: Q, digits: int = 3) -> dict:
    """``{name: p50, name_p20: p20, name_p80: p80}``: a row's timing in the sweep's convention
    (the bare name is the median, so summaries and ratios read it directly)."""
    return {name: round(q[1], digits), f"{name}_p20": round(q[0], digits), f"{name}_p80": round(q[2], digits)}
