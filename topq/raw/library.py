"""Ready-made raw kernels, usable from a recipe (`with: "topq.raw.library:silu"`) or with `raw_call`.

Each computes exactly what the Top op of the same name computes in `reference_ops.py` (same float32 operation
order), so swapping one in changes nothing but who runs the arithmetic. Activations are written for the
`[batch, tokens, features]` tensors a transformer block produces.
"""

from __future__ import annotations

from topq.raw.annotations import InOut, Input, Num
from topq.raw.functions import exp, rsqrt
from topq.raw.kernel import kernel


@kernel
def silu(x: Input["tensor<?x?x?xf32>"], y: InOut["tensor<?x?x?xf32>"]) -> None:
    """top.SiLU: x / (1 + exp(-x))."""
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for c in range(x.shape[2]):
                v = x[b, t, c]
                y[b, t, c] = v / (1.0 + exp(-v))


@kernel
def rms_norm(x: Input["tensor<?x?x?xf32>"], w: Input["tensor<?xf32>"], y: InOut["tensor<?x?x?xf32>"],
             eps: Num["f32"]) -> None:
    """RMSNorm over the last dim with a weight; the sum of squares runs left to right (not numpy's pairwise
    mean, so it matches top.RMSNorm to rounding, not bit for bit)."""
    n = x.shape[2]
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            acc = 0.0
            for c in range(n):
                v = x[b, t, c]
                acc = acc + v * v
            r = rsqrt(acc / n + eps)
            for c in range(n):
                y[b, t, c] = x[b, t, c] * r * w[c]
