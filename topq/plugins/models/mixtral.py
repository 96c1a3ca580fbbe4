"""Mixtral: the Mistral decoder with a sparse mixture of experts (softmax router, top-k renormalised)."""

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
from topq.models.moe import MOE_FIELDS, ExpertNames, moe_feed_forward, read_moe

EXPERTS = ExpertNames(router="model.layers.{i}.block_sparse_moe.gate.weight",
                      gate="model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
                      up="model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
                      down="model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight")


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    spec = normalize_llama_like(config, "mixtral", MOE_FIELDS)
    # Mixtral's router always renormalises the top-k scores; its experts are intermediate_size wide.
    return replace(spec, moe=read_moe(config, "mixtral", spec.num_layers, spec.intermediate_size,
                                      norm_topk_prob=True))


def build_block(ctx: BlockContext) -> Value:
    b, x = ctx.b, ctx.hidden
    x = b.top.Add(x, self_attention(ctx, rms_norm(ctx, x, "input_layernorm")))
    return b.top.Add(x, moe_feed_forward(ctx, rms_norm(ctx, x, "post_attention_layernorm"), EXPERTS))


FAMILY = ModelFamily(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    normalize=normalize,
    layer_weights=DECODER_LAYER_WEIGHTS,
    build_block=build_block,
    quant_groups=DECODER_QUANT_GROUPS,
    config_fields=MOE_FIELDS,
    description="Mixtral 8x7B / 8x22B (top-2 of 8 experts)",
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
