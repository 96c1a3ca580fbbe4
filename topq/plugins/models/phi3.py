"""Phi-3: the Llama block over fused checkpoint tensors (qkv_proj, gate_up_proj, cut by the weight map), RoPE
of any registered type (LongRoPE in the long-context models), sliding window on every layer when set."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.models.decoder import (DECODER_FIELDS, DECODER_LAYER_WEIGHTS, layer_windows, normalize_llama_like,
                                 rope_scaling_of)
from topq.models.weightmap import gate_up_sections, qkv_sections, split_rows, weight_map
from topq.plugins.models import llama

FIELDS = DECODER_FIELDS - {"attention_bias", "mlp_bias"} | {"sliding_window"}  # Phi-3's linears have no bias
L = DECODER_LAYER_WEIGHTS


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    scaling = rope_scaling_of(config)
    if scaling and "original_max_position_embeddings" not in scaling:  # Phi-3 keeps it beside rope_scaling
        scaling = {**scaling, "original_max_position_embeddings": config.get("original_max_position_embeddings")}
    return normalize_llama_like(config, "phi3", FIELDS, rope_scaling=scaling,
                                layer_windows=layer_windows(config, lambda layer: True))


FAMILY = replace(
    llama.FAMILY, name="phi3", architectures=("Phi3ForCausalLM",), model_types=("phi3",), normalize=normalize,
    map_weights=weight_map({
        **split_rows("model.layers.{i}.self_attn.qkv_proj.weight", qkv_sections, L["q_proj"], L["k_proj"],
                     L["v_proj"]),
        **split_rows("model.layers.{i}.mlp.gate_up_proj.weight", gate_up_sections, L["gate_proj"], L["up_proj"]),
    }),
    config_fields=FIELDS, description="Phi-3 (fused qkv / gate_up, LongRoPE)")


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
