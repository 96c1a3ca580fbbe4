"""W8A8 arithmetic shared by the `int8` scheme, the host's `top.MatMulInt8` kernel and targets' emulators, and the
reference semantics of `top.A8MatMul` (`a8_matmul`: the same linear on the weight's dequantized values).

One convention everywhere (symmetric, int8 range ±127 — -128 is never produced for activations or weights, as
TPU-MLIR's symmetric int8; only the requantized output of the static path below saturates to [-128, 127]):

* weights per output channel: `w_scale[n] = absmax(W[n]) / 127` (rounded to the compute dtype by the scheme),
  `code = clamp(round(w / w_scale), -127, 127)`;
* activations per tensor (static, a calibrated `act_scale`) or per token (dynamic: `row absmax / 127` at run
  time), `q = clamp(round(x / scale), -127, 127)` computed in float32;
* `round` is C's std::round (halves away from zero), as the chip's converters;
* `y = (q_x · codesᵀ) * (scale_x * w_scale[n])`: the int8 × int8 products are summed exactly (int32 on the chip;
  float64 here, exact for K < 2^53 / 127²) and dequantized per output channel — the float path, used when the
  activations are per token (`dynamic`: the scales are run-time values, so there is no static multiplier) or the
  op has no output scale (`out_scale == 0`).

Static requantization (`dynamic=False`, `out_scale > 0`), as TPU-MLIR's BM1684X per-channel int8 MatMul computes
it (sophgo/tpu-mlir: lib/Conversion/TopToTpu/BM1684X/MatMul.cpp `MatMulLowering::LoweringINT8`, the
`matmulPerchannelQuant` branch; lib/Support/MathUtils.cpp `get_scale_and_shift`, `RightShiftRound`,
`applyMultiplierAndRShift`; lib/Dialect/Tpu/Interfaces/Common/MatMul.cpp `tpu::MatMulOp::inference`, fused
requant in `RequantMode::MultiplierShift`):

* `acc[m, n] = Σ_k q_x[m, k] · codes[n, k] + bias_q[n]` in integers, with
  `bias_q[n] = round(bias[n] / (w_scale[n] · act_scale))` (float64, std::round, saturated to int32);
* `r[n] = f32(act_scale · w_scale[n] / out_scale)` (float64 product and quotient, then rounded to float as
  TPU-MLIR's `std::vector<float> scale_f`), represented as `M[n] · 2^-s` with an int32 multiplier per channel
  and one right shift `s ≥ 0` common to all channels (`requant_params`);
* `y_code = clamp(RightShiftRound(acc · M[n], s, HALF_UP), -128, 127)` (`requantize`; int8 saturation as
  TPU-MLIR's `saturate`, so -128 is possible here), and the op's float result is `f32(y_code) · f32(out_scale)`.
"""

from __future__ import annotations

import functools

import numpy as np

from topq.ir.errors import TopqError
from topq.ir.types import round_to_dtype

QMAX = 127
F32 = np.float32


def round_half_away(x: np.ndarray) -> np.ndarray:
    """C's std::round: halves go away from zero. numpy's rint rounds halves to even; only exact halves differ, and
    they are found and fixed in x's own dtype (no float64 detour)."""
    x = np.asarray(x)
    r = np.rint(x)
    tie = np.abs(x - r) == 0.5  # x - rint(x) is exact; rint sent a tie to the even side
    if tie.any():
        r = np.where(tie, x + np.copysign(0.5, x).astype(r.dtype), r)
    return r.astype(x.dtype, copy=False)


def token_scales(x: np.ndarray) -> np.ndarray:
    """Per-row (token) scales [..., 1] in float32: row absmax / 127 (1 for an all-zero row: codes stay 0)."""
    absmax = np.abs(np.asarray(x, dtype=F32)).max(axis=-1, keepdims=True)
    return np.where(absmax > 0, absmax / F32(QMAX), F32(1)).astype(F32)


def quantize_act(x: np.ndarray, scale: np.ndarray | np.floating | float) -> np.ndarray:
    """int8 codes (as float32) of x with a broadcastable float32 scale: clamp(round(x / scale), ±127)."""
    q = round_half_away(np.asarray(x, dtype=F32) / np.asarray(scale, dtype=F32))
    return np.clip(q, -QMAX, QMAX, out=q)


def quantize_weight(w: np.ndarray, scale_dtype: str = "f32") -> tuple[np.ndarray, np.ndarray]:
    """(int8 codes [N, K], w_scale [N] float32) per output channel; the scale is rounded to `scale_dtype` first so
    the codes are computed with the value the target multiplies by."""
    w = np.asarray(w, dtype=F32)
    absmax = np.abs(w).max(axis=1)
    scale = round_to_dtype(np.where(absmax > 0, absmax / F32(QMAX), F32(1)).astype(F32), scale_dtype)
    codes = np.clip(round_half_away(w / scale[:, None]), -QMAX, QMAX).astype(np.int8)
    return codes, scale


