"""Gemma 2: the Gemma block (topq.models.gemma), sliding window on every other layer (even layers slide)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.models import gemma
from topq.models.decoder import DECODER_QUANT_GROUPS, layer_windows, normalize_llama_like
from topq.models.weightmap import weight_map


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    return normalize_llama_like(config, "gemma2", gemma.GEMMA_FIELDS, **gemma.gemma_overrides(config),
                                layer_windows=layer_windows(config, lambda layer: layer % 2 == 0))


FAMILY = ModelFamily(
    name="gemma2",
    architectures=("Gemma2ForCausalLM",),
    model_types=("gemma2",),
    normalize=normalize,
    layer_weights=gemma.LAYER_WEIGHTS,
    build_block=gemma.build_block,
    quant_groups=DECODER_QUANT_GROUPS,
    map_weights=weight_map(gemma.norm_rules()),
    embed_hook=gemma.scale_embedding,
    head_hook=gemma.soft_cap_logits,
    config_fields=gemma.GEMMA_FIELDS,
    description="Gemma 2 (soft-capping, alternating sliding window)",
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
