"""The stage template: one family block → prefill, prefill-with-history and decode functions.

Function signatures (L = max_input_length, S = seq_length or a decode-chunk length, H hidden,
KVH kv heads, D head dim):

    embedding(ids[1,L] i32) -> hidden[1,L,H]            embedding_cache(ids[1,1]) -> hidden[1,1,H]
    block_{i}(hidden[1,L,H], pos[1,L]) -> (hidden, k[1,L,KVH,D], v)
    block_kv_{i}(hidden, pos, mask[1,1,1,S+L], history_k[1,S,KVH,D], history_v) -> (hidden, k, v)
    block_cache_{i}[_{S}](hidden[1,1,H], pos[1,1], mask[1,1,1,S+1], history_k[1,S,KVH,D], history_v)
        -> (hidden, k[1,1,KVH,D], v)
    lm_head(hidden[1,1,H]) -> logits[1,1,V]                (the final norm is folded in here; position-wise)

A recurrent layer (the family's `layer_states` names what it carries, e.g. a linear-attention layer's conv
window and state, each `[1, ...]` f32) has no KV and no decode variants:

    block_{i}(hidden, pos, valid[1,L]) -> (hidden, *states)
    block_kv_{i}(hidden, pos, valid[1,L], *states) -> (hidden, *states)
    block_cache_{i}(hidden[1,1,H], pos[1,1], *states) -> (hidden, *states)

`valid` is 1 on the real tokens of the padded segment, 0 on the padding, which must not reach the states.

Prefill is causal inside `top.FAttention` (no L×L mask). Prefill-with-history takes a small key mask
over history + new keys (like decode's), because only the runtime knows how much of the static
history buffer is filled. RoPE cos/sin are `[S, R]` weights gathered by position_ids.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from topq.core.errors import TopqError
from topq.core.family import LayerState, ModelFamily, ModelSpec
from topq.ir.builder import Builder
from topq.ir.graph import Module, Value
from topq.ir.reference_ops import rope_tables
from topq.ir.rope import rope_inv_freq
from topq.ir.types import tensor

ROPE_COS, ROPE_SIN = "rope.cos", "rope.sin"
ROPE_LOCAL_COS, ROPE_LOCAL_SIN = "rope_local.cos", "rope_local.sin"


class Stage(Enum):
    PREFILL = "prefill"
    PREFILL_KV = "prefill_kv"
    DECODE = "decode"

    @property
    def with_history(self) -> bool:
        return self is not Stage.PREFILL


@dataclass(frozen=True)
class StageConfig:
    seq_length: int
    max_input_length: int
    prefill_kv: bool = True
    decode_chunks: tuple[int, ...] = ()

    @property
    def decode_variants(self) -> tuple[int, ...]:
        """History lengths with a decode function, ascending; the last is seq_length."""
        return tuple(sorted({c for c in self.decode_chunks if 0 < c < self.seq_length} | {self.seq_length}))

    @classmethod
    def from_recipe(cls, stages: Any) -> StageConfig:
        return cls(int(stages.seq_length), int(stages.max_input_length), bool(stages.prefill_kv),
                   tuple(int(c) for c in stages.decode_chunks))


def stage_window(spec: ModelSpec, layer: int, seq_length: int) -> int:
    """`layer`'s sliding window in a program of `seq_length` positions: 0 for full attention, and for a window
    that covers every position anyway."""
    window = spec.window(layer)
    return window if 0 < window < seq_length else 0


def mask_rows(spec: ModelSpec, stage: Stage, layer: int, length: int, seq_length: int) -> int:
    """Rows of a history stage's key mask: one row shared by every query, except a sliding-window layer's
    prefill-with-history, where each query's window starts elsewhere in the history (one row per query)."""
    return length if stage is Stage.PREFILL_KV and stage_window(spec, layer, seq_length) else 1


def block_name(stage: Stage, layer: int, history: int = 0, seq_length: int = 0) -> str:
    if stage is Stage.PREFILL:
        return f"block_{layer}"
    if stage is Stage.PREFILL_KV:
        return f"block_kv_{layer}"
    return f"block_cache_{layer}" if history == seq_length else f"block_cache_{layer}_{history}"


