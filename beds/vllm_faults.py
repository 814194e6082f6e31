"""Faults on real vLLM engines (issue 35): a P1->D1 pair of :mod:`.vllm_bed` engines with kvtriton's
connector, and the two scenarios the real-engine tests (tests/engines/test_vllm_faults.py) and
``bench/faults.py --vllm`` run on it. Both return what they measured; the caller judges.

* :func:`queued_past_lease`: decode requests wait in the decode engine's queue (one running slot,
  taken by a local request; the engine not stepped meanwhile) for twice the prefill's lease, then
  load: their KV must still be held (the decode renewed it while they waited).
* :func:`prefill_killed_mid_load`: a second prefill engine (:func:`launch_victim`: nothing
  packed ahead, so every load needs its answer), met by one load, stops (SIGSTOP) with the
  decode's loads of its requests in flight, then is SIGKILLed: each load fails typed (the
  lifeline, not the ``timeout_s`` of 30 s), vLLM recomputes those requests
  (``kv_load_failure_policy="recompute"``), and the decode engine serves the next requests.
  (A hold packed ahead for its consumer is READ one-sided, stopped prefill or not: such loads
  would finish, and the kill would hit none.)
"""

from __future__ import annotations

import os
import signal
import time

from .vllm_bed import EngineProcess, engine_cpus, free_port_range, wait_all_ready

__all__ = ["LEASE_S", "TIMEOUT_S", "launch_pair", "launch_victim", "reference", "prefill", "queued_past_lease",
           "prefill_killed_mid_load"]

#: the prefill's lease (and the decode's: it renews queued requests every lease_s / 6)
LEASE_S = 5.0
#: the decode fails a silent load only after this long: a faster failure is the lifeline's
TIMEOUT_S = 30.0
MAX_TOKENS = 8


def launch_pair(python: str, model_dir, log_dir, block_size: int = 32) -> tuple[EngineProcess, EngineProcess]:
    """A TP1 prefill (its holds for the engine ``decode``, lease :data:`LEASE_S`) and a TP1 decode
    with one running slot (``max_num_seqs=1``: a second request waits in its queue), side by side."""
    p = EngineProcess.launch(
        python, model_dir, tp=1, role="kv_producer", port=free_port_range(1), block_size=block_size,
        extra={"lease_s": LEASE_S, "consumer": "decode", "handshake_timeout_s": 20.0},
        engine_id="prefill", log_dir=log_dir, name="prefill", cpus=engine_cpus(1, 0))
    try:
        d = EngineProcess.launch(
            python, model_dir, tp=1, role="kv_consumer", port=free_port_range(1), block_size=block_size,
            extra={"lease_s": LEASE_S, "timeout_s": TIMEOUT_S, "handshake_timeout_s": 5.0, "handshake_attempts": 1},
            engine_id="decode", log_dir=log_dir, name="decode", cpus=engine_cpus(1, 1),
            engine_options={"max_num_seqs": 1})
    except BaseException:
        p.kill()
        raise
    wait_all_ready([p, d])
    return p, d


def launch_victim(python: str, model_dir, log_dir, block_size: int = 32) -> EngineProcess:
    """A TP1 prefill engine ``victim`` whose holds name no consumer and are never packed ahead
    (``eager_guess`` off): a decode's load of one waits for its answer."""
    return EngineProcess.start(
        python, model_dir, tp=1, role="kv_producer", port=free_port_range(1), block_size=block_size,
        extra={"lease_s": TIMEOUT_S, "eager_guess": False, "handshake_timeout_s": 20.0},
        engine_id="victim", log_dir=log_dir, name="victim", cpus=engine_cpus(1, 0))


def reference(decode: EngineProcess, prompts, tag: str) -> list[list[int]]:
    """Greedy tokens of the decode engine computing each prompt itself."""
    out = decode.call("generate", requests=[{"id": f"{tag}{i}", "prompt": p, "max_tokens": MAX_TOKENS}
                                            for i, p in enumerate(prompts)])["outputs"]
    return [o["tokens"] for o in out]


