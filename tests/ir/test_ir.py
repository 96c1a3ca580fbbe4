"""Top IR: print/parse round trips, verifier and parser diagnostics, pattern rewriting, docs in sync."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
from data_paths import REPO
from ir_gen import EVERY_KIND_ATTRS, NASTY_STRING, Dims, build_module, op_table_rows

from topq.core.errors import TopqError
from topq.ir.builder import Builder
from topq.ir.catalogue import CATALOGUE
from topq.ir.graph import Function, Module, Operation
from topq.ir.parser import IRParseError, parse_module
from topq.ir.printer import print_module
from topq.ir.rewrite import Rewriter, apply_patterns
from topq.ir.types import ScalarType, TensorType, tensor
from topq.ir.verifier import VerifyError, verify_module

DIMS = Dims()


@pytest.fixture(scope="module")
def module() -> Module:
    return build_module(DIMS)


@pytest.fixture(scope="module")
def text(module: Module) -> str:
    return print_module(module)


def fresh(text: str) -> Module:
    """An independent copy to mutate (the module fixture is shared)."""
    return parse_module(text)


def find_op(function: Function, name: str, loc: str) -> tuple[int, Operation]:
    for index, op in enumerate(function.ops):
        if op.name == name and op.loc == loc:
            return index, op
    raise AssertionError(f"no {name} at {loc} in @{function.name}")


def same_attr(a: Any, b: Any) -> bool:
    """Equal with the same Python types (2 is not 2.0, -0.0 is not 0.0, True is not 1)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return math.copysign(1, a) == math.copysign(1, b) and (a == b or (math.isnan(a) and math.isnan(b)))
    if isinstance(a, list):
        return len(a) == len(b) and all(same_attr(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_attr(a[k], b[k]) for k in a)
    return bool(a == b)


# ------------------------------------------------------------------------------------ the module


def test_generated_module_is_a_realistic_llama(module: Module) -> None:
    assert module.num_ops() >= 2000
    for layer in range(DIMS.layers):
        for name in (f"block_{layer}", f"block_kv_{layer}", f"block_cache_{layer}"):
            assert name in module.functions
    decode = module["block_cache_31"]
    names = [op.name for op in decode.ops]
    for op_name in ("top.RMSNorm", "top.MatMul", "top.Reshape", "top.Gather", "top.Rope", "top.Concat",
                    "top.FAttention", "top.MLP", "top.Add", "top.Weight"):
        assert op_name in names
    attention = next(op for op in decode.ops if op.name == "top.FAttention")
    assert attention.attrs["q_head"] == 9 and attention.attrs["kv_head"] == 3
    assert len(attention.operands) == 4  # q, k, v and the decode mask
    assert [r.shape for r in decode.results] == [(1, 1, 576), (1, 1, 3, 64), (1, 1, 3, 64)]
    assert any(op.name == "top.TopK" for op in module.functions["attribute_zoo"].ops)


def test_print_parse_print_is_byte_identical(module: Module, text: str) -> None:
    parsed = parse_module(text)
    again = print_module(parsed)
    assert again == text
    assert parsed.num_ops() == module.num_ops()
    assert list(parsed.functions) == list(module.functions)


def test_parse_keeps_every_attribute_value_loc_and_type(module: Module, text: str) -> None:
    parsed = parse_module(text)
    zoo = parsed["attribute_zoo"]
    for key, value in EVERY_KIND_ATTRS.items():
        assert same_attr(zoo.attrs[key], value), (key, zoo.attrs[key], value)
    assert isinstance(zoo.attrs["tensor_type"], TensorType) and isinstance(zoo.attrs["scalar_type"], ScalarType)
    assert zoo.ops[0].attrs["name"] == NASTY_STRING and zoo.ops[0].loc == NASTY_STRING
    assert parsed.attrs["topq.note"] == NASTY_STRING
    for original, copy in zip(module, parsed):
        assert [a.type for a in original.args] == [a.type for a in copy.args]
        for op_a, op_b in zip(original.walk(), copy.walk(), strict=True):
            assert (op_a.name, op_a.loc) == (op_b.name, op_b.loc)
            assert same_attr(op_a.attrs, op_b.attrs), (op_a, op_a.attrs, op_b.attrs)
            assert [r.type for r in op_a.results] == [r.type for r in op_b.results]


def test_multi_result_op_round_trips(text: str) -> None:
    zoo_text = text[text.index("func.func @attribute_zoo"):]
    match = re.search(r'(%\d+):2 = "top.TopK"', zoo_text)
    assert match, "TopK should print as `%N:2 = ...`"
    assert f"return %14, {match.group(1)}#1, %4" in zoo_text
    zoo = parse_module(text)["attribute_zoo"]
    topk = next(op for op in zoo.ops if op.name == "top.TopK")
    assert zoo.results[1] is topk.results[1]  # `%N#1` resolves to the second result
    assert topk.results[1].type == tensor(1, 2, dtype="i32")
    silu = next(op for op in zoo.ops if op.name == "top.SiLU")
    assert silu.operands[0] is topk.results[0]


def test_verify_passes_on_built_and_parsed(module: Module, text: str) -> None:
    verify_module(module)
    verify_module(parse_module(text))


def test_real_stage_program_round_trips() -> None:
    """The stage template's own output (llama family, 2 layers, two decode variants) survives the text form."""
    from topq.core.stages import StageConfig, build_program
    from topq.models.decoder import normalize_llama_like
    from topq.plugins.models.llama import FAMILY

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
              "rms_norm_eps": 1e-5}
    spec = normalize_llama_like(config, "llama")
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (100, 64), "model.norm.weight": (64,),
                                          "lm_head.weight": (100, 64)}
    kv = 2 * 16
    sizes = {"input_layernorm": (64,), "post_attention_layernorm": (64,), "q_proj": (64, 64), "k_proj": (kv, 64),
             "v_proj": (kv, 64), "o_proj": (64, 64), "gate_proj": (128, 64), "up_proj": (128, 64),
             "down_proj": (64, 128)}
    for layer in range(2):
        for key, shape in sizes.items():
            shapes[FAMILY.layer_weights[key].format(i=layer)] = shape
    program = build_program(spec, FAMILY, StageConfig(64, 16, True, (32,)), shapes)
    verify_module(program)
    assert "block_cache_1_32" in program.functions and "block_kv_1" in program.functions
    text = print_module(program)
    assert print_module(parse_module(text)) == text


