"""The Top dialect: the LLM subset of TPU-MLIR's Top ops, declared as data with shape inference.

Semantics (the interpreter's kernels in `reference_ops.py` are their definition):
weights are in Hugging Face Linear layout `[out, in]` and used with `right_transpose = true`;
`top.FAttention` takes q `[B, Lq, Hq, D]`, k/v `[B, Lk, Hkv, D]`, an optional additive mask broadcast to
`[B, Hq, Lq, Lk]`, is causal bottom-right aligned (the first `Lk - Lq` keys are history) and returns
`[B, Lq, Hq * D]`. Its scores are `q·k × scale`, then `softcap · tanh(score / softcap)` when `softcap` > 0
(Gemma 2; absent or 0: none), then the mask. `window` > 0 is a sliding window: among the last `Lq` keys (the
queries' own tokens) query i sees key j only if `i - j < window`; history keys (the first `Lk - Lq`) are
windowed by the mask, which the runtime builds from positions, because only it knows how much of a static
history buffer is filled. `top.Rope` takes x `[B, L, H, D]` and cos/sin `[B, L, R]` (R ≤ D);
`top.MoE` takes x `[..., H]`, the router `[E, H]`, gate/up/down of each expert in turn and optionally a shared
expert's gate/up/down and its gate `[1, H]` (see `moe_operands`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from topq.ir.catalogue import AttrSpec, InferError, Linear, Traits, define
from topq.ir.types import TensorType, Type

A = AttrSpec


def _tensors(types: Sequence[Type]) -> list[TensorType]:
    for t in types:
        if not isinstance(t, TensorType):
            raise InferError(f"expected tensor operands, got {t}")
    return list(types)  # type: ignore[arg-type]


def broadcast_shapes(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        raise InferError(f"shapes {list(a)} and {list(b)} do not broadcast") from None


def _same(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    return [_tensors(types)[0]]


def _elementwise(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    a, b = _tensors(types)
    return [a.with_shape(broadcast_shapes(a.shape, b.shape))]


def _gather(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    table, index = _tensors(types)
    axis = attrs["axis"] % max(table.rank, 1)
    if index.dtype not in ("i32", "i64", "i16"):
        raise InferError(f"indices must be integers, got {index.dtype}")
    return [table.with_shape(table.shape[:axis] + index.shape + table.shape[axis + 1 :])]


def _norm(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, *params = _tensors(types)
    for p in params:
        if p.shape != x.shape[-1:]:
            raise InferError(f"norm parameter of shape {list(p.shape)} does not match the last dim {x.shape[-1]}")
    return [x]


def _matmul(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    a, b, *bias = _tensors(types)
    if a.rank < 1 or b.rank < 2:
        raise InferError("MatMul needs a of rank ≥ 1 and b of rank ≥ 2")
    k, n = (b.shape[-1], b.shape[-2]) if attrs["right_transpose"] else (b.shape[-2], b.shape[-1])
    if a.shape[-1] != k:
        raise InferError(f"contracting dims differ: a has {a.shape[-1]}, b has {k}")
    if b.rank == 2:
        shape = a.shape[:-1] + (n,)
    else:
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
        shape = batch + (a.shape[-2], n)
    if bias and bias[0].shape[-1:] != (n,):
        raise InferError(f"bias of shape {list(bias[0].shape)} does not match N = {n}")
    return [a.with_shape(shape)]


def _reshape(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    (x,) = _tensors(types)
    shape = list(attrs["shape"])
    if shape.count(-1) > 1:
        raise InferError("at most one -1 in a reshape")
    known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
    if -1 in shape:
        if known == 0 or x.numel % known:
            raise InferError(f"cannot reshape {list(x.shape)} to {shape}")
        shape[shape.index(-1)] = x.numel // known
    if int(np.prod(shape, dtype=np.int64)) != x.numel:
        raise InferError(f"cannot reshape {list(x.shape)} ({x.numel} elements) to {shape}")
    return [x.with_shape(tuple(shape))]


def _permute(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    (x,) = _tensors(types)
    order = attrs["order"]
    if sorted(order) != list(range(x.rank)):
        raise InferError(f"order {order} is not a permutation of {x.rank} axes")
    return [x.with_shape(tuple(x.shape[i] for i in order))]


def _concat(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    xs = _tensors(types)
    axis = attrs["axis"] % xs[0].rank
    for x in xs[1:]:
        if x.rank != xs[0].rank or any(x.shape[i] != xs[0].shape[i] for i in range(x.rank) if i != axis):
            raise InferError(f"cannot concat {list(xs[0].shape)} and {list(x.shape)} on axis {axis}")
        if x.dtype != xs[0].dtype:
            raise InferError(f"cannot concat {xs[0].dtype} and {x.dtype}")
    return [xs[0].with_shape(xs[0].shape[:axis] + (sum(x.shape[axis] for x in xs),) + xs[0].shape[axis + 1 :])]


def _slice(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    (x,) = _tensors(types)
    offset, ends, steps = attrs["offset"], attrs["ends"], attrs["steps"]
    if not len(offset) == len(ends) == len(steps) == x.rank:
        raise InferError(f"offset/ends/steps need {x.rank} entries each")
    if any(s <= 0 for s in steps):
        raise InferError("slice steps must be positive")
    shape = tuple(len(range(*slice(o, e, s).indices(d))) for o, e, s, d in zip(offset, ends, steps, x.shape))
    return [x.with_shape(shape)]


def _rope(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, cos, sin = _tensors(types)
    if x.rank != 4 or cos.rank != 3 or cos.shape != sin.shape:
        raise InferError("Rope takes x [B, L, H, D] and cos/sin [B, L, R]")
    if cos.shape[:2] != x.shape[:2] or cos.shape[2] > x.shape[3] or cos.shape[2] % 2:
        raise InferError(f"cos/sin {list(cos.shape)} do not fit x {list(x.shape)}")
    return [x]


def _fattention(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    q, k, v, *mask = _tensors(types)
    if q.rank != 4 or k.rank != 4 or k.shape != v.shape:
        raise InferError("FAttention takes q [B, Lq, Hq, D] and k, v [B, Lk, Hkv, D]")
    hq, hkv = attrs["q_head"], attrs["kv_head"]
    if q.shape[2] != hq or k.shape[2] != hkv or hq % hkv:
        raise InferError(f"heads do not match q_head={hq}, kv_head={hkv}: q {list(q.shape)}, k {list(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise InferError(f"q {list(q.shape)} and k {list(k.shape)} differ in batch or head dim")
    if k.shape[1] < q.shape[1]:
        raise InferError("FAttention needs at least as many keys as queries")
    if mask:
        broadcast_shapes(mask[0].shape, (q.shape[0], hq, q.shape[1], k.shape[1]))
    return [q.with_shape((q.shape[0], q.shape[1], hq * q.shape[3]))]


def _mlp(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, gate, up, down = _tensors(types)
    h = x.shape[-1]
    if gate.shape != up.shape or gate.shape[1] != h or down.shape != (h, gate.shape[0]):
        raise InferError(
            f"MLP weights gate {list(gate.shape)}, up {list(up.shape)}, down {list(down.shape)} do not fit hidden {h}"
        )
    return [x]


def moe_operands(num_experts: int, shared: bool) -> int:
    """top.MoE's operand count: x, the router, (gate, up, down) per expert, (gate, up, down, gate [1, H]) shared."""
    return 2 + 3 * num_experts + (4 if shared else 0)


