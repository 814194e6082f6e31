"""A prefill and a decode engine of a hybrid model (issue 32: sliding window, Mamba2, Gated
DeltaNet) and its oracles: tokens against one engine, and every KV cache group's bytes, per
region, sub-projection and SSM head, read from vLLM's own tensors on both engines
(:class:`beds.vllm_hooks.HybridOracle`), not from kvtriton's regions.

The decode side's bytes are its copy of each load's blocks taken when the load finished (before
the decode computes the last prompt token: with a state group the prefill stopped one prompt
token short, ``remote_num_tokens`` = prompt - 1, and the decode's first step advances the state
it loaded). The prefill side's are its held blocks after the decode read them.
"""

from __future__ import annotations

import os
from pathlib import Path

from .vllm_bed import EngineProcess, close_all, engine_cpus, free_port_range, wait_all_ready
from .vllm_models import HYBRID_KINDS
from .vllm_pair import D_EXTRA, P_EXTRA, BytesMismatch, _merge, failed_loads, load_story

__all__ = ["HybridPair", "BytesMismatch"]


class HybridPair:
    """Prefill (``kv_producer``) and decode (``kv_consumer``) engines of a hybrid model with
    kvtriton's connector (``connector="nixl"``: vLLM's NixlConnector, the side-by-side), each on
    its own cores. ``kind``: a key of :data:`beds.vllm_models.HYBRID_KINDS` (its engine options:
    bf16 for Qwen3-Next); ``conv_layout``: vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT`` in both engines
    (None: vLLM's choice, SD for kvtriton)."""

    def __init__(self, python: str, model_dir: str | os.PathLike, log_dir: str | os.PathLike, kind: str,
                 p_tp: int, d_tp: int, *, connector: str = "kvtriton", conv_layout: str | None = None,
                 block_size: int = 32, max_model_len: int = 512, timeout_s: float = 600.0):
        self.p_tp, self.d_tp, self.kind, self.connector = p_tp, d_tp, kind, connector
        ours = connector == "kvtriton"
        env = {"VLLM_SSM_CONV_STATE_LAYOUT": conv_layout} if conv_layout else None
        common = dict(connector=connector, block_size=block_size, log_dir=Path(log_dir), max_model_len=max_model_len,
                      engine_options={"max_num_seqs": 4, **HYBRID_KINDS[kind]}, env=env, timeout_s=timeout_s)
        self.lease_s = P_EXTRA["lease_s"] if ours else 0.0
        wait_s = common.pop("timeout_s")
        # side by side, each on its own cores: a vLLM start is tens of seconds of CPU-bound set-up
        self.prefill = EngineProcess.launch(
            python, model_dir, tp=p_tp, role="kv_producer", port=free_port_range(p_tp),
            extra=P_EXTRA if ours else {}, engine_id=f"prefill-tp{p_tp}", name=f"{kind}-prefill",
            cpus=engine_cpus(p_tp, 0), **common)
        try:
            self.decode = EngineProcess.launch(
                python, model_dir, tp=d_tp, role="kv_consumer", port=free_port_range(1),
                extra=D_EXTRA if ours else {}, engine_id=f"decode-tp{d_tp}", name=f"{kind}-decode",
                cpus=engine_cpus(d_tp, 1), **common)
        except BaseException:
            self.prefill.kill()
            raise
        wait_all_ready([self.prefill, self.decode], wait_s)

    # ------------------------------------------------------------------ requests
    def reference(self, prompts, tag: str, max_tokens: int = 8) -> list[list[int]]:
        """Greedy tokens of the decode engine computing each prompt itself (no transfer)."""
        out = self.decode.call("generate", timeout_s=900, seconds=870, requests=[
            {"id": f"{tag}{i}", "prompt": p, "max_tokens": max_tokens} for i, p in enumerate(prompts)])["outputs"]
        return [o["tokens"] for o in out]

    def prefill_requests(self, prompts, tag: str) -> list[dict]:
        out = self.prefill.call("generate", timeout_s=900, seconds=870, requests=[
            {"id": f"{tag}{i}", "prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            for i, p in enumerate(prompts)])["outputs"]
        return [o["kv_transfer_params"] for o in out]

    def decode_requests(self, prompts, params, tag: str, max_tokens: int = 8, timeout_s: float = 600) -> list[dict]:
        return self.decode.call("generate", timeout_s=timeout_s + 30, seconds=timeout_s, requests=[
            {"id": f"{tag}{i}", "prompt": p, "max_tokens": max_tokens, "kv_transfer_params": kp}
            for i, (p, kp) in enumerate(zip(prompts, params))])["outputs"]

    def settle(self, engine: EngineProcess, seconds: float | None = None) -> dict:
        seconds = self.lease_s + 30 if seconds is None else seconds
        engine.call("drain", seconds=seconds, timeout_s=seconds + 60)
        state = engine.call("state")
        if state["requests"] or state["free_blocks"] != state["total_blocks"]:
            raise AssertionError(f"engine did not settle: {state}")
        return state

    # ------------------------------------------------------------------ the oracles
    def transfer(self, prompts, ref, tag: str = "x") -> dict:
        """Prefill, decode, check: every group's bytes equal (:meth:`group_digests`), tokens equal
        ``ref``, at most ``1 + backoff`` prompt tokens computed by the decode."""
        failed = failed_loads(self.decode)
        params = self.prefill_requests(prompts, f"{tag}-p")
        out = self.decode_requests(prompts, params, f"{tag}-d")
        got = [o["tokens"] for o in out]
        try:
            digests = self.group_digests(prompts, params, f"{tag}-d")
        except BytesMismatch as e:  # a failed load is recomputed: tokens equal, the kept copy not the transfer's
            raise BytesMismatch(f"{e} [tokens {'identical to' if got == ref else 'differ from'} one engine; "
                                f"{load_story(out, failed_loads(self.decode) - failed)}]") from None
        if got != ref:  # the bytes were equal: the difference is the decode's own numerics
            raise AssertionError(f"decode tokens differ from one engine with every group's bytes equal "
                                 f"({digests['regions']} regions): {got} vs {ref}")
        computed = [o["prompt_computed"] for o in out]
        if not all(c <= 2 for c in computed):  # the last prompt token, the one a state group backs off
            raise AssertionError(f"decode recomputed prompt tokens: {computed}")
        self.settle(self.prefill)
        self.settle(self.decode)
        return {"identical": sum(a == b for a, b in zip(got, ref)), "n": len(ref), "prompt_computed": computed,
                "digests": digests, "params": params}

    def negative_control(self, prompts, tag: str = "neg") -> dict:
        """The byte oracle's own control: digest the prefill's blocks of every group, overwrite
        them (the states included) before the decode loads them, and check that the oracle
        tells the decode's loaded bytes from the digests taken before. Returns how many requests
        differed, and whether the tokens changed too (not required: a tiny model's first decode
        steps may not show a wrong state)."""
        params = self.prefill_requests(prompts, f"{tag}-p")
        before = [self._side(self.prefill, kp["remote_block_ids"], kp["remote_num_tokens"]) for kp in params]
        groups = len(params[0]["remote_block_ids"])
        blocks = [sorted({b for p in params for b in p["remote_block_ids"][g]}) for g in range(groups)]
        if not all(self.prefill.call("scramble", block_ids=blocks)["scrambled"]):
            raise AssertionError("nothing was scrambled")
        out = self.decode_requests(prompts, params, f"{tag}-d")
        caught = 0
        for i, (kp, src) in enumerate(zip(params, before)):
            try:
                self._compare(f"{tag}-d{i}", kp, src)
            except BytesMismatch:
                caught += 1
        if caught != len(params):
            raise AssertionError(f"the byte oracle caught {caught} of {len(params)} loads of overwritten KV")
        self.settle(self.prefill)
        self.settle(self.decode)
        return {"caught": caught, "tokens": [o["tokens"] for o in out]}

    def group_digests(self, prompts, params, tag: str) -> dict:
        """Every group's bytes of every request the decode loaded, per region, sub-projection and
        head (:class:`beds.vllm_hooks.HybridOracle`). Returns ``{"regions", "keys": {region: n}}``;
        raises :class:`BytesMismatch`. A replicated part (B/C of an ``n_groups`` 1 model) must
        agree on every rank of both engines."""
        summary: dict = {"regions": 0, "keys": {}}
        for i, kp in enumerate(params):
            src = self._side(self.prefill, kp["remote_block_ids"], kp["remote_num_tokens"])
            summary["keys"].update(self._compare(f"{tag}{i}", kp, src))
        summary["regions"] = len(summary["keys"])
        return summary

    @staticmethod
    def _side(engine: EngineProcess, block_ids, n: int, loaded: str | None = None) -> dict:
        return _merge(engine.call("digest", block_ids=block_ids, num_tokens=n, loaded=loaded)["digests"])

    def _compare(self, rid: str, kp: dict, src: dict) -> dict:
        """The decode's copy of load ``rid`` against the prefill's digests ``src``."""
        loads = [r or {} for r in self.decode.call("loaded_blocks")["loads"]]
        key = next((k for k in loads[0] if k == rid or k.rsplit("-", 1)[0] == rid), None)
        if key is None:
            raise BytesMismatch(f"{rid}: the decode made no load for it")
        local, remote, n = loads[0][key]["local"], kp["remote_block_ids"], kp["remote_num_tokens"]
        if not (local and isinstance(local[0], list)) or any(b < 0 for g in local for b in g):
            raise BytesMismatch(f"{rid}: not a per-group load of every block: {local}")
        try:
            dst = self._side(self.decode, local, n, loaded=key)
        except RuntimeError as e:
            raise BytesMismatch(f"{rid}: the decode kept no copy of its load ({e})") from None
        if set(src) != set(dst):
            raise BytesMismatch(f"{rid}: regions {sorted(src)} on the prefill, {sorted(dst)} on the decode")
        keys = {}
        for region, (kind, heads) in src.items():
            got = dst[region][1]
            if set(heads) != set(got):
                raise BytesMismatch(f"{rid} {region}: {sorted(heads)} on the prefill, {sorted(got)} on the decode")
            for h, digests in heads.items():
                if len(digests) != 1 or digests != got[h]:
                    raise BytesMismatch(f"{rid} {region} ({kind}) {h}: prefill {sorted(digests)} vs decode "
                                        f"{sorted(got[h])} (blocks {remote} -> {local}, {n} tokens)")
            keys[region] = len(heads)
        return keys

    def close(self) -> None:
        close_all([self.prefill, self.decode])
