"""kvtriton's main job: how many descriptors a hetero-TP transfer needs, and how fast we move it.

Sections (all by default; ``--sections`` picks some):

* ``descriptors``: descriptors per decode rank for one request, kvtriton (staged + direct) against
  vLLM-style direct head-slice reads (K/V packed per block, and K/V as separate streams) and
  per-token slices, for every preset x TP pair x block size (pure planning, no data).
* ``kernels``: pack/unpack throughput (bytes read + written / time) of the Triton kernels, the
  torch reference, a naive element-per-lane Triton gather, against a plain copy of as many bytes
  on the same device (bench/kernels.py; on CPU only the torch and copy rows are speed
  measurements, Triton runs only under the interpreter).
* ``e2e``: one request end to end between processes over NIXL (bench/e2e.py), when NIXL is
  installed: over UCX shared memory and ``UCX_TLS=tcp``, each with an idle host and with a
  busy-loop neighbor process on the same cores (each configuration in fresh processes).
* ``costmodel``: the grid that proves the plan's STAGED/DIRECT choice (bench/costgrid.py): every
  feasible mode timed per (transport, P->D, heads per rank, block size, layout) against the mode
  the measured cost model chose.
* ``planning``: per-request planning cost in us for 1k- and 128k-token requests (bench/planning.py).
* both also get block-size-change rows (bench/block_sizes.py): P4->D8 at 16->64 and 64->16
  against the same transfer with equal block sizes.
* ``rogue``: a hostile peer with a genuine handshake against an honest request (9 scenarios)
  and a load run of 256 concurrent requests into 4 decode ranks with and without it
  (bench/rogue.py, ~25 s), when NIXL is installed.
* ``pd_vllm``: prefill and decode as real vLLM engines (bench/pd_vllm.py), kvtriton's connector
  and vLLM's own NixlConnector side by side, P2->D1 and P1->D2: time to KV loaded per request
  (ours/theirs), time to the first decode token, descriptors; a 16-layer, 8-KV-head model with
  2k-token prompts (``--pd-size``; ``--quick``: the 2-layer toy), ~11-13 min on 2 busy cores, when
  the vLLM test bed is built (``make vllm-bed``; ``.venv-vllm`` or ``$KVTRITON_VLLM_PYTHON``).

Writes ``bench/results/sweep.csv`` in long form (one row per measured quantity: the row's
parameters, ``metric``, ``unit``, and its ``p20``/``p50``/``p80``; counts have three equal
quantiles), ``summary.md`` and ``descriptors.png``.
Reproduce: ``make sweep`` (or ``.venv/bin/python bench/sweep.py [--quick]``).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baselines import per_token_descriptor_count, vllm_direct_descriptor_count  # noqa: E402
from presets import BLOCK_SIZES, PRESETS, TOKENS, TP_PAIRS, Preset, specs_for  # noqa: E402

from kvtriton.errors import KVTritonError  # noqa: E402
from kvtriton.plan import (  # noqa: E402
    build_plan,
    ceil_div,
    compact_request,
    direct_runs,
    staged_descriptor_count,
)

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - bench extra not installed
    def tqdm(it, **_):
        return it

CHUNK_BYTES = 64 << 20  # the default staging chunk the "chunked" column assumes


def fragmented_block_ids(n: int, num_blocks: int, run: int, seed: int) -> np.ndarray:
    """Block ids as a paged allocator hands them out after some churn: runs of ``run``
    consecutive blocks at shuffled places."""
    rng = np.random.default_rng(seed)
    starts = rng.permutation(num_blocks // run)[: ceil_div(n, run)] * run
    return (starts[:, None] + np.arange(run)[None, :]).reshape(-1)[:n]


# --------------------------------------------------------------------------- descriptors
def descriptor_rows(presets, pairs, block_sizes, tokens) -> list[dict]:
    rows = []
    for preset in presets:
        for bs in block_sizes:
            n = tokens // bs
            num_blocks = 4 * n
            src_ids = fragmented_block_ids(n, num_blocks, 8, seed=1)
            dst_ids = fragmented_block_ids(n, num_blocks, 8, seed=2)
            for p_tp, d_tp in pairs:
                row = dict(section="descriptors", preset=preset.name, p_tp=p_tp, d_tp=d_tp,
                           block_size=bs, tokens=tokens)
                try:
                    src = specs_for(preset, 0, p_tp, num_blocks, bs)
                    worst = None
                    for d in range(d_tp):
                        dst = specs_for(preset, d, d_tp, num_blocks, bs)
                        plan = build_plan(d, d_tp, dst, p_tp, src)
                        s, t = compact_request(src_ids, dst_ids, num_blocks, num_blocks)
                        runs = direct_runs(plan, src, dst, s, t)
                        k = max(1, len({x.src_rank for x in plan.staged}))
                        counts = dict(
                            kvtriton_staged=staged_descriptor_count(plan, n),
                            kvtriton_direct=len(runs),
                            kvtriton_staged_chunked=staged_descriptor_count(plan, n, CHUNK_BYTES),
                            vllm_kv_packed=vllm_direct_descriptor_count(k, preset.split_layers, n)
                            + vllm_direct_descriptor_count(1, preset.replicate_layers, n),
                            vllm_kv_separate=vllm_direct_descriptor_count(k, preset.split_layers, n, 2)
                            + vllm_direct_descriptor_count(1, preset.replicate_layers, n),
                            per_token=per_token_descriptor_count(k, preset.split_layers, tokens)
                            + vllm_direct_descriptor_count(1, preset.replicate_layers, n),
                        )
                        counts["kvtriton"] = counts["kvtriton_staged"] + counts["kvtriton_direct"]
                        if worst is None or counts["kvtriton"] > worst["kvtriton"]:
                            worst = counts
                    row.update(worst)
                    row["vllm_packed_per_kvtriton"] = round(worst["vllm_kv_packed"] / max(1, worst["kvtriton"]))
                    row["vllm_separate_per_kvtriton"] = round(worst["vllm_kv_separate"] / max(1, worst["kvtriton"]))
                except KVTritonError as e:
                    row["note"] = f"skipped: {e}"
                rows.append(row)
    return rows


# --------------------------------------------------------------------------- output
# Numeric keys that describe a row rather than measure something (they stay columns of every
# long-form row); every other number is a metric, with ``<metric>_p20``/``_p80`` beside it when
# it was timed.
PARAM_KEYS = {"p_tp", "d_tp", "block_size", "tokens", "bytes", "heads_per_rank", "prefill_tp", "decode_tp",
              "blocks", "layers", "request", "bytes_per_descriptor"}
UNITS = {"ms": "ms", "us": "us", "gbps": "GB/s", "pct_of_copy": "%", "ratio": "x"}


def long_rows(rows: list[dict]) -> list[dict]:
    """Wide in-memory rows -> one row per (row, metric) with p20/p50/p80."""
    out = []
    for r in rows:
        ids = {k: v for k, v in r.items() if _is_param(k, v) and v is not None}
        for k, v in r.items():
            if _is_param(k, v) or k.endswith(("_p20", "_p80")) or v is None or v == "":
                continue
            out.append(dict(ids, metric=k, unit=_unit(k), p20=r.get(f"{k}_p20", v), p50=v, p80=r.get(f"{k}_p80", v)))
    return out


def _is_param(k, v) -> bool:
    return k in PARAM_KEYS or (isinstance(v, (str, bool)) and v != "")


def _unit(metric: str) -> str:
    for suffix, unit in UNITS.items():
        if metric == suffix or metric.endswith("_" + suffix):
            return unit
    return "count"


def write_outputs(rows: list[dict], out_dir: Path, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tidy = long_rows(rows)
    keys: list[str] = []
    for r in tidy:
        keys += [k for k in r if k not in keys and k not in ("metric", "unit", "p20", "p50", "p80")]
    with open(out_dir / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + ["metric", "unit", "p20", "p50", "p80"] + list(meta))
        w.writeheader()
        for r in tidy:
            w.writerow({**r, **meta})
    lines = [f"# kvtriton sweep ({meta['device']}, {meta['timestamp']})", "",
             f"Reproduce: `{meta['command']}`. torch {meta['torch']}, git {meta['git_sha']}. Timings: median "
             "with [p20-p80] of repeated runs in one process; `sweep.csv` has every quantity in long form.", ""]
    desc = [r for r in rows if r["section"] == "descriptors"]
    if desc:
        lines += ["## Descriptors per decode rank (one request of "
                  f"{desc[0]['tokens']} tokens; worst decode rank)", "",
                  "kvtriton = staged (one per source->destination pair, unchunked) + direct "
                  "(coalesced block runs of REPLICATE regions); `chunked` = staged with 64 MiB "
                  "chunks. vLLM columns: direct head-slice reads; vLLM 0.33 keeps K and V together "
                  "per (head, token), so its count is one per (source, layer, block) (`vLLM K||V`, the "
                  "headline baseline); `K/V separate` counts K and V as two streams. Block ids come in "
                  "runs of 8 consecutive blocks. Modes come from the default CostModel (CPU, 2.3 us "
                  "per descriptor, 10 GB/s repack: whole-block SPLIT slices of >= ~11.5 KB go direct, "
                  "e.g. 8->16 with 8 heads at block 64).", "",
                  "| preset | P->D | block | kvtriton | staged | direct | staged, chunked | vLLM K\\|\\|V | vLLM K/V separate | per-token | **vLLM K\\|\\|V / kvtriton** | K/V separate / kvtriton |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in desc:
            if "note" in r:
                lines.append(f"| {r['preset']} | {r['p_tp']}->{r['d_tp']} | {r['block_size']} | "
                             f"{r['note']} ||||||||| ")
                continue
            lines.append(
                f"| {r['preset']} | {r['p_tp']}->{r['d_tp']} | {r['block_size']} | {r['kvtriton']:,} | "
                f"{r['kvtriton_staged']:,} | {r['kvtriton_direct']:,} | {r['kvtriton_staged_chunked']:,} | "
                f"{r['vllm_kv_packed']:,} | {r['vllm_kv_separate']:,} | {r['per_token']:,} | "
                f"**{r['vllm_packed_per_kvtriton']:,}x** | {r['vllm_separate_per_kvtriton']:,}x |")
        lines.append("")
    # block-size-change rows (bench/block_sizes.py) ride in the kernels and e2e sections, in a table of their own
    kern = [r for r in rows if r["section"] == "kernels" and "src_block" not in r]
    if kern:
        lines += _table("Pack/unpack throughput (GB/s = bytes read + written / time)", kern)
    e2e = [r for r in rows if r["section"] == "e2e" and "src_block" not in r]
    if e2e:
        lines += _e2e_summary(e2e)
    for sec, what in (("kernels", "pack/unpack alone"), ("e2e", "one request end to end over NIXL")):
        bs = [r for r in rows if r["section"] == sec and "src_block" in r]
        if bs:
            lines += _table(f"Block-size changes, {what} (against equal block sizes; goal <= 1.2x)", bs)
    grid = [r for r in rows if r["section"] == "costmodel"]
    if grid:
        lines += _costmodel_summary(grid)
    plan = [r for r in rows if r["section"] == "planning"]
    if plan:
        lines += _table("Planning cost per request (us; goal <= 50, flat in block count where the work allows)",
                        plan)
    rogue = [r for r in rows if r["section"] == "rogue"]
    if rogue:
        from rogue import summary_lines  # bench/rogue.py

        lines += summary_lines(rogue)
    pd = [r for r in rows if r["section"] == "pd_vllm"]
    if pd:
        lines += _pd_vllm_summary(pd)
    (out_dir / "summary.md").write_text("\n".join(lines))
    _plot(desc, out_dir / "descriptors.png")


def _fmt(r: dict, k: str) -> str:
    v = r.get(k, "")
    if f"{k}_p20" in r:
        return f"{v} [{r[k + '_p20']}-{r[k + '_p80']}]"
    return _cell(v)


def _cell(v) -> str:
    """A markdown table cell: pipes escaped (method names say K||V)."""
    return str(v).replace("|", "\\|")


def _table(title: str, sec: list[dict], drop=("section",)) -> list[str]:
    cols: list[str] = []
    for r in sec:
        cols += [k for k in r if k not in cols and k not in drop and not k.endswith(("_p20", "_p80"))]
    lines = [f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r, c) for c in cols) + " |" for r in sec]
    return lines + [""]


def _e2e_summary(rows: list[dict]) -> list[str]:
    """One table (and its ratios) per P->D pair of bench/e2e.py."""
    out: list[str] = []
    for pair in dict.fromkeys(r.get("pair", "p4d8") for r in rows):
        out += _e2e_pair_summary([r for r in rows if r.get("pair", "p4d8") == pair])
    return out


def _e2e_pair_summary(rows: list[dict]) -> list[str]:
    lines = ["## One request end to end over NIXL (2 processes on 127.0.0.1)", "",
             f"{rows[0].get('case', '')}. Each (transport, host) ran in its own processes; `busy` = one "
             "busy-loop neighbor process on the same 2 cores for the whole run. ms: median [p20-p80].", ""]
    def cfg(r):
        return r.get("transport"), r.get("host"), r.get("ids", "random")

    configs = list(dict.fromkeys(cfg(r) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "failed"))
    lines += ["| method | descriptors | " + " | ".join(f"{t}, {h}, {i} ids" for t, h, i in configs) + " |",
              "|---|---|" + "---|" * len(configs)]
    for m in methods:
        sel = {cfg(r): r for r in rows if r["method"] == m}
        d = ", ".join(dict.fromkeys(f"{r['descriptors']:,}" for r in sel.values()))  # runs coalesce
        lines.append(f"| {_cell(m)} | {d} | " + " | ".join(_fmt(sel[c], "ms") if c in sel else "" for c in configs) + " |")
    lines += ["", "Same-run ratios (median / median, lower is better for kvtriton):", ""]
    for t, h, ids in configs:
        sel = {r["method"]: r["ms"] for r in rows if cfg(r) == (t, h, ids) and "ms" in r}
        place = sel.get("kvtriton pack_place, pull, 1 chunk(s) x 1 in flight") or \
            sel.get("kvtriton read_unpack, pull, 1 chunk(s) x 1 in flight")
        place_eager = sel.get("kvtriton pack_place, pull eager, 1 chunk(s) x 1 in flight") or \
            sel.get("kvtriton read_unpack, pull eager, 1 chunk(s) x 1 in flight")
        one = "pack_place" if "kvtriton pack_place, pull, 1 chunk(s) x 1 in flight" in sel else "read_unpack"
        auto = sel.get("kvtriton auto, pull, 1 chunk(s) x 1 in flight")
        pull = sel.get("kvtriton staged, pull, 1 chunk(s) x 1 in flight")
        push = sel.get("kvtriton staged, push, 1 chunk(s) x 1 in flight")
        eager = sel.get("kvtriton staged, pull eager, 1 chunk(s) x 1 in flight")
        packed = sel.get("vLLM 0.33 direct 8 KiB K||V reads")
        sep = sel.get("direct 4 KiB reads, K/V separate")
        if None in (pull, push, packed, sep):
            fail = [r.get("note", "") for r in rows if cfg(r) == (t, h, ids)]
            lines.append(f"- {t}, {h}, {ids} ids: incomplete ({'; '.join(fail)[:200]})")
            continue
        lines.append(f"- {t}, {h}, {ids} ids: staged pull / vLLM K||V direct = **{pull / packed:.2f}**, staged push / vLLM "
                     f"K||V direct = **{push / packed:.2f}**"
                     + (f", staged pull eager (packed at hold) / vLLM K||V direct = **{eager / packed:.2f}**"
                        if eager else "") + f"; staged pull / K/V-separate direct = {pull / sep:.2f}, "
                     f"push / K/V-separate = {push / sep:.2f}; READ floor {sel.get('single descriptor READ (pull floor)')}"
                     f" ms, WRITE floor {sel.get('single descriptor WRITE (push floor)')} ms"
                     + (f"; {one} pull / vLLM K||V direct = **{place / packed:.2f}**, / staged pull = "
                        f"{place / pull:.2f}" if place else "")
                     + (f"; {one} eager / vLLM K||V direct = **{place_eager / packed:.2f}**, / staged eager = "
                        f"{place_eager / eager:.2f}" if place_eager and eager else "")
                     + (f"; auto / staged pull = {auto / pull:.2f}" if auto else ""))
    return lines + [""]


def _costmodel_summary(rows: list[dict]) -> list[str]:
    from costgrid import noise_line, summary_line, tie_line  # bench/costgrid.py

    lines = ["## Cost model: the plan's choice against every mode it could have chosen (bench/costgrid.py)", "",
             "One decode rank fetches one 8 MiB request (2,048 tokens, GQA head_dim 128 bf16, 8/heads layers, "
             "random block ids) through real agents over NIXL in one process, once per feasible mode; `chosen` is "
             "what build_plan picks with the model measured for this host and transport (kvtriton.costmodel). "
             "One-sided: read_unpack (P > D, no pack pass) or pack_place (D > P, no unpack pass), where feasible. "
             "ms: median [p20-p80].", "",
             "| transport | P->D | heads/rank | block | layout | B/descriptor | chosen | chosen ms | best | best ms "
             "| staged ms | direct ms | one-sided ms | chosen/best | verdict (hit, tie, miss beyond noise) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ratio" not in r:
            lines.append(f"| {r.get('transport')} | failed: {r.get('note', '')[:200]} ||||||||||||| ")
            continue
        lines.append(f"| {r['transport']} | {r['p_tp']}->{r['d_tp']} | {r['heads_per_rank']} | {r['block_size']} | "
                     f"{r['layout']} | {r['bytes_per_descriptor']:,} | {r['chosen']} | {_fmt(r, 'chosen_ms')} | "
                     f"{r['best']} | {_fmt(r, 'best_ms')} | {_fmt(r, 'staged_ms')} | {_fmt(r, 'direct_ms')} | "
                     f"{_fmt(r, 'read_unpack_ms') or _fmt(r, 'pack_place_ms')} | {r['ratio']:.2f} | "
                     f"{r.get('verdict', r.get('miss_beyond_noise', ''))} |")
    models = list(dict.fromkeys((r.get("transport"), r.get("note")) for r in rows if "ratio" in r))
    lines += [""] + [f"- {t}: {n}; {summary_line([r for r in rows if r.get('transport') == t])}; "
                     f"{noise_line([r for r in rows if r.get('transport') == t])}" for t, n in models]
    lines += ["", "The model is measured once per transport, at the start (every probe in the same rounds), on a "
              "machine other processes share; the cells are timed over the next minutes, each mode's runs rotating "
              "over warmed connections in interleaved rounds. Verdict: hit = the chosen mode has the lowest median; "
              "tie = another mode's median is lower but the spreads overlap (the chosen mode's p20 at or below its "
              "p80): a coin toss near the crossover that this run cannot call; miss = slower beyond that spread, "
              "what a better model could fix. The last line is the median-based ratio over every cell regardless.",
              ""]
    return lines + [noise_line(rows), "", tie_line(rows), "", summary_line(rows), ""]


def _plot(desc: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    rows = [r for r in desc if "note" not in r and r["block_size"] == 16]
    if not rows:
        return
    labels = [f"{r['preset']}\n{r['p_tp']}->{r['d_tp']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.55), 4.5))
    for i, (key, name) in enumerate([("kvtriton", "kvtriton"), ("vllm_kv_separate", "vLLM direct (K/V separate)"),
                                     ("per_token", "per-token slices")]):
        ax.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("descriptors per decode rank")
    ax.set_title(f"One {rows[0]['tokens']}-token request, block size 16", pad=28)
    ax.set_xticks(x, labels, rotation=90, fontsize=7)
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.02), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    desc = [r for r in rows if r["section"] == "descriptors" and "note" not in r]
    print(f"{'preset':<22}{'P->D':>7}{'blk':>5}{'kvtriton':>10}{'vLLM packed':>13}{'vLLM sep':>11}{'per-token':>12}")
    for r in desc:
        print(f"{r['preset']:<22}{str(r['p_tp']) + '->' + str(r['d_tp']):>7}{r['block_size']:>5}"
              f"{r['kvtriton']:>10,}{r['vllm_kv_packed']:>13,}{r['vllm_kv_separate']:>11,}{r['per_token']:>12,}")
    for r in rows:
        if r["section"] != "descriptors":
            fields = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("section", "note"))
            print(f"[{r['section']}] {fields}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller payloads and fewer repetitions")
    ap.add_argument("--sections", default="descriptors,kernels,e2e,costmodel,planning,rogue,pd_vllm")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--full-grid", action="store_true",
                    help="costmodel: every block size 16-128 (192 cells, ~2x the time) instead of 16 and 128")
    ap.add_argument("--pd-size", choices=sorted(PD_SIZES), default="scaled",
                    help="model and prompt size of the pd_vllm section (--quick: small)")
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    presets = [PRESETS[p] for p in args.presets.split(",")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    rows: list[dict] = []
    if "descriptors" in sections:
        rows += descriptor_rows(tqdm(presets, desc="descriptors"), TP_PAIRS, BLOCK_SIZES, TOKENS)
    if "kernels" in sections and (HERE / "kernels.py").exists():
        from kernels import run_kernel_bench  # bench/kernels.py

        cases = [(p.name, list(p.truncated(4 if args.quick else 8).regions), *_pair(p), 16, TOKENS // 16)
                 for p in presets]
        rows += [{"section": "kernels", **r} for r in run_kernel_bench(cases, device, args.quick)]
        from block_sizes import kernel_rows  # bench/block_sizes.py: block-size changes vs equal sizes

        rows += [{"section": "kernels", **r} for r in kernel_rows(device, args.quick)]
    have_nixl = importlib.util.find_spec("nixl") is not None
    if "e2e" in sections and have_nixl:
        from e2e import run_e2e_matrix  # bench/e2e.py

        rows += [{"section": "e2e", **r} for r in run_e2e_matrix(quick=args.quick)]
        from block_sizes import e2e_rows  # bench/block_sizes.py

        rows += [{"section": "e2e", **r} for r in e2e_rows(quick=args.quick)]
    if "costmodel" in sections and have_nixl:
        from costgrid import run_costgrid  # bench/costgrid.py

        # the sweep times block sizes 16 and 128 (96 cells); --full-grid all of 16-128 (192 cells)
        rows += [{"section": "costmodel", **r} for r in run_costgrid(quick=not args.full_grid)]
    if "planning" in sections:
        from planning import planning_rows  # bench/planning.py

        rows += [{"section": "planning", **r} for r in planning_rows(quick=args.quick)]
    if "rogue" in sections and have_nixl:
        from rogue import run_rogue_bench  # bench/rogue.py

        rows += [{"section": "rogue", **r} for r in run_rogue_bench(quick=args.quick)]
    if "pd_vllm" in sections:
        rows += pd_vllm_rows(args.quick, args.pd_size)
    meta = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores, {platform.machine()})",
        torch=torch.__version__, git_sha=_git_sha(),
        timestamp=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command="python bench/sweep.py" + (" --quick" if args.quick else "")
        + (f" --sections {args.sections}" if args.sections != ap.get_default("sections") else ""),
    )
    write_outputs(rows, Path(args.out), meta)
    print_table(rows)
    print(f"\nwrote {args.out}/sweep.csv, summary.md, descriptors.png in {time.time() - t0:.1f} s")
    return 0


#: model and prompt sizes of the pd_vllm section (bench/pd_vllm.py run() keywords). "scaled": enough
#: layers, heads and tokens that NixlConnector posts ~2k descriptors per request (P2->D1: 2 source
#: ranks x 16 layers x 64 blocks), what the 2-core CPU engines run in a few minutes; "large" (32
#: layers, 4k-token prompts, 8k descriptors) only on request (--pd-size large).
PD_SIZES = {
    "small": dict(layers=2, kv_heads=2, head_dim=32, prompt_len=333, prompts=3),
    # kvtriton's staging sized so a request's payload can be packed ahead of its pull (eager)
    "scaled": dict(layers=16, kv_heads=8, head_dim=64, hidden=256, prompt_len=2048, prompts=3, staging_mib=320),
    "large": dict(layers=32, kv_heads=8, head_dim=64, hidden=256, prompt_len=4096, prompts=3, staging_mib=640),
}


def pd_vllm_rows(quick: bool, size: str = "scaled") -> list[dict]:
    """Both connectors on the same engines and prompts, both TP directions (bench/pd_vllm.py)."""
    import pd_vllm  # bench/pd_vllm.py

    if pd_vllm.vllm_python() is None:
        print("pd_vllm: skipped, no vLLM test bed (make vllm-bed)")
        return []
    size = "small" if quick else size
    cfg = PD_SIZES[size]
    results = pd_vllm.compare(**cfg, quiet=True, say=lambda *a: print(*a, flush=True))
    print("\n".join(pd_vllm.comparison_table(results)), flush=True)
    model = (f"{cfg['layers']} layers, {cfg['kv_heads']} KV heads, head_dim {cfg['head_dim']}, "
             f"~{cfg['prompt_len']} tokens")
    rows = []
    for res in results:
        key = {"section": "pd_vllm", "connector": res["connector"], "prefill_tp": res["prefill_tp"],
               "decode_tp": res["decode_tp"], "pd_size": size, "model": model}
        if not res["rows"]:
            rows.append({**key, "summary": res["summary"]})
        rows += [{**key, **r, "summary": res["summary"]} for r in res["rows"]]
    return rows


def _pd_vllm_summary(rows: list[dict]) -> list[str]:
    import pd_vllm  # bench/pd_vllm.py

    lines = ["## Prefill/decode on real vLLM engines (bench/pd_vllm.py)", "",
             f"vLLM 0.32 CPU build, random-weight GQA Llama ({rows[0].get('model', '?')}, fp32, block 32), "
             "8 decode tokens, each engine on its own core. KV loaded = the decode worker's start_load_kv seeing "
             "the load (first rank) to get_transfer_results reporting it (last rank), measured the same way for "
             "both connectors; KV ready = request submitted to the scheduler learning it; first decode token = "
             "KV load + one decode step. Medians over the measured requests; the first request (handshake, "
             "first use) is a warm-up, shown on its own. Descriptors = READs the decode ranks posted per request.",
             ""]
    results = []
    for key in dict.fromkeys((r["connector"], r["prefill_tp"], r["decode_tp"]) for r in rows):
        sel = [r for r in rows if (r["connector"], r["prefill_tp"], r["decode_tp"]) == key]
        results.append({"connector": key[0], "prefill_tp": key[1], "decode_tp": key[2], "summary": sel[0]["summary"],
                        "rows": [r for r in sel if "ttft_ms" in r],
                        "ok": sum(bool(r.get("identical")) for r in sel), "n": sum("ttft_ms" in r for r in sel)})
    lines += pd_vllm.comparison_table(results)
    return lines + [""] + [f"    {r['summary']}" for r in results] + [""]


def _median_or_na(values) -> str:
    known = [v for v in values if v is not None and v != ""]
    return f"{int(np.median(known))}" if known else "n/a"


def _pair(preset: Preset) -> tuple[int, int]:
    return (4, 8) if preset.split_layers else (1, 2)


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
