"""kvtriton's main job: how many descriptors a hetero-TP transfer needs, and how fast we move it.

Sections (all by default; ``--sections`` picks some):

* ``descriptors``: descriptors per decode rank for one request, kvtriton (staged + direct) against
  vLLM-style direct head-slice reads (K/V packed per block, and K/V as separate streams) and
  per-token slices (bench/baselines.py), for every preset x TP pair x block size (pure planning,
  no data; bench/descriptors.py).
* ``kernels``: pack/unpack throughput (bytes read + written / time) of the Triton kernels, the
  torch reference, a naive element-per-lane Triton gather, against a plain copy of as many bytes
  on the same device (bench/kernel_speed.py; on CPU only the torch and copy rows are speed
  measurements, Triton runs only under the interpreter).
* ``e2e``: one request end to end between processes over NIXL (bench/e2e.py), when NIXL is
  installed: over UCX shared memory and ``UCX_TLS=tcp``, each with an idle host and with a
  busy-loop neighbor process on the same cores (each configuration in fresh processes), at block 16
  and (idle) at vLLM 0.34's default block 64 (``--full``: every configuration at 16, 32 and 64).
* ``costmodel``: the grid that proves the plan's STAGED/DIRECT choice (bench/costgrid.py): every
  feasible mode timed per (transport, P->D, heads per rank, block size, layout) against the mode
  the measured cost model chose.
* ``planning``: per-request planning cost in us for 1k- and 128k-token requests (bench/planning.py).
* both also get block-size-change rows (bench/block_sizes.py): P4->D8 at 16->64 and 64->16
  against the same transfer with equal block sizes.
* ``fetch_host``: the host time of one small zero-copy fetch (P2->D1, the three small models of
  ``pd_vllm``'s cells) in one process, kvtriton's ``fetch()`` to its result against the same READs
  posted raw over lists prepared once (bench/fetch_host.py, a few seconds), when NIXL is installed.
* ``rogue``: a hostile peer with a genuine handshake against an honest request (9 scenarios)
  and a load run of 256 concurrent requests into 4 decode ranks with and without it
  (bench/rogue.py, ~25 s), when NIXL is installed.
* ``security_cost``: one request end to end with ``register="staging"`` and ``integrity=True``
  against the default, same run, as ratios (bench/security_cost.py, ~1 min; ``--full``: 16 MiB,
  ~5 min), when NIXL is installed.
* ``faults``: 2 prefill x 2 decode engines in processes over NIXL under a stream of requests, a
  prefill rank then a decode rank SIGKILLed and restarted (bench/faults.py): only with ``--full``
  (TP2, ~2 min) or ``--sections faults`` (TP1, ~1.5 min, most of it starting processes: more than
  the default sweep's 5 minutes can hold), when NIXL is installed.
* ``pd_vllm``: prefill and decode as real vLLM engines (bench/pd_vllm.py), kvtriton's connector
  and vLLM's own NixlConnector side by side, P2->D1 and P1->D2: time to KV loaded per request
  (ours/theirs), time to the first decode token, descriptors; a 16-layer, 8-KV-head model with
  2k-token prompts (``--pd-size``; ``--quick``: the 2-layer toy), ~11-13 min on 2 busy cores, when
  the vLLM test bed is there (``.venv-vllm`` or ``$KVTRITON_VLLM_PYTHON``): ``make sweep`` builds it
  (``make vllm-bed``) beside ``.venv`` before the sweep starts, so its headline has the real-engine
  row on a fresh clone; run directly without it, the section says so and is left out. After the
  one-at-a-time requests, on the same engines, many requests of mixed lengths in flight
  (bench/pd_vllm_load.py): p50/p99 of time to KV loaded and TTFT, the decode's step time with
  loads waiting. The default sweep: the small model at blocks 16 and 64 (vLLM 0.34's default),
  one engine pair per block, 8 and 32 in flight; ``--full`` adds 16 requests at 20 req/s.
* ``pd_hybrid`` (``--full`` only): the hybrid matrix of issue 32 on real vLLM engines, each model
  kind (Gemma-3 sliding window, Nemotron-H Mamba2 with ``n_groups`` 2 and 1, Qwen3-Next GDN) at
  P1->D1, P2->D1, P1->D2 and P2->D3, kvtriton (tokens and every group's bytes checked) beside
  NixlConnector (tokens; dividing pairs only): descriptors, bytes, time to KV loaded (~30 engine
  pairs, the better part of an hour on 2 cores; one model: ``bench/pd_vllm.py --model``).

Sizes: by default every section runs at a smaller size, so the whole job takes a few minutes
on a 2-core machine (descriptors for every preset; kernels and e2e with fewer layers and
repetitions, e2e on P4->D8 with random ids over shared memory idle and busy; the quick cost-model
grid on shared memory; planning with fewer repetitions; the rogue scenarios and a 64-request
load run; pd_vllm on the 2-layer toy model at P2->D1); ``--full`` runs today's full sizes (every
e2e configuration, both grid transports, the 256-request load, pd_vllm scaled at P2->D1 and
P1->D2). Each section shows a progress bar (tqdm) on stderr.

Each section has a budget in the default sweep (:data:`BUDGET_S`, 300 s in all) and its process
tree's peak memory is sampled (bench/memory.py: PSS summed over the processes it started, and the
largest process's RSS; goal <= 4 GB): summary.md's section table shows both and names any section
over its budget or the memory goal (it still runs to the end: its rows are kept). ``descriptors``
also plans one request per pd_vllm model kind (llama, deepseek, llama+mla-draft: ours against
NixlConnector's count, no engines); ``pd_vllm --full`` runs the MLA kinds on engines too.

Writes ``bench/results/sweep.csv`` in long form (one row per measured quantity: the row's
parameters, ``metric``, ``unit``, and its ``p20``/``p50``/``p80``; counts have three equal
quantiles), ``summary.md`` (a six-line headline first) and ``descriptors.png`` (all written by
bench/report.py). Reproduce: ``make sweep`` (or ``.venv/bin/python bench/sweep.py [--full]``).
"""

