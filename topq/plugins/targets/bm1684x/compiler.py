"""Compile a Top program for one chip of the family: lower → layer groups → DDR plan → program text + tensors."""

from __future__ import annotations

from collections import Counter
from typing import Any

from topq.core.errors import TopqError
from topq.core.target import CompiledModel, CompileJob
from topq.ir.parser import parse_module
from topq.ir.printer import print_module
from topq.ir.verifier import verify_module
from topq.plugins.targets.bm1684x.layer_group import assign_groups
from topq.plugins.targets.bm1684x.lowering import Lowering
from topq.plugins.targets.bm1684x.memory import plan_memory
from topq.plugins.targets.bm1684x.modes import mode_of, refuses
from topq.plugins.targets.bm1684x.spec import ChipSpec

#: bumped when the program's conventions change; an emulator refuses other versions
PROGRAM_VERSION = 1


def compile_model(job: CompileJob, chip: ChipSpec) -> CompiledModel:
    assert job.product is not None  # CompileJob fills it in
    problem = refuses(job.product)
    if problem is not None:
        raise TopqError(f"target {chip.name} cannot run {problem}")
    mode = mode_of(job.scheme.name, job.product)
    # A private copy: the pipeline keeps using its Top module (dumps, summaries).
    module = parse_module(print_module(job.module), source="top program")
    lowering = Lowering(job, mode)
    lowering.run(module)
    reports = {f.name: assign_groups(f, chip).to_dict() for f in module}
    types = lowering.tensor_types(module)
    plan = plan_memory(module, types, chip)
    module.attrs["bm.mode"] = mode.name
    verify_module(module)  # the lowered ops with every attribute the passes added
    metadata: dict[str, Any] = {
        "chip": chip.name,
        "mode": mode.name,
        "dtype": mode.dtype,
        "program_version": PROGRAM_VERSION,
        "memory": plan.summary(),
        "layer_groups": reports,
        "op_counts": dict(Counter(op.name for f in module for op in f.ops if op.name != "tpu.Weight")),
    }
    return CompiledModel(program=print_module(module), manifest=types, produce=lowering.tensors, metadata=metadata,
                         source_of=lambda name: lowering.sources[name].source)
