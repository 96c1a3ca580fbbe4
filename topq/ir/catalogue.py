"""The op catalogue: every op the verifier accepts, declared as data.

An `OpDef` gives operand and result arity, attributes (kind, default, allowed values), a shape
inference function and the op's `Traits` (what graph analyses need to know about it: which operands
are weights and linears, whether it is elementwise or a view, which norm parameters can absorb a
per-channel scale). Dialects (Top here, target dialects in their plugins) add their ops with
`register_op`; the builder fills defaults and infers result types from the same table.

Analyses ask traits, never op names, so one rule covers a class of ops (like tinygrad's op groups):
a new fused op that declares its linears is quantized, calibrated and counted without other edits.
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


@dataclass(frozen=True)
class Linear:
    """One linear map y = x Wᵀ inside an op: which operand is W and which is x.

    `input` None means x is computed inside the op (top.MLP's down projection reads act(x W_gᵀ)·(x W_uᵀ));
    `scales_input` is then the operand whose output rows scale x channel by channel (up: the hidden
    activation is linear in it), so a per-channel scale of x can be folded into that weight's rows.
    `layout_attr` names the bool attribute that says W is stored [N, K] (Hugging Face Linear layout);
    None means it always is."""

    weight: int
    input: int | None = 0
    role: str = ""
    layout_attr: str | None = None
    scales_input: int | None = None
    bias: int | None = None  # the operand holding its bias, when present
    # `input` None: the operands (x, gate weight, up weight) the hidden activation act(x W_gᵀ)·(x W_uᵀ) is made of
    hidden_from: tuple[int, int, int] | None = None
    # the linear sees only the tokens its op routes to expert `expert` (top.MoE); None: every token
    expert: int | None = None


@dataclass(frozen=True)
class Traits:
    """What graph analyses know about an op, as data (see the module doc).

    * `named_weight`: the op's result is a named tensor of the weight store (`attrs["name"]`).
    * `weights`: operands that are parameters (named weights in every program topq builds).
    * `linears`: the linear maps whose weights weight quantization applies to.
    * `elementwise`: results are computed element by element (operands broadcast).
    * `view`: the result holds the operand's elements reorganised or selected, none computed;
      `keeps_order`: and in the same order (a reshape), so channel c of the flat data stays channel c.
    * `norm_scale` / `norm_bias`: a normalization whose per-channel scale (and bias) operand can absorb a
      per-channel factor of its output (divide them by s and the output is divided by s).
    * `linears_of`: for an op with a variable number of operands (top.MoE: three per expert), its linears as a
      function of the operand count; `declared_linears` gives either.
    * `mixes_heads_of`: the output channel (head h, dim d) is a weighted sum over positions of this operand's
      channel (h // (q_head / kv_head), d): attention with grouped KV heads, so a per-channel factor of that
      operand reaches the output unchanged (o_proj's input can be scaled in v_proj's rows). The op has
      `q_head` / `kv_head` attributes.
    """

    named_weight: bool = False
    weights: tuple[int, ...] = ()
    linears: tuple[Linear, ...] = ()
    elementwise: bool = False
    view: bool = False
    keeps_order: bool = False
    norm_scale: int | None = None
    norm_bias: int | None = None
    mixes_heads_of: int | None = None
    linears_of: Callable[[int], tuple[Linear, ...]] | None = None


NO_TRAITS = Traits()


def declared_linears(name: str, operand_count: int) -> tuple[Linear, ...]:
    """The linears op `name` with `operand_count` operands declares (`Traits.linears` or `Traits.linears_of`)."""
    traits = traits_of(name)
    return traits.linears_of(operand_count) if traits.linears_of is not None else traits.linears

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
    traits: Traits | None = None  # None: not declared (ops no analysis looks into, e.g. a target's dialect)

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


def traits_of(name: str) -> Traits:
    """The traits of op `name` (none for an op that declares none or is unknown)."""
    opdef = CATALOGUE.get(name)
    return opdef.traits if opdef is not None and opdef.traits is not None else NO_TRAITS


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


def define(*args: Any, **kwargs: Any) -> OpDef:
    """Declare and register an op: `op_def`'s arguments, then `register_op`."""
    return register_op(op_def(*args, **kwargs))


def op_def(
    name: str,
    operands: int | tuple[int, int | None],
    results: int | None = 1,
    attrs: dict[str, AttrSpec] | None = None,
    infer: InferFn | None = None,
    regions: int = 0,
    doc: str = "",
    traits: Traits | None = None,
) -> OpDef:
    """An op definition, not registered (a dialect that registers through a plugin hook builds its table so)."""
    arity = (operands, operands) if isinstance(operands, int) else operands
    return OpDef(name, arity, results, attrs or {}, infer, regions, doc, traits)
