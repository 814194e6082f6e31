"""SGLang's real disaggregation classes with the ``kvtriton`` backend, every TP pair of the matrix.

Runs :mod:`beds.sglang_bed`'s pair cases (``P-D``: the prefill and decode ranks as processes
holding SGLang's real pools and metadata buffers, SGLang's bootstrap server, the manager, sender
and receiver ``get_kv_class`` returns, over real NIXL) in the SGLang test bed's interpreter
(``make sglang-bed``), each checked by the oracles CI checks the 2-3 pair with
(:func:`beds.sglang_bed.pair_problems`: a control before the first transfer, every byte of the
decode pages and every metadata row against the reference, the abort on both sides, no leak).
CI (``tests/engines/test_sglang_conformance.py``) keeps 2-3 only: the 1-2 and 2-1 pairs repeat
what ``tests/engines/test_sglang_servers.py`` runs end to end on real servers, and the split and
merge that 2-3 does at once.

One line per pair (``sglang_pairs: 1-2 ok: 5 rooms, N bytes checked, 41 s``); exit status 1 if a
pair fails its oracles or does not run. From the repository root, with kvtriton's venv::

    .venv/bin/python bench/sglang_pairs.py                 # 1-2, 2-1 and 2-3
    .venv/bin/python bench/sglang_pairs.py --pairs 1-2 --json out.json
"""

from __future__ import annotations

if not __package__:  # `python bench/sglang_pairs.py`: run as `python -m bench.sglang_pairs` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from beds import child_env
from beds.sglang_bed import CASES, MODEL_CONFIG, pair_problems
from beds.vllm_bed import free_port_range

ROOT = Path(__file__).resolve().parents[1]
PAIRS = tuple(c for c in CASES if c[0].isdigit())


def run_pair(python: str, pair: str, timeout_s: float = 2400) -> dict:
    """One pair case in the bed; its result with ``problems`` (empty: every oracle held) and
    ``seconds``."""
    with tempfile.TemporaryDirectory(prefix=f"sglang-pair-{pair}-") as model:
        (Path(model) / "config.json").write_text(json.dumps(MODEL_CONFIG))
        t0 = time.monotonic()
        res = subprocess.run([python, "-m", "beds.sglang_bed", pair, "--base-port", str(free_port_range(60)),
                              "--model", model], env=child_env(), capture_output=True, text=True, timeout=timeout_s)
        seconds = time.monotonic() - t0
    if res.returncode != 0:
        return {"case": pair, "seconds": seconds, "problems": [f"exit {res.returncode}: {res.stderr[-3000:]}"]}
    got = json.loads(res.stdout.strip().splitlines()[-1])
    return {**got, "seconds": seconds, "problems": pair_problems(got)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of {', '.join(PAIRS)}")
    bed = os.environ.get("KVTRITON_SGLANG_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")
    ap.add_argument("--python", default=bed,
                    help="the SGLang bed's interpreter (default: $KVTRITON_SGLANG_PYTHON, else .venv-sglang)")
    ap.add_argument("--json", help="write every pair's result here")
    a = ap.parse_args(argv)
    pairs = [p for p in a.pairs.split(",") if p]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        ap.error(f"unknown pairs {unknown}: one of {PAIRS}")
    if not Path(a.python).exists():
        print(f"sglang_pairs: no SGLang bed at {a.python} (`make sglang-bed` builds it)")
        return 1
    results = []
    for pair in pairs:
        r = run_pair(a.python, pair)
        results.append(r)
        if r["problems"]:
            print(f"sglang_pairs: {pair} FAILED in {r['seconds']:.0f} s: " + "; ".join(r["problems"]), flush=True)
        else:
            rooms = r["rooms"] + [r["after_abort"]]
            print(f"sglang_pairs: {pair} ok: {len(rooms)} rooms and an abort, "
                  f"{sum(x['bytes_checked'] for x in rooms)} bytes checked, {r['seconds']:.0f} s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
