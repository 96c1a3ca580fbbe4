"""`auto`: keep the quantization a checkpoint already has (GPTQ / AWQ / AutoRound / compressed-tensors
`quantization_config`, or GGUF Q4_0 / Q8_0 tensors), repacked for the target without requantizing.

Linears the checkpoint stores in float stay float; GGUF tensor types without an exact integer form (Q4_1,
k-quants) are dequantized, and the conversion warns naming those types.
"""

from __future__ import annotations

import topq
from topq.core.checkpoint import QuantizedWeightStore, WeightStore
from topq.core.hookspecs import Register
from topq.core.quant import QuantizedWeight, QuantScheme, SchemeProduct
from topq.quant.grid import signed_if_offset_symmetric


def stored(weights: WeightStore, name: str) -> QuantizedWeight | None:
    """The checkpoint's own integers for `name` (None: the checkpoint stores it as float)."""
    if not isinstance(weights, QuantizedWeightStore):
        return None
    q = weights.quantized(name)
    return signed_if_offset_symmetric(q) if q is not None else None

SCHEME = QuantScheme(
    "auto",
    "the checkpoint's own quantization (quantization_config or GGUF tensor types), repacked losslessly",
    compute_dtype="bf16",
    # The checkpoint decides each weight's bits; 4 and 8 are what the importers produce for GGUF and usual
    # GPTQ/AWQ checkpoints. Other widths (GPTQ 2/3-bit) reach the target per weight, as its QuantSpec.
    product=lambda options: SchemeProduct("bf16", (4, 8)),
    stored=stored,
)


@topq.hookimpl
def register_quant_schemes(register: Register[QuantScheme]) -> None:
    register(SCHEME)
