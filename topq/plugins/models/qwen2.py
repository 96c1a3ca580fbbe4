"""Qwen2 / Qwen2.5: a pre-norm decoder whose q/k/v projections carry biases."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.core.stages import BlockContext
from topq.ir.graph import Value
from topq.models.blocks import mlp, rms_norm, self_attention
from topq.models.decoder import DECODER_LAYER_WEIGHTS, DECODER_QUANT_GROUPS, normalize_llama_like
from topq.models.gguf import LLAMA_TENSORS, GGUFArchitecture
from topq.models.sliding import QWEN_WINDOW_FIELDS, qwen_windows


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    # Qwen2 configs do not say it, but q/k/v always have biases.
    return normalize_llama_like(config, "qwen2", QWEN_WINDOW_FIELDS, attention_bias=True, o_proj_bias=False,
                                layer_windows=qwen_windows(config))


def build_block(ctx: BlockContext) -> Value:
    b, x = ctx.b, ctx.hidden
    x = b.top.Add(x, self_attention(ctx, rms_norm(ctx, x, "input_layernorm")))
    return b.top.Add(x, mlp(ctx, rms_norm(ctx, x, "post_attention_layernorm")))


FAMILY = ModelFamily(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    normalize=normalize,
    layer_weights=DECODER_LAYER_WEIGHTS,
    build_block=build_block,
    quant_groups=DECODER_QUANT_GROUPS,
    config_fields=QWEN_WINDOW_FIELDS,
    description="Qwen2, Qwen2.5 (q/k/v bias)",
    formats={"gguf": GGUFArchitecture("qwen2", "Qwen2ForCausalLM", "qwen2", LLAMA_TENSORS,
                                      flags={"attention_bias": "attn_q.bias"})},
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
