"""Quantization schemes: the contract between a scheme plugin, the pipeline and the targets.

A scheme computes quantized *values* for each linear weight; the target decides how to store them
(packing is a target concern). The float schemes (`f32`, `bf16`, `f16`) only choose a compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from topq.core.errors import TopqError


@dataclass(frozen=True)
class QuantSpec:
    """What a target needs to lay out a quantized weight, known before its values are computed (streaming)."""

    shape: tuple[int, int]  # [N, K]
    bits: int
    group_size: int
    symmetric: bool
    act_order: bool = False  # columns grouped by a non-trivial g_idx


@dataclass
class QuantizedWeight:
    """Integer codes with per-group scales and zero points: w ≈ (codes - zeros) * scales, group-wise along K.

    codes: [N, K] integers, either unsigned in [0, 2^bits) with real zero points (asymmetric schemes, and
    imported checkpoints, whose symmetric weights carry zeros = 2^(bits-1)), or signed in
    [-2^(bits-1), 2^(bits-1)) with zeros = 0 (topq's symmetric RTN);
    scales / zeros: [N, K / group_size] (group_size = K for per-channel); g_idx: optional [K] group of each column.
    """

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    bits: int
    group_size: int
    symmetric: bool
    g_idx: np.ndarray | None = None

    @property
    def spec(self) -> QuantSpec:
        n, k = self.codes.shape
        act_order = self.g_idx is not None and not np.array_equal(self.g_idx, np.arange(k) // self.group_size)
        return QuantSpec((n, k), self.bits, self.group_size, self.symmetric, act_order)

    def dequantize(self) -> np.ndarray:
        n, k = self.codes.shape
        groups = self.g_idx if self.g_idx is not None else np.arange(k) // self.group_size
        scales = self.scales[:, groups].astype(np.float32)
        zeros = self.zeros[:, groups].astype(np.float32)
        return ((self.codes.astype(np.float32) - zeros) * scales).astype(np.float32)


@dataclass(frozen=True)
class QuantScheme:
    """What a quant plugin registers.

    `compute_dtype` is the activation/compute dtype (f32, bf16, f16); `weight_bits` is None for float schemes.
    `quantize(weight, options)` returns a QuantizedWeight for one linear weight [N, K] (round-to-nearest schemes).
    `calibrate(model, recipe, *, executor)` (schemes that need data: GPTQ, AWQ, AutoRound, INT8) runs the float
    model on the recipe's calibration data and returns {weight name: QuantizedWeight} plus anything it wants in the
    bundle (a `topq.core.calibration_result.CalibrationResult`: `float_weights`, `report`, `state`). `executor` is the
    conversion's `topq.core.executors.TaskExecutor`, for the per-sample work (`run_calibration` uses it); the
    pipeline passes it only to a `calibrate` that declares an `executor` parameter (or **kwargs), so two-argument
    calibrate functions keep working, in this process.

    The result is computed once, in the converting process. Workers that do not inherit that process's memory
    (Ray) load it from a file instead of calibrating again: the returned mapping's values, `float_weights`,
    `report` and `state` (JSON-able) are stored, and `restore(model, recipe, result)`, if the scheme has one,
    re-applies in the worker whatever else `calibrate` did to the model (int8 rewrites the program from the plan
    in `state`). A scheme whose calibrate changes the model in other ways and has no `restore` cannot be
    distributed exactly.

    `error_report(model, recipe, scheme, executor)`, for a weight-by-weight scheme (`quantize`, no `calibrate`), is
    run when the recipe gives calibration data: a CalibrationResult without values whose `report` lists each
    linear's output error on that data (the RTN schemes use `topq.quant.calibration.quantization_report`).
    """

    name: str
    description: str
    compute_dtype: str = "f32"
    weight_bits: int | None = None
    options: tuple[str, ...] = ()
    needs_calibration: bool = False
    quantize: Callable[[np.ndarray, Mapping[str, Any]], QuantizedWeight] | None = None
    calibrate: Callable[..., Mapping[str, QuantizedWeight]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    restore: Callable[[Any, Any, Any], None] | None = None
    error_report: Callable[[Any, Any, QuantScheme, Any], Mapping[str, QuantizedWeight]] | None = None

    @property
    def is_float(self) -> bool:
        return self.weight_bits is None


def resolve_group_size(group_size: int | None, k: int, what: str = "weight") -> int:
    """The effective group size for input size `k`: 0, -1 or None mean one group per row (per channel)."""
    if group_size is None or group_size <= 0:
        return k
    if k % group_size:
        raise TopqError(f"quant.group_size {group_size} does not divide the input size {k} of {what}")
    return int(group_size)


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
