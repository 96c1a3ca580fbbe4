"""The host target: the reference interpreter in float32. It is the golden reference for other targets.

Weights are stored as float32 after the scheme's rounding: float weights rounded to the compute dtype (bf16/f16
storage), quantized weights as exactly `QuantizedWeight.dequantize()` — the scheme's integers times its scales,
which are already in the compute dtype. Rounding that product to bf16/f16 again is how a chip materializes the
weight (the bm1684x emulator does it), not part of the scheme, so a host bundle shows the numerical effect of a
scheme without a chip's arithmetic, and agrees with runtimes that dequantize in float32 (ONNX Runtime's
MatMulNBits).
"""

from __future__ import annotations

import numpy as np

import topq
from topq.core.bundle import Bundle
from topq.core.hookspecs import Register
from topq.core.target import CompiledModel, CompileJob, Target, runs_everything
from topq.ir.interpreter import Interpreter
from topq.ir.parser import parse_module
from topq.ir.printer import print_module
from topq.ir.types import round_to_dtype


def weight_names(module) -> list[str]:  # type: ignore[no-untyped-def]
    names: dict[str, None] = {}
    for function in module:
        for op in function.walk():
            if op.name == "top.Weight":
                names[op.attrs["name"]] = None
    return list(names)


def compile_host(job: CompileJob) -> CompiledModel:
    names = weight_names(job.module)
    types = {op.attrs["name"]: op.results[0].type for f in job.module for op in f.walk() if op.name == "top.Weight"}

    assert job.product is not None  # CompileJob fills it in
    compute_dtype = job.product.compute_dtype
    # Every quantized weight (a scheme's own, or the integers and stored (f16) scales of a pre-quantized checkpoint
    # under `auto`) is `dequantize()` in float32, as the checkpoint's own arithmetic defines it; float weights take
    # the compute dtype's rounding.

    def produce(wanted):  # type: ignore[no-untyped-def]
        for name in wanted:
            quantized = job.quantized(name)
            if quantized is not None:
                yield name, quantized.dequantize()
            else:
                yield name, round_to_dtype(job.weights(name), compute_dtype)

    return CompiledModel(program=print_module(job.module), manifest={n: types[n] for n in names}, produce=produce)


class HostExecutor(Interpreter):
    def __init__(self, bundle: Bundle) -> None:
        module = parse_module(bundle.program, source=f"{bundle.path}:program")
        super().__init__(module, lambda name: np.asarray(bundle.tensor(name), dtype=np.float32))


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
