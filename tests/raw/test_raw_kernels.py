"""Raw kernels: the @kernel frontend, kernel IR, host execution (direct and as top.DSLRegion), errors, recipe
substitution on SmolLM2, and the example plugin's raw-kernel family.

Numerics are exact: a kernel must equal numpy's float32 result for the same operation order, bit for bit.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from data_paths import REPO
from smol_model import smol_path

import topq.core.plugins
from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.plugins import build_plugins
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session
from topq.ir.builder import Builder
from topq.ir.interpreter import Interpreter
from topq.ir.parser import parse_module
from topq.ir.printer import print_module
from topq.ir.types import TensorType
from topq.ir.verifier import verify_module
from topq.raw import InOut, Input, Num, exp, kernel, raw_call, rsqrt
from topq.raw.substitute import load_kernel

HERE = Path(__file__).resolve()
F32 = np.float32


# ------------------------------------------------------------------------------------------------ kernels


@kernel
def silu(x: Input["tensor<?x?xf32>"], y: InOut["tensor<?x?xf32>"]) -> None:
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            v = x[i, j]
            y[i, j] = v / (1.0 + exp(-v))


@kernel
def rms_norm(x: Input["tensor<?x?xf32>"], w: Input["tensor<?xf32>"], y: InOut["tensor<?x?xf32>"],
             eps: Num["f32"]) -> None:
    n = x.shape[1]
    for i in range(x.shape[0]):
        acc = 0.0
        for j in range(n):  # a loop-carried running sum: scf.for iter_args
            v = x[i, j]
            acc = acc + v * v
        r = rsqrt(acc / n + eps)
        for j in range(n):
            y[i, j] = x[i, j] * r * w[j]


@kernel
def leaky_relu(x: Input["tensor<?x?xf32>"], y: InOut["tensor<?x?xf32>"], slope: Num["f32"]) -> None:
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            v = x[i, j]
            if v > 0.0:
                r = v
            else:
                r = v * slope
            y[i, j] = r


@kernel
def clamp(x: Input["tensor<?x?xf32>"], y: InOut["tensor<?x?xf32>"], lo: Num["f32"], hi: Num["f32"]) -> None:
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            v = x[i, j]
            if v < lo:
                v = lo
            elif v > hi:
                v = hi
            y[i, j] = v


@kernel
def cumsum(x: Input["tensor<?xf32>"], y: InOut["tensor<?xf32>"]) -> None:
    """y[i] reads y[i - 1]: a dependence through memory, so the loop must not be vectorised."""
    y[0] = x[0]
    for i in range(1, x.shape[0]):
        y[i] = y[i - 1] + x[i]


@kernel
def decay_rows(x: Input["tensor<?x?xf32>"], y: InOut["tensor<?x?xf32>"]) -> None:
    """Row i reads row i - 1: the j loops may run as one numpy op each, the i loop must run in order."""
    for j in range(x.shape[1]):
        y[0, j] = x[0, j]
    for i in range(1, x.shape[0]):
        for j in range(x.shape[1]):
            y[i, j] = y[i - 1, j] * 0.5 + x[i, j]


@kernel
def row_min_max(x: Input["tensor<?x?xf32>"], lo: InOut["tensor<?xf32>"], hi: InOut["tensor<?xf32>"]) -> None:
    for i in range(x.shape[0]):
        a = x[i, 0]
        b = a
        for j in range(1, x.shape[1]):
            a = min(a, x[i, j])
            b = max(b, x[i, j])
        lo[i] = a
        hi[i] = b


@kernel
def shift_rows_down(x: Input["tensor<?x?xf32>"], y: InOut["tensor<?x?xf32>"]) -> None:
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            y[i + 1, j] = x[i, j]  # the last row lands past the end: an out-of-bounds store


def silu_ref(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(120) = inf gives the right limit -0.0
        return x / (F32(1) + np.exp(-x))


def rms_norm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    acc = np.zeros(x.shape[0], F32)
    for j in range(x.shape[1]):  # left to right, as the kernel sums
        acc = acc + x[:, j] * x[:, j]
    r = F32(1) / np.sqrt(acc / F32(x.shape[1]) + F32(eps))
    return x * r[:, None] * w


def leaky_ref(x: np.ndarray, slope: float) -> np.ndarray:
    return np.where(x > 0, x, x * F32(slope))


class Case(NamedTuple):
    kernel: Any
    inputs: Callable[[np.random.Generator], list[np.ndarray]]  # arrays for the Input parameters
    nums: dict[str, float]
    reference: Callable[..., np.ndarray]


def _activations(rng: np.random.Generator) -> np.ndarray:
    x = (rng.standard_normal((5, 48)) * 4).astype(F32)
    x[0, :4] = [-120.0, 120.0, 0.0, -0.0]  # exp overflow to inf, and signed zeros
    return x


CASES = {
    "silu": Case(silu, lambda rng: [_activations(rng)], {}, silu_ref),
    "rms_norm": Case(rms_norm, lambda rng: [_activations(rng), rng.standard_normal(48).astype(F32)],
                     {"eps": 1e-5}, lambda x, w: rms_norm_ref(x, w, 1e-5)),
    "leaky_relu": Case(leaky_relu, lambda rng: [_activations(rng)], {"slope": 0.01},
                       lambda x: leaky_ref(x, 0.01)),
}


def call_args(case: Case, inputs: list[np.ndarray]) -> list[Any]:
    """Arguments in the kernel's parameter order: Inputs, then a fresh InOut, then Num values."""
    args: list[Any] = []
    inputs = list(inputs)
    for p in case.kernel.params:
        if p.kind.value == "Input":
            args.append(inputs.pop(0))
        elif p.kind.value == "InOut":
            args.append(np.full_like(args[0], np.nan))
        else:
            args.append(case.nums[p.name])
    return args


