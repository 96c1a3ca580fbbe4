"""The int8 (W8A8) scheme: observers, the exact int8 linear, SmoothQuant, dynamic tokens, host vs bm1684x,
the calibration table and mixed precision."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from data_paths import AUSTEN
from host_bundles import TinyCheckpoint

from topq.core.errors import TopqError
from topq.ir.int8 import (
    int8_matmul,
    matmul_int8,
    quantize_bias,
    quantize_multiplier,
    quantize_multipliers,
    quantize_weight,
    requant_params,
    right_shift_round,
)
from topq.ir.reference_ops import REFERENCE_OPS
from topq.plugins.quant.int8 import smooth_factors
from topq.quant.observers import Observer, kl_threshold

# ------------------------------------------------------------------------------------------- observers


def heavy_tailed(n: int = 100_000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_t(2.5, size=(n // 64, 64)).astype(np.float32)


def test_minmax_is_the_exact_absmax_and_per_channel_max() -> None:
    x = heavy_tailed()
    obs = Observer("minmax")
    for chunk in np.array_split(x, 5):
        obs.add(chunk)
    assert obs.threshold() == float(np.abs(x).max())
    np.testing.assert_array_equal(obs.channel_absmax, np.abs(x).max(axis=0))


@pytest.mark.parametrize("p", [99.0, 99.9, 99.99])
def test_percentile_matches_numpy_within_one_bin(p: float) -> None:
    x = heavy_tailed(seed=1)
    obs = Observer("percentile", p)
    for chunk in np.array_split(x, 7):  # growing range: the histogram re-bins, counts stay exact
        obs.add(chunk)
    assert obs.hist is not None and obs.hist.sum() == x.size
    a = np.sort(np.abs(x).reshape(-1))
    t, bw = obs.threshold(), obs.bin_width
    # the value at rank p% of the count lies between the two order statistics around it (np.percentile's
    # "inverted_cdf" value and the next), up to the bin width; in a dense region that is np.percentile itself
    k = int(np.ceil(a.size * p / 100)) - 1
    assert a[k] - bw <= t <= a[min(k + 1, a.size - 1)] + bw, (t, a[k], a[k + 1], bw)
    if p <= 99.9:
        assert abs(t - float(np.percentile(a, p))) <= 2 * bw


def test_kl_clips_a_heavy_tail_but_not_a_uniform_distribution() -> None:
    x = heavy_tailed(seed=2)
    obs = Observer("kl")
    obs.add(x)
    t = obs.threshold()
    assert 0.02 * obs.absmax < t < 0.5 * obs.absmax  # the tail is cut well below max
    # a uniform |x| has no tail worth clipping: the best threshold keeps (almost) the whole range
    hist = np.full(2048, 100, dtype=np.int64)
    assert kl_threshold(hist, 1.0) >= 0.95


def test_unknown_observer_is_an_error() -> None:
    with pytest.raises(TopqError, match="unknown observer 'mse'.*minmax"):
        Observer("mse")


# ------------------------------------------------------------------------------------------- the int8 linear


def integer_linear(x: np.ndarray, codes: np.ndarray, w_scale: np.ndarray, sx: np.ndarray) -> np.ndarray:
    """Independent implementation: int64 arithmetic, round half away from zero via floor(|v| + 0.5)."""
    v = x.astype(np.float32) / sx.astype(np.float32)
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).clip(-127, 127).astype(np.int64)
    acc = q @ codes.astype(np.int64).T
    return (acc.astype(np.float64) * (sx.astype(np.float64) * w_scale.astype(np.float64))).astype(np.float32)


def test_host_int8_linear_equals_an_integer_implementation() -> None:
    rng = np.random.default_rng(3)
    w = rng.normal(size=(24, 48)).astype(np.float32)
    x = rng.normal(size=(2, 5, 48)).astype(np.float32)
    codes, w_scale = quantize_weight(w, "bf16")
    assert codes.dtype == np.int8 and np.abs(codes).max() == 127 and np.abs(codes).min() >= -127
    x[0, 0, :4] = [0.5, -1.5, 2.5, 127.5 * 0.25]  # exact halves at act_scale 0.25
    static = REFERENCE_OPS["top.MatMulInt8"]([x, codes.astype(np.float32), w_scale], {"act_scale": 0.25})[0]
    ref = integer_linear(x.reshape(-1, 48), codes, w_scale, np.float32(0.25)).reshape(2, 5, 24)
    np.testing.assert_allclose(static, ref, rtol=1e-6, atol=0)
    dynamic = REFERENCE_OPS["top.MatMulInt8"]([x, codes.astype(np.float32), w_scale], {"dynamic": True})[0]
    row_scale = (np.abs(x.reshape(-1, 48)).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    np.testing.assert_allclose(dynamic, integer_linear(x.reshape(-1, 48), codes, w_scale, row_scale).reshape(2, 5, 24),
                               rtol=1e-6, atol=0)
    float_out = x @ w.T
    assert np.linalg.norm(dynamic - float_out) / np.linalg.norm(float_out) < 0.02  # and it is a good approximation


def bm_kernel_matches_host_kernel() -> None:
    from topq.plugins.targets.bm1684x.kernels import matmul_int8 as bm

    rng = np.random.default_rng(4)
    codes, w_scale = quantize_weight(rng.normal(size=(16, 32)), "bf16")
    x = rng.normal(size=(1, 3, 32)).astype(np.float32)
    for attrs in ({"act_scale": 0.02, "dynamic": False}, {"dynamic": True}):
        host = matmul_int8(x, codes, w_scale, attrs.get("act_scale", 0.0), bool(attrs["dynamic"]))
        chip = bm([x, codes.astype(np.float32), w_scale], attrs)[0]
        np.testing.assert_allclose(chip, host, rtol=1e-6, atol=1e-6)
    # static requantization: the chip takes the compile-time multiplier / rshift / int32 bias; bit-exact
    bias = rng.normal(size=16).astype(np.float32)
    for out_scale in (0.04, 0.004):  # the second saturates many outputs
        attrs = {"act_scale": 0.02, "dynamic": False, "out_scale": out_scale}
        multiplier, rshift = requant_params(0.02, w_scale, out_scale)
        for b in (None, bias):
            host = matmul_int8(x, codes, w_scale, 0.02, False, b, out_scale=out_scale)
            extra = [] if b is None else [quantize_bias(b, 0.02, w_scale)]
            chip = bm([x, codes.astype(np.float32), multiplier, rshift, *extra], attrs)[0]
            assert chip.dtype == np.float32 and np.array_equal(chip, host)


def test_bm1684x_kernel_matches_the_host_kernel_on_the_same_inputs() -> None:
    bm_kernel_matches_host_kernel()


# ------------------------------------------------------------------------------------- static requantization
# TPU-MLIR (sophgo/tpu-mlir), BM1684X per-channel int8 MatMul: lib/Conversion/TopToTpu/BM1684X/MatMul.cpp
# (LoweringINT8, matmulPerchannelQuant: get_scale_and_shift per channel, then one common shift),
# lib/Support/MathUtils.cpp (get_scale_and_shift, RightShiftRound, applyMultiplierAndRShift: MultiplierShift,
# ROUNDING_HALF_UP), lib/Dialect/Tpu/Interfaces/Common/MatMul.cpp (fused requant, saturate to int8).


def ref_scale_and_shift(scale_f: float, bitwidth: int = 32) -> tuple[int, int]:
    """get_scale_and_shift written out for one value with Python ints and floats."""
    s = float(np.float32(scale_f))
    limit = 2**31 - 1 if bitwidth == 32 else 127
    best, shift = float(np.finfo(np.float32).max), 0
    for n in range(-32, 31):
        v = s * 2.0**n
        m = int(np.sign(v) * np.floor(abs(v) + 0.5))  # std::round
        err = float(np.float32(abs(m / 2.0**n - s)))
        if err < best and abs(m) < limit:
            best, shift = err, n
    v = s * 2.0**shift
    return int(np.sign(v) * np.floor(abs(v) + 0.5)), shift


def ref_requant_params(act_scale: float, w_scale: np.ndarray, out_scale: float) -> tuple[list[int], int]:
    r = [float(np.float32(act_scale * float(w) / out_scale)) for w in w_scale]
    for bitwidth in (32, 8):
        pairs = [ref_scale_and_shift(v, bitwidth) for v in r]
        common = max([0] + [sh for _, sh in pairs])
        mults = [m << (common - sh) for m, sh in pairs]
        if all(m < 2**31 for m in mults):
            return mults, common
    raise AssertionError("overflow")


def integer_requant_linear(x: np.ndarray, codes: np.ndarray, w_scale: np.ndarray, act_scale: float,
                           out_scale: float, bias: np.ndarray | None) -> np.ndarray:
    """Independent static W8A8 linear: int64 accumulator + int32 bias, (acc·M + 2^(s-1)) >> s, clamp to int8."""
    v = x.astype(np.float32) / np.float32(act_scale)
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).clip(-127, 127).astype(np.int64)
    acc = q @ codes.astype(np.int64).T
    if bias is not None:
        t = bias.astype(np.float64) / (w_scale.astype(np.float64) * act_scale)
        acc += (np.sign(t) * np.floor(np.abs(t) + 0.5)).astype(np.int64)
    mults, s = ref_requant_params(act_scale, w_scale, out_scale)
    prod = acc * np.array(mults, np.int64)
    code = ((prod + (1 << (s - 1))) >> s) if s > 0 else prod
    return code.clip(-128, 127).astype(np.float32) * np.float32(out_scale)


def test_quantize_multiplier_matches_hand_checked_tpu_mlir_values() -> None:
    # exact floats get the first n with zero error: the shortest multiplier
    assert quantize_multiplier(0.25) == (1, 2)
    assert quantize_multiplier(0.75) == (3, 2)
    assert quantize_multiplier(1.5) == (3, 1)  # r >= 1
    assert quantize_multiplier(3.0) == (3, 0)
    assert quantize_multiplier(0.1) == (13421773, 27)  # f32(0.1) = 13421773 · 2^-27 exactly
    # f32(3e-5)·2^28 = 8053.0634765625: n = 28, 29, 30 have the same error (the fraction only moves): first wins
    assert quantize_multiplier(3e-5) == (8053, 28)
    # r < 2^-31: every m rounds to 0 and n = -32 keeps the (equal) error: flushed to zero
    assert quantize_multiplier(2.0**-40) == (0, -32)
    assert quantize_multiplier(2.0**-31) == (0, -32)  # m = 1 at n = 30 has error 2^-31 = r: not smaller
    assert quantize_multiplier(2.0**-31 * (1 + 2.0**-23)) == (1, 30)
    # per channel: one common shift, multipliers lifted to it
    m, s = requant_params(0.5, np.array([0.5, 0.25], np.float32), 1.0)  # r = 0.25 → (1, 2), 0.125 → (1, 3)
    assert m.tolist() == [2, 1] and s.tolist() == [3, 3] and m.dtype == np.int32 and s.dtype == np.int8
    # r = 5 → (5, 0), r = f32(1e-6) → (537, 29): 5 << 29 overflows int32, so 8-bit multipliers:
    # 1e-6 · 2^26 = 67.1 → (67, 26) (n = 27 gives 134 > 127), 5 stays (5, 0) → common shift 26
    m, s = requant_params(1.0, np.array([5.0, 1e-6], np.float32), 1.0)
    assert quantize_multiplier(1e-6) == (537, 29)
    assert m.tolist() == [5 << 26, 67] and s.tolist() == [26, 26]


def test_quantize_multiplier_accuracy_and_independent_port() -> None:
    rng = np.random.default_rng(7)
    r = np.concatenate([10.0 ** rng.uniform(-9, 0.25, 400), rng.uniform(0.5, 8, 100)]).astype(np.float32)
    scale, shift = quantize_multipliers(r)
    for v, m, sh in zip(r.tolist(), scale.tolist(), shift.tolist()):
        assert (m, sh) == ref_scale_and_shift(v)
        assert 0 <= m < 2**31
        # the n = 30 candidate bounds the error by 2^-31 while it fits int32, else by r · 2^-30
        assert abs(m * 2.0**-sh - v) <= max(2.0**-31, v * 2.0**-30) * (1 + 2.0**-20), (v, m, sh)
    assert all(ref_scale_and_shift(v, 8) == tuple(map(int, quantize_multipliers(np.float32(v), 8)))
               for v in r[:50].tolist())
    w_scale = (rng.uniform(0.5, 2, 64) * 1e-3).astype(np.float32)
    m, s = requant_params(0.031, w_scale, 0.07)
    mults, common = ref_requant_params(0.031, w_scale, 0.07)
    assert m.tolist() == mults and set(s.tolist()) == {common}
    r = 0.031 * w_scale.astype(np.float64) / 0.07  # float r is r rounded to f32, then within 2^-31 of it
    np.testing.assert_allclose(m * 2.0 ** -s.astype(np.float64), r, rtol=2**-24, atol=2**-31)


def test_host_static_requant_linear_equals_an_integer_implementation() -> None:
    rng = np.random.default_rng(8)
    codes, w_scale = quantize_weight(rng.normal(size=(24, 48)), "bf16")
    x = rng.normal(size=(2, 5, 48)).astype(np.float32)
    x[0, 0, :4] = [0.5, -1.5, 2.5, 127.5 * 0.25]  # exact halves at act_scale 0.25
    bias = rng.normal(size=24).astype(np.float32)
    bias[:2] = [40.0, -40.0]  # saturates channels 0 and 1 (to 127 and -128)
    op = REFERENCE_OPS["top.MatMulInt8"]
    for out_scale in (0.05, 0.2):
        for b in (None, bias):
            attrs = {"act_scale": 0.25, "out_scale": out_scale}
            got = op([x, codes.astype(np.float32), w_scale, *([] if b is None else [b])], attrs)[0]
            want = integer_requant_linear(x.reshape(-1, 48), codes, w_scale, 0.25, out_scale, b).reshape(2, 5, 24)
            assert got.dtype == np.float32 and np.array_equal(got, want), (out_scale, b is None)
    codes_out = got / np.float32(0.2)
    assert (codes_out[..., 0] == 127).all() and (codes_out[..., 1] == -128).all()
    assert (np.abs(codes_out[..., 2:]) < 127).mean() > 0.5  # most others are in range at out_scale 0.2
    # dynamic (or out_scale 0) keeps the float dequantization, whatever out_scale says
    dyn = op([x, codes.astype(np.float32), w_scale], {"dynamic": True, "out_scale": 0.05})[0]
    np.testing.assert_array_equal(dyn, matmul_int8(x, codes, w_scale, 0.0, True))


def test_int8_matmul_is_exact_beyond_float32s_integer_range() -> None:
    """`int8_matmul` sums in float32 chunks of ≤ 1024 terms: the int64 sums, also for K past float32's exact
    integers (2100 · 2^14 > 2^24), for the K of every SmolLM2 linear and odd ones."""
    rng = np.random.default_rng(9)
    for k in (48, 576, 1024, 1536, 2100):
        qx = rng.integers(-128, 128, size=(7, k))
        codes = rng.integers(-128, 128, size=(5, k)).astype(np.int8)
        qx[0], codes[0] = -128, -128  # the largest product everywhere: one row sums to k · 2^14
        want = qx.astype(np.int64) @ codes.astype(np.int64).T
        got = int8_matmul(qx.astype(np.float32), codes)
        assert got.dtype == np.float64 and np.array_equal(got.astype(np.int64), want), k
        exact = int8_matmul(qx.astype(np.float32), codes, np.int64)  # the static path's accumulators
        assert exact.dtype == np.int64 and np.array_equal(exact, want), k


def test_the_scheme_interpreters_are_freed_without_the_cyclic_gc(tiny: dict[str, Any]) -> None:
    """The observing and error-report interpreters hold a whole float model's weights: they must go when their
    last reference does. A bound method of their own as the interpreter's tap made a reference cycle, and the
    observation pass's weights (~460 MB at SmolLM2) lived on through the mixed-precision search."""
    import gc
    import weakref

    from topq.core.pipeline import load_model
    from topq.plugins.quant.int8 import _ErrorInterpreter, _ObserveInterpreter

    module = load_model(recipe_for(tiny, "int8")).module
    gc.disable()
    try:
        makers = (lambda: _ObserveInterpreter(module, lambda n: np.zeros(1), {}, {}, {}),
                  lambda: _ErrorInterpreter(module, lambda n: np.zeros(1), {}, lambda n, x: x))
        for make in makers:
            interp = make()
            ref = weakref.ref(interp)
            del interp
            assert ref() is None, type(ref()).__name__
    finally:
        gc.enable()


