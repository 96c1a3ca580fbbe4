"""Top IR → ONNX: one ONNX graph per stage function, op by op, with the same inputs, outputs and shapes.

Every `top.Weight` becomes an initializer whose data lives in the bundle (declared *external*: the graph
bytes carry only its name, type and shape; the executor hands ORT the bundle's memory-mapped tensor), so a
weight used by several functions (a layer's prefill, prefill_kv and decode variants) is stored once.
Linears whose weight the pipeline quantized become `com.microsoft.MatMulNBits` (packing.py); every other op
lowers to standard ONNX ops (opset `OPSET`), written in the patterns ORT's graph optimizer fuses
(e.g. RMSNorm as Pow → ReduceMean → Add → Sqrt → Div → Mul, which it turns into SimplifiedLayerNormalization).

Activations are float32 whatever the scheme's compute dtype: float weights are stored in that dtype and cast
to float32 in the graph (ORT folds the cast once, at session creation), so the numbers are the host target's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from topq.core.errors import TopqError
from topq.ir.graph import Function, Operation, Value
from topq.ir.types import TensorType

OPSET = 21  # Gelu (20) with its `approximate` attribute; ORT ≥ 1.20 runs it
MS_DOMAIN = "com.microsoft"
MS_OPSET = 1
IR_VERSION = 10  # the IR version of opset 21
#: where an external initializer says its data is: the bundle tensor of the same name (never a file)
EXTERNAL_LOCATION = "topq-bundle"

ONNX_TYPES: dict[str, int] = {
    "f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16, "f64": TensorProto.DOUBLE,
    "i64": TensorProto.INT64, "i32": TensorProto.INT32, "i16": TensorProto.INT16, "i8": TensorProto.INT8,
    "ui8": TensorProto.UINT8, "i1": TensorProto.BOOL,
}


def onnx_type(dtype: str) -> int:
    try:
        return ONNX_TYPES[dtype]
    except KeyError:
        raise TopqError(f"onnx target: element type {dtype} has no ONNX tensor type") from None


@dataclass(frozen=True)
class StoredTensor:
    """A bundle tensor a graph reads as an initializer."""

    name: str
    type: TensorType


@dataclass
class LinearLowering:
    """How a weight-quantized linear is lowered: `emit(graph, x, weight_name) -> y` adds its nodes."""

    tensors: list[StoredTensor]
    emit: Callable[[GraphBuilder, str, str], str]


@dataclass
class GraphBuilder:
    """Nodes, initializers and names of one ONNX graph under construction."""

    name: str
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    external: dict[str, StoredTensor] = field(default_factory=dict)
    constants: list[onnx.TensorProto] = field(default_factory=list)
    _count: int = 0
    _cache: dict[Any, str] = field(default_factory=dict)

    def fresh(self, hint: str = "t") -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def node(self, op_type: str, inputs: Sequence[str], outputs: int | Sequence[str] = 1, domain: str = "",
             **attrs: Any) -> list[str]:
        names = [self.fresh(op_type) for _ in range(outputs)] if isinstance(outputs, int) else list(outputs)
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=self.fresh(f"n_{op_type}"),
                                           domain=domain or None, **attrs))
        return names

    def one(self, op_type: str, inputs: Sequence[str], domain: str = "", **attrs: Any) -> str:
        return self.node(op_type, inputs, 1, domain, **attrs)[0]

    def constant(self, array: np.ndarray, hint: str = "c") -> str:
        """A small constant stored inside the graph (shapes, axes, scalars), shared within the graph."""
        key = ("const", array.dtype.str, array.shape, array.tobytes())
        if key not in self._cache:
            name = self.fresh(hint)
            self.constants.append(numpy_helper.from_array(array, name))
            self._cache[key] = name
        return self._cache[key]

    def ints(self, values: Sequence[int]) -> str:
        return self.constant(np.asarray(values, dtype=np.int64), "ints")

    def scalar(self, value: float) -> str:
        return self.constant(np.asarray(value, dtype=np.float32), "scalar")

    def stored(self, tensor: StoredTensor) -> str:
        """A bundle tensor as an initializer; float tensors not stored in float32 are cast to it (once)."""
        self.external.setdefault(tensor.name, tensor)
        if tensor.type.dtype not in ("bf16", "f16"):
            return tensor.name
        key = ("f32", tensor.name)
        if key not in self._cache:
            self._cache[key] = self.one("Cast", [tensor.name], to=TensorProto.FLOAT)
        return self._cache[key]

    def transposed(self, name: str) -> str:
        """[N, K] → [K, N] of a weight (ORT folds it once at session creation)."""
        key = ("T", name)
        if key not in self._cache:
            self._cache[key] = self.one("Transpose", [name], perm=[1, 0])
        return self._cache[key]


def external_initializer(tensor: StoredTensor) -> onnx.TensorProto:
    proto = onnx.TensorProto(name=tensor.name, data_type=onnx_type(tensor.type.dtype), dims=list(tensor.type.shape),
                             data_location=TensorProto.EXTERNAL)
    for key, value in (("location", EXTERNAL_LOCATION), ("length", str(tensor.type.nbytes))):
        entry = proto.external_data.add()
        entry.key, entry.value = key, value
    return proto


class FunctionLowering:
    """Lowers one Top function. `weights(name)` gives the stored tensor of a float weight; `linears(name)` the
    lowering of a weight-quantized linear (None: a float linear)."""

    def __init__(self, function: Function, weights: Callable[[str], StoredTensor],
                 linears: Callable[[str], LinearLowering | None], rules: Mapping[str, Rule] | None = None) -> None:
        self.function = function
        self.weights = weights
        self.linears = linears
        self.rules = {**RULES, **(rules or {})}  # e.g. the target's choice of attention op (gqa.py)
        self.graph = GraphBuilder(function.name)
        self.names: dict[int, str] = {}
        self.weight_of: dict[int, str] = {}  # value id → weight name, for values made by top.Weight
        self.float_uses = _float_uses(function)

    def name(self, value: Value) -> str:
        return self.names[id(value)]

    def run(self) -> onnx.ModelProto:
        f = self.function
        inputs = []
        for i, arg in enumerate(f.args):
            self.names[id(arg)] = f"arg{i}"
            inputs.append(value_info(f"arg{i}", arg.type))
        for op in f.ops:
            self.lower(op)
        outputs = []
        for i, result in enumerate(f.results):
            # Identity gives every output its own name (a function may return an input or one value twice).
            self.graph.node("Identity", [self.name(result)], [f"out{i}"])
            outputs.append(value_info(f"out{i}", result.type))
        g = self.graph
        graph = helper.make_graph(_live(g.nodes, [o.name for o in outputs]), f.name, inputs, outputs,
                                  initializer=g.constants + [external_initializer(t) for t in g.external.values()])
        model = helper.make_model(graph, producer_name="topq", ir_version=IR_VERSION,
                                  opset_imports=[helper.make_opsetid("", OPSET),
                                                 helper.make_opsetid(MS_DOMAIN, MS_OPSET)])
        return model

    def lower(self, op: Operation) -> None:
        rule = self.rules.get(op.name)
        if rule is None:
            raise TopqError(f"onnx target: @{self.function.name}: op {op.name} has no ONNX lowering "
                            f"(it lowers: {', '.join(sorted(self.rules))})")
        outputs = rule(self, op)
        for value, name in zip(op.results, outputs):
            self.names[id(value)] = name

    # -- helpers shared by the rules ---------------------------------------------------------------
    def operand(self, op: Operation, i: int) -> str:
        return self.name(op.operands[i])

    def linear(self, x: str, weight: Value) -> str:
        """x @ weightᵀ for a weight in Linear layout [N, K]."""
        wname = self.weight_of.get(id(weight))
        lowering = self.linears(wname) if wname is not None else None
        if wname is not None and lowering is not None:
            for tensor in lowering.tensors:
                self.graph.external.setdefault(tensor.name, tensor)
            return lowering.emit(self.graph, x, wname)
        return self.graph.one("MatMul", [x, self.graph.transposed(self.name(weight))])


def _live(nodes: list[onnx.NodeProto], outputs: Sequence[str]) -> list[onnx.NodeProto]:
    """The nodes the outputs depend on, in order (a rule may leave some unread: GroupQueryAttention reads the
    history and the new keys apart, not their Concat)."""
    needed, kept = set(outputs), []
    for node in reversed(nodes):
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(node.input)
    return kept[::-1]


def rank(value: Value) -> int:
    return len(value.shape)


def value_info(name: str, type_: Any) -> onnx.ValueInfoProto:
    if not isinstance(type_, TensorType):
        raise TopqError(f"onnx target: {name} has type {type_}, not a tensor")
    return helper.make_tensor_value_info(name, onnx_type(type_.dtype), list(type_.shape))


# ------------------------------------------------------------------------------------------------ rules

Rule = Callable[[FunctionLowering, Operation], list[str]]


def _input(lw: FunctionLowering, op: Operation) -> list[str]:
    return [lw.graph.one("Identity", [lw.operand(op, 0)])]


def _weight(lw: FunctionLowering, op: Operation) -> list[str]:
    name = op.attrs["name"]
    lw.weight_of[id(op.results[0])] = name
    if lw.linears(name) is not None and id(op.results[0]) not in lw.float_uses:
        return [f"{name}:matmulnbits"]  # only ever read through `linear`, which stores its packed tensors
    return [lw.graph.stored(lw.weights(name))]


def _float_uses(function: Function) -> set[int]:
    """Ids of the values read other than as a linear's right operand (e.g. a tied embedding's Gather)."""
    return {id(operand) for op in function.walk() for i, operand in enumerate(op.operands)
            if not _is_linear_operand(op, i)}


def _is_linear_operand(op: Operation, index: int) -> bool:
    return (op.name == "top.MatMul" and index == 1 and bool(op.attrs.get("right_transpose"))) or \
        (op.name == "top.MLP" and index >= 1)


def _gather(lw: FunctionLowering, op: Operation) -> list[str]:
    return [lw.graph.one("Gather", [lw.operand(op, 0), lw.operand(op, 1)], axis=int(op.attrs.get("axis", 0)))]


def _rmsnorm(lw: FunctionLowering, op: Operation) -> list[str]:
    g = lw.graph
    x = lw.operand(op, 0)
    mean_square = g.one("ReduceMean", [g.one("Pow", [x, g.scalar(2.0)]), g.ints([-1])], keepdims=1)
    y = g.one("Div", [x, g.one("Sqrt", [g.one("Add", [mean_square, g.scalar(float(op.attrs["eps"]))])])])
    return [g.one("Mul", [y, lw.operand(op, 1)]) if len(op.operands) > 1 else y]


def _layernorm(lw: FunctionLowering, op: Operation) -> list[str]:
    g = lw.graph
    width = op.operands[0].shape[-1]
    scale = lw.operand(op, 1) if len(op.operands) > 1 else g.constant(np.ones(width, np.float32), "ones")
    bias = lw.operand(op, 2) if len(op.operands) > 2 else g.constant(np.zeros(width, np.float32), "zeros")
    return [g.one("LayerNormalization", [lw.operand(op, 0), scale, bias], axis=-1, epsilon=float(op.attrs["eps"]))]


def _matmul(lw: FunctionLowering, op: Operation) -> list[str]:
    g = lw.graph
    a, b = op.operands[0], op.operands[1]
    if op.attrs.get("right_transpose") and rank(b) == 2:
        y = lw.linear(lw.name(a), b)
    else:
        right = lw.name(b)
        if op.attrs.get("right_transpose"):
            perm = list(range(rank(b)))
            perm[-1], perm[-2] = perm[-2], perm[-1]
            right = g.one("Transpose", [right], perm=perm)
        y = g.one("MatMul", [lw.name(a), right])
    if len(op.operands) > 2:
        y = g.one("Add", [y, lw.operand(op, 2)])
    return [y]


def _binary(onnx_op: str) -> Rule:
    def rule(lw: FunctionLowering, op: Operation) -> list[str]:
        return [lw.graph.one(onnx_op, [lw.operand(op, 0), lw.operand(op, 1)])]

    return rule


def _mulconst(lw: FunctionLowering, op: Operation) -> list[str]:
    return [lw.graph.one("Mul", [lw.operand(op, 0), lw.graph.scalar(float(op.attrs["const_val"]))])]


def _reshape(lw: FunctionLowering, op: Operation) -> list[str]:
    return [lw.graph.one("Reshape", [lw.operand(op, 0), lw.graph.ints(op.results[0].shape)])]


def _permute(lw: FunctionLowering, op: Operation) -> list[str]:
    return [lw.graph.one("Transpose", [lw.operand(op, 0)], perm=[int(i) for i in op.attrs["order"]])]


def _concat(lw: FunctionLowering, op: Operation) -> list[str]:
    return [lw.graph.one("Concat", [lw.name(v) for v in op.operands], axis=int(op.attrs["axis"]))]


def _slice(lw: FunctionLowering, op: Operation) -> list[str]:
    g = lw.graph
    axes = list(range(rank(op.operands[0])))
    return [g.one("Slice", [lw.operand(op, 0), g.ints(op.attrs["offset"]), g.ints(op.attrs["ends"]),
                            g.ints(axes), g.ints(op.attrs["steps"])])]


def _slice_last(g: GraphBuilder, x: str, start: int, end: int, step: int = 1) -> str:
    return g.one("Slice", [x, g.ints([start]), g.ints([end]), g.ints([-1]), g.ints([step])])


def _rope(lw: FunctionLowering, op: Operation) -> list[str]:
    """The reference kernel's formula with standard ops; cos/sin [B, L, R] apply to every head."""
    g = lw.graph
    x = lw.operand(op, 0)
    heads, d = op.operands[0].shape[2:]
    r = op.operands[1].shape[-1]
    cos = g.one("Unsqueeze", [lw.operand(op, 1), g.ints([2])])
    sin = g.one("Unsqueeze", [lw.operand(op, 2), g.ints([2])])
    rotary = x if r == d else _slice_last(g, x, 0, r)
    if op.attrs.get("mode", "contiguous_halves") == "contiguous_halves":
        half = r // 2
        x1, x2 = _slice_last(g, rotary, 0, half), _slice_last(g, rotary, half, r)
        # x*cos + rotate_half(x)*sin with rotate_half = (-x2, x1): a + (-b)*c equals a - b*c bit for bit
        rotated = g.one("Concat", [g.one("Neg", [x2]), x1], axis=-1)
        out = g.one("Add", [g.one("Mul", [rotary, cos]), g.one("Mul", [rotated, sin])])
    else:  # interleaved pairs: (x_even, x_odd) → (x_even·c − x_odd·s, x_odd·c + x_even·s)
        even, odd = _slice_last(g, rotary, 0, r, 2), _slice_last(g, rotary, 1, r, 2)
        cos_even, sin_even = _slice_last(g, cos, 0, r, 2), _slice_last(g, sin, 0, r, 2)
        cos_odd, sin_odd = _slice_last(g, cos, 1, r, 2), _slice_last(g, sin, 1, r, 2)
        new_even = g.one("Sub", [g.one("Mul", [even, cos_even]), g.one("Mul", [odd, sin_even])])
        new_odd = g.one("Add", [g.one("Mul", [odd, cos_odd]), g.one("Mul", [even, sin_odd])])
        pairs = g.one("Concat", [g.one("Unsqueeze", [new_even, g.ints([-1])]),
                                 g.one("Unsqueeze", [new_odd, g.ints([-1])])], axis=-1)
        out = g.one("Reshape", [pairs, g.ints([0, 0, heads, r])])  # 0: batch and length as they are
    if r < d:
        out = g.one("Concat", [out, _slice_last(g, x, r, d)], axis=-1)
    return [out]


