"""One decoder graph with dynamic batch and sequence lengths, composed from an onnx bundle's stage functions.

onnxruntime-genai runs a single `model.onnx`: `input_ids`, `attention_mask`, `position_ids` and
`past_key_values.<i>.key/value` [batch, kv_heads, past, head_dim] in; `logits` [batch, sequence, vocab] and
`present.<i>.key/value` [batch, kv_heads, past + sequence, head_dim] out. The bundle's Top program already has
every piece: `embedding`, each layer's `block_kv_<i>` (prefill continuing from a KV history: with an empty
history it is the plain prefill, with one token it is a decode step) and `lm_head`. They are lowered again by the
onnx target's rules into one graph; only the rules that bake a length into a constant are replaced here by
shape-agnostic ones (Reshape keeps batch and sequence with 0, Slice cuts only the axes it really cuts, attention
builds its causal mask from the runtime lengths). Linears are the bundle's own MatMulNBits tensors and attributes,
float weights its float tensors (bf16 / f16 widened to float32, exactly), so the decoder multiplies by the same
values as the bundle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.ir.graph import Function, Operation
from topq.ir.parser import parse_module
from topq.ir.types import TensorType
from topq.plugins.targets.onnx.lowering import (
    IR_VERSION,
    MS_DOMAIN,
    MS_OPSET,
    OPSET,
    FunctionLowering,
    GraphBuilder,
    LinearLowering,
    StoredTensor,
    external_initializer,
)

PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"
#: numpy dtype name → the IR dtype of an initializer as the decoder stores it (float tables widened to float32)
STORED_DTYPES = {"float32": "f32", "bfloat16": "f32", "float16": "f32", "uint8": "ui8", "int64": "i64",
                 "int32": "i32"}


class DynamicLowering(FunctionLowering):
    """Lowers one stage function's body into a shared graph, its arguments bound to existing values."""

    def __init__(self, function: Function, graph: GraphBuilder, weights: Any, linears: Any) -> None:
        super().__init__(function, weights, linears)
        self.graph = graph

    def inline(self, inputs: list[str]) -> list[str]:
        for arg, name in zip(self.function.args, inputs, strict=True):
            self.names[id(arg)] = name
        for op in self.function.ops:
            self.lower(op)
        return [self.name(result) for result in self.function.results]

    def lower(self, op: Operation) -> None:
        rule = DYNAMIC_RULES.get(op.name)
        if rule is None:
            super().lower(op)
            return
        for value, name in zip(op.results, rule(self, op)):
            self.names[id(value)] = name


def _reshape(lw: FunctionLowering, op: Operation) -> list[str]:
    src, dst = op.operands[0].shape, op.results[0].shape
    if list(src[:2]) != list(dst[:2]):
        raise TopqError(f"onnx-genai: @{lw.function.name}: a reshape {list(src)} -> {list(dst)} changes the batch "
                        f"or sequence axis, which a decoder with dynamic lengths cannot express")
    return [lw.graph.one("Reshape", [lw.operand(op, 0), lw.graph.ints([0, 0, *dst[2:]])])]


def _slice(lw: FunctionLowering, op: Operation) -> list[str]:
    g = lw.graph
    shape = op.operands[0].shape
    offset, ends, steps = op.attrs["offset"], op.attrs["ends"], op.attrs["steps"]
    axes = [a for a in range(len(shape)) if (offset[a], ends[a], steps[a]) != (0, shape[a], 1)]
    if any(a < 2 for a in axes):
        raise TopqError(f"onnx-genai: @{lw.function.name}: a slice along the batch or sequence axis cannot be "
                        f"exported with dynamic lengths")
    if not axes:
        return [g.one("Identity", [lw.operand(op, 0)])]
    return [g.one("Slice", [lw.operand(op, 0), g.ints([offset[a] for a in axes]), g.ints([ends[a] for a in axes]),
                            g.ints(axes), g.ints([steps[a] for a in axes])])]