def prefill(p: EngineProcess, prompts, tag: str) -> list[dict]:
    """The prompts prefilled (held for the decode); the ``kv_transfer_params`` of each."""
    out = p.call("generate", requests=[{"id": f"{tag}{i}", "prompt": q, "max_tokens": 1,
                                        "kv_transfer_params": {"do_remote_decode": True}}
                                       for i, q in enumerate(prompts)])["outputs"]
    return [o["kv_transfer_params"] for o in out]


def _decode_requests(prompts, params, tag: str) -> list[dict]:
    return [{"id": f"{tag}{i}", "prompt": q, "max_tokens": MAX_TOKENS, "kv_transfer_params": kp}
            for i, (q, kp) in enumerate(zip(prompts, params))]


def queued_past_lease(p: EngineProcess, d: EngineProcess, prompts, blocker, tag: str = "q") -> dict:
    """``prompts`` prefilled; their decode requests submitted behind ``blocker`` (a local request
    that takes the decode's one running slot), one step, then :data:`LEASE_S` x 2 with the decode
    not stepped (its agent's thread renews), then run. Returns ``tokens``, ``prompt_computed`` of
    each, and ``queued_s``: how long the first waited after its hold was placed (at least)."""
    params = prefill(p, prompts, f"{tag}-p")
    held_at = time.monotonic()
    reqs = [{"id": f"{tag}-block", "prompt": blocker, "max_tokens": MAX_TOKENS}] + _decode_requests(
        prompts, params, f"{tag}-d")
    d.call("submit", requests=reqs, steps=1)
    time.sleep(2 * LEASE_S)
    out = d.call("generate", requests=[], ids=[r["id"] for r in reqs], seconds=120, timeout_s=180)["outputs"][1:]
    at = d.call("kv_in", ids=[r["id"] for r in reqs[1:]])["at"]
    loaded = [t for t in at.values() if t is not None]
    return {"tokens": [o["tokens"] for o in out], "prompt_computed": [o["prompt_computed"] for o in out],
            "queued_s": (min(loaded) - held_at) if loaded else None}


def prefill_killed_mid_load(p: EngineProcess, d: EngineProcess, prompts, tag: str = "k") -> dict:
    """One request of ``p`` (:func:`launch_victim`) loaded (the decode meets it; ``warm_computed``:
    the prompt tokens the decode computed for it), ``prompts`` prefilled, ``p`` stopped, their
    decode loads started (3 steps), ``p`` SIGKILLed. Returns ``typed_s``: kill to each load's end
    as the decode's scheduler learned it, ``tokens``/``prompt_computed`` of each request,
    ``decode_alive``, and the decode's log line of its first failed load."""
    warm = d.call("generate", requests=_decode_requests(prompts[:1], prefill(p, prompts[:1], f"{tag}-wp"),
                                                        f"{tag}-w"))["outputs"]
    params = prefill(p, prompts, f"{tag}-p")
    p.signal(signal.SIGSTOP)  # a prefill that stops answering: the decode's pulls stay in flight
    try:
        reqs = _decode_requests(prompts, params, f"{tag}-d")
        d.call("submit", requests=reqs, steps=3)
    finally:
        killed_at = time.perf_counter()  # CLOCK_MONOTONIC, as the decode's kv_in
        p.kill()
    out = d.call("generate", requests=[], ids=[r["id"] for r in reqs], seconds=120, timeout_s=180)["outputs"]
    at = d.call("kv_in", ids=[r["id"] for r in reqs])["at"]
    failed = [line for line in d.log_tail(200_000).splitlines() if f"load of {tag}-d" in line and "failed" in line]
    return {"warm_computed": warm[0]["prompt_computed"],
            "typed_s": [None if t is None else t - killed_at for t in at.values()],
            "tokens": [o["tokens"] for o in out], "prompt_computed": [o["prompt_computed"] for o in out],
            "decode_alive": d.proc.poll() is None and _alive(d.info.get("pid")), "log": failed[:1]}


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    return True
