"""A prefill engine and a decode engine of the vLLM test bed (:mod:`.vllm_bed`), the oracles the
real-engine tests and ``bench/pd_vllm.py`` share: tokens against one engine, prompt tokens the
decode computed, and a per-region byte check of the KV each load wrote.

The byte check (:meth:`EnginePair.region_digests`) asks both engines, per region and per global
KV head, for a SHA-256 of every prompt token's KV: on the prefill over the request's held
blocks after the decode read them (nothing has run on the prefill since, so these are the bytes
it held when freed, after every writer), on the decode over a copy of the blocks its load wrote,
taken when the load was reported finished, before any decode step touched them (later the
decode rewrites the last prompt token itself, and vLLM may give a finished request's blocks to
another request of the batch: digesting the live cache then was issue 19's "MLA last partial
block mismatch", an oracle bug, not a transfer's). Tokens alone cannot validate
an Eagle-3 draft's KV (the target verifies every draft token), and a REPLICATE region is checked
on every rank of both engines.
"""

from __future__ import annotations

import os
from pathlib import Path

from .vllm_bed import EngineProcess, close_all, engine_cpus, free_port_range, wait_all_ready

__all__ = ["EnginePair", "BytesMismatch", "P_EXTRA", "D_EXTRA"]

# timeouts sized for a 2-core host that stops running one core's processes for up to ~90 s
# (docs/operations.md, "Host notes"): a prefill starved that long is silent to its decode, and a
# transfer survives it only if the decode waits longer (timeout_s, each handshake attempt) and the
# prefill keeps its blocks longer (lease_s). A failure still fails: a load that never comes is
# recomputed after timeout_s, and the bed's oracles report it.
P_EXTRA = {"lease_s": 180.0, "handshake_timeout_s": 60.0}
D_EXTRA = {"timeout_s": 120.0, "handshake_timeout_s": 60.0, "handshake_attempts": 3}


class BytesMismatch(AssertionError):
    """A region's KV on the decode is not the prefill's (names the request, region and head)."""


