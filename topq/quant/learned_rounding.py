"""Learned rounding, AutoRound's quantizer (Cheng et al. 2023): per weight element a rounding offset V ∈ [-0.5, 0.5]
(round(w/scale + V) instead of round(w/scale)), per row and group a factor α on the group minimum and β on its
maximum, both in [0.5, 1] (range shrinking); the quantize-dequantize, its gradients by the straight-through
estimator, and the SignSGD step. Shared by AutoRound's per-linear objective (`topq.plugins.quant.autoround`) and
its block objective (`topq.quant.autoround_block`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from topq.core.quant import QuantizedWeight
from topq.ir.types import round_to_dtype
from topq.quant.grid import TINY_SCALE, check_bits, code_range, make_quantized, resolve_group_size

SCALE_BOUNDS = (0.5, 1.0)


@dataclass
class _Forward:
    y: np.ndarray  # dequantized weights [N, G, gs]
    offset: np.ndarray  # codes - zero (= y / scale)
    scale: np.ndarray  # [N, G, 1]
    zero: np.ndarray  # [N, G, 1]
    in_range: np.ndarray  # codes not clamped (the STE passes gradient only there)
    pick_max: np.ndarray | None  # symmetric: β·max (True) or α·|min| (False) set the scale


def _forward(w: np.ndarray, wmin: np.ndarray, wmax: np.ndarray, v: np.ndarray, alpha: np.ndarray,
             beta: np.ndarray, bits: int, symmetric: bool, scale_dtype: str = "f32") -> _Forward:
    """AutoRound's quantize-dequantize of grouped weights w [N, G, gs] (wmin ≤ 0 ≤ wmax per group), in w's dtype,
    with the scales rounded to `scale_dtype` (the dtype the bundle stores them in) as auto-round does: the rounding
    is tuned for the scales the model will have."""
    lo, hi = code_range(bits, symmetric)
    a, b = (alpha * wmin)[..., None], (beta * wmax)[..., None]
    if symmetric:
        pick_max = b >= -a
        scale = _stored(np.maximum(np.where(pick_max, b, -a) / hi, TINY_SCALE), scale_dtype, w.dtype)
        zero = np.zeros_like(scale)
    else:
        pick_max = None
        scale = _stored(np.maximum((b - a) / hi, TINY_SCALE), scale_dtype, w.dtype)
        zero = np.round(-a / scale).astype(w.dtype)
    t = w / scale
    t += v
    np.round(t, out=t)
    t += zero
    in_range = (t >= lo) & (t <= hi)
    np.clip(t, lo, hi, out=t)
    t -= zero  # now codes - zero
    return _Forward(scale * t, t, scale, zero, in_range, pick_max)


def _stored(scale: np.ndarray, scale_dtype: str, dtype: np.dtype) -> np.ndarray:
    """`scale` as stored in `scale_dtype`, in `dtype` (the straight-through estimator takes this rounding as the
    identity). Kept ≥ TINY_SCALE: an all-zero group's scale rounds to 0 in f16, and its codes would divide by it."""
    if scale_dtype != "f32":
        scale = np.maximum(round_to_dtype(scale, scale_dtype), TINY_SCALE)
    return scale.astype(dtype)


