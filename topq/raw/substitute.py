"""The recipe's `kernels:` section: replace named Top ops by raw kernels in every stage function.

    kernels:
      - {replace: top.SiLU, with: "my_pkg.kernels:silu"}

`with` is `module:function` naming a `@kernel`. Only modules of topq itself, of an installed topq plugin package
(entry-point group `topq`), or named by the user on the command line (`topq convert --kernel-module MODULE`,
which sets `TOPQ_KERNEL_MODULES`) are imported: a recipe alone cannot make topq import arbitrary code.
Fused ops hide the op to replace: the Llama-style families emit `top.MLP` (gate/up/down with the activation
inside), so replacing `top.SiLU` (or `top.GELU`) first decomposes each `top.MLP` with that activation into
`MatMul(gate)`, the activation op, `Mul(up)` and `MatMul(down)` — the same arithmetic as the fused reference —
and then replaces the activation.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

from topq.core.errors import TopqError
from topq.ir.catalogue import lookup_op
from topq.ir.graph import Module, Operation
from topq.ir.rewrite import Pattern, Rewriter, apply_patterns
from topq.raw.kernel import Kernel
from topq.raw.region import replacement_table

#: activation op → (the top.MLP `act` values that contain it, the attributes the decomposed op gets)
_MLP_ACTIVATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "top.SiLU": {"silu": {}},
    "top.GELU": {"gelu": {"approximate": "none"}, "gelu_tanh": {"approximate": "tanh"}},
}


def _allowed(module_name: str) -> bool:
    from topq.core.plugins import KERNEL_MODULES_ENV, third_party_entry_points

    package = module_name.split(".")[0]
    plugin_packages = {ep.value.split(":")[0].split(".")[0] for ep, _ in third_party_entry_points()}
    named = {m.strip() for m in os.environ.get(KERNEL_MODULES_ENV, "").split(",") if m.strip()}
    return package == "topq" or package in plugin_packages or module_name in named


def load_kernel(ref: str) -> Kernel:
    """Import `module:function` (an allowed module, see above) and check that it is a raw kernel."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise TopqError(f"kernels: {ref!r} must be 'module:function' (e.g. my_pkg.kernels:silu)")
    if not _allowed(module_name):
        raise TopqError(f"kernels: {module_name!r} is not part of topq or of an installed topq plugin; name it "
                        f"on the command line to allow it (topq convert --kernel-module {module_name})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TopqError(f"kernels: cannot import {module_name!r} for {ref!r}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TopqError(f"kernels: module {module_name!r} has no {attr!r} (for {ref!r})")
        obj = getattr(obj, part)
    if not isinstance(obj, Kernel):
        raise TopqError(f"kernels: {ref!r} is a {type(obj).__name__}, not a raw kernel (decorate it with "
                        f"@topq.raw.kernel)")
    return obj


def mlp_decomposition(activation: str) -> Pattern:
    """A pattern splitting a `top.MLP` whose act is one of `activation`'s into MatMul / act / Mul / MatMul."""
    acts = _MLP_ACTIVATIONS[activation]

    def pattern(op: Operation, rewriter: Rewriter) -> bool:
        act = op.attrs.get("act", "silu")
        if act not in acts:
            return False
        b = rewriter.builder
        x, w_gate, w_up, w_down = op.operands
        loc = op.loc or "mlp"
        gate = b.top.MatMul(x, w_gate, right_transpose=True, loc=f"{loc}.gate_proj")
        up = b.top.MatMul(x, w_up, right_transpose=True, loc=f"{loc}.up_proj")
        activated = b.op(activation, gate, loc=f"{loc}.act", **acts[act])
        y = b.top.MatMul(b.top.Mul(activated, up, loc=f"{loc}.mul"), w_down, right_transpose=True,
                         loc=f"{loc}.down_proj")
        rewriter.replace(op, [y])
        return True

    return pattern


def apply_kernel_substitutions(module: Module, entries: Iterable[Mapping[str, str]]) -> int:
    """Apply the recipe's `kernels` entries ({replace: OP, with: module:function}); return ops replaced."""
    replaced = 0
    for entry in entries:
        op_name, ref = entry["replace"], entry["with"]
        lookup_op(op_name)  # an unknown op name is an error listing the known ones
        kernel = load_kernel(ref)
        if op_name in _MLP_ACTIVATIONS:
            apply_patterns(module, {"top.MLP": [mlp_decomposition(op_name)]})
        before = _count(module, op_name)
        if before == 0:
            raise TopqError(f"kernels: no {op_name} op in the model to replace by {ref}")
        apply_patterns(module, replacement_table(op_name, kernel))
        replaced += before
    return replaced


def _count(module: Module, op_name: str) -> int:
    return sum(1 for f in module for op in f.walk() if op.name == op_name)
