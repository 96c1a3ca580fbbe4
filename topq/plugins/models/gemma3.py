"""Gemma 3 (text): the Gemma block with q/k RMSNorm, five sliding layers to one global by default, and a RoPE of
its own for the sliding layers (`rope_parameters.sliding_attention` or, in older configs, rope_local_base_freq)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.errors import TopqError
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.models import gemma
from topq.models.decoder import layer_windows, normalize_llama_like

FIELDS = gemma.GEMMA_FIELDS | {"rope_local_base_freq"}


def rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta / rope_scaling of the global layers and the base of the sliding ones."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one RoPE per layer type
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:
        full = dict(config.get("rope_scaling") or {}) | {"rope_theta": config.get("rope_theta") or 1e6}
        local = {"rope_theta": config.get("rope_local_base_freq") or 1e4}
    if local.get("rope_type", "default") != "default":
        raise TopqError(f"Gemma3ForCausalLM: sliding-attention rope type {local['rope_type']!r} is not supported")
    theta = float(full.pop("rope_theta", 1e6))
    full.setdefault("rope_type", full.pop("type", "default"))
    scaling = None if full["rope_type"] == "default" else full
    return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": float(local.get("rope_theta", 1e4))}


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
    return normalize_llama_like(config, "gemma3", FIELDS, **gemma.gemma_overrides(config), **rope(config),
                                qk_norm=True, layer_windows=layer_windows(config, lambda i: (i + 1) % pattern != 0))


#: GGUF keeps the global layers' RoPE base; llama.cpp fixes the sliding layers' at 10000, as `rope` does without one.
GGUF = gemma.gemma_gguf("gemma3", "Gemma3ForCausalLM", "gemma3_text", layers_27b=62,
                        metadata={"final_logit_softcapping": "final_logit_softcapping"}, defaults={})
FAMILY = gemma.gemma_family("gemma3", "Gemma3ForCausalLM", "gemma3_text", normalize, FIELDS,
                            "Gemma 3 text (q/k norm, local RoPE, 5:1 sliding window)", GGUF)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
