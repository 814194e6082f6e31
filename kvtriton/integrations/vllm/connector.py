"""``KVTritonConnector``: kvtriton as a vLLM v1 KV connector (only vLLM's public connector API).

Load it with::

    kv_transfer_config = {
        "kv_connector": "KVTritonConnector",
        "kv_connector_module_path": "kvtriton.integrations.vllm",
        "kv_role": "kv_producer",            # prefill; "kv_consumer" for decode, "kv_both" for either
        "kv_load_failure_policy": "recompute",  # decode: recompute blocks whose load failed
        "kv_connector_extra_config": {"port": 5710},  # see kvtriton.integrations.settings.TransferSettings
    }

The scheduler side lives in :mod:`.scheduler`, the worker side in :mod:`.worker`; this class only
routes vLLM's calls to them and adapts types.

It supports vLLM's hybrid KV cache manager (``SupportsHMA``): a sliding-window or Mamba/GDN
model keeps HMA on, the scheduler side gets one :class:`~.scheduler.CacheGroup` per KV cache
group, and the worker side one region per layer in its group (``RegionSpec.group``; Mamba/GDN
layers as state regions, :func:`.caches.regions_from_vllm_caches`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

try:  # failed receives by request: the only way vLLM takes a failed load with several KV cache groups
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # an older vLLM: block-level load errors only
    KVConnectorTransferResults = None

try:  # vLLM >= 0.34: how a connector reaches the KV cache decides how the extensible cache allocates it
    from vllm.config.kv_transfer import KVCacheAccess
except ImportError:  # 0.32, 0.33: no extensible KV cache, nothing to declare
    KVCacheAccess = None

from .caches import regions_from_vllm_caches, state_geometry
from .dp import dp_settings
from .metrics import KVTritonConnectorStats, KVTritonPromMetrics
from .scheduler import SchedulerSide, StepMessages, cache_groups
from .settings import SettingsError, from_extra_config
from .worker import WorkerSide

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

__all__ = ["KVTritonConnector", "KVTritonMetadata"]

logger = logging.getLogger(__name__)


class KVTritonMetadata(KVConnectorMetadata):
    """One step's messages from the scheduler to every worker (plain data: it crosses processes)."""

    def __init__(self, messages: StepMessages):
        self.messages = messages


class KVTritonConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector moving prompt KV from a prefill engine to a decode engine through kvtriton
    (hetero TP included), with NixlConnector's proxy protocol (``do_remote_decode`` /
    ``do_remote_prefill`` in ``kv_transfer_params``), hybrid models included (``SupportsHMA``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if os.environ.get("KVTRITON_DEBUG"):  # every control message and load, in every rank's log
            _debug_logging()
        kv = vllm_config.kv_transfer_config
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        # DP: each DP rank is an engine of its own, with its own id and range of ports (.dp)
        self.settings, self.engine_id = dp_settings(from_extra_config(kv.kv_connector_extra_config),
                                                    str(kv.engine_id), self.tp_size, vllm_config.parallel_config)
        self.block_size = vllm_config.cache_config.block_size
        self._producer = bool(kv.is_kv_producer)
        self._vllm_config = vllm_config
        #: KV cache groups (hybrid models: more than one)
        self._groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or (0,))
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(engine_id=self.engine_id, host=self.settings.host,
                                            port=self.settings.port, tp_size=self.tp_size,
                                            block_size=self.block_size,
                                            allowed_peers=self.settings.peer_allowlist(),
                                            groups=cache_groups(kv_cache_config))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # head-major blocks keep one head of one block contiguous; MLA has a single "head"
        model = vllm_config.model_config
        if model is None or getattr(model, "use_mla", False):
            return None
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config if vllm_config.kv_transfer_config else {}
        return from_extra_config(extra).kv_cache_layout or None

    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        """vLLM >= 0.34 (older ones never call it): the workers register the KV cache with NIXL
        (``REGISTERS``: each cache segment backed by one physical allocation, which UCX can
        register). ``register="staging"`` registers only kvtriton's own staging pool, so the cache
        is reached in process only."""
        extra = kv_transfer_config.kv_connector_extra_config if kv_transfer_config is not None else {}
        if from_extra_config(extra).register == "staging":
            return KVCacheAccess.IN_PROCESS
        return KVCacheAccess.REGISTERS

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVTritonMetadata(self._scheduler.build_messages(scheduler_output))

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA: the request's blocks in every KV cache group (out-of-window ones already nulled)."""
        return self._scheduler.request_finished(request, block_ids)

    def on_new_request(self, request) -> None:
        """A prefill request of a Mamba/GDN model stops one prompt token short (see :mod:`.scheduler`)."""
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        """vLLM >= 0.34: a load writes the request's own blocks in every group it transfers, so
        vLLM need not zero them first (as NixlConnector; the default assumes a prefix store)."""
        groups = getattr(self._kv_cache_config, "transfer_group_ids", None)
        if groups is None:
            groups = range(len(getattr(self._kv_cache_config, "kv_cache_groups", None) or (0,)))
        return tuple(groups)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        # a Mamba/GDN layer's cache is a list of tensors (conv, SSM state): all share one backing
        # allocation with the attention layers (the agent registers each storage once)
        first = next(t for v in kv_caches.values() for t in (v if isinstance(v, (list, tuple)) else (v,)))
        _check_staging_headroom(first.device, self.settings.staging_bytes)
        groups = _layer_groups(self._kv_cache_config)
        state_layers = _state_layer_names(self._kv_cache_config)
        regions = regions_from_vllm_caches(
            kv_caches, block_size=self.block_size,
            total_kv_heads=self._vllm_config.model_config.get_total_num_kv_heads(),
            mla_layers=_mla_layer_names(self._kv_cache_config),
            k_dim_major=first.device.type == "cpu",  # the CPU build's attention: K dim-major per block
            groups=groups,
            state=state_geometry(self._vllm_config.model_config.hf_config) if state_layers else None,
            tp_size=self.tp_size, conv_layout=_conv_state_layout(), state_pages=state_pages(self._kv_cache_config),
            block_sizes=_layer_block_sizes(self._kv_cache_config))
        self.vllm_caches = kv_caches  # vLLM's own tensors (the test bed's byte oracle reads them)
        self._worker = WorkerSide(self.settings, engine_id=self.engine_id, rank=get_tensor_model_parallel_rank(),
                                  tp_size=self.tp_size, regions=regions, serve=self._producer,
                                  failure_policy=_load_failure_policy(self._vllm_config))
        logger.info("kvtriton: rank %d of %s registered %d regions (vLLM cache %s %s strides %s -> %s%s)%s",
                    self._worker.rank, self.engine_id, len(regions), first.dtype, tuple(first.shape), first.stride(),
                    regions[0].spec.layout.value, regions[0].spec.head_dims,
                    f", handshake on {self.settings.host}:{self._worker.server.port}" if self._worker.server else "")

    def unregister_kv_caches(self) -> None:
        """Before sleep (vLLM >= 0.33; transfers drained by vLLM): the registration is dropped,
        whatever is still in flight fails typed and is recomputed. Idempotent."""
        if self._worker is not None:
            self._worker.unregister()

    def restore_kv_caches(self) -> None:
        """After wake: registered again under a newer generation; peers meet it again. Idempotent."""
        if self._worker is not None:
            self._worker.restore()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVTritonMetadata):
            self._worker.bind(connector_metadata.messages)

    def clear_connector_metadata(self) -> None:
        if self._worker is not None:
            self._worker.clear()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs only once its KV is in

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return None  # nothing leaves per layer: a decode pulls whole requests

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        sending, recving = self._worker.finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        """``get_finished``'s sets, and the requests whose load failed (``failed_recving``; each
        also finished receiving): with several KV cache groups vLLM refuses block-level load
        errors (a block id is unique only within its group), so it recomputes those requests."""
        if KVConnectorTransferResults is None:
            return super().get_transfer_results(finished_req_ids)
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.failed_loads() if self._worker is not None else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=failed if self._groups > 1 else set())

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._worker.load_errors() if self._worker is not None else set()
        return errors if self._groups <= 1 else set()  # several groups: failed_recving instead

    # ------------------------------------------------------------------ statistics (.metrics)
    def get_kv_connector_stats(self) -> KVTritonConnectorStats | None:
        """What this rank counted since vLLM last asked (once per step); None when nothing."""
        data = self._worker.take_stats() if self._worker is not None else None
        return None if data is None else KVTritonConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTritonConnectorStats:
        return KVTritonConnectorStats(data=data) if data is not None else KVTritonConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVTritonPromMetrics:
        return KVTritonPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None


