"""W8A8 arithmetic shared by the `int8` scheme, the host's `top.MatMulInt8` kernel and targets' emulators.

One convention everywhere (symmetric, int8 range ±127 — -128 is never produced, as TPU-MLIR's symmetric int8):

* weights per output channel: `w_scale[n] = absmax(W[n]) / 127` (rounded to the compute dtype by the scheme),
  `code = clamp(round(w / w_scale), -127, 127)`;
* activations per tensor (static, a calibrated `act_scale`) or per token (dynamic: `row absmax / 127` at run
  time), `q = clamp(round(x / scale), -127, 127)` computed in float32;
* `round` is C's std::round (halves away from zero), as the chip's converters;
* `y = (q_x · codesᵀ) * (scale_x * w_scale[n])`: the int8 × int8 products are summed exactly (int32 on the chip;
  float64 here, exact for K < 2^53 / 127²) and dequantized per output channel.
"""

from __future__ import annotations

import numpy as np

QMAX = 127
F32 = np.float32


def round_half_away(x: np.ndarray) -> np.ndarray:
    """C's std::round: halves go away from zero (numpy's rint rounds them to even)."""
    x = np.asarray(x)
    whole = np.trunc(x)
    return np.where(np.abs(x - whole) == 0.5, whole + np.sign(x), np.rint(x)).astype(x.dtype, copy=False)


def token_scales(x: np.ndarray) -> np.ndarray:
    """Per-row (token) scales [..., 1] in float32: row absmax / 127 (1 for an all-zero row: codes stay 0)."""
    absmax = np.abs(np.asarray(x, dtype=F32)).max(axis=-1, keepdims=True)
    return np.where(absmax > 0, absmax / F32(QMAX), F32(1)).astype(F32)


def quantize_act(x: np.ndarray, scale: np.ndarray | float) -> np.ndarray:
    """int8 codes (as float32) of x with a broadcastable float32 scale: clamp(round(x / scale), ±127)."""
    q = np.asarray(x, dtype=F32) / np.asarray(scale, dtype=F32)
    return np.clip(round_half_away(q), -QMAX, QMAX)


def quantize_weight(w: np.ndarray, scale_dtype: str = "f32") -> tuple[np.ndarray, np.ndarray]:
    """(int8 codes [N, K], w_scale [N] float32) per output channel; the scale is rounded to `scale_dtype` first so
    the codes are computed with the value the target multiplies by."""
    from topq.core.quant import round_to_dtype

    w = np.asarray(w, dtype=F32)
    absmax = np.abs(w).max(axis=1)
    scale = round_to_dtype(np.where(absmax > 0, absmax / F32(QMAX), F32(1)).astype(F32), scale_dtype)
    codes = np.clip(round_half_away(w / scale[:, None]), -QMAX, QMAX).astype(np.int8)
    return codes, scale


def matmul_int8(x: np.ndarray, codes: np.ndarray, w_scale: np.ndarray, act_scale: float, dynamic: bool,
                bias: np.ndarray | None = None) -> np.ndarray:
    """The exact W8A8 linear (host reference): float32 x [..., K], codes [N, K], w_scale [N] → float32 [..., N]."""
    x = np.asarray(x, dtype=F32)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    sx = token_scales(x2) if dynamic else np.full((x2.shape[0], 1), act_scale, F32)
    qx = quantize_act(x2, sx)
    acc = qx.astype(np.float64) @ np.asarray(codes, dtype=np.float64).T  # exact integer sums
    y = acc * (sx.astype(np.float64) * np.asarray(w_scale, dtype=np.float64)[None, :])
    y = y.astype(F32)
    if bias is not None:
        y += np.asarray(bias, dtype=F32)
    return y.reshape(*lead, codes.shape[0])
