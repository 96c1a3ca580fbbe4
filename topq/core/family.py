"""Model families: the contract between a family plugin and the core's stage template.

A family is data plus one function (the MLC-LLM shape): which architectures it accepts, how it turns a
Hugging Face config into a `ModelSpec`, its weight names, and `build_block`, the transformer block
written once. The stage template (`stages.py`) wraps that block into prefill, prefill-with-history and
decode functions through a `BlockContext`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from topq.core.errors import TopqError
from topq.core.spec import ModelSpec  # re-exported: families import it from here

if TYPE_CHECKING:
    # Type-only: stages imports this module at run time (family → stages would be a cycle).
    from topq.core.checkpoint import WeightStore
    from topq.core.stages import BlockContext
    from topq.ir.builder import Builder
    from topq.ir.graph import Value

#: `hook(builder, spec, value) -> value`: a family's step after the embedding gather or after the lm_head matmul.
GraphHook = Callable[["Builder", ModelSpec, "Value"], "Value"]

@dataclass(frozen=True)
class LayerState:
    """A tensor a recurrent layer carries between calls instead of KV: its name and shape (batch 1), always f32.
    Prefill returns it after the prompt; prefill-with-history and decode take the previous one and return the
    next."""

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelFamily:
    """What a family plugin registers.

    `layer_weights` maps the block's logical weight keys to tensor names with `{i}` for the layer;
    `global_weights` names the embedding, final norm and lm_head. These are the names the Top IR and the bundle
    use. `map_weights(spec, store)` gives the checkpoint's tensors under those names when the checkpoint stores
    them otherwise (fused, transformed: `topq.models.weightmap.weight_map` builds one from declarative rules);
    None reads every name as is. `quant_groups` lists the linears that share an input (AWQ scales
    them together). `build_block(ctx)` builds one transformer block. `embed_hook` transforms the embedding's
    output (Gemma's √H scale) and `head_hook` the logits (final soft-capping); None leaves them as they are.
    `config_fields` lists the Hugging Face config fields that change the numerics which the family implements
    (`topq.models.fields`: any other such field away from its neutral value is refused).

    `layer_states(spec, layer)` says what a layer carries from one call to the next: () (or no function) is a
    KV cache (the block calls `ctx.attention`); `LayerState`s are a recurrent layer's tensors (a linear-attention
    conv window and state), which the block reads with `ctx.state_in` and returns with `ctx.carry`.

    `formats` holds what a checkpoint format's reader needs from the family, keyed by the format's name; the format
    plugin defines the value (e.g. "gguf": `topq.models.gguf.GGUFArchitecture`, llama.cpp's names for the tensors).
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    normalize: Callable[[Mapping[str, Any]], ModelSpec]
    layer_weights: Mapping[str, str]
    build_block: Callable[[BlockContext], Any]
    global_weights: Mapping[str, str] = field(
        default_factory=lambda: {
            "embed": "model.embed_tokens.weight",
            "final_norm": "model.norm.weight",
            "lm_head": "lm_head.weight",
        }
    )
    quant_groups: tuple[tuple[str, ...], ...] = ()
    description: str = ""
    map_weights: Callable[[ModelSpec, WeightStore], WeightStore] | None = None
    embed_hook: GraphHook | None = None
    head_hook: GraphHook | None = None
    config_fields: frozenset[str] = frozenset()
    layer_states: Callable[[ModelSpec, int], tuple[LayerState, ...]] | None = None
    conversion_note: Callable[[Mapping[str, Any]], str | None] | None = None
    formats: Mapping[str, Any] = field(default_factory=dict)

    def states_of(self, spec: ModelSpec, layer: int) -> tuple[LayerState, ...]:
        """What `layer` carries instead of KV; () for a KV layer."""
        return () if self.layer_states is None else tuple(self.layer_states(spec, layer))

    def weights(self, spec: ModelSpec, store: WeightStore) -> WeightStore:
        """The checkpoint's tensors under the names the Top IR reads (`store` itself when the family maps
        nothing)."""
        return store if self.map_weights is None else self.map_weights(spec, store)

    def accepts(self, config: Mapping[str, Any]) -> bool:
        archs = config.get("architectures") or []
        return any(a in self.architectures for a in archs) or config.get("model_type") in self.model_types


def find_family(families: Any, config: Mapping[str, Any], requested: str = "auto") -> ModelFamily:
    """The family named by the recipe, or the one that accepts the config's architecture."""
    if requested != "auto":
        return families.get(requested)
    for family in families:
        if family.accepts(config):
            return family
    archs = config.get("architectures") or [config.get("model_type")]
    known = sorted(a for f in families for a in f.architectures)
    raise TopqError(f"unknown architecture {', '.join(map(str, archs))}; known: {', '.join(known)}")
