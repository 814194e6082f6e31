"""The connector's scheduler side on the vLLM that this Python imports (0.32 CPU build or upstream
0.33 or 0.34), with vLLM's own config, Request, SchedulerOutput and KVCacheBlocks types: the proxy
protocol from a prefill request to a decode load and its cancellation. Run by
tests/engines/test_vllm_connector.py under each vLLM; prints one ``ok <version>`` line."""

import importlib
import inspect
import sys

assert "vllm" not in sys.modules, "import kvtriton imported vLLM"
import kvtriton.integrations.vllm as integration  # noqa: E402

assert "vllm" not in sys.modules, "importing the integration package imported vLLM"

import vllm  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

# upstream vLLM 0.34 refuses any config on an x86 CPU without triton-cpu (platforms/cpu.py); this
# check builds configs and connectors, never runs a model, so it declares Triton present
importlib.import_module("vllm.triton_utils").HAS_TRITON = True

BLOCK = 16


def transfer_config(role: str, engine_id: str, **extra) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="KVTritonConnector", kv_connector_module_path="kvtriton.integrations.vllm",
                            kv_role=role, engine_id=engine_id,
                            kv_connector_extra_config={"port": 6100, "lease_s": 7.0, **extra})


def connector(role: str, engine_id: str):
    cfg = VllmConfig(
        kv_transfer_config=transfer_config(role, engine_id),
        parallel_config=ParallelConfig(tensor_parallel_size=1), cache_config=CacheConfig(block_size=BLOCK))
    return integration.KVTritonConnector(cfg, KVConnectorRole.SCHEDULER, None)


def request(rid: str, n: int, params: dict) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
                   None)


def new_data(req: Request, block_ids: list[int], *more_groups: list[int]) -> NewRequestData:
    """NewRequestData as vLLM's scheduler makes it (0.34 also passes the tokens to prefill);
    ``more_groups``: the block ids of KV cache groups 1, 2... (hybrid models)."""
    ids = (block_ids, *more_groups)
    if "prefill_token_ids" in inspect.signature(NewRequestData.from_request).parameters:
        return NewRequestData.from_request(req, ids, prefill_token_ids=list(req.prompt_token_ids))
    return NewRequestData.from_request(req, ids)


def step(conn, new=(), tokens=None):
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = list(new)
    out.num_scheduled_tokens = dict(tokens or {})
    return conn.build_connector_meta(out).messages


# prefill: a do_remote_decode request is held after the step that completes its prompt
p = connector("kv_producer", "P")
preq = request("p1", 40, {"do_remote_decode": True})
assert p.get_num_new_matched_tokens(preq, 0) == (0, False)
p.update_state_after_alloc(preq, KVCacheBlocks(blocks=([],)), 0)
msgs = step(p, [new_data(preq, [4, 5, 6])], {"p1": 40})
assert msgs.holds == {"p1": (4, 5, 6)}, msgs
preq.status = RequestStatus.FINISHED_LENGTH_CAPPED
delay, params = p.request_finished(preq, [4, 5, 6])
assert delay and params["remote_block_ids"] == [4, 5, 6] and params["remote_engine_id"] == "P", params
assert params["remote_port"] == 6100 and params["tp_size"] == 1 and params["do_remote_prefill"]
assert params["remote_num_tokens"] == 40, params  # as NixlConnector 0.34 sends it
assert step(p).confirms == {"p1"}
# a prefill that ends any other way is released, never reported
preq2 = request("p2", 20, {"do_remote_decode": True})
p.get_num_new_matched_tokens(preq2, 0)
assert step(p, [new_data(preq2, [9, 10])], {"p2": 20}).holds == {"p2": (9, 10)}
preq2.status = RequestStatus.FINISHED_ABORTED
assert p.request_finished(preq2, [9, 10]) == (False, None)
assert step(p).releases == {"p2"}

