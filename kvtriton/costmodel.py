"""Measure the planner's :class:`~kvtriton.plan.CostModel` on this host, transport and device.

:func:`~kvtriton.plan.build_plan` chooses STAGED or DIRECT per region from a few numbers (the
cost of one descriptor, pack and unpack bandwidth); this module measures them instead of assuming
them, and caches the result on disk per (host, transport, device) so a serving process pays the
~3 s measurement once. The planner stays pure: it is *given* a model (``build_plan(cost=...)``,
``TransferAgent(cost=...)``); nothing here is called by it.

What is measured, after a warm-up, all in the same rounds (at least ``reps``, more while a time
budget lasts, :data:`PROBE_BUDGET_S`; the order alternating; see :func:`_measure_rounds`), medians:

* ``read_gbps`` / ``write_gbps``: one descriptor of :data:`PROBE_BYTES` between two NIXL agents
  of this process over the transport UCX picks (``UCX_TLS`` is read when the first agent starts,
  so the transport is this process's);
* ``desc_us``: the slope of transfer time against descriptor count, the same bytes cut into
  each of :data:`PROBE_COUNTS` descriptors scattered on both sides over buffers larger than a
  CPU's last-level cache (:data:`PROBE_SPAN`), timed in interleaved rounds and fitted robustly
  (:func:`fit_desc_us`);
* ``pack_gbps`` / ``unpack_gbps``: :func:`kvtriton.ops.pack` / ``unpack`` (payload bytes / time,
  the ``impl`` the agent uses on ``device``) for a head-slice repack of that size between caches
  of the same layout (HND, one of two heads per block: whole-head tiles, as a zero-copy way's
  pieces are). Every choice the rates decide is a repack against a way that skips it (DIRECT,
  DIRECT_SLICE, or a pass of READ_UNPACK / PACK_PLACE), and those ways need both sides' bytes in
  the same order, so the repack they replace copies whole rows or tiles. The first probe timed an
  NHD -> HND relayout (256-byte rows gathered per token), 1.5-2x slower on this CPU than those
  copies: the model then took 4 KiB whole blocks DIRECT and NHD whole blocks READ_UNPACK where
  staging was faster, up to 1.24x (the full grid of issue 21). Like the descriptor probe's pieces,
  the repack's blocks are cold: caches :data:`PROBE_SPAN` times the payload, each call moving the
  next of that many disjoint block sets (:func:`probe_id_sets`), so no call finds its blocks in
  the last-level cache, as a request's blocks, written by the engine long before, are not. The
  warm probe (the same 24 MiB of blocks every call, inside this host's 32 MiB L3) timed the pack
  1.2-1.7x and the unpack 1.05-1.2x faster than cold (paired rounds, issue 36), while the
  descriptor side was measured cold: the crossover sat above the 4 KiB slices that direct reads
  won by 1.1-1.7x on this host (bench/costgrid.py's 4 KiB cells and bench/e2e.py's HND rows).

Why one set of rounds: the plan decides by a ratio (a descriptor's cost against a byte's repack
cost), and on a shared host the absolute numbers drift with load; probes run seconds apart (the
first version) saw different loads, e.g. a descriptor measured at 2.7 us under load against a
repack measured idle, which moved the crossover from ~5 to ~10 KiB and lost every 8 KiB cell of
the grid (bench/costgrid.py) by 1.1-1.5x. Why a slope: on tcp the one-descriptor time is bimodal
across runs (3.7 ms against 15 ms), and a difference of two medians taken at different moments
came out negative (clamped to 0.01 us per descriptor); the slope within a round does not see it.

Both engines must plan alike: the decode rank's model is the one that counts (it travels in
its handshake metadata and the source plans that rank's transfers with it).

Re-run: ``python -m kvtriton.costmodel --remeasure [--device cuda]`` (prints the model and the
cache file), or ``load_or_measure(remeasure=True)``. The cache directory is
``$KVTRITON_CACHE_DIR`` or ``~/.cache/kvtriton``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .plan import CostModel
from .plan.cost import UNMEASURED

__all__ = ["PROBE_BYTES", "PROBE_DESCRIPTORS", "PROBE_COUNTS", "transport_key", "cache_dir", "cache_path",
           "read_cache", "find_cached", "fit_desc_us", "fit_pass_us", "probe_id_sets", "measure", "load_or_measure"]

PROBE_BYTES = 8 << 20  # big enough that a post's fixed cost is noise, small enough for ~1 s
PROBE_DESCRIPTORS = 2048  # 4 KiB each: a vLLM-style head slice of a 16-token block
# the same bytes in this many descriptors: the plan's linear model is fitted where it is used (a
# request's thousands of descriptors); on tcp the cost is concave (here ~4.6 us each over the first
# 128, ~1.4 us each over 2,048: UCX pipelines them), so small counts would overstate it
PROBE_COUNTS = (1, PROBE_DESCRIPTORS // 2, PROBE_DESCRIPTORS)
#: the buffers the probe's pieces are scattered over, in PROBE_BYTES: larger than a CPU's last-level
#: cache (8 MiB of pieces over 32 MiB here; a 16 MiB L3 on this host), as a KV cache is
PROBE_SPAN = 4
PROBE_BUDGET_S = 3.0  # measurement rounds continue while this lasts (at least reps, at most MAX_ROUNDS)
MAX_ROUNDS = 60  # a load level lasts seconds here: rounds over the whole budget average several
DESC_US_FLOOR = 0.05  # a descriptor is never free: NIXL's own bookkeeping per entry
#: segments of the one-block passes that time a pass's fixed cost (1 and 4 regions, K and V); the
#: larger is the full probe's, so its fixed cost can be taken out of the byte rates
FIXED_SEGMENTS = (2, 8)
FIXED_US_FLOOR = 0.01  # the wire carries positive numbers only; a GPU's per-segment cost is ~0
# 2: desc_us is a fitted slope (version 1's difference could come out 0.01 on tcp); 3: same-layout repack probe;
# 4: a pass's fixed cost (pass_us, segment_us); 5: descriptors scattered on both sides (PROBE_SPAN);
# 6: the repack's blocks cold too (probe_id_sets)
CACHE_VERSION = 6


def transport_key() -> str:
    """The transport this process's NIXL agents will use, as a file-name-safe key."""
    tls = os.environ.get("UCX_TLS", "")
    return "ucx-" + ("".join(c if c.isalnum() else "_" for c in tls) if tls else "default")


