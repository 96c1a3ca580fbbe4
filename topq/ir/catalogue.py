"""The op catalogue: every op the verifier accepts, declared as data.

An `OpDef` gives operand and result arity, attributes (kind, default, allowed values) and a shape
inference function. Dialects (Top here, target dialects in their plugins) add their ops with
`register_op`; the builder fills defaults and infers result types from the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from topq.ir.errors import TopqError, UnknownNameError
from topq.ir.types import ScalarType, TensorType, Type

REQUIRED = object()

#: attribute kind → predicate on the Python value
_ATTR_KINDS: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "ints": lambda v: isinstance(v, list) and all(_ATTR_KINDS["int"](x) for x in v),
    "floats": lambda v: isinstance(v, list) and all(_ATTR_KINDS["float"](x) for x in v),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
    "type": lambda v: isinstance(v, (TensorType, ScalarType)),
    "any": lambda v: True,
}


class InferError(TopqError):
    """Shape inference rejected the operands or attributes (message without op context)."""


@dataclass(frozen=True)
class AttrSpec:
    kind: str
    default: Any = REQUIRED
    choices: tuple[Any, ...] | None = None

    def check(self, value: Any) -> str | None:
        """An error message, or None when the value is acceptable."""
        if not _ATTR_KINDS[self.kind](value):
            return f"expected {self.kind}, got {value!r}"
        if self.choices is not None and value not in self.choices:
            return f"expected one of {', '.join(map(repr, self.choices))}, got {value!r}"
        return None


#: (operand types, attrs with defaults filled) → result types; None means "no inference, trust the IR".
InferFn = Callable[[Sequence[Type], dict[str, Any]], list[Type] | None]


@dataclass(frozen=True)
class OpDef:
    name: str
    operands: tuple[int, int | None]  # (min, max); max None = variadic
    results: int | None  # None = variable, given by the IR
    attrs: dict[str, AttrSpec] = field(default_factory=dict)
    infer: InferFn | None = None
    regions: int = 0
    doc: str = ""

    def with_defaults(self, attrs: dict[str, Any]) -> dict[str, Any]:
        filled = dict(attrs)
        for key, spec in self.attrs.items():
            if key not in filled and spec.default is not REQUIRED and spec.default is not None:
                filled[key] = spec.default
        return filled

    def attr(self, attrs: dict[str, Any], key: str) -> Any:
        """An attribute with its default (for interpreters, which read attributes of parsed ops)."""
        if key in attrs:
            return attrs[key]
        return self.attrs[key].default


CATALOGUE: dict[str, OpDef] = {}


def register_op(opdef: OpDef) -> OpDef:
    if opdef.name in CATALOGUE and CATALOGUE[opdef.name] != opdef:
        raise TopqError(f"op {opdef.name} is registered twice with different definitions")
    CATALOGUE[opdef.name] = opdef
    return opdef


def lookup_op(name: str) -> OpDef:
    try:
        return CATALOGUE[name]
    except KeyError:
        dialect = name.split(".", 1)[0]
        raise UnknownNameError("op", name, [n for n in CATALOGUE if n.startswith(dialect + ".")] or CATALOGUE) from None


def define(
    name: str,
    operands: int | tuple[int, int | None],
    results: int | None = 1,
    attrs: dict[str, AttrSpec] | None = None,
    infer: InferFn | None = None,
    regions: int = 0,
    doc: str = "",
) -> OpDef:
    """Declare an op (`operands` is an exact count or a (min, max) range)."""
    arity = (operands, operands) if isinstance(operands, int) else operands
    return register_op(OpDef(name, arity, results, attrs or {}, infer, regions, doc))
