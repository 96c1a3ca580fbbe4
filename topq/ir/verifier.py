"""Verify a module against the op catalogue: known ops, arity, attributes, shapes, SSA order."""

from __future__ import annotations

# Importing the Top dialect registers its ops; target dialects register theirs when their plugin loads.
import topq.ir.top_ops  # noqa: F401
from topq.ir.catalogue import CATALOGUE, REQUIRED, InferError, OpDef
from topq.ir.errors import TopqError
from topq.ir.graph import Block, Function, Module, Operation


class VerifyError(TopqError):
    pass


def _where(function: Function, op: Operation, index: int) -> str:
    loc = f' loc("{op.loc}")' if op.loc else ""
    return f"@{function.name}: op #{index} {op.name}{loc}"


def verify_op(op: Operation, opdef: OpDef) -> str | None:
    """The first problem with one op, or None."""
    low, high = opdef.operands
    n = len(op.operands)
    if n < low or (high is not None and n > high):
        want = str(low) if low == high else f"{low}..{high if high is not None else 'n'}"
        return f"expected {want} operands, got {n}"
    if opdef.results is not None and len(op.results) != opdef.results:
        return f"expected {opdef.results} results, got {len(op.results)}"
    if len(op.regions) != opdef.regions:
        return f"expected {opdef.regions} regions, got {len(op.regions)}"
    for key, value in op.attrs.items():
        spec = opdef.attrs.get(key)
        if spec is None:
            known = ", ".join(opdef.attrs) or "none"
            return f"unknown attribute {key!r} (known: {known})"
        problem = spec.check(value)
        if problem:
            return f"attribute {key!r}: {problem}"
    for key, spec in opdef.attrs.items():
        if spec.default is REQUIRED and key not in op.attrs:
            return f"missing attribute {key!r}"
    if opdef.infer is not None:
        try:
            inferred = opdef.infer([v.type for v in op.operands], opdef.with_defaults(op.attrs))
        except InferError as exc:
            return str(exc)
        if inferred is not None:
            declared = [r.type for r in op.results]
            if inferred != declared:
                got = ", ".join(map(str, declared))
                want = ", ".join(map(str, inferred))
                return f"result type ({got}) does not match the inferred ({want})"
    return None


def _verify_block(function: Function, block: Block, defined: set[int]) -> None:
    defined.update(id(a) for a in block.args)
    for index, op in enumerate(block.ops):
        opdef = CATALOGUE.get(op.name)
        if opdef is None:
            raise VerifyError(f"{_where(function, op, index)}: unknown op")
        for v in op.operands:
            if id(v) not in defined:
                raise VerifyError(f"{_where(function, op, index)}: operand used before it is defined")
        problem = verify_op(op, opdef)
        if problem:
            raise VerifyError(f"{_where(function, op, index)}: {problem}")
        for region in op.regions:
            for inner in region.blocks:
                _verify_block(function, inner, set(defined))
        defined.update(id(r) for r in op.results)


def verify_function(function: Function) -> None:
    defined: set[int] = set()
    _verify_block(function, function.body, defined)
    for r in function.results:
        if id(r) not in defined:
            raise VerifyError(f"@{function.name}: returns a value that is not defined in it")


def verify_module(module: Module) -> None:
    for function in module:
        verify_function(function)