def cache_dir() -> Path:
    """Where cached models live: ``$KVTRITON_CACHE_DIR/costmodel`` or ``~/.cache/kvtriton/costmodel``."""
    return Path(os.environ.get("KVTRITON_CACHE_DIR") or Path.home() / ".cache" / "kvtriton") / "costmodel"


def _host() -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in platform.node() or "host")


def cache_path(device: str = "cpu", transport: str | None = None) -> Path:
    """Where the model of this host, ``transport`` (default: this process's) and device lives.
    On a CPU the repack runs on torch's intra-op threads, so their count is part of the key (a
    model measured with 2 threads overstates a 1-thread process's repack bandwidth ~1.5x)."""
    import torch

    dev = f"{device}-t{torch.get_num_threads()}" if device == "cpu" else device
    return cache_dir() / f"{_host()}-{transport or transport_key()}-{dev}.json"


def read_cache(path: Path) -> CostModel | None:
    """The model cached in ``path``, ``None`` when it is missing, of another version, or does not
    parse (such a file is measured over, never trusted)."""
    try:
        d = json.loads(path.read_text())
        if d.get("version") == CACHE_VERSION:
            vals = {k: float(d.get(k, v) if k in UNMEASURED else d[k]) for k, v in CostModel().as_dict().items()}
            if all(np.isfinite(v) and v > 0 for v in vals.values()):
                return CostModel(**vals, source=f"cached {path}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def find_cached(device: str = "cpu", transport: str | None = None) -> tuple[CostModel, Path] | None:
    """The cached model of this host, ``transport`` and device, without importing torch and
    without measuring (``kvtriton plan``, ``kvtriton doctor``): the exact file when torch is
    already imported, else, on a CPU where the key holds torch's thread count, the newest file
    of any thread count. ``None`` when there is none that parses."""
    import sys

    if "torch" in sys.modules:
        path = cache_path(device, transport)
        model = read_cache(path)
        if model is not None:
            return model, path
    prefix = f"{_host()}-{transport or transport_key()}-{device}"
    try:
        found = [p for p in cache_dir().glob(f"{prefix}*.json")
                 if p.name == f"{prefix}.json" or (device == "cpu" and p.name[len(prefix):].startswith("-t"))]
    except OSError:
        return None
    for path in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True):
        model = read_cache(path)
        if model is not None:
            return model, path
    return None