# ------------------------------------------------------------------ static requantization (integer multiplier)

INT32_MAX = (1 << 31) - 1
INT8_MIN, INT8_MAX = -128, 127  # the requantized output saturates like TPU-MLIR's saturate(v, i8)


def uses_requant(dynamic: bool, out_scale: float) -> bool:
    """Whether a MatMulInt8 requantizes with integer multipliers: static activations and an output scale."""
    return not dynamic and float(out_scale) > 0


def quantize_multipliers(scale_f: np.ndarray | float, bitwidth: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """TPU-MLIR's `get_scale_and_shift(scale_f, scale, shift, bitwidth)` (lib/Support/MathUtils.cpp), per element.

    For n = -32 … 30: `m = (int)std::round(scale_f · 2^n)`, `err = (float)|m / 2^n − scale_f|`; the first n with
    the smallest err and `|m| < m_limit` (INT32_MAX when bitwidth is 32, else CHAR_MAX = 127) wins: shift = n,
    scale = round(scale_f · 2^n), so scale_f ≈ scale · 2^-shift. scale_f is a float (float32); the arithmetic is
    double, err is compared as float, round is std::round (halves away from zero). Consequences: an exactly
    representable scale_f gets its shortest multiplier (0.25 → (1, 2)); scale_f < 2^-31 gives (0, -32) — the
    product is flushed to zero; otherwise |scale · 2^-shift − scale_f| ≤ 2^-31 while scale_f · 2^30 < 2^31 − 1
    (scale_f < ~2), else ≤ scale_f · 2^-30. (A candidate with |m| ≥ 2^31 is undefined behaviour in C; on x86 it
    becomes INT_MIN, whose error exceeds the n = -32 candidate's, so it never wins: it is skipped here.)
    Returns (scale int64, shift int64) arrays of scale_f's shape."""
    s = np.asarray(scale_f, dtype=F32).astype(np.float64)  # float → double, as `scale_f * std::pow(2, n)`
    m_limit = INT32_MAX if bitwidth == 32 else 127
    min_err = np.full(s.shape, np.finfo(F32).max, F32)  # FLT_MAX
    shift = np.zeros(s.shape, np.int64)  # the caller's initial value (MatMul.cpp: `int scale_ = 1, shift_ = 0`)
    scale = round_half_away(s)  # = round(scale_f · 2^shift) for that shift
    for n in range(-32, 31):
        p = 2.0 ** n
        m = round_half_away(s * p)
        err = np.abs(m / p - s).astype(F32)
        better = (err < min_err) & (np.abs(m) < m_limit)
        min_err = np.where(better, err, min_err)
        shift = np.where(better, n, shift)
        scale = np.where(better, m, scale)  # scale = round(scale_f · 2^shift): the m of the winning n
    return scale.astype(np.int64), shift


def quantize_multiplier(r: float, bitwidth: int = 32) -> tuple[int, int]:
    """(M, shift) of one real multiplier r ≈ M · 2^-shift: `quantize_multipliers` for a scalar."""
    scale, shift = quantize_multipliers(np.array([r], F32), bitwidth)
    return int(scale[0]), int(shift[0])


def requant_scales(act_scale: float, w_scale: np.ndarray, out_scale: float) -> np.ndarray:
    """r[n] = f32(act_scale · w_scale[n] / out_scale): double arithmetic, rounded to float (TPU-MLIR's scale_f)."""
    w = np.asarray(w_scale, dtype=F32).astype(np.float64)
    return ((float(act_scale) * w) / float(out_scale)).astype(F32)


def requant_params(act_scale: float, w_scale: np.ndarray, out_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (multiplier int32 [N], rshift int8 [N]) for r[n] = act_scale · w_scale[n] / out_scale, as
    TPU-MLIR's BM1684X MatMul LoweringINT8 computes them for per-channel quantization (the fused requant):

    each channel gets `(scale_n, shift_n) = get_scale_and_shift(r[n], 32)`; the common right shift is
    `s = max(0, max_n shift_n)` and `M[n] = scale_n << (s − shift_n)` (same value, scale_n · 2^-shift_n =
    M[n] · 2^-s). If some M[n] does not fit int32 the search is redone with 8-bit multipliers (the source's
    `shift_limit` loop: any bitwidth but 32 means |m| < 127) and, failing again, the linear cannot be lowered.
    One deviation: TPU-MLIR accepts `M[n] == 2^31` (its test is `> 0x80000000`) and then stores it in an int;
    here that is an overflow too. rshift is s repeated per channel (the chip's per-channel operand layout)."""
    r = requant_scales(act_scale, w_scale, out_scale)
    for bitwidth in (32, 8):
        scale, shift = quantize_multipliers(r, bitwidth)
        common = max(0, int(shift.max(initial=0)))
        lift = common - shift  # ≥ 0
        multiplier = scale << np.minimum(lift, 31)  # |scale| < 2^31: no int64 overflow below a lift of 32
        overflow = (scale != 0) & ((lift >= 32) | (multiplier > INT32_MAX))
        if not overflow.any():
            return multiplier.astype(np.int32), np.full(r.shape, common, np.int8)
    raise TopqError(f"int8 requantization: the per-channel multipliers of r in [{r.min():g}, {r.max():g}] "
                    f"overflow int32 with a common shift")


def quantize_bias(bias: np.ndarray, act_scale: float, w_scale: np.ndarray) -> np.ndarray:
    """bias_q[n] = round(bias[n] / (w_scale[n] · act_scale)) in the int32 accumulator domain (TPU-MLIR's
    `bias_int32`: float64 division, std::round), saturated to int32; returned as int32 [N]."""
    b = np.asarray(bias, dtype=F32).astype(np.float64)
    q = round_half_away(b / (np.asarray(w_scale, dtype=F32).astype(np.float64) * float(act_scale)))
    return np.clip(q, -INT32_MAX - 1, INT32_MAX).astype(np.int32)


EXACT_F32_TERMS = 1 << 10  # products of two int8 values (|p| ≤ 2^14) whose sums float32 holds exactly (≤ 2^24)


def int8_matmul(qx: np.ndarray, codes: np.ndarray, dtype: type[np.generic] = np.float64) -> np.ndarray:
    """qx [M, K] · codesᵀ for integer values in [-128, 127] (any dtype), exactly, as `dtype` (float64 or int64)
    [M, N].

    float32 GEMMs over K chunks of at most EXACT_F32_TERMS columns: every partial sum is then an integer of
    magnitude ≤ 2^24, which float32 holds exactly, whatever order the BLAS adds in; the chunks add in `dtype`. The
    same integers as a float64 GEMM, at float32 speed and without a float64 copy of the codes. int8 codes are
    converted one chunk at a time (callers keep them int8: a quarter of the memory)."""
    a = np.asarray(qx, dtype=F32)
    k = a.shape[1]

    def chunk(start: int) -> np.ndarray:  # codes[:, start:start + EXACT_F32_TERMS] as float32 (a view if they are)
        return np.asarray(codes[:, start:start + EXACT_F32_TERMS], dtype=F32)

    acc = (a[:, :EXACT_F32_TERMS] @ chunk(0).T).astype(dtype)
    for start in range(EXACT_F32_TERMS, k, EXACT_F32_TERMS):
        np.add(acc, a[:, start:start + EXACT_F32_TERMS] @ chunk(start).T, out=acc,
               casting="unsafe")  # into int64: the float32 partial sums are integers
    return acc


def right_shift_round(v: np.ndarray, shift: np.ndarray | int, out: np.ndarray | None = None) -> np.ndarray:
    """TPU-MLIR's `RightShiftRound(v, shift, ROUNDING_HALF_UP)` on int64: `(v >> s) + ((v & (2^s − 1)) ≥ 2^(s−1))`
    for s > 0 (an arithmetic shift, so halves round towards +inf), v for s = 0, `v << −s` for s < 0. `out` (an
    int64 array of v's shape, v itself allowed) takes the result in place of a new array."""
    v = np.asarray(v, dtype=np.int64)
    s = np.asarray(shift, dtype=np.int64)
    pos = np.maximum(s, 0)
    # v = q·2^s + r (0 ≤ r < 2^s): (v + 2^(s−1)) >> s = q + (r ≥ 2^(s−1)), the same integer in two passes
    half = np.where(pos > 0, np.int64(1) << np.maximum(pos - 1, 0), 0)
    if (s < 0).any():  # rare (a multiplier that needed a left shift): it reads v after the rounding
        result = np.where(s < 0, v << np.maximum(-s, 0), (v + half) >> pos)
        if out is None:
            return result
        out[...] = result
        return out
    result = np.add(v, half, out=out)
    return np.right_shift(result, pos, out=result)


def requantize(acc: np.ndarray, multiplier: np.ndarray, rshift: np.ndarray) -> np.ndarray:
    """int8 output codes (int64 array) of int accumulators [..., N] with per-channel multiplier / rshift [N]:
    `clamp(RightShiftRound(acc · M[n], s[n], HALF_UP), -128, 127)` — TPU-MLIR's
    `applyMultiplierAndRShift(v, M, s)` (RequantMode::MultiplierShift, default ROUNDING_HALF_UP) then
    `saturate(v, i8)`. All integer: |acc| < 2^31 and M < 2^31, so acc · M fits int64."""
    prod = np.multiply(acc, np.asarray(multiplier, dtype=np.int64), dtype=np.int64)  # a new array: in place below
    right_shift_round(prod, np.asarray(rshift, dtype=np.int64), out=prod)
    return np.clip(prod, INT8_MIN, INT8_MAX, out=prod)


def requant_linear(qx: np.ndarray, codes: np.ndarray, multiplier: np.ndarray, rshift: np.ndarray,
                   bias_q: np.ndarray | None, out_scale: float) -> np.ndarray:
    """Static W8A8 linear on int8 activation codes qx [M, K] (integers, any dtype) and codes [N, K]:
    acc = qx · codesᵀ (+ bias_q) exactly, requantized to int8 codes, returned as f32(code) · f32(out_scale)."""
    acc = int8_matmul(qx, codes, np.int64)  # exact sums
    if bias_q is not None:
        acc += np.asarray(bias_q, dtype=np.int64)
    y_code = requantize(acc, multiplier, rshift)
    return np.multiply(y_code, F32(out_scale), dtype=F32)  # the codes are exact in float32: one rounding


@functools.lru_cache(maxsize=1024)
def _host_requant_params(act_scale: float, out_scale: float, w_scale: bytes) -> tuple[np.ndarray, np.ndarray]:
    """requant_params for the host kernel, once per (linear, scales): the search costs 63 passes over N."""
    return requant_params(act_scale, np.frombuffer(w_scale, dtype=F32), out_scale)


def matmul_int8(x: np.ndarray, codes: np.ndarray, w_scale: np.ndarray, act_scale: float, dynamic: bool,
                bias: np.ndarray | None = None, out_scale: float = 0.0) -> np.ndarray:
    """The exact W8A8 linear (host reference): float32 x [..., K], codes [N, K], w_scale [N] → float32 [..., N].
    Static with `out_scale > 0`: requantized by integer multipliers (`requant_linear`); otherwise the float path."""
    x = np.asarray(x, dtype=F32)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if uses_requant(dynamic, out_scale):
        w = np.ascontiguousarray(w_scale, dtype=F32)
        multiplier, rshift = _host_requant_params(float(act_scale), float(out_scale), w.tobytes())
        bias_q = None if bias is None else quantize_bias(bias, act_scale, w)
        qx = quantize_act(x2, F32(act_scale))
        return requant_linear(qx, codes, multiplier, rshift, bias_q, out_scale).reshape(*lead, codes.shape[0])
    sx = token_scales(x2) if dynamic else np.full((x2.shape[0], 1), act_scale, F32)
    qx = quantize_act(x2, sx)
    acc = int8_matmul(qx, codes)  # exact integer sums
    y = acc * (sx.astype(np.float64) * np.asarray(w_scale, dtype=np.float64)[None, :])
    y = y.astype(F32)
    if bias is not None:
        y += np.asarray(bias, dtype=F32)
    return y.reshape(*lead, codes.shape[0])


def a8_matmul(x: np.ndarray, w: np.ndarray, act_scale: float, dynamic: bool, bias: np.ndarray | None = None,
              out_scale: float = 0.0) -> np.ndarray:
    """`top.A8MatMul` on the weight's values w [N, K] (its int8 codes times their scales, as `dequantize()` gives
    them): the activations quantized as in `matmul_int8`, the products summed in float64 (exact when w is codes
    times per-row scales), times the activation scale; static with `out_scale > 0`, rounded to int8 output codes
    times out_scale in float. A target's integer kernel (`matmul_int8` on the codes: TPU-MLIR's multiplier and
    shift) computes the same up to the last float rounding of a sum and, requantized, an output code at a tie."""
    x = np.asarray(x, dtype=F32)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    sx = token_scales(x2) if dynamic else np.full((x2.shape[0], 1), act_scale, F32)
    acc = quantize_act(x2, sx).astype(np.float64) @ np.asarray(w, dtype=np.float64).T
    y = acc * sx.astype(np.float64)
    if uses_requant(dynamic, out_scale):
        if bias is not None:
            y += np.asarray(bias, dtype=F32).astype(np.float64)
        y_code = np.clip(round_half_away(y / float(out_scale)), INT8_MIN, INT8_MAX)
        return (y_code.astype(F32) * F32(out_scale)).reshape(*lead, w.shape[0])
    y = y.astype(F32)
    if bias is not None:
        y += np.asarray(bias, dtype=F32)
    return y.reshape(*lead, w.shape[0])
