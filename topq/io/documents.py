"""Dataclass documents read back from files (a bundle's spec, a stored result): each value is checked against its
field's annotation before use, so a crafted document is an error line, not a traceback deep inside topq."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from typing import Any

from topq.io.schema import show
from topq.ir.errors import TopqError

__all__ = ["checked_document"]


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_float(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: a check per annotation (as written in the dataclass, with `from __future__ import annotations`)
FIELD_CHECKS: dict[str, Callable[[Any], bool]] = {
    "int": _is_int,
    "float": _is_float,
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "int | None": lambda v: v is None or _is_int(v),
    "dict[str, Any] | None": lambda v: v is None or (isinstance(v, dict) and all(isinstance(k, str) for k in v)),
    "tuple[int, ...]": lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) for x in v),
    "tuple[str, ...]": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
    "dict[str, int] | None": lambda v: v is None or (isinstance(v, dict) and all(
        isinstance(k, str) and _is_int(x) for k, x in v.items())),
}


def checked_document(cls: type, d: Any, what: str,
                     checks: Mapping[str, Callable[[Any], bool]] | None = None) -> dict[str, Any]:
    """A stored dataclass document `d` as keyword arguments for `cls`: a mapping with no unknown field, every
    required one, and each value fitting its annotation (`FIELD_CHECKS`, plus the caller's `checks` for its own
    annotations, e.g. a nested document)."""
    if not isinstance(d, Mapping):
        raise TopqError(f"{what} is {show(d)}, not a mapping")
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise TopqError(f"{what} has unknown fields: {', '.join(sorted(map(str, unknown)))}")
    missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING]
    if missing:
        raise TopqError(f"{what} lacks {', '.join(missing)}")
    table = {**FIELD_CHECKS, **(checks or {})}
    for f in fields(cls):
        check = table.get(str(f.type))
        if f.name in d and check is not None and not check(d[f.name]):
            raise TopqError(f"{what} field {f.name} = {show(d[f.name])} does not fit its type {f.type}")
    return dict(d)
