"""Qwen3 (dense): a pre-norm decoder with RMSNorm on each query and key head before RoPE."""

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
from topq.models.gguf import LLAMA_TENSORS, QK_NORM_TENSORS, GGUFArchitecture
from topq.models.sliding import QWEN_WINDOW_FIELDS, qwen_windows

LAYER_WEIGHTS = {
    **DECODER_LAYER_WEIGHTS,
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    return normalize_llama_like(config, "qwen3", QWEN_WINDOW_FIELDS, qk_norm=True,
                                layer_windows=qwen_windows(config))


def build_block(ctx: BlockContext) -> Value:
    b, x = ctx.b, ctx.hidden
    x = b.top.Add(x, self_attention(ctx, rms_norm(ctx, x, "input_layernorm"), qk_norm=True))
    return b.top.Add(x, mlp(ctx, rms_norm(ctx, x, "post_attention_layernorm")))


FAMILY = ModelFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    normalize=normalize,
    layer_weights=LAYER_WEIGHTS,
    build_block=build_block,
    quant_groups=DECODER_QUANT_GROUPS,
    config_fields=QWEN_WINDOW_FIELDS,
    description="Qwen3 dense (q/k norm)",
    formats={"gguf": GGUFArchitecture("qwen3", "Qwen3ForCausalLM", "qwen3", {**LLAMA_TENSORS, **QK_NORM_TENSORS})},
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