def test_the_error_report_holds_one_layers_float_weights_at_a_time(tiny: dict[str, Any]) -> None:
    """The error report runs every window through one layer, then the next: when it reads a layer's weights, no
    other layer's are alive (they go with the layer's interpreters, without the cyclic GC). Its rows are those of
    the conversion, and the same on two threads."""
    import gc
    import re
    import weakref

    from topq.core.pipeline import load_model
    from topq.plugins.quant.int8 import Int8Plan, _linear_names, calibrate, error_report
    from topq.quant.calibration import calibration_windows

    recipe = recipe_for(tiny, "int8", name="report_by_layer")
    model = load_model(recipe)
    linears = _linear_names(model)
    result = calibrate(model, recipe)
    plan = Int8Plan.from_yaml(result.state["int8_table"], "test")
    store = model.checkpoint.weights

    class Tracked:  # the store, counting the layers whose weights it handed out and that are still alive
        def __init__(self) -> None:
            self.alive: dict[int, int] = {}  # id(array) → layer
            self.most, self.read = 0, set()

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def get(self, name: str) -> np.ndarray:
            array = np.array(store.get(name))
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            if layer:
                self.alive[id(array)] = int(layer[1])
                weakref.finalize(array, self.alive.pop, id(array))
                self.read.add(int(layer[1]))
                self.most = max(self.most, len(set(self.alive.values())))
            return array

    windows = calibration_windows(model, recipe)
    for jobs in (1, 2):
        tracked = model.checkpoint.weights = Tracked()
        gc.disable()
        try:
            rows = error_report(model, plan, linears, windows, False, result, jobs)
        finally:
            gc.enable()
        assert tracked.read == set(range(model.spec.num_layers)) and model.spec.num_layers >= 2
        assert tracked.most == 1, tracked.most
        assert rows == result.report


