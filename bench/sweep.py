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
quantiles), ``summary.md`` and ``descriptors.png`` (all written by bench/report.py).
Reproduce: ``make sweep`` (or ``.venv/bin/python bench/sweep.py [--quick]``).
"""

from __future__ import annotations

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

HERE = Path(__file__).resolve().parent
# the benchmarks are sibling scripts, each runnable on its own; put them on the path when the sweep
# is imported (tests) rather than run (python bench/sweep.py puts bench/ first by itself)
sys.path.insert(0, str(HERE))

from descriptors import descriptor_rows  # noqa: E402  bench/descriptors.py
from presets import BLOCK_SIZES, PRESETS, TOKENS, TP_PAIRS, Preset  # noqa: E402  bench/presets.py
from report import pd_vllm_table, print_table, write_outputs  # noqa: E402  bench/report.py

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - bench extra not installed
    def tqdm(it, **_):
        return it


# --------------------------------------------------------------------------- sections
# Each runner takes the parsed arguments, the chosen presets and the device, and returns the
# section's rows, each tagged with its ``section`` (bench/report.py groups the tables by it).
def _descriptors(args, presets, device) -> list[dict]:
    return descriptor_rows(tqdm(presets, desc="descriptors"), TP_PAIRS, BLOCK_SIZES, TOKENS)


def _kernels(args, presets, device) -> list[dict]:
    from block_sizes import kernel_rows  # bench/block_sizes.py: block-size changes vs equal sizes
    from kernel_speed import run_kernel_bench  # bench/kernel_speed.py

    cases = [(p.name, list(p.truncated(4 if args.quick else 8).regions), *_pair(p), 16, TOKENS // 16)
             for p in presets]
    rows = [{"section": "kernels", **r} for r in run_kernel_bench(cases, device, args.quick)]
    return rows + [{"section": "kernels", **r} for r in kernel_rows(device, args.quick)]


def _e2e(args, presets, device) -> list[dict]:
    from block_sizes import e2e_rows  # bench/block_sizes.py
    from e2e import run_e2e_matrix  # bench/e2e.py

    rows = [{"section": "e2e", **r} for r in run_e2e_matrix(quick=args.quick)]
    return rows + [{"section": "e2e", **r} for r in e2e_rows(quick=args.quick)]


def _costmodel(args, presets, device) -> list[dict]:
    from costgrid import run_costgrid  # bench/costgrid.py

    # the sweep times block sizes 16 and 128 (96 cells); --full-grid all of 16-128 (192 cells)
    return [{"section": "costmodel", **r} for r in run_costgrid(quick=not args.full_grid)]


def _planning(args, presets, device) -> list[dict]:
    from planning import planning_rows  # bench/planning.py

    return [{"section": "planning", **r} for r in planning_rows(quick=args.quick)]


def _rogue(args, presets, device) -> list[dict]:
    from rogue import run_rogue_bench  # bench/rogue.py

    return [{"section": "rogue", **r} for r in run_rogue_bench(quick=args.quick)]


def _pd_vllm(args, presets, device) -> list[dict]:
    return pd_vllm_rows(args.quick, args.pd_size)


#: section -> (needs NIXL, runner). They run in this order whatever order --sections names them;
#: a section that needs NIXL is left out when NIXL is not installed.
SECTIONS = {
    "descriptors": (False, _descriptors),
    "kernels": (False, _kernels),
    "e2e": (True, _e2e),
    "costmodel": (True, _costmodel),
    "planning": (False, _planning),
    "rogue": (True, _rogue),
    "pd_vllm": (False, _pd_vllm),
}


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    """Run the chosen sections, write sweep.csv, summary.md and descriptors.png, print a table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller payloads and fewer repetitions")
    ap.add_argument("--sections", default=",".join(SECTIONS))
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
    have_nixl = importlib.util.find_spec("nixl") is not None
    t0 = time.time()
    rows: list[dict] = []
    for name, (needs_nixl, run) in SECTIONS.items():
        if name in sections and (have_nixl or not needs_nixl):
            rows += run(args, presets, device)
    meta = dict(
        device=(torch.cuda.get_device_name() if device == "cuda"
                else f"cpu ({os.cpu_count()} cores, {platform.machine()})"),
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
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    results = pd_vllm.compare(**cfg, quiet=True, say=say)
    # a row per model kind: MLA (DeepSeek-V2) and the GQA target with an Eagle-3 MLA draft, small
    # (vLLM CPU's MLA is slow); NixlConnector where it runs
    for kind in ("deepseek", "llama+mla-draft"):
        results += pd_vllm.compare(**PD_SIZES["small"], model_kind=kind, quiet=True, say=say)
    print("\n".join(pd_vllm_table(results)), flush=True)
    model = (f"{cfg['layers']} layers, {cfg['kv_heads']} KV heads, head_dim {cfg['head_dim']}, "
             f"~{cfg['prompt_len']} tokens")
    rows = []
    for res in results:
        key = {"section": "pd_vllm", "connector": res["connector"], "prefill_tp": res["prefill_tp"],
               "decode_tp": res["decode_tp"], "pd_size": size, "model_kind": res.get("model_kind", "llama")}
        key["model"] = model if key["model_kind"] == "llama" else f"{key['model_kind']} (small: 2 layers, ~333 tokens)"
        if not res["rows"]:
            rows.append({**key, "summary": res["summary"]})
        rows += [{**key, **r, "summary": res["summary"]} for r in res["rows"]]
    return rows


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
