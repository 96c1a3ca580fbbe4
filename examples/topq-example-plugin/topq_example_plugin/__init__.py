"""The `example-llama` model family: a Llama-style decoder registered from outside topq.

Everything a family needs is here: which configs it accepts, config normalisation, the weight-name
map and the transformer block, written once (the core builds prefill / prefill-with-history / decode
from it). It imports only the public `topq.core` API, never another plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec, normalize_llama_like
from topq.core.ir import Value
from topq.core.stages import BlockContext

__version__ = "0.1.0"

# Logical weight keys used by `build_block` → checkpoint tensor names ({i} is the layer index).
LAYER_WEIGHTS = {
    "input_layernorm": "model.layers.{i}.input_layernorm.weight",
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
    "post_attention_layernorm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate_proj": "model.layers.{i}.mlp.gate_proj.weight",
    "up_proj": "model.layers.{i}.mlp.up_proj.weight",
    "down_proj": "model.layers.{i}.mlp.down_proj.weight",
}


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    return normalize_llama_like(config, "example-llama")


def build_block(ctx: BlockContext) -> Value:
    """Pre-norm attention + gated MLP, each with a residual; `ctx.attention` handles history and masks."""
    s, b = ctx.spec, ctx.b
    x = ctx.hidden
    h = ctx.rms_norm(x, "input_layernorm")
    q = ctx.heads(ctx.linear(h, "q_proj", s.num_heads * s.head_dim), s.num_heads)
    k = ctx.heads(ctx.linear(h, "k_proj", s.num_kv_heads * s.head_dim), s.num_kv_heads)
    v = ctx.heads(ctx.linear(h, "v_proj", s.num_kv_heads * s.head_dim), s.num_kv_heads)
    attn = ctx.attention(ctx.rope(q), ctx.rope(k), v)
    x = b.top.Add(x, ctx.linear(attn, "o_proj", s.hidden_size))
    return b.top.Add(x, ctx.mlp(ctx.rms_norm(x, "post_attention_layernorm")))


FAMILY = ModelFamily(
    name="example-llama",
    architectures=("ExampleLlamaForCausalLM",),
    model_types=("example_llama",),
    normalize=normalize,
    layer_weights=LAYER_WEIGHTS,
    build_block=build_block,
    # Linears that read the same input (AWQ scales them together).
    quant_groups=(("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)),
    description="example third-party Llama-style family",
)


@topq.hookimpl
def register_model_families(register: Callable[[ModelFamily], None]) -> None:
    register(FAMILY)