from __future__ import annotations

if not __package__:  # `python bench/sweep.py`: run as `python -m bench.sweep` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import argparse
import datetime as _dt
import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.descriptors import descriptor_rows, model_kind_rows  # bench/descriptors.py
from bench.memory import PeakMemory  # bench/memory.py
from bench.presets import (  # bench/presets.py
    BLOCK_SIZES,
    PD_KIND_PAIRS,
    PD_MODEL_KINDS,
    PRESETS,
    TOKENS,
    TP_PAIRS,
    Preset,
)
from bench.report import load_table, pd_vllm_table, print_table, write_outputs  # bench/report.py

HERE = Path(__file__).resolve().parent

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - bench extra not installed
    class tqdm:  # type: ignore[no-redef]  # the same calls, no bar
        def __init__(self, *_, **__):
            pass

        def reset(self, total=None):
            pass

        def update(self, n=1):
            pass

        def set_postfix_str(self, s=""):
            pass

        def close(self):
            pass


class Bar:
    """A section's progress bar (tqdm on stderr): ``total(n)`` once the section knows its steps,
    ``step(what)`` as each one finishes (``what`` shows beside the bar)."""

    def __init__(self, name: str):
        self.bar = tqdm(total=1, desc=f"{name:<11}", unit="step", leave=True, dynamic_ncols=True)

    def total(self, n: int) -> None:
        self.bar.reset(total=max(1, n))

    def step(self, what: str = "") -> None:
        if what:
            self.bar.set_postfix_str(what[:48])
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


# --------------------------------------------------------------------------- sections
# Each runner takes the parsed arguments, the chosen presets, the device and its section's Bar,
# and returns the section's rows, each tagged with its ``section`` (bench/report.py groups the
# tables by it). ``args.full``: today's full sizes; else every section runs smaller.
def _descriptors(args, presets, device, bar) -> list[dict]:
    bar.total(len(presets) + 1)
    rows = []
    for p in presets:
        rows += descriptor_rows([p], TP_PAIRS, BLOCK_SIZES, TOKENS)
        bar.step(p.name)
    # a row per pd_vllm model kind (issue 19): planned, so in the default sweep without engines
    rows += model_kind_rows(PD_MODEL_KINDS, PD_KIND_PAIRS)
    bar.step("model kinds")
    return rows