def fattention_standard(lw: FunctionLowering, op: Operation) -> list[str]:
    """Scaled dot-product attention with GQA, the optional additive mask and the bottom-right causal rule,
    grouped like the reference kernel: the g query heads of one kv head share one batched matmul."""
    g = lw.graph
    b, lq, hq, d = op.operands[0].shape
    lk, hkv = op.operands[1].shape[1], int(op.attrs["kv_head"])
    group = hq // hkv
    q = g.one("Transpose", [lw.operand(op, 0)], perm=[0, 2, 1, 3])  # [B, Hq, Lq, D]
    q = g.one("Reshape", [q, g.ints([b, hkv, group * lq, d])])
    kt = g.one("Transpose", [lw.operand(op, 1)], perm=[0, 2, 3, 1])  # [B, Hkv, D, Lk]
    v = g.one("Transpose", [lw.operand(op, 2)], perm=[0, 2, 1, 3])  # [B, Hkv, Lk, D]
    scores = g.one("Mul", [g.one("MatMul", [q, kt]), g.scalar(float(op.attrs["scale"]))])
    scores = g.one("Reshape", [scores, g.ints([b, hq, lq, lk])])
    if op.attrs.get("softcap"):
        cap = g.scalar(float(op.attrs["softcap"]))
        scores = g.one("Mul", [g.one("Tanh", [g.one("Div", [scores, cap])]), cap])
    if len(op.operands) > 3:
        scores = g.one("Add", [scores, lw.operand(op, 3)])
    if op.attrs.get("causal", True) and lq > 1:
        # key j is hidden from query i when j > i + (Lk - Lq): a constant [Lq, Lk] of 0 / -inf
        i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
        causal = np.where(j > i + (lk - lq), np.float32(-np.inf), np.float32(0)).astype(np.float32)
        scores = g.one("Add", [scores, _causal_mask(g, causal)])
        if op.attrs.get("window"):
            scores = g.one("Add", [scores, _window_mask(g, lq, lk, int(op.attrs["window"]))])
    probs = g.one("Softmax", [scores], axis=-1)
    probs = g.one("Reshape", [probs, g.ints([b, hkv, group * lq, lk])])
    out = g.one("MatMul", [probs, v])  # [B, Hkv, g*Lq, D]
    out = g.one("Reshape", [out, g.ints([b, hq, lq, d])])
    out = g.one("Transpose", [out], perm=[0, 2, 1, 3])
    return [g.one("Reshape", [out, g.ints([b, lq, hq * d])])]


