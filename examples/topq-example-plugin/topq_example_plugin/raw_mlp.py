"""`example-llama-raw`: the example family with its gated-MLP activation written as a raw kernel.

A custom op needs no Top op of its own: the block builds the two projections with Top ops, then calls a
`@kernel` (`swiglu`, `silu(gate) * up` in float32) through `raw_call`, which embeds it in the graph as a
`top.DSLRegion`; the host target runs the region, other targets lower it. The family is registered from its
own entry point (`example-raw`), so the plain `example-llama` family stays exactly the built-in Llama graph.
"""

from __future__ import annotations

import dataclasses

import topq
from topq.core.family import ModelFamily
from topq.core.hookspecs import Register
from topq.core.stages import BlockContext
from topq.ir.graph import Value
from topq.models.blocks import linear, rms_norm, self_attention
from topq.raw import InOut, Input, exp, kernel, raw_call
from topq_example_plugin import FAMILY


@kernel
def swiglu(gate: Input["tensor<?x?x?xf32>"], up: Input["tensor<?x?x?xf32>"],
           out: InOut["tensor<?x?x?xf32>"]) -> None:
    """out = silu(gate) * up, elementwise over [batch, tokens, intermediate]."""
    for b in range(gate.shape[0]):
        for t in range(gate.shape[1]):
            for c in range(gate.shape[2]):
                g = gate[b, t, c]
                out[b, t, c] = g / (1.0 + exp(-g)) * up[b, t, c]


def build_block(ctx: BlockContext) -> Value:
    """The example block, with the MLP spelled out: gate/up projections, the raw SwiGLU kernel, down."""
    s, b, x = ctx.spec, ctx.b, ctx.hidden
    x = b.top.Add(x, self_attention(ctx, rms_norm(ctx, x, "input_layernorm")))
    m = rms_norm(ctx, x, "post_attention_layernorm")
    gate = linear(ctx, m, "gate_proj", s.intermediate_size)
    up = linear(ctx, m, "up_proj", s.intermediate_size)
    # The output buffer starts as `gate` (any tensor of the right type would do: every element is written).
    act = raw_call(b, swiglu, outputs=[gate], inputs=[gate, up], loc="swiglu")
    return b.top.Add(x, linear(ctx, act, "down_proj", s.hidden_size))


FAMILY_RAW = dataclasses.replace(
    FAMILY,
    name="example-llama-raw",
    architectures=("ExampleRawLlamaForCausalLM",),
    model_types=("example_llama_raw",),
    build_block=build_block,
    description="example family whose MLP activation is a raw kernel (top.DSLRegion)",
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY_RAW)
