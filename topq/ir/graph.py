"""Top IR data structures: values, operations, blocks, regions, functions and modules.

The IR is SSA, printed in MLIR's generic form (see `printer.py` / `parser.py`). It is deliberately
small: no use lists (rewrites rebuild op lists), one block per region, and `func.func` bodies whose
`return` is kept as the function's `results` rather than as an op.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from topq.ir.errors import TopqError
from topq.ir.types import TensorType, Type

#: Attribute values are plain Python data: bool, int, float, str, list, dict, or a Type.
Attr = Any


class Value:
    """An SSA value: a block argument (`owner` is the Block) or an op result (`owner` is the Operation)."""

    __slots__ = ("type", "owner", "index")

    def __init__(self, type: Type, owner: Operation | Block | None, index: int) -> None:
        self.type = type
        self.owner = owner
        self.index = index

    @property
    def shape(self) -> tuple[int, ...]:
        assert isinstance(self.type, TensorType), f"{self.type} has no shape"
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype if isinstance(self.type, TensorType) else self.type.name

    def __repr__(self) -> str:
        return f"<Value {self.type}>"


class Operation:
    """One op: a name such as `top.MatMul`, operands, typed results, attributes, optional regions."""

    __slots__ = ("name", "operands", "results", "attrs", "regions", "loc")

    def __init__(
        self,
        name: str,
        operands: list[Value],
        result_types: list[Type],
        attrs: dict[str, Attr] | None = None,
        regions: list[Region] | None = None,
        loc: str | None = None,
    ) -> None:
        self.name = name
        self.operands = list(operands)
        self.results = [Value(t, self, i) for i, t in enumerate(result_types)]
        self.attrs = dict(attrs) if attrs else {}
        self.regions = regions or []
        self.loc = loc

    @property
    def result(self) -> Value:
        if len(self.results) != 1:
            raise TopqError(f"{self.name} has {len(self.results)} results, not one")
        return self.results[0]

    def __repr__(self) -> str:
        return f"<Operation {self.name} {self.loc or ''}>"


@dataclass
class Block:
    args: list[Value] = field(default_factory=list)
    ops: list[Operation] = field(default_factory=list)

    def add_arg(self, type: Type) -> Value:
        value = Value(type, self, len(self.args))
        self.args.append(value)
        return value


@dataclass
class Region:
    blocks: list[Block] = field(default_factory=lambda: [Block()])

    @property
    def block(self) -> Block:
        return self.blocks[0]


@dataclass
class Function:
    """`func.func @name(args) -> (result types)`: the body block's args are the function's inputs."""

    name: str
    body: Block = field(default_factory=Block)
    results: list[Value] = field(default_factory=list)
    attrs: dict[str, Attr] = field(default_factory=dict)

    @property
    def args(self) -> list[Value]:
        return self.body.args

    @property
    def ops(self) -> list[Operation]:
        return self.body.ops

    @property
    def input_types(self) -> list[Type]:
        return [a.type for a in self.body.args]

    @property
    def result_types(self) -> list[Type]:
        return [r.type for r in self.results]

    def walk(self) -> Iterator[Operation]:
        """Every op, nested regions included, in program order."""
        yield from walk_ops(self.body.ops)


def walk_ops(ops: list[Operation]) -> Iterator[Operation]:
    for op in ops:
        yield op
        for region in op.regions:
            for block in region.blocks:
                yield from walk_ops(block.ops)


@dataclass
class Module:
    functions: dict[str, Function] = field(default_factory=dict)
    attrs: dict[str, Attr] = field(default_factory=dict)

    def add(self, function: Function) -> Function:
        if function.name in self.functions:
            raise TopqError(f"function @{function.name} is defined twice")
        self.functions[function.name] = function
        return function

    def __getitem__(self, name: str) -> Function:
        try:
            return self.functions[name]
        except KeyError:
            raise TopqError(f"no function @{name}; functions: {', '.join(self.functions)}") from None

    def __iter__(self) -> Iterator[Function]:
        return iter(self.functions.values())

    def num_ops(self) -> int:
        return sum(1 for f in self for _ in f.walk())
