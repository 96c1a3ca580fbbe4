"""Float schemes: no weight quantization, just the compute dtype (f32, bf16, f16)."""

from __future__ import annotations

import topq
from topq.core.hookspecs import Register
from topq.core.quant import QuantScheme

SCHEMES = (
    QuantScheme("f32", "float32 weights and activations", compute_dtype="f32"),
    QuantScheme("bf16", "bfloat16 weights and activations", compute_dtype="bf16"),
    QuantScheme("f16", "float16 weights and activations", compute_dtype="f16"),
)


@topq.hookimpl
def register_quant_schemes(register: Register[QuantScheme]) -> None:
    for scheme in SCHEMES:
        register(scheme)
