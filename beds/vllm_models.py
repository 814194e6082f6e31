"""Tiny random-weight models for the vLLM test bed: small enough for a 2-core CPU, shaped like the
models heterogeneous TP exists for. Each writer needs ``transformers`` (the bed's venv has it) and
writes a config + safetensors folder once (an existing ``config.json`` is kept).

* :class:`TinyLlama` (:func:`make_tiny_llama`): a GQA Llama; ``kv_heads`` picks the TP pairs it
  exercises (6 heads: P2->D3; 1 head: fewer KV heads than prefill ranks, vLLM replicates it).
* :class:`TinyDeepseek` (:func:`make_tiny_deepseek`): a DeepSeek-V2 with MLA at the **real**
  latent size (``kv_lora_rank`` 512 + rope 64 = 576, the only one vLLM's CPU MLA backend
  takes), dense MLPs, everything else tiny.
* Hybrids (issue 32), each a config vLLM's CPU build runs with its hybrid KV cache manager (HMA):
  :class:`TinyGemma3` (sliding window + full attention: 2 KV cache groups, the window smaller
  than the test prompts so clipping shows), :class:`TinyNemotronH` (Mamba2 + attention;
  ``n_groups`` 2 or 1, the latter replicating B/C on every rank at TP > 1) and
  :class:`TinyQwen3Next` (Gated DeltaNet + attention, every layer MoE; bf16 engines, GDN head
  dim 128: the CPU GDN kernel refuses less). Their defaults divide by TP 1, 2 and 3 where vLLM
  needs it (heads, KV heads, Mamba heads; a vocabulary padded to a multiple of 3 x 64).
* :func:`make_eagle3_mla_draft`: an ``Eagle3DeepseekV2ForCausalLM`` draft (one MLA layer) for a
  :class:`TinyLlama` target: the mixed cache of vLLM PR #44583 (a GQA target and an MLA draft in
  one KV cache group).

From a shell (the bed's Python)::

    python -m beds.vllm_models deepseek /tmp/ds '{"layers": 2}'
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TinyLlama", "TinyDeepseek", "TinyGemma3", "TinyNemotronH", "TinyQwen3Next", "make_tiny_llama",
           "make_tiny_deepseek", "make_tiny_gemma3", "make_tiny_nemotronh", "make_tiny_qwen3next",
           "make_eagle3_mla_draft", "make_model", "HYBRID_KINDS"]


@dataclass(frozen=True)
class TinyLlama:
    """A GQA Llama small enough for a 2-core CPU: random weights, no tokenizer. A TP3 engine needs
    a vocabulary vLLM pads to a multiple of 3 x 64 (576, not 512)."""

    layers: int = 2
    kv_heads: int = 2
    heads: int = 4
    head_dim: int = 32
    hidden: int = 128
    vocab: int = 512
    max_positions: int = 4096
    seed: int = 0


@dataclass(frozen=True)
class TinyDeepseek:
    """A DeepSeek-V2 with MLA: latent ``kv_lora_rank + rope`` per token (576 by default, what vLLM's
    CPU MLA backend requires), no MoE (``first_k_dense_replace`` covers every layer)."""

    layers: int = 2
    heads: int = 4
    hidden: int = 128
    kv_lora_rank: int = 512
    rope: int = 64
    nope: int = 32
    v_head_dim: int = 32
    q_lora_rank: int | None = None
    vocab: int = 512
    max_positions: int = 4096
    seed: int = 0


@dataclass(frozen=True)
class TinyGemma3:
    """A Gemma-3 text model alternating sliding-window and full attention layers: vLLM makes two
    KV cache groups (``SlidingWindowSpec`` and ``FullAttentionSpec``). ``sliding_window`` 48 at
    block 32: a decode needs only the last ``cdiv(48, 32) + 1`` = 3 blocks of the window group."""

    layers: int = 4
    sliding_window: int = 48
    kv_heads: int = 6
    heads: int = 6
    head_dim: int = 32
    hidden: int = 192
    vocab: int = 576
    max_positions: int = 4096
    seed: int = 0


@dataclass(frozen=True)
class TinyNemotronH:
    """A Nemotron-H hybrid: ``pattern`` ``M`` Mamba2, ``*`` attention, ``-`` MLP (layer 0 Mamba,
    1 attention, 2 MLP, 3 Mamba: vLLM groups the two Mamba layers and the attention layer apart).
    Mamba2: ``mamba_heads`` x ``mamba_head_dim`` = ``hidden`` (expand 1), ``n_groups`` B/C groups
    (1: vLLM replicates B and C on every rank at TP > 1), ``ssm_state`` per head, conv kernel 4."""

    pattern: str = "M*-M"
    n_groups: int = 2
    mamba_heads: int = 12
    mamba_head_dim: int = 16
    ssm_state: int = 16
    conv_kernel: int = 4
    kv_heads: int = 6
    heads: int = 6
    head_dim: int = 32
    hidden: int = 192
    vocab: int = 576
    max_positions: int = 4096
    seed: int = 0


@dataclass(frozen=True)
class TinyQwen3Next:
    """A Qwen3-Next: Gated DeltaNet (``linear_attention``) and full attention layers alternating,
    every layer MoE (vLLM's Qwen3-Next needs one). GDN ``k_heads`` x ``k_head_dim`` keys,
    ``v_heads`` x ``v_head_dim`` values (128: the CPU kernel refuses 32); engines run it in bf16."""

    layers: int = 4
    k_heads: int = 2
    v_heads: int = 4
    k_head_dim: int = 128
    v_head_dim: int = 128
    conv_kernel: int = 4
    kv_heads: int = 2
    heads: int = 4
    head_dim: int = 32
    hidden: int = 128
    experts: int = 4
    vocab: int = 512
    max_positions: int = 4096
    seed: int = 0


#: hybrid kinds of :func:`make_model` and the engine options each needs (bf16 for Qwen3-Next)
HYBRID_KINDS = {"gemma3": {}, "nemotronh": {}, "qwen3next": {"dtype": "bfloat16"}}


def _save(model, path: Path, seed: int, scale: float = 0.08) -> Path:
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():  # larger weights than the default init: logits far apart, no argmax ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, scale)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_llama(path: str | os.PathLike, model: TinyLlama = TinyLlama()) -> Path:
    """Write a random-weight Llama (config + safetensors) to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(model.seed)
    cfg = LlamaConfig(vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=2 * model.hidden,
                      num_hidden_layers=model.layers, num_attention_heads=model.heads,
                      num_key_value_heads=model.kv_heads, head_dim=model.head_dim,
                      max_position_embeddings=model.max_positions, torch_dtype="float32",
                      tie_word_embeddings=False)
    return _save(LlamaForCausalLM(cfg), path, model.seed)


def _deepseek_config(model: TinyDeepseek, **more):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=2 * model.hidden,
        moe_intermediate_size=model.hidden, num_hidden_layers=model.layers, num_attention_heads=model.heads,
        num_key_value_heads=model.heads, kv_lora_rank=model.kv_lora_rank, q_lora_rank=model.q_lora_rank,
        qk_rope_head_dim=model.rope, qk_nope_head_dim=model.nope, v_head_dim=model.v_head_dim,
        first_k_dense_replace=model.layers, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=1,
        max_position_embeddings=model.max_positions, torch_dtype="float32", tie_word_embeddings=False,
        rope_scaling=None, **more)


