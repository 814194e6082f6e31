"""Many requests in flight on real vLLM engines (issue 36): the load phase of ``bench/pd_vllm.py``.

Runs on the engines :func:`bench.pd_vllm.run` started, after its one-at-a-time requests, so one
engine start-up serves both. A *cell* is either ``N`` requests in flight at once (every prompt
prefilled, then all ``N`` handed to the decode in one go: ``N`` KV loads at once) or ``count``
requests arriving at the decode at a steady ``rate`` (req/s). Prompts are of mixed lengths (a
quarter, half, one and two times ``prompt_len``), the same for both connectors (seeded).

Per cell and connector: time to KV loaded (the worker's ``start_load_kv`` to the load reported
finished, as in the one-at-a-time rows) and to KV ready at the scheduler (submitted to the
scheduler learning it: queueing included), TTFT (submitted to the first decode token), p50 and
p99 each (with 8 requests the p99 is the slowest); requests token-identical to the decode
engine computing the prompt itself, prompt tokens recomputed; and what the loads cost the decode
engine's steps: a background request decodes the whole time, and the engine's own step times
(``beds.vllm_bed`` op ``step_times``) are split into steps with loads waiting (``progress()`` and
the connector's other per-step work run there) and the background alone before the loads.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["cells_from", "load_prompts", "run_cells", "pct", "BACKGROUND_PROMPT"]

#: the background request's prompt length (its decode steps are the step-time probe)
BACKGROUND_PROMPT = 32
#: steps of the background alone before the loads: the baseline step time
BASELINE_STEPS = 24


def cells_from(concurrency=(), rate: float = 0.0, rate_count: int = 16) -> list[dict]:
    """The cells to run: one per ``concurrency`` entry (``{"in_flight": n}``; a count given again is
    another run of that cell, ``"repeat": k``, its own row), and a rate cell."""
    cells: list[dict] = []
    for n in concurrency:
        if int(n) > 0:
            k = sum(1 for c in cells if c["in_flight"] == int(n))
            cells.append({"in_flight": int(n), **({"repeat": k} if k else {})})
    if rate > 0:
        cells.append({"rate": float(rate), "in_flight": int(rate_count)})
    return cells


def load_prompts(rng, n: int, prompt_len: int, block_size: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of mixed lengths (1/4, 1/2, 1 and 2 x ``prompt_len``, not block-aligned)."""
    scale = (0.25, 0.5, 1.0, 2.0)
    return [[rng.randrange(vocab) for _ in range(max(8, int(prompt_len * scale[i % 4])) + (i * 7) % block_size)]
            for i in range(n)]


def pct(values, q: float):
    """Nearest-rank percentile ``q`` (0-100) of the known values (None when none)."""
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    return known[min(len(known) - 1, max(0, math.ceil(q / 100 * len(known)) - 1))]


def run_cells(prefill, decode, connector: str, prompts, ref, cells, *, max_tokens: int, bg_tokens: int,
              say=print) -> list[dict]:
    """Each cell on the running engines; ``prompts``/``ref`` (tokens of one engine) cover the largest."""
    out = []
    for k, cell in enumerate(cells):
        out.append(_cell(prefill, decode, connector, prompts[:cell["in_flight"]], ref, cell, f"L{k}-",
                         max_tokens, bg_tokens))
        say(f"  load {_name(cell)} {connector}: {out[-1]['summary']}")
    return out


def _name(cell: dict) -> str:
    name = f"{cell['in_flight']} at {cell['rate']:g}/s" if "rate" in cell else f"{cell['in_flight']} in flight"
    return name + (f" (run {cell['repeat'] + 1})" if cell.get("repeat") else "")


