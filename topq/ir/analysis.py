"""Match helpers for analyses and rewrites, driven by op traits (`catalogue.Traits`), so producer chains are
not matched by hand.

    weight_name(op.operands[1])        # the top.Weight name feeding a value (optionally through views)
    users(function)[id(value)]         # the ops reading a value (None: a function result)
    linear_uses(function)              # every linear of a function: op, weight name, role, input
    linear_weight_names(module)        # the weights weight quantization applies to
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from topq.ir.catalogue import Linear, declared_linears, traits_of
from topq.ir.graph import Function, Module, Operation, Value

#: value id → the ops reading it, in op order; None stands for "returned by the function"
Users = dict[int, list[Operation | None]]


def producer(value: Value) -> Operation | None:
    """The op defining `value` (None for a block argument)."""
    owner = value.owner
    return owner if isinstance(owner, Operation) else None


def weight_name(value: Value, through_views: bool = False) -> str | None:
    """The name of the named weight (an op with the `named_weight` trait) that `value` is, else None.

    With `through_views`, single-operand views (reshape, permute, slice: the `view` trait) in between are
    looked through, e.g. a weight reshaped to heads."""
    op = producer(value)
    while through_views and op is not None and traits_of(op.name).view and len(op.operands) == 1:
        op = producer(op.operands[0])
    if op is not None and traits_of(op.name).named_weight:
        return str(op.attrs["name"])
    return None


def users(function: Function) -> Users:
    """Who reads each value of the function's top-level ops (`None`: a function result)."""
    table: Users = {}
    for op in function.ops:
        for v in op.operands:
            table.setdefault(id(v), []).append(op)
    for v in function.results:
        table.setdefault(id(v), []).append(None)
    return table


@dataclass(frozen=True)
class LinearUse:
    """One linear of a function: `op` computes x Wᵀ with W = the named weight `weight` (see `catalogue.Linear`)."""

    op: Operation
    linear: Linear
    weight: str

    @property
    def input(self) -> Value | None:
        """x, or None when the op computes it internally (top.MLP's down projection)."""
        return None if self.linear.input is None else self.op.operands[self.linear.input]

    @property
    def role(self) -> str:
        return self.linear.role

    @property
    def hf_layout(self) -> bool:
        """W is stored [N, K] (`right_transpose`-style), the layout weight quantization works on."""
        attr = self.linear.layout_attr
        return attr is None or bool(self.op.attrs.get(attr))


def op_linears(op: Operation) -> Iterator[LinearUse]:
    """The linears of one op whose weight is a named weight, in the op's declared order."""
    for linear in declared_linears(op.name, len(op.operands)):
        name = weight_name(op.operands[linear.weight])
        if name is not None:
            yield LinearUse(op, linear, name)


def linear_uses(function: Function) -> list[LinearUse]:
    """Every linear of the function's top-level ops, in op order."""
    return [use for op in function.ops for use in op_linears(op)]


def linear_weight_names(module: Module) -> frozenset[str]:
    """Weights used as the weight of a linear anywhere in the module (the ones weight quantization applies to)."""
    return frozenset(use.weight for function in module for op in function.walk() for use in op_linears(op))
