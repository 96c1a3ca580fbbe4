"""Llama family (also SmolLM): pre-norm decoder, GQA attention with RoPE, gated SiLU MLP, optional attention
and MLP biases (`attention_bias`, `mlp_bias`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.core.stages import BlockContext
from topq.ir.graph import Value
from topq.models.decoder import DECODER_FIELDS, DECODER_LAYER_WEIGHTS, DECODER_QUANT_GROUPS, normalize_llama_like


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    return normalize_llama_like(config, "llama")


def build_block(ctx: BlockContext) -> Value:
    b, x = ctx.b, ctx.hidden
    x = b.top.Add(x, ctx.self_attention(ctx.rms_norm(x, "input_layernorm")))
    return b.top.Add(x, ctx.mlp(ctx.rms_norm(x, "post_attention_layernorm")))


FAMILY = ModelFamily(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    normalize=normalize,
    layer_weights=DECODER_LAYER_WEIGHTS,
    build_block=build_block,
    quant_groups=DECODER_QUANT_GROUPS,
    description="Llama 2/3, SmolLM",
    config_fields=DECODER_FIELDS,
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
