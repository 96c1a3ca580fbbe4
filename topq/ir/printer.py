"""Print IR in MLIR's generic textual form.

The printer is canonical (SSA names are renumbered, attribute dictionaries are sorted), so
print → parse → print is byte-identical.
"""

from __future__ import annotations

import math
import re
import struct

from topq.ir.graph import Attr, Block, Function, Module, Operation, Region, Value
from topq.ir.types import ScalarType, TensorType

_ESCAPES = {'"': '\\"', "\\": "\\\\"}


def format_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif " " <= ch <= "~":
            out.append(ch)
        else:  # MLIR escapes other bytes as two hex digits each (UTF-8)
            out.extend(f"\\{b:02X}" for b in ch.encode("utf-8"))
    return '"' + "".join(out) + '"'


def format_float(value: float) -> str:
    if not math.isfinite(value):
        return "0x" + struct.pack(">d", value).hex().upper()
    text = repr(float(value))
    mantissa, _, exponent = text.partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    return mantissa + ("e" + exponent if exponent else "")


_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.$]*")


def format_key(key: str) -> str:
    """An attribute name or symbol: bare when it is an identifier, quoted otherwise (as MLIR does)."""
    return key if _IDENT_RE.fullmatch(key) else format_string(key)


def format_attr(value: Attr, nested: bool = False) -> str:
    """Top-level integers and floats carry their type (`3 : i64`); inside arrays the i64/f64 type is elided."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value) if nested else f"{value} : i64"
    if isinstance(value, float):
        # Hex spellings of inf/nan always need their type to be read back.
        return format_float(value) if nested and math.isfinite(value) else f"{format_float(value)} : f64"
    if isinstance(value, str):
        return format_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_attr(v, nested=True) for v in value) + "]"
    if isinstance(value, dict):
        return format_attr_dict(value)
    if isinstance(value, (TensorType, ScalarType)):
        return str(value)
    raise TypeError(f"cannot print attribute value {value!r} of type {type(value).__name__}")


def format_attr_dict(attrs: dict[str, Attr]) -> str:
    items = ", ".join(f"{format_key(k)} = {format_attr(attrs[k])}" for k in sorted(attrs))
    return "{" + items + "}"


class _Namer:
    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.next_result = 0
        self.next_arg = 0

    def arg(self, value: Value) -> str:
        name = f"%arg{self.next_arg}"
        self.next_arg += 1
        self.names[id(value)] = name
        return name

    def results(self, op: Operation) -> str:
        base = f"%{self.next_result}"
        self.next_result += 1
        if len(op.results) == 1:
            self.names[id(op.results[0])] = base
        else:
            for i, r in enumerate(op.results):
                self.names[id(r)] = f"{base}#{i}"
        return base if len(op.results) == 1 else f"{base}:{len(op.results)}"

    def __getitem__(self, value: Value) -> str:
        try:
            return self.names[id(value)]
        except KeyError:
            return "%<<undefined>>"


def _types(types: list) -> str:
    return ", ".join(str(t) for t in types)


def _result_types(types: list) -> str:
    if len(types) == 1 and isinstance(types[0], TensorType | ScalarType):
        return str(types[0])
    return f"({_types(types)})"


class Printer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def module(self, module: Module) -> str:
        head = "module"
        if module.attrs:
            head += " attributes " + format_attr_dict(module.attrs)
        self.lines.append(head + " {")
        for function in module:
            self.function(function, indent="  ")
        self.lines.append("}")
        return "\n".join(self.lines) + "\n"

    def function(self, function: Function, indent: str = "") -> None:
        namer = _Namer()
        args = ", ".join(f"{namer.arg(a)}: {a.type}" for a in function.args)
        head = f"{indent}func.func @{format_key(function.name)}({args})"
        if function.results:
            head += " -> " + _result_types(function.result_types)
        if function.attrs:
            head += " attributes " + format_attr_dict(function.attrs)
        self.lines.append(head + " {")
        self.ops(function.body.ops, namer, indent + "  ")
        ret = f"{indent}  return"
        if function.results:
            ret += " " + ", ".join(namer[r] for r in function.results) + " : " + _types(function.result_types)
        self.lines.append(ret)
        self.lines.append(indent + "}")

    def ops(self, ops: list[Operation], namer: _Namer, indent: str) -> None:
        for op in ops:
            self.op(op, namer, indent)

    def op(self, op: Operation, namer: _Namer, indent: str) -> None:
        operands = ", ".join(namer[v] for v in op.operands)
        prefix = namer.results(op) + " = " if op.results else ""
        region_text = ""
        if op.regions:
            region_text = " (" + ", ".join(self.region(r, namer, indent) for r in op.regions) + ")"
        text = f'{indent}{prefix}{format_string(op.name)}({operands}){region_text}'
        if op.attrs:
            text += " " + format_attr_dict(op.attrs)
        text += f" : ({_types([v.type for v in op.operands])}) -> {_result_types([r.type for r in op.results])}"
        if op.loc is not None:
            text += f" loc({format_string(op.loc)})"
        self.lines.append(text)

    def region(self, region: Region, namer: _Namer, indent: str) -> str:
        saved, self.lines = self.lines, []
        for block in region.blocks:
            self.block(block, namer, indent + "  ")
        body, self.lines = self.lines, saved
        return "{\n" + "\n".join(body) + "\n" + indent + "}"

    def block(self, block: Block, namer: _Namer, indent: str) -> None:
        if block.args:
            args = ", ".join(f"{namer.arg(a)}: {a.type}" for a in block.args)
            self.lines.append(f"{indent[:-2]}^bb0({args}):")
        self.ops(block.ops, namer, indent)


def print_module(module: Module) -> str:
    return Printer().module(module)


def print_function(function: Function) -> str:
    printer = Printer()
    printer.function(function)
    return "\n".join(printer.lines) + "\n"
