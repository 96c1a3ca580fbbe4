"""The host target: the reference interpreter in float32. It is the golden reference for other targets.

Weights are stored as float32 after the scheme's rounding (bf16/f16 storage, or dequantized integer
weights), so a host bundle shows the numerical effect of a scheme without a chip's arithmetic.
"""

from __future__ import annotations

import numpy as np

import topq
import topq.raw  # noqa: F401  (registers top.DSLRegion and its host kernel: bundles may contain raw kernels)
from topq.core.bundle import Bundle
from topq.core.hookspecs import Register
from topq.core.target import CompiledModel, CompileJob, Target
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

    def produce(wanted):  # type: ignore[no-untyped-def]
        for name in wanted:
            quantized = job.quantized(name)
            array = quantized.dequantize() if quantized is not None else job.weights(name)
            yield name, round_to_dtype(array, job.scheme.compute_dtype)

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
)


@topq.hookimpl
def register_targets(register: Register[Target]) -> None:
    register(TARGET)
