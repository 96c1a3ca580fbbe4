"""Fuzz the parser: mutated valid IR either parses or raises IRParseError with a sane position; nothing else.

The mutations are character edits (delete / insert / replace), token edits (delete / duplicate / replace /
insert a grammar token), truncation and line swaps, one to three per example, on printed Top IR.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ir_gen import Dims, build_module

from topq.ir.parser import IRParseError, parse_module
from topq.ir.printer import print_module

SMALL = """\
module {
  func.func @f(%arg0: tensor<2x4xf32>) -> (tensor<2x4xf32>, tensor<1x4xi32>) {
    %0:2 = "top.TopK"(%arg0) {axis = 0 : i64, k = 1 : i64} : (tensor<2x4xf32>) -> (tensor<1x4xf32>, tensor<1x4xi32>)
    %1 = "top.Add"(%arg0, %0#0) : (tensor<2x4xf32>, tensor<1x4xf32>) -> tensor<2x4xf32> loc("a\\0A\\"")
    return %1, %0#1 : tensor<2x4xf32>, tensor<1x4xi32>
  }
}
"""
# One layer of the realistic model plus the attribute zoo (every attribute kind, escapes, hex floats).
BASES = [SMALL, print_module(build_module(Dims(layers=1)))]

_TOKEN_RE = re.compile(r'"(?:[^"\\\n]|\\.)*"|tensor<[^<>]*>|%[\w.$#]+|@[\w.$]+|\^\w+|0x[0-9A-Fa-f]+'
                       r"|[-+]?\d+(?:\.\d*(?:[eE][-+]?\d+)?)?|[A-Za-z_][\w.$]*|->|\S")
#: Tokens of the grammar and near misses, to splice in.
GRAMMAR_TOKENS = [
    "%0", "%arg0", "%99", "%0#1", "%0#9", "%1:2", "%1:0", ":0", "@f", '"top.Add"', '"top.Nope"', "tensor<?x4xf32>",
    "tensor<f32>", "tensor<1x2xq7>", "tensor<1x>", "tensor<", "0x7FF0000000000000", "0x1", "1.0e+400", "-",
    "99999999999999999999999", "loc", "loc(", "attributes", "func.func", "return", "module", "{", "}", "(", ")",
    "[", "]", "<", ">", ",", "=", ":", "->", "^bb0", "true", "unit", '"\\"', '"\\ZZ"', '"\\C3\\A9"', ": i64",
    ": f64", ": q9", "index", "// comment\n", "\n", "#", "$", "\\",
]
_CHARS = st.sampled_from(list('%#@^"\\{}()[]<>,=:-+.x019aeftn \n\t\r') + ["\u00e9", "\x00", "\u2028", "\U0001f600"])

Mutation = Callable[[st.DrawFn, str], str]


def _position(draw: st.DrawFn, text: str) -> int:
    return draw(st.integers(0, len(text)))


def delete_chars(draw: st.DrawFn, text: str) -> str:
    i = _position(draw, text)
    return text[:i] + text[i + draw(st.integers(1, 12)):]


def insert_chars(draw: st.DrawFn, text: str) -> str:
    i = _position(draw, text)
    return text[:i] + "".join(draw(st.lists(_CHARS, min_size=1, max_size=6))) + text[i:]


def replace_char(draw: st.DrawFn, text: str) -> str:
    i = _position(draw, text)
    return text[:i] + draw(_CHARS) + text[i + 1:]


def _tokens(text: str) -> list[re.Match[str]]:
    return list(_TOKEN_RE.finditer(text))


def token_edit(draw: st.DrawFn, text: str) -> str:
    tokens = _tokens(text)
    if not tokens:
        return text
    tok = tokens[draw(st.integers(0, len(tokens) - 1))]
    other = tokens[draw(st.integers(0, len(tokens) - 1))].group()
    new = draw(st.sampled_from(["", tok.group() + " " + tok.group(), other, draw(st.sampled_from(GRAMMAR_TOKENS))]))
    return text[:tok.start()] + new + text[tok.end():]


def insert_token(draw: st.DrawFn, text: str) -> str:
    i = _position(draw, text)
    return text[:i] + draw(st.sampled_from(GRAMMAR_TOKENS)) + text[i:]


def truncate(draw: st.DrawFn, text: str) -> str:
    return text[:_position(draw, text)]


def swap_lines(draw: st.DrawFn, text: str) -> str:
    lines = text.split("\n")
    i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
    lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


MUTATIONS: list[Mutation] = [delete_chars, insert_chars, replace_char, token_edit, token_edit, insert_token,
                             truncate, swap_lines]


@st.composite
def mutated_ir(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(BASES))
    for _ in range(draw(st.integers(1, 3))):
        text = draw(st.sampled_from(MUTATIONS))(draw, text)
    return text


def check_parse(text: str) -> None:
    """The contract: a Module, or IRParseError pointing inside the text (1-based line and column)."""
    try:
        module = parse_module(text, "fuzz.mlir")
    except IRParseError as exc:
        lines = text.split("\n")
        assert 1 <= exc.line <= len(lines), (exc.line, len(lines))
        assert 1 <= exc.column <= len(lines[exc.line - 1]) + 1, (exc.column, lines[exc.line - 1])
        assert str(exc).startswith(f"fuzz.mlir:{exc.line}:{exc.column}: ")
        return
    printed = print_module(module)  # whatever parses must print as canonical, re-parseable text
    assert print_module(parse_module(printed)) == printed


def test_bases_are_valid() -> None:
    for text in BASES:
        assert print_module(parse_module(text)) == text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_ir())
def test_mutated_ir_parses_or_raises_ir_parse_error(text: str) -> None:
    check_parse(text)


# Crashes the fuzzer found (each was an exception other than IRParseError escaping parse_module).
FOUND = {
    "zero-result group": 'func.func @f() {\n  %1:0 = "top.X"() : () -> ()\n  return\n}\n',
    "NUL byte in an escaped string": 'func.func @f() {\n  "top.X"() {a = "\x00zz\\41"} : () -> ()\n  return\n}\n',
}


@pytest.mark.parametrize("text", list(FOUND.values()), ids=list(FOUND))
def test_found_inputs(text: str) -> None:
    check_parse(text)
