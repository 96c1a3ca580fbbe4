"""Qwen3 (dense): the Llama block with RMSNorm on each query and key head before RoPE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec, normalize_llama_like
from topq.core.ir import Value
from topq.core.stages import BlockContext

LAYER_WEIGHTS = {
    "input_layernorm": "model.layers.{i}.input_layernorm.weight",
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
    "post_attention_layernorm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate_proj": "model.layers.{i}.mlp.gate_proj.weight",
    "up_proj": "model.layers.{i}.mlp.up_proj.weight",
    "down_proj": "model.layers.{i}.mlp.down_proj.weight",
}


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    return normalize_llama_like(config, "qwen3", qk_norm=True)


def build_block(ctx: BlockContext) -> Value:
    s, b = ctx.spec, ctx.b
    x = ctx.hidden
    h = ctx.rms_norm(x, "input_layernorm")
    bias = s.attention_bias
    q = ctx.heads(ctx.linear(h, "q_proj", s.num_heads * s.head_dim, bias=bias), s.num_heads)
    k = ctx.heads(ctx.linear(h, "k_proj", s.num_kv_heads * s.head_dim, bias=bias), s.num_kv_heads)
    v = ctx.heads(ctx.linear(h, "v_proj", s.num_kv_heads * s.head_dim, bias=bias), s.num_kv_heads)
    q, k = ctx.rms_norm(q, "q_norm"), ctx.rms_norm(k, "k_norm")
    attn = ctx.attention(ctx.rope(q), ctx.rope(k), v)
    x = b.top.Add(x, ctx.linear(attn, "o_proj", s.hidden_size))
    return b.top.Add(x, ctx.mlp(ctx.rms_norm(x, "post_attention_layernorm")))


FAMILY = ModelFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    normalize=normalize,
    layer_weights=LAYER_WEIGHTS,
    build_block=build_block,
    quant_groups=(("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)),
    description="Qwen3 dense (q/k norm)",
)


@topq.hookimpl
def register_model_families(register) -> None:  # type: ignore[no-untyped-def]
    register(FAMILY)
