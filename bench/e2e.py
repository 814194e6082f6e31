"""End-to-end time of one request between two processes over NIXL (UCX on 127.0.0.1).

Llama-3-70B-like geometry (8 KV heads, head_dim 128, bf16, K and V separate, 16-token blocks),
prefill TP4 -> decode TP8, seen from decode rank 0: it needs head 0 of prefill rank 0's two heads
for every layer, K/V and block. ``layers`` is cut down from 80 so the run fits a 2-core machine;
the descriptor sizes are the real ones. Methods, all moving the same bytes into decode rank 0:

* ``kvtriton staged``: TransferAgent pull: the prefill packs from an **NHD** cache into staging,
  decode READs one descriptor per chunk and unpacks into its HND cache; control messages included.
  Timed from ``fetch`` to its result; the prefill's ``hold`` is placed before the clock starts.
* ``kvtriton staged, pull eager``: the hold names the decode engine, so the prefill packs at hold
  time and offers the pack to the decode rank (kvtriton.agent.eager); the clock starts once the
  decode has the offer, as when it asks some time after the prefill finished: it READs at once,
  no pull and no wait for the prefill process.
* ``kvtriton staged, pull eager-guess``: the same, but the hold names no consumer (as the vLLM
  connector's holds): the prefill packs for the only decode engine connected to it
  (``eager_guess``) and offers it; the note gives lazy pull (same chunks) / this.
* ``vLLM-style direct``: one 4 KiB descriptor per (layer, K/V, block) head slice, read from an
  HND copy of the cache (the layout that makes a head slice contiguous), prepared lists.
* ``per-token``: one 256 B descriptor per (layer, K/V, token), read from the NHD cache.
* ``single descriptor``: the same payload as one contiguous READ (the transport's floor).

Plus the staged path's parts timed alone: pack (in the prefill process), the one-descriptor
transfer, unpack (in the decode process). Every method's result is checked byte for byte once.
Run alone: ``python bench/e2e.py [--layers N]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import qfields, quantiles_ms, quantiles_of  # bench/timing.py

HEADS, HEAD_DIM, BLOCK, P_TP, D_TP = 8, 128, 16, 4, 8


def _caches(layers: int, num_blocks: int, seed: int):
    """Prefill rank 0's caches: NHD (K, V per layer) and an HND copy with the same content."""
    import torch

    from kvtriton.testing.oracle import random_bits

    gen = torch.Generator().manual_seed(seed)
    nhd = [[random_bits((num_blocks, BLOCK, 2, HEAD_DIM), torch.bfloat16, gen) for _ in range(2)]
           for _ in range(layers)]
    return nhd


def _busy_neighbor(deadline: float) -> None:
    """A CPU-bound neighbor (a busy serving process): spins until ``deadline`` (monotonic), so a
    bench that dies cannot leave it running for long."""
    x = 0
    while time.monotonic() < deadline:
        x += 1


