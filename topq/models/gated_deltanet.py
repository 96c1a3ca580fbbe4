"""Hybrid linear-attention decoders (Qwen3.5, Qwen3-Next): Gated DeltaNet layers between gated full-attention ones.

What the families share, written once (numerics of transformers' modeling_qwen3_5 / modeling_qwen3_next):

* the config: `layer_types` says per layer "linear_attention" or "full_attention"; the linear layers' sizes
  (`linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`, `linear_value_head_dim`,
  `linear_conv_kernel_dim`); partial RoPE (`partial_rotary_factor`, in `rope_parameters` in transformers 5);
* the layer's carried states: the causal conv's last K-1 inputs `[1, K-1, 2·HK·DK + HV·DV]` and the recurrent
  state `[1, HV, DK, DV]`, both f32 (`layer_states`);
* the Gated DeltaNet mixer: q/k/v through one projection and a depthwise causal conv with SiLU; beta =
  sigmoid(b); the log decay g = −exp(A_log) · softplus(a + dt_bias); the gated delta rule with L2-normed q/k
  (chunked in prefill, recurrent in decode); a per-head RMSNorm of the result times SiLU(z); out_proj. Padding
  tokens of a prefill segment get g = beta = 0 (`ctx.valid`), so they leave the state as it was;
* the gated attention: q_proj gives each head's query and a gate of head_dim, interleaved per head; per-head
  q/k RMSNorm, partial RoPE, attention, then output × sigmoid(gate) before o_proj;
* (1 + w) RMSNorms: the checkpoint stores w, the graph reads 1 + w (`ZERO_CENTERED_NORMS`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from topq.core.errors import TopqError
from topq.core.family import LayerState, ModelSpec
from topq.core.stages import BlockContext, Stage
from topq.ir.graph import Value
from topq.models.blocks import heads, linear, mlp, rms_norm, rope
from topq.models.decoder import DecoderConfig, architecture_of, hf_field, read_config
from topq.models.fields import refuse_unimplemented
from topq.models.weightmap import AddScalar, WeightRule

LINEAR, FULL = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR, FULL)
#: the chunk length of the prefill's gated delta rule (transformers' and FLA's default)
CHUNK_SIZE = 64

ATTENTION_WEIGHTS = {
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}
DELTANET_WEIGHTS = {
    "conv1d": "model.layers.{i}.linear_attn.conv1d.weight",
    "dt_bias": "model.layers.{i}.linear_attn.dt_bias",
    "A_log": "model.layers.{i}.linear_attn.A_log",
    "linear_norm": "model.layers.{i}.linear_attn.norm.weight",
    "out_proj": "model.layers.{i}.linear_attn.out_proj.weight",
}
NORM_WEIGHTS = {
    "input_layernorm": "model.layers.{i}.input_layernorm.weight",
    "post_attention_layernorm": "model.layers.{i}.post_attention_layernorm.weight",
}
MLP_WEIGHTS = {
    "gate_proj": "model.layers.{i}.mlp.gate_proj.weight",
    "up_proj": "model.layers.{i}.mlp.up_proj.weight",
    "down_proj": "model.layers.{i}.mlp.down_proj.weight",
}
#: linears that share an input (AWQ scales each group together); a layer has the groups of its kind
QUANT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                ("out_proj",), ("gate_proj", "up_proj"), ("down_proj",))
#: the norms computed as x̂ · (1 + w) (the gated norm of the linear layers uses w as is)
ZERO_CENTERED_NORMS = ("model.norm.weight", NORM_WEIGHTS["input_layernorm"],
                       NORM_WEIGHTS["post_attention_layernorm"], ATTENTION_WEIGHTS["q_norm"],
                       ATTENTION_WEIGHTS["k_norm"])


def zero_centered_norm_rules() -> dict[str, WeightRule]:
    return {name: AddScalar(name, 1.0) for name in ZERO_CENTERED_NORMS}


@dataclass(frozen=True)
class HybridConfig(DecoderConfig):
    """A hybrid decoder's config: the Llama-style fields plus the linear layers' (read by `read_config`)."""

    rope_theta: float = hf_field("rope_theta", "rope_parameters.rope_theta", default=10000.0)
    partial_rotary_factor: float | None = hf_field("partial_rotary_factor", "rope_parameters.partial_rotary_factor",
                                                   default=None)
    layer_types: Any = None
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4


#: the numerics-changing config fields the hybrid families implement (`ModelFamily.config_fields`); the others
#: (attention_bias, sliding windows, soft-caps, …) are refused by `refuse_unimplemented`
HYBRID_FIELDS = frozenset({"layer_types", "partial_rotary_factor"})


def normalize_hybrid(config: Mapping[str, Any], family: str, **overrides: Any) -> ModelSpec:
    refuse_unimplemented(config, architecture_of(config, family), HYBRID_FIELDS)
    cfg = read_config(HybridConfig, config, family)
    types = cfg.layer_types
    if types is None:  # transformers' default: every full_attention_interval-th layer attends
        types = [FULL if (i + 1) % cfg.full_attention_interval == 0 else LINEAR
                 for i in range(cfg.num_hidden_layers)]
    types = tuple(str(t) for t in types)
    if len(types) != cfg.num_hidden_layers:
        raise TopqError(f"{family}: layer_types has {len(types)} entries for {cfg.num_hidden_layers} layers")
    for i, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            raise TopqError(f"{family}: layer {i} has layer type {kind!r}, which the family does not know "
                            f"(known: {', '.join(LAYER_TYPES)})")
    sizes = {"key_heads": cfg.linear_num_key_heads, "value_heads": cfg.linear_num_value_heads,
             "key_head_dim": cfg.linear_key_head_dim, "value_head_dim": cfg.linear_value_head_dim,
             "conv_kernel": cfg.linear_conv_kernel_dim}
    for name, value in sizes.items():
        if value < 1:
            raise TopqError(f"{family}: linear attention {name} = {value} in the config; it must be positive")
    if sizes["conv_kernel"] < 2:
        raise TopqError(f"{family}: linear_conv_kernel_dim = {sizes['conv_kernel']}; the family needs at least 2")
    # what transformers' blocks hard-wire (or take from these fields) and this family computes only one way
    if cfg.hidden_act != "silu":
        raise TopqError(f"{family}: hidden_act = {cfg.hidden_act!r} is not supported (the linear layers' conv and "
                        "gated norm compute silu)")
    if config.get("attn_output_gate", True) is not True:
        raise TopqError(f"{family}: attn_output_gate = {config.get('attn_output_gate')!r} is not supported "
                        "(the attention output is always gated)")
    if str(config.get("mamba_ssm_dtype", "float32")) != "float32":
        raise TopqError(f"{family}: mamba_ssm_dtype = {config.get('mamba_ssm_dtype')!r} is not supported (the "
                        "recurrent state is float32)")
    if sizes["value_heads"] % sizes["key_heads"]:
        raise TopqError(f"{family}: linear_num_value_heads {sizes['value_heads']} is not a multiple of "
                        f"linear_num_key_heads {sizes['key_heads']}")
    return cfg.spec(config, family, qk_norm=True, layer_types=types, linear_attention=sizes, **overrides)


def _sizes(spec: ModelSpec) -> dict[str, int]:
    assert spec.linear_attention is not None  # normalize_hybrid sets it
    return spec.linear_attention


def conv_channels(spec: ModelSpec) -> int:
    s = _sizes(spec)
    return 2 * s["key_heads"] * s["key_head_dim"] + s["value_heads"] * s["value_head_dim"]


def layer_states(spec: ModelSpec, layer: int) -> tuple[LayerState, ...]:
    if spec.layer_types[layer] != LINEAR:
        return ()
    s = _sizes(spec)
    return (LayerState("conv", (1, s["conv_kernel"] - 1, conv_channels(spec))),
            LayerState("recurrent", (1, s["value_heads"], s["key_head_dim"], s["value_head_dim"])))


def build_block(ctx: BlockContext, feed_forward: Callable[[Value], Value] | None = None) -> Value:
    """One pre-norm decoder layer: its token mixer (by layer type), then the feed-forward (the dense MLP unless
    the family passes its own, e.g. Qwen3-Next's mixture of experts)."""
    b, x = ctx.b, ctx.hidden
    mixer = gated_deltanet if ctx.spec.layer_types[ctx.layer] == LINEAR else gated_attention
    x = b.top.Add(x, mixer(ctx, rms_norm(ctx, x, "input_layernorm")))
    h = rms_norm(ctx, x, "post_attention_layernorm")
    return b.top.Add(x, feed_forward(h) if feed_forward else mlp(ctx, h))


def _last_dim_slice(ctx: BlockContext, x: Value, start: int, stop: int, loc: str) -> Value:
    rank = len(x.shape)
    return ctx.b.top.Slice(x, offset=[0] * (rank - 1) + [start], ends=list(x.shape[:-1]) + [stop],
                           steps=[1] * rank, loc=loc)


def gated_attention(ctx: BlockContext, x: Value) -> Value:
    s, b = ctx.spec, ctx.b
    n_heads, d, length = s.num_heads, s.head_dim, ctx.length
    query_gate = b.top.Reshape(linear(ctx, x, "q_proj", 2 * n_heads * d), shape=[1, length, n_heads, 2 * d])
    q = _last_dim_slice(ctx, query_gate, 0, d, "query")
    gate = b.top.Reshape(_last_dim_slice(ctx, query_gate, d, 2 * d, "gate"), shape=[1, length, n_heads * d])
    k = heads(ctx, linear(ctx, x, "k_proj", s.num_kv_heads * d), s.num_kv_heads)
    v = heads(ctx, linear(ctx, x, "v_proj", s.num_kv_heads * d), s.num_kv_heads)
    q, k = rms_norm(ctx, q, "q_norm"), rms_norm(ctx, k, "k_norm")
    attn = ctx.attention(rope(ctx, q), rope(ctx, k), v)
    attn = b.top.Mul(attn, b.top.Sigmoid(gate, loc="output_gate"), loc="gated_output")
    return linear(ctx, attn, "o_proj", s.hidden_size)


def gated_deltanet(ctx: BlockContext, x: Value) -> Value:
    """The Gated DeltaNet mixer of a linear-attention layer; records its conv and recurrent states."""
    b, sz, length = ctx.b, _sizes(ctx.spec), ctx.length
    hk, hv, dk, dv = sz["key_heads"], sz["value_heads"], sz["key_head_dim"], sz["value_head_dim"]
    channels, key_dim, value_dim = conv_channels(ctx.spec), hk * dk, hv * dv
    qkv, z, beta_logit, a = in_projections(ctx, x, channels, value_dim, hv)

    conv_state = ctx.state_in("conv")
    operands = [qkv, ctx.weight("conv1d", (channels, 1, sz["conv_kernel"]))]
    operands += [conv_state] if conv_state is not None else []
    operands += [ctx.valid] if ctx.valid is not None else []
    mixed, conv_out = b.top.CausalConv1d(*operands, with_state=conv_state is not None, act="silu", loc="conv1d")
    q = b.top.Reshape(_last_dim_slice(ctx, mixed, 0, key_dim, "q"), shape=[1, length, hk, dk])
    k = b.top.Reshape(_last_dim_slice(ctx, mixed, key_dim, 2 * key_dim, "k"), shape=[1, length, hk, dk])
    v = b.top.Reshape(_last_dim_slice(ctx, mixed, 2 * key_dim, channels, "v"), shape=[1, length, hv, dv])

    beta = b.top.Sigmoid(beta_logit, loc="beta")
    rate = b.top.Softplus(b.top.Add(a, ctx.weight("dt_bias", (hv,)), loc="dt"), loc="softplus")
    g = b.top.MulConst(b.top.Mul(b.top.Exp(ctx.weight("A_log", (hv,)), loc="A"), rate), const_val=-1.0, loc="g")
    if ctx.valid is not None:  # padding writes nothing and decays nothing
        keep = b.top.Reshape(ctx.valid, shape=[1, length, 1])
        beta, g = b.top.Mul(beta, keep, loc="beta_valid"), b.top.Mul(g, keep, loc="g_valid")

    state = ctx.state_in("recurrent")
    rule_operands = [q, k, v, g, beta] + ([state] if state is not None else [])
    if ctx.stage is Stage.DECODE:
        core, state_out = b.top.GatedDeltaRule(*rule_operands, scale=dk ** -0.5, qk_l2norm=True, loc="delta_rule")
    else:
        core, state_out = b.top.ChunkGatedDeltaRule(*rule_operands, scale=dk ** -0.5, qk_l2norm=True,
                                                    chunk_size=CHUNK_SIZE, loc="delta_rule")
    ctx.carry(conv=conv_out, recurrent=state_out)

    normed = ctx.b.top.RMSNorm(core, ctx.weight("linear_norm", (dv,)), eps=ctx.spec.rms_norm_eps, loc="linear_norm")
    gated = b.top.Mul(normed, b.top.SiLU(b.top.Reshape(z, shape=[1, length, hv, dv])), loc="norm_gate")
    return linear(ctx, b.top.Reshape(gated, shape=[1, length, value_dim]), "out_proj", ctx.spec.hidden_size)


def in_projections(ctx: BlockContext, x: Value, channels: int, value_dim: int,
                   value_heads: int) -> tuple[Value, Value, Value, Value]:
    """(qkv, z, b, a): the family's layout of the mixer's input projections (`ctx.family.layer_weights`)."""
    return (linear(ctx, x, "in_proj_qkv", channels), linear(ctx, x, "in_proj_z", value_dim),
            linear(ctx, x, "in_proj_b", value_heads), linear(ctx, x, "in_proj_a", value_heads))