class BlockContext:
    """What a family's `build_block` sees: the builder, the spec, the layer's inputs and weights, and the stage's
    attention (`attention`) or recurrent states (`state_in`, `carry`). The decoder sublayers built on it
    (projections, norms, RoPE, the GQA sublayer, the gated MLP) are `topq.models.blocks`."""

    def __init__(self, builder: Builder, spec: ModelSpec, family: ModelFamily, layer: int, stage: Stage,
                 hidden: Value, cos: Value, sin: Value, shapes: Mapping[str, tuple[int, ...]] | None,
                 mask: Value | None = None, history_k: Value | None = None, history_v: Value | None = None,
                 window: int = 0, valid: Value | None = None, states: Mapping[str, Value] | None = None) -> None:
        self.b = builder
        self.spec = spec
        self.family = family
        self.layer = layer
        self.stage = stage
        self.hidden = hidden
        self.cos, self.sin = cos, sin
        self.shapes = shapes
        self.mask, self.history_k, self.history_v = mask, history_k, history_v
        self.window = window  # this layer's sliding window in tokens (0: full attention)
        self.k_out: Value | None = None
        self.v_out: Value | None = None
        self.valid = valid  # [1, L] f32 in a recurrent layer's prefill stages, else None
        self._states_in = dict(states or {})
        self.states_out: dict[str, Value] = {}

    def state_in(self, name: str) -> Value | None:
        """The carried state `name` this call starts from; None in prefill (the state starts at zero)."""
        return self._states_in.get(name)

    def carry(self, **states: Value) -> None:
        """Record the states this recurrent layer hands to its next call (one per `LayerState`)."""
        self.states_out.update(states)

    @property
    def length(self) -> int:
        return self.hidden.shape[1]

    def weight_name(self, key: str) -> str:
        try:
            template = self.family.layer_weights[key]
        except KeyError:
            raise TopqError(f"family {self.family.name} has no layer weight {key!r}") from None
        return template.format(i=self.layer)

    def weight(self, key: str, shape: tuple[int, ...]) -> Value:
        return named_weight(self.b, self.weight_name(key), shape, self.shapes)

    def attention(self, q: Value, k: Value, v: Value) -> Value:
        """Causal GQA attention of this stage; records k, v (post-RoPE) as the block's KV outputs."""
        self.k_out, self.v_out = k, v
        if self.stage.with_history:
            k = self.b.top.Concat(self.history_k, k, axis=1, loc="history_k")
            v = self.b.top.Concat(self.history_v, v, axis=1, loc="history_v")
        operands = (q, k, v) if self.mask is None else (q, k, v, self.mask)
        s = self.spec
        options: dict[str, Any] = {}  # set only when used: other models' IR stays as it was
        if s.attn_softcap:
            options["softcap"] = s.attn_softcap
        if self.window:
            options["window"] = self.window
        return self.b.top.FAttention(*operands, q_head=s.num_heads, kv_head=s.num_kv_heads,
                                     scale=s.attention_scale or 1.0 / math.sqrt(s.head_dim), causal=True,
                                     loc="attention", **options)


def named_weight(b: Builder, name: str, shape: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]] | None) -> Value:
    """A `top.Weight` checked against the checkpoint: missing or misshapen tensors are clear errors.

    `shapes` None builds from the config alone (performance prediction without weights)."""
    if shapes is None:
        return b.weight(name, tensor(*shape))
    if name not in shapes:
        raise TopqError(f"checkpoint has no tensor {name}")
    if tuple(shapes[name]) != tuple(shape):
        raise TopqError(f"tensor {name} has shape {list(shapes[name])}, expected {list(shape)}")
    return b.weight(name, tensor(*shape))


# --------------------------------------------------------------------------------------- RoPE tables


def rope_weights(spec: ModelSpec, seq_length: int) -> dict[str, np.ndarray]:
    """The RoPE cos/sin tables the program gathers from: the global RoPE, and the sliding-window layers' own
    (default type, `local_rope_theta`) when the spec has one (Gemma 3)."""
    inv_freq, attention_scaling = rope_inv_freq(spec, seq_length)
    cos, sin = rope_tables(np.arange(seq_length), inv_freq, spec.rope_mode, attention_scaling)
    tables = {ROPE_COS: cos, ROPE_SIN: sin}
    if spec.local_rope_theta:
        inv_freq, attention_scaling = rope_inv_freq(spec, seq_length, spec.local_rope_theta, {})
        cos, sin = rope_tables(np.arange(seq_length), inv_freq, spec.rope_mode, attention_scaling)
        tables.update({ROPE_LOCAL_COS: cos, ROPE_LOCAL_SIN: sin})
    return tables


def rope_table_names(spec: ModelSpec, layer: int) -> tuple[str, str]:
    """The cos/sin tables of `layer`."""
    if spec.local_rope_theta and spec.window(layer):
        return ROPE_LOCAL_COS, ROPE_LOCAL_SIN
    return ROPE_COS, ROPE_SIN


# --------------------------------------------------------------------------------------- the program


