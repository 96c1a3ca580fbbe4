"""Parse MLIR's generic textual form (the subset the printer writes, plus a few spellings MLIR allows).

Every error is an `IRParseError` that carries a line and column; no other exception escapes `parse_module`.
"""

from __future__ import annotations

import re
import struct
from typing import NoReturn

from topq.ir.errors import TopqError
from topq.ir.graph import Attr, Block, Function, Module, Operation, Region, Value
from topq.ir.types import Type, TypeParseError, parse_type


class IRParseError(TopqError):
    def __init__(self, message: str, line: int, column: int, source: str = "<text>") -> None:
        super().__init__(f"{source}:{line}:{column}: {message}")
        self.line, self.column = line, column


_TOKEN_RE = re.compile(
    r"""
    (?P<ws>[ \t\r\n]+|//[^\n]*)
  | (?P<type>tensor<[^<>]*>)
  | (?P<value>%[A-Za-z0-9_.$]+(?:\#\d+)?)
  | (?P<symbol>@(?:[A-Za-z0-9_.$]+|"(?:[^"\\\n]|\\.)*"))
  | (?P<label>\^[A-Za-z0-9_.$]+)
  | (?P<string>"(?:[^"\\\n]++|\\.)*+")
  | (?P<hex>0x[0-9A-Fa-f]+)
  | (?P<float>[-+]?\d+\.\d*(?:[eE][-+]?\d+)?)
  | (?P<int>[-+]?\d+)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_.$]*)
  | (?P<punct>->|[(){}\[\]<>,=:])
    """,
    re.VERBOSE,
)
_STRING_ESCAPE_RE = re.compile(r'\\([0-9A-Fa-f]{2}|["\\nt])')
_SIMPLE_ESCAPES = {'"': b'"', "\\": b"\\", "n": b"\n", "t": b"\t"}


def _unescape(body: str) -> str:
    """MLIR string escapes: \\XX (a byte in hex), \\", \\\\, \\n, \\t; bytes are UTF-8."""
    if "\\" not in body:
        return body
    out = bytearray()
    pos = 0
    for match in _STRING_ESCAPE_RE.finditer(body):
        out += body[pos:match.start()].encode("utf-8")
        code = match.group(1)
        out += _SIMPLE_ESCAPES.get(code) or bytes([int(code, 16)])
        pos = match.end()
    out += body[pos:].encode("utf-8")
    return out.decode("utf-8", errors="replace")


