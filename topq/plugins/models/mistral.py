"""Mistral: the Llama block with a sliding window of `sliding_window` tokens on every layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.models.decoder import DECODER_FIELDS, layer_windows, normalize_llama_like
from topq.plugins.models import llama

FIELDS = DECODER_FIELDS - {"attention_bias", "mlp_bias"} | {"sliding_window"}  # Mistral's linears have no bias


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    return normalize_llama_like(config, "mistral", FIELDS, layer_windows=layer_windows(config, lambda layer: True))


FAMILY = replace(llama.FAMILY, name="mistral", architectures=("MistralForCausalLM",), model_types=("mistral",),
                 normalize=normalize, description="Mistral (sliding window)", config_fields=FIELDS)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
