"""`top.DSLRegion`: a raw kernel embedded in a Top graph, and the host kernel that runs it.

    %y = "top.DSLRegion"(%out, %x) ({
    ^bb0(%arg2: tensor<1x64xf32>, %arg3: tensor<1x64xf32>):
      ... kernel IR (scf / memref / arith / math) ...
      "scf.yield"(%arg2) : (tensor<1x64xf32>) -> ()
    }) {arg_names = ["y", "x"], kernel = "my_kernels:silu", num_outputs = 1 : i64} : (...) -> tensor<1x64xf32>

Operands are the outputs (initial contents of the kernel's InOut buffers) followed by the inputs; the results
are typed like the outputs and are the buffers after the kernel ran (SSA sees the writes; the operands are not
modified). The region's block arguments are the operands *staged into on-chip memory*: a target lowers the op
by allocating a local buffer per operand and storing the operand into it before the body, then loading the
results from the output buffers and freeing them after it, and inlines the body in between.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from topq.core.errors import TopqError
from topq.ir.builder import Builder
from topq.ir.catalogue import CATALOGUE, NO_TRAITS, AttrSpec, InferError, op_def
from topq.ir.extension import IRExtension, install_extension
from topq.ir.graph import Operation, Region, Value
from topq.ir.rewrite import Pattern, Rewriter
from topq.ir.types import TensorType, Type
from topq.raw.annotations import ParamKind
from topq.raw.interpret import BlockExecutor
from topq.raw.kernel import Kernel

DSL_REGION = "top.DSLRegion"


def _infer(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    n = attrs["num_outputs"]
    if not 1 <= n <= len(types):
        raise InferError(f"num_outputs = {n} but the op has {len(types)} operands")
    if not all(isinstance(t, TensorType) for t in types):
        raise InferError("DSLRegion operands must be tensors")
    return list(types[:n])


#: Registered with the raw IR extension (`topq.raw.extension`). A kernel computes anything: no traits apply.
DSL_REGION_OP = op_def(
    DSL_REGION, (1, None), results=None, regions=1, infer=_infer,
    attrs={"num_outputs": AttrSpec("int"), "kernel": AttrSpec("str", ""), "arg_names": AttrSpec("list", None)},
    doc="a raw kernel: operands = outputs then inputs, results typed like the outputs, one region",
    traits=NO_TRAITS)


# -- building ---------------------------------------------------------------------------------------------------
def raw_call(b: Builder, kernel: Kernel, outputs: Sequence[Value], inputs: Sequence[Value],
             loc: str | None = None, **nums: int | float) -> Any:
    """Emit a `top.DSLRegion` running `kernel`; return its result (a tuple when there are several outputs).

    `outputs` are the initial contents of the kernel's InOut parameters (in order), `inputs` feed its Input
    parameters (in order), keywords give its Num parameters. Shapes must be static and match the annotations.
    """
    install_extension(REGION_IR)  # top.DSLRegion must be in the catalogue
    where = f"raw_call({kernel.ref})"
    if len(outputs) != len(kernel.inouts) or len(inputs) != len(kernel.inputs):
        raise TopqError(f"{where}: the kernel takes {len(kernel.inouts)} InOut and {len(kernel.inputs)} Input "
                        f"tensors, got {len(outputs)} outputs and {len(inputs)} inputs")
    params = [*kernel.inouts, *kernel.inputs]
    values = [*outputs, *inputs]
    types = {p.name: kernel.bind(p, v.type, where) for p, v in zip(params, values)}
    order = [p.name for p in params]
    body = kernel.lower(types, kernel.check_nums(nums, where), order)
    with b.at(body):
        b.create("scf.yield", body.args[:len(outputs)], result_types=[])
    attrs = {"kernel": kernel.ref, "num_outputs": len(outputs), "arg_names": order}
    op = b.create(DSL_REGION, values, attrs, [v.type for v in outputs], [Region([body])], loc=loc)
    return op.results[0] if len(op.results) == 1 else tuple(op.results)


# -- host execution ---------------------------------------------------------------------------------------------
class DSLRegionKernel:
    """The interpreter's region kernel for `top.DSLRegion` (installed with the raw IR extension). The interpreter
    calls `bind(op)` once per op when it plans a function, so the region's vectorisation analysis is done once,
    not per call."""

    def bind(self, op: Operation) -> Callable[[list[np.ndarray], dict[str, Any]], list[np.ndarray]]:
        body = op.regions[0].block
        names = list(op.attrs.get("arg_names") or [f"arg{i}" for i in range(len(body.args))])
        executor = BlockExecutor(body, op.attrs.get("kernel") or DSL_REGION, names)
        num_outputs = int(op.attrs["num_outputs"])
        dtypes = [a.type.np_dtype for a in body.args]

        def run(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
            buffers = [np.array(x, dtype=dt, copy=True) if i < num_outputs else np.asarray(x, dtype=dt)
                       for i, (x, dt) in enumerate(zip(inputs, dtypes))]
            return list(executor.run(buffers))

        return run



# -- replacing Top ops ------------------------------------------------------------------------------------------
def replacement_pattern(kernel: Kernel) -> Pattern:
    """A pattern replacing an op by a DSLRegion running `kernel`.

    The op's operands feed the kernel's Input parameters in order and its results are the InOut ones; each
    InOut buffer starts as a copy of the op's first operand of the same type (so the kernel must write every
    element it returns); Num parameters take the op's attributes of the same name (defaults included)."""

    def pattern(op: Operation, rewriter: Rewriter) -> bool:
        where = f"replacing {op.name}{f' at {op.loc}' if op.loc else ''} by {kernel.ref}"
        if len(op.operands) != len(kernel.inputs) or len(op.results) != len(kernel.inouts):
            raise TopqError(f"{where}: the op has {len(op.operands)} operands and {len(op.results)} results, the "
                            f"kernel {len(kernel.inputs)} Input and {len(kernel.inouts)} InOut parameters")
        outputs = []
        for p, result in zip(kernel.inouts, op.results):
            start = next((v for v in op.operands if v.type == result.type), None)
            if start is None:
                raise TopqError(f"{where}: no operand of type {result.type} to start InOut {p.name!r} from")
            outputs.append(start)
        opdef = CATALOGUE.get(op.name)
        attrs = opdef.with_defaults(op.attrs) if opdef else dict(op.attrs)
        nums = {p.name: attrs[p.name] for p in kernel.nums if p.name in attrs}
        try:
            results = raw_call(rewriter.builder, kernel, outputs, op.operands, loc=op.loc, **nums)
        except TopqError as exc:
            raise TopqError(f"{where}: {exc}") from None
        rewriter.replace(op, list(results) if isinstance(results, tuple) else [results])
        return True

    return pattern


def replacement_table(op_name: str, kernel: Kernel) -> dict[str, list[Pattern]]:
    """The pattern table replacing every `op_name` (in every stage function) by `kernel`."""
    if not any(p.kind is ParamKind.INOUT for p in kernel.params):
        raise TopqError(f"{kernel.ref} has no InOut parameter")
    return {op_name: [replacement_pattern(kernel)]}


#: `top.DSLRegion` and its host kernel as an IR extension of their own: `raw_call` installs it.
REGION_IR = IRExtension("raw-region", ops=(DSL_REGION_OP,), region_kernels={DSL_REGION: DSLRegionKernel()})
