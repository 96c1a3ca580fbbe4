"""The raw IR extension: the kernel IR ops, `top.DSLRegion`, its host kernel and the recipe's `kernels:`
substitution, as data. The raw plugin (`topq.raw.plugin`) registers it; `install()` puts it into the catalogue
and the interpreter for library code that uses raw kernels before (or without) loading plugins."""

from __future__ import annotations

from topq.ir.extension import IRExtension, install_extension
from topq.raw.kernel_ops import KERNEL_IR
from topq.raw.region import REGION_IR
from topq.raw.substitute import apply_kernel_substitutions

#: everything raw adds, as the raw plugin registers it (its parts install themselves where they are needed)
RAW = IRExtension(
    name="raw",
    ops=(*KERNEL_IR.ops, *REGION_IR.ops),
    region_kernels=REGION_IR.region_kernels,
    substitute_kernels=apply_kernel_substitutions,
)


def install() -> None:
    """Make the raw ops and the DSLRegion host kernel known (idempotent)."""
    install_extension(RAW)
