"""The `tpu` dialect of the BM1684X family, declared as data (names as in TPU-MLIR where one exists).

Every compute op carries `dtype`: the storage dtype of its result and of its float weights, and the operand dtype
of its MACs (f32 accumulation is implied). The passes add `group` (layer-group id), `tiling` ([seq, channel]
slices of an op that does not fit local memory alone) and `addr` / `addrs` (DDR byte addresses of the results; a
result without one lives in local memory inside its layer group).

Ops with a different shape from their Top counterpart:

* `tpu.A16MatMul(x, weight, scale[, zp][, bias])`: weight-only quantized linear. weight `[N, K*bits/8]` ui8 (W4:
  the even-k code in the low nibble; signed codes when `symmetric`), scale `[N, K/group_size]` in `dtype`, zp
  `[N, K/group_size]` ui8 only when asymmetric. `tpu.A16MLP` is the fused gated MLP with three such weights.
* `tpu.MatMulInt8(x, codes, w_scale[, bias])`: W8A8 linear. codes `[N, K]` i8, w_scale `[N]` in `dtype`; x is
  quantized to int8 in the kernel (static `act_scale`, or `dynamic`: per-row absmax / 127, the row-absmax reduction
  runs on the chip), the int32 accumulator is dequantized by the f32 per-channel scale act_scale · w_scale[n].
  Static with `out_scale > 0` (the requantizing form): `tpu.MatMulInt8(x, codes, multiplier, rshift[, bias_q])`,
  multiplier `[N]` i32 and rshift `[N]` i8 computed at compile time (r[n] = act_scale · w_scale[n] / out_scale ≈
  multiplier[n] · 2^-rshift[n]), bias_q `[N]` i32 in the accumulator domain; the int32 accumulator is requantized
  to int8 codes (`topq/core/int8_math.py` `requantize`) and the result is code · out_scale.
* `tpu.MoE(x, router, expert weights…[, shared weights…, shared_expert_gate])`: top.MoE with each linear weight
  as its float tensor (`weight_bits` 0) or its packed parts (weight, scale[, zp], as `tpu.A16MatMul`), in the
  order gate, up, down per expert, then the shared expert's; the router and the shared expert's gate stay float.
  It routes in f32 and runs each expert on its own tokens only (only the chosen experts' weights are read). The
  RMSNorm feeding it writes f32 (`out_dtype`), so which experts a token gets does not depend on rounding x to
  dtype (a near-tie would otherwise flip a whole expert); the experts read x rounded to dtype.
* `tpu.FAttention(q, k, v[, mask][, history_k, history_v])`: with `history = S > 0` the keys are the S history rows
  followed by the new k; the history operands are the layer's KV-cache region itself (no concat copy).
* `tpu.KVStore(x, positions)`: writes the new k or v rows into the layer's KV-cache region at row positions[0, 0]
  (rows past the region's `rows` are dropped). No result: it is a side effect on the persistent cache.
* `tpu.CausalConv1d`, `tpu.GatedDeltaRule`, `tpu.ChunkGatedDeltaRule` with `layer` and `state = k`: result 1 is
  the layer's carried state k, written in place over the layer's fixed f32 state region k, which is also where the
  op's state operand (an argument of prefill_kv / decode) is read from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import topq.ir.top_ops as top
from topq.ir.catalogue import AttrSpec, InferError, InferFn, define
from topq.ir.types import TensorType, Type
from topq.plugins.targets.bm1684x.modes import FLOAT_DTYPES

A = AttrSpec

#: attributes the passes add to any op
PASS_ATTRS: dict[str, AttrSpec] = {
    "group": A("int", None),
    "tiling": A("ints", None),
    "addr": A("int", None),
    "addrs": A("ints", None),
}
DTYPE = A("str", choices=FLOAT_DTYPES)
OUT_DTYPE = A("str", None, FLOAT_DTYPES)
QUANT = {"weight_bits": A("int", choices=(4, 8)), "group_size": A("int"), "symmetric": A("bool", False)}


def _typed(infer: InferFn) -> InferFn:
    """Top's shape inference with float results in the op's (out_)dtype."""

    def typed(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
        out = infer(types, attrs) or []
        dtype = attrs.get("out_dtype") or attrs["dtype"]
        return [t.with_dtype(dtype) if isinstance(t, TensorType) and t.dtype in FLOAT_DTYPES else t for t in out]

    return typed


def _tensors(types: Sequence[Type]) -> list[TensorType]:
    if not all(isinstance(t, TensorType) for t in types):
        raise InferError("expected tensor operands")
    return list(types)  # type: ignore[arg-type]


def _check_quant_weight(w: TensorType, scale: TensorType, zp: TensorType | None, attrs: dict[str, Any],
                        k: int | None = None) -> tuple[int, int]:
    """(N, K) of a packed weight, checking scale / zp shapes."""
    bits, group = attrs["weight_bits"], attrs["group_size"]
    if w.rank != 2 or w.dtype not in ("ui8", "i8"):
        raise InferError(f"packed weight must be 2-D ui8/i8, got {w}")
    n, k_w = w.shape[0], w.shape[1] * 8 // bits
    if k is not None and k != k_w:
        raise InferError(f"packed weight holds K = {k_w}, the input has {k}")
    if group <= 0 or k_w % group:
        raise InferError(f"group_size {group} does not divide K = {k_w}")
    if scale.shape != (n, k_w // group):
        raise InferError(f"scale {list(scale.shape)} does not match [{n}, {k_w // group}]")
    if (zp is None) != bool(attrs.get("symmetric", False)):
        raise InferError("asymmetric weights need a zero-point operand, symmetric ones none")
    if zp is not None and (zp.shape != scale.shape or zp.dtype != "ui8"):
        raise InferError(f"zero points must be ui8 {list(scale.shape)}, got {zp}")
    return n, k_w


def _a16matmul(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, w, scale, *rest = _tensors(types)
    symmetric = attrs.get("symmetric", False)
    zp = None if symmetric else (rest.pop(0) if rest else None)
    n, _ = _check_quant_weight(w, scale, zp, attrs, x.shape[-1])
    if bool(rest) != attrs.get("has_bias", False):
        raise InferError("bias operand and has_bias disagree")
    if rest and rest[0].shape != (n,):
        raise InferError(f"bias {list(rest[0].shape)} does not match N = {n}")
    return [x.with_shape(x.shape[:-1] + (n,)).with_dtype(attrs.get("out_dtype") or attrs["dtype"])]


def _matmul_int8(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, w, *rest = _tensors(types)
    if w.rank != 2 or w.dtype != "i8":
        raise InferError(f"MatMulInt8 wants i8 codes [N, K], got {w}")
    n = w.shape[:1]
    if not attrs["out_scale"] >= 0:
        raise InferError(f"MatMulInt8 out_scale must be >= 0 (0: float dequantization), got {attrs['out_scale']}")
    if not attrs["dynamic"] and attrs["out_scale"] > 0:  # requantizing form: multiplier, rshift[, bias_q]
        if not 2 <= len(rest) <= 3 or not attrs["act_scale"] > 0:
            raise InferError("static MatMulInt8 with out_scale takes x, codes, multiplier, rshift[, bias_q] and "
                             f"act_scale > 0; got {len(types)} operands, act_scale {attrs['act_scale']}")
        want = ("i32", "i8", "i32")
        for what, t, dtype in zip(("multiplier", "rshift", "bias_q"), rest, want):
            if t.shape != n or t.dtype != dtype:
                raise InferError(f"MatMulInt8: {what} must be {dtype} {list(n)}, got {t}")
    else:
        if len(rest) > 2:
            raise InferError(f"MatMulInt8 (float dequantization) takes x, codes, w_scale[, bias]; got {len(types)}")
        if not rest or rest[0].shape != n or rest[0].dtype not in FLOAT_DTYPES:
            raise InferError(f"MatMulInt8 wants a float scale {list(n)}, got {rest[0] if rest else 'none'}")
        if len(rest) == 2 and rest[1].shape != n:
            raise InferError(f"MatMulInt8: bias {list(rest[1].shape)} does not fit codes {list(w.shape)}")
    if x.shape[-1] != w.shape[1]:
        raise InferError(f"MatMulInt8: input {list(x.shape)} does not fit codes {list(w.shape)}")
    return [x.with_shape(x.shape[:-1] + w.shape[:1]).with_dtype(attrs.get("out_dtype") or attrs["dtype"])]


def _a16mlp(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, *rest = _tensors(types)
    per = 2 if attrs.get("symmetric", False) else 3
    if len(rest) != 3 * per:
        raise InferError(f"A16MLP takes x and 3 weights of {per} tensors each, got {len(types)} operands")
    weights = [rest[i * per:(i + 1) * per] for i in range(3)]
    dims = [_check_quant_weight(w[0], w[1], w[2] if per == 3 else None, attrs) for w in weights]
    (ng, kg), (nu, ku), (nd, kd) = dims
    h = x.shape[-1]
    if (kg, ku, nd) != (h, h, h) or ng != nu or kd != ng:
        raise InferError(f"A16MLP weights {dims} do not fit hidden {h}")
    return [x.with_dtype(attrs["dtype"])]


def moe_parts(attrs: dict[str, Any]) -> int:
    """Operands per linear weight of a tpu.MoE: 1 float tensor, or the packed weight, scale (and zero point)."""
    if not attrs.get("weight_bits"):
        return 1
    return 2 if attrs.get("symmetric", False) else 3


def _moe(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, router, *rest = _tensors(types)
    experts, per, shared = attrs["num_experts"], moe_parts(attrs), attrs.get("shared", False)
    want = 2 + 3 * per * (experts + shared) + shared
    if len(types) != want:
        raise InferError(f"MoE with {experts} experts, {per} tensors per weight, shared={shared} takes {want} "
                         f"operands, got {len(types)}")
    if router.shape != (experts, x.shape[-1]):
        raise InferError(f"MoE router {list(router.shape)} does not fit {experts} experts of hidden {x.shape[-1]}")
    if per > 1:
        for i in range(0, 3 * per * (experts + shared), per):
            part = rest[i:i + per]
            _check_quant_weight(part[0], part[1], part[2] if per == 3 else None, attrs)
    return [x.with_dtype(attrs["dtype"])]


def _fattention(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    q, k, _, *rest = _tensors(types)
    history = attrs.get("history", 0)
    mask = rest[0] if attrs.get("has_mask", False) and rest else None
    want = (1 if attrs.get("has_mask", False) else 0) + (2 if history else 0)
    if len(rest) != want:
        raise InferError(f"FAttention expects {3 + want} operands for has_mask/history, got {len(types)}")
    if history:
        hk, hv = rest[-2:]
        expected = (k.shape[0], history, k.shape[2], k.shape[3])
        if hk.shape != expected or hv.shape != expected:
            raise InferError(f"history k/v must be {list(expected)}, got {list(hk.shape)} and {list(hv.shape)}")
    total = k.with_shape((k.shape[0], history + k.shape[1]) + k.shape[2:])  # the keys the op attends to
    operands = [q, total, total] + ([mask] if mask is not None else [])
    return _typed(top._fattention)(operands, attrs)


def _kvstore(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, positions = _tensors(types)
    if x.rank != 4 or positions.shape != x.shape[:2] or positions.dtype != "i32":
        raise InferError(f"KVStore takes x [1, L, KVH, D] and positions [1, L] i32, got {x} and {positions}")
    if x.dtype != attrs["dtype"]:
        raise InferError(f"KVStore of {x.dtype} values into a {attrs['dtype']} cache")
    return []


def _cast(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    return [_tensors(types)[0].with_dtype(attrs["dtype"])]


def _tpu(name: str, operands: int | tuple[int, int | None], infer: Callable[..., list[Type]] | None,
         attrs: dict[str, AttrSpec] | None = None, results: int | None = 1, dtype: bool = True, doc: str = "") -> None:
    spec = dict(attrs or {})
    if dtype:
        spec["dtype"] = DTYPE
    define(f"tpu.{name}", operands, results, {**spec, **PASS_ATTRS}, infer, doc=doc)


_tpu("Weight", 0, None, {"name": A("str")}, dtype=False,
     doc="a tensor of the bundle, at `addr` in the coefficient region")
_tpu("Gather", 2, _typed(top._gather), {"axis": A("int", 0)})
_tpu("RMSNorm", (1, 2), _typed(top._norm), {"eps": A("float", 1e-6), "out_dtype": OUT_DTYPE},
     doc="f32 statistics; out_dtype f32 when it feeds a tpu.MoE (routing on the unrounded values)")
_tpu("LayerNorm", (1, 3), _typed(top._norm), {"eps": A("float", 1e-5)}, doc="f32 statistics")
_tpu("MatMul", (2, 3), _typed(top._matmul), {"right_transpose": A("bool", False), "out_dtype": OUT_DTYPE})
_tpu("MatMulInt8", (3, 5), _matmul_int8, {"act_scale": A("float", 0.0), "dynamic": A("bool", False),
                                          "out_scale": A("float", 0.0), "out_dtype": OUT_DTYPE},
     doc="W8A8: x → int8 (static act_scale or per-row absmax/127), int8×int8 → int32, × f32 per-channel scale; "
         "static with out_scale > 0: requantized by i32 multiplier and i8 rshift to int8 codes, × out_scale")
_tpu("A16MatMul", (3, 5), _a16matmul, {**QUANT, "has_bias": A("bool", False), "out_dtype": OUT_DTYPE})
_tpu("MLP", 4, _typed(top._mlp), {"act": A("str", "silu", ("silu", "gelu", "gelu_tanh"))},
     doc="gate/up/down matmuls; gate, up, act and act*up rounded to dtype; the activation in f32")
_tpu("A16MLP", (7, 10), _a16mlp, {**QUANT, "act": A("str", "silu", ("silu", "gelu", "gelu_tanh"))})
_tpu("MoE", (5, None), _moe, {
    "num_experts": A("int"), "top_k": A("int"), "scoring": A("str", "softmax", ("softmax", "sigmoid")),
    "norm_topk_prob": A("bool", False), "act": A("str", "silu", ("silu", "gelu", "gelu_tanh")),
    "shared": A("bool", False), "weight_bits": A("int", 0, (0, 4, 8)), "group_size": A("int", 0),
    "symmetric": A("bool", False)},
    doc="routing in f32; each chosen expert's MLP (rounded as tpu.MLP) on its tokens, weighted and summed in f32")
_tpu("Add", 2, _typed(top._elementwise))
_tpu("Mul", 2, _typed(top._elementwise))
_tpu("MulConst", 1, _typed(top._same), {"const_val": A("float")})
_tpu("SiLU", 1, _typed(top._same), doc="evaluated in f32")
_tpu("Tanh", 1, _typed(top._same), doc="evaluated in f32")
_tpu("GELU", 1, _typed(top._same), {"approximate": A("str", "none", ("none", "tanh"))})
_tpu("Softmax", 1, _typed(top._same), {"axis": A("int", -1)}, doc="f32 exp and sum")
_tpu("Cast", 1, _cast)
_tpu("Reshape", 1, top._reshape, {"shape": A("ints")}, dtype=False, doc="a view: shares its operand's memory")
_tpu("Permute", 1, top._permute, {"order": A("ints")}, dtype=False)
_tpu("Slice", 1, top._slice, {"offset": A("ints"), "ends": A("ints"), "steps": A("ints")}, dtype=False)
_tpu("Concat", (1, None), top._concat, {"axis": A("int")}, dtype=False)
_tpu("Rope", 3, _typed(top._rope), {"mode": A("str", "contiguous_halves", ("contiguous_halves", "interleaved_pairs"))})
_tpu("FAttention", (3, 6), _fattention,
     {"q_head": A("int"), "kv_head": A("int"), "scale": A("float"), "causal": A("bool", True),
      "has_mask": A("bool", False), "history": A("int", 0), "softcap": A("float", None),
      "window": A("int", None)},
     doc="f32 scores and softmax; probabilities rounded to dtype before the PV matmul")
_tpu("TopK", 1, _typed(top._topk), {"k": A("int"), "axis": A("int", -1), "largest": A("bool", True)}, results=2)
_tpu("Sigmoid", 1, _typed(top._same), doc="evaluated in f32")
_tpu("Softplus", 1, _typed(top._same), doc="evaluated in f32")
_tpu("Exp", 1, _typed(top._same), doc="evaluated in f32")


def _with_f32_state(infer: InferFn) -> InferFn:
    """A linear-attention op: its output in `dtype`, its carried state (result 1) in f32."""

    def typed(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
        out, state = infer(types, attrs) or []
        assert isinstance(out, TensorType) and isinstance(state, TensorType)
        return [out.with_dtype(attrs["dtype"]), state.with_dtype("f32")]

    return typed


#: a recurrent op whose new state (result 1) is a carried state: its layer's state region and slot (lowering.py
#: `bind_states`); the op then reads its state operand from that region and writes the new state over it
STATE_REGION = {"layer": A("int", None), "state": A("int", None)}
_tpu("CausalConv1d", (2, 4), _with_f32_state(top._causal_conv1d),
     {"with_state": A("bool", True), "act": A("str", "silu", ("silu", "none")), **STATE_REGION},
     results=2, doc="depthwise causal conv in f32 over the f32 state window and dtype inputs; state out f32")
_tpu("GatedDeltaRule", (5, 6), _with_f32_state(top._gated_delta_rule), {**top._GDR_ATTRS, **STATE_REGION},
     results=2, doc="recurrent gated delta rule: dtype q/k/v/g/beta, f32 state read and written, f32 arithmetic")
_tpu("ChunkGatedDeltaRule", (5, 6), _with_f32_state(top._gated_delta_rule),
     {**top._GDR_ATTRS, "chunk_size": A("int", 64), **STATE_REGION}, results=2,
     doc="chunked form of tpu.GatedDeltaRule")
_tpu("KVStore", 2, _kvstore, {"layer": A("int"), "kind": A("str", choices=("k", "v")), "rows": A("int")}, results=0)


# -- raw kernels (raw.py) ----------------------------------------------------------------------------------------
# A `top.DSLRegion` lowers to `tpu.DSLRegion` (same operands and region, results in the storage dtype); the staging
# pass brackets it with LocalAlloc + LocalStore (DDR → local) and LocalLoad + LocalFree (local → DDR), then the
# inline pass splices the kernel body between them, so the final program holds only the staging ops and kernel IR.


def _dsl_region(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    n = attrs["num_outputs"]
    if not 1 <= n <= len(types) or not all(isinstance(t, TensorType) for t in types):
        raise InferError(f"tpu.DSLRegion takes tensor operands, outputs first (num_outputs = {n})")
    return list(types[:n])


def _local_store(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    x, buf = _tensors(types)
    if x.shape != buf.shape:
        raise InferError(f"LocalStore of {x} into a {buf} buffer")
    return []


def _local_load(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    (buf,) = _tensors(types)
    return [buf.with_dtype(attrs["dtype"]) if buf.dtype in FLOAT_DTYPES else buf]  # floats leave in storage dtype


define("tpu.DSLRegion", (1, None), None,
       {"num_outputs": A("int"), "kernel": A("str", ""), "arg_names": A("list", None), "dtype": DTYPE},
       _dsl_region, regions=1, doc="a raw kernel between lowering and inlining (operands: outputs then inputs)")
_tpu("LocalAlloc", 0, None, {"name": A("str", ""), "kernel": A("str", ""), "offset": A("int", None)}, dtype=False,
     doc="a local-memory buffer for one staged operand; `offset` in bytes into local memory (layer_group.py)")
_tpu("LocalStore", 2, _local_store, results=0, dtype=False, doc="DDR tensor → local buffer (converted to its dtype)")
_tpu("LocalLoad", 1, _local_load, doc="local buffer → a tensor in `dtype` (rounded)")
_tpu("LocalFree", 1, None, results=0, dtype=False, doc="end of a local buffer's life")
