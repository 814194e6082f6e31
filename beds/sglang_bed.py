"""SGLang's real disaggregation classes in child processes, for the backend's conformance tests.

Runs in the SGLang test bed's interpreter (``make sglang-bed``), never in the main one: it
imports SGLang. ``python -m beds.sglang_bed CASE`` plays one case and prints one
JSON line (``tests/engines/test_sglang_conformance.py`` runs it and asserts on that line).

Each rank is a process of its own (``spawn``) holding what an SGLang scheduler would hand the
backend: the published ``ServerArgs`` of its engine (``publish`` with its world rank, the
``kvtriton`` plugin registered first, as SGLang's plugin loader does), a real
``MHATokenToKVPool`` (token-major ``[size + page, heads, head_dim]`` per layer, bf16) and
``MetadataBuffers``, ``KVArgs`` filled as ``prefill.py``/``decode.py`` fill them, and the
manager, sender and receiver ``get_kv_class`` returns for the backend. SGLang's bootstrap server
(``KVTritonKVBootstrapServer``) runs in this driver, up before any rank registers, or, in the
killed-prefill case, in the prefill's only rank, so killing the prefill kills it too, as when a
real prefill server dies. The driver (this process) plays both schedulers: it creates
senders and receivers, allocates pages, polls ``KVPoll`` states, and checks every byte of the
decode pages and metadata rows against a reference drawn here, with numpy, from the room's seed
(the prefill ranks write their head slice of it; the decode pools start as other random bytes).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from kvtriton.testing.child import AgentChild, ChildProcess

__all__ = ["CASES", "run_case", "pair_problems", "bytes_per_room"]

HEADS, HEAD_DIM, LAYERS, PAGE = 6, 8, 2, 4  # 6 KV heads: TP 1, 2 and 3 all divide them
POOL_TOKENS, AUX_ROWS, HIDDEN = 256, 8, 16
ITEM = 2  # bf16 bytes
POLL = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}

MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 96,
                "num_attention_heads": 12, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM,
                "num_hidden_layers": LAYERS, "intermediate_size": 64, "vocab_size": 128,
                "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}


def heads_of(rank: int, tp: int) -> list[int]:
    """The global KV heads an SGLang rank of TP ``tp`` holds (the model's sharding contract)."""
    if tp <= HEADS:
        return list(range(rank * HEADS // tp, (rank + 1) * HEADS // tp))
    return [rank * HEADS // tp]


def reference(seed: int, n_pages: int) -> np.ndarray:
    """``[layers, 2 (K, V), n_pages * PAGE tokens, HEADS, HEAD_DIM * 2 bytes]``, random bytes."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(LAYERS, 2, n_pages * PAGE, HEADS, HEAD_DIM * ITEM), dtype=np.uint8)


def aux_reference(seed: int, item_lens: list[int]) -> list[bytes]:
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in item_lens]


# ---------------------------------------------------------------------------------------- a rank
def _rank_main(conn, role: str, rank: int, tp: int, cfg: dict) -> None:
    os.environ.update(cfg.get("env", {}))
    import torch
    from sglang.srt.disaggregation import utils as disagg_utils
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, MetadataBuffers, TransferBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    from kvtriton.integrations.sglang import plugin

    plugin.register()  # what SGLang's loader does in each process, before parsing arguments
    kv_class = disagg_utils.get_kv_class  # the hooked one (a name bound before the hook would be SGLang's)
    backend = TransferBackend("kvtriton")
    server_args = ServerArgs(model_path=cfg["model"], device="cpu", tp_size=tp, host="127.0.0.1",
                             port=cfg["http_port"], disaggregation_mode=role,
                             disaggregation_transfer_backend="kvtriton",
                             disaggregation_bootstrap_port=cfg["bootstrap_port"], skip_server_warmup=True)
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(pp_group=None)  # no process groups here; read only when pp_size > 1
    bootstrap = None
    if role == "prefill" and rank == 0 and cfg.get("bootstrap_in_rank0"):
        bootstrap = kv_class(backend, KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", cfg["bootstrap_port"])
    local = len(heads_of(rank, tp))
    pool = MHATokenToKVPool(POOL_TOKENS, PAGE, torch.bfloat16, local, HEAD_DIM, LAYERS, "cpu", False)
    junk = torch.Generator().manual_seed(cfg["junk_seed"] + rank)
    for buf in (*pool.k_buffer, *pool.v_buffer):  # never zeros: an untouched page must not match
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, generator=junk,
                                                  dtype=torch.uint8))
    meta = MetadataBuffers(AUX_ROWS, HIDDEN, torch.float32, 4)
    args = KVArgs()
    args.engine_rank, args.pp_rank, args.system_dp_rank, args.rust_http_port = rank, 0, 0, None
    args.kv_cache_dtype_str, args.kv_layout = "bfloat16", None
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    args.kv_layer_ids = list(range(LAYERS)) * 2
    args.num_draft_entries, args.prefill_start_layer, args.prefill_end_layer = 0, 0, LAYERS
    if role == "prefill":  # what prefill.py states; decode.py leaves head counts out
        args.kv_head_num, args.total_kv_head_num = local, HEADS
    args.page_size = PAGE
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
    args.state_types, args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], [], []
    args.state_layer_ids, args.state_dim_per_tensor = [], []
    args.ib_device, args.gpu_id = None, 0
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    mgr = kv_class(backend, KVClassType.MANAGER)(args, mode, server_args, False)
    peers: dict[int, object] = {}

    def buffers_of(name):
        return [t for t in pool.k_buffer] if name == "k" else [t for t in pool.v_buffer]

    def fill(room, seed, pages, aux_index):  # this rank's head slice of the room's reference
        ref = reference(seed, len(pages))
        hs = heads_of(rank, tp)
        for layer in range(LAYERS):
            for s, name in enumerate(("k", "v")):
                buf = buffers_of(name)[layer].view(torch.uint8)
                for j, page in enumerate(pages):
                    rows = torch.from_numpy(ref[layer, s, j * PAGE:(j + 1) * PAGE][:, hs].copy())
                    buf[page * PAGE:(page + 1) * PAGE].copy_(rows.view(PAGE, len(hs), -1))
        _write_aux(meta, aux_index, aux_reference(seed, list(args.aux_item_lens)))

    def read(pages, aux_index):
        out = []
        for layer in range(LAYERS):
            for name in ("k", "v"):
                buf = buffers_of(name)[layer].view(torch.uint8)
                out.append(np.stack([buf[p * PAGE:(p + 1) * PAGE].numpy().copy() for p in pages]))
        return {"kv": out, "aux": _read_aux(meta, aux_index), "heads": heads_of(rank, tp)}

    def sender(room, addr):
        peers[room] = kv_class(backend, KVClassType.SENDER)(mgr, addr, room)

    def send(room, pages, aux_index, chunks):
        s = peers[room]
        s.init(len(pages), aux_index)
        parts = np.array_split(np.asarray(pages, dtype=np.int64), chunks)
        for part in parts:
            s.send(part)

    def receiver(room, addr):
        deadline = time.monotonic() + 30
        while not mgr.try_ensure_parallel_info(addr):  # decode.py's bootstrap queue does this
            if time.monotonic() > deadline:
                raise TimeoutError(f"no prefill info from {addr}")
            time.sleep(0.2)
        r = peers[room] = kv_class(backend, KVClassType.RECEIVER)(mgr, addr, room)
        r.init(0)

    def failure(room):
        try:
            peers[room].failure_exception()
        except Exception as e:  # noqa: BLE001 - SGLang's KVTransferError, reported as text
            return str(e)
        return ""

    def clear(room):
        peers.pop(room).clear()

    def leaks():
        st = mgr.agent.debug_state()
        role_rooms = (mgr.prefill or mgr.decode).rooms()
        return {"staging_in_use": st["staging"]["num_slots"] - st["staging"]["free_slots"], "holds": len(st["holds"]),
                "fetches": len(st["fetches"]), "rooms": role_rooms, "status_rooms": len(mgr.request_status)}

    commands = {
        "fill": fill, "read": read, "sender": sender, "send": send, "receiver": receiver,
        "send_metadata": lambda room, pages, aux_index: peers[room].send_metadata(np.asarray(pages, np.int32),
                                                                                  aux_index),
        "poll": lambda room: int(peers[room].poll()), "abort": lambda room: peers[room].abort(),
        "failure": failure, "clear": clear, "leaks": leaks, "engine": lambda: mgr.agent.engine_id,
        "agent": lambda: mgr.agent.transport.name,
        "zmq": lambda: [mgr.local_ip, mgr.rank_port], "refused": lambda: mgr.refused_messages,
        "inline_steps": lambda: mgr.inline.steps,
        "aux_lens": lambda: [int(n) for n in args.aux_item_lens],
    }
    child = AgentChild(conn, [], commands, step=lambda: None, busy=lambda: False, idle_wait_s=0.01,
                       errors=(Exception,))
    try:
        child.ready({"rank": rank, "role": role})
        child.run()
    finally:
        mgr.close()
        if bootstrap is not None:
            bootstrap.close()


def _write_aux(meta, index: int, rows: list[bytes]) -> None:
    import torch

    for buf, row in zip(_aux_tensors(meta), rows):
        row_view = buf.view(torch.uint8).reshape(buf.shape[0], -1)[index]
        row_view.copy_(torch.frombuffer(bytearray(row), dtype=torch.uint8))


def _read_aux(meta, index: int) -> list[bytes]:
    import torch

    return [buf.view(torch.uint8).reshape(buf.shape[0], -1)[index].numpy().tobytes() for buf in _aux_tensors(meta)]


def _aux_tensors(meta):
    """SGLang's metadata buffers in ``get_buf_infos`` order (matched by pointer)."""
    ptrs = meta.get_buf_infos()[0]
    found = {t.data_ptr(): t for t in vars(meta).values() if hasattr(t, "data_ptr") and hasattr(t, "shape")}
    return [found[p] for p in ptrs]


# ---------------------------------------------------------------------------------------- the driver
class Engine:
    """The ranks of one SGLang engine (prefill or decode), each a child process."""

    def __init__(self, role: str, tp: int, cfg: dict, name: str):
        self.role, self.tp, self.name = role, tp, name
        self.addr = f"127.0.0.1:{cfg['bootstrap_port']}"
        self.bootstrap = None
        if role == "prefill" and not cfg.get("bootstrap_in_rank0"):
            # up before any rank registers (a rank that starts first would exhaust its retries)
            from sglang.srt.disaggregation import utils as disagg_utils

            from kvtriton.integrations.sglang import plugin

            plugin.register()
            cls = disagg_utils.get_kv_class(disagg_utils.TransferBackend("kvtriton"),
                                            disagg_utils.KVClassType.BOOTSTRAP_SERVER)
            self.bootstrap = cls("127.0.0.1", cfg["bootstrap_port"])
        self.ranks = [ChildProcess(_rank_main, role, r, tp, cfg, name=f"{name}{r}") for r in range(tp)]

    def ready(self, timeout_s: float = 600) -> None:  # SGLang imports for minutes on a loaded 2-core host
        for p in self.ranks:
            p.ready(timeout_s)

    def each(self, cmd: str, *args, timeout_s: float = 60):
        return [p.call(cmd, *args, timeout_s=timeout_s) for p in self.ranks]

    def wait(self, room: int, want: set[str], timeout_s: float = 60) -> list[str]:
        """Poll every rank until each is in one of ``want`` (or Failed); the states."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = [POLL[s] for s in self.each("poll", room)]
            if all(s in want or s == "Failed" for s in states) or time.monotonic() > deadline:
                return states
            time.sleep(0.05)

    def kill(self) -> None:
        for p in self.ranks:
            p.process.kill()
            p.process.join(10)

    def close(self) -> None:
        for p in self.ranks:
            p.close(10)
        if self.bootstrap is not None:
            self.bootstrap.close()


def _room_pages(rng, n_pages: int) -> list[int]:
    """Scattered page ids (page 0 is SGLang's padding page), in a random order."""
    return [int(x) for x in rng.choice(np.arange(1, POOL_TOKENS // PAGE), size=n_pages, replace=False)]


def _check(decode: Engine, room: int, seed: int, pages: list[int], aux_index: int) -> dict:
    """Every byte of the decode pages and metadata rows against the reference."""
    ref = reference(seed, len(pages))
    checked = mismatched = aux_bad = 0
    for got in decode.each("read", pages, aux_index):
        hs = got["heads"]
        for i, arr in enumerate(got["kv"]):
            want = ref[i // 2, i % 2].reshape(len(pages), PAGE, HEADS, -1)[:, :, hs]
            checked += want.size
            mismatched += int((arr.reshape(want.shape) != want).sum())
        aux_bad += sum(a != b for a, b in zip(got["aux"], aux_reference(seed, [len(a) for a in got["aux"]])))
    return {"bytes_checked": checked, "bytes_mismatched": mismatched, "aux_rows_mismatched": aux_bad}


def _transfer(prefill: Engine, decode: Engine, room: int, seed: int, n_tokens: int, rng, *, abort: bool = False,
              check_before: bool = False) -> dict:
    """One request as SGLang's two schedulers drive it; the states, failures and byte checks."""
    n_pages = -(-n_tokens // PAGE)
    d_pages, p_pages = _room_pages(rng, n_pages), _room_pages(rng, n_pages)
    d_aux, p_aux = int(rng.integers(AUX_ROWS)), int(rng.integers(AUX_ROWS))
    out: dict = {"room": room, "tokens": n_tokens}
    decode.each("receiver", room, prefill.addr)
    prefill.each("sender", room, prefill.addr)
    out["decode_bootstrapped"] = decode.wait(room, {"WaitingForInput"})
    if check_before:  # the control: the decode pages do not hold the reference before the transfer
        out["before"] = _check(decode, room, seed, d_pages, d_aux)
    decode.each("send_metadata", room, d_pages, d_aux)
    out["prefill_bootstrapped"] = prefill.wait(room, {"WaitingForInput"})
    if abort:
        decode.each("abort", room)
        out["decode"] = decode.wait(room, {"Success"})
        out["prefill"] = prefill.wait(room, {"Success"}, timeout_s=20)
    else:
        prefill.each("fill", room, seed, p_pages, p_aux)
        prefill.each("send", room, p_pages, p_aux, 2)
        out["decode"] = decode.wait(room, {"Success"})
        out["prefill"] = prefill.wait(room, {"Success"})
    out["decode_failures"] = [f for f in decode.each("failure", room)] if "Failed" in out["decode"] else []
    out["prefill_failures"] = [f for f in prefill.each("failure", room)] if "Failed" in out["prefill"] else []
    if not abort and "Failed" not in out["decode"]:
        out.update(_check(decode, room, seed, d_pages, d_aux))
    for e in (decode, prefill):
        if "Failed" not in out[e.role]:
            e.each("clear", room)
    return out


def _rogue(prefill: Engine, decode: Engine, room: int, seed: int, n_tokens: int, rng) -> dict:
    """One honest room while a client without the cluster secret forges WANT (to the prefill, before
    the decode's), READY and STATUS (to the decode, while it waits for the prefill's READY):
    unsealed, and sealed under another key. The room must succeed byte-exact, every forgery refused."""
    import secrets

    import zmq

    from kvtriton.integrations.sglang.messages import STATUS_TAG, Abort, Ready, Want
    from kvtriton.protocol.auth import PairKeys
    from kvtriton.protocol.seal import ControlSigner

    n_pages = -(-n_tokens // PAGE)
    d_pages, p_pages = _room_pages(rng, n_pages), _room_pages(rng, n_pages)
    d_aux, p_aux = int(rng.integers(AUX_ROWS)), int(rng.integers(AUX_ROWS))
    out: dict = {"room": room, "tokens": n_tokens}
    p_engine = prefill.each("engine")[0]
    (p_ip, p_port), (d_ip, d_port) = prefill.each("zmq")[0], decode.each("zmq")[0]
    # seal v3 is under each pair's meeting keys: the forger met no one, so it makes keys up, and
    # claims the name of the agent each receiver did meet (the decode's to the prefill, and back)
    p_agent, d_agent = prefill.each("agent")[0], decode.each("agent")[0]
    forgers = {}
    for name, to in ((d_agent, p_agent), (p_agent, d_agent)):
        forgers[to] = ControlSigner(agent=name)
        forgers[to].learn(to, "rogue", 0, PairKeys(send=secrets.token_bytes(32), recv=secrets.token_bytes(32)))
    ctx = zmq.Context()
    push_p, push_d = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    to = {id(push_p): p_agent, id(push_d): d_agent}
    for sock, ip, port in ((push_p, p_ip, p_port), (push_d, d_ip, d_port)):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{ip}:{port}")

    def forge(sock, frames) -> int:
        sock.send_multipart(frames)  # unsealed
        sock.send_multipart(forgers[to[id(sock)]].seal(frames, to[id(sock)]))  # sealed under keys of no meeting
        return 2

    def refused(engine: Engine, n: int) -> int:
        deadline = time.monotonic() + 30
        while (got := engine.each("refused")[0]) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    try:
        decode.each("receiver", room, prefill.addr)
        prefill.each("sender", room, prefill.addr)
        out["decode_bootstrapped"] = decode.wait(room, {"WaitingForInput"})
        # claim the room for another decode engine before the real one asks
        sent_p = forge(push_p, Want(room, "sglang-decode@rogue:1", 0, "127.0.0.1", 9, 0).to_zmq())
        out["prefill_refused_before_want"] = refused(prefill, sent_p)
        decode.each("send_metadata", room, d_pages, d_aux)
        out["prefill_bootstrapped"] = prefill.wait(room, {"WaitingForInput"})
        # abort the room on the prefill, as SGLang's ABORT and as ours in the decode's name
        d_engine = decode.each("engine")[0]
        sent_p += forge(push_p, [b"ABORT", str(room).encode()])
        sent_p += forge(push_p, Abort(room, d_engine, 0).to_zmq())
        out["prefill_refused_after_want"] = refused(prefill, sent_p)
        # the decode waits for READY: feed it other page ids and metadata rows, and fail the room
        lens = decode.each("aux_lens")[0]
        fake = Ready(room, p_engine, 0, np.asarray(_room_pages(rng, n_pages), np.int64),
                     tuple(rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lens))
        sent_d = forge(push_d, fake.to_zmq())
        sent_d += forge(push_d, [STATUS_TAG, str(room).encode(), b"0", b"0", b"forged failure"])
        out["decode_refused_before_ready"] = refused(decode, sent_d)
        prefill.each("fill", room, seed, p_pages, p_aux)
        prefill.each("send", room, p_pages, p_aux, 2)
        out["decode"] = decode.wait(room, {"Success"})
        out["prefill"] = prefill.wait(room, {"Success"})
        out["decode_failures"] = decode.each("failure", room) if "Failed" in out["decode"] else []
        out["prefill_failures"] = prefill.each("failure", room) if "Failed" in out["prefill"] else []
        if "Failed" not in out["decode"]:
            out.update(_check(decode, room, seed, d_pages, d_aux))
        out["refused"] = {"prefill": prefill.each("refused"), "decode": decode.each("refused")}
        out["sent"] = {"prefill": sent_p, "decode": sent_d}
        for e in (decode, prefill):
            if "Failed" not in out[e.role]:
                e.each("clear", room)
    finally:
        push_p.close()
        push_d.close()
        ctx.term()
    return out


def _config(base_port: int, model: str, http_port: int, env: dict, bootstrap_in_rank0: bool = False) -> dict:
    """One engine's settings. ``bootstrap_in_rank0``: SGLang's bootstrap server lives (and dies)
    with prefill rank 0 (TP1 engines only: another rank could start before it); else this
    driver hosts it."""
    return {"bootstrap_port": base_port, "http_port": http_port, "model": model, "junk_seed": base_port, "env": env,
            "bootstrap_in_rank0": bootstrap_in_rank0}


def run_case(case: str, *, base_port: int, model: str, seed: int = 0) -> dict:
    """Play ``case`` (see :data:`CASES`); everything it observed, as plain values."""
    rng = np.random.default_rng(seed)
    env = {"SGLANG_HOST_IP": "127.0.0.1",
           "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
           "KVTRITON_SGLANG_CONFIG": json.dumps({"timeout_s": 10.0, "lease_s": 20.0, "staging_bytes": 4 << 20,
                                                 "slot_bytes": 16 << 10})}
    engines: list[Engine] = []
    try:
        if case == "rogue":  # the cluster runs with a shared secret: its control messages are sealed
            secret = os.path.join(model, "kvtriton-secret")
            with open(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(os.urandom(32).hex().encode())
            env = {**env, "KVTRITON_AUTH_SECRET_FILE": secret}
            p = Engine("prefill", 1, _config(base_port, model, base_port + 50, env), "P")
            d = Engine("decode", 1, _config(base_port + 20, model, base_port + 51, env), "D")
            engines = [p, d]
            for e in engines:
                e.ready()
            out = {"case": case, "room": _rogue(p, d, 300, seed + 300, 19, rng)}
            out["abort"] = _transfer(p, d, 301, seed + 301, 11, rng, abort=True)  # the sealed KVT_ABORT
            out["refused_after"] = {"prefill": p.each("refused"), "decode": d.each("refused")}
            out["inline_steps"] = {"prefill": p.each("inline_steps"), "decode": d.each("inline_steps")}
            time.sleep(0.5)
            out["leaks"] = {"decode": d.each("leaks"), "prefill": p.each("leaks")}
            return out
        if case == "killed_prefill":
            a = Engine("prefill", 1, _config(base_port, model, base_port + 50, env, True), "PA")
            b = Engine("prefill", 1, _config(base_port + 10, model, base_port + 51, env, True), "PB")
            d = Engine("decode", 1, _config(base_port + 20, model, base_port + 52, env), "D")
            engines = [a, b, d]
            for e in engines:
                e.ready()
            out: dict = {"case": case}
            # room 1 reaches prefill A, which dies before it sends; room 2 on B must be unaffected
            d.each("receiver", 11, a.addr)
            a.each("sender", 11, a.addr)
            d.wait(11, {"WaitingForInput"})
            d.each("send_metadata", 11, _room_pages(rng, 3), 1)
            a.wait(11, {"WaitingForInput"})
            a.kill()
            out["killed_room"] = d.wait(11, {"Success"}, timeout_s=60)
            out["killed_failures"] = d.each("failure", 11)
            out["other"] = _transfer(b, d, 12, seed + 12, 21, rng)
            out["leaks"] = {"decode": d.each("leaks"), "prefill": b.each("leaks")}
            return out
        p_tp, d_tp = (int(x) for x in case.split("-"))
        p = Engine("prefill", p_tp, _config(base_port, model, base_port + 50, env), "P")
        d = Engine("decode", d_tp, _config(base_port + 20, model, base_port + 51, env), "D")
        engines = [p, d]
        for e in engines:
            e.ready()
        out = {"case": case, "engines": {"prefill": p.each("engine")[0], "decode": d.each("engine")[0]}, "rooms": []}
        for i, n_tokens in enumerate((13, 30, 7)):  # not multiples of the page size
            out["rooms"].append(_transfer(p, d, 100 + i, seed + i, n_tokens, rng, check_before=i == 0))
        out["abort"] = _transfer(p, d, 200, seed + 200, 17, rng, abort=True)
        out["after_abort"] = _transfer(p, d, 201, seed + 201, 9, rng)
        time.sleep(0.5)
        out["leaks"] = {"decode": d.each("leaks"), "prefill": p.each("leaks")}
        return out
    finally:
        for e in engines:
            e.close()


CASES = ("1-2", "2-1", "2-3", "killed_prefill", "rogue")


def bytes_per_room(tokens: int, d_tp: int) -> int:
    """Bytes of the decode pages a room of ``tokens`` fills, over its ``d_tp`` ranks (whole pages;
    a rank holding fewer heads than one still holds one)."""
    heads = sum(max(1, HEADS // d_tp) for _ in range(d_tp))
    return LAYERS * 2 * -(-tokens // PAGE) * PAGE * heads * HEAD_DIM * ITEM


def pair_problems(got: dict) -> list[str]:
    """The oracles of a TP pair case (``P-D`` in :data:`CASES`) over what :func:`run_case`
    returned: the control (the decode pages did not hold the reference before the first
    transfer), every room Success on every rank with every byte and metadata row equal to the
    reference, the abort failing on both sides with its reasons, nothing leaked. Empty: all hold.
    One place for them: ``test_sglang_conformance.py`` runs the pair CI keeps (2-3),
    ``bench/sglang_pairs.py`` every pair."""
    d_tp = int(got["case"].split("-")[1])
    out: list[str] = []
    first = got["rooms"][0]
    if not (first["before"]["bytes_mismatched"] > 0 and first["before"]["aux_rows_mismatched"] > 0):
        out.append(f"control: the decode held the reference before the transfer: {first['before']}")
    for room in got["rooms"] + [got["after_abort"]]:
        if room["decode"] != ["Success"] * d_tp or set(room["prefill"]) != {"Success"}:
            out.append(f"room not Success on every rank: {room}")
        if room["bytes_checked"] != bytes_per_room(room["tokens"], d_tp):
            out.append(f"bytes checked {room['bytes_checked']} != {bytes_per_room(room['tokens'], d_tp)}: {room}")
        if room["bytes_mismatched"] or room["aux_rows_mismatched"]:
            out.append(f"bytes or metadata rows differ from the reference: {room}")
    abort = got["abort"]
    if abort["decode"] != ["Failed"] * d_tp or set(abort["prefill"]) != {"Failed"}:
        out.append(f"abort not Failed on both sides: {abort}")
    if not all("Aborted" in f for f in abort["decode_failures"]):
        out.append(f"decode failures without Aborted: {abort['decode_failures']}")
    if not all("RequestAbortedError" in f for f in abort["prefill_failures"]):
        out.append(f"prefill failures without RequestAbortedError: {abort['prefill_failures']}")
    for side in got["leaks"].values():
        for rank in side:
            if rank != {"staging_in_use": 0, "holds": 0, "fetches": 0, "rooms": 0, "status_rooms": 0}:
                out.append(f"leak: {got['leaks']}")
    return out


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=CASES)
    ap.add_argument("--base-port", type=int, required=True)
    ap.add_argument("--model", required=True, help="a directory holding the model's config.json (no weights)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(json.dumps(run_case(a.case, base_port=a.base_port, model=a.model, seed=a.seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