def moe_expert_weights(expert: int) -> tuple[int, int, int]:
    """The operands holding expert `expert`'s gate, up and down weights."""
    return 2 + 3 * expert, 3 + 3 * expert, 4 + 3 * expert


def _moe_experts(operand_count: int) -> tuple[int, bool]:
    """(experts, has a shared expert) of a top.MoE with this many operands."""
    rest = operand_count - 2
    shared = rest % 3 == 1
    return (rest - 4) // 3 if shared else rest // 3, shared


def _gated_mlp_linears(gate: int, up: int, down: int, prefix: str, expert: int | None) -> tuple[Linear, ...]:
    return (Linear(gate, 0, prefix + "gate", expert=expert), Linear(up, 0, prefix + "up", expert=expert),
            Linear(down, None, prefix + "down", scales_input=up, hidden_from=(0, gate, up), expert=expert))


def _moe_linears(operand_count: int) -> tuple[Linear, ...]:
    """Each expert's gate/up/down (seeing only its routed tokens), then the shared expert's. The router and the
    shared expert's gate stay float (as GPTQ / AWQ checkpoints of MoE models keep them)."""
    experts, shared = _moe_experts(operand_count)
    linears = [lin for e in range(experts) for lin in _gated_mlp_linears(*moe_expert_weights(e), "", e)]
    if shared:
        s = moe_operands(experts, False)
        linears += _gated_mlp_linears(s, s + 1, s + 2, "shared_", None)
    return tuple(linears)


