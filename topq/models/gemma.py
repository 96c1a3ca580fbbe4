"""What Gemma 2 and Gemma 3 (text) share: `(1 + w)` RMSNorms, norms before and after both sublayers, the √H
embedding scale, attention scale `query_pre_attn_scalar ** -0.5`, tanh soft-capping of the attention scores
and of the logits, alternating sliding-window layers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from topq.core.family import ModelFamily
from topq.core.spec import ModelSpec
from topq.core.stages import BlockContext
from topq.ir.builder import Builder
from topq.ir.graph import Value
from topq.models.blocks import mlp, rms_norm, self_attention
from topq.models.decoder import DECODER_FIELDS, DECODER_LAYER_WEIGHTS, DECODER_QUANT_GROUPS
from topq.models.gguf import GEMMA_TENSORS, GGUFArchitecture
from topq.models.weightmap import AddScalar, WeightRule, weight_map

GEMMA_FIELDS = DECODER_FIELDS - {"mlp_bias"} | {"sliding_window", "layer_types", "attn_logit_softcapping",
                                 "final_logit_softcapping", "query_pre_attn_scalar"}
LAYER_WEIGHTS = {
    **DECODER_LAYER_WEIGHTS,
    "pre_feedforward_layernorm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm": "model.layers.{i}.post_feedforward_layernorm.weight",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
         "q_norm", "k_norm")


def norm_rules(final_norm: str = "model.norm.weight") -> dict[str, WeightRule]:
    """Gemma stores each RMSNorm weight as w for a (1 + w) scale: add the 1 once, when the weight is read."""
    names = [LAYER_WEIGHTS[key] for key in NORMS] + [final_norm]
    return {name: AddScalar(name, 1.0) for name in names}


def gemma_overrides(config: Mapping[str, Any]) -> dict[str, Any]:
    """The spec fields every Gemma text config sets the same way. Gemma ties its embeddings unless the config
    says otherwise (transformers' Gemma configs default to True; Llama's to False)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {
        **({} if "tie_word_embeddings" in config else {"tie_word_embeddings": True}),
        "attention_scale": float(config.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        "attn_softcap": float(config.get("attn_logit_softcapping") or 0.0),
        "final_softcap": float(config.get("final_logit_softcapping") or 0.0),
        "hidden_act": config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh",
    }


def build_block(ctx: BlockContext) -> Value:
    b, x = ctx.b, ctx.hidden
    attn = self_attention(ctx, rms_norm(ctx, x, "input_layernorm"), qk_norm=ctx.spec.qk_norm)
    x = b.top.Add(x, rms_norm(ctx, attn, "post_attention_layernorm"))
    feed_forward = mlp(ctx, rms_norm(ctx, x, "pre_feedforward_layernorm"))
    return b.top.Add(x, rms_norm(ctx, feed_forward, "post_feedforward_layernorm"))


def scale_embedding(b: Builder, spec: ModelSpec, hidden: Value) -> Value:
    return b.top.MulConst(hidden, const_val=math.sqrt(spec.hidden_size), loc="embed_scale")


def soft_cap_logits(b: Builder, spec: ModelSpec, logits: Value) -> Value:
    """logits ← c · tanh(logits / c) with c = final_logit_softcapping (none when 0)."""
    if not spec.final_softcap:
        return logits
    cap = spec.final_softcap
    capped = b.top.Tanh(b.top.MulConst(logits, const_val=1.0 / cap, loc="softcap_in"), loc="softcap")
    return b.top.MulConst(capped, const_val=cap, loc="softcap_out")


def gguf_attention_scale(layers_27b: int) -> Callable[[Mapping[str, Any]], Mapping[str, Any]]:
    """`query_pre_attn_scalar`, which GGUF files do not store: llama.cpp takes the head size, except for the 27B
    model (recognised by its layer count), which scales by hidden_size / num_attention_heads as its config says."""
    def derive(config: Mapping[str, Any]) -> Mapping[str, Any]:
        big = config["num_hidden_layers"] == layers_27b
        return {"query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if big
                else config["head_dim"]}
    return derive


def gemma_gguf(name: str, architecture: str, model_type: str, layers_27b: int,
               metadata: Mapping[str, str], defaults: Mapping[str, Any]) -> GGUFArchitecture:
    """A Gemma GGUF architecture: the shared tensors (norms stored as 1 + w), GELU-tanh, the derived attention
    scale; `metadata` / `defaults` are the version's own keys and the values llama.cpp assumes without them."""
    return GGUFArchitecture(name, architecture, model_type, GEMMA_TENSORS,
                            metadata={"attention.sliding_window": "sliding_window", **metadata},
                            defaults={"hidden_act": "gelu_pytorch_tanh", **defaults},
                            derive=gguf_attention_scale(layers_27b))


def gemma_family(name: str, architecture: str, model_type: str, normalize: Callable[[Mapping[str, Any]], ModelSpec],
                 config_fields: frozenset[str], description: str, gguf: GGUFArchitecture) -> ModelFamily:
    """A Gemma family: the shared block, weights, norm mapping and hooks, with its own config reading."""
    return ModelFamily(name=name, architectures=(architecture,), model_types=(model_type,), normalize=normalize,
                       layer_weights=LAYER_WEIGHTS, build_block=build_block, quant_groups=DECODER_QUANT_GROUPS,
                       map_weights=weight_map(norm_rules()), embed_hook=scale_embedding, head_hook=soft_cap_logits,
                       config_fields=config_fields, description=description, formats={"gguf": gguf})
