"""A prefill and a decode vLLM engine with kvtriton's connector (real vLLM in the bed's venv)."""

from beds.vllm_bed import EngineProcess, close_all, engine_cpus, free_port_range, wait_all_ready

from .vllm_bed_python import vllm_bed_python

BLOCK = 32


LENGTHS = (37, 100, 333, 650)  # not multiples of the block size; up to 21 blocks


MAX_TOKENS = 8


# the bed's timeouts (beds/vllm_pair.py: a host that starves an engine for up to ~90 s)
P_EXTRA = {"lease_s": 180.0, "handshake_timeout_s": 60.0}


D_EXTRA = {"timeout_s": 120.0, "handshake_timeout_s": 60.0, "handshake_attempts": 3}


class Pair:
    """A prefill engine and a decode engine, both with kvtriton's connector."""

    def __init__(self, model_dir, log_dir, p_tp, d_tp, p_extra=None, d_extra=None, p_block=BLOCK, d_block=BLOCK):
        self.p_tp, self.d_tp = p_tp, d_tp
        port = free_port_range(p_tp)
        # both start at once, each on its own cores: a pair is ready in one engine's start-up time
        self.prefill = EngineProcess.launch(
            vllm_bed_python(), model_dir, tp=p_tp, connector="kvtriton", role="kv_producer", port=port,
            block_size=p_block,
            extra={**P_EXTRA, **(p_extra or {})}, engine_id=f"prefill-tp{p_tp}", log_dir=log_dir, name="prefill",
            cpus=engine_cpus(p_tp, 0))
        try:
            self.decode = EngineProcess.launch(
                vllm_bed_python(), model_dir, tp=d_tp, connector="kvtriton", role="kv_consumer",
                port=free_port_range(1),
                block_size=d_block, extra={**D_EXTRA, **(d_extra or {})}, engine_id=f"decode-tp{d_tp}",
                log_dir=log_dir, name="decode", cpus=engine_cpus(d_tp, 1))  # no core shared with the prefill
        except BaseException:
            self.prefill.kill()
            raise
        wait_all_ready([self.prefill, self.decode])

    def reference(self, prompts, tag="ref"):
        """Greedy tokens of the decode engine computing each prompt itself (no transfer)."""
        out = self.decode.call("generate", requests=[
            {"id": f"{tag}{i}", "prompt": p, "max_tokens": MAX_TOKENS} for i, p in enumerate(prompts)])["outputs"]
        assert [o["prompt_computed"] for o in out] == [len(p) for p in prompts]
        return [o["tokens"] for o in out]

    def prefill_requests(self, prompts, tag):
        out = self.prefill.call("generate", requests=[
            {"id": f"{tag}{i}", "prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            for i, p in enumerate(prompts)])["outputs"]
        params = [o["kv_transfer_params"] for o in out]
        assert all(p and p["do_remote_prefill"] and p["tp_size"] == self.p_tp for p in params), params
        return params

    def decode_requests(self, prompts, params, tag, timeout_s=400):
        return self.decode.call("generate", timeout_s=timeout_s + 30, requests=[
            {"id": f"{tag}{i}", "prompt": p, "max_tokens": MAX_TOKENS, "kv_transfer_params": kp}
            for i, (p, kp) in enumerate(zip(prompts, params))], seconds=timeout_s)["outputs"]

    def settle(self, engine, seconds=30):
        """Step ``engine`` until it holds no request; its blocks and staging must all be free."""
        engine.call("drain", seconds=seconds, timeout_s=seconds + 30)
        state = engine.call("state")
        assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"], state
        assert state["staging_in_use"] and all(s == 0 for s in state["staging_in_use"]), state
        return state

    def close(self):
        close_all([self.prefill, self.decode])

