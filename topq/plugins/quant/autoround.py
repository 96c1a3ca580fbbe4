"""AutoRound (Cheng et al. 2023): learn the rounding with signed gradient descent.

The quantizer (`topq.quant.learned_rounding`): per weight element a rounding offset V ∈ [-0.5, 0.5], per
row and group range factors α, β ∈ [0.5, 1] on the group's minimum and maximum, trained by SignSGD — step =
lr · sign(gradient), lr decaying linearly to 0 — with gradients through the rounding by the straight-through
estimator. The scales are tuned as they will be stored, rounded to `quant.act_dtype` at every step (auto-round
rounds its to float16 the same way). Two objectives (`quant.objective`):

* `block` (the paper's and auto-round's; opt-in: it needs torch, which topq itself does not require, and takes
  1.2–1.5× the per-linear objective's time): every linear of a
  decoder layer together, on the layer's output against the float model's, in minibatches of `batch_size`
  windows drawn as auto-round draws them (seeded shuffles of all windows; `topq.quant.autoround_block`).
  Layers with ops the torch kernels do not run (top.MoE, linear attention) use the per-linear objective, and
  their report rows say `objective: linear`.
* `linear` (the default): each linear on its own calibration output error ||X Wᵀ - X Ŵᵀ||² = Σ_n D_n H D_nᵀ (D = Ŵ - W,
  H = mean xᵀx), exact over all calibration tokens (no sampling), below. Each row keeps the parameters with its
  lowest loss seen (V = 0, α = β = 1 is plain RTN and is iteration 0, so the result never loses to RTN on the
  objective). Each step's D·H product is the calibration's (`quant.calibration_matmul`: float32 numpy, or bf16).
  q_proj / k_proj keep their full ranges (α = β = 1; only the rounding is tuned), as AWQ skips their clipping:
  their error reaches the model through q·kᵀ and the softmax, which this objective does not see. Measured on
  SmolLM2 (8 × 256 calibration tokens, 50 steps, w4 g64 asym, 2 × 256 evaluation tokens): RTN 39.63, tuned q/k
  ranges 41.34 (worse than RTN), fixed q/k ranges 38.80, q/k/v left at RTN 38.54.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

import topq
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.core.progress import progress_bar
from topq.core.quant import Option, QuantizedWeight, QuantScheme
from topq.core.recipe import Field
from topq.ir.products import matmul, products
from topq.ir.torch_kernels import require_torch
from topq.quant.autoround_block import LAYER_TUNER
from topq.quant.calibration import GroupInputs, HessianStats, LayerState, calibration_scheme
from topq.quant.grid import stack_rows
from topq.quant.learned_rounding import Rounding, step_size

FIXED_RANGE_KEYS = ("q_proj", "k_proj")


def autoround(w: np.ndarray, h: np.ndarray, bits: int = 4, group_size: int | None = 128, symmetric: bool = False,
              iters: int = 200, lr: float | None = None, progress: bool = False,
              fixed_range: np.ndarray | None = None, scale_dtype: str = "f32") -> QuantizedWeight:
    """Quantize w [N, K] by tuning rounding offsets and range factors on the output error through H [K, K].
    Rows where `fixed_range` [N] is true keep the full [min, max] range (α = β = 1): only their rounding is tuned.
    The scales are tuned as they will be stored, rounded to `scale_dtype`."""
    rounding = Rounding(w, bits, group_size, symmetric, scale_dtype)
    n = rounding.shape[0]
    lr = 1.0 / max(iters, 1) if lr is None else float(lr)
    h32 = np.asarray(h, dtype=np.float32)
    best_loss = np.full(n, np.inf)
    best = rounding.params()
    for step in progress_bar(range(iters + 1), desc="autoround", unit="step", disable=not progress, leave=False):
        f = rounding.forward()
        d = f.y.reshape(rounding.shape) - rounding.w
        dh = matmul(d, h32)  # the step's products: float32 numpy, or bf16 (`solve_group`)
        loss = np.einsum("nk,nk->n", d, dh, dtype=np.float64)
        better = loss < best_loss
        if better.any():
            best_loss[better] = loss[better]
            for kept, now in zip(best, (rounding.v, rounding.alpha, rounding.beta)):
                kept[better] = now[better]
        if step == iters:  # the last evaluation only scores the final parameters
            break
        rounding.step(dh, f, step_size(lr, step, iters), fixed_range)  # ∂loss/∂Ŵ = 2·D·H: the same sign
    return rounding.quantized(best)

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
                             iters=options["iters"], lr=options["lr"], fixed_range=fixed[a:a + ROW_CHUNK],
                             scale_dtype=state.scale_dtype)

    qw = stack_rows(group.map(solve_rows, starts))
    state.set_quantized_rows(group.names, qw)
    state.record(group.names, weights, [state.current_weight(n) for n in group.names], h, options["bits"],
                 options["group_size"], options["symmetric"], group.map)
    for row in state.result.report[-len(group.names):]:
        row["objective"] = "linear"


OBJECTIVES = ("block", "linear")
DEFAULT_BATCH = 8  # auto-round's batch_size

OPTIONS = (
    Option("iters", Field("int", 200, ge=0, help="autoround: optimisation steps (0 = plain rounding)")),
    Option("lr", Field("float", None, nullable=True, gt=0, help="autoround: learning rate; null = 1/iters")),
    Option("objective", Field("str", "linear", choices=OBJECTIVES,
                              help="autoround: block (each layer's output, minibatches) or linear (each linear's "
                                   "output error through H)")),
    Option("batch_size", Field("int", None, nullable=True, ge=1,
                               help="autoround: calibration windows per step (objective block); null = 8")),
)


def read_options(quant: Mapping[str, Any]) -> dict[str, Any]:
    iters = int(quant["iters"])
    objective = str(quant["objective"])
    if objective == "block":
        require_torch()
    elif quant["batch_size"] is not None:  # the per-linear objective uses every token at each step
        raise TopqError("quant.batch_size is for quant.objective: block; the linear objective has no minibatches")
    return {"iters": iters, "lr": float(quant["lr"]) if quant["lr"] is not None else 1.0 / max(iters, 1),
            "objective": objective, "batch_size": int(quant["batch_size"] or DEFAULT_BATCH)}


SCHEME = calibration_scheme(
    "autoround", "AutoRound: SignSGD-tuned rounding offsets and range factors (weight-only, calibrated)",
    group_solver=solve_group, own_options=OPTIONS, read_options=read_options, observe=HessianStats,
    layer_tuner=LAYER_TUNER)


@topq.hookimpl
def register_quant_schemes(register: Register[QuantScheme]) -> None:
    register(SCHEME)