def build_program(spec: ModelSpec, family: ModelFamily, config: StageConfig,
                  shapes: Mapping[str, tuple[int, ...]] | None = None) -> Module:
    """Every function of the model for these stages, from the family's one block builder.

    `shapes` maps checkpoint tensor names to their shapes, checked as the graph is built; None trusts the
    spec (a config-only build for performance prediction).
    """
    if config.max_input_length > config.seq_length:
        raise TopqError("stages.max_input_length must not exceed stages.seq_length")
    S, L, H = config.seq_length, config.max_input_length, spec.hidden_size
    if shapes is not None:
        shapes = {**shapes, **{name: (S, spec.rope_dim) for name in (ROPE_COS, ROPE_SIN, ROPE_LOCAL_COS,
                                                                     ROPE_LOCAL_SIN)}}
    b = Builder()
    b.module.attrs = {
        "topq.seq_length": S,
        "topq.max_input_length": L,
        "topq.prefill_kv": config.prefill_kv,
        "topq.decode_variants": list(config.decode_variants),
        "topq.num_layers": spec.num_layers,
    }
    embed = family.global_weights["embed"]
    for name, length in (("embedding", L), ("embedding_cache", 1)):
        with b.function(name, tensor(1, length, dtype="i32")) as f:
            table = named_weight(b, embed, (spec.vocab_size, H), shapes)
            hidden = b.top.Gather(table, f.args[0], axis=0, loc="embed")
            f.returns(family.embed_hook(b, spec, hidden) if family.embed_hook else hidden)

    for layer in range(spec.num_layers):
        _build_block_function(b, spec, family, Stage.PREFILL, layer, L, 0, shapes, S)
        if config.prefill_kv:
            _build_block_function(b, spec, family, Stage.PREFILL_KV, layer, L, S, shapes, S)
        # a recurrent layer reads no history: one decode function, whatever the context length
        for history in (S,) if family.states_of(spec, layer) else config.decode_variants:
            _build_block_function(b, spec, family, Stage.DECODE, layer, 1, history, shapes, S)

    with b.function("lm_head", tensor(1, 1, H)) as f:
        norm = named_weight(b, family.global_weights["final_norm"], (H,), shapes)
        h = b.top.RMSNorm(f.args[0], norm, eps=spec.rms_norm_eps, loc="final_norm")
        head = family.global_weights["embed"] if spec.tie_word_embeddings else family.global_weights["lm_head"]
        logits = b.top.MatMul(h, named_weight(b, head, (spec.vocab_size, H), shapes), right_transpose=True,
                              loc="lm_head")
        f.returns(family.head_hook(b, spec, logits) if family.head_hook else logits)
    return b.module


def _build_block_function(b: Builder, spec: ModelSpec, family: ModelFamily, stage: Stage, layer: int,
                          length: int, history: int, shapes: Mapping[str, tuple[int, ...]] | None,
                          seq_length: int) -> None:
    H, KVH, D = spec.hidden_size, spec.num_kv_heads, spec.head_dim
    states = family.states_of(spec, layer)
    inputs = [tensor(1, length, H), tensor(1, length, dtype="i32")]
    if states:
        if stage is not Stage.DECODE:
            inputs.append(tensor(1, length))
        if stage.with_history:
            inputs += [tensor(*s.shape) for s in states]
    elif stage.with_history:
        inputs += [tensor(1, 1, mask_rows(spec, stage, layer, length, seq_length), history + length),
                   tensor(1, history, KVH, D), tensor(1, history, KVH, D)]
    name = block_name(stage, layer, history, seq_length)
    with b.function(name, *inputs, attrs={"stage": stage.value, "layer": layer}) as f, b.scope(f"layers.{layer}."):
        hidden, positions, *rest = f.args
        R = spec.rope_dim
        cos_table, sin_table = rope_table_names(spec, layer)
        cos = b.top.Gather(b.weight(cos_table, tensor(seq_length, R)), positions, axis=0, loc="rope_cos")
        sin = b.top.Gather(b.weight(sin_table, tensor(seq_length, R)), positions, axis=0, loc="rope_sin")
        if states:
            valid = rest.pop(0) if stage is not Stage.DECODE else None
            ctx = BlockContext(b, spec, family, layer, stage, hidden, cos, sin, shapes, valid=valid,
                               states={s.name: v for s, v in zip(states, rest)})
            out = family.build_block(ctx)
            f.returns(out, *_carried(family, layer, states, ctx))
            return
        mask, history_k, history_v = rest if rest else (None, None, None)
        ctx = BlockContext(b, spec, family, layer, stage, hidden, cos, sin, shapes, mask, history_k, history_v,
                           window=stage_window(spec, layer, seq_length))
        out = family.build_block(ctx)
        if ctx.k_out is None or ctx.v_out is None:
            raise TopqError(f"family {family.name}: build_block never called ctx.attention")
        f.returns(out, ctx.k_out, ctx.v_out)


def _carried(family: ModelFamily, layer: int, states: tuple[LayerState, ...], ctx: BlockContext) -> list[Value]:
    """The states a recurrent block returned, in the declared order, checked against their declared shapes."""
    if ctx.k_out is not None:
        raise TopqError(f"family {family.name}: layer {layer} carries states, but its block attends over KV")
    if set(ctx.states_out) != {s.name for s in states}:
        raise TopqError(f"family {family.name}: layer {layer} returned states {sorted(ctx.states_out)}, declared "
                        f"{[s.name for s in states]}")
    values = [ctx.states_out[s.name] for s in states]
    for s, v in zip(states, values):
        if tuple(v.shape) != tuple(s.shape):
            raise TopqError(f"family {family.name}: layer {layer} state {s.name} is {list(v.shape)}, declared "
                            f"{list(s.shape)}")
    return values


def layer_carries(spec: ModelSpec, family: ModelFamily) -> list[list[list[Any]]]:
    """Per layer, what it carries as stored in a bundle's stages: [] for KV, else [[name, shape], ...]."""
    return [[[s.name, list(s.shape)] for s in family.states_of(spec, i)] for i in range(spec.num_layers)]