def test_the_search_holds_its_linears_in_the_spill_and_bf16_in_bf16(tiny: dict[str, Any],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The mixed-precision search keeps each linear's int8 codes and its bf16 form (a bf16 array: half of
    float32's memory, 200 MB at SmolLM2, widened exactly per product) in the spill, one map per layer and form,
    and releases a layer's pages after running it."""
    import ml_dtypes

    from topq.core.pipeline import convert
    from topq.plugins.quant import int8
    from topq.quant.spill import mapping_of

    held: list[Any] = []
    released: list[int] = []
    init, release = int8._SearchForms.__init__, int8._SearchForms.release

    def spy(self: Any, *args: Any) -> None:
        held.append(self)
        init(self, *args)

    def spy_release(self: Any, layer: int) -> None:
        released.append(layer)
        release(self, layer)

    monkeypatch.setattr(int8._SearchForms, "__init__", spy)
    monkeypatch.setattr(int8._SearchForms, "release", spy_release)
    convert(recipe_for(tiny, "int8", name="mixed-bf16", table=str(tiny["root"] / "mixed-bf16.yaml"), budget=1.0,
                       calibration={"samples": 8}), progress=False)
    [forms] = held
    floats = forms._bf16
    assert len(floats) == len(forms.codes) == 14 and all(w.dtype == ml_dtypes.bfloat16 for w in floats.values())
    layers = sorted(forms._names)
    assert layers == [0, 1] and set(released) == set(layers)
    for form in (floats, {n: codes for n, (codes, _) in forms.codes.items()}):
        maps = {layer: {id(mapping_of(form[n])) for n in forms._names[layer]} for layer in layers}
        assert all(len(ids) == 1 and None not in {mapping_of(form[n]) for n in forms._names[layer]}
                   for layer, ids in maps.items())  # one map per layer
        assert maps[0] != maps[1]


def test_right_shift_round_is_tpu_mlirs_formula() -> None:
    """`(v >> s) + ((v & (2^s − 1)) ≥ 2^(s−1))` for s > 0, v for s = 0, v << −s for s < 0, per channel."""
    rng = np.random.default_rng(10)
    v = rng.integers(-2 ** 52, 2 ** 52, size=(50, 64))
    v[0] = np.arange(-32, 32)  # ties at every small shift
    for shift in (0, 1, 5, 31, np.full(64, 7), rng.integers(-3, 40, size=64)):
        s = np.broadcast_to(np.asarray(shift, dtype=np.int64), v.shape)
        pos = np.maximum(s, 0)
        formula = np.where(s > 0, (v >> pos) + ((v & ((1 << pos) - 1)) >= (1 << np.maximum(pos - 1, 0))), v)
        want = np.where(s < 0, v << np.maximum(-s, 0), formula)
        np.testing.assert_array_equal(right_shift_round(v, shift), want)
        in_place = v.copy()  # `out=v`: requantize's path, also where some shifts are negative
        assert right_shift_round(in_place, shift, out=in_place) is in_place
        np.testing.assert_array_equal(in_place, want)


def test_bm1684x_program_with_static_requant_matches_host_bit_exactly() -> None:
    """A hand-built Top module (requantizing linears with and without bias, a dynamic one) whose weights' int8
    values come from the scheme contract (`CompileJob.quantized`), compiled for bm1684x and for the host: the
    bm1684x lowering computes multiplier / rshift / bias_q tensors, the host lowers to `top.MatMulInt8` on the
    codes, and the emulator equals the host after the op-boundary bf16 rounding, bit for bit (the dynamic linear:
    float dequantization, unchanged)."""
    import ml_dtypes

    from topq.core.plugins import get_plugins
    from topq.core.quant import QuantizedWeight
    from topq.core.target import CompileJob
    from topq.ir.builder import Builder
    from topq.ir.interpreter import Interpreter
    from topq.ir.parser import parse_module
    from topq.ir.printer import print_module
    from topq.ir.types import TensorType
    from topq.ir.verifier import verify_module
    from topq.plugins.targets.bm1684x.compiler import compile_model
    from topq.plugins.targets.bm1684x.emulator import Emulator
    from topq.plugins.targets.bm1684x.spec import BM1684X
    from topq.plugins.targets.host import compile_host

    rng = np.random.default_rng(9)
    n, k = 40, 64
    values: dict[str, QuantizedWeight] = {}
    for name in ("a", "b", "c"):
        codes, w_scale = quantize_weight(rng.normal(size=(n, k)), "bf16")
        values[name] = QuantizedWeight(codes, w_scale[:, None], np.zeros((n, 1), np.float32), 8, k, True)
    weights = {name: q.dequantize() for name, q in values.items()}
    # a bias a bf16 checkpoint holds: the host bundle stores it in the compute dtype, bm1684x quantizes it to int32
    weights["a.bias"] = (rng.normal(size=n) * 4).astype(ml_dtypes.bfloat16).astype(np.float32)
    b = Builder()
    functions = {"with_bias": ("a", {"act_scale": 0.021, "out_scale": 0.043}),
                 "saturating": ("b", {"act_scale": 0.019, "out_scale": 0.011}),
                 "dynamic": ("c", {"dynamic": True, "out_scale": 0.05})}
    for fname, (w, attrs) in functions.items():
        with b.function(fname, TensorType((1, 7, k))) as f:
            operands = [f.args[0], b.weight(w, TensorType((n, k)))]
            if f"{w}.bias" in weights:
                operands.append(b.weight(f"{w}.bias", TensorType((n,))))
            f.returns(b.top.A8MatMul(*operands, loc=fname, **attrs))
    text = print_module(b.module)

    def job() -> CompileJob:
        return CompileJob(module=parse_module(text), spec=None, weights=weights.__getitem__,  # type: ignore[arg-type]
                          scheme=get_plugins().schemes.get("int8"), quant_options={}, recipe={},
                          quantized=values.get, quant_spec=lambda name: values[name].spec if name in values else None)

    compiled = compile_model(job(), BM1684X)
    assert compiled.manifest["a.multiplier"] == TensorType((n,), "i32")
    assert compiled.manifest["a.rshift"] == TensorType((n,), "i8")
    assert compiled.manifest["a.bias_q"] == TensorType((n,), "i32")
    assert compiled.manifest["a.qweight"] == TensorType((n, k), "i8")
    assert "b.multiplier" in compiled.manifest and "b.bias_q" not in compiled.manifest
    assert "a.wscale" not in compiled.manifest and "c.wscale" in compiled.manifest  # only the float path ships it
    tensors = dict(compiled.produce(list(compiled.manifest)))
    np.testing.assert_array_equal(tensors["a.qweight"], values["a"].codes)
    m, s = requant_params(0.021, values["a"].scales[:, 0], 0.043)
    np.testing.assert_array_equal(tensors["a.multiplier"], m)
    np.testing.assert_array_equal(tensors["a.rshift"], s)
    emulator = Emulator(compiled.program, tensors.__getitem__, BM1684X, checker=True)
    host_compiled = compile_host(job())
    assert set(host_compiled.manifest) == {"a.qweight", "a.wscale", "a.bias", "b.qweight", "b.wscale", "c.qweight",
                                           "c.wscale"}  # the float weights the lowering orphaned are gone
    host_tensors = dict(host_compiled.produce(list(host_compiled.manifest)))
    np.testing.assert_array_equal(host_tensors["b.qweight"], values["b"].codes.astype(np.float32))
    host = Interpreter(parse_module(host_compiled.program), host_tensors.__getitem__)

    def bf16(a: np.ndarray) -> np.ndarray:
        return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)

    for fname in functions:
        x = bf16(rng.normal(size=(1, 7, k)) * 1.5)  # the chip's activations are bf16
        got, want = emulator.run(fname, [x])[0], host.run(fname, [x])[0]
        if fname == "dynamic":
            np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
            continue
        assert np.array_equal(got, bf16(want)), fname
    codes = host.run("saturating", [bf16(rng.normal(size=(1, 7, k)) * 1.5)])[0] / np.float32(0.011)
    assert (np.abs(codes) >= 127).any() and (np.abs(codes) < 127).any()  # saturated and in-range outputs
    # the dialect checks the operands against the form the attributes select
    broken = compiled.program.replace("out_scale = 0.043 : f64", "out_scale = 0.0 : f64")
    assert broken != compiled.program
    with pytest.raises(TopqError, match=r"MatMulInt8 \(float dequantization\) takes x, codes, w_scale"):
        verify_module(parse_module(broken))
    # a weight without per-channel int8 values cannot be lowered (named)
    del values["c"]
    with pytest.raises(TopqError, match=r"dynamic: its weight must be quantized per channel to symmetric int8"):
        compile_host(job())


