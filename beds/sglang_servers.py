"""Real SGLang servers on this CPU for the SGLang backend's Tier 2 tests and ``bench/pd_sglang.py``.

Each server is ``python -m beds.sglang_launch`` (SGLang's own ``launch_server`` with
the bed's observing hooks, :mod:`.sglang_hooks`) in the SGLang test bed's Python (``make
sglang-bed``), run on CPU the one way SGLang runs without its CUDA kernels: ``SGLANG_USE_CPU_ENGINE=1
--device cpu --attention-backend torch_native --disable-overlap-schedule``, gloo between TP ranks,
``SGLANG_CPU_OMP_THREADS_BIND`` giving each rank its own cores, ``--sleep-on-idle``. The parent (pytest, the bench)
needs only the standard library: it talks HTTP to the servers and reads the hooks' event files.

Requests are posted as SGLang's router (``sglang_router --pd-disaggregation --mini-lb``) posts
them: the same ``/generate`` body to the prefill and the decode server at once, carrying
``bootstrap_host``/``bootstrap_port`` (the prefill's bootstrap server) and one ``bootstrap_room``
per request. Greedy, ``ignore_eos``, a fixed ``max_new_tokens``; ``--skip-tokenizer-init``, so
prompts are token ids and answers ``output_ids``.

The model is a tiny random-weight Llama saved locally (:data:`SGLANG_LLAMA`, written by
:func:`make_model` in the bed's Python): ``--load-format dummy`` would draw weights per TP shard,
so a TP1 and a TP2 server would hold different models. Six KV heads split over TP 1, 2 and 3; a
vocabulary of 576 divides by 3 x 64.

SGLang's CPU path imports ops of the CPU build of sgl-kernel, which no registry publishes (PyPI's
``sglang-kernel`` is the CUDA build and needs ``libcuda.so.1``): unless ``real_kernels`` is asked
for, a server gets :mod:`sglang_cpu_ops`'s torch stand-in for the two memory ops the plain path
calls (its docstring names the SGLang lines).

Example (from the repository root, with the bed built)::

    model = make_model(".venv-sglang/bin/python", "/tmp/tiny")
    with ServerProcess.start(".venv-sglang/bin/python", model, tp=1, log_dir="/tmp") as plain:
        tokens = plain.generate([[1, 2, 3]], max_tokens=4)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from . import child_env
from .vllm_bed import engine_cpus, free_port_range
from .vllm_models import TinyLlama

__all__ = ["SGLANG_LLAMA", "ServerProcess", "BedEvents", "make_model", "pd_generate", "engine_cpus",
           "free_port_range", "CPU_ARGS"]

SGLANG_LLAMA = TinyLlama(layers=2, kv_heads=6, heads=6, head_dim=32, hidden=192, vocab=576)
# SGLang's CPU path (no sgl-kernel, no CUDA graphs, no overlap thread), float32 for TP-invariant
# greedy tokens, token ids in and out
CPU_OPS = Path(__file__).resolve().parent / "sglang_cpu_ops"  # holds the sgl_kernel stand-in
# --sleep-on-idle: an idle scheduler otherwise polls flat out (a ready TP2 prefill's two ranks held
# ~90% of a 2-core host while its decode started, which then took 3 min instead of 20 s); it sleeps
# only when fully idle (nothing queued, nothing in transfer), waking on the next request
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
            "--skip-tokenizer-init", "--dtype", "float32", "--random-seed", "0", "--disable-radix-cache",
            "--sleep-on-idle")


def make_model(python: str, path: str | os.PathLike, model: TinyLlama = SGLANG_LLAMA, timeout_s: float = 300) -> Path:
    """Write the tiny Llama to ``path`` with the bed's Python (which has transformers)."""
    path = Path(path)
    subprocess.run([python, "-m", "beds.vllm_models", "llama", str(path), json.dumps(model.__dict__)],
                   check=True, timeout=timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env())
    return path


class BedEvents:
    """What the hooks of one server's processes wrote (:mod:`.sglang_hooks`)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def events(self) -> list[dict]:
        out = []
        for f in sorted(self.folder.glob("*.jsonl")):
            for line in f.read_text().splitlines():
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except ValueError:  # a line being written
                        pass
        return out

    def counters(self) -> dict[str, int]:
        """The latest counters of each process, summed: ``nixl_descriptors``, ``nixl_posts`` and
        kvtriton's agent stats (``staged_descriptors``...)."""
        last: dict[int, dict] = {}
        for e in self.events():
            if e["event"] == "counters":
                last[e["pid"]] = e
        total: dict[str, int] = {}
        for e in last.values():
            for k, v in [("nixl_descriptors", e["nixl_descriptors"]), ("nixl_posts", e["nixl_posts"]),
                         *e["agent"].items()]:
                total[k] = total.get(k, 0) + int(v)
        return total

    def by_room(self, event: str) -> dict[int, list[dict]]:
        out: dict[int, list[dict]] = {}
        for e in self.events():
            if e["event"] == event and e.get("room") is not None:
                out.setdefault(e["room"], []).append(e)
        return out