def make_tiny_deepseek(path: str | os.PathLike, model: TinyDeepseek = TinyDeepseek()) -> Path:
    """Write a random-weight DeepSeek-V2 (MLA, dense MLPs) to ``path``."""
    import torch
    from transformers import DeepseekV2ForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(model.seed)
    return _save(DeepseekV2ForCausalLM(_deepseek_config(model)), path, model.seed)


def make_tiny_gemma3(path: str | os.PathLike, model: TinyGemma3 = TinyGemma3()) -> Path:
    """Write a random-weight Gemma-3 text model (sliding, full, sliding, full, ...) to ``path``."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(model.seed)
    cfg = Gemma3TextConfig(
        vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=2 * model.hidden,
        num_hidden_layers=model.layers, num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
        head_dim=model.head_dim, max_position_embeddings=model.max_positions, sliding_window=model.sliding_window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(model.layers)],
        query_pre_attn_scalar=model.head_dim, tie_word_embeddings=True, torch_dtype="float32")
    cfg.architectures = ["Gemma3ForCausalLM"]
    return _save(Gemma3ForCausalLM(cfg), path, model.seed)


def make_tiny_nemotronh(path: str | os.PathLike, model: TinyNemotronH = TinyNemotronH()) -> Path:
    """Write a random-weight Nemotron-H (Mamba2 + attention + MLP layers, ``model.pattern``) to ``path``."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    if model.mamba_heads * model.mamba_head_dim != model.hidden:
        raise ValueError(f"mamba_heads x mamba_head_dim ({model.mamba_heads} x {model.mamba_head_dim}) must equal "
                         f"hidden ({model.hidden}): the tiny model uses expand 1")
    torch.manual_seed(model.seed)
    types = {"M": "mamba", "*": "attention", "-": "mlp"}
    cfg = NemotronHConfig(
        vocab_size=model.vocab, hidden_size=model.hidden, layers_block_type=[types[c] for c in model.pattern],
        num_attention_heads=model.heads, num_key_value_heads=model.kv_heads, head_dim=model.head_dim,
        max_position_embeddings=model.max_positions, intermediate_size=2 * model.hidden,
        ssm_state_size=model.ssm_state, mamba_num_heads=model.mamba_heads, mamba_head_dim=model.mamba_head_dim,
        n_groups=model.n_groups, conv_kernel=model.conv_kernel, expand=1, chunk_size=64,
        tie_word_embeddings=False, torch_dtype="float32")
    cfg.architectures = ["NemotronHForCausalLM"]
    return _save(NemotronHForCausalLM(cfg), path, model.seed)