def test_a8_matmul_reference_on_dequantized_weights_equals_the_integer_kernel() -> None:
    """`top.A8MatMul`'s reference semantics (the scheme's int8 weight as dequantized values) and the integer
    kernel on its codes (`top.MatMulInt8`, what targets run) agree: exactly on the float path without bias, to
    float rounding with a bias, and to at most one requantized output code."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(48, 96)).astype(np.float32)
    x = rng.normal(size=(2, 5, 96)).astype(np.float32)
    bias = rng.normal(size=48).astype(np.float32)
    codes, scale = quantize_weight(w, "bf16")
    dequantized = (codes.astype(np.float32) * scale[:, None]).astype(np.float32)
    a8, int8 = REFERENCE_OPS["top.A8MatMul"], REFERENCE_OPS["top.MatMulInt8"]
    for attrs in ({"act_scale": 0.02}, {"dynamic": True}, {"act_scale": 0.02, "out_scale": 0.05}):
        for extra in ([], [bias]):
            got = a8([x, dequantized, *extra], attrs)[0]
            want = int8([x, codes.astype(np.float32), scale, *extra], attrs)[0]
            if "out_scale" in attrs:
                assert np.abs(got - want).max() <= 0.05 * 1.0001 and (got != want).mean() < 0.01
            elif extra:
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
            else:
                np.testing.assert_array_equal(got, want)


def outlier_problem(seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Activations with a few huge channels (as LLM norms produce) and varying token magnitudes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(256, 128)).astype(np.float32)
    x[:, [3, 40, 77]] *= 60.0
    x *= rng.lognormal(0, 0.8, size=(256, 1)).astype(np.float32)
    w = (rng.normal(size=(64, 128)) * 0.1).astype(np.float32)
    return x, w


def int8_error(x: np.ndarray, w: np.ndarray, dynamic: bool, alpha: float | None = None) -> float:
    s = np.ones(x.shape[1], np.float32)
    if alpha is not None:
        s = smooth_factors(np.abs(x).max(axis=0), np.abs(w).max(axis=0), alpha)
    xs, ws = x / s, w * s
    codes, w_scale = quantize_weight(ws, "bf16")
    y = matmul_int8(xs, codes, w_scale, float(np.abs(xs).max() / 127), dynamic)
    ref = x @ w.T
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def test_smoothquant_reduces_the_error_with_outlier_channels() -> None:
    x, w = outlier_problem()
    plain, smooth = int8_error(x, w, False), int8_error(x, w, False, 0.5)
    assert smooth < 0.6 * plain, (smooth, plain)
    s = smooth_factors(np.array([4.0, 0.0, 1.0]), np.array([1.0, 1.0, 0.0]), 0.5)
    np.testing.assert_allclose(s, [2.0, 1.0, 1.0])  # max|X|^α / max|W|^(1-α); dead channels keep 1


def test_dynamic_tokens_beat_static_on_outlier_inputs() -> None:
    x, w = outlier_problem()
    assert int8_error(x, w, True) < 0.7 * int8_error(x, w, False)


# ------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> dict[str, Any]:
    """A tiny random Llama, byte-level calibration ids from EMMA, a held-out eval sequence, f32 host logits."""
    root = tmp_path_factory.mktemp("int8")
    tiny_checkpoint("llama", root / "model")
    text = (AUSTEN / "00_EMMA.txt").read_bytes()
    (root / "emma.ids").write_text(" ".join(str(b) for b in text[:6000]))
    state: dict[str, Any] = {"root": root, "eval": [int(b) for b in text[40000:40040]]}
    state["f32"] = run(state, "f32")
    return state


def recipe_for(state: dict[str, Any], scheme: str, chip: str = "host", name: str | None = None,
               calibration: dict[str, Any] | None = None, **quant: Any) -> Any:
    from topq.core.recipe import recipe_from_defaults

    tag = name or f"{scheme}_{chip}_{abs(hash(tuple(sorted(map(str, quant.items())))))}"
    cal = {"data": str(state["root"] / "emma.ids"), "samples": 4, "seq_len": 32, **(calibration or {})}
    return recipe_from_defaults(
        model={"path": str(state["root"] / "model")}, quant={"scheme": scheme, **quant, "calibration": cal},
        target={"chip": chip}, stages={"seq_length": 64, "max_input_length": 32, "prefill_kv": True,
                                       "decode_chunks": [64]},
        output={"path": str(state["root"] / f"{tag}.topq")})


def run(state: dict[str, Any], scheme: str, chip: str = "host", **quant: Any) -> np.ndarray:
    from topq.core.bundle import Bundle
    from topq.core.pipeline import convert
    from topq.core.runtime import Session

    recipe = recipe_for(state, scheme, chip, **quant)
    convert(recipe, progress=False)
    return Session(Bundle(recipe.output.path)).feed(state["eval"], all_logits=True)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("quant", [{}, {"dynamic_tokens": True}, {"smooth_alpha": 0.5}, {"observer": "percentile"},
                                   {"observer": "kl"}])
def test_host_int8_is_close_to_float(tiny: dict[str, Any], quant: dict[str, Any]) -> None:
    from topq.core.bundle import Bundle

    err = rel(run(tiny, "int8", **quant), tiny["f32"])
    assert 0.001 < err < 0.15, err  # a real perturbation, but small
    program = Bundle(recipe_for(tiny, "int8", **quant).output.path).program
    assert program.count('"top.MatMulInt8"') == 7 * 2 * 3  # 7 linears × 2 layers × 3 stage functions
    assert ("dynamic = true" in program) == bool(quant.get("dynamic_tokens"))


@pytest.mark.parametrize("quant", [{}, {"dynamic_tokens": True}, {"smooth_alpha": 0.5}])
def test_bm1684x_emulator_matches_host_per_function(tiny: dict[str, Any], quant: dict[str, Any]) -> None:
    from topq.core.bundle import Bundle
    from topq.core.plugins import get_plugins

    run(tiny, "int8", **quant)
    run(tiny, "int8", chip="bm1684x", **quant)
    host_b = Bundle(recipe_for(tiny, "int8", **quant).output.path)
    chip_b = Bundle(recipe_for(tiny, "int8", chip="bm1684x", **quant).output.path)
    assert "tpu.MatMulInt8" in chip_b.program and chip_b.tensor(
        "model.layers.0.mlp.down_proj.weight.qweight").dtype == np.int8
    from topq.ir.parser import parse_module

    static = [op for f in parse_module(host_b.program) for op in f.ops
              if op.name == "top.MatMulInt8" and not op.attrs.get("dynamic") and op.attrs.get("out_scale", 0.0) > 0]
    multipliers = [n for n in chip_b.tensor_names() if n.endswith(".multiplier")]
    assert bool(static) == bool(multipliers)  # static requant (calibrated out_scale) ships i32 multipliers
    assert all(chip_b.tensor(n).dtype == np.int32 for n in multipliers)
    plugins = get_plugins()
    host, chip = plugins.targets.get("host").open(host_b), plugins.targets.get("bm1684x").open(chip_b)
    ids = np.array([tiny["eval"][:32]], np.int32)
    positions = np.arange(32, dtype=np.int32)[None]
    h = host.run("embedding", [ids])[0]
    for i in range(2):  # each block on the host's input to it (the activations calibration saw)
        a, b = host.run(f"block_{i}", [h, positions])[0], chip.run(f"block_{i}", [h, positions])[0]
        cos = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
        # Static requantization rounds every linear's output to int8 too: where the chip's bf16 activations differ
        # from the host's f32 ones by an ulp, an output code can move by one whole step (out_scale), so the
        # per-block agreement is looser than for the float-dequantized (dynamic) path.
        assert cos >= (0.995 if static else 0.999), (i, cos)
        h = a


def test_per_linear_error_report(tiny: dict[str, Any]) -> None:
    """convert --json / bundle metadata carry one row per decoder linear: its planned mode and relative output
    error on calibration inputs; per-token dynamic scales beat one static scale on the same linears."""
    from topq.core.bundle import Bundle
    from topq.core.pipeline import convert

    reports = {}
    for tag, quant in (("static", {}), ("dynamic", {"dynamic_tokens": True})):
        recipe = recipe_for(tiny, "int8", name=f"report_{tag}", **quant)
        summary = convert(recipe, progress=False)
        assert summary["quant_report"] == Bundle(recipe.output.path).meta["quant_report"]
        reports[tag] = {r["name"]: r for r in summary["quant_report"]}
    static, dynamic = reports["static"], reports["dynamic"]
    assert len(static) == 14 and all(r["mode"] == "int8" and 0 < r["error"] < 0.2 for r in static.values())
    assert sum(r["error"] for r in dynamic.values()) < sum(r["error"] for r in static.values())


def test_calibration_table_round_trip(tiny: dict[str, Any]) -> None:
    from topq.core.bundle import Bundle
    from topq.core.pipeline import convert

    table = tiny["root"] / "calib.yaml"
    first = recipe_for(tiny, "int8", name="table_a", table=str(table), smooth_alpha=0.5)
    convert(first, progress=False)
    doc = yaml.safe_load(table.read_text())
    assert doc["observer"] == "minmax" and len(doc["layers"]) == 14 and len(doc["smooth"]) == 8
    assert all(v["mode"] == "int8" and v["act_scale"] > 0 for v in doc["layers"].values())
    # the second run reads the table: no calibration data needed, same bundle
    second = recipe_for(tiny, "int8", name="table_b", table=str(table), smooth_alpha=0.5,
                        calibration={"data": str(tiny["root"] / "missing.ids")})
    convert(second, progress=False)
    a, b = Bundle(first.output.path), Bundle(second.output.path)
    assert a.program == b.program and '"topq.int8"' in a.program or "topq.int8" in a.program
    for name in a.tensor_names():
        np.testing.assert_array_equal(a.tensor(name), b.tensor(name))
    # an edited table is obeyed: a linear switched to bf16 becomes a float matmul
    name = "model.layers.1.mlp.down_proj.weight"
    doc["layers"][name]["mode"] = "bf16"
    table.write_text(yaml.safe_dump(doc))
    third = recipe_for(tiny, "int8", name="table_c", table=str(table), smooth_alpha=0.5)
    convert(third, progress=False)
    assert Bundle(third.output.path).program.count('"top.MatMulInt8"') == 13 * 3


def test_mixed_precision_search_invariants(tiny: dict[str, Any]) -> None:
    """On a random tiny model int8 may even *lower* perplexity, so this checks the search's contract; the
    SmolLM2 benchmark (benchmarks/int8_quality.py) shows linears actually going back to bf16."""
    from topq.core.bundle import Bundle
    from topq.core.pipeline import convert

    table = tiny["root"] / "mixed.yaml"
    recipe = recipe_for(tiny, "int8", name="mixed", table=str(table), budget=1.0, calibration={"samples": 8})
    convert(recipe, progress=False)
    doc = yaml.safe_load(table.read_text())
    report = doc["mixed_precision"]
    bf16 = [n for n, v in doc["layers"].items() if v["mode"] == "bf16"]
    limit = report["budget"] * report["bf16_ppl"]
    assert report["bf16_linears"] == len(bf16)
    assert (len(bf16) >= 1) == (report["int8_ppl"] > limit)  # bf16 linears only when all-int8 misses the budget
    assert report["final_ppl"] <= limit or len(bf16) == len(doc["layers"])
    program = Bundle(recipe.output.path).program
    assert program.count('"top.MatMulInt8"') == (14 - len(bf16)) * 3
    # the search's forwards on two threads (`--jobs 2`): the same sensitivities, cut and table
    threaded = tiny["root"] / "mixed-jobs2.yaml"
    on_threads = recipe_for(tiny, "int8", name="mixed-jobs2", table=str(threaded), budget=1.0,
                            calibration={"samples": 8})
    convert(on_threads, progress=False, jobs=2)
    assert yaml.safe_load(threaded.read_text()) == doc
    # …and the same error report (its windows on the two threads, summed in window order)
    assert Bundle(on_threads.output.path).meta["quant_report"] == Bundle(recipe.output.path).meta["quant_report"]


def test_mixed_precision_evaluations_resume_from_kept_states(tiny: dict[str, Any], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The cut's evaluations start each window at a hidden state an earlier evaluation kept: the same perplexities,
    bit for bit, as evaluations from the embedding (a 6-layer model, so that late cuts differ only in deep layers)."""
    from tiny_models import build_tiny

    from topq.core.pipeline import convert
    from topq.plugins.quant import int8

    deep = {"root": tmp_path}
    build_tiny("llama", tmp_path / "model", overrides={"num_hidden_layers": 6})
    shutil.copy(tiny["root"] / "emma.ids", tmp_path / "emma.ids")
    reports = {}
    for every in (1, 1000):  # every layer's input kept / only the embedding's output (nothing to resume from)
        monkeypatch.setattr(int8, "KEEP_EVERY", every)
        table = tmp_path / f"resume-{every}.yaml"
        convert(recipe_for(deep, "int8", name=f"resume-{every}", table=str(table), budget=1.0,
                           calibration={"samples": 8}), progress=False)
        reports[every] = yaml.safe_load(table.read_text())["mixed_precision"]
    resumed, fresh = reports[1], reports[1000]
    assert resumed["cut_evaluations"] >= 4 and resumed["cut_layers_reused"] > 0 and fresh["cut_layers_reused"] == 0
    assert resumed["cut_ppl"] == fresh["cut_ppl"]
    assert resumed == {**fresh, "cut_layers_reused": resumed["cut_layers_reused"]}