def dsl_module(case: Case, inputs: list[np.ndarray]) -> Any:
    """A Top function taking the inputs and returning the kernel's result through a top.DSLRegion."""
    b = Builder()
    types = [TensorType(a.shape, "f32") for a in inputs]
    with b.function("main", *types) as f:
        # The output buffer starts as the first input: the kernels overwrite every element.
        f.returns(raw_call(b, case.kernel, [f.args[0]], f.args, loc="raw", **case.nums))
    return b.module


# ------------------------------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_is_bit_exact_on_numpy_arrays(name: str) -> None:
    case = CASES[name]
    inputs = case.inputs(np.random.default_rng(0))
    before = [a.copy() for a in inputs]
    got = case.kernel(*call_args(case, inputs))
    want = case.reference(*inputs)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))  # -0.0 stays -0.0
    assert all(np.array_equal(a, b) for a, b in zip(inputs, before))  # Inputs are never written


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_is_bit_exact_inside_a_top_graph(name: str) -> None:
    case = CASES[name]
    inputs = case.inputs(np.random.default_rng(1))
    module = dsl_module(case, inputs)
    verify_module(module)
    text = print_module(module)
    assert '"top.DSLRegion"' in text and '"scf.for"' in text
    # The interpreter runs the region parsed back from text, as a host bundle would.
    (got,) = Interpreter(parse_module(text), lambda name: np.zeros(0)).run("main", inputs)
    assert np.array_equal(got, case.reference(*inputs))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_ir_round_trips_byte_identically(name: str) -> None:
    case = CASES[name]
    inputs = case.inputs(np.random.default_rng(2))
    text = case.kernel.ir(*call_args(case, inputs))
    module = parse_module(text)
    verify_module(module)
    assert print_module(module) == text
    function = module[case.kernel.name]
    assert str(function.input_types[0]) == "tensor<5x48xf32>"  # `?` bound from the operands
    ops = {op.name for op in function.walk()}
    assert {"scf.for", "memref.load", "memref.store", "scf.yield"} <= ops
    graph_text = print_module(dsl_module(case, inputs))
    assert print_module(parse_module(graph_text)) == graph_text