def make_tiny_qwen3next(path: str | os.PathLike, model: TinyQwen3Next = TinyQwen3Next()) -> Path:
    """Write a random-weight Qwen3-Next (Gated DeltaNet and full attention alternating, MoE) to ``path``."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(model.seed)
    cfg = Qwen3NextConfig(
        vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=2 * model.hidden,
        num_hidden_layers=model.layers, num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
        head_dim=model.head_dim, max_position_embeddings=model.max_positions,
        layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(model.layers)],
        linear_conv_kernel_dim=model.conv_kernel, linear_key_head_dim=model.k_head_dim,
        linear_value_head_dim=model.v_head_dim, linear_num_key_heads=model.k_heads,
        linear_num_value_heads=model.v_heads, decoder_sparse_step=1, mlp_only_layers=[],
        num_experts=model.experts, num_experts_per_tok=2, moe_intermediate_size=model.hidden,
        shared_expert_intermediate_size=model.hidden, tie_word_embeddings=False, torch_dtype="float32")
    cfg.architectures = ["Qwen3NextForCausalLM"]
    return _save(Qwen3NextForCausalLM(cfg), path, model.seed)


def make_eagle3_mla_draft(path: str | os.PathLike, target: TinyLlama = TinyLlama(),
                          draft: TinyDeepseek = TinyDeepseek(layers=1, q_lora_rank=64)) -> Path:
    """Write an Eagle-3 draft with one MLA layer (``Eagle3DeepseekV2ForCausalLM``) for ``target``:
    the weights vLLM's loader maps (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``embed_tokens``)
    as safetensors, and a DeepSeek-V2 config naming that architecture. The draft needs a
    ``q_lora_rank``: vLLM's Eagle-3 loader always stacks ``kv_a_proj_with_mqa`` into
    ``fused_qkv_a_proj``, which only a low-rank query projection has."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    if (path / "config.json").exists():
        return path
    if target.layers < 2:
        raise ValueError("an Eagle-3 draft reads a hidden state from inside the target: give it >= 2 layers")
    if draft.q_lora_rank is None:
        raise ValueError("an Eagle-3 DeepSeek draft needs q_lora_rank (vLLM loads it fused with kv_a_proj_with_mqa)")
    if draft.hidden != target.hidden or draft.vocab != target.vocab:
        raise ValueError(f"the draft's hidden/vocab ({draft.hidden}, {draft.vocab}) must equal the target's "
                         f"({target.hidden}, {target.vocab})")
    # one auxiliary hidden state, taken before the target's last layer: vLLM's default picks
    # layers (2, L // 2, L - 3), which a 2-layer target does not have
    aux = [target.layers - 1]
    cfg = _deepseek_config(draft, architectures=["Eagle3DeepseekV2ForCausalLM"], num_aux_hidden_states=len(aux),
                           eagle_aux_hidden_state_layer_ids=aux, target_hidden_size=target.hidden,
                           draft_vocab_size=draft.vocab)
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(draft.seed + 1)
    h, n, q = draft.hidden, draft.heads, draft.nope + draft.rope

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.08).contiguous()

    a = "midlayer.self_attn."
    tensors = {
        "fc.weight": w(h, len(aux) * target.hidden), "norm.weight": torch.ones(h), "lm_head.weight": w(draft.vocab, h),
        "embed_tokens.weight": w(draft.vocab, h),
        "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        a + "q_a_proj.weight": w(draft.q_lora_rank, 2 * h), a + "q_a_layernorm.weight": torch.ones(draft.q_lora_rank),
        a + "q_b_proj.weight": w(n * q, draft.q_lora_rank),
        a + "kv_a_proj_with_mqa.weight": w(draft.kv_lora_rank + draft.rope, 2 * h),
        a + "kv_a_layernorm.weight": torch.ones(draft.kv_lora_rank),
        a + "kv_b_proj.weight": w(n * (draft.nope + draft.v_head_dim), draft.kv_lora_rank),
        a + "o_proj.weight": w(h, n * draft.v_head_dim),
        "midlayer.mlp.gate_proj.weight": w(2 * h, h), "midlayer.mlp.up_proj.weight": w(2 * h, h),
        "midlayer.mlp.down_proj.weight": w(h, 2 * h),
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path


_HYBRIDS = {"gemma3": (TinyGemma3, make_tiny_gemma3), "nemotronh": (TinyNemotronH, make_tiny_nemotronh),
            "qwen3next": (TinyQwen3Next, make_tiny_qwen3next)}


def make_model(kind: str, path: str | os.PathLike, options: dict | None = None) -> Path:
    """``kind``: ``llama``, ``deepseek``, ``eagle3-mla`` (options: ``target``/``draft`` dicts), or a
    hybrid: ``gemma3``, ``nemotronh``, ``qwen3next`` (options: the fields of its ``Tiny*`` class)."""
    options = dict(options or {})
    if kind in _HYBRIDS:
        cls, make = _HYBRIDS[kind]
        return make(path, cls(**options))
    if kind == "llama":
        return make_tiny_llama(path, TinyLlama(**options))
    if kind == "deepseek":
        return make_tiny_deepseek(path, TinyDeepseek(**options))
    if kind == "eagle3-mla":
        return make_eagle3_mla_draft(path, TinyLlama(**options.get("target", {})),
                                     TinyDeepseek(**{"layers": 1, "q_lora_rank": 64, **options.get("draft", {})}))
    raise ValueError(f"unknown model kind {kind!r}: expected llama, deepseek, eagle3-mla, {', '.join(_HYBRIDS)}")


if __name__ == "__main__":
    make_model(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)
