"""The decoder sublayers families build their blocks from, on top of the core's `BlockContext`.

The core's context knows stages (inputs, history, masks, recurrent states, `ctx.attention`); these functions
know what a decoder layer is made of — projections, norms, heads, RoPE, the GQA sublayer, the gated MLP — so
the core stays free of model vocabulary and a family with other parts writes its own next to them.
"""

from __future__ import annotations

from topq.core.errors import TopqError
from topq.core.stages import BlockContext, named_weight
from topq.ir.graph import Value

#: Hugging Face `hidden_act` → `top.MLP` `act`.
MLP_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def linear(ctx: BlockContext, x: Value, key: str, out_features: int, bias: bool = False) -> Value:
    """x · Wᵀ (+ b): a `top.MatMul` with `right_transpose` on the layer weight `key` (its bias beside it)."""
    w = ctx.weight(key, (out_features, x.shape[-1]))
    if not bias:
        return ctx.b.top.MatMul(x, w, right_transpose=True, loc=key)
    name = ctx.weight_name(key).removesuffix(".weight") + ".bias"
    return ctx.b.top.MatMul(x, w, named_weight(ctx.b, name, (out_features,), ctx.shapes), right_transpose=True,
                            loc=key)


def rms_norm(ctx: BlockContext, x: Value, key: str) -> Value:
    return ctx.b.top.RMSNorm(x, ctx.weight(key, x.shape[-1:]), eps=ctx.spec.rms_norm_eps, loc=key)


def heads(ctx: BlockContext, x: Value, count: int) -> Value:
    """[1, L, count·D] → [1, L, count, D]."""
    return ctx.b.top.Reshape(x, shape=[x.shape[0], x.shape[1], count, ctx.spec.head_dim])


def rope(ctx: BlockContext, x: Value) -> Value:
    """RoPE with the layer's table (the sliding layers' own when `spec.local_rope_theta` is set)."""
    return ctx.b.top.Rope(x, ctx.cos, ctx.sin, mode=ctx.spec.rope_mode)


def self_attention(ctx: BlockContext, x: Value, qk_norm: bool = False) -> Value:
    """The usual GQA self-attention sublayer: q/k/v projections, optional per-head q/k RMSNorm (weights `q_norm`,
    `k_norm`), RoPE, this stage's attention, o_proj (biases as the spec says). Returns the o_proj output."""
    s = ctx.spec
    q = heads(ctx, linear(ctx, x, "q_proj", s.num_heads * s.head_dim, bias=s.attention_bias), s.num_heads)
    k = heads(ctx, linear(ctx, x, "k_proj", s.num_kv_heads * s.head_dim, bias=s.attention_bias), s.num_kv_heads)
    v = heads(ctx, linear(ctx, x, "v_proj", s.num_kv_heads * s.head_dim, bias=s.attention_bias), s.num_kv_heads)
    if qk_norm:
        q, k = rms_norm(ctx, q, "q_norm"), rms_norm(ctx, k, "k_norm")
    attn = ctx.attention(rope(ctx, q), rope(ctx, k), v)
    return linear(ctx, attn, "o_proj", s.hidden_size, bias=s.o_proj_bias)


def mlp(ctx: BlockContext, x: Value, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> Value:
    """The gated MLP down(act(gate(x)) · up(x)): one `top.MLP`, or its parts when the spec has MLP biases
    (`top.MLP` has none)."""
    s, b = ctx.spec, ctx.b
    act = MLP_ACTIVATIONS.get(s.hidden_act)
    if act is None:
        raise TopqError(f"activation {s.hidden_act!r} is not supported (silu, gelu, gelu_pytorch_tanh)")
    inter, hidden = s.intermediate_size, s.hidden_size
    if s.mlp_bias:
        g = linear(ctx, x, gate, inter, bias=True)
        a = b.top.SiLU(g) if act == "silu" else b.top.GELU(g, approximate="tanh" if act == "gelu_tanh" else "none")
        return linear(ctx, b.top.Mul(a, linear(ctx, x, up, inter, bias=True)), down, hidden, bias=True)
    return b.top.MLP(x, ctx.weight(gate, (inter, hidden)), ctx.weight(up, (inter, hidden)),
                     ctx.weight(down, (hidden, inter)), act=act, loc="mlp")