def _fattention(lw: FunctionLowering, op: Operation) -> list[str]:
    """The onnx target's attention (GQA grouped per kv head, additive mask, bottom-right causal rule) with every
    length taken from the tensors at run time."""
    g = lw.graph
    hq, d = op.operands[0].shape[2:]
    hkv = int(op.attrs["kv_head"])
    q = g.one("Reshape", [g.one("Transpose", [lw.operand(op, 0)], perm=[0, 2, 1, 3]), g.ints([0, hkv, -1, d])])
    kt = g.one("Transpose", [lw.operand(op, 1)], perm=[0, 2, 3, 1])  # [B, Hkv, D, Lk]
    v = g.one("Transpose", [lw.operand(op, 2)], perm=[0, 2, 1, 3])  # [B, Hkv, Lk, D]
    scores = g.one("Mul", [g.one("MatMul", [q, kt]), g.scalar(float(op.attrs["scale"]))])
    scores = g.one("Reshape", [scores, g.ints([0, hq, -1, 0])])  # [B, Hq, Lq, Lk]
    if len(op.operands) > 3:
        scores = g.one("Add", [scores, lw.operand(op, 3)])
    if op.attrs.get("causal", True):
        scores = g.one("Add", [scores, _causal_mask(g, scores)])
    probs = g.one("Reshape", [g.one("Softmax", [scores], axis=-1), g.ints([0, hkv, -1, 0])])
    out = g.one("Reshape", [g.one("MatMul", [probs, v]), g.ints([0, hq, -1, d])])  # [B, Hq, Lq, D]
    out = g.one("Transpose", [out], perm=[0, 2, 1, 3])
    return [g.one("Reshape", [out, g.ints([0, 0, hq * d])])]


def _causal_mask(g: GraphBuilder, scores: str) -> str:
    """[Lq, Lk]: -inf where key j > query i + (Lk - Lq), else 0; built once per graph (every layer has the same
    lengths)."""
    key = ("dynamic causal",)
    if key not in g._cache:
        shape = g.one("Shape", [scores])
        lq = g.one("Gather", [shape, g.constant(np.asarray(2, np.int64), "axis")], axis=0)
        lk = g.one("Gather", [shape, g.constant(np.asarray(3, np.int64), "axis")], axis=0)
        zero, one = g.constant(np.asarray(0, np.int64), "zero"), g.constant(np.asarray(1, np.int64), "one")
        rows = g.one("Unsqueeze", [g.one("Range", [zero, lq, one]), g.ints([1])])
        cols = g.one("Unsqueeze", [g.one("Range", [zero, lk, one]), g.ints([0])])
        hidden = g.one("Greater", [cols, g.one("Add", [rows, g.one("Sub", [lk, lq])])])
        g._cache[key] = g.one("Where", [hidden, g.scalar(float("-inf")), g.scalar(0.0)])
    return g._cache[key]


DYNAMIC_RULES = {"top.Reshape": _reshape, "top.Slice": _slice, "top.FAttention": _fattention}


def stored_type(array: np.ndarray) -> TensorType:
    try:
        return TensorType(tuple(array.shape), STORED_DTYPES[array.dtype.name])
    except KeyError:
        raise TopqError(f"onnx-genai: bundle tensor of type {array.dtype} cannot be exported") from None


def matmulnbits_nodes(bundle: Bundle, functions: Mapping[str, Any]) -> dict[str, onnx.NodeProto]:
    """The bundle's MatMulNBits nodes by their weight (`<w>.qweight` input), from its compiled graphs."""
    nodes: dict[str, onnx.NodeProto] = {}
    for entry in functions.values():
        for node in onnx.load_from_string(bytes(bundle.tensor(entry["graph"]))).graph.node:
            if node.op_type == "MatMulNBits":
                nodes[node.input[1].removesuffix(".qweight")] = node
    return nodes