def _prefill(conn, layers: int, num_blocks: int, variants: list[dict], reps: int) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(1)
    from kvtriton import Region
    from kvtriton.agent import TransferAgent
    from kvtriton.ops import pack
    from kvtriton.plan import build_plan
    from kvtriton.transport.nixl import NixlTransport

    nhd = _caches(layers, num_blocks, seed=1)
    hnd = [[t.transpose(1, 2).contiguous() for t in kv] for kv in nhd]  # bench-only HND copy
    # bench-only vLLM 0.33 layout: K||V together per (head, token), head-major blocks
    joint = [torch.cat(kv, -1).transpose(1, 2).contiguous() for kv in nhd]
    regions = [Region.attention(f"layer.{i}", k, v, layout="NHD", block_size=BLOCK, total_heads=HEADS)
               for i, (k, v) in enumerate(nhd)]
    agents = [TransferAgent(f"P{i}", 0, P_TP, regions, **kw) for i, kw in enumerate(variants)]
    raw = NixlTransport(f"P-raw-{os.getpid()}")
    flat = [t for kv in nhd for t in kv] + [t for kv in hnd for t in kv] + joint
    payload = torch.randint(0, 256, (layers * 2 * num_blocks * BLOCK * HEAD_DIM * 2,), dtype=torch.uint8)
    raw.register(flat + [payload])
    conn.send(dict(agent_md=[a.metadata() for a in agents], raw_md=raw.metadata(), raw_name=raw.name,
                   nhd=[[t.data_ptr() for t in kv] for kv in nhd], hnd=[[t.data_ptr() for t in kv] for kv in hnd],
                   joint=[t.data_ptr() for t in joint], payload=payload.data_ptr()))
    try:
        while True:
            if conn.poll(0.0005 if all(a.idle() for a in agents) else 0):
                cmd, *args = conn.recv()
                if cmd == "add_remote":
                    for a, md in zip(agents, args[0]):
                        a.add_remote(md)
                    raw.add_remote(args[1])
                    conn.send("ok")
                elif cmd == "hold":  # (req, ids, variant, consumer or None, chunks, packed ahead)
                    a, ahead = agents[args[2]], args[5]
                    end = time.monotonic() + 30
                    while ahead and a.pool.free_slots < a.pool.num_slots and time.monotonic() < end:
                        a.progress()  # the last request's ack: its staging is back
                    offers = a.stats["eager_offers"]
                    a.hold(args[0], args[1], lease_s=120, consumer=args[3])
                    end = time.monotonic() + 30
                    while ahead and a.stats["eager_offers"] == offers and time.monotonic() < end:
                        a.progress()  # packed, and offered to the decode rank
                    conn.send(dict(packed=a.packed_ahead(args[0]), hits=a.stats["eager_hits"]))
                elif cmd == "time_pack":
                    plan = build_plan(0, D_TP, args[1], P_TP, agents[0].specs)  # what the agents pack for D0
                    read = plan.staged_read(0)
                    ids = np.asarray(args[0])
                    staging = torch.empty(read.payload_bytes(ids.size), dtype=torch.uint8)
                    offs = read.segment_offsets(ids.size)
                    conn.send(quantiles_ms(lambda: pack(regions, read.segments, offs, ids, staging, impl="torch"),
                                           reps))
                elif cmd == "exit":
                    conn.send("ok")
                    break
            for a in agents:
                a.progress()
            raw.poll_notifs()  # the passive side of the raw READs must be driven too
    finally:
        for a in agents:
            a.close()
        raw.close()


