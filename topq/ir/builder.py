"""Build IR top-down: an insertion context plus one call per op.

    b = Builder()
    with b.function("block_0", tensor(1, L, H), tensor(1, L, dtype="i32")) as f:
        hidden, positions = f.args
        w = b.weight("model.norm.weight", tensor(H))
        y = b.top.RMSNorm(hidden, w, eps=1e-5)
        f.returns(y)

Result types come from the catalogue's shape inference unless given (`result_types=`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import topq.ir.top_ops  # noqa: F401  (registers the Top dialect)
from topq.ir.catalogue import lookup_op
from topq.ir.errors import TopqError
from topq.ir.graph import Block, Function, Module, Operation, Region, Value
from topq.ir.types import Type


class _Dialect:
    """`b.top.MatMul(a, w, right_transpose=True)` → `b.op("top.MatMul", a, w, right_transpose=True)`."""

    def __init__(self, builder: Builder, prefix: str) -> None:
        self._builder, self._prefix = builder, prefix

    def __getattr__(self, name: str) -> Any:
        full = f"{self._prefix}.{name}"
        return lambda *operands, **kw: self._builder.op(full, *operands, **kw)


class FunctionScope:
    def __init__(self, function: Function) -> None:
        self.function = function

    @property
    def args(self) -> list[Value]:
        return self.function.args

    def returns(self, *values: Value) -> None:
        self.function.results = list(values)


class Builder:
    def __init__(self, module: Module | None = None) -> None:
        self.module = module if module is not None else Module()
        self.block: Block | None = None
        self.loc_prefix = ""

    def __getattr__(self, dialect: str) -> _Dialect:
        if dialect.startswith("_"):
            raise AttributeError(dialect)
        return _Dialect(self, dialect)

    @contextmanager
    def function(self, name: str, *arg_types: Type, attrs: dict[str, Any] | None = None) -> Iterator[FunctionScope]:
        function = Function(name, attrs=dict(attrs or {}))
        for t in arg_types:
            function.body.add_arg(t)
        with self.at(function.body):
            yield FunctionScope(function)
        self.module.add(function)

    @contextmanager
    def at(self, block: Block) -> Iterator[Block]:
        saved, self.block = self.block, block
        try:
            yield block
        finally:
            self.block = saved

    @contextmanager
    def scope(self, prefix: str) -> Iterator[None]:
        """Prefix the `loc` of ops built inside (e.g. "layers.3.")."""
        saved, self.loc_prefix = self.loc_prefix, self.loc_prefix + prefix
        try:
            yield
        finally:
            self.loc_prefix = saved

    def create(
        self,
        name: str,
        operands: Sequence[Value],
        attrs: dict[str, Any] | None = None,
        result_types: Sequence[Type] | None = None,
        regions: list[Region] | None = None,
        loc: str | None = None,
    ) -> Operation:
        if self.block is None:
            raise TopqError("builder has no insertion block: use `with builder.function(...)`")
        attrs = {k: v for k, v in (attrs or {}).items() if v is not None}
        if result_types is None:
            opdef = lookup_op(name)
            inferred = opdef.infer([v.type for v in operands], opdef.with_defaults(attrs)) if opdef.infer else None
            if inferred is None:
                raise TopqError(f"{name} needs explicit result_types")
            result_types = inferred
        op = Operation(name, list(operands), list(result_types), attrs, regions,
                       self.loc_prefix + loc if loc is not None else None)
        self.block.ops.append(op)
        return op

    def op(self, op_name: str, /, *operands: Value, result_types: Sequence[Type] | None = None,
           loc: str | None = None, **attrs: Any) -> Any:
        """Create an op; return its single result, or the tuple of results."""
        op = self.create(op_name, operands, attrs, result_types, loc=loc)
        return op.results[0] if len(op.results) == 1 else tuple(op.results)

    def weight(self, name: str, type: Type) -> Value:
        return self.op("top.Weight", result_types=[type], name=name)
