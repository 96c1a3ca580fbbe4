"""Qwen2-MoE: the Qwen2 decoder (q/k/v bias) with sparse experts plus a sigmoid-gated shared expert."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.core.stages import BlockContext
from topq.ir.graph import Value
from topq.models.blocks import rms_norm, self_attention
from topq.models.decoder import DECODER_LAYER_WEIGHTS, DECODER_QUANT_GROUPS, normalize_llama_like
from topq.models.gguf import (
    LLAMA_TENSORS,
    MOE_METADATA,
    QWEN_MOE_TENSORS,
    QWEN_SHARED_EXPERT_TENSORS,
    GGUFArchitecture,
)
from topq.models.moe import QWEN_MOE_FIELDS, QWEN_SHARED_EXPERTS, moe_feed_forward, read_moe


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    # q/k/v biases: `qkv_bias` in newer configs, always on in older ones.
    spec = normalize_llama_like(config, "qwen2_moe", QWEN_MOE_FIELDS,
                                attention_bias=bool(config.get("qkv_bias", True)))
    return replace(spec, moe=read_moe(config, "qwen2_moe", spec.num_layers, spec.intermediate_size, shared=True))


def build_block(ctx: BlockContext) -> Value:
    b, x = ctx.b, ctx.hidden
    x = b.top.Add(x, self_attention(ctx, rms_norm(ctx, x, "input_layernorm")))
    return b.top.Add(x, moe_feed_forward(ctx, rms_norm(ctx, x, "post_attention_layernorm"), QWEN_SHARED_EXPERTS))


#: llama.cpp's qwen2moe: every layer sparse, top-k scores not renormalised.
GGUF = GGUFArchitecture(
    name="qwen2moe", architecture="Qwen2MoeForCausalLM", model_type="qwen2_moe",
    tensors={**LLAMA_TENSORS, **QWEN_MOE_TENSORS, **QWEN_SHARED_EXPERT_TENSORS},
    metadata={**MOE_METADATA, "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    defaults={"norm_topk_prob": False}, flags={"qkv_bias": "attn_q.bias"})

FAMILY = ModelFamily(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    normalize=normalize,
    layer_weights=DECODER_LAYER_WEIGHTS,
    build_block=build_block,
    quant_groups=DECODER_QUANT_GROUPS,
    config_fields=QWEN_MOE_FIELDS,
    description="Qwen2-MoE / Qwen1.5-MoE (q/k/v bias, top-k experts, gated shared expert)",
    formats={"gguf": GGUF},
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
