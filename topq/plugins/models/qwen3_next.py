"""Qwen3-Next: the Qwen3.5 hybrid (`topq.models.gated_deltanet`) with the linear layers' input projections fused
per key head (`in_proj_qkvz`, `in_proj_ba`) and sparse MoE MLPs. Dense layers only for now: a layer the config
makes a sparse MoE layer is refused, naming the fields that decide it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.errors import TopqError
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.models import gated_deltanet as gdn
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


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    spec = gdn.normalize_hybrid(config, "qwen3_next")
    experts = int(config.get("num_experts") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    sparse = [i for i in range(spec.num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0]
    if sparse:
        raise TopqError(f"qwen3_next: layers {sparse} are sparse MoE layers (num_experts = {experts}, "
                        f"decoder_sparse_step = {step}, mlp_only_layers = {sorted(dense)}); the qwen3_next family "
                        "converts dense layers only (mlp_only_layers covering every layer, or num_experts = 0)")
    return spec


FAMILY = ModelFamily(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    model_types=("qwen3_next",),
    normalize=normalize,
    layer_weights=LAYER_WEIGHTS,
    build_block=gdn.build_block,
    map_weights=weight_map(WEIGHT_RULES),
    layer_states=gdn.layer_states,
    quant_groups=gdn.QUANT_GROUPS,
    config_fields=gdn.HYBRID_FIELDS,
    description="Qwen3-Next, dense layers (Gated DeltaNet + gated attention)",
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