def test_reduction_and_if_lower_to_structured_ops() -> None:
    x = np.ones((2, 3), F32)
    norm_ir = rms_norm.ir(x, np.ones(3, F32), x, 1e-6)
    # acc is carried by the inner loop: scf.for with an f32 iter_arg that yields the next sum.
    assert re.search(r'= "scf\.for"\(%\d+, %\d+, %\d+, %\d+\) \(\{\n\s+\^bb0\(%arg\d+: index, %arg\d+: f32\):',
                     norm_ir)
    assert '"arith.constant"() {value = 1.0e-06 : f64} : () -> f32' in norm_ir  # the Num, specialised
    relu_ir = leaky_relu.ir(x, x, 0.5)
    assert re.search(r'= "scf\.if"\(%\d+\) \(\{', relu_ir) and '{predicate = "ogt"}' in relu_ir


def test_elif_and_builtins() -> None:
    x = _activations(np.random.default_rng(3))
    assert np.array_equal(clamp(x, x, -1.5, 2.0), np.clip(x, F32(-1.5), F32(2.0)))
    lo, hi = row_min_max(x, np.zeros(5, F32), np.zeros(5, F32))  # two InOuts: a tuple
    assert np.array_equal(lo, x.min(axis=1)) and np.array_equal(hi, x.max(axis=1))


def test_vectorisation_keeps_memory_dependences() -> None:
    x = np.random.default_rng(4).standard_normal(40).astype(F32)
    assert np.array_equal(cumsum(x, np.zeros_like(x)), np.cumsum(x, dtype=F32))  # numpy's cumsum is sequential
    x2 = x.reshape(5, 8)
    assert np.array_equal(silu(x2, x2), silu_ref(x2))
    (cumsum_spec,) = cumsum._cache.values()
    silu_spec = next(s for key, s in silu._cache.items() if key[0][0][1] == (5, 8))
    assert cumsum_spec.executor.vectorised_loops == 0  # y[i] depends on y[i - 1]: interpreted in order
    assert silu_spec.executor.vectorised_loops == 2  # both loops run as whole-array numpy ops
    want = np.zeros_like(x2)
    want[0] = x2[0]
    for i in range(1, 5):
        want[i] = want[i - 1] * F32(0.5) + x2[i]
    assert np.array_equal(decay_rows(x2, x2), want)
    (decay_spec,) = decay_rows._cache.values()
    assert decay_spec.executor.vectorised_loops == 2  # both j loops; not the i loop


def test_specialisations_are_cached_per_shape() -> None:
    k = leaky_relu
    k._cache.clear()
    a, b = np.ones((2, 3), F32), np.ones((4, 3), F32)
    k(a, a, 0.1)
    k(a * 2, a, 0.1)
    assert len(k._cache) == 1
    k(b, b, 0.1)
    k(a, a, 0.2)  # Num values are part of the specialisation
    assert len(k._cache) == 3


# ------------------------------------------------------------------------------------------------ errors


def _line_of(message: str) -> str:
    """The source line a `FILE:LINE: ...` message points at (so the test checks the line, not just a number)."""
    match = re.match(rf"{re.escape(str(HERE))}:(\d+): ", message)
    assert match, message
    return HERE.read_text(encoding="utf-8").splitlines()[int(match.group(1)) - 1]


def test_malformed_type_string() -> None:
    with pytest.raises(TopqError) as info:
        @kernel
        def bad(x: Input["tensor<4xq32>"], y: InOut["tensor<4xf32>"]) -> None:  # noqa: F821
            y[0] = x[0]
    message = str(info.value)
    assert "parameter 'x'" in message and "unknown element type 'q32'" in message
    assert "tensor<4xq32>" in _line_of(message)
    assert "\n" not in message


