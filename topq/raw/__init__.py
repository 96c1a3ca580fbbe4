"""Raw kernels: Python functions with MLIR-typed parameters, compiled to kernel IR and embedded in Top graphs.

    from topq.raw import kernel, Input, InOut, Num, exp

    @kernel
    def silu(x: Input["tensor<?x?xf32>"], y: InOut["tensor<?x?xf32>"]):
        for i in range(x.shape[0]):
            for j in range(x.shape[1]):
                v = x[i, j]
                y[i, j] = v / (1.0 + exp(-v))

`silu(x, out)` runs it on numpy arrays; `raw_call(b, silu, [out], [x])` puts it in a Top graph as a
`top.DSLRegion`; a recipe's `kernels: [{replace: top.SiLU, with: "pkg.mod:silu"}]` swaps it in for an op.
See docs/raw_kernels.md. The kernel IR ops, `top.DSLRegion` and its host kernel are an IR extension
(`topq.raw.extension`) that the raw plugin registers; decorating a kernel or calling `raw_call` installs it too.
"""

from topq.raw.annotations import InOut, Input, Num
from topq.raw.functions import erf, exp, log, rsqrt, sqrt, tanh
from topq.raw.kernel import Kernel, kernel
from topq.raw.region import DSL_REGION, raw_call

__all__ = ["DSL_REGION", "InOut", "Input", "Kernel", "Num", "erf", "exp", "kernel", "log", "raw_call", "rsqrt",
           "sqrt", "tanh"]
