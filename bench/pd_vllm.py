"""Prefill/decode disaggregation on real vLLM engines: kvtriton's connector or vLLM's NixlConnector.

Starts a prefill engine and a decode engine (vLLM's CPU build, child processes; the test bed from
``make vllm-bed``) on a random-weight GQA Llama of the given shape, made here, and runs each prompt
the way a P/D proxy does: prefill with ``max_tokens=1`` and ``do_remote_decode``, then decode with
the ``kv_transfer_params`` it returned. Per request it prints the time to KV loaded (the decode
worker's ``start_load_kv`` seeing the load, first rank, to ``get_transfer_results`` reporting it,
last rank: the same hooks for both connectors, see ``vllm_bed._BedHooks.time_loads``), the time to
the first decode token (the KV load plus one decode step) and the descriptors the decode ranks
posted for it; then checks
the tokens against the decode engine computing the prompt itself, and counts the prompt tokens the
decode engine computed (from its scheduler's own outputs: 1 per request when the KV came over).

The last line is always::

    pd_vllm: <connector>: <ok>/<n> requests token-identical to one engine; prompt tokens recomputed on
    decode: <r>; P<p>->D<d>

(one line; wrapped here)

Run from the repository root with kvtriton's venv (the engines use ``.venv-vllm``)::

    .venv/bin/python bench/pd_vllm.py --connector kvtriton --prefill-tp 2 --decode-tp 1
    .venv/bin/python bench/pd_vllm.py --connector nixl --prefill-tp 1 --decode-tp 2 --json out.json
    # both connectors, P2->D1 and P1->D2, ~2k descriptors per NixlConnector load, table with ours/theirs
    .venv/bin/python bench/pd_vllm.py --connector both --layers 16 --kv-heads 8 --head-dim 64 \
        --hidden 256 --prompt-len 2048 --prompts 4 --staging-mib 160
    # a pair NixlConnector refuses (its handshake asserts on 3 % 2): kvtriton moves it, its row fails
    .venv/bin/python bench/pd_vllm.py --connector both --pairs 2:3 --kv-heads 6
    # MLA, and a GQA target with an Eagle-3 MLA draft in one KV cache group (block 16)
    .venv/bin/python bench/pd_vllm.py --connector both --model deepseek
    .venv/bin/python bench/pd_vllm.py --connector kvtriton --model llama+mla-draft --prefill-tp 2
    .venv/bin/python bench/pd_vllm.py --connector both --model nemotronh-ng1 --pairs 1:2,2:1
    # many requests in flight (bench/pd_vllm_load.py): 8 and 32 at once and 16 at 20 req/s, block 16 and 64
    .venv/bin/python bench/pd_vllm.py --connector both --pairs 2:1 --block-size 16,64 --concurrency 8,32 --rate 20
"""

from __future__ import annotations

if not __package__:  # `python bench/pd_vllm.py`: run as `python -m bench.pd_vllm` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from beds import child_env
from beds.vllm_bed import WORKER_START, EngineProcess, TinyLlama, engine_cpus, free_port_range
from beds.vllm_models import TinyDeepseek
from bench.pd_vllm_load import BACKGROUND_PROMPT, cells_from, load_prompts, run_cells  # bench/pd_vllm_load.py
from bench.report import fmt_ms, load_table, median_known, pd_vllm_table  # bench/report.py

# both connectors' engines fork their TP workers, as vLLM does on GPUs (its CPU platform spawns them,
# each importing vLLM again: ~16 s of a TP2 engine's start here; docs/operations.md); what is timed
# starts after the engines are up. KVTRITON_BED_WORKER_START=spawn gives vLLM's own way back.
os.environ.setdefault(WORKER_START, "fork")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
#: where :func:`compare` keeps the models it makes, across runs (``make clean`` removes it): making
#: one starts the bed's Python and imports transformers, 23-68 s of a sweep on the loaded 2-core host
MODEL_CACHE = ROOT / "build" / "pd_vllm-models"