# ------------------------------------------------------------------------------------ verifier


def _rename(op: Operation) -> None:
    op.name = "top.Frobnicate"


def _drop_operand(op: Operation) -> None:
    op.operands.pop()


def _drop_q_head(op: Operation) -> None:
    del op.attrs["q_head"]


def _string_bool(op: Operation) -> None:
    op.attrs["right_transpose"] = "yes"


def _float_shape(op: Operation) -> None:
    op.attrs["shape"] = [1, 512, 9, 64.0]


def _bad_mode(op: Operation) -> None:
    op.attrs["mode"] = "sideways"


def _unknown_attr(op: Operation) -> None:
    op.attrs["alpha"] = 1.0


def _wrong_result(op: Operation) -> None:
    op.results[0].type = tensor(1, 512, 577)


def _bad_heads(op: Operation) -> None:
    op.attrs["kv_head"] = 2


VERIFIER_CASES: list[tuple[str, str, Callable[[Operation], None], str]] = [
    # op name, loc suffix, mutation, expected problem (the text after "op #N name loc(...): ")
    ("top.Add", "residual_attn", _rename, "unknown op"),
    ("top.Add", "residual_mlp", _drop_operand, "expected 2 operands, got 1"),
    ("top.FAttention", "attention", _drop_q_head, "missing attribute 'q_head'"),
    ("top.MatMul", "q_proj", _string_bool, "attribute 'right_transpose': expected bool, got 'yes'"),
    ("top.Reshape", "heads", _float_shape, "attribute 'shape': expected ints, got [1, 512, 9, 64.0]"),
    ("top.Rope", "rope_q", _bad_mode,
     "attribute 'mode': expected one of 'contiguous_halves', 'interleaved_pairs', got 'sideways'"),
    ("top.RMSNorm", "input_layernorm", _unknown_attr, "unknown attribute 'alpha' (known: eps)"),
    ("top.MatMul", "v_proj", _wrong_result,
     "result type (tensor<1x512x577xf32>) does not match the inferred (tensor<1x512x192xf32>)"),
    ("top.FAttention", "attention", _bad_heads, "heads do not match q_head=9, kv_head=2"),
]


@pytest.mark.parametrize(("op_name", "loc", "mutate", "problem"), VERIFIER_CASES,
                         ids=[c[2].__name__.strip("_") for c in VERIFIER_CASES])
def test_verifier_names_function_op_and_loc(text: str, op_name: str, loc: str,
                                            mutate: Callable[[Operation], None], problem: str) -> None:
    copy = fresh(text)
    function = copy["block_kv_7"]
    full_loc = f"layers.7.{loc}"
    index, op = find_op(function, op_name, full_loc)
    mutate(op)
    with pytest.raises(VerifyError) as info:
        verify_module(copy)
    message = str(info.value)
    where = f'@block_kv_7: op #{index} {op.name} loc("{full_loc}")'
    assert message.startswith(where), message
    assert problem in message, message


