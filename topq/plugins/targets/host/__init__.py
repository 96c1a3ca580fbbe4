"""The host target: the reference interpreter in float32. It is the golden reference for other targets.

Weights are stored as float32 after the scheme's rounding (bf16/f16 storage, or dequantized integer
weights), so a host bundle shows the numerical effect of a scheme without a chip's arithmetic. Integers taken
from a pre-quantized checkpoint (`auto`) are dequantized exactly, as the checkpoint's own arithmetic does.
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
    # A scheme that takes the checkpoint's own integers (`auto`: GPTQ / AWQ / AutoRound / compressed-tensors, GGUF
    # Q4_0 / Q8_0) is dequantized as the checkpoint's arithmetic defines it: its stored (f16) scales, a float32
    # result, no rounding to the compute dtype. Float weights still take the compute dtype's rounding.
    exact = job.scheme.stored is not None

    def produce(wanted):  # type: ignore[no-untyped-def]
        for name in wanted:
            quantized = job.quantized(name)
            if quantized is not None and exact:
                yield name, quantized.dequantize()
                continue
            array = quantized.dequantize() if quantized is not None else job.weights(name)
            yield name, round_to_dtype(array, compute_dtype)

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