def build_decoder(bundle: Bundle) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The decoder graph (its bundle initializers declared external) and those initializers' values by name."""
    meta = bundle.meta.get("target_meta") or {}
    module = {f.name: f for f in parse_module(bundle.program, source=f"{bundle.path}:program")}
    spec = bundle.meta["spec"]
    layers = int(spec["num_layers"])
    wanted = ["embedding", *(f"block_kv_{i}" for i in range(layers)), "lm_head"]
    missing = [name for name in wanted if name not in module]
    if missing:
        raise TopqError(f"{bundle.path}: the decoder is composed of @embedding, @block_kv_<i> and @lm_head; "
                        f"missing: {', '.join('@' + m for m in missing)} (convert with stages.prefill_kv: true)")
    nbits = matmulnbits_nodes(bundle, meta.get("functions", {}))
    names = set(bundle.tensor_names())
    values: dict[str, np.ndarray] = {}

    def store(name: str) -> StoredTensor:
        array = np.asarray(bundle.tensor(name))
        if array.dtype.name in ("bfloat16", "float16"):
            array = array.astype(np.float32)
        values[name] = array
        return StoredTensor(name, stored_type(array))

    def linear(name: str) -> LinearLowering | None:
        node = nbits.get(name)
        if node is None:
            return None
        perm = f"{name}.perm" if f"{name}.perm" in names else None
        tensors = [store(t) for t in [*node.input[1:], *([perm] if perm else [])]]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

        def emit(g: GraphBuilder, x: str, weight: str) -> str:
            if perm is not None:
                x = g.one("Gather", [x, perm], axis=-1)
            return g.one("MatMulNBits", [x, *node.input[1:]], domain=MS_DOMAIN, **attrs)

        return LinearLowering(tensors, emit)

    g = GraphBuilder("decoder")
    hkv, head = int(spec["num_kv_heads"]), _head_dim(module["block_kv_0"])
    float_ = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            ["batch_size", "total_sequence_length"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", float_, ["batch_size", "sequence_length",
                                                               int(spec["vocab_size"])])]
    # attention_mask (1 = attend) as the additive [B, 1, 1, T] mask the block functions take
    padding = g.one("Equal", ["attention_mask", g.constant(np.asarray(0, np.int64), "zero")])
    mask = g.one("Unsqueeze", [g.one("Where", [padding, g.scalar(float("-inf")), g.scalar(0.0)]), g.ints([1, 2])])

    def inline(function: str, args: list[str]) -> list[str]:
        return DynamicLowering(module[function], g, store, linear).inline(args)

    (hidden,) = inline("embedding", ["input_ids"])
    for i in range(layers):
        history = []
        for past, present in ((PAST_KEY % i, PRESENT_KEY % i), (PAST_VALUE % i, PRESENT_VALUE % i)):
            inputs.append(helper.make_tensor_value_info(past, float_, ["batch_size", hkv, "past_sequence_length",
                                                                       head]))
            outputs.append(helper.make_tensor_value_info(present, float_, ["batch_size", hkv,
                                                                           "total_sequence_length", head]))
            history.append(g.one("Transpose", [past], perm=[0, 2, 1, 3]))  # [B, P, Hkv, D] as topq's cache
        hidden, k_new, v_new = inline(f"block_kv_{i}", [hidden, "position_ids", mask, *history])
        for old, new, present in ((history[0], k_new, PRESENT_KEY % i), (history[1], v_new, PRESENT_VALUE % i)):
            g.node("Transpose", [g.one("Concat", [old, new], axis=1)], [present], perm=[0, 2, 1, 3])
    (logits,) = inline("lm_head", [hidden])
    g.node("Identity", [logits], ["logits"])
    # the initializers as the onnx target declares them (external, data elsewhere) until the exporter writes them
    graph = helper.make_graph(g.nodes, "topq_decoder", inputs, outputs,
                              initializer=g.constants + [external_initializer(t) for t in g.external.values()])
    model = helper.make_model(graph, producer_name="topq", ir_version=IR_VERSION,
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, MS_OPSET)])
    return model, {name: values[name] for name in g.external}


def _head_dim(block: Function) -> int:
    """Head size from the KV history argument [B, L, Hkv, D] of a block_kv function."""
    return int(block.args[-1].shape[-1])