def run_e2e_bench(quick: bool = False, layers: int | None = None, tokens: int = 8192,
                  variants: list[tuple[str, int, int]] | None = None, busy: int = 0,
                  per_token: bool = True, transport: str = "") -> list[dict]:
    """One process pair, one transport (whatever ``UCX_TLS`` this process started with).

    ``variants``: kvtriton configurations as (mode, chunks per request, chunks in flight[, eager]);
    default: one chunk (pull and push), 8 pipelined chunks (pull) and one chunk packed at hold
    time (pull, eager: True, the hold names its consumer; ``"guess"``, it names none and the
    prefill guesses its only connected engine; staging and ``eager_bytes`` fit the whole
    request). ``busy``: CPU-bound
    neighbor processes spinning on the same cores for the whole measurement (bounded: they stop
    by themselves after 300 s). ``per_token``: time the (slow) per-token baseline too.
    """
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from kvtriton import Region
    from kvtriton.agent import TransferAgent
    from kvtriton.ops import unpack
    from kvtriton.plan import ceil_div
    from kvtriton.transport.nixl import NixlTransport

    layers = layers or (4 if quick else 16)
    reps = 5 if quick else 9
    n = tokens // BLOCK
    num_blocks = n + 8
    payload = layers * 2 * n * BLOCK * HEAD_DIM * 2  # bytes decode rank 0 receives
    variants = [tuple(v) + (False,) * (4 - len(v)) for v in
                (variants or [("pull", 1, 1), ("push", 1, 1), ("pull", 8, 2), ("pull", 1, 1, True),
                              ("pull", 1, 1, "guess")])]
    slot = 256 << 10
    agent_kw = []
    for mode, chunks, inflight, eager in variants:
        chunk = ceil_div(payload // chunks, slot) * slot
        # eager: the whole request packed ahead, plus the staging its engine's lazy pulls keep
        staging = ((chunks + inflight) if eager else inflight) * chunk
        agent_kw.append(dict(staging_bytes=staging, slot_bytes=slot, chunk_bytes=chunk, mode=mode,
                             inflight_chunks=inflight, impl="torch", timeout_s=60,
                             eager_bytes=chunks * chunk if eager else 0, eager_guess=eager == "guess"))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill, args=(child, layers, num_blocks, agent_kw, reps), daemon=True)
    proc.start()
    neighbors = [ctx.Process(target=_busy_neighbor, args=(time.monotonic() + 300,), daemon=True)
                 for _ in range(busy)]
    rows: list[dict] = []
    agents: list = []
    raw = None
    try:
        if not parent.poll(120):
            raise TimeoutError("prefill process did not start")
        info = parent.recv()
        rng = np.random.default_rng(0)
        src_ids = rng.permutation(num_blocks)[:n]
        dst_ids = rng.permutation(num_blocks)[:n]
        k_caches = [[torch.empty(num_blocks, 1, BLOCK, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
                    for _ in range(layers)]
        # the vLLM 0.33 layout on the decode side: K||V per (head, token), one head per rank
        joint = [torch.empty(num_blocks, 1, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16) for _ in range(layers)]
        regions = [Region.attention(f"layer.{i}", k, v, layout="HND", block_size=BLOCK, total_heads=HEADS)
                   for i, (k, v) in enumerate(k_caches)]
        agents = [TransferAgent(f"D{i}", 0, D_TP, regions, **kw) for i, kw in enumerate(agent_kw)]
        raw = NixlTransport(f"D-raw-{os.getpid()}")
        flat = [t for kv in k_caches for t in kv]
        landing = torch.empty(payload, dtype=torch.uint8)
        raw.register(flat + joint + [landing])
        for a, md in zip(agents, info["agent_md"]):
            a.add_remote(md)
        raw_peer = raw.add_remote(info["raw_md"])
        parent.send(("add_remote", [a.metadata() for a in agents], raw.metadata()))
        parent.recv()
        for nb in neighbors:
            nb.start()

        expected = _expected(layers, num_blocks, src_ids)

        def check(what: str) -> None:
            for i, (k, v) in enumerate(k_caches):
                for j, t in enumerate((k, v)):
                    got = t[torch.as_tensor(dst_ids)].view(torch.uint8)
                    if not torch.equal(got, expected[i][j]):
                        raise AssertionError(f"{what}: layer {i} stream {j} differs from the source head")

        def check_joint() -> None:
            for i, t in enumerate(joint):
                got = t[torch.as_tensor(dst_ids)].view(torch.uint8)
                if not torch.equal(got, torch.cat(expected[i], -1)):
                    raise AssertionError(f"direct K||V: layer {i} differs from the source head")

        def clear() -> None:
            for t in flat + joint:
                t.view(torch.uint8).fill_(0xA5)

        def post_and_wait(op, local, li, remote, ri) -> None:
            x = raw.post(op, local, li, remote, ri)
            while raw.poll(x).name != "DONE":
                pass
            raw.release(x)

        def prep(l_rows, r_rows):
            ll = raw.prep_local(np.concatenate(l_rows).astype(np.int64), "DRAM")
            rl = raw.prep_remote(raw_peer, np.concatenate(r_rows).astype(np.int64), "DRAM")
            return ll, rl, np.arange(ll.count)

        def descs(addrs, size):
            return np.stack([addrs, np.full(addrs.size, size), np.zeros(addrs.size, np.int64)], 1)

        # -- one descriptor: the same bytes, one READ (the pull floor) and one WRITE (the push floor)
        one_l = raw.prep_local(np.array([[landing.data_ptr(), payload, 0]]), "DRAM")
        one_r = raw.prep_remote(raw_peer, np.array([[info["payload"], payload, 0]]), "DRAM")
        # every timed method is run once and checked here, then timed in interleaved rounds below
        timed = {"read": lambda: post_and_wait("READ", one_l, [0], one_r, [0]),
                 "write": lambda: post_and_wait("WRITE", one_l, [0], one_r, [0])}
        timed["read"]()
        timed["write"]()

        # -- vLLM 0.33 direct reads: one 8 KiB K||V head slice per (layer, block), HND joint cache
        kv_bytes = BLOCK * 2 * HEAD_DIM * 2
        l_rows = [descs(joint[i].data_ptr() + dst_ids * kv_bytes, kv_bytes) for i in range(layers)]
        r_rows = [descs(info["joint"][i] + src_ids * 2 * kv_bytes, kv_bytes) for i in range(layers)]
        p_l, p_r, pidx = prep(l_rows, r_rows)
        clear()
        timed["packed"] = lambda: post_and_wait("READ", p_l, pidx, p_r, pidx)
        timed["packed"]()
        check_joint()

        # -- K/V as separate streams: one 4 KiB head slice per (layer, K/V, block), HND copy
        blk_bytes = 2 * BLOCK * HEAD_DIM * 2  # one HND block of prefill rank 0 (2 heads)
        slice_bytes = BLOCK * HEAD_DIM * 2
        l_rows = [descs(k_caches[i][j].data_ptr() + dst_ids * slice_bytes, slice_bytes)
                  for i in range(layers) for j in range(2)]
        r_rows = [descs(info["hnd"][i][j] + src_ids * blk_bytes, slice_bytes) for i in range(layers) for j in range(2)]
        d_l, d_r, idx = prep(l_rows, r_rows)
        clear()
        timed["direct"] = lambda: post_and_wait("READ", d_l, idx, d_r, idx)
        timed["direct"]()
        check("direct")

        # -- per-token reads from the NHD cache: 256 B rows of head 0
        token_q = None
        if per_token:
            row = HEAD_DIM * 2
            tok = np.arange(BLOCK)
            r_rows, l_rows = [], []
            for i in range(layers):
                for j in range(2):
                    src = info["nhd"][i][j] + (src_ids[:, None] * blk_bytes + tok[None, :] * 2 * row).reshape(-1)
                    dst = k_caches[i][j].data_ptr() + (dst_ids[:, None] * slice_bytes + tok[None, :] * row).reshape(-1)
                    r_rows.append(descs(src, row))
                    l_rows.append(descs(dst, row))
            t_l, t_r, tidx = prep(l_rows, r_rows)
            clear()
            token_q = quantiles_ms(lambda: post_and_wait("READ", t_l, tidx, t_r, tidx), 3)
            check("per-token")

        # -- the staged path's parts, each alone
        parent.send(("time_pack", src_ids.tolist(), agents[0].specs))
        pack_q = parent.recv()
        read = agents[0].plan_for("P0").staged_read(0)
        stage = torch.empty(read.payload_bytes(n), dtype=torch.uint8)
        offs = read.segment_offsets(n)
        unpack_q = quantiles_ms(lambda: unpack(regions, read.segments, offs, dst_ids, stage, impl="torch"), reps)

        # -- kvtriton staged, end to end through the agents, per variant
        counter = [0]
        case = f"llama3-70b-like ({layers} layers) P4->D8 block 16, NHD source, {tokens} tokens"
        common = dict(case=case, transport=transport or _transport_label(),
                      host="busy" if busy else "idle", bytes=payload)
        ndescs = [[0] for _ in variants]
        setups, held = {}, {}  # untimed: the hold (and for eager its pack) before each timed fetch
        for i, (mode, chunks, inflight, eager) in enumerate(variants):

            def hold(i=i, eager=eager, chunks=chunks, agent=agents[i]) -> None:
                req = f"r{counter[0]}"
                counter[0] += 1
                parent.send(("hold", req, src_ids.tolist(), i, f"D{i}" if eager is True else None, chunks,
                             bool(eager)))
                held[i] = dict(parent.recv(), req=req)
                if eager and held[i]["packed"] < chunks:
                    raise AssertionError(f"eager: {held[i]['packed']} of {chunks} chunks packed at hold time")
                end = time.monotonic() + 30
                while eager and not agent.has_offer(f"P{i}", req) and time.monotonic() < end:
                    agent.progress()  # the decode has the offer before it fetches

            def staged(i=i, agent=agents[i], ndesc=ndescs[i]) -> None:
                req = held.pop(i)["req"]
                agent.fetch(req, f"P{i}", src_ids, dst_ids)
                while True:
                    agent.progress()
                    res = agent.results()
                    if res:
                        if not res[0].ok:
                            raise res[0].error
                        ndesc[0] = res[0].descriptors
                        return

            clear()
            hold()
            staged()
            check(f"staged {mode}{_eager_label(eager)}")
            timed[f"staged{i}"] = staged
            setups[f"staged{i}"] = hold

        # interleaved rounds: a burst of load on this shared machine hits every method alike
        samples: dict[str, list[float]] = {k: [] for k in timed}
        for _ in range(reps):
            for k, fn in timed.items():
                if k in setups:
                    setups[k]()
                samples[k].append(quantiles_ms(fn, 1, warmup=0)[1])
        for i, v in enumerate(variants):  # every eager fetch found its pack (the source counts hits)
            if v[3]:
                setups[f"staged{i}"]()
                if held[i]["hits"] < reps or agents[i].stats["offers_taken"] != reps + 1:
                    raise AssertionError(f"eager: {agents[i].stats['offers_taken']} of {reps + 1} fetches took "
                                         f"the offer, {held[i]['hits']} hits at the source")
        qs = {k: quantiles_of(v) for k, v in samples.items()}
        read_q, write_q, packed_q, direct_q = qs["read"], qs["write"], qs["packed"], qs["direct"]
        staged_rows = []
        for i, (mode, chunks, inflight, eager) in enumerate(variants):
            q = qs[f"staged{i}"]
            floor = read_q[1] if mode == "pull" else write_q[1]
            parts = (0 if eager else pack_q[1]) + floor + unpack_q[1]
            lazy = [j for j, w in enumerate(variants) if w == (mode, chunks, inflight, False)]
            vs_lazy = f"; lazy/this = {qs[f'staged{lazy[0]}'][1] / q[1]:.2f}x" if eager and lazy else ""
            staged_rows.append(dict(
                common, method=f"kvtriton staged, {mode}{_eager_label(eager)}, {chunks} chunk(s) x {inflight}"
                               " in flight", descriptors=ndescs[i][0], **qfields("ms", q, 2),
                note=f"{q[1] / parts:.2f}x the sum of its parts ({'' if eager else 'pack + '}one "
                     f"{'READ' if mode == 'pull' else 'WRITE'} + unpack); vLLM K||V direct/this = {packed_q[1] / q[1]:.2f}x; K/V-separate direct/this = "
                     f"{direct_q[1] / q[1]:.2f}x{vs_lazy}"))
        rows += staged_rows
        rows += [
            dict(common, method="vLLM 0.33 direct 8 KiB K||V reads", descriptors=p_l.count,
                 **qfields("ms", packed_q, 2), note="headline baseline: one read per (layer, block)"),
            dict(common, method="direct 4 KiB reads, K/V separate", descriptors=d_l.count,
                 **qfields("ms", direct_q, 2), note="one read per (layer, K/V, block)"),
        ]
        if token_q is not None:
            rows.append(dict(common, method="per-token 256 B reads", descriptors=t_l.count,
                             **qfields("ms", token_q, 2), note=""))
        rows += [
            dict(common, method="single descriptor READ (pull floor)", descriptors=1, **qfields("ms", read_q, 2),
                 note=""),
            dict(common, method="single descriptor WRITE (push floor)", descriptors=1, **qfields("ms", write_q, 2),
                 note=""),
            dict(common, method="part: pack alone", descriptors=0, **qfields("ms", pack_q, 2), note="prefill process"),
            dict(common, method="part: unpack alone", descriptors=0, **qfields("ms", unpack_q, 2),
                 note="decode process"),
        ]
        for r in rows:
            r["gbps"] = round(r["bytes"] / r["ms"] / 1e6, 2) if r["ms"] else ""
        parent.send(("exit",))
        parent.poll(10)
    finally:
        for nb in neighbors:
            if nb.is_alive():
                nb.terminate()
            nb.join(5)
        for a in agents:
            a.close()
        if raw is not None:
            raw.close()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return rows


def _eager_label(eager) -> str:
    """How a variant's hold is packed: lazily (''), ahead for its named consumer, or ahead for
    the only engine connected (no consumer named: the vLLM connector's holds)."""
    return {False: "", True: " eager", "guess": " eager-guess"}[eager]


def _transport_label() -> str:
    tls = os.environ.get("UCX_TLS", "")
    return f"UCX_TLS={tls}" if tls else "UCX default (shared memory)"


# (label, UCX_TLS or None for UCX's default choice, busy neighbors). NIXL's UCX backend does not
# start with UCX_TLS limited to shared memory (it needs tcp for its wireup), so shared memory is
# UCX's default choice on one host (cma/posix for the bytes).
CONFIGS = [("shm", None, 0), ("tcp", "tcp", 0), ("shm", None, 1), ("tcp", "tcp", 1)]


def run_e2e_matrix(quick: bool = False, configs=CONFIGS, timeout_s: float = 240) -> list[dict]:
    """:func:`run_e2e_bench` per (transport, host load), each in fresh processes: UCX reads
    ``UCX_TLS`` once, when the first agent starts. Per-token reads run only in the first config."""
    import json
    import subprocess
    import sys
    import tempfile

    rows: list[dict] = []
    for k, (label, tls, busy) in enumerate(configs):
        env = dict(os.environ)
        env.pop("UCX_TLS", None)
        if tls:
            env["UCX_TLS"] = tls
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, os.path.abspath(__file__), "--json", f.name, "--transport", label,
                   "--busy", str(busy)] + (["--quick"] if quick else []) + ([] if k == 0 else ["--no-per-token"])
            print(f"e2e: {label}, {'busy' if busy else 'idle'} host ...", flush=True)
            try:
                res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
                ok = res.returncode == 0
                err = res.stderr[-300:]
            except subprocess.TimeoutExpired:
                ok, err = False, f"timed out after {timeout_s} s"
            if not ok:
                rows.append(dict(case="e2e", transport=label, host="busy" if busy else "idle",
                                 method="failed", note=err.replace("\n", " ")))
                continue
            rows += json.load(open(f.name))
    return rows


def _expected(layers: int, num_blocks: int, src_ids: np.ndarray):
    """Head 0 of the prefill's blocks ``src_ids``, as HND tiles, per layer and stream (bytes)."""
    import torch

    nhd = _caches(layers, num_blocks, seed=1)  # the prefill's content, regenerated from its seed
    ids = torch.as_tensor(src_ids)
    return [[t[ids][:, :, 0:1].transpose(1, 2).contiguous().view(torch.uint8) for t in kv] for kv in nhd]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound neighbor processes on the same cores")
    ap.add_argument("--transport", default="", help="label of this run's transport (UCX_TLS sets it)")
    ap.add_argument("--no-per-token", action="store_true")
    ap.add_argument("--json", default=None, help="write the rows here as JSON (used by the sweep)")
    args = ap.parse_args()
    rows = run_e2e_bench(args.quick, args.layers, busy=args.busy, per_token=not args.no_per_token,
                         transport=args.transport)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(rows, f)
    for r in rows:
        print(f"{r['method']:<48} {r['descriptors']:>9} desc {r['ms']:>9.2f} ms "
              f"[{r['ms_p20']:.2f}-{r['ms_p80']:.2f}] {r['gbps']:>7} GB/s  {r['note']}")


if __name__ == "__main__":
    main()
