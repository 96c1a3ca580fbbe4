"""Weight-only RTN schemes (w8bf16, w4bf16, w8f16, w4f16): BM1684X's compiler formulas, guards, options."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topq.core.errors import TopqError
from topq.core.plugins import get_plugins
from topq.ir.types import round_to_dtype
from topq.plugins.quant.rtn import SCHEMES, quantize, round_half_away


def q4(w: np.ndarray, **options: object):  # type: ignore[no-untyped-def]
    return quantize(np.asarray(w, np.float32), options, bits=4, compute_dtype="bf16")


def test_schemes_are_registered_with_their_dtype_and_bits() -> None:
    schemes = get_plugins().schemes
    for name, dtype, bits in (("w8bf16", "bf16", 8), ("w4bf16", "bf16", 4), ("w8f16", "f16", 8), ("w4f16", "f16", 4)):
        s = schemes.get(name)
        assert (s.compute_dtype, s.weight_bits, s.needs_calibration) == (dtype, bits, False)
        assert {"group_size", "symmetric"} <= {o.name for o in s.options}
    assert {s.name for s in SCHEMES} == {"w8bf16", "w4bf16", "w8f16", "w4f16"}


def test_asymmetric_values_follow_the_compiler_formula() -> None:
    # one row, two groups of 4: [-1, 0, 0.5, 2] and [1, 2, 3, 4] (all positive: range not widened to 0)
    w = np.array([[-1.0, 0.0, 0.5, 2.0, 1.0, 2.0, 3.0, 4.0]], np.float32)
    q = q4(w, group_size=4)
    assert q.bits == 4 and q.group_size == 4 and not q.symmetric
    np.testing.assert_array_equal(q.scales, round_to_dtype(np.array([[3 / 15, 3 / 15]], np.float32), "bf16"))
    # zp = round(-min / scale): 1/0.2 = 5; -1/0.2 = -5 -> clamped to 0
    np.testing.assert_array_equal(q.zeros, [[5, 0]])
    s = np.float32(3) / np.float32(15)
    expected = np.clip(round_half_away(w / s) + np.repeat(q.zeros, 4, axis=1), 0, 15)
    np.testing.assert_array_equal(q.codes, expected)
    assert q.codes.dtype == np.uint8 and q.codes.max() <= 15


def test_symmetric_codes_are_signed_and_hit_the_extremes() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 128)).astype(np.float32)
    for bits in (4, 8):
        q = quantize(w, {"group_size": 32, "symmetric": True}, bits=bits, compute_dtype="f16")
        qmax = 2 ** (bits - 1) - 1
        groups = q.codes.astype(int).reshape(8, 4, 32)
        assert q.codes.dtype == np.int8 and (q.zeros == 0).all()
        assert (np.abs(groups).max(axis=-1) == qmax).all()  # the absmax maps to ±(2^(b-1) - 1)
        absmax = np.abs(w.reshape(8, 4, 32)).max(axis=-1)
        np.testing.assert_array_equal(q.scales, round_to_dtype(absmax / np.float32(qmax), "f16"))


def test_halves_round_away_from_zero_as_std_round() -> None:
    np.testing.assert_array_equal(round_half_away(np.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997], np.float32)),
                                  [1, 2, 3, -1, -3, 0])
    # w / scale = 2.5 exactly: numpy's half-to-even would give 2
    w = np.array([[0.0, 0.5, 1.25, 3.0]], np.float32)  # min 0, max 3 -> scale 0.2 (bf16-rounded later)
    q = q4(w, group_size=4)
    s = np.float32(3) / np.float32(15)
    assert q.codes[0, 2] == round_half_away(np.float32(1.25) / s)


@pytest.mark.parametrize("value", [0.0, 0.75, -3.5, 1e-3])
@pytest.mark.parametrize("symmetric", [False, True])
def test_constant_groups_do_not_divide_by_zero(value: float, symmetric: bool) -> None:
    w = np.full((2, 8), value, np.float32)
    q = q4(w, group_size=4, symmetric=symmetric)
    assert np.isfinite(q.scales).all() and (q.scales > 0).all()
    if symmetric and value:  # an ordinary symmetric group: only the scale's rounding to bf16 is lost
        np.testing.assert_allclose(q.dequantize(), w, rtol=2**-8)
    else:  # zero range: the constant is exactly representable, as the chip stores it
        np.testing.assert_array_equal(q.dequantize(), round_to_dtype(w, "bf16"))


def test_per_channel_and_group_size_errors() -> None:
    w = np.random.default_rng(1).normal(size=(4, 96)).astype(np.float32)
    for per_channel in (0, -1):
        q = q4(w, group_size=per_channel)
        assert q.group_size == 96 and q.scales.shape == (4, 1)
    with pytest.raises(TopqError, match=r"group_size 64 does not divide the input size 96"):
        q4(w, group_size=64)
    with pytest.raises(TopqError, match="quant.bits 8 does not match the scheme's 4-bit"):
        q4(w, group_size=32, bits=8)
    with pytest.raises(TopqError, match="2-D"):
        q4(w[0], group_size=32)
    with pytest.raises(TopqError, match="inf or NaN"):
        q4(np.full((2, 4), np.nan, np.float32), group_size=4)


def test_scales_are_values_of_the_compute_dtype() -> None:
    w = np.random.default_rng(2).normal(size=(16, 64)).astype(np.float32)
    for dtype, np_dtype in (("bf16", ml_dtypes.bfloat16), ("f16", np.float16)):
        q = quantize(w, {"group_size": 16}, bits=8, compute_dtype=dtype)
        np.testing.assert_array_equal(q.scales, q.scales.astype(np_dtype).astype(np.float32))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bits=st.sampled_from([4, 8]), symmetric=st.booleans(),
       group=st.sampled_from([8, 16, 32]), spread=st.floats(1e-3, 1e3))
def test_codes_and_error_bound(seed: int, bits: int, symmetric: bool, group: int, spread: float) -> None:
    """Codes are round(w / s) (+ zp) with the f32 scale of the formula, so |w - (code - zp) s| <= s / 2 inside the
    group's range; the stored (rounded) scale changes each value by at most |code - zp| * |s - stored|."""
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(3, 64)) * spread + rng.normal() * spread).astype(np.float32)
    q = quantize(w, {"group_size": group, "symmetric": symmetric}, bits=bits, compute_dtype="bf16")
    g = w.reshape(3, 64 // group, group)
    if symmetric:
        s = np.abs(g).max(-1) / np.float32(2 ** (bits - 1) - 1)
        z = np.zeros_like(s)
    else:
        s = (g.max(-1) - g.min(-1)) / np.float32(2**bits - 1)
        z = np.clip(round_half_away(-g.min(-1) / s), 0, 2**bits - 1)
    codes = q.codes.astype(np.float64).reshape(g.shape)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)
    assert codes.min() >= lo and codes.max() <= hi
    np.testing.assert_array_equal(q.zeros.reshape(z.shape), z)
    err = np.abs(g - (codes - z[..., None]) * s[..., None])
    inside = (g >= (lo - z[..., None]) * s[..., None]) & (g <= (hi - z[..., None]) * s[..., None])
    assert (err[inside] <= 0.5 * s[..., None].repeat(group, -1)[inside] * (1 + 1e-5) + 1e-30).all()
    stored = q.scales.reshape(s.shape).astype(np.float64)
    deq = q.dequantize().reshape(g.shape)
    bound = 0.5 * s[..., None] * (1 + 1e-5) + np.abs(codes - z[..., None]) * np.abs(s - stored)[..., None]
    assert (np.abs(g - deq)[inside] <= bound[inside] * (1 + 1e-6)).all()