def test_verifier_catches_use_before_definition(text: str) -> None:
    copy = fresh(text)
    ops = copy["block_3"].ops
    index, _ = find_op(copy["block_3"], "top.Gather", "layers.3.rope_cos")
    ops[index - 1], ops[index] = ops[index], ops[index - 1]  # the Gather now precedes its table
    with pytest.raises(VerifyError,
                       match=r'@block_3: op #0 top.Gather loc\("layers.3.rope_cos"\): operand used before'):
        verify_module(copy)


def test_unknown_op_in_text_parses_then_fails_verification(text: str) -> None:
    """`topq ir check` flow: the generic form parses any op name; the verifier rejects unknown ones."""
    bad = text.replace('"top.Softmax"', '"top.Softmaks"')
    parsed = parse_module(bad)
    with pytest.raises(VerifyError, match=r'@attribute_zoo: op #8 top.Softmaks loc\("softmax"\): unknown op'):
        verify_module(parsed)


# ------------------------------------------------------------------------------------ parser errors

SMALL = """\
module {
  func.func @f(%arg0: tensor<2x4xf32>) -> tensor<2x4xf32> {
    %0 = "top.SiLU"(%arg0) : (tensor<2x4xf32>) -> tensor<2x4xf32> loc("a")
    %1 = "top.Add"(%0, %arg0) : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    return %1 : tensor<2x4xf32>
  }
}
"""

PARSER_CASES = [
    # replace old → new once; expected message fragment, line, column
    ('"top.Add"(%0,', '"top.Add"(%7,', "use of undefined value %7", 4, 20),
    ("%1 = ", "%0 = ", "value %0 is defined twice", 4, 5),
    ("%arg0: tensor<2x4xf32>", "%arg0: tensor<2x4xq7>", "unknown element type 'q7'", 2, 23),
    ("-> tensor<2x4xf32> loc", "-> tensor<2x4> loc", "not a type: 'tensor<2x4>'", 3, 51),
    ("%1 : tensor<2x4xf32>", "%1 : tensor<2x4xi32>", "return operand types do not match in @f", 5, 5),
    ('"top.SiLU"(%arg0) :', '"top.SiLU"(%arg0) ; ', "unexpected character ';'", 3, 28),
]


def test_small_text_is_valid() -> None:
    module = parse_module(SMALL)
    verify_module(module)
    assert print_module(module) == SMALL


@pytest.mark.parametrize(("old", "new", "message", "line", "column"), PARSER_CASES)
def test_parser_errors_have_line_and_column(old: str, new: str, message: str, line: int, column: int) -> None:
    assert old in SMALL
    with pytest.raises(IRParseError) as info:
        parse_module(SMALL.replace(old, new, 1), "small.mlir")
    assert (info.value.line, info.value.column) == (line, column), str(info.value)
    assert str(info.value).startswith(f"small.mlir:{line}:{column}: ")
    assert message in str(info.value)


def test_parser_error_position_deep_in_a_big_module(text: str) -> None:
    """Positions stay exact thousands of lines in (the layer-30 decode function)."""
    start = text.index("func.func @block_cache_30(")
    target = text.index('"top.FAttention"(%15, %17', start)
    use = target + len('"top.FAttention"(')
    bad = text[:use] + "%999" + text[use + 3:]
    with pytest.raises(IRParseError, match="use of undefined value %999") as info:
        parse_module(bad)
    assert info.value.line == text.count("\n", 0, use) + 1 > 2500
    assert info.value.column == use - text.rfind("\n", 0, use)


# ------------------------------------------------------------------------------------ rewriting


def drop_multiply_by_one(op: Operation, rewriter: Rewriter) -> bool:
    if op.attrs.get("const_val") != 1.0:
        return False
    rewriter.replace(op, [op.operands[0]])
    return True


def add_self_to_double(op: Operation, rewriter: Rewriter) -> bool:
    x, y = op.operands
    if x is not y:
        return False
    rewriter.replace(op, [rewriter.builder.top.MulConst(x, const_val=2.0, loc=op.loc)])
    return True


PATTERNS = {"top.MulConst": [drop_multiply_by_one], "top.Add": [add_self_to_double]}


def _rewrite_input() -> Module:
    b = Builder()
    with b.function("f", tensor(2, 4)) as f:
        (x,) = f.args
        one = b.top.MulConst(x, const_val=1.0, loc="one")
        doubled = b.top.Add(one, one, loc="double")  # Add(x, x) once `one` is gone
        again = b.top.MulConst(doubled, const_val=1.0)
        quad = b.top.Add(again, again, loc="double2")
        kept = b.top.Add(quad, x, loc="kept")  # different operands: stays an Add
        f.returns(b.top.MulConst(kept, const_val=3.0, loc="three"), one)
    return b.module