def _moe(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, router, *weights = _tensors(types)
    experts, shared = _moe_experts(len(types))
    h, declared = x.shape[-1], attrs["num_experts"]
    if len(types) != moe_operands(declared, shared):
        raise InferError(f"MoE with num_experts={declared} takes {moe_operands(declared, False)} or "
                         f"{moe_operands(declared, True)} operands, got {len(types)}")
    if router.shape != (experts, h):
        raise InferError(f"MoE router {list(router.shape)} does not fit {experts} experts of hidden {h}")
    if not 0 < attrs["top_k"] <= experts:
        raise InferError(f"MoE top_k = {attrs['top_k']} is out of range for {experts} experts")
    for e in range(experts + shared):
        gate, up, down = weights[3 * e:3 * e + 3]
        if gate.shape != up.shape or gate.shape[1:] != (h,) or down.shape != (h, gate.shape[0]):
            raise InferError(f"MoE expert weights gate {list(gate.shape)}, up {list(up.shape)}, down "
                             f"{list(down.shape)} do not fit hidden {h}")
    if shared and weights[-1].shape != (1, h):
        raise InferError(f"MoE shared expert gate {list(weights[-1].shape)} is not [1, {h}]")
    return [x]


def _topk(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    (x,) = _tensors(types)
    axis = attrs["axis"] % x.rank
    if not 0 < attrs["k"] <= x.shape[axis]:
        raise InferError(f"k = {attrs['k']} is out of range for axis of size {x.shape[axis]}")
    shape = x.shape[:axis] + (attrs["k"],) + x.shape[axis + 1 :]
    return [x.with_shape(shape), TensorType(shape, "i32")]


def _int8_attrs(op: str, attrs: dict[str, Any]) -> None:
    if not attrs["dynamic"] and not attrs["act_scale"] > 0:
        raise InferError(f"{op} needs act_scale > 0 unless dynamic")
    if not attrs["out_scale"] >= 0:
        raise InferError(f"{op} out_scale must be >= 0 (0: float dequantization), got {attrs['out_scale']}")


def _a8_matmul(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, w, *bias = _tensors(types)
    if w.rank != 2:
        raise InferError(f"A8MatMul wants a weight [N, K], got {list(w.shape)}")
    _int8_attrs("A8MatMul", attrs)
    return _matmul([x, w, *bias], {"right_transpose": True})


def _matmul_int8(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, codes, w_scale, *bias = _tensors(types)
    if codes.rank != 2 or w_scale.shape != codes.shape[:1]:
        raise InferError(f"MatMulInt8 wants codes [N, K] and w_scale [N], got {list(codes.shape)} and "
                         f"{list(w_scale.shape)}")
    _int8_attrs("MatMulInt8", attrs)
    return _matmul([x, codes, *bias], {"right_transpose": True})


#: traits shared by classes of ops (catalogue.Traits documents each field)
ELEMENTWISE = Traits(elementwise=True)
VIEW = Traits(view=True)
PLAIN = Traits()

define("top.Input", 1, infer=_same, doc="marks a function input", traits=PLAIN)
define("top.Weight", 0, attrs={"name": A("str")}, doc="a named tensor of the weight store (type given by the IR)",
       traits=Traits(named_weight=True))
# Gather selects rows by run-time indices: not a view of a weight for analyses (an embedding is no linear).
define("top.Gather", 2, attrs={"axis": A("int", 0)}, infer=_gather, traits=Traits(weights=(0,)))
define("top.RMSNorm", (1, 2), attrs={"eps": A("float", 1e-6)}, infer=_norm,
       traits=Traits(weights=(1,), norm_scale=1))
define("top.LayerNorm", (1, 3), attrs={"eps": A("float", 1e-5)}, infer=_norm,
       traits=Traits(weights=(1, 2), norm_scale=1, norm_bias=2))
define("top.MatMul", (2, 3), attrs={"right_transpose": A("bool", False)}, infer=_matmul,
       traits=Traits(weights=(1, 2), linears=(Linear(1, 0, layout_attr="right_transpose", bias=2),)))
define("top.Add", 2, infer=_elementwise, traits=ELEMENTWISE)
define("top.Mul", 2, infer=_elementwise, traits=ELEMENTWISE)
define("top.MulConst", 1, attrs={"const_val": A("float")}, infer=_same, traits=ELEMENTWISE)
define("top.Reshape", 1, attrs={"shape": A("ints")}, infer=_reshape, traits=Traits(view=True, keeps_order=True))
define("top.Permute", 1, attrs={"order": A("ints")}, infer=_permute, traits=VIEW)
define("top.Concat", (1, None), attrs={"axis": A("int")}, infer=_concat, traits=VIEW)
define("top.Slice", 1, attrs={"offset": A("ints"), "ends": A("ints"), "steps": A("ints")}, infer=_slice,
       traits=VIEW)
define("top.Rope", 3, attrs={"mode": A("str", "contiguous_halves", ("contiguous_halves", "interleaved_pairs"))},
       infer=_rope, traits=PLAIN)
define("top.FAttention", (3, 4),
       attrs={"q_head": A("int"), "kv_head": A("int"), "scale": A("float"), "causal": A("bool", True),
              "softcap": A("float", None), "window": A("int", None)},  # absent: off,
       infer=_fattention, traits=Traits(mixes_heads_of=2))
define("top.MLP", 4, attrs={"act": A("str", "silu", ("silu", "gelu", "gelu_tanh"))}, infer=_mlp,
       traits=Traits(weights=(1, 2, 3), linears=(Linear(1, 0, "gate"), Linear(2, 0, "up"),
                                                 Linear(3, None, "down", scales_input=2,
                                                        hidden_from=(0, 1, 2)))))
# Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral): router scores (softmax or sigmoid, float32) of x Wᵣᵀ, the
# top_k experts per token (ties to the lower index), their scores renormalised to sum 1 when norm_topk_prob, the
# sum of score · gated MLP of each chosen expert, plus sigmoid(x W_sgᵀ) · shared gated MLP when present.
define("top.MoE", (5, None),
       attrs={"num_experts": A("int"), "top_k": A("int"), "scoring": A("str", "softmax", ("softmax", "sigmoid")),
              "norm_topk_prob": A("bool", False), "act": A("str", "silu", ("silu", "gelu", "gelu_tanh"))},
       infer=_moe, traits=Traits(weights=(1,), linears_of=_moe_linears),
       doc="sparse mixture of gated-MLP experts with a top-k router and an optional gated shared expert")
define("top.SiLU", 1, infer=_same, traits=ELEMENTWISE)
define("top.Tanh", 1, infer=_same, traits=ELEMENTWISE)
define("top.GELU", 1, attrs={"approximate": A("str", "none", ("none", "tanh"))}, infer=_same, traits=ELEMENTWISE)
define("top.Softmax", 1, attrs={"axis": A("int", -1)}, infer=_same, traits=PLAIN)
define("top.TopK", 1, results=2, attrs={"k": A("int"), "axis": A("int", -1), "largest": A("bool", True)},
       infer=_topk, traits=PLAIN)
INT8_ATTRS = {"act_scale": A("float", 0.0), "dynamic": A("bool", False), "out_scale": A("float", 0.0)}
# A linear on int8 activations (what the `int8` scheme writes): x quantized per tensor (act_scale) or per row
# (dynamic) times the weight W [N, K], whose int8 values (per channel) are the scheme's `QuantizedWeight` for W,
# handed to the target like any quantized weight's; optionally requantized to int8 output codes (static,
# out_scale > 0). Targets lower it to their integer kernel (host: top.MatMulInt8 on W's codes and scales).
define("top.A8MatMul", (2, 3), attrs=INT8_ATTRS, infer=_a8_matmul,
       traits=Traits(weights=(1, 2), linears=(Linear(1, 0, bias=2),)),
       doc="y = q(x) Wᵀ · scale_x [+ bias] on int8 activations with the scheme's int8 W; requantized to int8 codes "
           "times out_scale when static with out_scale > 0")
# The W8A8 kernel on explicit codes: x quantized per tensor (act_scale) or per row (dynamic), int8 codes [N, K] held
# as integers in a float tensor, per-channel w_scale [N]; see topq/ir/int8.py for the exact arithmetic.
# Static with out_scale > 0: the int32 accumulator (+ bias quantized to it) is requantized to int8 output codes by
# a per-channel integer multiplier and right shift (r = act_scale · w_scale[n] / out_scale), y = code · out_scale.
# dynamic or out_scale == 0: float dequantization (per-token scales are run-time values: no static multiplier).
define("top.MatMulInt8", (3, 4), attrs=INT8_ATTRS, infer=_matmul_int8,
       # Already quantized: its weights are no site for weight quantization (no `linears`).
       traits=Traits(weights=(1, 2, 3)),
       doc="y = (q(x) codesᵀ) * (scale_x * w_scale) [+ bias], or requantized by M·2^-s to "
           "int8 codes times out_scale (static, out_scale > 0)")


# ----------------------------------------------------------------- linear attention (Gated DeltaNet layers)
# Kernels: topq/ir/reference_linear_attention.py (layouts and the recurrence in its module doc).


def _gated_delta_rule(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    q, k, v, g, beta, *state = _tensors(types)
    if q.rank != 4 or k.shape != q.shape or v.rank != 4 or v.shape[:2] != q.shape[:2]:
        raise InferError(f"gated delta rule takes q, k [B, L, HK, DK] and v [B, L, HV, DV]; got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    b, length, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if hv % hk or g.shape != (b, length, hv) or beta.shape != g.shape:
        raise InferError(f"value heads {hv} must be a multiple of key heads {hk}, g and beta [B, L, HV] = "
                         f"{[b, length, hv]}; got {list(g.shape)}, {list(beta.shape)}")
    state_type = TensorType((b, hv, dk, dv), "f32")  # the state stays f32 whatever the activations are
    if state and state[0].shape != state_type.shape:
        raise InferError(f"state {list(state[0].shape)} is not [B, HV, DK, DV] = {list(state_type.shape)}")
    if attrs.get("chunk_size", 1) < 1:
        raise InferError(f"chunk_size must be positive, got {attrs['chunk_size']}")
    return [v, state_type]


def _causal_conv1d(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, weight, *rest = _tensors(types)
    if x.rank != 3 or weight.rank != 3 or weight.shape[:2] != (x.shape[2], 1):
        raise InferError(f"CausalConv1d takes x [B, L, C] and weight [C, 1, K]; got {list(x.shape)}, "
                         f"{list(weight.shape)}")
    state_type = TensorType((x.shape[0], weight.shape[2] - 1, x.shape[2]), "f32")
    if attrs["with_state"]:
        if not rest or rest[0].shape != state_type.shape:
            raise InferError(f"CausalConv1d with_state needs a state [B, K-1, C] = {list(state_type.shape)}")
        rest = rest[1:]
    if rest and rest[0].shape != x.shape[:2]:
        raise InferError(f"valid {list(rest[0].shape)} is not [B, L] = {list(x.shape[:2])}")
    return [x, state_type]


_GDR_ATTRS = {"scale": A("float"), "qk_l2norm": A("bool", True)}
define("top.GatedDeltaRule", (5, 6), results=2, attrs=_GDR_ATTRS, infer=_gated_delta_rule, traits=PLAIN,
       doc="(q, k, v, g, beta[, state]) -> (out [B, L, HV, DV], state [B, HV, DK, DV]): the recurrent form")
define("top.ChunkGatedDeltaRule", (5, 6), results=2, attrs={**_GDR_ATTRS, "chunk_size": A("int", 64)},
       infer=_gated_delta_rule, traits=PLAIN, doc="the gated delta rule computed chunk by chunk (prefill)")
# Operands: x, weight [C, 1, K] (PyTorch's depthwise layout), the state if with_state, then optionally valid [B, L]
# (a prefix of ones: the new state is the window at the last real token, so padding never enters it).
define("top.CausalConv1d", (2, 4), results=2,
       attrs={"with_state": A("bool", True), "act": A("str", "silu", ("silu", "none"))},
       infer=_causal_conv1d, traits=Traits(weights=(1,)),
       doc="depthwise causal conv over time carrying its last K-1 inputs: (y [B, L, C], state [B, K-1, C])")
define("top.Sigmoid", 1, infer=_same, traits=ELEMENTWISE)
define("top.Softplus", 1, infer=_same, traits=ELEMENTWISE, doc="log(1 + exp(x)); x above 20 (torch's threshold)")
define("top.Exp", 1, infer=_same, traits=ELEMENTWISE)
