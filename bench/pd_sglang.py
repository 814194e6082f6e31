"""Prefill/decode disaggregation on real SGLang servers: kvtriton's backend or SGLang's own nixl.

Starts a plain server (the reference), then a prefill server and a decode server (SGLang 0.5.23 on
CPU, the test bed from ``make sglang-bed``; :mod:`beds.sglang_servers`) with
``--disaggregation-transfer-backend BACKEND`` on the bed's tiny Llama, and posts each prompt as
SGLang's router does (one body to both servers, one bootstrap room per request), one request at a
time. Per request it reports:

* ``kv_loaded_ms``: the prefill's last ``send()`` of the request (its KV is computed) to the last
  decode rank's receiver polling ``Success`` (the same hooks for any backend:
  :mod:`beds.sglang_hooks`; wall clocks of one host);
* ``receiver_ms``: the first decode receiver made to the last one done (includes the prefill);
* ``descriptors``: descriptors handed to NIXL by both servers' ranks for the request (counted at
  NIXL's ``initialize_xfer``/``make_prepped_xfer``, so any backend is counted alike) and, for
  kvtriton, ``agent_descriptors`` from the agents' own stats (staged + direct + one-sided);
* ``sglang_nixl_formula``: what SGLang's nixl backend posts for it by its own code (one
  descriptor per (layer, K/V, token of each page) per prefill->decode rank pair, whole pages:
  ``sglang/srt/disaggregation/nixl/conn.py`` ``_slice_page_indices_to_dlist``), reported beside
  the measurement because that backend does not start on a CPU (below);
* ``identical``: decode tokens equal to the plain server's.

SGLang's nixl backend on this CPU: its managers register the KV pool as NIXL ``VRAM``
(``nixl/conn.py:206`` defaults every pool to VRAM; ``register_buffer_to_engine``,
``nixl/conn.py:1992``), which UCX refuses without CUDA ("VRAM memory is detected as host by UCX"),
so the prefill's scheduler dies at start; its row reports that error.

The last line is always ``pd_sglang: <backend>: <ok>/<n> requests token-identical to a plain
server; P<p>->D<d>`` (or why it failed).

Run from the repository root with kvtriton's venv (the servers use ``.venv-sglang``)::

    .venv/bin/python bench/pd_sglang.py --backend kvtriton --prefill-tp 1 --decode-tp 2
    .venv/bin/python bench/pd_sglang.py --backend both --pairs 1:2,2:1 --json out.json
"""

from __future__ import annotations

if not __package__:  # `python bench/pd_sglang.py`: run as `python -m bench.pd_sglang` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from beds.sglang_servers import (
    SGLANG_LLAMA,
    ServerProcess,
    engine_cpus,
    make_model,
    pd_generate,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
AGENT_DESCRIPTORS = ("staged_descriptors", "direct_descriptors", "one_sided_descriptors")
PAIRS = ((1, 2), (2, 1))


def sglang_python() -> str | None:
    py = os.environ.get("KVTRITON_SGLANG_PYTHON") or str(DEFAULT_SGLANG_PY)
    return py if Path(py).exists() else None


