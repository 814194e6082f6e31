"""Run in the vLLM test bed's interpreter: the kvtriton connector's scheduler side of each DP
rank of a TP2 x DP2 prefill engine, built on vLLM's own config classes (with vLLM's own DP id
suffixing, as its engine core applies it). Prints, as JSON, per DP rank: the connector's engine
id, its base handshake port, and the port its ``kv_transfer_params`` name."""

import json
import sys

from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.engine.utils import _apply_dp_identity_suffix

from kvtriton.integrations.vllm.connector import KVTritonConnector
from kvtriton.integrations.vllm.scheduler import remote_params

out = []
for d in range(2):
    cfg = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=d),
                     kv_transfer_config=KVTransferConfig(kv_connector="KVTritonConnector", kv_role="kv_producer",
                                                         kv_connector_module_path="kvtriton.integrations.vllm",
                                                         engine_id="P",
                                                         kv_connector_extra_config={"port": int(sys.argv[1])}))
    _apply_dp_identity_suffix(cfg, d)
    c = KVTritonConnector(cfg, KVConnectorRole.SCHEDULER)
    s = c._scheduler
    params = remote_params(s.engine_id, s.host, s.port, s.tp_size, s.block_size, "r", [1])
    out.append([c.engine_id, c.settings.port, params["remote_port"]])
print(json.dumps(out))