# vLLM CPU: MLA runs on CPU_MLA (named: AMX_MLA would be picked on AMX hosts) at block 16, with the
# rotary custom op off (it is wrong for DeepSeek's 3-D q_pe); the mixed cache also needs the bed's
# two capability patches (beds/vllm_patches.py)
MLA_OPTIONS = {"attention_config": {"backend": "CPU_MLA"}, "compilation_config": {"custom_ops": ["-rotary_embedding"]}}
MODEL_KINDS = ("llama", "deepseek", "llama+mla-draft")
#: hybrid models (issue 32): kind -> (model kind of beds.vllm_models, its options)
HYBRID_MODELS = {"gemma3": ("gemma3", {}), "nemotronh": ("nemotronh", {"n_groups": 2}),
                 "nemotronh-ng1": ("nemotronh", {"n_groups": 1}), "qwen3next": ("qwen3next", {})}
MIXED_PATCHES = ("cpu-attention-block-16", "mla-metadata-target-head-size")


def vllm_python() -> str | None:
    py = os.environ.get("KVTRITON_VLLM_PYTHON") or str(DEFAULT_VLLM_PY)
    return py if Path(py).exists() else None


def _num_blocks(params) -> int:
    ids = (params or {}).get("remote_block_ids") or []
    return len(ids[0]) if ids and isinstance(ids[0], list) else len(ids)  # NixlConnector: one list per group


def _sum_stats(per_rank) -> dict:
    out = {"loads": 0, "descriptors": 0, "bytes": 0}
    for s in per_rank or ():
        for k in out:
            out[k] += (s or {}).get(k, 0)
    return out


_WAY_COUNTERS = {"direct": "direct_descriptors", "one_sided": "one_sided_descriptors",
                 "staged": "staged_descriptors"}


def _ways(decode, connector: str) -> dict:
    """kvtriton: the decode ranks' descriptors by how they moved (zero copy: DIRECT runs and head
    slices; one-sided READs; staged chunks) and the payloads the per-request direct_slice way moved
    (the loads' records), summed over ranks; {} for NixlConnector (no agent)."""
    if connector != "kvtriton":
        return {}
    per_rank = decode.call("agent_stats")["stats"] or ()
    out = {k: sum((s or {}).get(c, 0) for s in per_rank) for k, c in _WAY_COUNTERS.items()}
    loads = decode.call("transfer_stats")["stats"] or ()
    out["slice_payloads"] = sum((s or {}).get("payloads_direct_slice", 0) for s in loads)
    return out


