"""The SGLang test bed's stand-in for the CPU build of sgl-kernel (SGLang's native op library).

Why it exists: with ``SGLANG_USE_CPU_ENGINE=1`` SGLang 0.5.23 imports CPU ops from ``sgl_kernel``
at module level (``sglang/srt/mem_cache/allocation.py:46`` ``assign_req_to_token_pool_cpu``,
``sglang/kernels/ops/kvcache/cache_move.py:10`` ``copy_all_layer_kv_cache_cpu``, and the
speculative-decoding ops), and PyPI publishes sgl-kernel only as its CUDA build
(``sglang-kernel`` 0.4.10 fails to import here: ``libcuda.so.1: cannot open shared object
file``); the CPU build is compiled from SGLang's sources, which no registry carries. So the
bed's servers (and only they: :mod:`beds.sglang_servers` puts this folder on their
``PYTHONPATH``) get torch implementations of the two memory ops the CPU path of a plain Llama
calls, with the semantics of SGLang's own Triton kernels. Every other name raises when called,
naming the op. ``torch.ops.sgl_kernel`` stays empty, so SGLang's Intel AMX backend
(``sglang/srt/utils/common.py:358``: ``convert_weight_packed``) is off and every layer takes its
plain torch path. Nothing of SGLang's scheduler, pools, disaggregation or transfer backends is
replaced.
"""

import ctypes

__version__ = "0.0.0+kvtriton-bed"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = `` the next ``end[i] - start[i]``
    entries of ``out_cache_loc`` (requests in order), as ``allocation.assign_req_to_token_pool``."""
    at = 0
    for row, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = e - s
        req_to_token[row, s:e] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += n


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every buffer ``b`` (address ``data_ptrs[b]``, ``strides[b]`` bytes per token): copy the
    token rows at ``src_loc`` to ``tgt_loc``, as ``cache_move.copy_all_layer_kv_cache_tiled``
    (sources read before any target is written)."""
    src, tgt = src_loc.tolist(), tgt_loc.tolist()
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(ptr + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(ptr + t * stride, row, stride)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not in the kvtriton test bed's CPU op stand-in "
                                  "(beds/sglang_cpu_ops): this server path needs the real CPU build")

    missing.__name__ = name
    return missing
