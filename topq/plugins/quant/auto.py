"""`auto`: keep the quantization a checkpoint already has (GPTQ / AWQ / AutoRound / compressed-tensors
`quantization_config`, or GGUF tensor types), for the target's weight-only layout.

Each decoder linear takes one of three routes (docs/quantization.md, "Pre-quantized checkpoints"):

* **exact**: integers the checkpoint stores in a form the targets take (GPTQ / AWQ / AutoRound /
  compressed-tensors, GGUF Q4_0 / Q8_0) keep their codes and their stored scales;
* **requant**: GGUF types whose values are float combinations, not integers times one scale (Q4_1's d·q + m,
  Q5_0 / Q5_1, the k-quants, the IQ kinds; `WeightStore.dequantized_bits`) are requantized from their dequantized
  values by round-to-nearest on topq's grid (`topq.quant.grid.quantize_groups`: group 32, asymmetric, the range
  widened to contain 0 so that a group of one sign cannot clip), 4-bit when the checkpoint stores them at 4 bits
  or fewer, 8-bit from 5 bits up (W4 would throw away what Q5_K / Q6_K keep; every target that takes `auto`
  stores both widths), or all at `quant.bits` (4 or 8) when the recipe sets it;
* **float**: linears the checkpoint stores in float stay float.

Scales are in the compute dtype, `quant.act_dtype` (default bf16): with f16 a GGUF / GPTQ f16 scale is kept bit
for bit; with bf16 it is rounded (up to 2^-8 relative) where a target stores scales in the compute dtype (the
host target keeps stored scales exact). `report` lists every stored-quantized linear with its route and error and
says in one warning line what was requantized or rounded.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

import topq
from topq.core.calibration_result import CalibrationResult
from topq.core.checkpoint import QuantizedWeightStore, WeightStore
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.core.quant import QuantizedWeight, QuantScheme, QuantSpec, SchemeProduct
from topq.ir.analysis import linear_weight_names
from topq.ir.types import round_to_dtype
from topq.quant.grid import quantize_groups, signed_if_offset_symmetric
from topq.quant.options import ACT_DTYPE, BITS, act_dtype

#: the requantized layout: BM1684X's W4 group (and the block size of Q4_1 and of the k-quants' sub-blocks)
GROUP = 32


def requant_bits(stored_bits: int, options: Mapping[str, Any]) -> int:
    """The width a linear stored at `stored_bits` is requantized to: `quant.bits` when set (4 or 8), else 4 up to
    4 bits and 8 above."""
    wanted = options.get("bits")
    if wanted is None:
        return 4 if stored_bits <= 4 else 8
    if wanted not in (4, 8):
        raise TopqError(f"quant.bits {wanted}: scheme auto requantizes to 4 or 8 bits (null: by the stored type)")
    return int(wanted)


def requantize(w: np.ndarray, bits: int, dtype: str, what: str = "weight") -> QuantizedWeight:
    """Round-to-nearest of a dequantized weight [N, K] in groups of 32, asymmetric, scales rounded to `dtype`."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise TopqError(f"{what}: cannot requantize shape {list(w.shape)} in groups of {GROUP}")
    q = quantize_groups(w, bits, GROUP, symmetric=False)
    return dataclasses.replace(q, scales=round_to_dtype(q.scales, dtype))


def stored(weights: WeightStore, name: str, options: Mapping[str, Any]) -> QuantizedWeight | None:
    """The checkpoint's own integers for `name`, its requantization when it has none, None when it is float."""
    if not isinstance(weights, QuantizedWeightStore):
        return None
    q = weights.quantized(name)
    if q is not None:
        return signed_if_offset_symmetric(q)
    bits = weights.dequantized_bits(name)
    if bits is None:
        return None
    return requantize(weights.get(name), requant_bits(bits, options), act_dtype(options), name)


def stored_spec(weights: WeightStore, name: str, options: Mapping[str, Any]) -> QuantSpec | None:
    """The layout `stored` gives `name`, without dequantizing or requantizing it."""
    if not isinstance(weights, QuantizedWeightStore):
        return None
    bits = weights.dequantized_bits(name)
    if bits is None:
        q = stored(weights, name, options)
        return q.spec if q is not None else None
    n, k = weights.shape(name)
    return QuantSpec((n, k), requant_bits(bits, options), GROUP, symmetric=False)


def _relative(error: np.ndarray, reference: np.ndarray) -> float:
    norm = float(np.linalg.norm(reference))
    return float(np.linalg.norm(error)) / norm if norm > 0 else float(np.linalg.norm(error))


