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
  stores both widths);
* **float**: linears the checkpoint stores in float stay float.

Scales are in the compute dtype, `quant.act_dtype` (default bf16): with f16 a GGUF / GPTQ f16 scale is kept bit
for bit; with bf16 it is rounded (up to 2^-8 relative) where a target stores scales in the compute dtype (the
host target keeps stored scales exact). `report` lists every stored-quantized linear with its route and error and
says in one warning line what was requantized or rounded.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

import topq
from topq.core.calibration_result import CalibrationResult
from topq.core.checkpoint import QuantizedWeightStore, WeightStore
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.core.quant import QuantizedWeight, QuantScheme, SchemeProduct
from topq.ir.analysis import linear_weight_names
from topq.ir.types import round_to_dtype
from topq.quant.grid import quantize_groups, signed_if_offset_symmetric
from topq.quant.options import ACT_DTYPE, act_dtype

#: the requantized layout: BM1684X's W4 group (and the block size of Q4_1 and of the k-quants' sub-blocks)
GROUP = 32


def requant_bits(stored_bits: int) -> int:
    """The width a linear stored at `stored_bits` is requantized to: 4 up to 4 bits, 8 above."""
    return 4 if stored_bits <= 4 else 8


def requantize(w: np.ndarray, stored_bits: int, dtype: str, what: str = "weight") -> QuantizedWeight:
    """Round-to-nearest of a dequantized weight [N, K] in groups of 32, asymmetric, scales rounded to `dtype`."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise TopqError(f"{what}: cannot requantize shape {list(w.shape)} in groups of {GROUP}")
    q = quantize_groups(w, requant_bits(stored_bits), GROUP, symmetric=False)
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
    return requantize(weights.get(name), bits, act_dtype(options), name)


def _relative(error: np.ndarray, reference: np.ndarray) -> float:
    norm = float(np.linalg.norm(reference))
    return float(np.linalg.norm(error)) / norm if norm > 0 else float(np.linalg.norm(error))


def _row(weights: WeightStore, name: str, dtype: str) -> dict[str, Any] | None:
    """One report row: the route, the checkpoint's type and the relative Frobenius error of the weight the
    product holds against the checkpoint's own values (exact routes: only the scales' rounding to `dtype`)."""
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
    requantized = requantize(reference, bits, dtype, name)
    return {"name": name, "mode": "requant", "source": source, "bits": requantized.bits,
            "error": _relative(requantized.dequantize() - reference, reference)}


def report(model: Any, recipe: Any) -> CalibrationResult:
    """Per stored-quantized decoder linear, its route and error (no data is read: `error` is the relative
    Frobenius error of the weight, the output error for white inputs); one warning line per lossy route."""
    weights = model.checkpoint.weights
    dtype = act_dtype(recipe.to_dict()["quant"])
    linears = linear_weight_names(model.module)
    # the lm_head (or the tied embedding) follows quant.lm_head, not this scheme (as the pipeline's Quantizer)
    head = model.family.global_weights["embed" if model.spec.tie_word_embeddings else "lm_head"]
    result = CalibrationResult()
    if isinstance(weights, QuantizedWeightStore):
        for name in weights.names():
            if name in linears and name != head and (row := _row(weights, name, dtype)) is not None:
                result.report.append(row)
    _warn(result.report, dtype)
    return result


def _warn(rows: list[dict[str, Any]], dtype: str) -> None:
    requant = [r for r in rows if r["mode"] == "requant"]
    if requant:
        kinds = ", ".join(f"{n} × {t}" for t, n in sorted(Counter(r["source"] for r in requant).items()))
        widths = "/".join(f"W{b}" for b in sorted({r["bits"] for r in requant}))
        errors = [r["error"] for r in requant]
        print(f"warning: auto: {len(requant)} linears stored without an exact integer form ({kinds}) are "
              f"requantized to {widths} group {GROUP} asymmetric: relative weight error mean "
              f"{100 * float(np.mean(errors)):.2f} %, max {100 * max(errors):.2f} % (per linear in the quant report)",
              file=sys.stderr)
    rounded = [r for r in rows if r.get("scale_error", 0.0) > 0]
    if rounded:
        worst = max(r["scale_error"] for r in rounded)
        print(f"warning: auto: the stored scales of {len(rounded)} linears are rounded to {dtype}, the compute "
              f"dtype, on targets that store scales in it (max relative scale error {100 * worst:.3f} %)"
              + ("; quant.act_dtype: f16 keeps f16 scales exact" if dtype != "f16" else ""), file=sys.stderr)


SCHEME = QuantScheme(
    "auto",
    "the checkpoint's own quantization (quantization_config or GGUF tensor types); GGUF types without an exact "
    "integer form requantized to group 32 (reported)",
    compute_dtype="bf16",
    options=(ACT_DTYPE,),
    # The checkpoint decides each weight's bits; 4 and 8 are what the importers and the requantization produce
    # for GGUF and usual GPTQ/AWQ checkpoints. Other widths (GPTQ 2/3-bit) reach the target per weight, as its
    # QuantSpec.
    product=lambda options: SchemeProduct(act_dtype(options), (4, 8)),
    stored=stored,
    calibrate=report,
)


@topq.hookimpl
def register_quant_schemes(register: Register[QuantScheme]) -> None:
    register(SCHEME)
