"""Hooks of the vLLM test bed that run inside the engine's workers (``collective_rpc``): read or
disturb the connector's caches and count what any connector does, through the connector
instance's public methods. Nothing of vLLM is patched here (:mod:`.vllm_patches` holds the
bed's few documented capability patches)."""

from __future__ import annotations

import gc
import time

__all__ = ["BedHooks", "MAX_KEPT_LOADS"]

#: loads whose blocks a decode rank keeps a copy of for :meth:`BedHooks.digest` (the newest)
MAX_KEPT_LOADS = 64


class BedHooks:
    """Run inside the workers through ``collective_rpc``: read or disturb the connector's caches."""

    @staticmethod
    def staging_in_use(conn) -> int | None:
        worker = getattr(conn, "_worker", None)
        return worker.staging_in_use() if worker is not None else None

    @staticmethod
    def transfer_stats(conn) -> dict | None:
        """Loads finished by this rank so far: count, descriptors posted, bytes (kvtriton: and its
        agent's eager-pack counters, ``eager_*`` and ``offers_taken``, and ``deferred_fetches``)."""
        worker = getattr(conn, "_worker", None)
        if worker is not None:  # kvtriton
            eager = {k: v for k, v in worker.agent.stats.items()
                     if k.startswith("eager") or k in ("offers_taken", "deferred_fetches")}
            return {**worker.stats, **eager}
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import stats

        return dict(getattr(stats.NixlKVConnectorStats, "_bed_counts", {}))

    @staticmethod
    def agent_stats(conn) -> dict | None:
        """The rank's TransferAgent counters (messages refused, eager packs, offers...)."""
        worker = getattr(conn, "_worker", None)
        return dict(worker.agent.stats) if worker is not None else None

    @staticmethod
    def time_loads(conn, keep: bool = True) -> None:
        """Timestamp every load on this rank the same way for any connector: when ``start_load_kv``
        first sees the request in its step's metadata (NixlConnector: ``reqs_to_recv``, kvtriton:
        ``messages.loads``) and when ``get_transfer_results`` first reports it in
        ``finished_recving``. Wraps the connector instance's public methods, nothing of vLLM is
        patched. ``time.perf_counter`` is CLOCK_MONOTONIC: comparable across the engine's processes.
        ``keep``: copy each kvtriton load's blocks when it is reported (:meth:`_keep_loaded`, for
        the byte oracle); benches pass False, since the copy runs on the engine thread inside the
        step that reports the load and would be timed as part of it (~100 ms at 68 MB a rank)."""
        if getattr(conn, "_bed_load_times", None) is not None:
            return
        times = conn._bed_load_times = {}
        loads_seen = conn._bed_loads = {}
        calls = conn._bed_calls = {"start_load_kv": [], "get_transfer_results": []}  # seconds per call
        # the interpreter's garbage collections in this worker (any thread: a collection stops them
        # all), seconds each: a full one of an engine's heap can take a step's time in one call
        calls["gc_pause"] = []
        began = [0.0]

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                _bounded(calls["gc_pause"]).append(time.perf_counter() - began[0])

        gc.callbacks.append(on_gc)
        BedHooks._time_lock_waits(conn, calls)
        start, results = conn.start_load_kv, conn.get_transfer_results

        def timed_start(forward_context, **kw):
            md = getattr(conn, "_connector_metadata", None)
            loads = getattr(md, "reqs_to_recv", None) or getattr(getattr(md, "messages", None), "loads", None) or {}
            now = time.perf_counter()
            for rid, load in loads.items():
                times.setdefault(rid, [now, None])
                local = getattr(load, "local_block_ids", None)
                if getattr(load, "source", None) is not None and load.report:  # kvtriton's LoadSpec only
                    loads_seen[rid] = {"local": _ids(local), "num_tokens": load.num_tokens,
                                       "remote": _ids(load.remote_block_ids),
                                       "remote_request": load.source.request_id}
            try:
                return start(forward_context, **kw)
            finally:
                _bounded(calls["start_load_kv"]).append(time.perf_counter() - now)

        def timed_results(finished_req_ids):
            t0 = time.perf_counter()
            out = results(finished_req_ids)
            now = time.perf_counter()
            _bounded(calls["get_transfer_results"]).append(now - t0)
            for rid in out.finished_recving or ():
                t = times.get(rid)
                if t is not None and t[1] is None:
                    t[1] = now
                if keep and rid in loads_seen:
                    BedHooks._keep_loaded(conn, rid, loads_seen[rid]["local"])
            return out

        conn.start_load_kv, conn.get_transfer_results = timed_start, timed_results

    @staticmethod
    def _time_lock_waits(conn, calls: dict) -> None:
        """kvtriton: the engine thread's waits for its agent's lock in ``start_load_kv`` (the
        step's fetches run under ``agent.batch()``; the agent's progress thread may hold it),
        seconds each, as ``calls["agent_lock_wait"]``: which part of a slow call was waiting
        for that thread rather than working (the worker asks ``batch(wait=False)``, which never
        waits: its fetches are deferred instead, counted as ``deferred_fetches``). The instance's
        ``batch`` is shadowed, nothing else; NixlConnector has no such lock (nothing recorded)."""
        agent = getattr(getattr(conn, "_worker", None), "agent", None)
        if agent is None:
            return
        waits = calls["agent_lock_wait"] = []
        batch = agent.batch  # the agent's own (the worker asks with wait=False: never waiting, it defers)

        class _TimedBatch:
            def __init__(self, wait: bool = True):
                self._cm = batch(wait)

            def __enter__(self):
                t0 = time.perf_counter()
                got = self._cm.__enter__()
                _bounded(waits).append(time.perf_counter() - t0)
                return got

            def __exit__(self, *exc):
                return self._cm.__exit__(*exc)

        agent.batch = _TimedBatch

    @staticmethod
    def _keep_loaded(conn, rid: str, block_ids) -> None:
        """A copy of the blocks a load wrote, taken when it is reported finished: before any
        forward of the decode reads or writes them. Why not digest the live cache later: by then
        vLLM may have handed a finished request's blocks to another request of the same batch (a
        37-token request done one step early lost its last block to a longer request's next
        token, issue 19), and the decode's own step rewrote the last prompt token's row."""
        kept = conn.__dict__.setdefault("_bed_loaded_kv", {})
        if block_ids and isinstance(block_ids[0], list):  # per KV cache group (hybrid): vLLM's own tensors
            kept[rid] = (block_ids, HybridOracle(conn).copy(block_ids))
            while len(kept) > MAX_KEPT_LOADS:
                del kept[next(iter(kept))]
            return
        if any(b < 0 for b in block_ids):  # partly local (prefix cache): not checked (region_digests says so)
            return
        ids = list(block_ids)
        kept[rid] = (ids, [[t[ids].clone() for t in r.streams] for r in conn._worker.agent.regions])
        while len(kept) > MAX_KEPT_LOADS:  # bounded: the oldest go (dicts keep insertion order)
            del kept[next(iter(kept))]

    @staticmethod
    def load_times(conn) -> dict:
        """The loads :meth:`time_loads` saw end on this rank since the last call: request id ->
        (start_load_kv, reported loaded)."""
        times = getattr(conn, "_bed_load_times", None) or {}
        done = {rid: t for rid, t in times.items() if t[1] is not None}
        for rid in done:
            del times[rid]
        return done

    @staticmethod
    def call_times(conn) -> dict:
        """Seconds each call of the connector's per-step work took on the engine's thread since the
        last call (``start_load_kv``, ``get_transfer_results``: where kvtriton's ``progress()`` runs)."""
        calls = getattr(conn, "_bed_calls", None) or {}
        out = {name: list(ts) for name, ts in calls.items()}
        for ts in calls.values():
            ts.clear()
        return out

    @staticmethod
    def count_nixl_descriptors(conn) -> None:
        """NixlConnector records NIXL's own telemetry per READ; count it here too, since vLLM
        drains its stats every step. The counts live on the class: a module global here would be
        copied into each worker process with the pickled function and stay at zero."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import stats

        cls = stats.NixlKVConnectorStats
        if getattr(cls, "_bed_counted", False):
            return
        record = cls.record_transfer
        counts = cls._bed_counts = {"loads": 0, "descriptors": 0, "bytes": 0}

        def counting(self, res):
            if res is not None:
                counts["loads"] += 1
                counts["descriptors"] += int(res.descCount)
                counts["bytes"] += int(res.totalBytes)
            return record(self, res)

        cls.record_transfer, cls._bed_counted = counting, True

    @staticmethod
    def scramble(conn, block_ids, seed) -> int:
        import torch

        if block_ids and isinstance(block_ids[0], list):  # per KV cache group (hybrid)
            return HybridOracle(conn).scramble(block_ids, seed)

        # the regions view vLLM's own cache tensors, so writing them writes the engine's cache
        g = torch.Generator().manual_seed(seed)
        n = 0
        for t in (t for r in conn._worker.agent.regions for t in r.streams):
            for b in block_ids:
                t[b].copy_(torch.randn(t[b].shape, generator=g, dtype=torch.float32).to(t.dtype) * 10)
                n += 1
        return n

    @staticmethod
    def loaded_blocks(conn) -> dict:
        """kvtriton: every load this rank was told to make so far (request id -> its local and
        remote blocks, token count when the block sizes differ, the prefill's request id)."""
        return dict(getattr(conn, "_bed_loads", None) or {})

    @staticmethod
    def debug_state(conn) -> dict | None:
        worker = getattr(conn, "_worker", None)
        return worker.agent.debug_state() if worker is not None else None

    @staticmethod
    def digest(conn, block_ids, num_tokens, loaded: str | None = None) -> dict:
        """Per region (model order), per *global* KV head: SHA-256 of the region's bytes for the
        first ``num_tokens`` tokens stored in ``block_ids`` (in that order), as the engine's
        attention reads them (dim-major K parts regrouped per token), so two engines of any TP
        and block layout give equal digests for equal KV. A REPLICATE region (MLA) has one key,
        ``"all"``. The region's kind is reported too. ``loaded``: a request id whose load this
        rank reported finished: digest the copy of its blocks taken then (see
        :meth:`_keep_loaded`; ``block_ids`` must be its blocks), not the live cache."""
        import hashlib

        import torch

        from kvtriton.regions import Kind, Layout, token_parts

        if block_ids and isinstance(block_ids[0], list):  # per KV cache group (hybrid)
            return HybridOracle(conn).digest(block_ids, num_tokens, loaded)
        worker = conn._worker
        rank, tp = worker.rank, worker.tp_size
        if loaded is None:
            ids, streams = list(block_ids), [r.streams for r in worker.agent.regions]
        else:
            kept_ids, streams = (getattr(conn, "_bed_loaded_kv", None) or {}).get(loaded, (None, None))
            if kept_ids != list(block_ids):
                raise KeyError(f"no copy of load {loaded!r} into blocks {list(block_ids)} (kept: {kept_ids})")
            ids = list(range(len(kept_ids)))
        out = {}
        for r, region_streams in zip(worker.agent.regions, streams):
            spec = r.spec
            rows = []
            for s, t in enumerate(region_streams):
                dm = spec.dim_major[s] if spec.dim_major else 0
                nhd = t if spec.layout is Layout.NHD else t.transpose(1, 2)
                parts = token_parts(t, dm) if dm else [(0, nhd)]
                rows.append(torch.cat([v[ids].reshape(-1, *v.shape[2:])[:num_tokens]
                                       for _, v in parts], dim=-1))
            x = torch.cat(rows, dim=-1)  # [tokens, local heads, row]
            if spec.kind is Kind.REPLICATE:
                heads = {"all": x}
            elif spec.local_heads * tp == spec.total_heads:
                heads = {str(rank * spec.local_heads + h): x[:, h] for h in range(spec.local_heads)}
            else:  # fewer KV heads than ranks: vLLM gives rank r head r // (tp / heads)
                heads = {str(rank * spec.total_heads // tp): x[:, 0]}
            def sha(v):
                return hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

            bs = spec.block_size
            out[spec.name] = {"kind": spec.kind.value, "tokens": int(x.shape[0]),
                              "heads": {h: sha(v) for h, v in heads.items()},
                              # per block position, to say where a mismatch is
                              "blocks": {h: [sha(v[i:i + bs])[:12] for i in range(0, v.shape[0], bs)]
                                         for h, v in heads.items()}}
        return out


def _ids(ids) -> list:
    """Block ids as JSON: a flat list, or one list per KV cache group."""
    if ids and isinstance(ids[0], (list, tuple)):
        return [[int(b) for b in g] for g in ids]
    return [int(b) for b in ids]


def _sha(t) -> str:
    import hashlib

    import torch

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class HybridOracle:
    """The byte oracle of a hybrid model's caches, on vLLM's own tensors (``conn.vllm_caches``,
    never kvtriton's regions): each layer's blocks of its KV cache group, cut by what the model
    says each rank holds, named by *global* index so two engines of any TP compare equal.

    * attention (full or sliding window, vLLM's CPU layout ``[blocks, heads, block, K|V]`` with K
      dim-major): ``{layer}`` per global KV head, the group's tokens (a window's clipped blocks
      hold the last ``num_tokens - (cdiv(num_tokens, block) - len(blocks)) * block``);
    * Mamba2 state: ``{layer}.x`` per SSM head (``head_dim`` conv channels), ``{layer}.B`` and
      ``{layer}.C`` per B/C group (a rank of an ``n_groups`` 1 model at TP > 1 holds group 0 whole,
      as vLLM's ``extra_groups_for_head_shards`` makes it: replicas must agree), ``{layer}.ssm``
      per SSM head;
    * Gated DeltaNet state: ``{layer}.q`` / ``.k`` per key head, ``.v`` and ``.ssm`` per value head.

    The conv state is read in vLLM's layout (``VLLM_SSM_CONV_STATE_LAYOUT``, DS or SD)."""

    def __init__(self, conn):
        self.conn = conn
        worker = conn._worker
        self.rank, self.tp = worker.rank, worker.tp_size
        from kvtriton.integrations.vllm.caches import state_views
        from kvtriton.integrations.vllm.connector import state_pages

        pages = state_pages(conn._kv_cache_config)
        self.caches = {n: state_views(t, *pages[n]) if n in pages and not isinstance(t, (list, tuple)) else t
                       for n, t in conn.vllm_caches.items()}
        self.groups = {n: i for i, g in enumerate(conn._kv_cache_config.kv_cache_groups) for n in g.layer_names}
        self.block = {i: g.kv_cache_spec.block_size for i, g in enumerate(conn._kv_cache_config.kv_cache_groups)}
        self.hf = conn._vllm_config.model_config.hf_config
        self.total_kv_heads = conn._vllm_config.model_config.get_total_num_kv_heads()
        from kvtriton.integrations.vllm.connector import _conv_state_layout

        self.conv_layout = _conv_state_layout()

    def layers(self, block_ids):
        from kvtriton.integrations.vllm.caches import layer_sort_key

        for name in sorted(self.caches, key=layer_sort_key):
            g = self.groups[name]
            t = self.caches[name]
            yield name, g, list(t) if isinstance(t, (list, tuple)) else [t], list(block_ids[g])

    def copy(self, block_ids) -> dict:
        return {name: [t[ids].clone() for t in tensors] for name, _, tensors, ids in self.layers(block_ids)}

    def scramble(self, block_ids, seed: int) -> int:
        import torch

        g = torch.Generator().manual_seed(seed)
        n = 0
        for _, _, tensors, ids in self.layers(block_ids):
            for t in tensors:
                for b in ids:
                    t[b].copy_(torch.randn(t[b].shape, generator=g, dtype=torch.float32).to(t.dtype) * 10)
                    n += 1
        return n

    def digest(self, block_ids, num_tokens: int, loaded: str | None = None) -> dict:
        kept = None
        if loaded is not None:
            kept_ids, kept = (getattr(self.conn, "_bed_loaded_kv", None) or {}).get(loaded, (None, None))
            if kept_ids != [list(g) for g in block_ids]:
                raise KeyError(f"no copy of load {loaded!r} into blocks {block_ids} (kept: {kept_ids})")
        out = {}
        for name, g, tensors, ids in self.layers(block_ids):
            if not ids:
                continue
            if kept is not None:
                tensors, ids = kept[name], list(range(len(ids)))
            if len(tensors) == 2:
                out.update(self._state(name, tensors, ids))
            else:
                out[name] = self._attention(tensors[0], ids, num_tokens, self.block[g])
        return out

    def _attention(self, t, ids, num_tokens: int, block: int) -> dict:
        import torch

        from kvtriton.regions import token_parts

        skipped = -(-num_tokens // block) - len(ids)  # a window's blocks before its clipped ones
        tokens = num_tokens - skipped * block
        parts = token_parts(t, t.shape[3] // 2) if t.device.type == "cpu" else [(0, t.transpose(1, 2))]
        x = torch.cat([v[ids].reshape(-1, *v.shape[2:])[:tokens] for _, v in parts], dim=-1)
        local = t.shape[1]
        if local * self.tp == self.total_kv_heads:
            heads = {str(self.rank * local + h): x[:, h] for h in range(local)}
        else:  # fewer KV heads than ranks
            heads = {str(self.rank * self.total_kv_heads // self.tp): x[:, 0]}
        return {"kind": "split", "tokens": int(x.shape[0]), "heads": {h: _sha(v) for h, v in heads.items()}}

    def _state(self, name: str, tensors, ids) -> dict:
        conv, ssm = tensors[0][ids], tensors[1][ids]
        if self.conv_layout == "SD":  # [blocks, K-1, channels] -> [blocks, channels, K-1]
            conv = conv.transpose(1, 2)
        parts: dict[str, dict] = {}
        c, r, tp = self.hf, self.rank, self.tp

        def put(part, key, v):
            parts.setdefault(f"{name}.{part}", {})[key] = _sha(v)

        if getattr(c, "linear_num_value_heads", None):  # Gated DeltaNet: conv [q | k | v]
            kh, vh = c.linear_num_key_heads // tp, c.linear_num_value_heads // tp
            kd, vd = c.linear_key_head_dim, c.linear_value_head_dim
            for h in range(kh):
                put("q", f"h{r * kh + h}", conv[:, h * kd:(h + 1) * kd])
                put("k", f"h{r * kh + h}", conv[:, kh * kd + h * kd:kh * kd + (h + 1) * kd])
            for h in range(vh):
                put("v", f"h{r * vh + h}", conv[:, 2 * kh * kd + h * vd:2 * kh * kd + (h + 1) * vd])
                put("ssm", f"h{r * vh + h}", ssm[:, h])
        else:  # Mamba2: conv [x | B | C]
            heads, hd, st, ng = c.mamba_num_heads // tp, c.mamba_head_dim, c.ssm_state_size, c.n_groups
            local_groups = (ng if ng % tp == 0 else tp) // tp  # n_groups 1 at TP > 1: one whole copy a rank
            x, b = heads * hd, local_groups * st
            for h in range(heads):
                put("x", f"h{r * heads + h}", conv[:, h * hd:(h + 1) * hd])
                put("ssm", f"h{r * heads + h}", ssm[:, h])
            for j in range(local_groups):
                grp = r * ng // tp + j
                put("B", f"g{grp}", conv[:, x + j * st:x + (j + 1) * st])
                put("C", f"g{grp}", conv[:, x + b + j * st:x + b + (j + 1) * st])
        return {region: {"kind": "state", "tokens": 1, "heads": heads_} for region, heads_ in parts.items()}


def _bounded(values: list, most: int = 100_000) -> list:
    """``values``, its oldest half dropped past ``most`` (a long test's calls are never read)."""
    if len(values) > most:
        del values[: most // 2]
    return values