def _backward(g: np.ndarray, f: _Forward, w: np.ndarray, wmin: np.ndarray, wmax: np.ndarray, alpha: np.ndarray,
              bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of the loss w.r.t. V, α, β given g = ∂loss/∂y, every round() treated as identity (STE)."""
    hi = code_range(bits, symmetric)[1]
    s = f.scale
    g_t = g * s  # through y = s·(clip(t) - z) into t = round(w/s + V) + z ...
    g_t *= f.in_range  # ... where the clamp lets it through
    # y = s·(q - z): ∂/∂s directly, plus through t's w/s term.
    g_s = np.einsum("ngi,ngi->ng", g, f.offset)[..., None] - np.einsum("ngi,ngi->ng", g_t, w)[..., None] / (s * s)
    if symmetric:
        g_amax = g_s[..., 0] / hi
        pick_max = f.pick_max[..., 0]
        g_alpha = np.where(pick_max, 0.0, g_amax * -wmin)
        g_beta = np.where(pick_max, g_amax * wmax, 0.0)
        return g_t, g_alpha, g_beta
    # z = round(-a / s) appears in t (+z) and in y (-s·z).
    g_z = g_t.sum(axis=-1, keepdims=True) - g.sum(axis=-1, keepdims=True) * s
    a = (alpha * wmin)[..., None]
    g_a = -g_z / s
    g_s = g_s + g_z * a / (s * s)
    # s = (b - a) / hi
    g_a = g_a - g_s / hi
    g_b = g_s / hi
    return g_t, (g_a * wmin[..., None])[..., 0], (g_b * wmax[..., None])[..., 0]


class Rounding:
    """One weight's AutoRound parameters — offsets V, range factors α, β — with its quantize-dequantize and the
    SignSGD step, shared by the per-linear objective (`autoround`) and the block objective
    (`topq.quant.autoround_block`). float32 throughout: the step is a sign, so precision only matters for
    ranking losses (which the callers sum in float64); the elementwise passes run twice as fast as in float64."""

    def __init__(self, w: np.ndarray, bits: int, group_size: int | None, symmetric: bool,
                 scale_dtype: str = "f32") -> None:
        self.bits, self.symmetric, self.scale_dtype = check_bits(bits), symmetric, scale_dtype
        self.shape = n, k = np.shape(w)
        self.gs = resolve_group_size(group_size, k)
        self.w = np.asarray(w, dtype=np.float32)
        self.wg = self.w.reshape(n, k // self.gs, self.gs)
        self.wmin = np.minimum(self.wg.min(axis=-1), 0.0)
        self.wmax = np.maximum(self.wg.max(axis=-1), 0.0)
        self.v = np.zeros_like(self.wg)
        self.alpha = np.ones(self.wmin.shape, dtype=np.float32)
        self.beta = np.ones(self.wmin.shape, dtype=np.float32)

    def params(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(V, α, β), copied."""
        return self.v.copy(), self.alpha.copy(), self.beta.copy()

    def forward(self) -> _Forward:
        return _forward(self.wg, self.wmin, self.wmax, self.v, self.alpha, self.beta, self.bits, self.symmetric,
                        self.scale_dtype)

    def step(self, grad: np.ndarray, f: _Forward, lr: np.float32, fixed_range: np.ndarray | None = None) -> None:
        """One SignSGD step given grad = ∂loss/∂Ŵ [N, K] (any positive multiple: only its sign is used) at `f`, this
        step's `forward()`. Rows where `fixed_range` is true keep α = β = 1."""
        g_v, g_alpha, g_beta = _backward(grad.reshape(self.wg.shape), f, self.wg, self.wmin, self.wmax, self.alpha,
                                         self.bits, self.symmetric)
        lo_b, hi_b = SCALE_BOUNDS
        self.v -= lr * np.sign(g_v)
        np.clip(self.v, -0.5, 0.5, out=self.v)
        self.alpha = np.clip(self.alpha - lr * np.sign(g_alpha), lo_b, hi_b).astype(np.float32)
        self.beta = np.clip(self.beta - lr * np.sign(g_beta), lo_b, hi_b).astype(np.float32)
        if fixed_range is not None:
            self.alpha[fixed_range], self.beta[fixed_range] = 1.0, 1.0

    def quantized(self, params: tuple[np.ndarray, np.ndarray, np.ndarray]) -> QuantizedWeight:
        """The weight quantized with `params` (V, α, β), computed in float64."""
        v, alpha, beta = (p.astype(np.float64) for p in params)
        f = _forward(self.wg.astype(np.float64), self.wmin.astype(np.float64), self.wmax.astype(np.float64), v,
                     alpha, beta, self.bits, self.symmetric, self.scale_dtype)
        codes = f.offset + f.zero
        return make_quantized(codes.reshape(self.shape), f.scale[..., 0], f.zero[..., 0], self.bits, self.gs,
                              self.symmetric)


def step_size(lr: float, step: int, iters: int) -> np.float32:
    """The learning rate of `step`: linear decay to 0, as the reference's LinearLR schedule."""
    return np.float32(lr * (1.0 - step / iters))
