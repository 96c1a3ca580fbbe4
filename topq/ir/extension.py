"""IR extensions: ops and region kernels a plugin adds to the IR (e.g. `topq.raw`: the kernel IR ops,
`top.DSLRegion` and the host kernel that runs it), and the recipe's `kernels:` substitution it offers.

An extension is plain data, built when its module is imported; it reaches the catalogue and the reference
interpreter only when installed: by the plugin manager for every extension a plugin registers
(`register_ir_extensions`), or explicitly by library code that needs its ops before plugins load (a raw
kernel is lowered when it is decorated). Installing is idempotent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from topq.ir.catalogue import OpDef, register_op
from topq.ir.errors import TopqError
from topq.ir.graph import Module, Operation
from topq.ir.interpreter import REGION_KERNELS
from topq.ir.reference_ops import Kernel


class RegionKernel(Protocol):
    """Runs ops whose behaviour lives in their regions: specialised once per op when a function is planned."""

    def bind(self, op: Operation) -> Kernel: ...


#: (module, the recipe's `kernels` entries {replace: OP, with: module:function}) → number of ops replaced
KernelSubstitution = Callable[[Module, Sequence[Mapping[str, str]]], int]


@dataclass(frozen=True)
class IRExtension:
    """What an IR extension adds. `name` identifies it in the plugin registry."""

    name: str
    ops: tuple[OpDef, ...] = ()
    region_kernels: Mapping[str, RegionKernel] = field(default_factory=dict)
    substitute_kernels: KernelSubstitution | None = None  # applies a recipe's `kernels:` section


_INSTALLED: dict[str, IRExtension] = {}


def install_extension(extension: IRExtension) -> None:
    """Register the extension's ops in the catalogue and its region kernels with the interpreter (once)."""
    if _INSTALLED.get(extension.name) is extension:
        return
    for opdef in extension.ops:
        register_op(opdef)
    for name, kernel in extension.region_kernels.items():
        known = REGION_KERNELS.get(name)
        if known is not None and type(known) is not type(kernel):
            raise TopqError(f"region kernel for {name} is registered twice ({type(known).__name__}, "
                            f"{type(kernel).__name__})")
        REGION_KERNELS[name] = kernel
    _INSTALLED[extension.name] = extension
