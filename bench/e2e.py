"""End-to-end time of one request between two processes over NIXL (UCX on 127.0.0.1).

Llama-3-70B-like geometry (8 KV heads, head_dim 128, bf16, K and V separate, 16-token blocks),
prefill TP4 -> decode TP8, seen from decode rank 0: it needs head 0 of prefill rank 0's two heads
for every layer, K/V and block. ``layers`` is cut down from 80 so the run fits a 2-core machine;
the descriptor sizes are the real ones. Methods, all moving the same bytes into decode rank 0:

* ``kvtriton staged``: TransferAgent pull: the prefill packs from an **NHD** cache into staging,
  decode READs one descriptor per chunk and unpacks into its HND cache; control messages included.
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

import numpy as np

HEADS, HEAD_DIM, BLOCK, P_TP, D_TP = 8, 128, 16, 4, 8


def _caches(layers: int, num_blocks: int, seed: int):
    """Prefill rank 0's caches: NHD (K, V per layer) and an HND copy with the same content."""
    import torch

    from kvtriton.testing.oracle import random_bits

    gen = torch.Generator().manual_seed(seed)
    nhd = [[random_bits((num_blocks, BLOCK, 2, HEAD_DIM), torch.bfloat16, gen) for _ in range(2)]
           for _ in range(layers)]
    return nhd


