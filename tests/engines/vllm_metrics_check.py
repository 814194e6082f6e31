"""The connector's statistics through vLLM's own stats classes, on the vLLM this Python imports
(0.32 CPU build, upstream 0.33 or 0.34): ``KVConnectorProm`` and ``KVConnectorLogging`` resolve
KVTritonConnector from the kv_transfer_config as vLLM's stat loggers do, build its Prometheus
metrics and its stats objects, and are fed two ranks' windows merged the way vLLM's executor
merges them. Run by tests/test_vllm_metrics_stats.py under each vLLM; prints ``ok <version>``."""

import importlib
import sys

import vllm
from prometheus_client import REGISTRY
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

from kvtriton.agent import RequestResult
from kvtriton.errors import RequestRejectedError, TransferTimeoutError
from kvtriton.integrations.vllm import KVTritonConnector
from kvtriton.integrations.vllm.stats import WorkerStats

# upstream vLLM 0.34 refuses any config on an x86 CPU without triton-cpu (platforms/cpu.py); this
# check builds configs and connectors, never runs a model, so it declares Triton present
importlib.import_module("vllm.triton_utils").HAS_TRITON = True


def fail(msg):
    print(msg, file=sys.stderr)
    sys.exit(1)


kv = KVTransferConfig(kv_connector="KVTritonConnector", kv_connector_module_path="kvtriton.integrations.vllm",
                      kv_role="kv_consumer")
cfg = VllmConfig(kv_transfer_config=kv)
labels = {0: ["m", "0"], 1: ["m", "1"]}
prom = KVConnectorProm(cfg, ["model_name", "engine"], labels)
if type(prom.prom_metrics).__name__ != "KVTritonPromMetrics":
    fail(f"vLLM built {prom.prom_metrics!r}")

# two ranks' windows, as their workers' get_kv_connector_stats() return them
ranks = []
for r in range(2):
    w = WorkerStats()
    w.transfer(RequestResult(f"a{r}", True, seconds=0.02, descriptors=2, bytes=65536, post_seconds=0.001,
                             ways=(("staged", 2),)))
    w.transfer(RequestResult(f"b{r}", True, seconds=0.04, descriptors=3, bytes=4096, post_seconds=0.002,
                             ways=(("direct", 1), ("read_unpack", 1))))
    w.failed(TransferTimeoutError("t") if r else RequestRejectedError("r"))
    ranks.append(w.take({"eager_hits": 3 + r, "leases_expired": 1, "refused": 0}))
    if w.take({"eager_hits": 3 + r, "leases_expired": 1}) is not None:
        fail("a second take repeated the first one's events")
merged = KVTritonConnector.build_kv_connector_stats(ranks[0])
merged = merged.aggregate(KVTritonConnector.build_kv_connector_stats(ranks[1]))  # the executor's merge
payload = merged.to_dict()  # what the scheduler puts in SchedulerStats
prom.observe(payload, engine_idx=1)


def sample(name, **lab):
    v = REGISTRY.get_sample_value(name, {"model_name": "m", "engine": "1", **lab})
    return 0.0 if v is None else v


checks = {
    "count": (sample("vllm:kvtriton_xfer_time_seconds_count"), 4),
    "bytes": (sample("vllm:kvtriton_bytes_transferred_sum"), 2 * (65536 + 4096)),
    "descriptors": (sample("vllm:kvtriton_num_descriptors_sum"), 10),
    "staged": (sample("vllm:kvtriton_payloads_total", way="staged"), 4),
    "direct": (sample("vllm:kvtriton_payloads_total", way="direct"), 2),
    "read_unpack": (sample("vllm:kvtriton_payloads_total", way="read_unpack"), 2),
    "rejected": (sample("vllm:kvtriton_num_failed_transfers_total", kind="rejected"), 1),
    "timeout": (sample("vllm:kvtriton_num_failed_transfers_total", kind="timeout"), 1),
    "eager": (sample("vllm:kvtriton_eager_hits_total"), 7),
    "leases": (sample("vllm:kvtriton_num_expired_leases_total"), 2),
    "other engine": (REGISTRY.get_sample_value("vllm:kvtriton_xfer_time_seconds_count",
                                               {"model_name": "m", "engine": "0"}), 0),
    "pre-created": (REGISTRY.get_sample_value("vllm:kvtriton_payloads_total",
                                              {"model_name": "m", "engine": "0", "way": "pack_place"}), 0),
}
bad = {k: v for k, v in checks.items() if v[0] != v[1]}
if bad:
    fail(f"metrics differ (got, expected): {bad}")

# the logging stats logger: accumulate two steps, then one summary line through reduce()
logging_ = KVConnectorLogging(kv)
logging_.observe(payload)
logging_.observe(payload)
lines = []
logging_.log(lambda fmt, *a: lines.append(fmt % a))
if not lines or "Num successful transfers=8" not in lines[0] or "Num failed transfers=4" not in lines[0]:
    fail(f"logged {lines}")
# a payload that is not ours (or damaged on the way) is dropped, never raised on
junk = KVTritonConnector.build_kv_connector_stats({"transfer_duration": ["x"], "ways": {"staged": -1}, "events": 3})
if not junk.is_empty():
    fail(f"junk payload kept: {junk.data}")
print("ok", vllm.__version__)
