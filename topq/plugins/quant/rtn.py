"""Weight-only round-to-nearest schemes: w8bf16, w4bf16, w8f16, w4f16.

The values are computed exactly as BM1684X's compiler (TPU-MLIR's A16MatMul weight reorder) computes them, in
float32, per group of `group_size` weights along K:

* asymmetric: `scale = (max - min) / (2^bits - 1)`, `zp = clamp(round(-min / scale), 0, 2^bits - 1)`,
  `code = clamp(round(w / scale) + zp, 0, 2^bits - 1)`; the range is *not* widened to contain 0 (unlike GPTQ's
  convention in `topq.quant.grid`), so an all-positive group spends every code on its own values.
* symmetric: `scale = absmax / (2^(bits-1) - 1)`, signed codes `clamp(round(w / scale), -2^(bits-1), 2^(bits-1)-1)`.

`round` is C's `std::round` (halves away from zero), not numpy's half-to-even. An asymmetric group whose range is
zero (a constant c) would divide by zero: it gets the scale |c| (1 for an all-zero group), so c is code - zp = ±1
(0) times its scale and dequantizes to c as stored; an all-zero symmetric group gets scale 1 and codes 0. The
compiler stores the scales in the compute dtype, so the returned scales are already rounded to it: the
values here are exactly what the chip multiplies by, and the host target's dequantized weights match the chip's
bit for bit. Storage layout (packing) is the target's business.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

import topq
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.core.quant import QuantizedWeight, QuantScheme
from topq.ir.int8 import round_half_away
from topq.ir.types import round_to_dtype
from topq.quant.calibration import quantization_report
from topq.quant.grid import code_range, make_quantized, resolve_group_size
from topq.quant.options import WEIGHT_OPTIONS


def rtn_values(w: np.ndarray, bits: int, group_size: int, symmetric: bool) -> tuple[np.ndarray, ...]:
    """(codes [N, K], scales [N, G], zeros [N, G]) in float32, group-wise along K (group_size divides K)."""
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    lo, hi = code_range(bits, symmetric)
    if symmetric:
        absmax = np.abs(groups).max(axis=-1)
        scale = np.where(absmax > 0, absmax / np.float32(hi), np.float32(1)).astype(np.float32)
        zero = np.zeros_like(scale)
        codes = np.clip(round_half_away(groups / scale[..., None]), lo, hi)
    else:
        wmin, wmax = groups.min(axis=-1), groups.max(axis=-1)
        span = wmax - wmin
        # a constant group c gets scale |c| (1 for zeros): code - zp = ±1 (0) dequantizes to the stored c
        constant = np.where(wmin != 0, np.abs(wmin), np.float32(1))
        scale = np.where(span > 0, span / np.float32(hi), constant).astype(np.float32)
        zero = np.clip(round_half_away(-wmin / scale), lo, hi)
        codes = np.clip(round_half_away(groups / scale[..., None]) + zero[..., None], lo, hi)
    return codes.reshape(n, k), scale, zero


def quantize(w: np.ndarray, options: Mapping[str, Any], *, bits: int, compute_dtype: str) -> QuantizedWeight:
    """Quantize one linear weight [N, K] (options: group_size, symmetric; bits must match the scheme if given)."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise TopqError(f"weight-only quantization needs a 2-D weight [N, K], got shape {list(w.shape)}")
    wanted = options.get("bits")
    if wanted is not None and int(wanted) != bits:
        raise TopqError(f"quant.bits {wanted} does not match the scheme's {bits}-bit weights")
    if not np.isfinite(w).all():
        raise TopqError("weight-only quantization: the weight contains inf or NaN")
    k = w.shape[1]
    group_size = resolve_group_size(options.get("group_size", 64), k)
    symmetric = bool(options.get("symmetric", False))
    codes, scale, zero = rtn_values(w, bits, group_size, symmetric)
    return make_quantized(codes, round_to_dtype(scale, compute_dtype), zero, bits, group_size, symmetric)


def _scheme(bits: int, dtype: str) -> QuantScheme:
    act = {"bf16": "bfloat16", "f16": "float16"}[dtype]
    return QuantScheme(
        name=f"w{bits}{dtype}",
        description=f"{bits}-bit weight-only round-to-nearest (group-wise, as BM1684X's compiler), {act} activations",
        compute_dtype=dtype,
        weight_bits=bits,
        options=WEIGHT_OPTIONS,
        quantize=functools.partial(quantize, bits=bits, compute_dtype=dtype),
        error_report=quantization_report,
    )


SCHEMES = tuple(_scheme(bits, dtype) for dtype in ("bf16", "f16") for bits in (8, 4))


@topq.hookimpl
def register_quant_schemes(register: Register[QuantScheme]) -> None:
    for scheme in SCHEMES:
        register(scheme)
