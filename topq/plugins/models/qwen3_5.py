"""Qwen3.5 (text): a hybrid decoder, Gated DeltaNet layers with a gated full-attention layer every few
(`topq.models.gated_deltanet` has the numerics).

The published checkpoints are the multimodal `Qwen3_5ForConditionalGeneration`: the family converts their text
model (config `text_config`, tensors under `model.language_model.`, the shared `lm_head`) and says so; the vision
tower's tensors are not read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.checkpoint import WeightStore
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.models import gated_deltanet as gdn
from topq.models.weightmap import AddScalar, Rows, WeightRule, weight_map

MULTIMODAL = "Qwen3_5ForConditionalGeneration"
TEXT_PREFIX = "model.language_model."

LAYER_WEIGHTS = {
    **gdn.NORM_WEIGHTS, **gdn.ATTENTION_WEIGHTS, **gdn.DELTANET_WEIGHTS, **gdn.MLP_WEIGHTS,
    "in_proj_qkv": "model.layers.{i}.linear_attn.in_proj_qkv.weight",
    "in_proj_z": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "in_proj_b": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "in_proj_a": "model.layers.{i}.linear_attn.in_proj_a.weight",
}


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config: `text_config` of a multimodal checkpoint (with its architecture and the top-level
    tie_word_embeddings, which decides the shared lm_head), else the config itself."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        return config
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    return {**text, "architectures": list(config.get("architectures") or [MULTIMODAL]),
            **({"tie_word_embeddings": tie} if tie is not None else {})}


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    return gdn.normalize_hybrid(text_config(config), "qwen3_5")


def conversion_note(config: Mapping[str, Any]) -> str | None:
    if isinstance(config.get("text_config"), Mapping) and config.get("vision_config") is not None:
        arch = (config.get("architectures") or [MULTIMODAL])[0]
        return f"{arch} has a vision tower: converting its text model only (the vision tensors are not read)"
    return None


def _text_model_rules() -> dict[str, WeightRule]:
    """IR name → the multimodal checkpoint's tensor: the same names under model.language_model. (a one-part Rows is
    the tensor itself), (1 + w) for the zero-centered norms."""
    names = [*LAYER_WEIGHTS.values(), "model.embed_tokens.weight", "model.norm.weight"]
    rules: dict[str, WeightRule] = {name: Rows(TEXT_PREFIX + name.removeprefix("model."), 1, 0) for name in names}
    rules.update({name: AddScalar(TEXT_PREFIX + name.removeprefix("model."), 1.0) for name in gdn.ZERO_CENTERED_NORMS})
    return rules


_TEXT_ONLY = weight_map(gdn.zero_centered_norm_rules())
_MULTIMODAL = weight_map(_text_model_rules())


def map_weights(spec: ModelSpec, store: WeightStore) -> WeightStore:
    multimodal = TEXT_PREFIX + "embed_tokens.weight" in store
    return (_MULTIMODAL if multimodal else _TEXT_ONLY)(spec, store)


FAMILY = ModelFamily(
    name="qwen3_5",
    architectures=("Qwen3_5ForCausalLM", MULTIMODAL),
    model_types=("qwen3_5_text", "qwen3_5"),
    normalize=normalize,
    layer_weights=LAYER_WEIGHTS,
    build_block=gdn.build_block,
    map_weights=map_weights,
    conversion_note=conversion_note,
    layer_states=gdn.layer_states,
    quant_groups=gdn.QUANT_GROUPS,
    config_fields=gdn.HYBRID_FIELDS,
    description="Qwen3.5 text (Gated DeltaNet + gated attention)",
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