def _causal_mask(g: GraphBuilder, mask: np.ndarray) -> str:
    """The mask built in the graph (Trilu of a -inf constant), not stored: ORT folds it at session creation."""
    lq, lk = mask.shape
    key = ("causal", lq, lk)
    if key not in g._cache:
        full = g.one("ConstantOfShape", [g.ints([lq, lk])],
                     value=numpy_helper.from_array(np.asarray([-np.inf], np.float32)))
        g._cache[key] = g.one("Trilu", [full, g.constant(np.asarray(lk - lq + 1, np.int64), "k")], upper=1)
    return g._cache[key]


def _window_mask(g: GraphBuilder, lq: int, lk: int, window: int) -> str:
    """-inf where new key j is `window` or more positions behind query i (i - j ≥ window), 0 elsewhere and on
    the history columns (the runtime's mask windows those): [Lq, Lk], built in the graph like the causal mask."""
    key = ("window", lq, lk, window)
    if key not in g._cache:
        full = g.one("ConstantOfShape", [g.ints([lq, lq])],
                     value=numpy_helper.from_array(np.asarray([-np.inf], np.float32)))
        band = g.one("Trilu", [full, g.constant(np.asarray(-window, np.int64), "k")], upper=0)
        if lk > lq:
            history = g.one("ConstantOfShape", [g.ints([lq, lk - lq])],
                            value=numpy_helper.from_array(np.asarray([0.0], np.float32)))
            band = g.one("Concat", [history, band], axis=1)
        g._cache[key] = band
    return g._cache[key]


