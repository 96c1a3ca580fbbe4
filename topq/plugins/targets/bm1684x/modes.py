"""The quantization modes the BM1684X family runs, as data: compute dtype and weight bits per recipe scheme name."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from topq.core.errors import TopqError

FLOAT_DTYPES = ("f32", "bf16", "f16")
NP_DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f16": np.dtype(np.float16),
}


@dataclass(frozen=True)
class Mode:
    name: str
    dtype: str  # activations, float weights and the KV cache are stored in this dtype; MACs take it
    weight_bits: int = 0  # 0: float weights (tpu.MatMul); 4 or 8: weight-only (tpu.A16MatMul)


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("f32", "f32"), Mode("bf16", "bf16"), Mode("f16", "f16"),
    Mode("w8bf16", "bf16", 8), Mode("w4bf16", "bf16", 4), Mode("w8f16", "f16", 8), Mode("w4f16", "f16", 4),
    # the checkpoint's own 4/8-bit weights (A16MatMul per weight, as its QuantSpec says) with bf16 activations
    Mode("auto", "bf16"),
    # calibrated weight-only algorithms: their integers are packed like RTN's (per weight, from its QuantSpec)
    Mode("gptq", "bf16"), Mode("awq", "bf16"), Mode("autoround", "bf16"),
    # W8A8: the scheme rewrites its linears to top.MatMulInt8 (→ tpu.MatMulInt8); everything else is bf16
    Mode("int8", "bf16"),
)}


def get_mode(name: str, chip: str = "bm1684x") -> Mode:
    try:
        return MODES[name]
    except KeyError:
        raise TopqError(f"target {chip} cannot run scheme {name!r}; it runs: {', '.join(MODES)}") from None