REWRITTEN = """\
module {
  func.func @f(%arg0: tensor<2x4xf32>) -> (tensor<2x4xf32>, tensor<2x4xf32>) {
    %0 = "top.MulConst"(%arg0) {const_val = 2.0 : f64} : (tensor<2x4xf32>) -> tensor<2x4xf32> loc("double")
    %1 = "top.MulConst"(%0) {const_val = 2.0 : f64} : (tensor<2x4xf32>) -> tensor<2x4xf32> loc("double2")
    %2 = "top.Add"(%1, %arg0) : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32> loc("kept")
    %3 = "top.MulConst"(%2) {const_val = 3.0 : f64} : (tensor<2x4xf32>) -> tensor<2x4xf32> loc("three")
    return %3, %arg0 : tensor<2x4xf32>, tensor<2x4xf32>
  }
}
"""


def test_rewrite_table_reaches_fixed_point() -> None:
    module = _rewrite_input()
    verify_module(module)
    assert apply_patterns(module, PATTERNS) == 1  # one changing sweep, then a clean one
    verify_module(module)
    assert print_module(module) == REWRITTEN
    assert apply_patterns(module, PATTERNS) == 0  # already at the fixed point


def test_rewrite_without_matches_leaves_module_unchanged(module: Module, text: str) -> None:
    copy = fresh(text)
    assert apply_patterns(copy, PATTERNS) == 0
    assert print_module(copy) == text


def test_rewrite_that_never_converges_hits_the_iteration_limit() -> None:
    def rebuild_silu(op: Operation, rewriter: Rewriter) -> bool:
        rewriter.replace(op, [rewriter.builder.top.SiLU(op.operands[0], loc=op.loc)])  # always "changes"
        return True

    b = Builder()
    with b.function("f", tensor(4)) as f:
        f.returns(b.top.SiLU(f.args[0]))
    with pytest.raises(TopqError, match="did not reach a fixed point in 5 sweeps"):
        apply_patterns(b.module, {"top.SiLU": [rebuild_silu]}, max_iterations=5)


# ------------------------------------------------------------------------------------ docs


def test_every_top_op_is_documented_in_ir_md() -> None:
    docs = (REPO / "docs" / "ir.md").read_text(encoding="utf-8")
    top_ops = [n for n in CATALOGUE if n.startswith("top.")]
    assert len(top_ops) >= 20
    regenerate = "regenerate: python -m tests.helpers.ir_gen --op-table"
    undocumented = [n for n in top_ops if f"| `{n}` |" not in docs]
    assert not undocumented, f"docs/ir.md has no op-table row for {undocumented}; {regenerate}"
    stale = [row for row in op_table_rows() if row not in docs]
    assert not stale, f"docs/ir.md op table is out of date; {regenerate}\n" + "\n".join(stale)


def test_ir_md_examples_parse_and_verify() -> None:
    docs = (REPO / "docs" / "ir.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```mlir\n(.*?)```", docs, flags=re.S)
    assert blocks, "docs/ir.md should show the textual form in an ```mlir block"
    for block in blocks:
        module = parse_module(block, "docs/ir.md")
        verify_module(module)
        assert print_module(parse_module(print_module(module))) == print_module(module)


# Printer outputs that did not parse back when these tests were written (print → parse must always work).
PRINTER_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "attribute name with a space": ("f", {"a b": 1}),
    "nested dict key with a dash": ("f", {"x": {"a-b": 1}}),
    "non-finite float in an array": ("f", {"x": [math.inf, 1.0]}),
    "function name with a dash": ("block-0", {}),
}


@pytest.mark.parametrize(("name", "attrs"), list(PRINTER_CASES.values()), ids=list(PRINTER_CASES))
def test_printed_text_always_parses_back(name: str, attrs: dict[str, Any]) -> None:
    b = Builder()
    with b.function(name, tensor(2), attrs=attrs) as f:
        f.returns(b.top.SiLU(f.args[0]))
    text = print_module(b.module)
    parsed = parse_module(text)
    assert same_attr(parsed[name].attrs, attrs)
    assert print_module(parsed) == text


def test_long_string_literal_parses_in_bounded_memory() -> None:
    """A 5 MB string attribute once took ~290 bytes of parser memory per character (regex backtracking state);
    the tokenizer now consumes runs of plain characters at once. Measured in a fresh process (peak RSS)."""
    import subprocess
    import sys

    program = (
        "import resource\n"
        "from topq.ir.parser import parse_module\n"
        "text = 'func.func @f() -> (tensor<1xf32>) {\\n  %0 = \"top.Weight\"() {name = \"' + 'a' * 5_000_000 + "
        "'\"} : () -> tensor<1xf32>\\n  return %0 : tensor<1xf32>\\n}\\n'\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "module = parse_module(text)\n"
        "assert len(next(iter(module)).body.ops[0].attrs['name']) == 5_000_000\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) < 100, f"parsing a 5 MB literal took {out.stdout.strip()} MiB more"