def _row(weights: WeightStore, name: str, options: Mapping[str, Any]) -> dict[str, Any] | None:
    """One report row: the route, the checkpoint's type and the relative Frobenius error of the weight the
    product holds against the checkpoint's own values (exact routes: only the scales' rounding to the compute
    dtype)."""
    dtype = act_dtype(options)
    source = weights.dtype(name)
    q = weights.quantized(name)
    if q is not None:
        reference = q.dequantize()  # the stored scales
        rounded = round_to_dtype(np.asarray(q.scales, dtype=np.float32), dtype)
        scales = np.asarray(q.scales, dtype=np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale_error = float(np.max(np.where(scales != 0, np.abs(rounded - scales) / np.abs(scales), 0.0),
                                       initial=0.0))
        product = QuantizedWeight(q.codes, rounded, q.zeros, q.bits, q.group_size, q.symmetric, q.g_idx)
        return {"name": name, "mode": "exact", "source": source, "bits": q.bits,
                "error": _relative(product.dequantize() - reference, reference), "scale_error": scale_error}
    bits = weights.dequantized_bits(name)
    if bits is None:
        return None
    reference = weights.get(name)
    requantized = requantize(reference, requant_bits(bits, options), dtype, name)
    return {"name": name, "mode": "requant", "source": source, "bits": requantized.bits,
            "error": _relative(requantized.dequantize() - reference, reference)}


def report(model: Any, recipe: Any) -> CalibrationResult:
    """Per stored-quantized decoder linear, its route and error (no data is read: `error` is the relative
    Frobenius error of the weight, the output error for white inputs); one warning line per lossy route
    (`CalibrationResult.warnings`)."""
    weights = model.checkpoint.weights
    options = recipe.to_dict()["quant"]
    linears = linear_weight_names(model.module)
    # the lm_head (or the tied embedding) follows quant.lm_head, not this scheme (as the pipeline's Quantizer)
    head = model.family.global_weights["embed" if model.spec.tie_word_embeddings else "lm_head"]
    result = CalibrationResult()
    if isinstance(weights, QuantizedWeightStore):
        for name in weights.names():
            if name in linears and name != head and (row := _row(weights, name, options)) is not None:
                result.report.append(row)
    result.warnings = _warnings(result.report, act_dtype(options))
    return result


def _warnings(rows: list[dict[str, Any]], dtype: str) -> list[str]:
    lines = []
    requant = [r for r in rows if r["mode"] == "requant"]
    if requant:
        kinds = ", ".join(f"{n} × {t}" for t, n in sorted(Counter(r["source"] for r in requant).items()))
        widths = "/".join(f"W{b}" for b in sorted({r["bits"] for r in requant}))
        errors = [r["error"] for r in requant]
        lines.append(f"auto: {len(requant)} linears stored without an exact integer form ({kinds}) are "
                     f"requantized to {widths} group {GROUP} asymmetric: relative weight error mean "
                     f"{100 * float(np.mean(errors)):.2f} %, max {100 * max(errors):.2f} % "
                     "(per linear in the quant report)")
    rounded = [r for r in rows if r.get("scale_error", 0.0) > 0]
    if rounded:
        worst = max(r["scale_error"] for r in rounded)
        hint = "; quant.act_dtype: f16 keeps f16 scales exact" if dtype != "f16" else ""
        lines.append(f"auto: the stored scales of {len(rounded)} linears are rounded to {dtype}, the compute dtype, "
                     f"on targets that store scales in it (max relative scale error {100 * worst:.3f} %){hint}")
    return lines


def product(options: Mapping[str, Any]) -> SchemeProduct:
    """The checkpoint decides each weight's bits; 4 and 8 are what the importers and the requantization produce
    for GGUF and usual GPTQ/AWQ checkpoints. Other widths (GPTQ 2/3-bit) reach the target per weight, as its
    QuantSpec. A `quant.bits` auto cannot requantize to is refused here, before any work."""
    requant_bits(4, options)
    return SchemeProduct(act_dtype(options), (4, 8))


SCHEME = QuantScheme(
    "auto",
    "the checkpoint's own quantization (quantization_config or GGUF tensor types); GGUF types without an exact "
    "integer form requantized to group 32 (reported)",
    compute_dtype="bf16",
    options=(BITS, ACT_DTYPE),
    product=product,
    stored=stored,
    stored_spec=stored_spec,
    calibrate=report,
)


@topq.hookimpl
def register_quant_schemes(register: Register[QuantScheme]) -> None:
    register(SCHEME)
