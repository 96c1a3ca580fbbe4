"""Targets: the contract between a target plugin, the pipeline (compile) and the runtime (execute)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from topq.core.errors import TopqError
from topq.ir.types import TensorType

if TYPE_CHECKING:
    from topq.core.bundle import Bundle
    from topq.core.family import ModelSpec
    from topq.core.quant import Option, QuantizedWeight, QuantScheme, QuantSpec, SchemeProduct
    from topq.ir.graph import Module


@dataclass
class CompileJob:
    """Everything a target needs to compile a model: the Top program, its weights and the recipe's choices."""

    module: Module
    spec: ModelSpec
    weights: Callable[[str], np.ndarray]  # float32 tensor by name (checkpoint + RoPE tables)
    scheme: QuantScheme
    quant_options: Mapping[str, Any]
    recipe: Mapping[str, Any]
    #: a float weight stored in `dtype` (f32/bf16/f16) — without a float32 detour when the checkpoint already
    #: stores it that way (large embeddings stream at their stored size)
    weight_in: Callable[[str, str], np.ndarray] | None = None
    linear_weights: frozenset[str] = frozenset()  # names of weights used as a MatMul's right operand
    #: the scheme's values for a weight-quantized linear (None: keep it in the compute dtype). The pipeline
    #: decides (scheme, quant.lm_head, pre-quantized checkpoints); targets only pack what it returns.
    quantized: Callable[[str], QuantizedWeight | None] = lambda name: None
    #: the layout of `quantized(name)` without computing it (lowering and memory planning need only this)
    quant_spec: Callable[[str], QuantSpec | None] = lambda name: None
    #: what the scheme produces with these options (compute dtype, weight bits, int8 activations); default:
    #: `scheme.produces(quant_options)`
    product: SchemeProduct | None = None

    def __post_init__(self) -> None:
        if self.product is None:
            self.product = self.scheme.produces(self.quant_options)
        if self.weight_in is None:
            from topq.ir.types import ELEMENT_TYPES, round_to_dtype

            self.weight_in = lambda name, dtype: round_to_dtype(self.weights(name), dtype).astype(ELEMENT_TYPES[dtype])


@dataclass
class CompiledModel:
    """What a target hands to the bundle writer: the program, and its tensors as a manifest plus a producer.

    `manifest` lists every bundle tensor (name → type) in bundle order; `produce(names)` yields the arrays of
    those tensors in that order, computing each from the checkpoint on demand so conversion can stream and run
    in parallel (any subset, in any process that compiled the same job). `source_of(name)` names the checkpoint
    weight a tensor is made from (None for tensors the compiler synthesises), for build caching.
    """

    program: str
    manifest: dict[str, TensorType]
    produce: Callable[[Sequence[str]], Iterator[tuple[str, np.ndarray]]]
    metadata: dict[str, Any] = field(default_factory=dict)
    source_of: Callable[[str], str | None] = lambda name: name


class Executor(Protocol):
    """Runs one function of a loaded bundle: the runtime's only view of a target. `lm_head` is position-wise; an
    executor whose `run` also takes it on [1, T, H] for any T says so with a true `lm_head_rows` attribute (optional),
    and the runtime then computes a segment's logits in one call (perplexity), not one call per position."""

    def run(self, name: str, inputs: list[np.ndarray]) -> list[np.ndarray]: ...


def float_only(product: SchemeProduct) -> str | None:
    """The default `Target.refuses`: float weights and float activations only."""
    if product.weight_bits:
        return f"{'/'.join(map(str, product.weight_bits))}-bit quantized weights"
    if product.int8_activations:
        return "int8 activations"
    return None


def runs_everything(product: SchemeProduct) -> None:
    """`Target.refuses` of a target that stores whatever a scheme produces (the host)."""


@dataclass(frozen=True)
class Target:
    """What a target plugin registers.

    `refuses(product)` says why the target cannot store what a scheme produces (a short phrase naming it, e.g.
    "3-bit quantized weights"), or None when it can; the pipeline asks before converting. Targets choose by the
    product, never by the scheme's name, so a third-party scheme runs wherever its values fit."""

    name: str
    description: str
    compile: Callable[[CompileJob], CompiledModel]
    open: Callable[[Bundle], Executor]
    refuses: Callable[[SchemeProduct], str | None] = float_only
    perf: Callable[..., Any] | None = None
    #: what `topq inspect` adds for this target's bundles (memory map, layer groups, predicted speed): keys merged
    #: into the JSON description, and optional `text_sections` (list of str) printed after the tables
    report: Callable[[Bundle], dict[str, Any]] | None = None
    #: the recipe options it reads (`target.<name>`, beside `chip`); `compile` finds them in `job.recipe["target"]`
    options: tuple[Option, ...] = ()


#: the keys of the recipe's `target` section that belong to the core, not to a target
CORE_TARGET_KEYS = ("chip", "checker")


def check_target_options(target: Target, section: Mapping[str, Any], declared: Iterable[Option]) -> None:
    """Refuse, before any work, a `target.<option>` set away from its default that the chosen target does not
    read (e.g. onnx's `accuracy_level` with `chip: host`): it would change nothing."""
    own = {o.name for o in target.options}
    for option in declared:
        if option.name not in own and section.get(option.name, option.spec.default) != option.spec.default:
            raise TopqError(f"target.{option.name} = {section[option.name]!r} does not apply to target "
                            f"{target.name} (it reads: {', '.join(sorted(own)) or 'no options'})")
