"""GPTQ (Frantar et al. 2022): column-by-column quantization with second-order error compensation.

The solver is a pure numpy function of a weight W [N, K] and the Hessian proxy H = Σ xᵀx [K, K] of the
linear's inputs; `topq.quant.calibration` gathers H layer by layer and calls it. Rows never interact (every
row sees the same H), so linears that share an input (q/k/v, gate/up) are stacked and solved in one call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

import topq
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.core.quant import Option, QuantizedWeight, QuantScheme
from topq.core.recipe import Field
from topq.quant.calibration import HessianStats, InputStats, calibration_scheme
from topq.quant.grid import (
    MapFn,
    check_bits,
    make_quantized,
    params_from_range,
    quantize_values,
    resolve_group_size,
    row_blocks,
    search_range,
    serial_map,
)

#: columns per triangular solve of `_upper_inverse_factor`
INVERSE_BLOCK = 192


def _upper_inverse_factor(a: np.ndarray) -> np.ndarray:
    """U upper-triangular with UᵀU = A⁻¹ for a symmetric positive definite A; LinAlgError if A is not.

    With J the index reversal, J A J = L Lᵀ gives A⁻¹ = (J L⁻¹ J)ᵀ (J L⁻¹ J) and J L⁻¹ J is upper triangular:
    one Cholesky and one triangular inverse (the reference's cholesky → cholesky_inverse → cholesky does three
    cubic steps). torch's LAPACK is used when installed: numpy's bundled OpenBLAS Cholesky was measured ~20×
    slower at K = 1536 (4.4 s vs 0.2 s), the bottleneck of a whole-model run.

    The inverse is solved by blocks of INVERSE_BLOCK columns, each against the trailing factor only: L⁻¹'s columns
    [a, b) are zero above row a, so ~K³/3 multiply-adds instead of a solve against the whole identity's K³ (torch
    has no `trtri`). The float64 result differs from one whole solve in its last bits; GPTQ casts it to float32."""
    rev = np.ascontiguousarray(np.asarray(a, dtype=np.float64)[::-1, ::-1])
    try:
        import torch
    except ImportError:  # torch is optional
        return np.linalg.inv(np.linalg.cholesky(rev))[::-1, ::-1].copy()
    lower, info = torch.linalg.cholesky_ex(torch.from_numpy(rev))
    if int(info) != 0:
        raise np.linalg.LinAlgError("not positive definite")
    k = rev.shape[0]
    inv_lower = torch.zeros((k, k), dtype=torch.float64)
    for cols in row_blocks(k, INVERSE_BLOCK):
        a0, a1 = cols.start, cols.stop
        identity = torch.zeros((k - a0, a1 - a0), dtype=torch.float64)
        identity[:a1 - a0].fill_diagonal_(1.0)
        inv_lower[a0:, a0:a1] = torch.linalg.solve_triangular(lower[a0:, a0:], identity, upper=False)
    return inv_lower.numpy()[::-1, ::-1].copy()


def _inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper Cholesky factor of (H + λI)⁻¹, λ = damp · mean(diag H).

    Row i of this factor holds exactly the coefficients GPTQ needs to spread column i's rounding error over the
    not-yet-quantized columns (the reference's `cholesky_inverse` + `cholesky(upper=True)`). A Hessian that is
    still not positive definite (too few tokens, damp 0) gets more dampening instead of failing."""
    k = h.shape[0]
    mean_diag = float(np.mean(np.diag(h)))
    base = max(mean_diag, 1e-12)
    for attempt in range(6):
        lam = base * (damp * 10 ** attempt if damp > 0 else 1e-6 * 10 ** attempt)
        try:
            return _upper_inverse_factor(h + lam * np.eye(k))
        except np.linalg.LinAlgError:
            continue
    raise TopqError("gptq: the calibration Hessian is not positive definite even with heavy dampening")


#: rows per column loop: `gptq` solves row blocks of about this size apart (rows never interact), on the layer
#: loop's threads when it has them; the blocks depend only on N, so the result does not depend on the jobs
ROW_BLOCK = 320


