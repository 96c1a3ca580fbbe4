"""What the BM1684X family runs, decided from what a scheme produces (`SchemeProduct`), never from its name.

* compute: f32, bf16 or f16 — activations, float weights, scales and the KV cache are stored in it;
* weights: float (tpu.MatMul), or 4/8-bit weight-only integers of any scheme (tpu.A16MatMul; each weight's
  layout is checked against the packing by `packing.check_spec`);
* int8 activations: top.MatMulInt8 → tpu.MatMulInt8 (W8A8).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from topq.core.quant import SchemeProduct

FLOAT_DTYPES = ("f32", "bf16", "f16")
WEIGHT_BITS = (4, 8)  # what tpu.A16MatMul packs
NP_DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f16": np.dtype(np.float16),
}


@dataclass(frozen=True)
class Mode:
    name: str  # the recipe's scheme, recorded in the bundle (`bm.mode`, target metadata)
    dtype: str  # activations, float weights and the KV cache are stored in this dtype; MACs take it


def refuses(product: SchemeProduct) -> str | None:
    """Why the chip cannot store what a scheme produces (None: it can)."""
    if product.compute_dtype not in FLOAT_DTYPES:
        return f"compute dtype {product.compute_dtype} (it computes in {', '.join(FLOAT_DTYPES)})"
    odd = [bits for bits in product.weight_bits if bits not in WEIGHT_BITS]
    if odd:
        return f"{odd[0]}-bit weights (tpu.A16MatMul packs 4- or 8-bit weights)"
    if product.act_order:
        return "act-order (permuted g_idx) groups; quantize without act_order"
    return None


def mode_of(scheme: str, product: SchemeProduct) -> Mode:
    """The mode a bundle is compiled in: named after the scheme, computing in its product's dtype."""
    return Mode(scheme, product.compute_dtype)
