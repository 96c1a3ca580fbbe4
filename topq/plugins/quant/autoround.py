"""AutoRound (Cheng et al. 2023): learn the rounding with signed gradient descent.

Per weight element a rounding offset V ∈ [-0.5, 0.5] (round(w/scale + V) instead of round(w/scale)); per row
and group a factor α on the group minimum and β on its maximum, both in [0.5, 1] (range shrinking). They are
trained by SignSGD — step = lr · sign(gradient), lr decaying linearly to 0 — on the linear's calibration
output error ||X Wᵀ - X Ŵᵀ||² = Σ_n D_n H D_nᵀ (D = Ŵ - W, H = mean xᵀx), with gradients through the rounding
by the straight-through estimator. The reference trains on the decoder block's output in minibatches; here
the objective is per linear and exact over all calibration tokens through H (no sampling noise, so no
randomness either). Each row keeps the parameters with its lowest loss seen (V = 0, α = β = 1 is plain RTN
and is iteration 0, so the result never loses to RTN on the objective). Each step's D·H product is the
calibration's (`quant.calibration_matmul`: float32 numpy, or bf16 — twice as fast per step on an AMX CPU).

q_proj / k_proj keep their full ranges (α = β = 1; only the rounding is tuned), as AWQ skips their clipping: their
error reaches the model through q·kᵀ and the softmax, which the per-linear objective does not see. Measured on
SmolLM2 (8 × 256 calibration tokens, 50 steps, w4 g64 asym, 2 × 256 evaluation tokens): RTN 39.63, AutoRound
with tuned q/k ranges 41.34 (worse than RTN), with fixed q/k ranges 38.80, with q/k/v left at RTN 38.54.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

import topq
from topq.core.hookspecs import Register
from topq.core.progress import progress_bar
from topq.core.quant import Option, QuantizedWeight, QuantScheme
from topq.core.recipe import Field
from topq.ir.products import matmul, products
from topq.quant.calibration import GroupInputs, HessianStats, LayerState, calibration_scheme
from topq.quant.grid import (
    TINY_SCALE,
    check_bits,
    code_range,
    make_quantized,
    resolve_group_size,
    stack_rows,
)

SCALE_BOUNDS = (0.5, 1.0)
FIXED_RANGE_KEYS = ("q_proj", "k_proj")


@dataclass
class _Forward:
    y: np.ndarray  # dequantized weights [N, G, gs]
    offset: np.ndarray  # codes - zero (= y / scale)
    scale: np.ndarray  # [N, G, 1]
    zero: np.ndarray  # [N, G, 1]
    in_range: np.ndarray  # codes not clamped (the STE passes gradient only there)
    pick_max: np.ndarray | None  # symmetric: β·max (True) or α·|min| (False) set the scale


def _forward(w: np.ndarray, wmin: np.ndarray, wmax: np.ndarray, v: np.ndarray, alpha: np.ndarray,
             beta: np.ndarray, bits: int, symmetric: bool) -> _Forward:
    """AutoRound's quantize-dequantize of grouped weights w [N, G, gs] (wmin ≤ 0 ≤ wmax per group), in w's dtype."""
    lo, hi = code_range(bits, symmetric)
    a, b = (alpha * wmin)[..., None], (beta * wmax)[..., None]
    if symmetric:
        pick_max = b >= -a
        scale = np.maximum(np.where(pick_max, b, -a) / hi, TINY_SCALE).astype(w.dtype)
        zero = np.zeros_like(scale)
    else:
        pick_max = None
        scale = np.maximum((b - a) / hi, TINY_SCALE).astype(w.dtype)
        zero = np.round(-a / scale).astype(w.dtype)
    t = w / scale
    t += v
    np.round(t, out=t)
    t += zero
    in_range = (t >= lo) & (t <= hi)
    np.clip(t, lo, hi, out=t)
    t -= zero  # now codes - zero
    return _Forward(scale * t, t, scale, zero, in_range, pick_max)


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


def autoround(w: np.ndarray, h: np.ndarray, bits: int = 4, group_size: int | None = 128, symmetric: bool = False,
              iters: int = 200, lr: float | None = None, progress: bool = False,
              fixed_range: np.ndarray | None = None) -> QuantizedWeight:
    """Quantize w [N, K] by tuning rounding offsets and range factors on the output error through H [K, K].
    Rows where `fixed_range` [N] is true keep the full [min, max] range (α = β = 1): only their rounding is tuned."""
    bits = check_bits(bits)
    n, k = np.shape(w)
    gs = resolve_group_size(group_size, k)
    g_count = k // gs
    lr = 1.0 / max(iters, 1) if lr is None else float(lr)
    # float32 throughout: the step is a sign, so precision only matters for the loss ranking (summed in float64);
    # the per-step GEMM D·H (N·K² multiply-adds) and ~30 elementwise passes run twice as fast as in float64.
    w32 = np.asarray(w, dtype=np.float32)
    h32 = np.asarray(h, dtype=np.float32)
    wg = w32.reshape(n, g_count, gs)
    wmin = np.minimum(wg.min(axis=-1), 0.0)
    wmax = np.maximum(wg.max(axis=-1), 0.0)
    v = np.zeros_like(wg)
    alpha = np.ones((n, g_count), dtype=np.float32)
    beta = np.ones((n, g_count), dtype=np.float32)
    best_loss = np.full(n, np.inf)
    best = (v.copy(), alpha.copy(), beta.copy())
    lo_b, hi_b = SCALE_BOUNDS
    for step in progress_bar(range(iters + 1), desc="autoround", unit="step", disable=not progress, leave=False):
        f = _forward(wg, wmin, wmax, v, alpha, beta, bits, symmetric)
        d = f.y.reshape(n, k) - w32
        dh = matmul(d, h32)  # the step's products: float32 numpy, or bf16 (`solve_group`)
        loss = np.einsum("nk,nk->n", d, dh, dtype=np.float64)
        better = loss < best_loss
        if better.any():
            best_loss[better] = loss[better]
            best[0][better], best[1][better], best[2][better] = v[better], alpha[better], beta[better]
        if step == iters:  # the last evaluation only scores the final parameters
            break
        # ∂loss/∂Ŵ = 2·D·H; the factor 2 does not change a sign step.
        g_v, g_alpha, g_beta = _backward(dh.reshape(n, g_count, gs), f, wg, wmin, wmax, alpha, bits, symmetric)
        step_lr = np.float32(lr * (1.0 - step / iters))  # linear decay to 0, as the reference's LinearLR schedule
        v -= step_lr * np.sign(g_v)
        np.clip(v, -0.5, 0.5, out=v)
        alpha = np.clip(alpha - step_lr * np.sign(g_alpha), lo_b, hi_b).astype(np.float32)
        beta = np.clip(beta - step_lr * np.sign(g_beta), lo_b, hi_b).astype(np.float32)
        if fixed_range is not None:
            alpha[fixed_range], beta[fixed_range] = 1.0, 1.0
    f = _forward(wg.astype(np.float64), wmin.astype(np.float64), wmax.astype(np.float64),
                 best[0].astype(np.float64), best[1].astype(np.float64), best[2].astype(np.float64), bits, symmetric)
    codes = f.offset + f.zero
    return make_quantized(codes.reshape(n, k), f.scale[..., 0], f.zero[..., 0], bits, gs, symmetric)


# --------------------------------------------------------------------------------------- layer adapter


ROW_CHUNK = 256  # rows per solver call: the unit `GroupInputs.map` spreads over the loop's threads


def solve_group(group: GroupInputs, state: LayerState, options: Mapping[str, Any]) -> None:
    """AutoRound for one quant group: rows are independent under the per-linear objective, so the group's linears
    are stacked and solved in chunks of ROW_CHUNK rows on `group.map`. The chunks are the same whoever runs them
    (and a row's steps do not depend on the other rows of its chunk), so the result does not depend on the jobs."""
    weights = [state.float_weight(name) for name in group.names]
    h = group.stats.hessian()
    w = np.concatenate(weights, axis=0)
    fixed = np.concatenate([np.full(x.shape[0], key in FIXED_RANGE_KEYS) for key, x in zip(group.keys, weights)])
    starts = range(0, w.shape[0], ROW_CHUNK)

    def solve_rows(a: int) -> QuantizedWeight:
        # set here, on whichever thread runs the chunk: the loop's threads do not inherit the caller's choice
        with products(options["calibration_matmul"]):
            return autoround(w[a:a + ROW_CHUNK], h, options["bits"], options["group_size"], options["symmetric"],
                             iters=options["iters"], lr=options["lr"], fixed_range=fixed[a:a + ROW_CHUNK])

    qw = stack_rows(group.map(solve_rows, starts))
    state.set_quantized_rows(group.names, qw)
    state.record(group.names, weights, [state.current_weight(n) for n in group.names], h, options["bits"],
                 options["group_size"], options["symmetric"])


OPTIONS = (
    Option("iters", Field("int", 200, ge=0, help="autoround: optimisation steps (0 = plain rounding)")),
    Option("lr", Field("float", None, nullable=True, gt=0, help="autoround: learning rate; null = 1/iters")),
)


def read_options(quant: Mapping[str, Any]) -> dict[str, Any]:
    iters = int(quant["iters"])
    return {"iters": iters, "lr": float(quant["lr"]) if quant["lr"] is not None else 1.0 / max(iters, 1)}


SCHEME = calibration_scheme(
    "autoround", "AutoRound: SignSGD-tuned rounding offsets and range factors (weight-only, calibrated)",
    group_solver=solve_group, own_options=OPTIONS, read_options=read_options, observe=HessianStats)


@topq.hookimpl
def register_quant_schemes(register: Register[QuantScheme]) -> None:
    register(SCHEME)