class ServerProcess:
    """One SGLang HTTP server (all its ranks) in its own process group; ``close`` kills it all."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, url: str, events: BedEvents, tp: int,
                 bootstrap_port: int | None):
        self.proc, self.log_path, self.url, self.events = proc, log_path, url, events
        self.tp, self.bootstrap_port = tp, bootstrap_port

    @classmethod
    def start(cls, python: str, model_dir: str | os.PathLike, *, tp: int = 1, mode: str = "null",
              backend: str = "nixl", page_size: int = 16, cpus: str | None = None,
              log_dir: str | os.PathLike = ".", name: str = "server", env: dict | None = None,
              extra_args: tuple[str, ...] = (), max_total_tokens: int = 8192, real_kernels: bool = False,
              timeout_s: float = 600.0) -> ServerProcess:
        """``mode``: ``null`` (a plain server), ``prefill`` or ``decode``; ``backend``: SGLang's
        ``--disaggregation-transfer-backend`` (``nixl``, ``kvtriton``). Waits for ``/health`` up
        to ``timeout_s``."""
        server = cls.launch(python, model_dir, tp=tp, mode=mode, backend=backend, page_size=page_size, cpus=cpus,
                            log_dir=log_dir, name=name, env=env, extra_args=extra_args,
                            max_total_tokens=max_total_tokens, real_kernels=real_kernels)
        try:
            server.wait_ready(timeout_s)
        except BaseException:
            server.close()
            raise
        return server

    @classmethod
    def launch(cls, python: str, model_dir: str | os.PathLike, *, tp: int = 1, mode: str = "null",
               backend: str = "nixl", page_size: int = 16, cpus: str | None = None,
               log_dir: str | os.PathLike = ".", name: str = "server", env: dict | None = None,
               extra_args: tuple[str, ...] = (), max_total_tokens: int = 8192,
               real_kernels: bool = False) -> ServerProcess:
        """Spawns the server without waiting for it (``wait_ready``): a pair's two servers start
        side by side, each on its own cores (a start is minutes of CPU-bound imports and set-up
        on a small host), rather than one after the other."""
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        events = BedEvents(log_dir / f"{name}.events")
        port, nccl = free_port_range(1), free_port_range(1)
        cmd = [python, "-m", "beds.sglang_launch", "--model-path", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--tp", str(tp), "--nccl-port", str(nccl),
               "--page-size", str(page_size), "--max-total-tokens", str(max_total_tokens), *CPU_ARGS]
        bootstrap = None
        if mode != "null":
            cmd += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend]
            if mode == "decode":
                # the default backup of retracted requests is a host pool that SGLang pins with
                # cudaHostRegister (mem_cache/pool_host/common.py:147), which needs a CUDA driver
                cmd += ["--disaggregation-decode-retraction-backup", "none"]
            if mode == "prefill":  # kvtriton's rank r serves handshakes on bootstrap + 1 + r
                bootstrap = free_port_range(tp + 2)
                cmd += ["--disaggregation-bootstrap-port", str(bootstrap)]
        cmd += list(extra_args)
        env_out = child_env()
        env_out.update({
            "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": cpus or engine_cpus(tp, 0, 1),
            "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "lo", "SGLANG_HOST_IP": "127.0.0.1",
            "PYTHONUNBUFFERED": "1", "KVTRITON_SGLANG_BED_DIR": str(events.folder),
            # a PyPI torch (the CUDA build) brings libnccl, and SGLang's TP group then builds a
            # PyNcclCommunicator on the CPU device, which fails (parallel_state.py:464 ->
            # pynccl.py:116 torch.cuda.device(cpu)); a library that does not load turns it off,
            # as on a CPU torch build (pynccl.py:73-79)
            "SGLANG_NCCL_SO_PATH": "/nonexistent/kvtriton-bed-no-nccl.so",
            # a TP>1 rank's vocab-parallel embedding masks its input in a @torch.compile function
            # (inductor on CPU: vocab_parallel_embedding.py get_masked_input_and_mask): g++ builds
            # its kernel at the first forward, minutes on a loaded 2-core host without a warm
            # /tmp/torchinductor_* cache (a fresh CI machine); eager runs the same pointwise ops
            # (as beds.vllm_bed does for vLLM's engines)
            "TORCH_COMPILE_DISABLE": "1",
        })
        env_out.pop("TRITON_INTERPRET", None)
        env_out.update(env or {})
        if not real_kernels:
            env_out["PYTHONPATH"] = os.pathsep.join([str(CPU_OPS), *filter(None, [env_out.get("PYTHONPATH")])])
        log_path = log_dir / f"{name}.log"
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env_out, start_new_session=True)
        return cls(proc, log_path, f"http://127.0.0.1:{port}", events, tp, bootstrap)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def wait_all_ready(servers: list[ServerProcess], timeout_s: float = 600.0) -> None:
        """Waits for servers launched side by side; if one fails to start, every one is closed."""
        try:
            for server in servers:
                server.wait_ready(timeout_s)
        except BaseException:
            for server in servers:
                server.close()
            raise

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with {self.proc.returncode}; log: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError, TimeoutError):
                pass
            time.sleep(2)
        raise TimeoutError(f"SGLang server not healthy in {timeout_s} s; log: {self.log_tail()}")

    def post(self, path: str, body: dict, timeout_s: float = 300.0):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.url}{path}: HTTP {e.code}: {e.read()[:2000]!r}") from None

    def generate(self, prompts: list[list[int]], max_tokens: int, timeout_s: float = 300.0) -> list[list[int]]:
        """Greedy tokens of this (plain) server for each prompt."""
        out = self.post("/generate", _body(prompts, max_tokens), timeout_s)
        return [o["output_ids"] for o in out]

    def scramble(self, dtype: str | None = "float32") -> None:
        """The negative control (a prefill server): while on, its senders overwrite the pages
        they are about to send with noise in ``dtype`` (the pool's element type); ``None``: off."""
        path = self.events.folder / "scramble"
        if dtype:
            path.write_text(dtype)
        else:
            path.unlink(missing_ok=True)

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "<no log>"

    @staticmethod
    def close_all(servers: list[ServerProcess], timeout_s: float = 30.0) -> None:
        """Closes servers side by side: each process group gets its SIGTERM first (a server's
        shut-down takes seconds: SGLang waits 5 s before its crash diagnostics), then each is
        closed as :meth:`close` does."""
        for server in servers:
            if server.proc.poll() is None:
                try:
                    os.killpg(server.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for server in servers:
            server.close(timeout_s, terminated=True)

    def close(self, timeout_s: float = 30.0, terminated: bool = False) -> None:
        """SIGTERM the process group (unless ``terminated``: :meth:`close_all` sent it), then
        SIGKILL whatever is left of it (ranks included)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None and sig == signal.SIGTERM:
                sig = signal.SIGKILL  # the launcher is gone: its children may not be
            try:
                if not (terminated and sig == signal.SIGTERM):
                    os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGKILL:
                break
        if self.proc.poll() is None:
            print(f"sglang_servers: pid {self.proc.pid} still alive after SIGKILL", file=sys.stderr)


def _body(prompts, max_tokens: int) -> dict:
    return {"input_ids": [list(map(int, p)) for p in prompts],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}}


def pd_generate(prefill: ServerProcess, decode: ServerProcess, prompts: list[list[int]], max_tokens: int,
                rooms: list[int], timeout_s: float = 300.0) -> dict:
    """Post ``prompts`` the way SGLang's router does (one body to both servers at once, one
    bootstrap room per request); returns ``{"tokens": decode's output_ids per prompt, "prefill":
    the prefill's answers, "seconds": wall time of the whole exchange, "posted": time.time() at
    the post}``."""
    if prefill.bootstrap_port is None:
        raise ValueError("pd_generate needs a prefill server (started with mode='prefill')")
    body = {**_body(prompts, max_tokens), "bootstrap_host": ["127.0.0.1"] * len(prompts),
            "bootstrap_port": [prefill.bootstrap_port] * len(prompts), "bootstrap_room": list(rooms)}
    answers: dict[str, object] = {}

    def post(name, server):
        try:
            answers[name] = server.post("/generate", body, timeout_s)
        except BaseException as e:  # noqa: BLE001 - reported below
            answers[name] = e

    posted, t0 = time.time(), time.perf_counter()
    threads = [threading.Thread(target=post, args=(n, s), daemon=True) for n, s in (("prefill", prefill),
                                                                                      ("decode", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    seconds = time.perf_counter() - t0
    for name in ("prefill", "decode"):
        got = answers.get(name)
        if got is None:
            raise TimeoutError(f"{name} server gave no answer in {timeout_s} s")
        if isinstance(got, BaseException):
            raise RuntimeError(f"{name} server: {got}") from got
    return {"tokens": [o["output_ids"] for o in answers["decode"]], "prefill": answers["prefill"],
            "decode": answers["decode"], "seconds": seconds, "posted": posted}
