"""Compile a Top program for ONNX Runtime: one serialized ONNX graph per stage function, plus its initializers.

The bundle holds each graph's ModelProto bytes as a uint8 tensor (`onnx.<function>`, or
`layers.<i>.onnx.<function>` so a layer's graphs build in that layer's unit) and every initializer once, under
the Top weight's name (float weights) or `<weight>.<part>` (MatMulNBits tensors, packing.py). All are
checksummed like any bundle tensor; nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from topq.core.errors import TopqError
from topq.core.quant import QuantizedWeight
from topq.core.target import CompiledModel, CompileJob
from topq.ir.graph import Function
from topq.ir.printer import print_module
from topq.ir.types import TensorType
from topq.plugins.targets.onnx import gqa, packing
from topq.plugins.targets.onnx.conventions import ATTENTION_GQA, DEFAULT_ATTENTION, PROGRAM_VERSION
from topq.plugins.targets.onnx.lowering import (
    ONNX_TYPES,
    OPSET,
    FunctionLowering,
    LinearLowering,
    Rule,
    StoredTensor,
    check_model,
)

FLOAT_DTYPES = ("f32", "bf16", "f16")


def graph_tensor_name(function: Function) -> str:
    layer = function.attrs.get("layer")
    return f"onnx.{function.name}" if layer is None else f"layers.{layer}.onnx.{function.name}"


def attention_rules(job: CompileJob, mode: str) -> dict[str, Rule]:
    """The `top.FAttention` rule of `target.attention`; `gqa` refuses, before any work, an attention it cannot
    express (naming the function and why)."""
    if mode == ATTENTION_GQA:
        for function in job.module:
            for op in function.walk():
                if op.name == "top.FAttention" and (why := gqa.unfit(op)) is not None:
                    raise TopqError(f"target.attention = gqa: @{function.name} has {why}; "
                                    f"use target.attention: auto or standard")
    return {"top.FAttention": gqa.rule(mode)}


def compile_onnx(job: CompileJob, accuracy_level: int, attention: str = DEFAULT_ATTENTION) -> CompiledModel:
    dtype = job.product.compute_dtype
    if dtype not in FLOAT_DTYPES:
        raise TopqError(f"onnx target: compute dtype {dtype} is not one of {', '.join(FLOAT_DTYPES)}")
    if any(op.name == "top.A8MatMul" for f in job.module for op in f.walk()):
        raise TopqError("onnx target cannot run W8A8 (top.A8MatMul) linears yet; "
                        "use a weight-only scheme (w8/w4, gptq, awq, autoround) or a float one")
    weight_types = {op.attrs["name"]: op.results[0].type for f in job.module for op in f.walk()
                    if op.name == "top.Weight" and isinstance(op.results[0].type, TensorType)}
    # Every quantized linear's layout is checked before any graph is built or any value computed.
    specs = {name: spec for name in sorted(job.linear_weights) if (spec := job.quant_spec(name)) is not None}
    for name, spec in specs.items():
        packing.check_spec(spec, name)
    rules = attention_rules(job, attention)

    def stored(name: str) -> StoredTensor:
        # A quantized weight that is also read as a float table (a tied embedding under a quantized lm_head) is
        # stored as its exact dequantized values, like the MatMulNBits beside it sees them.
        return StoredTensor(name, weight_types[name].with_dtype("f32" if name in specs else dtype))

    def linear(name: str) -> LinearLowering | None:
        spec = specs.get(name)
        return packing.lowering(name, spec, accuracy_level) if spec is not None else None

    manifest: dict[str, TensorType] = {}
    sources: dict[str, str | None] = {}
    graphs: dict[str, bytes] = {}
    functions: dict[str, dict[str, Any]] = {}
    gqa_nodes = 0
    for function in job.module:
        model = FunctionLowering(function, stored, linear, rules).run()
        check_model(model)
        gqa_nodes += sum(node.op_type == "GroupQueryAttention" for node in model.graph.node)
        external = [t for t in model.graph.initializer if t.external_data]
        for tensor in external:
            base = packing.weight_of(tensor.name) if tensor.name not in weight_types else tensor.name
            if tensor.name not in manifest:
                manifest[tensor.name] = TensorType(tuple(tensor.dims), _ir_dtype(tensor.data_type))
                sources[tensor.name] = base
        graph_name = graph_tensor_name(function)
        graphs[graph_name] = model.SerializeToString(deterministic=True)
        functions[function.name] = {"graph": graph_name, "initializers": [t.name for t in external]}
    for graph_name, data in graphs.items():
        manifest[graph_name] = TensorType((len(data),), "ui8")
        sources[graph_name] = None

    weight_in = job.weight_in
    assert weight_in is not None  # CompileJob fills it in __post_init__

    def produce(names: Sequence[str]) -> Iterator[tuple[str, np.ndarray]]:
        packed: tuple[str, dict[str, np.ndarray]] | None = None  # the last weight packed (its parts are adjacent)
        for name in names:
            if name in graphs:
                yield name, np.frombuffer(graphs[name], dtype=np.uint8)
            elif name in weight_types and name not in specs:
                yield name, weight_in(name, dtype)
            elif name in weight_types:  # the float table of a quantized weight (see `stored`)
                yield name, _quantized(job, name).dequantize()
            else:
                base = packing.weight_of(name)
                if packed is None or packed[0] != base:
                    q = _quantized(job, base)
                    if q.spec != specs[base]:  # the manifest was laid out from the spec
                        raise TopqError(f"{base}: the scheme's values ({q.spec}) do not match the layout it "
                                        f"announced ({specs[base]})")
                    packed = (base, packing.pack(q, base))
                yield name, packed[1][name]

    metadata = {
        "program_version": PROGRAM_VERSION,
        "opset": OPSET,
        "dtype": dtype,
        "accuracy_level": accuracy_level,
        "attention": attention,
        "gqa_nodes": gqa_nodes,
        "functions": functions,
        "matmul_nbits": len(specs),
    }
    return CompiledModel(program=print_module(job.module), manifest=manifest, produce=produce, metadata=metadata,
                         source_of=lambda name: sources.get(name))


def _quantized(job: CompileJob, name: str) -> QuantizedWeight:
    q = job.quantized(name)
    if q is None:
        raise TopqError(f"onnx target: {name} has a quantized layout but the scheme returned no values for it")
    return q


def _ir_dtype(onnx_dtype: int) -> str:
    for name, code in ONNX_TYPES.items():
        if code == onnx_dtype:
            return name
    raise TopqError(f"onnx target: ONNX tensor type {onnx_dtype} has no bundle dtype")