class EnginePair:
    """Prefill (``kv_producer``) and decode (``kv_consumer``) engines, each on its own cores.
    ``connector``: ``kvtriton`` or ``nixl``; ``engine_options``/``patches`` go to both engines;
    ``log_stats``: vLLM's stat loggers on in both (their Prometheus samples: the ``metrics`` op)."""

    def __init__(self, python: str, model_dir: str | os.PathLike, log_dir: str | os.PathLike, p_tp: int, d_tp: int,
                 *, block_size: int = 32, connector: str = "kvtriton", p_extra: dict | None = None,
                 d_extra: dict | None = None, engine_options: dict | None = None, patches: tuple[str, ...] = (),
                 max_model_len: int = 2048, log_stats: bool = False, timeout_s: float = 400.0):
        self.p_tp, self.d_tp, self.connector = p_tp, d_tp, connector
        ours = connector == "kvtriton"
        # settling waits past the lease too: a hold no reader's done ends (a lost decode) ends by it
        self.lease_s = float({**(P_EXTRA if ours else {}), **(p_extra or {})}.get("lease_s", 0.0))
        common = dict(connector=connector, block_size=block_size, log_dir=Path(log_dir), engine_options=engine_options,
                      patches=patches, max_model_len=max_model_len, log_stats=log_stats)
        # both start at once, each on its own cores: a pair is ready in one engine's start-up time
        self.prefill = EngineProcess.launch(
            python, model_dir, tp=p_tp, role="kv_producer", port=free_port_range(p_tp),
            extra={**(P_EXTRA if ours else {}), **(p_extra or {})}, engine_id=f"prefill-tp{p_tp}", name="prefill",
            cpus=engine_cpus(p_tp, 0), **common)
        try:
            self.decode = EngineProcess.launch(
                python, model_dir, tp=d_tp, role="kv_consumer", port=free_port_range(1),
                extra={**(D_EXTRA if ours else {}), **(d_extra or {})}, engine_id=f"decode-tp{d_tp}", name="decode",
                cpus=engine_cpus(d_tp, 1), **common)  # no core shared with the prefill
        except BaseException:
            self.prefill.kill()
            raise
        wait_all_ready([self.prefill, self.decode], timeout_s)

    # ------------------------------------------------------------------ requests
    def reference(self, prompts, tag: str, max_tokens: int = 8) -> list[list[int]]:
        """Greedy tokens of the decode engine computing each prompt itself (no transfer)."""
        out = self.decode.call("generate", requests=[
            {"id": f"{tag}{i}", "prompt": p, "max_tokens": max_tokens} for i, p in enumerate(prompts)])["outputs"]
        computed = [o["prompt_computed"] for o in out]
        if computed != [len(p) for p in prompts]:
            raise AssertionError(f"the reference did not compute its prompts: {computed}")
        return [o["tokens"] for o in out]

    def prefill_requests(self, prompts, tag: str) -> list[dict]:
        out = self.prefill.call("generate", requests=[
            {"id": f"{tag}{i}", "prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            for i, p in enumerate(prompts)])["outputs"]
        return [o["kv_transfer_params"] for o in out]

    def decode_requests(self, prompts, params, tag: str, max_tokens: int = 8, timeout_s: float = 400) -> list[dict]:
        return self.decode.call("generate", timeout_s=timeout_s + 30, requests=[
            {"id": f"{tag}{i}", "prompt": p, "max_tokens": max_tokens, "kv_transfer_params": kp}
            for i, (p, kp) in enumerate(zip(prompts, params))], seconds=timeout_s)["outputs"]

    def descriptors(self) -> dict:
        """The decode ranks' load counters summed (kvtriton's and NixlConnector's alike)."""
        out = {"loads": 0, "descriptors": 0, "bytes": 0}
        for s in self.decode.call("transfer_stats")["stats"] or ():
            for k in out:
                out[k] += (s or {}).get(k, 0)
        return out

    def settle(self, engine: EngineProcess, seconds: float | None = None) -> dict:
        """Step ``engine`` until it holds no request (at most ``seconds``, default 30 s past the
        prefill's lease); its blocks (and kvtriton's staging) are free."""
        seconds = self.lease_s + 30 if seconds is None else seconds
        engine.call("drain", seconds=seconds, timeout_s=seconds + 30)
        state = engine.call("state")
        if state["requests"] or state["free_blocks"] != state["total_blocks"]:
            raise AssertionError(f"engine did not settle: {state}")
        if self.connector == "kvtriton" and not (state["staging_in_use"] and
                                                 all(s == 0 for s in state["staging_in_use"])):
            raise AssertionError(f"staging still in use: {state}")
        return state

    # ------------------------------------------------------------------ the oracles together
    def negative_control(self, prompts, ref, tag: str = "neg") -> int:
        """Overwrite the prefill's blocks after its requests finished, before the decode loads
        them: the decode's tokens must change (the KV really travels). Run it before the decode
        first meets the prefill, or with a prefill that packs nothing ahead (``eager_guess``
        false, no ``consumer``), so nothing was packed at hold time.

        Once more, on fresh requests, when every load of the first round failed and vLLM recomputed:
        this 2-core host has starved one engine's processes for 12-77 s at a time (each agent logs
        "did not run for ..."; the kernel logs workqueue lockups), past the decode's handshake and
        ``timeout_s``. A recomputed load is the connector's failure path working, not a transfer; a
        second round that moves nothing fails the control. Returns how many requests of a first
        round failed that way (0 or ``len(prompts)``): the prefill keeps their holds to the lease."""
        failed = 0
        for attempt in (1, 2):
            params = self.prefill_requests(prompts, f"{tag}{attempt}-p")
            blocks = sorted({b for p in params for b in p["remote_block_ids"]})
            if not all(self.prefill.call("scramble", block_ids=blocks)["scrambled"]):
                raise AssertionError("nothing was scrambled")
            out = self.decode_requests(prompts, params, f"{tag}{attempt}-d")
            computed = [o.get("prompt_computed") for o in out]
            if [o["tokens"] for o in out] != ref:
                break
            if attempt == 2 or computed != [len(p) for p in prompts]:
                raise AssertionError("tokens did not change with the prefill's KV overwritten (prompt tokens "
                                     f"computed by the decode per request: {computed}; more than 1: its load failed "
                                     "and vLLM recomputed, so this control saw no transfer)")
            print(f"negative control: every load failed and was recomputed ({computed}); once more")
            failed = len(prompts)
        self.settle(self.prefill)
        return failed

    def transfer(self, prompts, ref=None, tag: str = "x") -> dict:
        """Prefill, decode, then check: tokens equal ``ref`` (None: the decode computes the
        reference afterwards, so fresh engines' first requests get consecutive blocks), at most
        one prompt token computed per request, every region's bytes equal
        (:meth:`region_digests`). Returns ``{"identical", "n", "prompt_computed", "digests",
        "descriptors", "bytes", "params", "ref"}``."""
        before = self.descriptors()
        failed = failed_loads(self.decode)
        params = self.prefill_requests(prompts, f"{tag}-p")
        out = self.decode_requests(prompts, params, f"{tag}-d")
        try:
            digests = self.region_digests(prompts, params, f"{tag}-d")
        except BytesMismatch as e:  # say whether the tokens showed it too, and whether a load failed
            ref = self.reference(prompts, f"{tag}-ref") if ref is None else ref
            same = [o["tokens"] for o in out] == ref
            raise BytesMismatch(f"{e} [tokens {'identical to' if same else 'differ from'} one engine; "
                                f"{load_story(out, failed_loads(self.decode) - failed)}]") from None
        after = self.descriptors()
        if ref is None:
            ref = self.reference(prompts, f"{tag}-ref")
        got = [o["tokens"] for o in out]
        computed = [o["prompt_computed"] for o in out]
        if got != ref:
            raise AssertionError(f"decode tokens differ from one engine: {got} vs {ref}")
        if not all(c <= 1 for c in computed):
            raise AssertionError(f"decode recomputed prompt tokens: {computed}")
        self.settle(self.prefill)
        self.settle(self.decode)
        return {"identical": sum(a == b for a, b in zip(got, ref)), "n": len(ref), "prompt_computed": computed,
                "digests": digests, "descriptors": after["descriptors"] - before["descriptors"],
                "bytes": after["bytes"] - before["bytes"], "params": params, "ref": ref}

    # ------------------------------------------------------------------ bytes
    def region_digests(self, prompts, params, tag: str) -> dict:
        """Check every region's bytes of every request the decode loaded (see the module
        docstring); call after :meth:`decode_requests`, before the prefill runs again (the
        decode side is each rank's copy of its newest ``MAX_KEPT_LOADS`` loads, see
        :mod:`.vllm_hooks`).
        Returns ``{"regions": n, "kinds": {region: kind}, "heads": {region: n}}``; raises
        :class:`BytesMismatch`. Its own control: each decode digest must differ from the
        prefill's digest of another request (a digest that cannot tell requests apart fails)."""
        loads = [r or {} for r in self.decode.call("loaded_blocks")["loads"]]
        summary: dict = {"regions": 0, "kinds": {}, "heads": {}}
        prev = None
        for i, (p, kp) in enumerate(zip(prompts, params)):
            rid = f"{tag}{i}"
            # vLLM's own request ids carry a suffix: "<ours>-<random>"
            key = next((k for k in loads[0] if k == rid or k.rsplit("-", 1)[0] == rid), None)
            if key is None:
                raise BytesMismatch(f"{rid}: the decode made no load for it")
            spec = loads[0][key]
            if any(b < 0 for b in spec["local"]):
                raise BytesMismatch(f"{rid}: a partly local prompt (prefix cache) is not checked here")
            # every prompt token the prefill computed (the bed runs without prefix caching: all of
            # them), in the decode's copy of its blocks taken when the load finished (the decode
            # recomputes the last one afterwards, and may reuse a finished request's blocks)
            n = len(p)
            src_raw = self.prefill.call("digest", block_ids=list(kp["remote_block_ids"]), num_tokens=n)["digests"]
            try:
                dst_raw = self.decode.call("digest", block_ids=spec["local"], num_tokens=n, loaded=key)["digests"]
            except RuntimeError as e:
                raise BytesMismatch(f"{rid}: the decode kept no copy of its load ({e})") from None
            src, dst = _merge(src_raw), _merge(dst_raw)
            for region, (kind, heads) in src.items():
                got = dst.get(region, (None, {}))[1]
                if set(heads) != set(got):
                    raise BytesMismatch(f"{rid} region {region}: heads {sorted(heads)} on the prefill, {sorted(got)} "
                                        "on the decode")
                for h, digests in heads.items():
                    if len(digests) != 1 or digests != got[h]:
                        where = _blocks(src_raw, region, h), _blocks(dst_raw, region, h)
                        raise BytesMismatch(f"{rid} region {region} ({kind}) head {h}: prefill {sorted(digests)} "
                                            f"vs decode {sorted(got[h])} ({n} tokens; per block, prefill ranks "
                                            f"{where[0]} vs decode ranks {where[1]}; blocks "
                                            f"{list(kp['remote_block_ids'])} -> {spec['local']})")
                summary["kinds"][region], summary["heads"][region] = kind, len(heads)
            if prev is not None and prev == _digest_set(dst):
                raise BytesMismatch(f"{rid}: the digest does not tell two requests apart")
            prev = _digest_set(src)
        summary["regions"] = len(summary["kinds"])
        return summary

    def close(self) -> None:
        close_all([self.prefill, self.decode])


def failed_loads(engine: EngineProcess) -> int:
    """Loads the engine's connector reported failed so far, every rank (kvtriton's ``failed``;
    0 for NixlConnector): vLLM recomputes such a request, so its tokens can match while the
    copy the bed kept of its load holds whatever the failed load left."""
    return sum((s or {}).get("failed", 0) for s in engine.call("transfer_stats")["stats"] or ())


def load_story(out, failed: int) -> str:
    """What a byte mismatch's message adds: the prompt tokens each request's decode computed
    (more than one: the load failed and vLLM recomputed) and the failed loads counted meanwhile."""
    return (f"prompt tokens computed by the decode per request {[o.get('prompt_computed') for o in out]}, "
            f"loads its connector reported failed meanwhile {failed}")


def _merge(per_rank) -> dict:
    """Rank digests -> ``{region: (kind, {head: {digest, ...}})}``: a REPLICATE region's ``all``
    gathers one digest per rank (all equal when every replica holds the same KV)."""
    out: dict = {}
    for rank in per_rank:
        for region, d in (rank or {}).items():
            kind, heads = out.setdefault(region, (d["kind"], {}))
            for h, digest in d["heads"].items():
                heads.setdefault(h, set()).add(digest)
    return out


def _blocks(per_rank, region: str, head: str) -> list:
    return [(rank or {}).get(region, {}).get("blocks", {}).get(head) for rank in per_rank]


def _digest_set(merged: dict) -> frozenset:
    return frozenset((r, h, d) for r, (_, heads) in merged.items() for h, ds in heads.items() for d in ds)