class _Parser:
    def __init__(self, text: str, source: str) -> None:
        self.text = text
        self.source = source
        self.kinds: list[str] = []
        self.texts: list[str] = []
        self.starts: list[int] = []
        pos = 0
        for match in _TOKEN_RE.finditer(text):
            if match.start() != pos:
                self.fail_at(pos, f"unexpected character {text[pos]!r}")
            pos = match.end()
            kind = match.lastgroup
            if kind == "ws":
                continue
            self.kinds.append(kind)  # type: ignore[arg-type]
            self.texts.append(match.group())
            self.starts.append(match.start())
        if pos != len(text):
            self.fail_at(pos, f"unexpected character {text[pos]!r}")
        self.kinds.append("eof")
        self.texts.append("")
        self.starts.append(len(text))
        self.i = 0
        self.values: dict[str, Value] = {}

    # -- token helpers -------------------------------------------------------------------------
    def fail_at(self, pos: int, message: str) -> NoReturn:
        line = self.text.count("\n", 0, pos) + 1
        column = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        raise IRParseError(message, line, column, self.source)

    def integer(self, text: str) -> int:
        """An integer literal; the IR's integers are at most 64 bits (a longer literal is refused before Python
        converts it: 5,000 digits would raise, and a million would take seconds)."""
        if len(text.lstrip("+-")) > 20 or not -(1 << 63) <= (value := int(text)) < (1 << 64):
            self.i -= 1
            self.fail("integer literal out of the 64-bit range")
        return value

    def fail(self, message: str) -> NoReturn:
        self.fail_at(self.starts[self.i], message)

    def peek(self, offset: int = 0) -> str:
        return self.texts[self.i + offset]

    def kind(self) -> str:
        return self.kinds[self.i]

    def next(self) -> str:
        text = self.texts[self.i]
        if self.kinds[self.i] == "eof":
            self.fail("unexpected end of input")
        self.i += 1
        return text

    def expect(self, text: str) -> None:
        if self.texts[self.i] != text or self.kinds[self.i] == "string":
            found = self.texts[self.i] or "end of input"
            self.fail(f"expected {text!r}, found {found!r}")
        self.i += 1

    def accept(self, text: str) -> bool:
        if self.texts[self.i] == text and self.kinds[self.i] != "string":
            self.i += 1
            return True
        return False

    def expect_kind(self, kind: str, what: str) -> str:
        if self.kinds[self.i] != kind:
            found = self.texts[self.i] or "end of input"
            self.fail(f"expected {what}, found {found!r}")
        return self.next()

    # -- grammar -------------------------------------------------------------------------------
    def module(self) -> Module:
        module = Module()
        if self.accept("module"):
            if self.accept("attributes"):
                module.attrs = self.attr_dict()
            self.expect("{")
            while not self.accept("}"):
                self.function_into(module)
        else:
            while self.kind() != "eof":
                self.function_into(module)
        if self.kind() != "eof":
            self.fail(f"unexpected {self.peek()!r} after the module")
        return module

    def function_into(self, module: Module) -> None:
        start = self.i
        self.expect("func.func")
        name = self.expect_kind("symbol", "a function name like @block_0")[1:]
        if name.startswith('"'):
            name = _unescape(name[1:-1])
        if name in module.functions:
            self.fail_at(self.starts[start], f"function @{name} is defined twice")
        self.values = {}
        function = Function(name)
        self.expect("(")
        if not self.accept(")"):
            while True:
                self.define_arg(function.body)
                if self.accept(")"):
                    break
                self.expect(",")
        declared: list[Type] = []
        if self.accept("->"):
            declared = self.result_types()
        if self.accept("attributes"):
            function.attrs = self.attr_dict()
        self.expect("{")
        while self.peek() != "return":
            if self.kind() == "eof":
                self.fail(f"function @{name} has no return")
            function.body.ops.append(self.operation())
        ret_pos = self.starts[self.i]
        self.next()
        if self.kind() == "value":
            function.results = self.operand_list()
            self.expect(":")
            types = self.type_list()
            if [r.type for r in function.results] != types:
                self.fail_at(ret_pos, f"return operand types do not match in @{name}")
        if [r.type for r in function.results] != declared:
            self.fail_at(ret_pos, f"return of @{name} does not match its declared result types")
        self.expect("}")
        module.add(function)

    def define_arg(self, block: Block) -> None:
        name = self.expect_kind("value", "an argument like %arg0")
        self.expect(":")
        value = block.add_arg(self.type())
        if name in self.values:
            self.fail(f"value {name} is defined twice")
        self.values[name] = value
        if self.accept("loc"):
            self.location()

    def operation(self) -> Operation:
        op_start = self.i
        result_name: str | None = None
        count = 1
        if self.kind() == "value":
            result_name = self.next()
            if "#" in result_name:
                self.fail("a result name cannot carry '#'")
            if self.accept(":"):
                count = self.integer(self.expect_kind("int", "a result count"))
                if count < 1:
                    self.i -= 1
                    self.fail("a result count must be at least 1")
            self.expect("=")
        elif self.kind() != "string":
            self.fail(f"expected an operation, found {self.peek()!r}")
        name = _unescape(self.expect_kind("string", 'an op name like "top.Add"')[1:-1])
        self.expect("(")
        operands = [] if self.accept(")") else self.operand_list(close=")")
        regions: list[Region] = []
        if self.peek() == "(" and self.peek(1) == "{":
            self.next()
            while True:
                regions.append(self.region())
                if self.accept(")"):
                    break
                self.expect(",")
        attrs = self.attr_dict() if self.peek() == "{" else {}
        self.expect(":")
        self.expect("(")
        operand_types = [] if self.accept(")") else self.type_list(close=")")
        self.expect("->")
        result_types = self.result_types()
        loc = self.location() if self.accept("loc") else None
        if [v.type for v in operands] != operand_types:
            have = ", ".join(str(v.type) for v in operands)
            self.fail_at(self.starts[op_start], f"{name}: operand types ({have}) do not match its signature")
        if result_name is None and result_types:
            self.fail_at(self.starts[op_start], f"{name} has results but no name for them")
        if result_name is not None and len(result_types) != count:
            self.fail_at(self.starts[op_start],
                         f"{name}: {count} result name(s) for {len(result_types)} result type(s)")
        op = Operation(name, operands, result_types, attrs, regions, loc)
        if result_name is not None:
            if result_name in self.values:
                self.fail_at(self.starts[op_start], f"value {result_name} is defined twice")
            if count == 1:
                self.values[result_name] = op.results[0]
            else:
                for k, r in enumerate(op.results):
                    self.values[f"{result_name}#{k}"] = r
                self.values[result_name] = op.results[0]
        return op

    def region(self) -> Region:
        self.expect("{")
        block = Block()
        if self.kind() == "label":
            self.next()
            self.expect("(")
            if not self.accept(")"):
                while True:
                    self.define_arg(block)
                    if self.accept(")"):
                        break
                    self.expect(",")
            self.expect(":")
        while not self.accept("}"):
            block.ops.append(self.operation())
        return Region([block])

    def operand_list(self, close: str | None = None) -> list[Value]:
        values = []
        while True:
            name = self.expect_kind("value", "an SSA value like %0")
            value = self.values.get(name)
            if value is None:
                self.i -= 1
                self.fail(f"use of undefined value {name}")
            values.append(value)
            if close is not None and self.accept(close):
                return values
            if not self.accept(","):
                if close is not None:
                    self.fail(f"expected ',' or {close!r}, found {self.peek()!r}")
                return values

    def location(self) -> str:
        self.expect("(")
        loc = _unescape(self.expect_kind("string", "a location string")[1:-1])
        self.expect(")")
        return loc

    # -- types and attributes ------------------------------------------------------------------
    def type(self) -> Type:
        kind, text = self.kind(), self.peek()
        if kind not in ("type", "ident"):
            self.fail(f"expected a type, found {text or 'end of input'!r}")
        try:
            parsed = parse_type(text)
        except TypeParseError as exc:
            self.fail(str(exc))
        self.i += 1
        return parsed

    def type_list(self, close: str | None = None) -> list[Type]:
        types = [self.type()]
        while self.accept(","):
            types.append(self.type())
        if close is not None:
            self.expect(close)
        return types

    def result_types(self) -> list[Type]:
        if self.accept("("):
            return [] if self.accept(")") else self.type_list(close=")")
        return [self.type()]

    def attr_dict(self) -> dict[str, Attr]:
        self.expect("{")
        attrs: dict[str, Attr] = {}
        if self.accept("}"):
            return attrs
        while True:
            if self.kind() == "string":
                key = _unescape(self.next()[1:-1])
            else:
                key = self.expect_kind("ident", "an attribute name")
            if key in attrs:
                self.fail(f"attribute {key!r} is given twice")
            if self.accept("="):
                attrs[key] = self.attr_value(top=True)
            else:
                attrs[key] = True  # a unit attribute
            if self.accept("}"):
                return attrs
            self.expect(",")

    def attr_value(self, top: bool = False) -> Attr:
        kind, text = self.kind(), self.peek()
        if kind == "string":
            self.i += 1
            return _unescape(text[1:-1])
        if kind == "int":
            self.i += 1
            value: Attr = self.integer(text)
            if self.peek() == ":":
                self.i += 1
                suffix = self.expect_kind("ident", "an integer or float type")
                if suffix in ("f64", "f32", "f16", "bf16"):
                    value = float(value)
                elif suffix not in ("i64", "i32", "i16", "i8", "i1", "si32", "si64", "ui32", "ui64", "index"):
                    self.fail(f"unknown attribute type {suffix!r}")
            return value
        if kind in ("float", "hex"):
            self.i += 1
            if kind == "hex":
                if not self.accept(":"):
                    self.fail("a hexadecimal float needs a type, e.g. 0x7FF0000000000000 : f64")
                self.expect_kind("ident", "a float type")
                if len(text) != 18:
                    self.fail("a hexadecimal f64 has 16 digits")
                return struct.unpack(">d", bytes.fromhex(text[2:]))[0]
            if self.accept(":"):
                self.expect_kind("ident", "a float type")
            return float(text)
        if text == "[" and kind == "punct":
            self.i += 1
            items: list[Attr] = []
            if self.accept("]"):
                return items
            while True:
                items.append(self.attr_value())
                if self.accept("]"):
                    return items
                self.expect(",")
        if text == "{" and kind == "punct":
            return self.attr_dict()
        if kind == "ident" and text in ("true", "false"):
            self.i += 1
            return text == "true"
        if kind in ("type", "ident"):
            return self.type()
        self.fail(f"expected an attribute value, found {text or 'end of input'!r}")


def parse_module(text: str, source: str = "<text>") -> Module:
    """Parse a module (or a bare list of functions); raise IRParseError with line and column on bad input."""
    try:
        return _Parser(text, source).module()
    except IRParseError:
        raise
    except RecursionError:
        raise IRParseError("nesting too deep", 1, 1, source) from None
