"""Recipe options shared by the weight-quantizing schemes (declared once, so their declarations agree).

Each scheme lists the options it reads in `QuantScheme.options`; the recipe schema merges them
(`topq.io.schema.merge_options`), and two schemes may share an option only with the same declaration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from topq.core.errors import TopqError
from topq.core.quant import Option
from topq.core.recipe import Field
from topq.ir.products import KINDS

__all__ = ["ACT_DTYPE", "BITS", "CALIBRATION_MATMUL", "EXPERT_MIN_TOKENS", "EXPERT_MIN_TOKENS_OPTION", "GROUP_SIZE",
           "SYMMETRIC", "WEIGHT_OPTIONS", "act_dtype"]

BITS = Option("bits", Field("int", None, nullable=True, ge=1, le=16, help="weight bits; null = the scheme's default"))
GROUP_SIZE = Option("group_size", Field("int", 64, ge=-1,
                                        help="weights per quantization group; 0 or -1 = per channel"))
SYMMETRIC = Option("symmetric", Field("bool", False, help="symmetric (no zero point) weight quantization"))
ACT_DTYPE = Option("act_dtype", Field("str", None, nullable=True,
                                      help="activation dtype for weight-only algorithms"))
CALIBRATION_MATMUL = Option("calibration_matmul", Field(
    "str", "f32", choices=KINDS,
    help="calibrated schemes: the products of the calibration forwards' linears and Hessian sums; f32 = numpy "
         "float32 (the reference), bf16 = torch bfloat16 (fast on CPUs with bf16 units, other results)"))
EXPERT_MIN_TOKENS = 16
EXPERT_MIN_TOKENS_OPTION = Option("expert_min_tokens", Field(
    "int", EXPERT_MIN_TOKENS, ge=1,
    help="calibrated schemes: a mixture-of-experts expert routed fewer calibration tokens than this is rounded to "
         "nearest instead (reported)"))

#: what every weight-only scheme reads
WEIGHT_OPTIONS = (BITS, GROUP_SIZE, SYMMETRIC)

_ACT_DTYPES = ("bf16", "f16", "f32")


def act_dtype(options: Mapping[str, Any], default: str = "bf16") -> str:
    """`quant.act_dtype`, or `default` when null; a dtype the algorithms cannot compute in is an error."""
    value = options.get("act_dtype") or default
    if value not in _ACT_DTYPES:
        raise TopqError(f"quant.act_dtype must be bf16, f16 or f32, got {value!r}")
    return str(value)
