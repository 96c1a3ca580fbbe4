"""Gemma 2: the Gemma block (topq.models.gemma), sliding window on every other layer (even layers slide)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.models import gemma
from topq.models.decoder import layer_windows, normalize_llama_like


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    return normalize_llama_like(config, "gemma2", gemma.GEMMA_FIELDS, **gemma.gemma_overrides(config),
                                layer_windows=layer_windows(config, lambda layer: layer % 2 == 0))


#: llama.cpp's defaults for files without the soft-capping keys are Gemma 2's own, 50 and 30.
SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping")
GGUF = gemma.gemma_gguf("gemma2", "Gemma2ForCausalLM", "gemma2", layers_27b=46, metadata={k: k for k in SOFTCAPS},
                        defaults={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
FAMILY = gemma.gemma_family("gemma2", "Gemma2ForCausalLM", "gemma2", normalize, gemma.GEMMA_FIELDS,
                            "Gemma 2 (soft-capping, alternating sliding window)", GGUF)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