def test_the_cut_keeps_only_states_it_can_resume_from(tiny: dict[str, Any], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The bracket's ends drop the states in front of layers no later evaluation resumes from (`_Evaluation.trim`):
    fewer states held, the same search (a 6-layer model, a state kept in front of every layer)."""
    from tiny_models import build_tiny

    from topq.core.pipeline import convert
    from topq.plugins.quant import int8

    deep = {"root": tmp_path}
    build_tiny("llama", tmp_path / "model", overrides={"num_hidden_layers": 6})
    shutil.copy(tiny["root"] / "emma.ids", tmp_path / "emma.ids")
    monkeypatch.setattr(int8, "KEEP_EVERY", 1)
    reports, held = {}, {}
    evaluation = int8._Evaluation
    for trimmed in (True, False):
        made: list[Any] = []

        def recorded(*args: Any, made: list[Any] = made) -> Any:
            made.append(evaluation(*args))
            return made[-1]

        monkeypatch.setattr(int8, "_Evaluation", recorded)
        if not trimmed:
            monkeypatch.setattr(evaluation, "trim", lambda self, last: None)
        table = tmp_path / f"trim-{trimmed}.yaml"
        convert(recipe_for(deep, "int8", name=f"trim-{trimmed}", table=str(table), budget=1.0,
                           calibration={"samples": 8}), progress=False)
        reports[trimmed] = yaml.safe_load(table.read_text())["mixed_precision"]
        held[trimmed] = sum(len(states) for e in made[2:] for states in e.kept)  # the cut's evaluations, as kept
    assert reports[True]["cut_evaluations"] >= 4
    assert reports[True] == reports[False]
    assert held[True] < held[False], held


def test_dynamic_tokens_without_smoothing_reads_no_statistics(tiny: dict[str, Any]) -> None:
    """Per-token scales are computed at run time: no observation pass, no static scales in the table — and such a
    table cannot be reused for static int8 (a clear error, not a zero scale)."""
    from topq.core.pipeline import convert

    table = tiny["root"] / "dynamic.yaml"
    convert(recipe_for(tiny, "int8", name="dyn_table", table=str(table), dynamic_tokens=True), progress=False)
    layers = yaml.safe_load(table.read_text())["layers"]
    assert all(v["act_scale"] == 0 and "out_scale" not in v for v in layers.values())
    with pytest.raises(TopqError, match="no static activation scale"):
        convert(recipe_for(tiny, "int8", name="dyn_reuse", table=str(table)), progress=False)


def test_errors(tiny: dict[str, Any], tmp_path: Path) -> None:
    from topq.core.pipeline import convert
    from topq.core.recipe import recipe_from_defaults

    with pytest.raises(TopqError, match="needs calibration data"):
        convert(recipe_for(tiny, "int8", calibration={"data": None}), progress=False)
    with pytest.raises(TopqError, match="not found"):
        convert(recipe_for(tiny, "int8", calibration={"data": str(tmp_path / "nope.ids")}), progress=False)
    short = tmp_path / "short.ids"
    short.write_text("1 2 3 4 5")
    with pytest.raises(TopqError, match="needs 128 tokens"):
        convert(recipe_for(tiny, "int8", calibration={"data": str(short)}), progress=False)
    with pytest.raises(TopqError, match="observer"):
        recipe_from_defaults(model={"path": "x"}, quant={"scheme": "int8", "observer": "mse"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nscheme: int8\nlayers: {a: {mode: int4, act_scale: 1}}\n")
    with pytest.raises(TopqError, match="mode must be int8 or bf16"):
        convert(recipe_for(tiny, "int8", table=str(bad)), progress=False)