def test_unsupported_constructs_name_file_line_and_construct() -> None:
    with pytest.raises(TopqError) as info:
        @kernel
        def with_while(x: Input["tensor<4xf32>"], y: InOut["tensor<4xf32>"]) -> None:
            i = 0
            while i < 4:
                i += 1
    assert str(info.value).endswith("unsupported construct: while loop")
    assert "while i < 4" in _line_of(str(info.value))

    with pytest.raises(TopqError) as info:
        @kernel
        def with_comprehension(x: Input["tensor<4xf32>"], y: InOut["tensor<4xf32>"]) -> None:
            y[0] = [v for v in range(4)]
    assert str(info.value).endswith("unsupported construct: list comprehension")
    assert "[v for v in range(4)]" in _line_of(str(info.value))

    with pytest.raises(TopqError) as info:
        @kernel
        def with_unknown_call(x: Input["tensor<4xf32>"], y: InOut["tensor<4xf32>"]) -> None:
            for i in range(4):
                y[i] = softplus(x[i])  # noqa: F821
    assert str(info.value).endswith("unsupported construct: call to unknown function 'softplus'")
    assert "softplus(x[i])" in _line_of(str(info.value))


def test_shape_that_does_not_match_the_annotation() -> None:
    @kernel
    def fixed(x: Input["tensor<?x8xf32>"], y: InOut["tensor<?x8xf32>"]) -> None:
        for i in range(x.shape[0]):
            for j in range(8):
                y[i, j] = x[i, j]

    x = np.ones((4, 8), F32)
    assert np.array_equal(fixed(x, x), x)
    with pytest.raises(TopqError, match=r"argument 'x' is tensor<4x9xf32>, which does not match its annotation "
                                        r"tensor<\?x8xf32> \(.*test_raw_kernels\.py:\d+\)$"):
        fixed(np.ones((4, 9), F32), x)
    with pytest.raises(TopqError, match=r"argument 'y' is tensor<4x8xf64>"):
        fixed(x, np.ones((4, 8)))
    with pytest.raises(TopqError, match=r"argument 'x' is tensor<8xf32>"):
        silu(np.ones(8, F32), np.ones(8, F32))


def test_inout_written_out_of_bounds() -> None:
    x = np.ones((4, 8), F32)
    with pytest.raises(TopqError) as info:
        shift_rows_down(x, x)
    message = str(info.value)
    assert message.startswith("test_raw_kernels.py:")
    assert message.endswith("store to y[4, 0] is out of bounds for shape [4, 8]")
    line = int(message.split(":")[1])
    assert "y[i + 1, j] = x[i, j]" in HERE.read_text(encoding="utf-8").splitlines()[line - 1]
    # The same check guards the region inside a Top graph.
    b = Builder()
    with b.function("main", TensorType((4, 8))) as f:
        f.returns(raw_call(b, shift_rows_down, [f.args[0]], [f.args[0]]))
    with pytest.raises(TopqError, match=r"store to y\[4, 0\] is out of bounds"):
        Interpreter(b.module, lambda name: np.zeros(0)).run("main", [x])


def test_kernel_reference_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TopqError, match=r"'numpy' is not part of topq or of an installed topq plugin"):
        load_kernel("numpy:ones")  # refused before it is imported (tests/raw/test_kernel_allowlist.py)
    monkeypatch.setenv("TOPQ_KERNEL_MODULES", "no_such_module_xyz,numpy")  # as `convert --kernel-module` does
    with pytest.raises(TopqError, match=r"cannot import 'no_such_module_xyz'"):
        load_kernel("no_such_module_xyz:silu")
    with pytest.raises(TopqError, match=r"'numpy:ones' is a function, not a raw kernel"):
        load_kernel("numpy:ones")
    with pytest.raises(TopqError, match=r"must be 'module:function'"):
        load_kernel("topq.raw.library.silu")
    assert load_kernel("topq.raw.library:silu").name == "silu"


# ------------------------------------------------------------------------------------------------ SmolLM2

SMOL_STAGES: dict[str, Any] = {"seq_length": 256, "max_input_length": 64, "prefill_kv": False}
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345]
DECODE_STEPS = 4


