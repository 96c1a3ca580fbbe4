"""Phi-3: the Llama block over fused checkpoint tensors (qkv_proj, gate_up_proj, cut by the weight map), RoPE
of any registered type (LongRoPE in the long-context models), sliding window on every layer when set."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.errors import TopqError
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.models import decoder
from topq.models.gguf import LLAMA_TENSORS, GGUFArchitecture
from topq.models.weightmap import gate_up_sections, qkv_sections, split_rows, weight_map

FIELDS = decoder.DECODER_FIELDS - {"attention_bias", "mlp_bias"} | {"sliding_window"}  # no biases in Phi-3
L = decoder.DECODER_LAYER_WEIGHTS


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    scaling = decoder.rope_scaling_of(config)
    if scaling and "original_max_position_embeddings" not in scaling:  # Phi-3 keeps it beside rope_scaling
        scaling = {**scaling, "original_max_position_embeddings": config.get("original_max_position_embeddings")}
    return decoder.normalize_llama_like(config, "phi3", FIELDS, rope_scaling=scaling,
                                        layer_windows=decoder.layer_windows(config, lambda layer: True))


def gguf_longrope(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """LongRoPE from the factor tensors llama.cpp writes for the long-context models (no `rope.scaling.type`)."""
    if "long_factor" not in config:
        return {}
    if "short_factor" not in config:
        raise TopqError("phi3 GGUF: rope_factors_long without rope_factors_short")
    scaling = {"rope_type": "longrope", "long_factor": config["long_factor"], "short_factor": config["short_factor"],
               "original_max_position_embeddings": config.get("original_max_position_embeddings")}
    if config.get("rope_attention_factor") is not None:
        scaling["attention_factor"] = config["rope_attention_factor"]
    return {"rope_scaling": scaling}


#: llama.cpp keeps Phi-3's fused tensors (attn_qkv; ffn_up is [gate; up]), writes a window of 0 for none and the
#: LongRoPE factors as two tensors.
GGUF = GGUFArchitecture(
    name="phi3", architecture="Phi3ForCausalLM", model_type="phi3",
    tensors={**LLAMA_TENSORS, "blk.{i}.attn_qkv": "model.layers.{i}.self_attn.qkv_proj",
             "blk.{i}.ffn_up": "model.layers.{i}.mlp.gate_up_proj"},
    metadata={"attention.sliding_window": "sliding_window",
              "rope.scaling.original_context_length": "original_max_position_embeddings",
              "rope.scaling.attn_factor": "rope_attention_factor"},
    rotary_dims=True, config_tensors={"rope_factors_long": "long_factor", "rope_factors_short": "short_factor"},
    derive=gguf_longrope)

FAMILY = ModelFamily(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    normalize=normalize,
    layer_weights=L,
    build_block=decoder.pre_norm_block,
    quant_groups=decoder.DECODER_QUANT_GROUPS,
    map_weights=weight_map({
        **split_rows("model.layers.{i}.self_attn.qkv_proj.weight", qkv_sections, L["q_proj"], L["k_proj"],
                     L["v_proj"]),
        **split_rows("model.layers.{i}.mlp.gate_up_proj.weight", gate_up_sections, L["gate_proj"], L["up_proj"]),
    }),
    config_fields=FIELDS,
    description="Phi-3 (fused qkv / gate_up, LongRoPE)",
    formats={"gguf": GGUF},
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