def _activation(g: GraphBuilder, x: str, act: str) -> str:
    if act == "silu":
        return g.one("Mul", [x, g.one("Sigmoid", [x])])
    if act in ("gelu", "gelu_tanh"):
        return g.one("Gelu", [x], approximate="tanh" if act == "gelu_tanh" else "none")
    raise TopqError(f"onnx target: no lowering for activation {act!r}")


def _mlp(lw: FunctionLowering, op: Operation) -> list[str]:
    g = lw.graph
    x = lw.operand(op, 0)
    gate = _activation(g, lw.linear(x, op.operands[1]), str(op.attrs.get("act", "silu")))
    hidden = g.one("Mul", [gate, lw.linear(x, op.operands[2])])
    return [lw.linear(hidden, op.operands[3])]


def _silu(lw: FunctionLowering, op: Operation) -> list[str]:
    return [_activation(lw.graph, lw.operand(op, 0), "silu")]


def _tanh(lw: FunctionLowering, op: Operation) -> list[str]:
    return [lw.graph.one("Tanh", [lw.operand(op, 0)])]


def _gelu(lw: FunctionLowering, op: Operation) -> list[str]:
    approximate = str(op.attrs.get("approximate", "none"))
    return [_activation(lw.graph, lw.operand(op, 0), "gelu_tanh" if approximate == "tanh" else "gelu")]


