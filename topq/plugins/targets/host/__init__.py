"""The host target: the reference interpreter in float32. It is the golden reference for other targets.

Weights are stored as float32 after the scheme's rounding: float weights rounded to the compute dtype (bf16/f16
storage), quantized weights as exactly `QuantizedWeight.dequantize()` — the scheme's integers times its scales,
which are already in the compute dtype. Rounding that product to bf16/f16 again is how a chip materializes the
weight (the bm1684x emulator does it), not part of the scheme, so a host bundle shows the numerical effect of a
scheme without a chip's arithmetic, and agrees with runtimes that dequantize in float32 (ONNX Runtime's
MatMulNBits).

A linear on int8 activations (`top.A8MatMul`) is lowered to `top.MatMulInt8` on its weight's codes (`<w>.qweight`,
integers in float32) and per-channel scales (`<w>.wscale`), the scheme's `QuantizedWeight`: the host computes it
with the exact integer arithmetic a chip uses (`topq.ir.int8.matmul_int8`), not on dequantized weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

import topq
from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.core.target import CompiledModel, CompileJob, Target, runs_everything
from topq.ir.analysis import users, weight_name
from topq.ir.graph import Module, Operation
from topq.ir.interpreter import Interpreter
from topq.ir.parser import parse_module
from topq.ir.printer import print_module
from topq.ir.rewrite import Rewriter, apply_patterns
from topq.ir.types import TensorType, round_to_dtype


def weight_names(module) -> list[str]:  # type: ignore[no-untyped-def]
    names: dict[str, None] = {}
    for function in module:
        for op in function.walk():
            if op.name == "top.Weight":
                names[op.attrs["name"]] = None
    return list(names)


def lower_int8_linears(module: Module, job: CompileJob) -> dict[str, tuple[str, int | None]]:
    """`top.A8MatMul(x, w)` → `top.MatMulInt8(x, <w>.qweight, <w>.wscale)`, in place; the weights it orphans are
    dropped. Returns {tensor: (weight, column)}: the codes (None) or the scale column (0) of `job.quantized(weight)`."""
    derived: dict[str, tuple[str, int | None]] = {}

    def lower(op: Operation, rw: Rewriter) -> bool:
        x, w, *bias = op.operands
        name = weight_name(w)
        q = job.quant_spec(name) if name is not None else None
        if name is None or q is None or q.bits != 8 or not q.symmetric or q.group_size != q.shape[1]:
            raise TopqError(f"{op.loc or 'top.A8MatMul'}: its weight must be quantized per channel to symmetric "
                            f"int8 by the scheme (got {q})")
        n, k = q.shape
        codes = rw.builder.op("top.Weight", result_types=[TensorType((n, k), "f32")], name=f"{name}.qweight")
        scale = rw.builder.op("top.Weight", result_types=[TensorType((n,), "f32")], name=f"{name}.wscale")
        rw.replace(op, [rw.builder.op("top.MatMulInt8", x, codes, scale, *bias, loc=op.loc, **op.attrs)])
        derived[f"{name}.qweight"], derived[f"{name}.wscale"] = (name, None), (name, 0)
        return True

    apply_patterns(module, {"top.A8MatMul": [lower]})
    lowered = {name for name, _ in derived.values()}
    for function in module:
        read = users(function)
        function.body.ops = [op for op in function.ops if not (
            op.name == "top.Weight" and op.attrs["name"] in lowered and not read.get(id(op.results[0])))]
    return derived


def compile_host(job: CompileJob) -> CompiledModel:
    module, derived = job.module, {}
    if any(op.name == "top.A8MatMul" for f in module for op in f.walk()):
        module = parse_module(print_module(module), source="top program")  # the pipeline keeps its Top module
        derived = lower_int8_linears(module, job)
    names = weight_names(module)
    types = {op.attrs["name"]: op.results[0].type for f in module for op in f.walk() if op.name == "top.Weight"}

    assert job.product is not None  # CompileJob fills it in
    compute_dtype = job.product.compute_dtype
    # Every quantized weight (a scheme's own, or the integers and stored (f16) scales of a pre-quantized checkpoint
    # under `auto`) is `dequantize()` in float32, as the checkpoint's own arithmetic defines it; float weights take
    # the compute dtype's rounding.

    def produce(wanted: Iterable[str]) -> Iterator[tuple[str, np.ndarray]]:
        for name in wanted:
            if name in derived:  # a W8A8 linear's codes or scales
                source, column = derived[name]
                q = job.quantized(source)
                assert q is not None
                yield name, (q.codes if column is None else q.scales[:, column]).astype(np.float32)
                continue
            quantized = job.quantized(name)
            if quantized is not None:
                yield name, quantized.dequantize()
            else:
                yield name, round_to_dtype(job.weights(name), compute_dtype)

    return CompiledModel(program=print_module(module), manifest={n: types[n] for n in names}, produce=produce)


#: ops that compute each position (row) alone and hold no shape of their own: a function of only these runs on any
#: number of positions
POSITION_WISE = frozenset({"top.Weight", "top.RMSNorm", "top.LayerNorm", "top.MatMul", "top.MatMulInt8", "top.Add",
                           "top.Mul", "top.MulConst", "top.Tanh"})


class HostExecutor(Interpreter):
    def __init__(self, bundle: Bundle) -> None:
        module = parse_module(bundle.program, source=f"{bundle.path}:program")
        super().__init__(module, lambda name: np.asarray(bundle.tensor(name), dtype=np.float32))
        #: the runtime's batched logits (`Executor` doc): lm_head on [1, T, H] when it is position-wise
        head = module.functions.get("lm_head")
        self.lm_head_rows = head is not None and all(op.name in POSITION_WISE for op in head.walk())
        self.any_positions = frozenset({"lm_head"} if self.lm_head_rows else ())


TARGET = Target(
    name="host",
    description="reference interpreter, float32 numpy (golden reference)",
    compile=compile_host,
    open=HostExecutor,
    refuses=runs_everything,  # stores any scheme's values: dequantized, in float32
)


@topq.hookimpl
def register_targets(register: Register[Target]) -> None:
    register(TARGET)
