"""Group-wise integer quantization math shared by RTN and the calibrated solvers (GPTQ, AWQ, AutoRound).

One convention everywhere (what `QuantizedWeight.dequantize` expects):

* asymmetric: codes in [0, 2^b - 1], scale = (max - min) / (2^b - 1), zero = round(-min / scale),
  w ≈ (code - zero) * scale.
  The group range is widened to include 0 (min ≤ 0 ≤ max), as GPTQ and AutoRound do, so the zero point is always a
  valid code and an all-positive group cannot lose its small values.
* symmetric: codes in [-2^(b-1), 2^(b-1) - 1], zero = 0, scale = absmax / (2^(b-1) - 1): the largest magnitude maps to
  ±(2^(b-1) - 1) exactly and nothing is clipped.

Groups run along the input dimension K of a weight [N, K]: column k belongs to group k // group_size unless a
`g_idx` says otherwise (GPTQ's act-order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from topq.core.errors import TopqError
from topq.core.quant import QuantizedWeight, resolve_group_size

#: a group whose range is zero (all zeros) gets this scale: codes stay at the zero point and dequantize to 0.
TINY_SCALE = 1e-12

#: rows per product of `output_errors` (`row_blocks`): in blocks this large each row's result is the one product's
#: of all the rows (checked on SmolLM2's report shapes, tests/quant/test_quant_algorithms.py); blocks of a few rows
#: can take BLAS's small-matrix kernels, whose bits differ
REPORT_ROWS = 512

#: `map(fn, items)` ≡ `[fn(item) for item in items]`, run anywhere (`GroupInputs.map`: the layer loop's threads)
MapFn = Callable[[Callable[[Any], Any], Iterable[Any]], list[Any]]


def serial_map(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    return [fn(item) for item in items]


def row_blocks(n: int, size: int) -> list[slice]:
    """N rows as ceil(N / size) blocks of near-equal size, in order."""
    bounds = np.linspace(0, n, max(1, -(-n // size)) + 1).round().astype(int).tolist()
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def check_bits(bits: int) -> int:
    if not 2 <= int(bits) <= 8:
        raise TopqError(f"quant.bits must be in 2..8 for integer weights, got {bits}")
    return int(bits)


def code_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """Smallest and largest integer code."""
    if symmetric:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def params_from_range(wmin: np.ndarray, wmax: np.ndarray, bits: int,
                      symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point (float arrays, zero integral) for groups with range [wmin, wmax].

    The range is widened to contain 0 first (see the module doc)."""
    wmin = np.minimum(np.asarray(wmin, dtype=np.float64), 0.0)
    wmax = np.maximum(np.asarray(wmax, dtype=np.float64), 0.0)
    if symmetric:
        scale = np.maximum(-wmin, wmax) / ((1 << (bits - 1)) - 1)
        scale = np.where(scale > TINY_SCALE, scale, 1.0)
        return scale, np.zeros_like(scale)
    maxq = (1 << bits) - 1
    scale = (wmax - wmin) / maxq
    scale = np.where(scale > TINY_SCALE, scale, 1.0)
    zero = np.clip(np.round(-wmin / scale), 0, maxq)
    return scale, zero


def search_range(groups: np.ndarray, bits: int, symmetric: bool, axis: int,
                 importance: np.ndarray | None = None, max_shrink: float = 0.2,
                 steps: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point per group (groups run along `axis`) from the range [p·min, p·max] for p = 1 −
    max_shrink · i / steps, i < steps (1, 0.99, … 0.81 by default), whichever rounds the group with the least
    Σ importance · (w − ŵ)².

    `importance` broadcasts against `groups` (GPTQ passes diag(H): the output error of each input channel, to the
    diagonal approximation); None weighs all weights alike. Ties keep the wider range, so the result is
    min/max's wherever shrinking does not help. Computed in float32 (the solvers' precision); the parameters are
    `params_from_range`'s."""
    g = np.asarray(groups, dtype=np.float32)
    wmin, wmax = g.min(axis=axis), g.max(axis=axis)
    best_err = np.full(wmin.shape, np.inf)
    best_scale = best_zero = np.zeros(wmin.shape)
    for step in range(steps):
        shrink = 1.0 - max_shrink * step / steps
        scale, zero = params_from_range(wmin * shrink, wmax * shrink, bits, symmetric)
        s = np.expand_dims(scale, axis).astype(np.float32)
        z = np.expand_dims(zero, axis).astype(np.float32)
        d = quantize_values(g, s, z, bits, symmetric)
        d -= z
        d *= s
        d -= g
        d *= d
        if importance is not None:
            d *= importance
        err = d.sum(axis=axis, dtype=np.float64)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale, best_zero = np.where(better, scale, best_scale), np.where(better, zero, best_zero)
    return best_scale, best_zero


