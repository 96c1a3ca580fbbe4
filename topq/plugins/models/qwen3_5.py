"""Qwen3.5 (text): a hybrid decoder, Gated DeltaNet layers with a gated full-attention layer every few
(`topq.models.gated_deltanet` has the numerics)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.models import gated_deltanet as gdn
from topq.models.weightmap import weight_map

LAYER_WEIGHTS = {
    **gdn.NORM_WEIGHTS, **gdn.ATTENTION_WEIGHTS, **gdn.DELTANET_WEIGHTS, **gdn.MLP_WEIGHTS,
    "in_proj_qkv": "model.layers.{i}.linear_attn.in_proj_qkv.weight",
    "in_proj_z": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "in_proj_b": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "in_proj_a": "model.layers.{i}.linear_attn.in_proj_a.weight",
}


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    return gdn.normalize_hybrid(config, "qwen3_5")


FAMILY = ModelFamily(
    name="qwen3_5",
    architectures=("Qwen3_5ForCausalLM",),
    model_types=("qwen3_5_text",),
    normalize=normalize,
    layer_weights=LAYER_WEIGHTS,
    build_block=gdn.build_block,
    map_weights=weight_map(gdn.zero_centered_norm_rules()),
    layer_states=gdn.layer_states,
    quant_groups=gdn.QUANT_GROUPS,
    description="Qwen3.5 text (Gated DeltaNet + gated attention)",
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
