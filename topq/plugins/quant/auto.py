"""`auto`: keep the quantization a checkpoint already has (GPTQ / AWQ / AutoRound / compressed-tensors
`quantization_config`, or GGUF Q4_0 / Q8_0 tensors), repacked for the target without requantizing.

Linears the checkpoint stores in float stay float; GGUF tensor types without an exact integer form (Q4_1,
k-quants) are dequantized, and the conversion warns naming those types.
"""

from __future__ import annotations

import topq
from topq.core.hookspecs import Register
from topq.core.quant import QuantScheme

SCHEME = QuantScheme(
    "auto",
    "the checkpoint's own quantization (quantization_config or GGUF tensor types), repacked losslessly",
    compute_dtype="bf16",
    options=("lm_head",),
)


@topq.hookimpl
def register_quant_schemes(register: Register[QuantScheme]) -> None:
    register(SCHEME)