# decode: every prompt token comes from the prefill; blocks pair by position; abort cancels
d = connector("kv_consumer", "D")
dreq = request("d1", 40, dict(params))
assert d.get_num_new_matched_tokens(dreq, 0) == (40, True)
d.update_state_after_alloc(dreq, KVCacheBlocks(blocks=([KVCacheBlock(b) for b in (7, 8, 9)],)), 40)
load = step(d).loads["d1"]
assert load.remote_block_ids == (4, 5, 6) and load.local_block_ids == (7, 8, 9) and load.report
assert load.source.request_id == "p1" and load.source.engine_id == "P"
dreq.status = RequestStatus.FINISHED_ABORTED
assert d.request_finished(dreq, [7, 8, 9]) == (False, None)
assert step(d).cancels == {"d1"}
# malformed params: computed locally, never loaded
bad = request("d2", 40, {**params, "remote_block_ids": ["x"]})
assert d.get_num_new_matched_tokens(bad, 0) == (0, False)
assert integration.KVTritonConnector.get_required_kvcache_layout(p._vllm_config) in (None, "LBHNC")

# what this vLLM's base class asks of a connector: nothing left abstract, and 0.34's declarations
Connector = integration.KVTritonConnector
assert not Connector.__abstractmethods__, Connector.__abstractmethods__
assert d.get_loaded_kv_cache_group_ids(dreq) == (0,)  # a load writes the request's own blocks
for hook in ("unregister_kv_caches", "restore_kv_caches"):  # sleep and wake (0.33 and later)
    if hasattr(KVConnectorBase_V1, hook):
        assert getattr(Connector, hook) is not getattr(KVConnectorBase_V1, hook), hook
        getattr(d, hook)()  # a scheduler-side connector has no worker: nothing to do
try:
    from vllm.config.kv_transfer import KVCacheAccess
except ImportError:  # before 0.34: no extensible KV cache
    assert not hasattr(KVConnectorBase_V1, "kv_cache_access")
else:
    assert Connector.kv_cache_access(transfer_config("kv_producer", "P")) == KVCacheAccess.REGISTERS
    assert Connector.kv_cache_access(transfer_config("kv_producer", "P", register="staging")) == \
        KVCacheAccess.IN_PROCESS  # only kvtriton's own staging pool is registered then
    assert p._vllm_config.kv_transfer_config.registers_kv_cache_memory()  # what vLLM itself reads from it

# hybrid models (issue 32): the connector keeps vLLM's hybrid KV cache manager on (SupportsHMA),
# and a Mamba model's prefill request (vLLM's own Request) stops one prompt token short
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA, supports_hma  # noqa: E402

assert issubclass(Connector, SupportsHMA) and supports_hma(Connector)


class MambaSpec:  # what the scheduler side reads of a state group (by type name, as vLLM's own)
    block_size = 4096


class FullAttentionSpec:
    block_size = BLOCK


hybrid_config = type("KVCacheConfig", (), {"kv_cache_groups": [
    type("G", (), {"kv_cache_spec": MambaSpec(), "layer_names": ["m"]})(),
    type("G", (), {"kv_cache_spec": FullAttentionSpec(), "layer_names": ["a"]})()]})()
hp = integration.KVTritonConnector(p._vllm_config, KVConnectorRole.SCHEDULER, hybrid_config)
hreq = request("h1", 40, {"do_remote_decode": True})
hp.on_new_request(hreq)
assert (hreq.num_prompt_tokens, len(hreq.prompt_token_ids), hreq.num_tokens) == (39, 39, 39), hreq
hp.get_num_new_matched_tokens(hreq, 0)
assert step(hp, [new_data(hreq, [9], [4, 5, 6])], {"h1": 39}).holds == {"h1": ((9,), (4, 5, 6))}
hreq.status = RequestStatus.FINISHED_LENGTH_CAPPED
delay, hparams = hp.request_finished_all_groups(hreq, ([9], [4, 5, 6]))
assert delay and hparams["remote_block_ids"] == [[9], [4, 5, 6]] and hparams["remote_num_tokens"] == 39, hparams
hd = integration.KVTritonConnector(d._vllm_config, KVConnectorRole.SCHEDULER, hybrid_config)
hdreq = request("hd1", 40, dict(hparams))
assert hd.get_num_new_matched_tokens(hdreq, 0) == (39, True)  # the decode computes the 40th itself
hd.update_state_after_alloc(hdreq, KVCacheBlocks(blocks=([KVCacheBlock(3)], [KVCacheBlock(b) for b in (7, 8, 10)])), 39)
hload = step(hd).loads["hd1"]
assert hload.remote_block_ids == ((9,), (4, 5, 6)) and hload.local_block_ids == ((3,), (7, 8, 10)), hload
print("ok", vllm.__version__)