def quantize_values(w: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int,
                    symmetric: bool) -> np.ndarray:
    """Integer codes (as floats) of `w` with broadcastable scale/zero: clamp(round(w / scale) + zero)."""
    lo, hi = code_range(bits, symmetric)
    codes = np.round(w / scale) + zero
    # np.minimum / np.maximum in place: np.clip's values, without its per-call overhead (GPTQ calls this per column)
    np.maximum(codes, lo, out=codes)
    return np.minimum(codes, hi, out=codes)


def group_view(w: np.ndarray, group_size: int) -> np.ndarray:
    """[N, K] → [N, K / group_size, group_size] (a view for contiguous input)."""
    n, k = w.shape
    return w.reshape(n, k // group_size, group_size)


def quantize_groups(w: np.ndarray, bits: int, group_size: int | None, symmetric: bool,
                    shrink: np.ndarray | float | None = None) -> QuantizedWeight:
    """Round-to-nearest with min/max group ranges, optionally shrunk by `shrink` ([N, G] or a scalar in (0, 1]):
    the range becomes [shrink * min, shrink * max] and weights outside it are clamped (AWQ's clipping)."""
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2:
        raise TopqError(f"expected a 2-D weight [N, K], got shape {list(w.shape)}")
    bits = check_bits(bits)
    gs = resolve_group_size(group_size, w.shape[1])
    groups = group_view(w, gs)
    wmin, wmax = groups.min(axis=-1), groups.max(axis=-1)
    if shrink is not None:
        wmin, wmax = wmin * shrink, wmax * shrink
    scale, zero = params_from_range(wmin, wmax, bits, symmetric)
    codes = quantize_values(groups, scale[..., None], zero[..., None], bits, symmetric)
    return make_quantized(codes.reshape(w.shape), scale, zero, bits, gs, symmetric)


def make_quantized(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int, group_size: int,
                   symmetric: bool, g_idx: np.ndarray | None = None) -> QuantizedWeight:
    """A QuantizedWeight with compact storage: int8 codes/zeros when symmetric, uint8 when asymmetric; f32 scales."""
    dtype = np.int8 if symmetric else np.uint8
    return QuantizedWeight(
        codes=np.asarray(codes).astype(dtype),
        scales=np.asarray(scales, dtype=np.float32),
        zeros=np.asarray(zeros).astype(dtype),
        bits=bits, group_size=group_size, symmetric=symmetric,
        g_idx=None if g_idx is None else np.asarray(g_idx, dtype=np.int32),
    )


def stack_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """The QuantizedWeight of row blocks solved apart (same bits, groups and g_idx), stacked along N in order."""
    first = parts[0]
    return QuantizedWeight(np.concatenate([q.codes for q in parts]), np.concatenate([q.scales for q in parts]),
                           np.concatenate([q.zeros for q in parts]), first.bits, first.group_size, first.symmetric,
                           first.g_idx)


def rtn(w: np.ndarray, bits: int, group_size: int | None, symmetric: bool) -> QuantizedWeight:
    """Plain round-to-nearest group quantization: the baseline every algorithm must beat."""
    return quantize_groups(w, bits, group_size, symmetric)


def fake_quant(w: np.ndarray, bits: int, group_size: int | None, symmetric: bool,
               shrink: np.ndarray | float | None = None) -> np.ndarray:
    """quantize → dequantize in float64, without building a QuantizedWeight (hot loops of the searches)."""
    w = np.asarray(w, dtype=np.float64)
    gs = resolve_group_size(group_size, w.shape[1])
    groups = group_view(w, gs)
    wmin, wmax = groups.min(axis=-1), groups.max(axis=-1)
    if shrink is not None:
        wmin, wmax = wmin * shrink, wmax * shrink
    scale, zero = params_from_range(wmin, wmax, bits, symmetric)
    scale, zero = scale[..., None], zero[..., None]
    # (clip(round(w / scale) + zero) - zero) * scale, as quantize_values and dequantize compute it, in place: the
    # same operations in the same order (the same bits) with one temporary instead of six
    lo, hi = code_range(bits, symmetric)
    t = groups / scale
    np.round(t, out=t)
    t += zero
    np.maximum(t, lo, out=t)
    np.minimum(t, hi, out=t)
    t -= zero
    t *= scale
    return t.reshape(w.shape)


def output_error(w: np.ndarray, w_hat: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Per-row layer-output error ||x wᵀ - x ŵᵀ||² summed over the calibration inputs x, via H = Σ xᵀx:
    row n gives (w - ŵ)_n H (w - ŵ)_nᵀ. Exact for all tokens, and cheaper than re-running them when tokens > K."""
    d = np.asarray(w, dtype=np.float64) - np.asarray(w_hat, dtype=np.float64)
    return np.einsum("nk,nk->n", d @ np.asarray(h, dtype=np.float64), d)


def output_errors(diffs: Sequence[np.ndarray], h: np.ndarray, map: MapFn = serial_map) -> np.ndarray:
    """Σ_n d_n H d_nᵀ for each matrix d of `diffs` (rows [N_i, K]): float32 GEMMs over blocks of all their rows
    (`REPORT_ROWS`, run on `map`), each row's dot product summed in float64. For reports (`output_error` is the
    float64 reference): the float32 products differ from it by ~1e-5 relative."""
    d = np.concatenate([np.asarray(x, dtype=np.float32) for x in diffs], axis=0)
    h32 = np.asarray(h, dtype=np.float32)
    if not len(d):
        return np.zeros(len(diffs))
    per_row = np.concatenate(map(lambda rows: np.einsum("nk,nk->n", d[rows] @ h32, d[rows], dtype=np.float64),
                                 row_blocks(len(d), REPORT_ROWS)))
    bounds = np.cumsum([0] + [np.shape(x)[0] for x in diffs])
    return np.add.reduceat(per_row, bounds[:-1])


def to_signed_symmetric(weight: QuantizedWeight) -> QuantizedWeight:
    """An offset-symmetric weight (zeros all 2^(bits-1)) as signed codes with zeros 0; the same values."""
    offset = 1 << (weight.bits - 1)
    if not np.all(np.asarray(weight.zeros) == offset):
        raise TopqError(f"not an offset-symmetric weight: zeros are not all {offset}")
    dtype = np.int8 if weight.bits <= 8 else np.int16
    return QuantizedWeight(
        codes=(weight.codes.astype(np.int16) - offset).astype(dtype),
        scales=weight.scales, zeros=np.zeros_like(weight.zeros), bits=weight.bits,
        group_size=weight.group_size, symmetric=True, g_idx=weight.g_idx)


def signed_if_offset_symmetric(q: QuantizedWeight) -> QuantizedWeight:
    """Imported symmetric weights carry unsigned codes with zeros 2^(bits-1); topq's symmetric form is signed codes
    with zeros 0 (the same values). A "symmetric" weight whose zeros differ is kept exactly as asymmetric."""
    if not q.symmetric or not np.any(q.zeros):
        return q
    if np.all(np.asarray(q.zeros) == 1 << (q.bits - 1)):
        return to_signed_symmetric(q)
    return dataclasses.replace(q, symmetric=False)