@dataclass(frozen=True)
class _Columns:
    """What every row block's column loop shares: the Cholesky factor, the column order and the grid."""

    u: np.ndarray  # [K, K] float32, upper factor of (H + λI)⁻¹ in solving order
    importance: np.ndarray  # [K, 1] diag(H) in solving order (the mse search's weights)
    perm: np.ndarray  # solving position → column
    dead: np.ndarray  # [K] bool: input channels that never fired
    bits: int
    gs: int
    symmetric: bool
    block_size: int
    static_groups: bool
    mse: bool

    def group_params(self, groups: np.ndarray, axis: int, importance: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.mse:
            return search_range(groups, self.bits, self.symmetric, axis, importance)
        return params_from_range(groups.min(axis=axis), groups.max(axis=axis), self.bits, self.symmetric)

    def solve(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Codes [K, n] in solving order and scales / zeros [groups, n] of the rows w [n, K] (float64)."""
        k, n = len(self.perm), w.shape[0]
        gs, bits, symmetric, U = self.gs, self.bits, self.symmetric, self.u
        # Work on Wᵀ in float32 (as the reference): a column of W is then a contiguous row, so the per-column
        # error updates touch contiguous memory, at half the bytes of float64.
        Wt = np.where(self.dead[:, None], 0.0, w.T)[self.perm].astype(np.float32)
        codes = np.zeros((k, n), dtype=np.float32)
        scales = np.zeros((k // gs, n), dtype=np.float64)
        zeros = np.zeros((k // gs, n), dtype=np.float64)
        scale = zero = np.zeros(n)
        if self.static_groups:  # [groups, N], from the weights before any update (dead columns as zeros)
            importance = np.empty_like(self.importance)
            importance[self.perm] = self.importance  # in column order
            groups = np.where(self.dead[:, None], 0.0, w.T).reshape(k // gs, gs, n)
            scales, zeros = self.group_params(groups, 1, importance.reshape(k // gs, gs, 1))
            group_of = self.perm // gs  # the group of the column solved at each position
        for i1 in range(0, k, self.block_size):
            i2 = min(i1 + self.block_size, k)
            W1 = Wt[i1:i2].copy()
            err1 = np.zeros_like(W1)
            U1 = U[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                if self.static_groups:
                    scale, zero = scales[group_of[col]], zeros[group_of[col]]
                elif col % gs == 0:
                    # Group parameters from the weights as updated so far (all earlier error already folded in).
                    group = np.concatenate([W1[i:i + gs], Wt[i2:col + gs]], axis=0)
                    scale, zero = self.group_params(group, 0, self.importance[col:col + gs])
                    scales[col // gs], zeros[col // gs] = scale, zero
                q = quantize_values(W1[i], scale, zero, bits, symmetric)
                codes[col] = q
                err = ((W1[i] - (q - zero) * scale) / U1[i, i]).astype(np.float32)
                W1[i:] -= U1[i, i:, None] * err  # the outer product, without np.outer's overhead
                err1[i] = err
            # Lazy batch update: the rest of the matrix sees this block's errors in one GEMM.
            Wt[i2:] -= U[i1:i2, i2:].T @ err1
        return codes, scales, zeros


def gptq(w: np.ndarray, h: np.ndarray, bits: int = 4, group_size: int | None = 128, symmetric: bool = False,
         act_order: bool = False, damp: float = 0.01, block_size: int = 128,
         static_groups: bool = False, scale_search: str = "minmax", map: MapFn = serial_map) -> QuantizedWeight:
    """Quantize W [N, K] minimising ||X Wᵀ - X Ŵᵀ||² for inputs with H = XᵀX (any positive multiple works).

    act_order: columns are processed by decreasing diag(H) (the most active inputs first, while most
    columns can still absorb their error); groups are formed in that order, so `g_idx[k]` = (position of
    column k in the order) // group_size, and each group's parameters come from its weights as updated when the
    solver reaches it (the reference).

    static_groups: each group's parameters come from the weights before any update, groups in column order
    (AutoGPTQ's `static_groups`, llm-compressor's `actorder: static`); with act_order the columns are still
    solved in activation order, and the result has plain groups (no g_idx), which every target runs.

    scale_search: "minmax" takes each group's range as it is; "mse" shrinks it where that rounds the group with
    less diag(H)-weighted squared error (`search_range`), with the group's weights as the solver sees them.

    Rows never interact (each sees the same H), so after the one Cholesky factorisation the column loop runs on
    row blocks (`row_blocks` of `ROW_BLOCK` rows), through `map` (`GroupInputs.map`: the layer loop's threads).
    """
    w = np.asarray(w, dtype=np.float64)
    h = np.asarray(h, dtype=np.float64)
    n, k = w.shape
    if h.shape != (k, k):
        raise TopqError(f"gptq: Hessian of shape {list(h.shape)} does not match weight input size {k}")
    if scale_search not in ("minmax", "mse"):
        raise TopqError(f"gptq: scale_search must be minmax or mse, got {scale_search!r}")
    bits, gs = check_bits(bits), resolve_group_size(group_size, k)

    H = h.copy()
    # An input channel that never fired carries no information: quantize its weights as zeros, as the reference.
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    perm = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(k)
    H = H[np.ix_(perm, perm)]
    columns = _Columns(_inverse_cholesky(H, damp).astype(np.float32), np.diag(H)[:, None].astype(np.float32), perm,
                       dead, bits, gs, symmetric, max(1, int(block_size)), static_groups,
                       scale_search == "mse")
    parts = map(lambda rows: columns.solve(w[rows]), row_blocks(n, ROW_BLOCK))
    codes, scales, zeros = (np.concatenate([p[i] for p in parts], axis=1).T for i in range(3))

    if not act_order:
        return make_quantized(codes, scales, zeros, bits, gs, symmetric)
    out = np.empty_like(codes)
    out[:, perm] = codes
    if static_groups:
        return make_quantized(out, scales, zeros, bits, gs, symmetric)
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[perm] = np.arange(k) // gs
    return make_quantized(out, scales, zeros, bits, gs, symmetric, g_idx=g_idx)


# --------------------------------------------------------------------------------------- layer adapter


def solve(weight: np.ndarray, stats: InputStats, options: Mapping[str, Any],
          map: MapFn = serial_map) -> QuantizedWeight:
    """GPTQ for linears sharing an input (stacked along N: every row sees the same H, so one call solves them; its
    row blocks run on `map`)."""
    return gptq(weight, stats.hessian(), bits=options["bits"], group_size=options["group_size"],
                symmetric=options["symmetric"], act_order=options["act_order"], damp=options["damp"],
                block_size=options["block_size"], static_groups=options["static_groups"],
                scale_search=options["scale_search"], map=map)


OPTIONS = (
    Option("act_order", Field("bool", False, help="gptq: quantize columns in decreasing activation order")),
    Option("damp", Field("float", 0.01, ge=0, le=1, help="gptq: Hessian dampening, fraction of the mean diagonal")),
    Option("block_size", Field("int", 128, ge=1, help="gptq: columns per lazy-update block")),
    Option("static_groups", Field("bool", False, help="gptq: group parameters from the unsolved weights, groups in "
                                                      "column order (act_order without a permuted g_idx)")),
    Option("scale_search", Field("str", "minmax", choices=("minmax", "mse"),
                                 help="gptq: group ranges as min/max, or shrunk where that lowers the "
                                      "diag(H)-weighted rounding error")),
)


def read_options(quant: Mapping[str, Any]) -> dict[str, Any]:
    return {"act_order": bool(quant["act_order"]), "damp": float(quant["damp"]),
            "block_size": int(quant["block_size"]), "static_groups": bool(quant["static_groups"]),
            "scale_search": str(quant["scale_search"])}


SCHEME = calibration_scheme(
    "gptq", "GPTQ: Hessian-aware column-wise rounding (W4/W8 weight-only, calibrated)",
    solve=solve, own_options=OPTIONS, read_options=read_options, observe=HessianStats)


@topq.hookimpl
def register_quant_schemes(register: Register[QuantScheme]) -> None:
    register(SCHEME)
