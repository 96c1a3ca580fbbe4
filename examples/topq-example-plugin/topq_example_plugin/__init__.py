"""The `example-llama` model family: a Llama-style decoder registered from outside topq.

Everything a family needs is here: which configs it accepts, config normalisation, the weight-name
map and the transformer block, written once (the core builds prefill / prefill-with-history / decode
from it). It imports only the public `topq.core` API, never another plugin.
"""

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

__version__ = "0.1.0"

def normalize(config: Mapping[str, Any]) -> ModelSpec:
    return normalize_llama_like(config, "example-llama")


def build_block(ctx: BlockContext) -> Value:
    """Pre-norm attention + gated MLP, each with a residual. `self_attention` builds q/k/v, RoPE and the
    stage's attention (history, masks), which the core's stage template varies per stage."""
    b, x = ctx.b, ctx.hidden
    x = b.top.Add(x, self_attention(ctx, rms_norm(ctx, x, "input_layernorm")))
    return b.top.Add(x, mlp(ctx, rms_norm(ctx, x, "post_attention_layernorm")))


FAMILY = ModelFamily(
    name="example-llama",
    architectures=("ExampleLlamaForCausalLM",),
    model_types=("example_llama",),
    normalize=normalize,
    # Logical weight keys used by the block → checkpoint names ({i} is the layer): the usual decoder names.
    layer_weights=DECODER_LAYER_WEIGHTS,
    build_block=build_block,
    quant_groups=DECODER_QUANT_GROUPS,  # linears that read the same input (AWQ scales them together)
    description="example third-party Llama-style family",
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