def fit_desc_us(counts: Sequence[int], rounds_ms: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Per-descriptor cost from timings of the same bytes cut into ``counts`` descriptors.

    ``rounds_ms[r][i]`` is round ``r``'s time (ms) of the transfer in ``counts[i]`` pieces; a
    round times every count back to back, so a load burst or a slow connection that lasts a round
    shifts all of its points alike and leaves its slope alone. Each round's slope is the median of
    its pairwise slopes (Theil-Sen: one disturbed point cannot move it), and the estimate is the
    median over rounds. Returns ``(desc_us, spread_us)``: ``spread_us`` is half the p20-p80 range
    of the per-round slopes. Pure (unit-tested on synthetic timings); a slope that is not positive
    (no cost resolved) is returned as is and the caller decides.

    >>> round(fit_desc_us([1, 101], [[1.0, 1.2], [1.5, 1.7], [1.0, 9.0]])[0], 6)  # one outlier round
    2.0
    """
    c = np.asarray(counts, dtype=np.float64)
    t = np.asarray(rounds_ms, dtype=np.float64)
    if c.ndim != 1 or c.size < 2 or t.ndim != 2 or t.shape[1] != c.size or t.shape[0] < 1:
        raise ValueError(f"need >= 2 descriptor counts and rounds of one time per count; got counts {c.shape}, "
                         f"times {t.shape}")
    i, j = np.triu_indices(c.size, 1)
    keep = c[j] != c[i]
    i, j = i[keep], j[keep]
    per_round = np.median((t[:, j] - t[:, i]) / (c[j] - c[i]), axis=1) * 1e3  # ms -> us per descriptor
    lo, hi = np.quantile(per_round, [0.2, 0.8])
    return float(np.median(per_round)), float(hi - lo) / 2


@contextlib.contextmanager
def _transport_probe():
    """Two NIXL agents of this process with :data:`PROBE_SPAN` x :data:`PROBE_BYTES` registered on
    each: yields ``(read, write)``; ``read(k)`` times (ms) one READ of :data:`PROBE_BYTES` cut into
    ``PROBE_COUNTS[k]`` descriptors, ``write()`` one WRITE of them as one descriptor. The pieces
    lie at random distinct places on both sides (none merge), as a request's cache blocks do:
    pieces read in address order from a buffer the last-level cache holds cost ~30% less each
    than pieces scattered over a larger one (1.3 against 1.7 us on this CPU over UCX shared
    memory), and what the ways post is the latter."""
    import torch

    from .transport.nixl import NixlTransport, XferStatus

    tag = f"{os.getpid()}-{time.monotonic_ns() % 10**9}"
    a, b = NixlTransport(f"costmodel-a-{tag}"), NixlTransport(f"costmodel-b-{tag}")
    try:
        src = torch.randint(0, 256, (PROBE_SPAN * PROBE_BYTES,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        a.register(dst)
        b.register(src)
        peer = a.add_remote(b.metadata())
        b.add_remote(a.metadata())
        lists = []
        for count in PROBE_COUNTS:
            piece = PROBE_BYTES // count
            rng = np.random.default_rng(count)
            places = PROBE_SPAN * count  # piece-sized places in each buffer
            remote = np.stack([src.data_ptr() + rng.choice(places, count, replace=False) * piece,
                               np.full(count, piece), np.zeros(count, np.int64)], 1).astype(np.int64)
            local = remote.copy()
            local[:, 0] = dst.data_ptr() + rng.choice(places, count, replace=False) * piece
            lists.append((a.prep_local(local, "DRAM"), a.prep_remote(peer, remote, "DRAM"), np.arange(count)))

        def xfer(op, local, remote, idx) -> float:
            t0 = time.perf_counter()
            x = a.post(op, local, idx, remote, idx)
            deadline = time.monotonic() + 30
            while a.poll(x) is not XferStatus.DONE:
                b.poll_notifs()  # the passive side must be driven too (no progress thread)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cost model probe: {op} did not finish in 30 s")
            a.release(x)
            return (time.perf_counter() - t0) * 1e3

        yield (lambda k: xfer("READ", *lists[k])), (lambda: xfer("WRITE", *lists[0]))
    finally:
        a.close()
        b.close()


def _probe_regions(layers: int, num_blocks: int, block: int, heads: int, layout: str, gen, device: str) -> list:
    """``layers`` GQA regions of 2 KV heads in all (``heads`` of them local), head_dim 128, bf16,
    separate K and V filled with random bits: the caches the repack probe moves between. Built
    here rather than by ``kvtriton.testing`` (the library never imports its test support)."""
    import torch

    from .regions import Region

    def stream() -> torch.Tensor:
        inner = (block, heads, 128) if layout == "NHD" else (heads, block, 128)
        raw = torch.randint(0, 256, (num_blocks * block * heads * 128 * 2,), dtype=torch.uint8, generator=gen)
        return raw.view(torch.bfloat16).view(num_blocks, *inner).to(device)

    return [Region.attention(f"l{i}", stream(), stream(), layout=layout, block_size=block, total_heads=2)
            for i in range(layers)]


def probe_id_sets(n: int, sets: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(num_blocks, ids)``: ``ids[k]`` the ``k``-th of ``sets`` disjoint sets of ``n`` block ids,
    scattered at random over a cache of ``num_blocks = n * sets + 8`` blocks. A probe that moves
    set ``k % sets`` on its ``k``-th call touches each block once per ``sets`` calls, so with
    ``sets`` x the payload beyond the last-level cache every call finds its blocks cold.

    >>> nb, ids = probe_id_sets(3, 2)
    >>> nb, ids.shape, len(set(ids.ravel().tolist()))
    (14, (2, 3), 6)
    """
    num_blocks = n * sets + 8
    ids = np.random.default_rng(seed).permutation(num_blocks)[:n * sets].reshape(sets, n)
    return num_blocks, ids


def _repack_probe(device: str, impl: str):
    """``(pack, unpack, nbytes, fixed)``: ``pack``/``unpack`` each time (ms)
    :func:`kvtriton.ops.pack` / ``unpack`` of an HND 2-head source -> HND 1-head destination
    repack (block 16, bf16) of ``nbytes`` payload (same byte order: see the module docstring), each
    call over the next of :data:`PROBE_SPAN` disjoint block sets (cold blocks, :func:`probe_id_sets`);
    ``fixed`` maps ``(op, segments)`` to a timer of one block of that repack over ``segments``
    segments (:data:`FIXED_SEGMENTS`), whose bytes are noise next to the pass's fixed cost."""
    import torch

    from . import ops
    from .plan import build_plan

    layers, block = FIXED_SEGMENTS[-1] // 2, 16
    n = PROBE_BYTES // (layers * 2 * block * 128 * 2)
    num_blocks, src_sets = probe_id_sets(n, PROBE_SPAN, seed=0)
    _, dst_sets = probe_id_sets(n, PROBE_SPAN, seed=1)
    gen = torch.Generator().manual_seed(0)
    src = _probe_regions(layers, num_blocks, block, 2, "HND", gen, device)  # TP1: both heads
    dst = _probe_regions(layers, num_blocks, block, 1, "HND", gen, device)  # rank 0 of TP2: one head

    def payload(k: int):  # the first k regions' (K and V: 2k segments) payload of rank 0 of TP2 from TP1
        return build_plan(0, 2, [r.spec for r in dst[:k]], 1, [r.spec for r in src[:k]], modes="staged").staged[0]

    read = payload(layers)
    src_ids = [torch.as_tensor(ids, device=device) for ids in src_sets]
    dst_ids = [torch.as_tensor(ids, device=device) for ids in dst_sets]
    staging = torch.empty(read.payload_bytes(n), dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timer(op, regions, part, id_sets):
        offs = part.segment_offsets(int(id_sets[0].numel()))
        calls = [0]

        def fn() -> float:
            ids = id_sets[calls[0] % len(id_sets)]  # the next set: blocks no recent call touched
            calls[0] += 1
            t0 = time.perf_counter()
            getattr(ops, op)(regions, part.segments, offs, ids, staging, impl=impl)
            sync()
            return (time.perf_counter() - t0) * 1e3
        return fn

    fixed = {}
    for segments in FIXED_SEGMENTS:
        part = payload(segments // 2)
        fixed["pack", segments] = timer("pack", src[:segments // 2], part, [src_ids[0][:1]])
        fixed["unpack", segments] = timer("unpack", dst[:segments // 2], part, [dst_ids[0][:1]])
    return (timer("pack", src, read, src_ids), timer("unpack", dst, read, dst_ids), read.payload_bytes(n),
            fixed)


def fit_pass_us(segments: Sequence[int], rounds_ms: Sequence[Sequence[float]]) -> tuple[float, float]:
    """``(pass_us, segment_us)``: the fixed cost of a repack pass, per call and per segment, from
    one-block passes over ``segments[i]`` segments timed ``rounds_ms[r][i]`` ms in round ``r``:
    the line through the two counts of each round, medians over rounds. Pure; a value that is not
    positive (nothing resolved) is returned as is and the caller decides.

    >>> fit_pass_us([2, 8], [[0.1, 0.16], [0.1, 0.19], [0.1, 0.16]])
    (80.0, 10.0)
    """
    s = np.asarray(segments, dtype=np.float64)
    t = np.asarray(rounds_ms, dtype=np.float64) * 1e3  # us
    if s.shape != (2,) or s[0] == s[1] or t.ndim != 2 or t.shape[1] != 2 or t.shape[0] < 1:
        raise ValueError(f"need two segment counts and rounds of two times; got {s.shape}, {t.shape}")
    per_segment = (t[:, 1] - t[:, 0]) / (s[1] - s[0])
    per_pass = t[:, 0] - s[0] * per_segment
    return float(np.median(per_pass)), float(np.median(per_segment))


def _measure_rounds(device: str, impl: str, reps: int, budget_s: float) -> dict:
    """Every probe in the same rounds: each round READs the bytes as each descriptor count, WRITEs
    them once, packs and unpacks them, and packs and unpacks one block over each segment count,
    its order alternating between rounds. A load burst on a shared host then lands on all of them
    alike, so the ratios the plan decides by (a descriptor's cost against a byte's repack cost)
    hold even when the absolute numbers drift. At least ``reps`` rounds, more while ``budget_s``
    lasts, at most :data:`MAX_ROUNDS`."""
    pack, unpack, nbytes, fixed = _repack_probe(device, impl)
    with _transport_probe() as (read, write):
        steps = {("read", k): functools.partial(read, k) for k in range(len(PROBE_COUNTS))}
        steps.update({("write", 0): write, ("pack", 0): pack, ("unpack", 0): unpack})
        steps.update(fixed)  # (op, segments): the one-block passes
        order = list(steps)
        for fn in steps.values():
            fn()  # warm-up: connection wire-up, first touch of pages
        rows: list[dict] = []
        stop = time.monotonic() + budget_s
        while len(rows) < reps or (time.monotonic() < stop and len(rows) < MAX_ROUNDS):
            rows.append({step: steps[step]() for step in (order if len(rows) % 2 == 0 else order[::-1])})
    desc_us, spread = fit_desc_us(PROBE_COUNTS, [[r["read", k] for k in range(len(PROBE_COUNTS))] for r in rows])
    if desc_us <= 0:
        desc_us = spread  # nothing resolved above the noise: the spread bounds what a descriptor can cost
    # pack and unpack pay alike per call (validation, dispatch): one fit over both ops' rounds
    pass_us, segment_us = fit_pass_us(FIXED_SEGMENTS, [[r[op, s] for s in FIXED_SEGMENTS]
                                                       for r in rows for op in ("pack", "unpack")])
    pass_us, segment_us = max(pass_us, FIXED_US_FLOOR), max(segment_us, FIXED_US_FLOOR)
    med = {w: float(np.median([r[w, 0] for r in rows])) for w in ("write", "pack", "unpack")}
    # the byte rates net of the probe pass's own fixed cost (never below a quarter of the pass)
    fixed_ms = (pass_us + FIXED_SEGMENTS[-1] * segment_us) / 1e3
    net = {w: max(med[w] - fixed_ms, med[w] / 4) for w in ("pack", "unpack")}
    return dict(desc_us=max(desc_us, DESC_US_FLOOR),
                read_gbps=PROBE_BYTES / float(np.median([r["read", 0] for r in rows])) / 1e6,
                write_gbps=PROBE_BYTES / med["write"] / 1e6,
                pack_gbps=nbytes / net["pack"] / 1e6, unpack_gbps=nbytes / net["unpack"] / 1e6,
                pass_us=pass_us, segment_us=segment_us, rounds=len(rows))


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def measure(device: str = "cpu", impl: str = "auto", reps: int = 5, budget_s: float = PROBE_BUDGET_S) -> CostModel:
    """Measure a :class:`CostModel` now (a few seconds on a CPU; see the module docstring)."""
    m = _measure_rounds(device, impl, reps, budget_s)
    return CostModel(desc_us=round(m["desc_us"], 4), pack_gbps=round(m["pack_gbps"], 3),
                     unpack_gbps=round(m["unpack_gbps"], 3), read_gbps=round(m["read_gbps"], 3),
                     write_gbps=round(m["write_gbps"], 3), pass_us=round(m["pass_us"], 3),
                     segment_us=round(m["segment_us"], 3),
                     source=f"measured {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {transport_key()}, "
                            f"{device}, {_threads()} torch threads, {m['rounds']} rounds")


def load_or_measure(device: str = "cpu", impl: str = "auto", *, remeasure: bool = False,
                    path: Path | None = None) -> CostModel:
    """The cached model of this host, transport and device; measured (and cached) on first use or
    when ``remeasure``. A cache file that does not parse is measured over, not trusted."""
    path = path or cache_path(device)
    cached = None if remeasure else read_cache(path)
    if cached is not None:
        return cached
    model = measure(device, impl)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(dict(version=CACHE_VERSION, **model.as_dict(), source=model.source)))
        os.replace(tmp, path)  # atomic: concurrent processes never read half a file
    except OSError:
        pass  # a read-only home still gets a measured model, just not a cached one
    return model


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``python -m kvtriton.costmodel`` and ``kvtriton costmodel``."""
    ap.add_argument("--device", default="cpu", help="the device the repack runs on (cpu, cuda, cuda:1, ...)")
    ap.add_argument("--impl", default="auto", help="the repack implementation timed (auto, torch, triton)")
    ap.add_argument("--remeasure", action="store_true", help="measure again and overwrite the cache")


def run(args: argparse.Namespace) -> int:
    """Print the cached model (measured and cached first when there is none, or with
    ``--remeasure``) as JSON, with its crossover and cache file."""
    model = load_or_measure(args.device, args.impl, remeasure=args.remeasure)
    print(json.dumps(dict(model.as_dict(), crossover_bytes=round(model.crossover_bytes()), source=model.source,
                          cache=str(cache_path(args.device))), indent=1), file=getattr(args, "stdout", None))
    return 0


def main(argv=None) -> int:
    import sys

    ap = argparse.ArgumentParser(description="Measure (or show the cached) kvtriton cost model.")
    add_arguments(ap)
    args = ap.parse_args(argv)
    args.stdout = sys.stdout  # the JSON only: NIXL's INFO lines (printed to sys.stdout) go to stderr
    with contextlib.redirect_stdout(sys.stderr):
        return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
