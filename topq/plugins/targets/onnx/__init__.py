"""The ONNX Runtime target (`target.chip: onnx`): each stage function as an ONNX graph run by ONNX Runtime.

compile: Top → ONNX per function (lowering.py; weight-only linears as MatMulNBits, packing.py) → graph bytes and
initializers as bundle tensors (compiler.py). open: an executor with one InferenceSession per function
(executor.py). It chooses by what the scheme produces — its compute dtype and each weight's QuantSpec — never by
the scheme's name. See docs/onnx.md.

`onnx` and `onnxruntime` are imported only when a model is compiled or opened, so topq loads without them.
"""

from __future__ import annotations

import os
from typing import Any

import topq
from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.core.quant import Option, SchemeProduct
from topq.core.target import CompiledModel, CompileJob, Executor, Target
from topq.io.schema import Field
from topq.plugins.targets.onnx.conventions import (
    ACCURACY_LEVELS,
    ATTENTION_MODES,
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_ATTENTION,
)

ACCURACY_LEVEL = Option("accuracy_level", Field(
    "int", DEFAULT_ACCURACY_LEVEL, ge=min(ACCURACY_LEVELS), le=max(ACCURACY_LEVELS),
    help="onnx: MatMulNBits accuracy_level, the smallest type its activations may be computed in "
         "(0: float32, as the scheme's values; 4: int8, faster, +0.4 % perplexity on SmolLM2 W4)"))

ATTENTION = Option("attention", Field(
    "str", DEFAULT_ATTENTION, choices=ATTENTION_MODES,
    help="onnx: attention as com.microsoft.GroupQueryAttention (gqa: everywhere, refusing what it cannot "
         "express), standard ONNX ops (standard), or GroupQueryAttention where it fits (auto; docs/onnx.md)"))


def accuracy_level(job: CompileJob) -> int:
    """MatMulNBits' accuracy_level: the recipe's `target.accuracy_level` (typed and range-checked by the schema)."""
    value = (job.recipe.get("target") or {}).get("accuracy_level", DEFAULT_ACCURACY_LEVEL)
    if isinstance(value, bool) or value not in ACCURACY_LEVELS:  # a job built by hand, not from a recipe
        raise TopqError(f"target.accuracy_level must be one of {', '.join(map(str, ACCURACY_LEVELS))}, got {value!r}")
    return int(value)


def attention(job: CompileJob) -> str:
    """The recipe's `target.attention` (checked by the schema)."""
    value = (job.recipe.get("target") or {}).get("attention", DEFAULT_ATTENTION)
    if value not in ATTENTION_MODES:  # a job built by hand, not from a recipe
        raise TopqError(f"target.attention must be one of {', '.join(ATTENTION_MODES)}, got {value!r}")
    return str(value)


def compile_bundle(job: CompileJob) -> CompiledModel:
    try:
        import onnx  # noqa: F401
    except ImportError:
        raise TopqError("the onnx target needs the onnx package, which is not installed: "
                        "pip install 'onnx>=1.17,<2'") from None
    from topq.plugins.targets.onnx.compiler import compile_onnx

    return compile_onnx(job, accuracy_level(job), attention(job))


def open_bundle(bundle: Bundle) -> Executor:
    from topq.plugins.targets.onnx.executor import OnnxExecutor

    override = os.environ.get("TOPQ_ONNX_ACCURACY_LEVEL")
    level = None
    if override:
        if override not in {str(a) for a in ACCURACY_LEVELS}:
            raise TopqError(f"TOPQ_ONNX_ACCURACY_LEVEL must be one of {', '.join(map(str, ACCURACY_LEVELS))}, "
                            f"got {override!r}")
        level = int(override)
    return OnnxExecutor(bundle, accuracy_level=level)


def report(bundle: Bundle) -> dict[str, Any]:
    """What `topq inspect` shows for an onnx bundle: the ONNX side of its functions."""
    meta = bundle.meta.get("target_meta") or {}
    functions = meta.get("functions", {})
    graph_bytes = sum(int(bundle.tensor(f["graph"]).nbytes) for f in functions.values())
    text = (f"onnx: opset {meta.get('opset')} + com.microsoft, {len(functions)} graphs ({graph_bytes / 1e3:.1f} kB), "
            f"activations float32, float weights {meta.get('dtype')}, {meta.get('matmul_nbits', 0)} MatMulNBits "
            f"linears (accuracy_level {meta.get('accuracy_level')})")
    if meta.get("attention"):
        text += f", attention {meta['attention']} ({meta.get('gqa_nodes', 0)} GroupQueryAttention)"
    return {"onnx": {k: meta.get(k) for k in ("opset", "dtype", "accuracy_level", "matmul_nbits", "attention")},
            "text_sections": [text]}


def refuses(product: SchemeProduct) -> str | None:
    """MatMulNBits holds 4- and 8-bit weight-only linears; activations stay float (no W8A8 mapping)."""
    if product.int8_activations:
        return "int8 activations (W8A8 has no ONNX mapping here)"
    odd = [b for b in product.weight_bits if b not in (4, 8)]
    if odd:
        return f"{'/'.join(map(str, odd))}-bit weights (MatMulNBits takes 4 or 8 bits)"
    return None


TARGET = Target(
    name="onnx",
    description="ONNX Runtime (CPU): one ONNX graph per stage function, float32 activations, "
                "W4/W8 weight-only linears as MatMulNBits",
    compile=compile_bundle,
    open=open_bundle,
    report=report,
    refuses=refuses,
    options=(ACCURACY_LEVEL, ATTENTION),
)


@topq.hookimpl
def register_targets(register: Register[Target]) -> None:
    register(TARGET)