def run(connector: str, prefill_tp: int, decode_tp: int, *, kv_heads: int = 2, layers: int = 2, head_dim: int = 32,
        hidden: int | None = None, block_size: int = 32, prompts: int = 4, prompt_len: int = 333, max_tokens: int = 8,
        warmup: bool = True, python: str | None = None, log_dir: str | None = None, quiet: bool = False,
        env: dict | None = None, profile: str | None = None, eager: bool = True, staging_mib: int = 0,
        model_kind: str = "llama", concurrent_start: bool | None = None, model_cache: str | None = None,
        modes: str = "", say=None, before_measure=None, closing: list | None = None,
        load_cells: list | None = None) -> dict:
    """Run one P/D configuration; returns a result dict (``rows`` per request, ``ok``, ``recomputed``).

    With ``warmup`` a first request (``request`` -1, its own prompt) goes through before the
    measured ones: it carries the handshake and first-use costs, reported but left out of medians.
    ``env``: extra environment for both engines (``KVTRITON_DEBUG=1``: every control message in
    their logs). ``profile``: a folder; py-spy (``$PY_SPY`` or on ``PATH``) samples both engines,
    their worker processes included, over the measured requests and writes one flame graph each.
    kvtriton only: ``eager`` names the decode engine as the consumer of the prefill's holds (a
    fixed pairing, ``consumer`` in the connector settings), so the prefill packs each request as soon
    as it finishes; ``staging_mib`` (0: the default) sizes the prefill engine's staging pool.
    ``before_measure``: called once the engines are up, before the first request (compare: wait
    for the previous run's engines to be gone). ``closing``: a list; when given, the engines are
    closed by a thread appended to it (the caller joins it) instead of before returning, so the
    next run's engines start meanwhile. ``modes``: kvtriton only, forces the agents' modes
    (the connector setting ``modes``, e.g. ``"pack_place"`` or ``"direct_slice"``) on both engines, for A/Bs.
    ``say``: where lines go (default print; ``quiet`` keeps only the phases line).
    ``load_cells``: after the one-at-a-time requests, these cells of many requests in flight on
    the same engines (bench/pd_vllm_load.py, :func:`~bench.pd_vllm_load.cells_from`), results in
    ``load``. Block sizes under 32 (Llama) run with the bed's ``cpu-attention-block-16`` patch.
    ``concurrent_start``: both engines start at once, each on its own cores (None, the default,
    and True); False: one after the other, the one with more ranks first (see
    :func:`_start_order`). ``model_cache``: a folder for the made model (default: the log
    folder), so runs sharing it make the model once.
    ``model_kind``: ``llama`` (GQA, the shape above), ``deepseek`` (a DeepSeek-V2 with ``layers``
    MLA layers at latent 576; block 16) or ``llama+mla-draft`` (the Llama with an Eagle-3 MLA
    draft in its KV cache group, 2 speculative tokens; block 16)."""
    t0, phases = time.time(), {}
    python = python or vllm_python()
    if python is None:
        raise RuntimeError(f"no vLLM test bed at {DEFAULT_VLLM_PY}: run `make vllm-bed`")
    tell = say or (lambda *a: print(*a, flush=True))  # the phases line, always
    say = (lambda *a: None) if quiet else tell
    work = Path(log_dir or tempfile.mkdtemp(prefix="pd_vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    models = Path(model_cache or MODEL_CACHE)
    hidden = hidden or 2 * kv_heads * head_dim
    # a TP3 engine needs a vocabulary vLLM pads to a multiple of 3 x 64 (512 fails: "512 is not divisible by 3")
    vocab = 576 if prefill_tp % 3 == 0 or decode_tp % 3 == 0 else 512
    model = TinyLlama(layers=layers, kv_heads=kv_heads, heads=2 * kv_heads, head_dim=head_dim,
                      hidden=hidden, vocab=vocab, max_positions=max(4096, 2 * prompt_len))
    options, patches = None, ()
    if model_kind not in MODEL_KINDS:
        raise ValueError(f"model_kind {model_kind!r}: expected one of {MODEL_KINDS}")
    if model_kind == "deepseek":
        model = TinyDeepseek(layers=layers, max_positions=max(4096, 2 * prompt_len))
        model_dir = _make(python, "deepseek", models / f"deepseek-l{layers}", model.__dict__)
        block_size, options = 16, MLA_OPTIONS
    else:
        model_dir = _make(python, "llama", models / f"llama-l{layers}-kv{kv_heads}-d{head_dim}-h{hidden}-v{vocab}",
                          model.__dict__)
        if block_size < 32:  # the CPU attention backend declares multiples of 32; its kernel runs at 16
            patches = ("cpu-attention-block-16",)
    if model_kind == "llama+mla-draft":
        draft = _make(python, "eagle3-mla", models / f"eagle3-mla-h{hidden}", {"target": model.__dict__,
                                                                              "draft": {"hidden": hidden}})
        block_size, patches = 16, MIXED_PATCHES
        options = {**MLA_OPTIONS, "speculative_config": {"method": "eagle3", "model": str(draft),
                                                         "num_speculative_tokens": 2, "attention_backend": "CPU_MLA"}}
    load_cells = load_cells or []
    rng = random.Random(11)
    first = -1 if warmup else 0
    toks = [[rng.randrange(model.vocab) for _ in range(prompt_len + (i * 7) % block_size)]
            for i in range(first, prompts)]
    loads = load_prompts(random.Random(36), max((c["in_flight"] for c in load_cells), default=0), prompt_len,
                         block_size, model.vocab)
    max_len = 1 << (max(map(len, toks + loads)) + max_tokens + block_size).bit_length()
    bg_tokens = max_len - BACKGROUND_PROMPT - block_size  # the load cells' background request
    # the blocks this run can use at once: the decode's reference batch (every prompt, warm-up
    # included, at once; prefix caching is off, so they are free again after it) and 16 spare;
    # the measured requests run one at a time. Not the 1 GiB VLLM_CPU_KVCACHE_SPACE (its smallest
    # value) per worker: a P2->D1 run held 5.5 GB of PSS with it, and room for the batch twice
    # over still put the scaled model's runs at 5.2 GB, over the 4 GB every bench must stay under
    # (the load cells: their prompts at once on the prefill, beside the background on the decode)
    blocks = sum(-(-(len(p) + max_tokens + 2 * block_size) // block_size) for p in toks + loads) + 16
    blocks += -(-max_len // block_size) if loads else 0
    options = {**(options or {}), "num_gpu_blocks_override": blocks}
    common = dict(connector=connector, block_size=block_size, max_model_len=max_len, log_dir=work,
                  engine_options=options, patches=patches)
    p_extra = {"lease_s": 120.0} if connector == "kvtriton" else {}
    d_extra = {"timeout_s": 60.0, "handshake_timeout_s": 30.0} if connector == "kvtriton" else {}
    if connector == "kvtriton" and eager:
        p_extra["consumer"] = f"decode-{connector}"
    if connector == "kvtriton" and modes:  # forced on both engines (their plans must agree)
        p_extra["modes"] = d_extra["modes"] = modes
    if connector == "kvtriton" and staging_mib:  # where eager packs wait (the decode streams through its default)
        p_extra["staging_bytes"] = staging_mib << 20
    phases["model_s"] = time.time() - t0
    t1 = time.time()
    # each engine on its own cores (engine_cpus): sharing a core with the other engine's spinning
    # ranks stalled the prefill for tens of seconds on a 2-core host
    specs = {"prefill": dict(tp=prefill_tp, role="kv_producer", port=free_port_range(prefill_tp), extra=p_extra,
                             cpus=engine_cpus(prefill_tp, 0)),
             "decode": dict(tp=decode_tp, role="kv_consumer", port=free_port_range(1), extra=d_extra,
                            cpus=engine_cpus(decode_tp, 1))}
    order, concurrent = _start_order(connector, specs, concurrent_start)
    engines = _start_engines(python, model_dir, connector, env, specs, order, common, concurrent, phases)
    phases["engines_s"] = time.time() - t1
    prefill, decode = engines["prefill"], engines["decode"]
    if before_measure is not None:
        t1 = time.time()
        before_measure()
        phases["wait_previous_s"] = time.time() - t1
    say(f"engines up in {phases['engines_s']:.1f} s (logs in {work})")
    rows, spies, load = [], [], []
    try:
        t1 = time.time()
        ref = decode.call("generate", requests=[{"id": f"ref{i}", "prompt": p, "max_tokens": max_tokens}
                                                 for i, p in enumerate(toks + loads)], timeout_s=1200)["outputs"]
        phases["reference_s"] = time.time() - t1
        t1 = time.time()
        for i, p in enumerate(toks, start=first):
            if i == 0 and profile:
                spies = _start_profilers(profile, f"{connector}-P{prefill_tp}D{decode_tp}", engines)
            params = prefill.call("generate", requests=[{"id": f"p{i}", "prompt": p, "max_tokens": 1,
                                                         "kv_transfer_params": {"do_remote_decode": True}}]
                                  )["outputs"][0]["kv_transfer_params"]
            before = _sum_stats(decode.call("transfer_stats")["stats"])
            ways0 = _ways(decode, connector)
            out = decode.call("generate", requests=[{"id": f"d{i}", "prompt": p, "max_tokens": max_tokens,
                                                     "kv_transfer_params": params}])["outputs"][0]
            after = _sum_stats(decode.call("transfer_stats")["stats"])
            loaded = decode.call("load_times", ids=[f"d{i}"])["times"][f"d{i}"]
            ways1 = _ways(decode, connector)
            ways = {k: ways1[k] - ways0[k] for k in ways1 if ways1[k] != ways0[k]}
            ms = lambda s: None if s is None else 1e3 * s  # noqa: E731
            row = {"connector": connector, "model_kind": model_kind, "prefill_tp": prefill_tp, "decode_tp": decode_tp,
                   "request": i,
                   "prompt_tokens": len(p), "blocks": _num_blocks(params),
                   "ttft_ms": 1e3 * out["ttft_s"],
                   # start_load_kv saw the load (first rank) -> get_transfer_results reported it (last rank)
                   "kv_loaded_ms": ms(loaded["worker_s"]),
                   # request submitted -> the scheduler learned its KV is in
                   "kv_ready_ms": ms(loaded["scheduler_s"]),
                   # None: the connector's counters saw no load for it (not measured, not zero)
                   "descriptors": (after["descriptors"] - before["descriptors"]
                                   if after["loads"] > before["loads"] else None),
                   "kv_bytes": after["bytes"] - before["bytes"], "prompt_computed": out["prompt_computed"],
                   "identical": out["tokens"] == ref[i - first]["tokens"],
                   # kvtriton: descriptors by way ("direct": DIRECT and DIRECT_SLICE runs), e.g. {"direct": 2080}
                   "ways": ",".join(f"{k} {v}" for k, v in ways.items()) or None}
            rows.append(row)
            desc = row["descriptors"] if row["descriptors"] is not None else "n/a"
            say(f"  request {i}{' (warm-up)' if i < 0 else ''}: {row['prompt_tokens']} tokens "
                f"({row['blocks']} blocks), KV loaded in {fmt_ms(row['kv_loaded_ms'])} ms "
                f"(ready at scheduler {fmt_ms(row['kv_ready_ms'])} ms), "
                f"time to first decode token {row['ttft_ms']:.1f} ms, descriptors {desc}, "
                f"{'(' + row['ways'] + ') ' if row['ways'] else ''}prompt tokens computed "
                f"{row['prompt_computed']}, {'identical' if row['identical'] else 'DIFFERENT'}")
        phases["requests_s"] = time.time() - t1
        if load_cells:
            t1 = time.time()
            load = run_cells(prefill, decode, connector, loads, [r["tokens"] for r in ref[len(toks):]], load_cells,
                             max_tokens=max_tokens, bg_tokens=bg_tokens, say=tell)
            phases["load_s"] = time.time() - t1
    finally:
        t1 = time.time()
        for spy in spies:
            spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
            try:
                spy.wait(timeout=120)
            except subprocess.TimeoutExpired:
                spy.kill()
        if closing is None:
            _close_all(engines.values())
            phases["close_s"] = time.time() - t1
        else:  # closed meanwhile: the caller's next engines start as these exit
            import threading

            closer = threading.Thread(target=_close_all, args=(list(engines.values()),), daemon=True)
            closer.start()
            closing.append(closer)
    ok = sum(r["identical"] for r in rows)
    recomputed = sum(max(0, r["prompt_computed"] - 1) for r in rows)
    timed = [r for r in rows if r["request"] >= 0]
    phases = {k: round(v, 1) for k, v in phases.items()}
    tell(f"  phases of {connector} P{prefill_tp}->D{decode_tp} (s): "
         + ", ".join(f"{k[:-2]} {v}" for k, v in phases.items()))
    return {"rows": rows, "ok": ok, "n": len(rows), "recomputed": recomputed, "model_kind": model_kind,
            "phases": phases, "block_size": block_size, "load": load,
            "ttft_ms_median": statistics.median(r["ttft_ms"] for r in timed) if timed else None,
            "kv_loaded_ms_median": median_known([r["kv_loaded_ms"] for r in timed]),
            "summary": f"pd_vllm: {connector}: {ok}/{len(rows)} requests token-identical to one engine; "
                       f"prompt tokens recomputed on decode: {recomputed}; P{prefill_tp}->D{decode_tp}"
                       + ("" if model_kind == "llama" else f"; model {model_kind}")}


def _start_order(connector: str, specs: dict, concurrent: bool | None) -> tuple[list[str], bool]:
    """(engine names in start order, start them at once?). Start-up is most of this bench's time
    (30-60 s an engine on 2 busy cores, most of it a TP engine spawning its worker processes), so
    by default both engines start at once, each on its own cores (kvtriton P2->D1: 44 s for both
    against 16 + 44 one after the other). NixlConnector's progress thread busy-polls from the moment
    its agent exists and slowed a concurrent TP prefill's worker start (25 -> 61 s), but starting its
    engines one after the other (``concurrent=False``, more ranks first) left the prefill's first
    generate unanswered for 300 s in both runs that tried it (2026-12-01, host load 30-50), while
    every concurrent start ran: concurrent it is, for both connectors, until that is understood."""
    if concurrent is None:
        concurrent = True
    return sorted(specs, key=lambda n: (-specs[n]["tp"], n != "prefill")), concurrent


def _start_engines(python, model_dir, connector, env, specs, order, common, concurrent, phases) -> dict:
    """The engines of ``specs`` (name -> EngineProcess.start keywords), in ``order`` or all at
    once (one thread each: EngineProcess.start blocks until its engine answers); every started
    engine closed if any fails. ``phases[<name>_up_s]``: each engine's own start-up time."""
    import threading

    engines, errors = {}, []

    def start(name):
        t = time.time()
        try:
            engines[name] = EngineProcess.start(python, model_dir, engine_id=f"{name}-{connector}", env=env,
                                                name=f"{name}-{connector}", timeout_s=600, keep_loads=False,
                                                **specs[name], **common)  # no oracle copy inside the timed step
            phases[f"{name}_up_s"] = time.time() - t
        except BaseException as e:  # noqa: BLE001 - raised below, after every engine is closed
            errors.append(e)

    if concurrent:
        threads = [threading.Thread(target=start, args=(n,), daemon=True) for n in order]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for n in order:
            if not errors:
                start(n)
    if errors:
        _close_all(engines.values())
        raise errors[0]
    return engines


def _close_all(engines) -> None:
    """Close every engine at once: each waits up to a minute for its child to exit."""
    import threading

    threads = [threading.Thread(target=e.close, daemon=True) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _make(python: str, kind: str, path: Path, options: dict) -> Path:
    """Write a tiny model with the bed's Python (beds/vllm_models.py); a model already
    written there (same kind and shape: the folder is named by them) is reused, so the runs of
    :func:`compare` sharing a ``log_dir`` make it once."""
    done = path / ".made"
    if done.exists() and done.read_text() == json.dumps(options, sort_keys=True):
        return path
    subprocess.run([python, "-m", "beds.vllm_models", kind, str(path), json.dumps(options)], check=True,
                   timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
    done.write_text(json.dumps(options, sort_keys=True))
    return path


def _start_profilers(folder: str, tag: str, engines: dict) -> list[subprocess.Popen]:
    import shutil

    spy = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if spy is None:
        raise RuntimeError("profile needs py-spy: set PY_SPY or put it on PATH")
    Path(folder).mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([spy, "record", "--subprocesses", "--threads", "--rate", "250", "--nonblocking",
                               "--format", "raw", "-o", str(Path(folder) / f"{tag}-{name}.txt"),
                               "--pid", str(e.proc.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, e in engines.items()]
    time.sleep(2.0)  # py-spy attaches before the first measured request
    return procs


PAIRS = ((2, 1), (1, 2))


def compare(pairs=PAIRS, *, say=print, overlap: bool = True, **kw) -> list[dict]:
    """Both connectors on the same model and prompts, each TP pair: one result per (pair,
    connector), as :func:`run` returns it, plus ``connector``/``prefill_tp``/``decode_tp``. The
    model is made once (``model_cache``; default: ``log_dir`` when given, else :data:`MODEL_CACHE`,
    kept for the next run too); each run's logs go to its own folder.
    ``overlap``: the next run's engines start while the last run's exit (False: after, for the
    larger models, where two runs' engines at once pass the 4 GB a bench may take)."""
    out = []
    log_dir = kw.pop("log_dir", None)
    root = Path(log_dir or tempfile.mkdtemp(prefix="pd_vllm-"))
    kw.setdefault("model_cache", str(root if log_dir else MODEL_CACHE))  # a folder named keeps it all
    closing: list = []  # each run's engines exit while the next run's start; gone before it measures

    def previous_gone():
        while closing:
            closing.pop().join()

    try:
        for p_tp, d_tp in pairs:
            for connector in ("kvtriton", "nixl"):
                out.append(_compare_one(connector, p_tp, d_tp, root, say, kw, previous_gone,
                                        closing if overlap else None))
    finally:
        previous_gone()
    return out


def _compare_one(connector, p_tp, d_tp, root, say, kw, previous_gone, closing) -> dict:
    """One (connector, pair) of :func:`compare`; a failure becomes a result with no rows."""
    say(f"pd_vllm: {connector} P{p_tp}->D{d_tp} ...")
    try:
        res = run(connector, p_tp, d_tp, log_dir=str(root / f"P{p_tp}D{d_tp}-{connector}"), say=say,
                  before_measure=previous_gone, closing=closing, **kw)
    except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the others
        res = {"rows": [], "ok": 0, "n": 0, "recomputed": 0, "error": f"{type(e).__name__}: {str(e)[:300]}",
               "summary": f"pd_vllm: {connector}: failed ({type(e).__name__}: {str(e)[:200]}); P{p_tp}->D{d_tp}"}
    say(res["summary"])
    return {"connector": connector, "prefill_tp": p_tp, "decode_tp": d_tp, **res}


def run_hybrid(connector: str, prefill_tp: int, decode_tp: int, *, model: str, prompt_lens=(77, 203, 161),
               log_dir: str | None = None, say=print) -> dict:
    """One hybrid model (:data:`HYBRID_MODELS`) P/D through ``connector`` (``kvtriton`` or
    ``nixl``): tokens against one engine, the decode's descriptors and bytes, time to KV loaded
    per request, and (kvtriton) every group's bytes checked (:class:`beds.vllm_hybrid.HybridPair`)."""
    from beds.vllm_hybrid import HybridPair

    python = vllm_python()
    if python is None:
        raise RuntimeError("no vLLM test bed: make vllm-bed (or set KVTRITON_VLLM_PYTHON)")
    kind, options = HYBRID_MODELS[model]
    root = Path(log_dir or tempfile.mkdtemp(prefix="pd_vllm_hybrid_"))
    model_dir = _make(python, kind, root / "models" / model, options)
    run_dir = root / f"{connector}-p{prefill_tp}d{decode_tp}-{model}"
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(32)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in prompt_lens]
    pair = HybridPair(python, model_dir, run_dir, kind, prefill_tp, decode_tp, connector=connector)
    try:
        ref = pair.reference(prompts, "ref")
        before = _sum_stats(pair.decode.call("transfer_stats")["stats"])
        if connector == "kvtriton":
            res = pair.transfer(prompts, ref, tag="x")
            identical, checked = res["identical"], res["digests"]["regions"]
        else:
            params = pair.prefill_requests(prompts, "x-p")
            out = pair.decode_requests(prompts, params, "x-d")
            identical, checked = sum(o["tokens"] == r for o, r in zip(out, ref)), None
        after = _sum_stats(pair.decode.call("transfer_stats")["stats"])
        times = pair.decode.call("load_times", ids=[f"x-d{i}" for i in range(len(prompts))])["times"]
        loaded = [t["worker_s"] for t in times.values() if t["worker_s"] is not None]
    finally:
        pair.close()
    row = {"connector": connector, "model": model, "prefill_tp": prefill_tp, "decode_tp": decode_tp,
           "identical": identical, "n": len(prompts), "regions_checked": checked,
           "descriptors": after["descriptors"] - before["descriptors"], "bytes": after["bytes"] - before["bytes"],
           "kv_loaded_ms": 1e3 * statistics.median(loaded) if loaded else None}
    row["summary"] = (f"{model} {connector} P{prefill_tp}->D{decode_tp}: tokens {identical}/{len(prompts)}, regions "
                      f"byte-checked {checked if checked is not None else '-'}, descriptors {row['descriptors']}, "
                      f"bytes {row['bytes']}, KV loaded {fmt_ms(row['kv_loaded_ms'])} ms (median)")
    say(row["summary"])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connector", choices=["kvtriton", "nixl", "both"], default="kvtriton",
                    help="both: each connector on P2->D1 and P1->D2 (the --*-tp flags are ignored), with a table")
    ap.add_argument("--pairs", default="2:1,1:2", help="with --connector both: P:D pairs to run")
    ap.add_argument("--model", choices=MODEL_KINDS + tuple(HYBRID_MODELS), default="llama",
                    help="llama: GQA; deepseek: DeepSeek-V2 MLA (latent 576, block 16); llama+mla-draft: the "
                         "Llama with an Eagle-3 MLA draft in one KV cache group (block 16, the bed's CPU patches); "
                         "hybrids (issue 32, the --*-tp flags or --pairs): gemma3 (sliding window), nemotronh "
                         "(Mamba2, n_groups 2), nemotronh-ng1 (n_groups 1), qwen3next (Gated DeltaNet, bf16)")
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=0, help="model width (0: 2 * kv heads * head dim)")
    ap.add_argument("--no-warmup", action="store_true", help="no unmeasured first request")
    ap.add_argument("--no-eager", action="store_true", help="kvtriton: no consumer named, packs wait for the pull")
    ap.add_argument("--staging-mib", type=int, default=0, help="kvtriton: staging pool per prefill rank (0: default)")
    ap.add_argument("--start", choices=["auto", "concurrent", "sequential"], default="auto",
                    help="engine start-up: both at once (auto, concurrent) or one after the other, more ranks first")
    ap.add_argument("--profile", help="folder for py-spy samples of both engines over the measured requests")
    ap.add_argument("--debug", action="store_true", help="KVTRITON_DEBUG=1 in the engines (control messages logged)")
    ap.add_argument("--block-size", default="32",
                    help="tokens per block; comma-separated with --connector both (e.g. 16,64: vLLM 0.34's default "
                         "is 64; under 32 the bed's cpu-attention-block-16 patch runs the Llama)")
    ap.add_argument("--concurrency", default="", help="after the one-at-a-time requests, cells of this many requests "
                    "of mixed prompt lengths in flight at once on the same engines (comma-separated, e.g. 8,32)")
    ap.add_argument("--rate", type=float, default=0.0, help="and a cell of --rate-count requests arriving at the "
                    "decode at this steady rate (req/s)")
    ap.add_argument("--rate-count", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=333)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--modes", default="", help="kvtriton: force the agents' modes on both engines (an A/B)")
    args = ap.parse_args(argv)
    if args.model in HYBRID_MODELS:
        pairs = (tuple(tuple(int(x) for x in pd.split(":")) for pd in args.pairs.split(","))
                 if args.connector == "both" else ((args.prefill_tp, args.decode_tp),))
        connectors = ("kvtriton", "nixl") if args.connector == "both" else (args.connector,)
        rows = [run_hybrid(c, p, d, model=args.model, say=lambda *a: print(*a, flush=True))
                for p, d in pairs for c in connectors]
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0 if all(r["identical"] == r["n"] for r in rows) else 1
    blocks = [int(b) for b in args.block_size.split(",")]
    cells = cells_from([c for c in args.concurrency.split(",") if c], args.rate, args.rate_count)
    kw = dict(kv_heads=args.kv_heads, layers=args.layers, head_dim=args.head_dim, hidden=args.hidden or None,
              load_cells=cells, prompts=args.prompts, prompt_len=args.prompt_len,
              max_tokens=args.max_tokens, warmup=not args.no_warmup, profile=args.profile,
              eager=not args.no_eager, staging_mib=args.staging_mib, model_kind=args.model,
              modes=args.modes, concurrent_start={"auto": None, "concurrent": True, "sequential": False}[args.start],
              env={"KVTRITON_DEBUG": "1"} if args.debug else None)
    if args.connector == "both":
        pairs = tuple(tuple(int(x) for x in pd.split(":")) for pd in args.pairs.split(","))
        results = [r for b in blocks for r in compare(pairs, **kw, block_size=b, say=lambda *a: print(*a, flush=True))]
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        print("\n".join(pd_vllm_table(results)))
        if cells:
            print("\n".join(load_table(results)))
        for r in results:
            print(r["summary"])
        return 0 if all(r["n"] and r["ok"] == r["n"] and r["recomputed"] == 0 and _loads_ok(r) for r in results) else 1
    runs = [run(args.connector, args.prefill_tp, args.decode_tp, **kw, block_size=b) for b in blocks]
    if args.json:  # one block size: its result, as before; several: the list
        Path(args.json).write_text(json.dumps(runs[0] if len(runs) == 1 else runs, indent=1))
    for res in runs:
        print(res["summary"])
    return 0 if all(r["ok"] == r["n"] and r["recomputed"] == 0 and _loads_ok(r) for r in runs) else 1


def _loads_ok(res: dict) -> bool:
    return all(c["ok"] == c["n"] and c["recomputed"] == 0 for c in res.get("load") or ())


if __name__ == "__main__":
    sys.exit(main())