def _check_staging_headroom(device: torch.device, staging_bytes: int) -> None:
    """The staging pool is allocated here, after vLLM sized the KV cache: vLLM 0.34 creates this
    connector once warmup measured free memory and the cache was committed (with
    ``gpu_memory_utilization`` 1.0 by default), so the pool fits only in headroom the user left.
    Say so, rather than fail in an allocation deep in the agent."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if free < staging_bytes:
        raise SettingsError(
            f"kvtriton's staging pool ({staging_bytes >> 20} MiB, kv_connector_extra_config['staging_bytes']) does "
            f"not fit: {free >> 20} MiB of {total >> 20} MiB free on {device} once vLLM committed its KV cache. "
            f"Leave headroom: lower gpu_memory_utilization by at least {staging_bytes / total:.4f} (plus a few "
            f"hundred MiB for kernels), or lower staging_bytes")


def _load_failure_policy(vllm_config) -> str:
    """vLLM's ``kv_load_failure_policy`` (``"fail"``, vLLM's default: a request whose load failed
    ends with an error and no tokens; ``"recompute"``: its prompt is computed locally)."""
    return str(getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", None) or "fail")


def _debug_logging() -> None:
    log = logging.getLogger("kvtriton")
    log.setLevel(logging.DEBUG)
    if not any(getattr(h, "_kvtriton", False) for h in log.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d pid %(process)d %(threadName)s %(name)s: %(message)s",
                                         "%H:%M:%S"))
        h._kvtriton = True
        log.addHandler(h)
        log.propagate = False


def _layer_groups(kv_cache_config) -> dict[str, int]:
    """Layer name -> index of its KV cache group (``RegionSpec.group``)."""
    return {name: i for i, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ())
            for name in group.layer_names}


def state_pages(kv_cache_config) -> dict[str, tuple]:
    """State layer name -> its ``MambaSpec``'s ``(shapes, dtypes)``: how its page holds conv and
    SSM states (:func:`.caches.state_views`)."""
    out = {}
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        for name in group.layer_names:
            s = getattr(spec, "kv_cache_specs", {}).get(name, spec)  # UniformTypeKVCacheSpecs
            if "Mamba" in type(s).__name__:
                out[name] = (tuple(tuple(x) for x in s.shapes), tuple(s.dtypes))
    return out


def _layer_block_sizes(kv_cache_config) -> dict[str, int]:
    """Layer name -> tokens per block of its group (a hybrid model's attention groups: vLLM raises
    their block size until a page matches the state pages)."""
    return {name: int(group.kv_cache_spec.block_size)
            for group in getattr(kv_cache_config, "kv_cache_groups", None) or () for name in group.layer_names}


def _state_layer_names(kv_cache_config) -> set[str]:
    """Layers whose cache is a Mamba/GDN state (``MambaSpec``)."""
    return {name for group in getattr(kv_cache_config, "kv_cache_groups", None) or ()
            if "Mamba" in type(group.kv_cache_spec).__name__ for name in group.layer_names}


def _conv_state_layout() -> str:
    """vLLM's conv state layout (``VLLM_SSM_CONV_STATE_LAYOUT``: ``DS`` or ``SD``, vLLM's default;
    its CPU platform picks DS only for its own NIXL connector): the state regions' conv views."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    except ImportError:  # a vLLM without the setting: SD
        return os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT") or "SD"
    return str(get_conv_state_layout())


def _mla_layer_names(kv_cache_config) -> set[str]:
    """Layers whose cache spec is an MLA spec (REPLICATE: identical on every rank)."""
    names: set[str] = set()
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        if isinstance(per_layer, dict):
            names.update(n for n, s in per_layer.items() if "MLA" in type(s).__name__)
        elif "MLA" in type(spec).__name__:
            names.update(group.layer_names)
    return names