def _kernels(args, presets, device, bar) -> list[dict]:
    from bench.block_sizes import kernel_rows  # bench/block_sizes.py: block-size changes vs equal sizes
    from bench.kernel_speed import run_kernel_bench  # bench/kernel_speed.py

    quick = not args.full
    cases = [(p.name, list(p.truncated(4 if quick else 8).regions), *_pair(p), 16, TOKENS // 16)
             for p in presets]
    bar.total(len(cases) + 1)
    rows = []
    for case in cases:
        rows += [{"section": "kernels", **r} for r in run_kernel_bench([case], device, quick)]
        bar.step(case[0])
    rows += [{"section": "kernels", **r} for r in kernel_rows(device, quick)]
    bar.step("block-size changes")
    return rows


#: e2e configurations of the default (smaller) sweep: P4->D8, random ids, shared memory idle and
#: with a busy neighbour (the cases the headline and issue 21's busy-host goal read); --full: all
E2E_SMALL = dict(pairs=("p4d8",), ids=("random",), configs=[("shm", None, 0), ("shm", None, 1)])
#: and the same request at vLLM 0.34's default block (64: its K||V reads of 32 KiB), idle host; --full
#: runs every configuration at blocks 16, 32 and 64
E2E_SMALL_BLOCKS = dict(pairs=("p4d8",), ids=("random",), configs=[("shm", None, 0)], blocks=(64,))
E2E_FULL_BLOCKS = (16, 32, 64)


def _e2e(args, presets, device, bar) -> list[dict]:
    from bench import e2e  # bench/e2e.py
    from bench.block_sizes import e2e_rows  # bench/block_sizes.py

    runs = [{"blocks": E2E_FULL_BLOCKS}] if args.full else [E2E_SMALL, E2E_SMALL_BLOCKS]
    bar.total(1 + sum(len(kw.get("pairs", e2e.PAIRS)) * len(kw.get("ids", e2e.IDS)) * len(kw.get("blocks", (16,)))
                      * len(kw.get("configs", e2e.CONFIGS)) for kw in runs))
    rows = [{"section": "e2e", **r} for kw in runs
            for r in e2e.run_e2e_matrix(quick=not args.full, progress=bar.step, **kw)]
    rows += [{"section": "e2e", **r} for r in e2e_rows(quick=not args.full)]
    bar.step("block-size changes")
    return rows


def _costmodel(args, presets, device, bar) -> list[dict]:
    from bench import costgrid  # bench/costgrid.py

    # default: the small grid (8 cells, shared memory); --full: the quick grid (48 cells per
    # transport, what the sweep ran before); --full-grid: every block size of 16-128
    size = "full" if args.full_grid else ("quick" if args.full else "small")
    bar.total(len(list(costgrid._cells(size))) * len(costgrid.GRID_TRANSPORTS[size]))
    return [{"section": "costmodel", "grid": size, **r}
            for r in costgrid.run_costgrid(size, progress=lambda line: bar.step(line.split(":")[0][9:]))]


def _planning(args, presets, device, bar) -> list[dict]:
    from bench.planning import planning_rows  # bench/planning.py

    rows = [{"section": "planning", **r} for r in planning_rows(quick=not args.full)]
    bar.step("planned")
    return rows


def _fetch_host(args, presets, device, bar) -> list[dict]:
    from bench.fetch_host import CASES, run_fetch_host  # bench/fetch_host.py

    bar.total(2 * len(CASES))
    reps = 40 if args.full else 15
    # warm caches (the figure), then each request after a 32 MiB copy, as a fetch after a
    # large READ or an engine's forward pass runs (bench/fetch_host.py --cold)
    return [{"section": "fetch_host", **r} for cold in (False, True)
            for r in run_fetch_host(reps, progress=bar.step, cold=cold)]


def _rogue(args, presets, device, bar) -> list[dict]:
    from bench import rogue  # bench/rogue.py

    bar.total(len(rogue.SCENARIOS) + rogue.load_runs(not args.full))
    return [{"section": "rogue", **r} for r in rogue.run_rogue_bench(quick=not args.full, progress=bar.step)]


def _security_cost(args, presets, device, bar) -> list[dict]:
    from bench.security_cost import run_security_cost  # bench/security_cost.py

    rows = run_security_cost() if args.full else run_security_cost(layers=2, tokens=512, reps=3)
    bar.step("timed")
    return rows


def _faults(args, presets, device, bar) -> list[dict]:
    from bench.faults import run_faults  # bench/faults.py

    bar.total(1)
    rows = [{"section": "faults", **r} for r in run_faults("default" if args.full else "small", say=lambda *a: None)]
    bar.step("killed and restarted")
    return rows


def _pd_vllm(args, presets, device, bar) -> list[dict]:
    return pd_vllm_rows(not args.full, args.pd_size, bar)


def _pd_hybrid(args, presets, device, bar) -> list[dict]:
    return pd_hybrid_rows(bar)


#: section -> (needs NIXL, runner). They run in this order whatever order --sections names them;
#: a section that needs NIXL is left out when NIXL is not installed.
SECTIONS = {
    "descriptors": (False, _descriptors),
    "kernels": (False, _kernels),
    "e2e": (True, _e2e),
    "costmodel": (True, _costmodel),
    "planning": (False, _planning),
    "fetch_host": (True, _fetch_host),
    "rogue": (True, _rogue),
    "security_cost": (True, _security_cost),
    "faults": (True, _faults),
    "pd_vllm": (False, _pd_vllm),
    "pd_hybrid": (False, _pd_hybrid),
}


#: seconds each section may take in the default sweep on a 2-core box (sum 300 s: the 5-minute
#: goal of issue 21); a section past its budget is not cut short (its rows would be lost) but
#: summary.md's section table says it ran over, by how much, so the total's cause is in plain view
#: sections only --full (or --sections naming them) runs: the fault bench starts and kills a dozen
#: agent processes (~80 s on a loaded 2-core host), more than the default sweep's 5 minutes can hold
FULL_ONLY = {"faults", "pd_hybrid"}

BUDGET_S = {"descriptors": 5, "kernels": 20, "e2e": 60, "costmodel": 40, "planning": 5, "fetch_host": 10,
            "rogue": 20, "security_cost": 15, "pd_vllm": 125}
#: peak memory every bench must stay under (issue 21: the quick grid once peaked at 10 GB)
MEMORY_GOAL_GB = 4.0


def section_row(name: str, seconds: float, memory: dict, full: bool) -> dict:
    """The sweep's own row for one section: wall time, its budget (default sweep only) and the
    peak memory of the section's process tree (bench/memory.py)."""
    budget = None if full else BUDGET_S.get(name)
    over = budget is not None and seconds > budget
    heavy = memory.get("tree_pss_gb") is not None and memory["tree_pss_gb"] > MEMORY_GOAL_GB
    notes = []
    if over:
        notes.append(f"over its budget by {seconds - budget:.0f} s")
    if heavy:
        notes.append(f"over the {MEMORY_GOAL_GB:g} GB goal")
    return {"section": "sweep", "part": name, "wall_s": round(seconds, 1), "budget_s": budget,
            "tree_pss_gb": memory.get("tree_pss_gb"), "largest_rss_gb": memory.get("largest_rss_gb"),
            "largest_process": memory.get("largest", ""), "within": "no" if (over or heavy) else "yes",
            "note": "; ".join(notes)}


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    """Run the chosen sections, write sweep.csv, summary.md and descriptors.png, print a table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true",
                    help="today's full sizes (~35 min on 2 cores); default: every section smaller (~3 min)")
    ap.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    ap.add_argument("--sections", default=None, help="comma-separated (default: every section; faults only with "
                    "--full)")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--full-grid", action="store_true",
                    help="costmodel: every block size 16-128 (192 cells) instead of the small or quick grid")
    ap.add_argument("--pd-size", choices=sorted(PD_SIZES), default="scaled",
                    help="model and prompt size of the pd_vllm section with --full (default sweep: small)")
    args = ap.parse_args(argv)
    sections = (set(args.sections.split(",")) if args.sections
                else set(SECTIONS) - (set() if args.full else FULL_ONLY))
    presets = [PRESETS[p] for p in args.presets.split(",")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    have_nixl = importlib.util.find_spec("nixl") is not None
    t0 = time.time()
    rows: list[dict] = []
    ran: dict[str, float] = {}
    for name, (needs_nixl, run) in SECTIONS.items():
        if name in sections and (have_nixl or not needs_nixl):
            t1, bar = time.time(), Bar(name)
            with PeakMemory() as mem:
                try:
                    rows += run(args, presets, device, bar)
                finally:
                    bar.close()
            ran[name] = round(time.time() - t1, 1)
            rows.append(section_row(name, ran[name], mem.figures(), args.full))
    meta = dict(
        device=(torch.cuda.get_device_name() if device == "cuda"
                else f"cpu ({os.cpu_count()} cores, {platform.machine()})"),
        torch=torch.__version__, git_sha=_git_sha(),
        timestamp=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command="python bench/sweep.py" + (" --full" if args.full else "") + (" --full-grid" if args.full_grid else "")
        + (f" --sections {args.sections}" if args.sections else ""),
    )
    meta["wall_s"] = f"{time.time() - t0:.0f}"
    meta["section_s"] = ", ".join(f"{k} {v:.0f} s" for k, v in ran.items())
    meta["load_avg"] = " ".join(f"{x:.1f}" for x in os.getloadavg())  # the box is shared: how busy it was
    write_outputs(rows, Path(args.out), meta)
    print_table(rows)
    print(f"\nwrote {args.out}/sweep.csv, summary.md, descriptors.png in {time.time() - t0:.1f} s")
    return 0


#: model and prompt sizes of the pd_vllm section (bench/pd_vllm.py run() keywords). "scaled": enough
#: layers, heads and tokens that NixlConnector posts ~2k descriptors per request (P2->D1: 2 source
#: ranks x 16 layers x 64 blocks), what the 2-core CPU engines run in a few minutes; "large" (32
#: layers, 4k-token prompts, 8k descriptors) only on request (--pd-size large).
PD_SIZES = {
    # 16 prompts: a small request loads in 1-15 ms, one or two engine steps whichever connector, so
    # the median of 3 moved 3x between quiet runs (the Llama with an MLA draft, issue 21), and
    # NixlConnector's loads there are bimodal (~1 ms or 7-15 ms a load): a median of 8 landed on
    # either mode (DeepSeek's cell 1.24x in one run, 0.61x in the next); a request costs ~0.1 s here
    "small": dict(layers=2, kv_heads=2, head_dim=32, prompt_len=333, prompts=16),
    # kvtriton's staging sized so one request's payload can be packed ahead of its pull (eager;
    # the requests run one at a time): 136 MB from the one prefill rank at P1->D2
    "scaled": dict(layers=16, kv_heads=8, head_dim=64, hidden=256, prompt_len=2048, prompts=3, staging_mib=160),
    "large": dict(layers=32, kv_heads=8, head_dim=64, hidden=256, prompt_len=4096, prompts=3, staging_mib=576),
}

#: --full also runs this geometry (issue 21): Llama-70B's head_dim 128 with one KV head per decode
#: rank at P1->D2, NixlConnector's one READ per (source rank, layer, block) then moving one head's
#: K||V: 32 KiB at the CPU build's smallest block (32 tokens) in fp32, against 8 KiB on a GPU at
#: block 16 in bf16 (the small model's READs are 8 KiB: 32 tokens x 32 dims x 2 x fp32)
PD_REALISTIC = dict(layers=16, kv_heads=2, head_dim=128, prompt_len=2048, prompts=3, staging_mib=128)
PD_REALISTIC_KIND = "llama hd128"


#: TP pairs of the pd_vllm section: the default sweep runs P2->D1 (the cell issue 21 is about)
PD_PAIRS_SMALL = ((2, 1),)
#: the default sweep's real-engine blocks: 16 (vLLM 0.33 and before) and vLLM 0.34's default (64), what
#: users run now; one engine pair each (~60 s a block on a quiet 2-core host)
PD_BLOCKS_SMALL = (16, 64)
#: many requests in flight on the same engines, after the one-at-a-time requests (bench/pd_vllm_load.py):
#: the default sweep 8 and 32 at once, three runs of each, alternated (seconds on the small model: the
#: engines' start-up is the cost); the headline takes each connector's median run of a cell, as one
#: run was a lottery on this host (one 0.5 s stall of either connector's READs decided a cell: 81x,
#: 0.01x); the table shows every run. --full adds 16 requests at a steady 20 req/s, and runs the
#: small model at blocks 16 and 64
PD_LOAD_RUNS = 3
PD_LOAD_SMALL = dict(concurrency=(8, 32) * PD_LOAD_RUNS)
PD_LOAD_FULL = dict(concurrency=(8, 32) * PD_LOAD_RUNS, rate=20.0, rate_count=16)
PD_LOAD_BLOCKS_FULL = (16, 64)


def pd_vllm_rows(quick: bool, size: str = "scaled", bar=None) -> list[dict]:
    """Both connectors on the same engines and prompts (bench/pd_vllm.py): ``quick``, the small
    model at P2->D1; else ``size`` at P2->D1 and P1->D2."""
    from bench import pd_vllm  # bench/pd_vllm.py

    if pd_vllm.vllm_python() is None:
        print("pd_vllm: skipped, no vLLM test bed (`make vllm-bed` builds it; `make sweep` does first)")
        return []
    from bench.pd_vllm_load import cells_from  # bench/pd_vllm_load.py

    size = "small" if quick else size
    pairs = PD_PAIRS_SMALL if quick else pd_vllm.PAIRS
    cfg = PD_SIZES[size]
    if quick:
        cfg = {**cfg, "load_cells": cells_from(**PD_LOAD_SMALL)}
    if bar is not None:
        bar.total(2 * len(pairs) * (len(PD_BLOCKS_SMALL) if quick else 1)
                  + (0 if quick else 2 * len(pairs) + 4 + 2 * len(PD_LOAD_BLOCKS_FULL)))

    def say(*a):
        print(*a, flush=True)
        line = str(a[0]) if a else ""
        if bar is not None and line.startswith("pd_vllm: ") and ("token-identical" in line or ": failed (" in line):
            bar.step(line.split(";")[-1].strip())  # a (pair, connector) finished: its summary line

    # the larger models one run at a time: two runs' engines at once took 5.4 GB
    if quick:  # the small model at each block, one engine pair per block
        results = [res for block in PD_BLOCKS_SMALL
                   for res in pd_vllm.compare(pairs, **cfg, block_size=block, quiet=True, say=say, overlap=True)]
    else:
        results = pd_vllm.compare(pairs, **cfg, quiet=True, say=say, overlap=False)
    if not quick:  # --full: the realistic descriptor size, then a row per model kind
        for res in pd_vllm.compare(pairs, **PD_REALISTIC, quiet=True, say=say, overlap=False):
            results.append({**res, "model_kind": PD_REALISTIC_KIND})
    if not quick:  # the small size (vLLM CPU's MLA is slow); NixlConnector where it runs
        for kind in ("deepseek", "llama+mla-draft"):
            results += pd_vllm.compare(PD_PAIRS_SMALL, **PD_SIZES["small"], model_kind=kind, quiet=True, say=say)
    if not quick:  # issue 36: many requests in flight at block 16 and vLLM 0.34's 64, the small model
        for block in PD_LOAD_BLOCKS_FULL:
            for res in pd_vllm.compare(PD_PAIRS_SMALL, **PD_SIZES["small"], block_size=block, quiet=True, say=say,
                                       load_cells=cells_from(**PD_LOAD_FULL)):
                results.append({**res, "model_kind": f"llama block {block}"})
    print("\n".join(pd_vllm_table(results)), flush=True)
    if any(r.get("load") for r in results):
        print("\n".join(load_table(results)), flush=True)
    model = (f"{cfg['layers']} layers, {cfg['kv_heads']} KV heads, head_dim {cfg['head_dim']}, "
             f"~{cfg['prompt_len']} tokens")
    rows = []
    for res in results:
        key = {"section": "pd_vllm", "connector": res["connector"], "prefill_tp": res["prefill_tp"],
               "decode_tp": res["decode_tp"], "pd_size": size, "model_kind": res.get("model_kind", "llama"),
               "block_size": res.get("block_size")}
        key["model"] = {"llama": model,
                        PD_REALISTIC_KIND: (f"{PD_REALISTIC['layers']} layers, {PD_REALISTIC['kv_heads']} KV heads, "
                                            f"head_dim {PD_REALISTIC['head_dim']}, ~{PD_REALISTIC['prompt_len']} "
                                            f"tokens")}.get(key["model_kind"],
                                                            f"{key['model_kind']} (small: 2 layers, ~333 tokens)")
        if not res["rows"]:
            rows.append({**key, "summary": res["summary"]})
        rows += [{**r, **key, "summary": res["summary"]} for r in res["rows"]]  # key's model_kind wins
        rows += [load_row(key, c) for c in res.get("load") or ()]
    return rows


def load_row(key: dict, cell: dict) -> dict:
    """One load cell (bench/pd_vllm_load.py) as a pd_vllm row: its figures, none of the
    one-at-a-time rows' keys (``ttft_ms``, ``identical``...), so those tables and medians skip it."""
    figures = {k: v for k, v in cell.items() if k.endswith(("_p50", "_p99")) or k.startswith("step")}
    return {**key, "load_cell": f"{cell['in_flight']} in flight" if cell.get("rate") is None
            else f"{cell['in_flight']} at {cell['rate']:g} req/s",
            "in_flight": cell["in_flight"], "rate": cell.get("rate"), "repeat": cell.get("repeat") or 0,
            "load_ok": cell["ok"], "load_n": cell["n"], "load_recomputed": cell["recomputed"], **figures,
            "summary": cell["summary"]}


#: the hybrid matrix of issue 32 (--full): every model kind at these P->D pairs, both connectors;
#: NixlConnector moves Mamba/GDN state only between TP sizes that divide (P2->D3 is ours alone)
HYBRID_PAIRS = ((1, 1), (2, 1), (1, 2), (2, 3))


def pd_hybrid_rows(bar=None) -> list[dict]:
    """Each hybrid model kind (bench/pd_vllm.py ``--model``: sliding window, Mamba2 with
    ``n_groups`` 2 and 1, Gated DeltaNet) at :data:`HYBRID_PAIRS` through kvtriton (tokens,
    every group's bytes checked) and NixlConnector (tokens) on the same prompts: descriptors,
    bytes and time to KV loaded side by side. A run that fails is a row saying why."""
    from bench import pd_vllm  # bench/pd_vllm.py

    if pd_vllm.vllm_python() is None:
        print("pd_hybrid: skipped, no vLLM test bed (`make vllm-bed` builds it)")
        return []
    cells = [(m, p, d, c) for m in pd_vllm.HYBRID_MODELS for p, d in HYBRID_PAIRS for c in ("kvtriton", "nixl")
             if c == "kvtriton" or (max(p, d) % min(p, d) == 0)]
    if bar is not None:
        bar.total(len(cells))
    rows = []
    for model, p, d, connector in cells:
        key = {"section": "pd_hybrid", "model": model, "connector": connector, "prefill_tp": p, "decode_tp": d}
        try:
            row = pd_vllm.run_hybrid(connector, p, d, model=model, say=lambda *a: print(*a, flush=True))
            rows.append({**row, **key})
        except Exception as e:  # one cell's failure is a row, the matrix goes on
            rows.append({**key, "summary": f"{model} {connector} P{p}->D{d}: failed ({type(e).__name__}: {e})"})
        if bar is not None:
            bar.step(f"{model} {connector} P{p}->D{d}")
    return rows


def _pair(preset: Preset) -> tuple[int, int]:
    return (4, 8) if preset.split_layers else (1, 2)


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