def _cell(prefill, decode, connector, prompts, ref, cell, tag, max_tokens, bg_tokens) -> dict:
    n = len(prompts)
    eager0 = _eager(prefill, decode, connector)  # before the prefill: its holds are offered as placed
    params = [o["kv_transfer_params"] for o in prefill.call("generate", timeout_s=900, seconds=600, requests=[
        {"id": f"{tag}p{i}", "prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        for i, p in enumerate(prompts)])["outputs"]]
    # the background request decodes through the whole cell: first its prefill and a few steps,
    # then the baseline (it alone), then the loads beside it
    bg = f"{tag}bg"
    decode.call("submit", requests=[{"id": bg, "prompt": list(range(1, BACKGROUND_PROMPT + 1)),
                                     "max_tokens": bg_tokens}], steps=3)
    decode.call("step_times")
    decode.call("submit", requests=[], steps=BASELINE_STEPS)
    base = [s[0] for s in decode.call("step_times")["steps"]]
    gap = 1.0 / cell["rate"] if "rate" in cell else 0.0
    reqs = [{"id": f"{tag}d{i}", "prompt": p, "max_tokens": max_tokens, "kv_transfer_params": kp,
             **({"at_s": i * gap} if gap else {})} for i, (p, kp) in enumerate(zip(prompts, params))]
    decode.call("call_times")
    outs = decode.call("generate", requests=reqs, timeout_s=900, seconds=600)["outputs"]
    eager = {k: v - eager0.get(k, 0) for k, v in _eager(prefill, decode, connector).items()}
    steps = decode.call("step_times")["steps"]
    # the connector's per-step calls on the engine thread, rank 0 (the engine process at TP1)
    calls = (decode.call("call_times")["calls"] or [{}])[0] or {}
    decode.call("abort", ids=[bg])
    decode.call("drain", seconds=30, timeout_s=60)
    prefill.call("drain", seconds=60, timeout_s=90)  # held blocks freed before the next cell
    times = decode.call("load_times", ids=[r["id"] for r in reqs])["times"]
    rows = []
    for i, (r, o) in enumerate(zip(reqs, outs)):
        t = times.get(r["id"]) or {}
        rows.append({"request": i, "prompt_tokens": len(r["prompt"]), "ttft_ms": 1e3 * o["ttft_s"],
                     "kv_loaded_ms": None if t.get("worker_s") is None else 1e3 * t["worker_s"],
                     "kv_ready_ms": None if t.get("scheduler_s") is None else 1e3 * t["scheduler_s"],
                     "identical": o["tokens"] == ref[i], "prompt_computed": o["prompt_computed"]})
    loading = [s[0] for s in steps if s[1] > 0]
    res = {"connector": connector, "in_flight": n, "rate": cell.get("rate"), "repeat": cell.get("repeat", 0),
           "rows": rows,
           "ok": sum(r["identical"] for r in rows), "n": n,
           "recomputed": sum(max(0, r["prompt_computed"] - 1) for r in rows),
           "steps_loading": len(loading), "step_base_ms": _ms(statistics.median(base)) if base else None,
           "step_loading_ms_p50": _ms(pct(loading, 50)), "step_loading_ms_p99": _ms(pct(loading, 99)),
           # the connector's own calls on the engine thread over the cell (rank 0): total and slowest
           **{f"{k}_ms_total": _ms(sum(v)) for k, v in calls.items()},
           **{f"{k}_ms_max": _ms(max(v, default=0.0)) for k, v in calls.items()},
           # kvtriton: the loads the decode READ from an offer without pulling (offers_taken), the
           # prefill's offers read so and its pulls answered from packs made ahead, over the cell
           **eager,
           # every step of the cell: [ms, requests waiting for their KV, requests running]
           "steps": [[round(1e3 * t, 2), w, r] for t, w, r in steps]}
    for k in ("kv_loaded_ms", "kv_ready_ms", "ttft_ms"):
        res[f"{k}_p50"], res[f"{k}_p99"] = pct([r[k] for r in rows], 50), pct([r[k] for r in rows], 99)
    f = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    res["summary"] = (f"{res['ok']}/{n} identical, recomputed {res['recomputed']}; KV loaded p50/p99 "
                      f"{f(res['kv_loaded_ms_p50'])}/{f(res['kv_loaded_ms_p99'])} ms, KV ready "
                      f"{f(res['kv_ready_ms_p50'])}/{f(res['kv_ready_ms_p99'])} ms, TTFT "
                      f"{f(res['ttft_ms_p50'])}/{f(res['ttft_ms_p99'])} ms; decode step {f(res['step_base_ms'])} ms "
                      f"alone, {f(res['step_loading_ms_p50'])}/{f(res['step_loading_ms_p99'])} ms with loads "
                      f"waiting ({len(loading)} steps); connector calls on the engine thread: start_load_kv "
                      f"{f(res.get('start_load_kv_ms_total'))} ms in all "
                      f"(slowest {f(res.get('start_load_kv_ms_max'))}), "
                      f"get_transfer_results {f(res.get('get_transfer_results_ms_total'))} ms "
                      f"(slowest {f(res.get('get_transfer_results_ms_max'))}), garbage collections of the "
                      f"decode worker {f(res.get('gc_pause_ms_total'))} ms (longest {f(res.get('gc_pause_ms_max'))})"
                      + (f", waits for the agent's lock in start_load_kv {f(res.get('agent_lock_wait_ms_total'))} "
                         f"ms (longest {f(res.get('agent_lock_wait_ms_max'))})"
                         if "agent_lock_wait_ms_total" in res else "")
                      + (f"; offers READ without a pull {eager['offers_taken']} (one per source rank and load), "
                         f"pulls {eager['eager_pull_hits'] + eager['eager_offer_pulls'] + eager['eager_misses']}, "
                         f"fetches deferred to the agent's thread {eager.get('deferred_fetches', 0)}"
                         if eager else ""))
    return res


_EAGER = {"decode": ("offers_taken", "deferred_fetches"),
          "prefill": ("eager_offers", "eager_offer_reads", "eager_offer_pulls", "eager_pull_hits", "eager_misses")}


def _eager(prefill, decode, connector: str) -> dict:
    """kvtriton's eager counters summed over each engine's ranks ({} for NixlConnector)."""
    if connector != "kvtriton":
        return {}
    out = {}
    for name, engine in (("decode", decode), ("prefill", prefill)):
        ranks = engine.call("agent_stats")["stats"] or ()
        for k in _EAGER[name]:
            out[k] = sum((r or {}).get(k, 0) for r in ranks)
    return out


def _ms(seconds):
    return None if seconds is None else 1e3 * seconds