def _softmax(lw: FunctionLowering, op: Operation) -> list[str]:
    return [lw.graph.one("Softmax", [lw.operand(op, 0)], axis=int(op.attrs.get("axis", -1)))]


def _topk(lw: FunctionLowering, op: Operation) -> list[str]:
    g = lw.graph
    values, indices = g.node("TopK", [lw.operand(op, 0), g.ints([int(op.attrs["k"])])], 2,
                             axis=int(op.attrs.get("axis", -1)), largest=int(bool(op.attrs.get("largest", True))),
                             sorted=1)
    return [values, g.one("Cast", [indices], to=TensorProto.INT32)]


RULES: dict[str, Rule] = {
    "top.Input": _input,
    "top.Weight": _weight,
    "top.Gather": _gather,
    "top.RMSNorm": _rmsnorm,
    "top.LayerNorm": _layernorm,
    "top.MatMul": _matmul,
    "top.Add": _binary("Add"),
    "top.Mul": _binary("Mul"),
    "top.MulConst": _mulconst,
    "top.Reshape": _reshape,
    "top.Permute": _permute,
    "top.Concat": _concat,
    "top.Slice": _slice,
    "top.Rope": _rope,
    "top.FAttention": fattention_standard,
    "top.MLP": _mlp,
    "top.SiLU": _silu,
    "top.Tanh": _tanh,
    "top.GELU": _gelu,
    "top.Softmax": _softmax,
    "top.TopK": _topk,
}


def check_model(model: onnx.ModelProto) -> None:
    """onnx.checker (with shape inference) on the graph. The checker would look for external data in files, so
    it sees a copy whose external initializers are graph inputs of the same type."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    external = [t for t in graph.initializer if t.data_location == TensorProto.EXTERNAL]
    for tensor in external:
        graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        graph.initializer.remove(tensor)
    try:
        onnx.checker.check_model(copy, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise TopqError(f"onnx target: graph {graph.name} is not valid ONNX: {str(exc).splitlines()[0]}") from None
