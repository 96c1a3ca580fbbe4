"""Mistral: the Llama block with a sliding window of `sliding_window` tokens on every layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.models import decoder

FIELDS = decoder.DECODER_FIELDS - {"attention_bias", "mlp_bias"} | {"sliding_window"}  # no biases in Mistral


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    windows = decoder.layer_windows(config, lambda layer: True)
    return decoder.normalize_llama_like(config, "mistral", FIELDS, layer_windows=windows)


FAMILY = ModelFamily(name="mistral", architectures=("MistralForCausalLM",), model_types=("mistral",),
                     normalize=normalize, layer_weights=decoder.DECODER_LAYER_WEIGHTS,
                     build_block=decoder.pre_norm_block, quant_groups=decoder.DECODER_QUANT_GROUPS,
                     config_fields=FIELDS, description="Mistral (sliding window)")


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
