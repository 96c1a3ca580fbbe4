"""Tiny random transformers models for numerics tests (built at test time, never committed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.15,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
VOCAB: int = COMMON["vocab_size"]

#: name → (config class, model class, config overrides)
KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "linear_rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_theta": 5000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}}),
    # issue 12: windows of 6 tokens, so every stage of the tiny bundles (L = 16, S = 64) runs past them
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", {
        "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),  # layer 1 slides
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0, "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        # original_max_position_embeddings = the bundles' seq_length: the short factors, as transformers uses
        "sliding_window": 10, "original_max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                            "long_factor": [1.0, 1.5, 2.2, 3.0, 4.0, 5.5, 7.0, 9.0]}}),
    # Mixture of experts: 4 experts, top 2, narrow experts; Qwen2-MoE with a shared expert and a dense layer.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": None}),
}

#: hybrid linear-attention kinds (Gated DeltaNet layers, full attention every 2nd layer): their recurrent layers
#: have no decode variants, so they are not among the KINDS every KV-cache host test runs.
LINEAR_ATTENTION: dict[str, Any] = dict(
    head_dim=32, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4)
HYBRID_KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", LINEAR_ATTENTION),
    # the dense variant: mlp_only_layers covers every layer
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**LINEAR_ATTENTION, "mlp_only_layers": [0, 1]}),
    # the sparse variant: decoder_sparse_step 2 makes the attention layer 1 a MoE layer (4 experts, top 2, a gated
    # shared expert); the linear layer 0 stays dense
    "qwen3_next_moe": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        **LINEAR_ATTENTION, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": True, "decoder_sparse_step": 2}),
}


def build_tiny(kind: str, directory: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
               overrides: dict[str, Any] | None = None) -> Any:
    """Create, save (safetensors) and return a tiny random model of `kind` in eval mode."""
    config_cls, model_cls, kind_overrides = {**KINDS, **HYBRID_KINDS}[kind]
    config = getattr(transformers, config_cls)(**{**COMMON, **kind_overrides, **(overrides or {})})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norms start at 1; perturb them so a wrong norm weight shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    model.to(dtype).save_pretrained(directory, safe_serialization=True)
    return model.float()


def build_tiny_qwen3_5_multimodal(directory: Path, seed: int = 0) -> Any:
    """A tiny random Qwen3_5ForConditionalGeneration (the published checkpoints' layout: a vision tower beside the
    text model), saved and returned in eval mode."""
    text = {k: v for k, v in COMMON.items() if k not in ("initializer_range",)}
    config = transformers.Qwen3_5Config(
        text_config={**text, **LINEAR_ATTENTION}, initializer_range=COMMON["initializer_range"],
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, temporal_patch_size=1))
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def prompt(n: int, seed: int = 0) -> list[int]:
    """n token ids, avoiding the special ids 0..2 so nothing is treated as padding or end of text."""
    import numpy as np

    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def build_unrouted_moe(directory: Path, seed: int = 0) -> Any:
    """A tiny Qwen3-MoE whose last expert no token is ever routed to: 5 experts, top 2, router rows a, a, -a, -a,
    0. Every token's scores are t, t, -t, -t, 0 with t = a·x, so the top two are experts 0, 1 (t > 0) or 2, 3
    (t < 0), never expert 4 (at t = 0 the tie goes to the lower indices)."""
    overrides = {"num_experts": 5}
    model = build_tiny("qwen3_moe", directory, seed, overrides=overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            rows = layer.mlp.gate.weight
            a = rows[0].clone()
            rows.copy_(torch.stack([a, a, -a, -a, torch.zeros_like(a)]))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def hf_logits(model: Any, ids: list[int]) -> Any:
    """transformers' logits [n, V] (numpy) for one full forward pass over ids."""
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def max_diff(a: Any, b: Any) -> float:
    """The largest absolute difference of two arrays of the same shape."""
    import numpy as np

    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())
