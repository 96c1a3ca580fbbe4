"""Qwen3-Next: the Qwen3.5 hybrid (`topq.models.gated_deltanet`) with the linear layers' input projections fused
per key head (`in_proj_qkvz`, `in_proj_ba`) and sparse MoE feed-forwards (transformers' Qwen3NextSparseMoeBlock:
softmax router, top-k experts, renormalised by `norm_topk_prob`, plus a shared expert scaled by
sigmoid(shared_expert_gate)) as one `top.MoE`; layers in `mlp_only_layers` or off `decoder_sparse_step` are dense."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.core.stages import BlockContext
from topq.ir.graph import Value
from topq.models import gated_deltanet as gdn
from topq.models.moe import QWEN_SHARED_EXPERTS, moe_feed_forward, read_moe
from topq.models.weightmap import GroupedRows, WeightRule, weight_map

QKVZ = "model.layers.{i}.linear_attn.in_proj_qkvz.weight"
BA = "model.layers.{i}.linear_attn.in_proj_ba.weight"
LAYER_WEIGHTS = {
    **gdn.NORM_WEIGHTS, **gdn.ATTENTION_WEIGHTS, **gdn.DELTANET_WEIGHTS, **gdn.MLP_WEIGHTS,
    # the names the graph reads; derived from the fused tensors by WEIGHT_RULES
    "in_proj_qkv": "model.layers.{i}.linear_attn.in_proj_qkv.weight",
    "in_proj_z": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "in_proj_b": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "in_proj_a": "model.layers.{i}.linear_attn.in_proj_a.weight",
}


def _key_heads(spec: ModelSpec) -> int:
    assert spec.linear_attention is not None
    return spec.linear_attention["key_heads"]


def _qkvz_parts(spec: ModelSpec) -> tuple[int, int, int, int]:
    """Per key head: its query, its key, then the values and z gates of the value heads it serves."""
    s = spec.linear_attention
    assert s is not None
    served = s["value_heads"] // s["key_heads"] * s["value_head_dim"]
    return s["key_head_dim"], s["key_head_dim"], served, served


def _ba_parts(spec: ModelSpec) -> tuple[int, int]:
    s = spec.linear_attention
    assert s is not None
    served = s["value_heads"] // s["key_heads"]
    return served, served


WEIGHT_RULES: dict[str, WeightRule] = {
    **gdn.zero_centered_norm_rules(),
    LAYER_WEIGHTS["in_proj_qkv"]: GroupedRows(QKVZ, _key_heads, _qkvz_parts, (0, 1, 2)),
    LAYER_WEIGHTS["in_proj_z"]: GroupedRows(QKVZ, _key_heads, _qkvz_parts, (3,)),
    LAYER_WEIGHTS["in_proj_b"]: GroupedRows(BA, _key_heads, _ba_parts, (0,)),
    LAYER_WEIGHTS["in_proj_a"]: GroupedRows(BA, _key_heads, _ba_parts, (1,)),
}


#: Qwen3NextConfig's defaults for the MoE fields, which differ from other MoE families' (a config.json that leaves
#: one out, or sets it null, gets what transformers would build: e.g. 512 experts and renormalised top-k weights)
MOE_DEFAULTS: dict[str, Any] = {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                                "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
                                "decoder_sparse_step": 1, "mlp_only_layers": []}


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    spec = gdn.normalize_hybrid(config, "qwen3_next")
    moe_config = {**config, **{k: v for k, v in MOE_DEFAULTS.items() if config.get(k) is None}}
    return replace(spec, moe=read_moe(moe_config, "qwen3_next", spec.num_layers, spec.intermediate_size,
                                      shared=True))


def build_block(ctx: BlockContext) -> Value:
    return gdn.build_block(ctx, lambda x: moe_feed_forward(ctx, x, QWEN_SHARED_EXPERTS))


FAMILY = ModelFamily(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    model_types=("qwen3_next",),
    normalize=normalize,
    layer_weights=LAYER_WEIGHTS,
    build_block=build_block,
    map_weights=weight_map(WEIGHT_RULES),
    layer_states=gdn.layer_states,
    quant_groups=gdn.QUANT_GROUPS,
    config_fields=gdn.HYBRID_FIELDS,
    description="Qwen3-Next (Gated DeltaNet + gated attention, top-k experts with a gated shared expert)",
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
