"""The kernel IR: the MLIR `scf`, `memref`, `arith` and `math` subset that raw kernels lower to.

Inside a kernel, tensor-typed block arguments are *buffers* (memref semantics, the operands a target stages
into local memory): `memref.load` reads an element, `memref.store` writes one in place. Everything else is
scalar SSA: `f32`/`f16`/`bf16`/`f64` floats, `index` for loop counters and subscripts, `i1` for conditions,
`i64`/`i32` only as the bridge of `arith.index_cast` → `arith.sitofp`. Control flow is structured:

* `scf.for(lb, ub, step, inits...)` — one region whose block takes `(iv: index, iter_args...)` and ends in
  `scf.yield(next iter_args...)`; the results are the final iter_args (loop-carried values, e.g. a sum).
* `scf.if(cond)` — two regions (then, else), each ending in `scf.yield(values...)`; the results are the
  yielded values of the branch taken.
* `scf.yield` also terminates a `top.DSLRegion` body, yielding the output buffers.

The ops are declared here as data with result-type inference (`KERNEL_OPS`); once installed (`topq.raw.extension`)
the Top verifier and builder accept them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from topq.ir.catalogue import NO_TRAITS, AttrSpec, InferError, InferFn, OpDef, op_def
from topq.ir.extension import IRExtension
from topq.ir.types import ScalarType, TensorType, Type

A = AttrSpec

FLOAT_TYPES = frozenset({"f32", "f16", "bf16", "f64"})
INT_TYPES = frozenset({"index", "i64", "i32"})
INDEX = ScalarType("index")
I1 = ScalarType("i1")

#: Python comparison → predicate. Floats use ordered predicates except `!=` (unordered: NaN != NaN is true,
#: as in Python); integers use the signed ones.
CMPF_PREDICATES = ("oeq", "une", "olt", "ole", "ogt", "oge", "one", "ueq", "ult", "ule", "ugt", "uge", "ord", "uno")
CMPI_PREDICATES = ("eq", "ne", "slt", "sle", "sgt", "sge")


def _scalar(t: Type, kinds: frozenset[str], what: str) -> ScalarType:
    if not isinstance(t, ScalarType) or t.name not in kinds:
        raise InferError(f"expected {what}, got {t}")
    return t


def _same_scalar(kinds: frozenset[str], what: str):  # type: ignore[no-untyped-def]
    def infer(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
        first = _scalar(types[0], kinds, what)
        for t in types[1:]:
            if t != first:
                raise InferError(f"operand types differ: {first} and {t}")
        return [first]

    return infer


_float_op = _same_scalar(FLOAT_TYPES, "a float scalar")
_int_op = _same_scalar(INT_TYPES, "an index or integer scalar")
_bool_op = _same_scalar(frozenset({"i1"}), "an i1 condition")


def _cmp(kinds: frozenset[str], what: str):  # type: ignore[no-untyped-def]
    same = _same_scalar(kinds, what)

    def infer(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
        same(types, attrs)
        return [I1]

    return infer


def _select(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    cond, a, b = types
    if cond != I1:
        raise InferError(f"select condition must be i1, got {cond}")
    if a != b or not isinstance(a, ScalarType):
        raise InferError(f"select operands must be scalars of one type, got {a} and {b}")
    return [a]


def _buffer_access(types: Sequence[Type], first_index: int) -> TensorType:
    buffer = types[first_index - 1]
    if not isinstance(buffer, TensorType):
        raise InferError(f"expected a tensor buffer, got {buffer}")
    indices = types[first_index:]
    if len(indices) != buffer.rank:
        raise InferError(f"{buffer} needs {buffer.rank} indices, got {len(indices)}")
    if any(t != INDEX for t in indices):
        raise InferError("buffer indices must be of type index")
    return buffer


def _load(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    return [ScalarType(_buffer_access(types, 1).dtype)]


def _store(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    buffer = _buffer_access(types, 2)
    if types[0] != ScalarType(buffer.dtype):
        raise InferError(f"cannot store {types[0]} into {buffer}")
    return []


def _for(types: Sequence[Type], attrs: dict[str, Any]) -> list[Type]:
    if any(t != INDEX for t in types[:3]):
        raise InferError("scf.for bounds and step must be of type index")
    return list(types[3:])


def _if(types: Sequence[Type], attrs: dict[str, Any]) -> None:
    if types[0] != I1:
        raise InferError(f"scf.if condition must be i1, got {types[0]}")
    return None  # the result types are whatever the branches yield: given by the IR


def _cast(types: Sequence[Type], attrs: dict[str, Any]) -> None:
    _scalar(types[0], INT_TYPES | FLOAT_TYPES | {"i1"}, "a scalar")
    return None  # the target type is the result type written in the IR


#: The kernel IR ops (registered through the raw plugin's IR extension, `topq.raw.plugin`).
KERNEL_OPS: list[OpDef] = []


def _op(name: str, operands: int | tuple[int, int | None], results: int | None = 1,
        attrs: dict[str, AttrSpec] | None = None, infer: InferFn | None = None, regions: int = 0,
        doc: str = "") -> None:
    # Scalar and buffer ops inside a kernel body: none of the Top-graph traits apply.
    KERNEL_OPS.append(op_def(name, operands, results, attrs, infer, regions, doc, NO_TRAITS))


# -- structured control flow and buffers ------------------------------------------------------------------
_op("scf.for", (3, None), results=None, infer=_for, regions=1,
    doc="for iv in range(lb, ub, step) with loop-carried iter_args; results = final iter_args")
_op("scf.if", 1, results=None, infer=_if, regions=2, doc="then / else regions, each ending in scf.yield")
_op("scf.yield", (0, None), results=0, doc="terminator: the values a region hands to its parent op")
_op("memref.load", (1, None), infer=_load, doc="buffer[indices...] → element")
_op("memref.store", (2, None), results=0, infer=_store, doc="buffer[indices...] = value (in place)")

# -- arith ----------------------------------------------------------------------------------------------
_op("arith.constant", 0, attrs={"value": A("float")}, doc="a scalar constant; its type is the result type")
for _name in ("addf", "subf", "mulf", "divf", "maximumf", "minimumf"):
    _op(f"arith.{_name}", 2, infer=_float_op)
_op("arith.negf", 1, infer=_float_op)
for _name in ("addi", "subi", "muli", "floordivsi", "maxsi", "minsi"):
    _op(f"arith.{_name}", 2, infer=_int_op)
for _name in ("andi", "ori", "xori"):
    _op(f"arith.{_name}", 2, infer=_bool_op)
_op("arith.cmpf", 2, attrs={"predicate": A("str", choices=CMPF_PREDICATES)},
    infer=_cmp(FLOAT_TYPES, "float scalars"))
_op("arith.cmpi", 2, attrs={"predicate": A("str", choices=CMPI_PREDICATES)},
    infer=_cmp(INT_TYPES, "index or integer scalars"))
_op("arith.select", 3, infer=_select)
_op("arith.index_cast", 1, infer=_cast, doc="index ↔ i64/i32")
_op("arith.sitofp", 1, infer=_cast, doc="signed integer → float")

# -- math -------------------------------------------------------------------------------------------------
MATH_FUNCTIONS = ("exp", "log", "sqrt", "rsqrt", "tanh", "absf", "erf")
for _name in MATH_FUNCTIONS:
    _op(f"math.{_name}", 1, infer=_float_op)


#: The kernel IR ops as an IR extension of their own: lowering a kernel installs it (before plugins load, too).
KERNEL_IR = IRExtension("raw-kernel-ops", ops=tuple(KERNEL_OPS))
