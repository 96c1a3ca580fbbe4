"""Llama family (also SmolLM): pre-norm decoder, GQA attention with RoPE, gated SiLU MLP, optional attention
and MLP biases (`attention_bias`, `mlp_bias`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.models import decoder


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    return decoder.normalize_llama_like(config, "llama")


FAMILY = ModelFamily(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    normalize=normalize,
    layer_weights=decoder.DECODER_LAYER_WEIGHTS,
    build_block=decoder.pre_norm_block,
    quant_groups=decoder.DECODER_QUANT_GROUPS,
    description="Llama 2/3, SmolLM",
    config_fields=decoder.DECODER_FIELDS,
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