def _convert_smol(output: Path, kernels: list[dict[str, str]]) -> Bundle:
    recipe = recipe_from_defaults(model={"path": str(smol_path())}, quant={"scheme": "f32"},
                                  target={"chip": "host"}, stages=SMOL_STAGES, output={"path": str(output)},
                                  kernels=kernels)
    from topq.core.pipeline import convert

    convert(recipe, progress=False)
    return Bundle(output)


@pytest.fixture(scope="session")
def smol_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Bundle, Bundle]:
    """SmolLM2 converted twice: with the built-in ops, and with top.SiLU replaced by a raw kernel."""
    directory = tmp_path_factory.mktemp("smol_raw")
    builtin = _convert_smol(directory / "builtin.topq", [])
    raw = _convert_smol(directory / "raw.topq",
                        [{"replace": "top.SiLU", "with": "topq.raw.library:silu"}])
    return builtin, raw


def test_smollm2_with_a_raw_silu_kernel_matches_the_builtin_op(smol_pair: tuple[Bundle, Bundle]) -> None:
    builtin, raw = smol_pair
    # The recipe's replacement decomposed every top.MLP (SiLU is fused inside) and replaced each SiLU.
    assert raw.program.count('"top.DSLRegion"') == 30 * 2  # 30 layers × (prefill, decode)
    assert '"top.SiLU"' not in raw.program and '"top.MLP"' not in raw.program
    assert '"top.MLP"' in builtin.program and '"top.DSLRegion"' not in builtin.program
    runs = [list(Session(bundle).generate(PROMPT, DECODE_STEPS + 1, stop_ids=[])) for bundle in (builtin, raw)]
    tokens = [[t for t, _ in run] for run in runs]
    assert tokens[0] == tokens[1] and len(tokens[0]) == DECODE_STEPS + 1
    diff = max(float(np.abs(a - b).max()) for (_, a), (_, b) in zip(*runs))
    print(f"\nSmolLM2 raw SiLU vs built-in: tokens {tokens[1]}, max |Δ logits| = {diff:.1e}")
    assert diff <= 1e-5, diff


# ------------------------------------------------------------------------------------------------ example plugin


def _example_raw_plugin() -> Any:
    """The example plugin's raw-kernel family module, from the source tree (the installed copy may predate it)."""
    path = REPO / "examples" / "topq-example-plugin" / "topq_example_plugin" / "raw_mlp.py"
    spec = importlib.util.spec_from_file_location("topq_example_plugin_raw_mlp", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_plugin_family_with_a_raw_kernel_op(tiny_host: Callable[..., Any], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    reference = tiny_host("llama")  # the built-in llama family on the same tiny checkpoint
    monkeypatch.setenv("TOPQ_LOAD_PLUGINS", "")  # the installed entry points must not register it twice
    monkeypatch.setattr(topq.core.plugins, "_PLUGINS", build_plugins(extra=(_example_raw_plugin(),)))
    stages = {"seq_length": 64, "max_input_length": 16, "decode_chunks": [16, 32]}
    recipe = recipe_from_defaults(model={"path": str(reference.checkpoint), "family": "example-llama-raw"},
                                  quant={"scheme": "f32"}, target={"chip": "host"}, stages=stages,
                                  output={"path": str(tmp_path / "raw.topq")})
    from topq.core.pipeline import convert

    convert(recipe, progress=False)
    bundle = Bundle(tmp_path / "raw.topq")
    assert bundle.meta["family"] == "example-llama-raw"
    assert '"top.DSLRegion"' in bundle.program and '"top.MLP"' not in bundle.program
    ids = [5, 17, 99, 3, 42, 8]
    got = list(Session(bundle).generate(ids, 6, stop_ids=[]))
    want = list(Session(reference.bundle).generate(ids, 6, stop_ids=[]))
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(float(np.abs(a - b).max()) for (_, a), (_, b) in zip(got, want)) <= 1e-5
