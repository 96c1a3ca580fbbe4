"""The hooks a topq plugin implements. Each receives a `register` callback (the style of simonw/llm).

A plugin is a module (or object) with functions decorated by `topq.hookimpl`; it registers built-in
or third-party model families, checkpoint formats, quantization schemes, targets, IR extensions and exporters. Every
hook is
documented in docs/plugins.md (a test checks that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

import pluggy

if TYPE_CHECKING:
    from topq.core.checkpoint import CheckpointFormat
    from topq.core.exporter import Exporter
    from topq.core.family import ModelFamily
    from topq.core.quant import QuantScheme
    from topq.core.target import Target
    from topq.ir.extension import IRExtension

hookspec = pluggy.HookspecMarker("topq")
hookimpl = pluggy.HookimplMarker("topq")

Item = TypeVar("Item", contravariant=True)


class Register(Protocol[Item]):
    """The callback a hook receives: `register(item)` adds one family / format / scheme / target to its registry
    (a second item of the same name is an error). Implementations annotate it, e.g.
    `def register_targets(register: Register[Target]) -> None`, so type checkers see what they may pass."""

    def __call__(self, item: Item, /) -> None: ...


@hookspec
def register_model_families(register: Register[ModelFamily]) -> None:
    """Register model families: the architectures / model_types a family accepts, its config normalisation,
    its weight-name map, its per-layer block builder and its quant groups."""


@hookspec
def register_checkpoint_formats(register: Register[CheckpointFormat]) -> None:
    """Register checkpoint readers (a Hugging Face directory, a GGUF file, pre-quantized formats)."""


@hookspec
def register_quant_schemes(register: Register[QuantScheme]) -> None:
    """Register quantization schemes: name, options, whether it needs calibration, how it quantizes weights."""


@hookspec
def register_targets(register: Register[Target]) -> None:
    """Register targets: a chip spec, its dialect and lowering, passes, bundle code, runtime and perf model."""


@hookspec
def register_ir_extensions(register: Register[IRExtension]) -> None:
    """Register IR extensions: ops added to the catalogue, region kernels the reference interpreter runs them with,
    and optionally the substitution that applies a recipe's `kernels:` section (topq.raw registers its own)."""


@hookspec
def register_exporters(register: Register[Exporter]) -> None:
    """Register exporters (`topq export KIND SOURCE DIR`): hand a model to another tool, e.g. TPU-MLIR."""
