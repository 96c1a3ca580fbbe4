"""Qwen3-MoE: the Qwen3 decoder (q/k norm) with a sparse mixture-of-experts feed-forward (no shared expert)."""

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
from topq.models.gguf import LLAMA_TENSORS, MOE_METADATA, QK_NORM_TENSORS, QWEN_MOE_TENSORS, GGUFArchitecture
from topq.models.moe import QWEN_EXPERTS, QWEN_MOE_FIELDS, moe_feed_forward, read_moe

LAYER_WEIGHTS = {
    **DECODER_LAYER_WEIGHTS,
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    spec = normalize_llama_like(config, "qwen3_moe", QWEN_MOE_FIELDS, qk_norm=True)
    return replace(spec, moe=read_moe(config, "qwen3_moe", spec.num_layers, spec.intermediate_size))


def build_block(ctx: BlockContext) -> Value:
    b, x = ctx.b, ctx.hidden
    x = b.top.Add(x, self_attention(ctx, rms_norm(ctx, x, "input_layernorm"), qk_norm=True))
    return b.top.Add(x, moe_feed_forward(ctx, rms_norm(ctx, x, "post_attention_layernorm"), QWEN_EXPERTS))


#: llama.cpp's qwen3moe always renormalises the top-k scores (transformers' GGUF loader assumes the same).
GGUF = GGUFArchitecture("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe",
                        {**LLAMA_TENSORS, **QK_NORM_TENSORS, **QWEN_MOE_TENSORS}, metadata=MOE_METADATA,
                        defaults={"norm_topk_prob": True})

FAMILY = ModelFamily(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    normalize=normalize,
    layer_weights=LAYER_WEIGHTS,
    build_block=build_block,
    quant_groups=DECODER_QUANT_GROUPS,
    config_fields=QWEN_MOE_FIELDS,
    description="Qwen3-MoE (q/k norm, top-k experts)",
    formats={"gguf": GGUF},
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
