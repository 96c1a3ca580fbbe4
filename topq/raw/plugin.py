"""Raw kernels as a built-in plugin: registers the raw IR extension (docs/raw_kernels.md)."""

from __future__ import annotations

from collections.abc import Callable

import topq
from topq.ir.extension import IRExtension
from topq.raw.extension import RAW


@topq.hookimpl
def register_ir_extensions(register: Callable[[IRExtension], None]) -> None:
    register(RAW)