def sglang_nixl_descriptors(prefill_tp: int, decode_tp: int, layers: int, tokens: int, page: int) -> int:
    """SGLang nixl's descriptors for one request over all decode ranks, by its code: per
    (prefill rank, decode rank) pair that shares heads, one per (layer, K/V, token slot of each
    page sent). With ``prefill_tp == decode_tp`` it sends whole pages instead (one per layer,
    K/V and page per rank)."""
    pages = -(-tokens // page)
    if prefill_tp == decode_tp:
        return decode_tp * 2 * layers * pages
    sources_per_decode = max(1, prefill_tp // decode_tp)
    return decode_tp * sources_per_decode * 2 * layers * pages * page


def _counts(servers) -> dict[str, int]:
    total: dict[str, int] = {}
    for s in servers:
        for k, v in s.events.counters().items():
            total[k] = total.get(k, 0) + v
    return total


def _wait_done(decode: ServerProcess, room: int, ranks: int, timeout_s: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        done = decode.events.by_room("recv_done").get(room, [])
        if len(done) >= ranks or time.monotonic() > deadline:
            return done
        time.sleep(0.05)


def run(backend: str, prefill_tp: int, decode_tp: int, *, prompts: int = 4, prompt_len: int = 333,
        max_tokens: int = 8, page: int = 16, warmup: bool = True, python: str | None = None,
        log_dir: str | None = None, quiet: bool = False, env: dict | None = None) -> dict:
    """One P/D configuration on SGLang servers; returns ``rows`` per request, ``ok``, ``n``,
    medians and a ``summary`` line. ``env``: extra environment for the servers (e.g.
    ``KVTRITON_SGLANG_CONFIG``)."""
    python = python or sglang_python()
    if python is None:
        raise RuntimeError(f"no SGLang test bed at {DEFAULT_SGLANG_PY}: run `make sglang-bed`")
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    work = Path(log_dir or tempfile.mkdtemp(prefix="pd_sglang-"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(python, work / "model")
    rng = random.Random(11)
    first = -1 if warmup else 0
    toks = [[rng.randrange(1, SGLANG_LLAMA.vocab) for _ in range(prompt_len + (i * 7) % page)]
            for i in range(first, prompts)]
    secret = work / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)  # a secret file others can read is refused
    env = {"KVTRITON_AUTH_SECRET_FILE": str(secret), **(env or {})}
    t0 = time.time()
    with ServerProcess.start(python, model, tp=1, page_size=page, log_dir=work, name="plain", env=env) as plain:
        ref = plain.generate(toks, max_tokens)
    say(f"reference from a plain TP1 server in {time.time() - t0:.1f} s (logs in {work})")
    tag = f"{backend}-p{prefill_tp}d{decode_tp}"
    prefill = ServerProcess.start(python, model, tp=prefill_tp, mode="prefill", backend=backend, page_size=page,
                                  cpus=engine_cpus(prefill_tp, 0), log_dir=work, name=f"prefill-{tag}", env=env)
    rows = []
    try:
        decode = ServerProcess.start(python, model, tp=decode_tp, mode="decode", backend=backend, page_size=page,
                                     cpus=engine_cpus(decode_tp, 1), log_dir=work, name=f"decode-{tag}", env=env)
        try:
            say(f"servers up in {time.time() - t0:.1f} s")
            for i, p in enumerate(toks, start=first):
                room = 7000 + i
                before = _counts((prefill, decode))
                out = pd_generate(prefill, decode, [p], max_tokens, [room])
                done = _wait_done(decode, room, decode_tp)
                time.sleep(0.3)  # the prefill's last counters line follows its sender's Success
                after = _counts((prefill, decode))
                sends = prefill.events.by_room("send").get(room, [])
                inits = decode.events.by_room("recv_init").get(room, [])
                ok_ranks = [e for e in done if e["state"] == "success"]
                ms = lambda a, b: 1e3 * (b - a)  # noqa: E731
                row = {"backend": backend, "prefill_tp": prefill_tp, "decode_tp": decode_tp, "request": i,
                       "prompt_tokens": len(p), "pages": -(-len(p) // page),
                       "kv_loaded_ms": (ms(max(e["t"] for e in sends), max(e["t"] for e in ok_ranks))
                                        if sends and len(ok_ranks) == decode_tp else None),
                       "receiver_ms": (ms(min(e["t"] for e in inits), max(e["t"] for e in ok_ranks))
                                       if inits and len(ok_ranks) == decode_tp else None),
                       "request_ms": 1e3 * out["seconds"],
                       "descriptors": after.get("nixl_descriptors", 0) - before.get("nixl_descriptors", 0),
                       "agent_descriptors": (sum(after.get(k, 0) - before.get(k, 0) for k in AGENT_DESCRIPTORS)
                                             if backend == "kvtriton" else None),
                       "sglang_nixl_formula": sglang_nixl_descriptors(prefill_tp, decode_tp, SGLANG_LLAMA.layers,
                                                                      len(p), page),
                       "ranks_done": len(ok_ranks), "identical": out["tokens"][0] == ref[i - first]}
                rows.append(row)
                kv = "n/a" if row["kv_loaded_ms"] is None else f"{row['kv_loaded_ms']:.1f}"
                say(f"  request {i}{' (warm-up)' if i < 0 else ''}: {row['prompt_tokens']} tokens "
                    f"({row['pages']} pages), KV loaded in {kv} ms, request {row['request_ms']:.0f} ms, "
                    f"descriptors {row['descriptors']} (agents: {row['agent_descriptors']}; SGLang nixl by its "
                    f"code: {row['sglang_nixl_formula']}), {'identical' if row['identical'] else 'DIFFERENT'}")
        finally:
            decode.close()
    finally:
        prefill.close()
    ok = sum(r["identical"] for r in rows)
    timed = [r for r in rows if r["request"] >= 0 and r["kv_loaded_ms"] is not None]
    return {"rows": rows, "ok": ok, "n": len(rows),
            "kv_loaded_ms_median": statistics.median(r["kv_loaded_ms"] for r in timed) if timed else None,
            "descriptors_median": statistics.median(r["descriptors"] for r in rows[-prompts:]) if rows else None,
            "summary": f"pd_sglang: {backend}: {ok}/{len(rows)} requests token-identical to a plain server; "
                       f"P{prefill_tp}->D{decode_tp}"}


def compare(pairs=PAIRS, *, backends=("kvtriton", "nixl"), say=print, **kw) -> list[dict]:
    """Each backend on the same model and prompts, each TP pair: one result per (pair, backend),
    as :func:`run` returns it (or with ``error``), plus ``backend``/``prefill_tp``/``decode_tp``."""
    out = []
    for p_tp, d_tp in pairs:
        for backend in backends:
            say(f"pd_sglang: {backend} P{p_tp}->D{d_tp} ...")
            try:
                res = run(backend, p_tp, d_tp, **kw)
            except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the others
                msg = str(e)
                cause = next((line.strip() for line in msg.splitlines()
                              if "VRAM" in line or "Error" in line or "error" in line), msg[:200])
                res = {"rows": [], "ok": 0, "n": 0, "error": f"{type(e).__name__}: {cause[:400]}",
                       "summary": f"pd_sglang: {backend}: failed ({type(e).__name__}: {cause[:200]}); "
                                  f"P{p_tp}->D{d_tp}"}
            say(res["summary"])
            out.append({"backend": backend, "prefill_tp": p_tp, "decode_tp": d_tp, **res})
    return out


def table(results: list[dict]) -> list[str]:
    lines = ["| pair | backend | identical | KV loaded ms (median) | descriptors/request (median) | "
             "SGLang nixl by its code |",
             "|---|---|---|---|---|---|"]
    for r in results:
        formula = r["rows"][-1]["sglang_nixl_formula"] if r.get("rows") else "-"
        kv = "-" if r.get("kv_loaded_ms_median") is None else f"{r['kv_loaded_ms_median']:.1f}"
        desc = r.get("descriptors_median")
        lines.append(f"| P{r['prefill_tp']}->D{r['decode_tp']} | {r['backend']} | {r['ok']}/{r['n']} | {kv} | "
                     f"{'-' if desc is None else desc} | {formula} |" + (f" {r['error']}" if r.get("error") else ""))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["kvtriton", "nixl", "both"], default="kvtriton")
    ap.add_argument("--pairs", default="1:2,2:1", help="with --backend both: P:D pairs to run")
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=333)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--log-dir")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    kw = dict(prompts=args.prompts, prompt_len=args.prompt_len, max_tokens=args.max_tokens, page=args.page_size,
              warmup=not args.no_warmup, log_dir=args.log_dir)
    if args.backend == "both":
        pairs = tuple(tuple(int(x) for x in pd.split(":")) for pd in args.pairs.split(","))
        results = compare(pairs, **kw, say=lambda *a: print(*a, flush=True))
    else:
        try:
            results = [{"backend": args.backend, "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp,
                        **run(args.backend, args.prefill_tp, args.decode_tp, **kw)}]
        except Exception as e:  # noqa: BLE001 - the last line says why
            print(f"pd_sglang: {args.backend}: failed ({type(e).__name__}: {str(e)[:300]}); "
                  f"P{args.prefill_tp}->D{args.decode_tp}")
            return 1
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n".join(table(results)))
    for r in results:
        print(r["summary"])
    return 0 if all(r["n"] and r["ok"] == r["n"] for r in results if r["backend"] == "kvtriton") else 1


if __name__ == "__main__":
    sys.exit(main())