def _median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


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
    regions = [Region.attention(f"layer.{i}", k, v, layout="NHD", block_size=BLOCK, total_heads=HEADS)
               for i, (k, v) in enumerate(nhd)]
    agents = [TransferAgent(f"P{i}", 0, P_TP, regions, **kw) for i, kw in enumerate(variants)]
    raw = NixlTransport(f"P-raw-{os.getpid()}")
    flat = [t for kv in nhd for t in kv] + [t for kv in hnd for t in kv]
    payload = torch.randint(0, 256, (layers * 2 * num_blocks * BLOCK * HEAD_DIM * 2,), dtype=torch.uint8)
    raw.register(flat + [payload])
    conn.send(dict(agent_md=[a.metadata() for a in agents], raw_md=raw.metadata(), raw_name=raw.name,
                   nhd=[[t.data_ptr() for t in kv] for kv in nhd], hnd=[[t.data_ptr() for t in kv] for kv in hnd],
                   payload=payload.data_ptr()))
    try:
        while True:
            if conn.poll(0.0005 if all(a.idle() for a in agents) else 0):
                cmd, *args = conn.recv()
                if cmd == "add_remote":
                    for a, md in zip(agents, args[0]):
                        a.add_remote(md)
                    raw.add_remote(args[1])
                    conn.send("ok")
                elif cmd == "hold":
                    agents[args[2]].hold(args[0], args[1], lease_s=120)
                    conn.send("ok")
                elif cmd == "time_pack":
                    plan = build_plan(0, D_TP, args[1], P_TP, agents[0].specs)  # what the agents pack for D0
                    read = plan.staged_read(0)
                    ids = np.asarray(args[0])
                    staging = torch.empty(read.payload_bytes(ids.size), dtype=torch.uint8)
                    offs = read.segment_offsets(ids.size)
                    conn.send(_median_ms(lambda: pack(regions, read.segments, offs, ids, staging, impl="torch"),
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
                  variants: list[tuple[str, int, int]] | None = None) -> list[dict]:
    """``variants``: kvtriton configurations as (mode, chunks per request, chunks in flight);
    default: one chunk (pull and push) and 8 pipelined chunks (pull)."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from kvtriton import Region
    from kvtriton.agent import TransferAgent
    from kvtriton.ops import unpack
    from kvtriton.plan import ceil_div
    from kvtriton.transport.nixl import NixlTransport

    layers = layers or (4 if quick else 16)
    reps = 3 if quick else 5
    n = tokens // BLOCK
    num_blocks = n + 8
    payload = layers * 2 * n * BLOCK * HEAD_DIM * 2  # bytes decode rank 0 receives
    variants = variants or [("pull", 1, 1), ("push", 1, 1), ("pull", 8, 2)]
    slot = 256 << 10
    agent_kw = []
    for mode, chunks, inflight in variants:
        chunk = ceil_div(payload // chunks, slot) * slot
        agent_kw.append(dict(staging_bytes=inflight * chunk, slot_bytes=slot, chunk_bytes=chunk, mode=mode,
                             inflight_chunks=inflight, impl="torch", timeout_s=60))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill, args=(child, layers, num_blocks, agent_kw, reps), daemon=True)
    proc.start()
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
        regions = [Region.attention(f"layer.{i}", k, v, layout="HND", block_size=BLOCK, total_heads=HEADS)
                   for i, (k, v) in enumerate(k_caches)]
        agents = [TransferAgent(f"D{i}", 0, D_TP, regions, **kw) for i, kw in enumerate(agent_kw)]
        raw = NixlTransport(f"D-raw-{os.getpid()}")
        flat = [t for kv in k_caches for t in kv]
        landing = torch.empty(payload, dtype=torch.uint8)
        raw.register(flat + [landing])
        for a, md in zip(agents, info["agent_md"]):
            a.add_remote(md)
        raw_peer = raw.add_remote(info["raw_md"])
        parent.send(("add_remote", [a.metadata() for a in agents], raw.metadata()))
        parent.recv()

        expected = _expected(layers, num_blocks, src_ids)

        def check(what: str) -> None:
            for i, (k, v) in enumerate(k_caches):
                for j, t in enumerate((k, v)):
                    got = t[torch.as_tensor(dst_ids)].view(torch.uint8)
                    if not torch.equal(got, expected[i][j]):
                        raise AssertionError(f"{what}: layer {i} stream {j} differs from the source head")

        def clear() -> None:
            for kv in k_caches:
                for t in kv:
                    t.view(torch.uint8).fill_(0xA5)

        def post_and_wait(local, li, remote, ri) -> None:
            x = raw.post("READ", local, li, remote, ri)
            while raw.poll(x).name != "DONE":
                pass
            raw.release(x)

        # -- single descriptor: the same bytes, one READ
        one_l = raw.prep_local(np.array([[landing.data_ptr(), payload, 0]]), "DRAM")
        one_r = raw.prep_remote(raw_peer, np.array([[info["payload"], payload, 0]]), "DRAM")
        single_ms = _median_ms(lambda: post_and_wait(one_l, [0], one_r, [0]), reps)

        # -- vLLM-style direct 4 KiB head-slice reads from the HND copy (head 0 of 2)
        blk_bytes = 2 * BLOCK * HEAD_DIM * 2  # one HND block of prefill rank 0 (2 heads)
        slice_bytes = BLOCK * HEAD_DIM * 2
        r_rows, l_rows = [], []
        for i in range(layers):
            for j in range(2):
                r_rows.append(np.stack([info["hnd"][i][j] + src_ids * blk_bytes, np.full(n, slice_bytes),
                                        np.zeros(n, np.int64)], 1))
                l_rows.append(np.stack([k_caches[i][j].data_ptr() + dst_ids * slice_bytes, np.full(n, slice_bytes),
                                        np.zeros(n, np.int64)], 1))
        d_l = raw.prep_local(np.concatenate(l_rows).astype(np.int64), "DRAM")
        d_r = raw.prep_remote(raw_peer, np.concatenate(r_rows).astype(np.int64), "DRAM")
        nd = d_l.count
        idx = np.arange(nd)
        clear()
        direct_ms = _median_ms(lambda: post_and_wait(d_l, idx, d_r, idx), reps)
        check("direct")

        # -- per-token reads from the NHD cache: 256 B rows of head 0
        row = HEAD_DIM * 2
        tok = np.arange(BLOCK)
        r_rows, l_rows = [], []
        for i in range(layers):
            for j in range(2):
                src = info["nhd"][i][j] + (src_ids[:, None] * blk_bytes + tok[None, :] * 2 * row).reshape(-1)
                dst = k_caches[i][j].data_ptr() + (dst_ids[:, None] * slice_bytes + tok[None, :] * row).reshape(-1)
                r_rows.append(np.stack([src, np.full(src.size, row), np.zeros(src.size, np.int64)], 1))
                l_rows.append(np.stack([dst, np.full(dst.size, row), np.zeros(dst.size, np.int64)], 1))
        t_l = raw.prep_local(np.concatenate(l_rows).astype(np.int64), "DRAM")
        t_r = raw.prep_remote(raw_peer, np.concatenate(r_rows).astype(np.int64), "DRAM")
        nt = t_l.count
        tidx = np.arange(nt)
        clear()
        token_ms = _median_ms(lambda: post_and_wait(t_l, tidx, t_r, tidx), max(1, reps - 2))
        check("per-token")

        # -- the staged path's parts, each alone
        parent.send(("time_pack", src_ids.tolist(), agents[0].specs))
        pack_ms = parent.recv()
        read = agents[0].plan_for("P0").staged_read(0)
        stage = torch.empty(read.payload_bytes(n), dtype=torch.uint8)
        offs = read.segment_offsets(n)
        unpack_ms = _median_ms(lambda: unpack(regions, read.segments, offs, dst_ids, stage, impl="torch"), reps)
        parts = pack_ms + single_ms + unpack_ms

        # -- kvtriton staged, end to end through the agents, per variant
        counter = [0]
        case = f"llama3-70b-like ({layers} layers) P4->D8 block 16, NHD source, {tokens} tokens"
        common = dict(case=case, bytes=payload)
        for i, (mode, chunks, inflight) in enumerate(variants):
            agent, descs = agents[i], [0]

            def staged() -> None:
                req = f"r{counter[0]}"
                counter[0] += 1
                parent.send(("hold", req, src_ids.tolist(), i))
                parent.recv()
                agent.fetch(req, f"P{i}", src_ids, dst_ids)
                while True:
                    agent.progress()
                    res = agent.results()
                    if res:
                        if not res[0].ok:
                            raise res[0].error
                        descs[0] = res[0].descriptors
                        return

            clear()
            staged_ms = _median_ms(staged, reps)
            check(f"staged {mode}")
            rows.append(dict(common, method=f"kvtriton staged, {mode}, {chunks} chunk(s) x {inflight} in flight",
                             descriptors=descs[0], ms=round(staged_ms, 2),
                             note=f"{staged_ms / parts:.2f}x the sum of its parts; direct/this = "
                                  f"{direct_ms / staged_ms:.2f}x; per-token/this = {token_ms / staged_ms:.1f}x"))
        rows += [
            dict(common, method="vLLM-style direct 4 KiB reads", descriptors=nd, ms=round(direct_ms, 2), note=""),
            dict(common, method="per-token 256 B reads", descriptors=nt, ms=round(token_ms, 2), note=""),
            dict(common, method="single descriptor (floor)", descriptors=1, ms=round(single_ms, 2), note=""),
            dict(common, method="part: pack alone", descriptors=0, ms=round(pack_ms, 2), note="prefill process"),
            dict(common, method="part: unpack alone", descriptors=0, ms=round(unpack_ms, 2), note="decode process"),
        ]
        for r in rows:
            r["gbps"] = round(r["bytes"] / r["ms"] / 1e6, 2) if r["ms"] else ""
        parent.send(("exit",))
        parent.poll(10)
    finally:
        for a in agents:
            a.close()
        if raw is not None:
            raw.close()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
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
    args = ap.parse_args()
    for r in run_e2e_bench(args.quick, args.layers):
        print(f"{r['method']:<32} {r['descriptors']:>9} desc {r['ms']:>9.2f} ms {r['gbps']:>7} GB/s  {r['note']}")


if __name__ == "__main__":
    main()
