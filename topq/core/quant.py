"""Quantization schemes: the contract between a scheme plugin, the pipeline and the targets.

A scheme computes quantized *values* for each linear weight; the target decides how to store them
(packing is a target concern). The float schemes (`f32`, `bf16`, `f16`) only choose a compute dtype.
A scheme declares its recipe options (`Option`) and says what it produces (`SchemeProduct`): targets
choose by that, never by the scheme's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from topq.core.errors import TopqError
from topq.io.schema import Field

if TYPE_CHECKING:
    from topq.core.checkpoint import WeightStore

#: keys of the recipe's `quant` section that belong to the core, not to a scheme
CORE_QUANT_KEYS = ("scheme", "lm_head", "calibration")


@dataclass(frozen=True)
class Option:
    """One recipe option a scheme reads (`quant.<name>`): its type, default, choices, range and doc (`spec.help`).

    Schemes may share an option (bits, group_size, symmetric) only with the same declaration."""

    name: str
    spec: Field


@dataclass(frozen=True)
class SchemeProduct:
    """What a scheme produces with given options: what a target selects by (never the scheme's name).

    `compute_dtype`: activations, float weights and quantization scales (f32, bf16, f16);
    `weight_bits`: bit widths of the `QuantizedWeight`s it may return (() = float weights only; each weight's
    exact layout is its `QuantSpec`); `int8_activations`: linears compute on int8 activations (`top.A8MatMul`);
    `act_order`: its weights may come in act-order groups (a permuted `g_idx`, GPTQ's `act_order`).
    """

    compute_dtype: str
    weight_bits: tuple[int, ...] = ()
    int8_activations: bool = False
    act_order: bool = False


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


class InputObserver(Protocol):
    """Statistics of one linear input over calibration data: `add` is called once per calibration sample, in
    sample order, with that sample's inputs x [tokens, K].

    An observer whose costly work is a pure function of one sample may split `add` in two: a static method
    `summarize(x)` (run in the layer loop's tasks, in parallel; picklable, for executors of other processes) and
    `add_summary(summary)` (run in sample order), with `add(x)` ≡ `add_summary(summarize(x))`. `InputStats` does
    so: its per-sample Gram product is most of a calibrated conversion's arithmetic."""

    def add(self, x: np.ndarray) -> None: ...


@dataclass(frozen=True)
class QuantScheme:
    """What a quant plugin registers.

    `compute_dtype` is the activation/compute dtype (f32, bf16, f16); `weight_bits` is None for float schemes;
    `options` are the recipe options it reads (merged into the recipe schema when plugins load); `product(options)`
    says what it produces for a recipe's options (default: `compute_dtype` and `weight_bits` as declared);
    `stored(weights, name, options)` returns values the checkpoint already holds instead of computing them (`auto`;
    None: keep the weight float); `stored_spec(weights, name, options)`, when given, is the layout of `stored`'s value
    without computing it (a requantization is costly; the targets plan with the layout first).
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

    `observe` and `solve` are the two halves of a layer-wise calibrated scheme: `observe(k)` a fresh accumulator of
    the statistics of one linear input with k channels (`InputObserver`), `solve(weight [N, K], stats, options)` the
    QuantizedWeight of linears sharing that input (stacked along N) from its statistics (a `map=` keyword, if
    declared, gets `GroupInputs.map`). Built with `topq.quant.calibration.calibration_scheme(solve=, observe=)`, whose
    `calibrate` runs the layer loop; schemes that need more than one weight at a time (AWQ folds scales into the
    previous op) give the loop a group solver instead and leave `solve` None.
    """

    name: str
    description: str
    compute_dtype: str = "f32"
    weight_bits: int | None = None
    options: tuple[Option, ...] = ()
    needs_calibration: bool = False
    quantize: Callable[[np.ndarray, Mapping[str, Any]], QuantizedWeight] | None = None
    calibrate: Callable[..., Mapping[str, QuantizedWeight]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    restore: Callable[[Any, Any, Any], None] | None = None
    error_report: Callable[[Any, Any, QuantScheme, Any], Mapping[str, QuantizedWeight]] | None = None
    product: Callable[[Mapping[str, Any]], SchemeProduct] | None = None
    stored: Callable[[WeightStore, str, Mapping[str, Any]], QuantizedWeight | None] | None = None
    stored_spec: Callable[[WeightStore, str, Mapping[str, Any]], QuantSpec | None] | None = None
    observe: Callable[[int], InputObserver] | None = None
    solve: Callable[[np.ndarray, Any, Mapping[str, Any]], QuantizedWeight] | None = None

    def produces(self, options: Mapping[str, Any]) -> SchemeProduct:
        """What this scheme produces with the recipe's `quant` options."""
        if self.product is not None:
            return self.product(options)
        return SchemeProduct(self.compute_dtype, () if self.weight_bits is None else (self.weight_bits,))


def resolve_group_size(group_size: int | None, k: int, what: str = "weight") -> int:
    """The effective group size for input size `k`: 0, -1 or None mean one group per row (per channel)."""
    if group_size is None or group_size <= 0:
        return k
    if k % group_size:
        raise TopqError(f"quant.group_size {group_size} does not divide the input size {k} of {what}")
    return int(group_size)
