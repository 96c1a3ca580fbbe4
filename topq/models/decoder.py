"""The Llama-style decoder vocabulary that model families share: reading a Hugging Face config into a typed
dataclass (`read_config`, `hf_field`), the common config (`DecoderConfig`, `normalize_llama_like`) and the
Hugging Face names of a decoder layer's weights. Families use it; the core knows only `ModelSpec`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar, get_type_hints

from topq.core.errors import TopqError
from topq.core.spec import ModelSpec
from topq.io.schema import show
from topq.models.blocks import mlp, rms_norm, self_attention
from topq.models.fields import refuse_unimplemented

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from topq.core.stages import BlockContext
    from topq.ir.graph import Value

C = TypeVar("C", bound="DataclassInstance")


def normalize_rope(config: dict[str, Any]) -> dict[str, Any]:
    """Give a config both rope spellings: flat `rope_theta`/`rope_scaling` and transformers 5's
    `rope_parameters`, so model families can read either whatever wrote the config."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        params = dict(params)
        config.setdefault("rope_theta", params.get("rope_theta"))
        if config.get("rope_scaling") is None:
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
            # "default" rope carries no scaling: keep the old spelling (None) for it.
            config["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    else:
        params = {"rope_theta": config.get("rope_theta"), "rope_type": "default"}
        if config.get("rope_scaling"):
            params.update(config["rope_scaling"])
        config["rope_parameters"] = params
    config.setdefault("rope_theta", None)
    config.setdefault("rope_scaling", None)
    return config


def config_get(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """The first present, non-None config value among `keys` (configs spell things differently)."""
    for key in keys:
        value = config.get(key)
        if value is not None:
            return value
    return default


def hf_field(*keys: str, default: Any = MISSING) -> Any:
    """A field of a family's config dataclass read from the first present Hugging Face config key among `keys`
    (dotted for nested dicts: "rope_parameters.rope_type"); the field's own name when no key is given."""
    return field(default=default, metadata={"hf_keys": keys})


def _lookup(config: Mapping[str, Any], key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def read_config(cls: type[C], config: Mapping[str, Any], family: str) -> C:
    """A family's config dataclass filled from a Hugging Face config: each field from its key(s) (`hf_field`),
    converted to the field's type; an absent (or null) key takes the default, and a field without one is
    required. The dataclass is the list of what the family reads."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):
        keys = f.metadata.get("hf_keys") or (f.name,)
        value = next((v for v in (_lookup(config, k) for k in keys) if v is not None), None)
        if value is None:
            if f.default is MISSING and f.default_factory is MISSING:
                raise TopqError(f"config is missing {keys[0]!r} (needed by the {family} family)")
            continue
        values[f.name] = _convert(value, hints[f.name], keys[0], family)
    return cls(**values)


def _convert(value: Any, kind: Any, key: str, family: str) -> Any:
    """`value` as the scalar type `kind` (or `kind | None`) names; other annotations keep the value as is."""
    for scalar in (bool, int, float, str):
        if kind is scalar or kind == scalar | None:
            try:
                converted = scalar(value)
            except (TypeError, ValueError, OverflowError):
                converted = None
            # int(1.5) and int(true) would silently give 1: a count is an integer (or its exact spelling)
            lossy = scalar is int and (isinstance(value, bool) or (isinstance(value, float) and value != converted))
            if converted is None or lossy or (scalar is float and isinstance(value, bool)):
                raise TopqError(f"config field {key}={show(value)} is not a {scalar.__name__} "
                                f"(read by the {family} family)")
            return converted
    return value


@dataclass(frozen=True)
class DecoderConfig:
    """What a Llama-style decoder family reads from a Hugging Face config (the role optimum's NormalizedConfig
    plays); `normalize_llama_like` turns it into a `ModelSpec`."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None  # None: one per attention head
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = hf_field("hidden_act", "hidden_activation", default="silu")
    attention_bias: bool = False
    mlp_bias: bool = False
    partial_rotary_factor: float | None = hf_field("partial_rotary_factor", "rope_parameters.partial_rotary_factor",
                                                   default=None)
    bos_token_id: Any = None  # kept as the config spells it
    eos_token_id: Any = None  # an id or a list of ids

    def spec(self, config: Mapping[str, Any], family: str, **overrides: Any) -> ModelSpec:
        heads = self.num_attention_heads
        if heads < 1:
            raise TopqError(f"{family}: num_attention_heads = {heads} in the config; it must be a positive integer")
        head_dim = self.head_dim if self.head_dim is not None else self.hidden_size // heads
        spec: dict[str, Any] = {
            "family": family,
            "architecture": (config.get("architectures") or [config.get("model_type", family)])[0],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_hidden_layers,
            "num_heads": heads,
            "num_kv_heads": self.num_key_value_heads if self.num_key_value_heads is not None else heads,
            "head_dim": head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling_of(config),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "o_proj_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": _eos_ids(self.eos_token_id),
        }
        if self.partial_rotary_factor:
            spec["rotary_dim"] = int(head_dim * self.partial_rotary_factor)
        spec.update(overrides)
        return ModelSpec(**spec)


#: The numerics fields `DecoderConfig` implements (topq.models.fields); families add their own.
DECODER_FIELDS = frozenset({"attention_bias", "mlp_bias", "partial_rotary_factor"})


def normalize_llama_like(config: Mapping[str, Any], family: str, honored: Iterable[str] = DECODER_FIELDS,
                         **overrides: Any) -> ModelSpec:
    """The `ModelSpec` of a Llama-style decoder config (`DecoderConfig`), after refusing numerics fields outside
    `honored`; `overrides` set spec fields the config does not say (Qwen2's q/k/v biases)."""
    refuse_unimplemented(config, architecture_of(config, family), honored)
    return read_config(DecoderConfig, config, family).spec(config, family, **overrides)


def architecture_of(config: Mapping[str, Any], family: str) -> str:
    return str((config.get("architectures") or [config.get("model_type", family)])[0])


def layer_windows(config: Mapping[str, Any], sliding: Callable[[int], bool]) -> tuple[int, ...]:
    """Per-layer sliding windows (0 = full) from `sliding_window` and `layer_types` or, in configs written
    without `layer_types`, the architecture's own pattern `sliding(layer)`; () when no layer slides."""
    window = config.get("sliding_window")
    layers = int(config.get("num_hidden_layers") or 0)
    types = config.get("layer_types") or ["sliding_attention" if sliding(i) else "full_attention"
                                          for i in range(layers)]
    unknown = sorted({str(t) for t in types} - {"sliding_attention", "full_attention"})
    if unknown:
        raise TopqError(f"{architecture_of(config, '?')}: config field layer_types has {', '.join(unknown)}; "
                        "only sliding_attention and full_attention are supported")
    if not window or "sliding_attention" not in types:
        return ()
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def rope_scaling_of(config: Mapping[str, Any]) -> dict[str, Any] | None:
    # transformers 5 folds rope_theta into rope_parameters; older configs use rope_scaling.
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    if not scaling:
        return None
    scaling = {k: v for k, v in dict(scaling).items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    scaling["rope_type"] = kind
    scaling.pop("type", None)
    return scaling


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


#: Hugging Face names of a Llama-style decoder layer's weights, by the logical keys block builders use.
DECODER_LAYER_WEIGHTS: dict[str, str] = {
    "input_layernorm": "model.layers.{i}.input_layernorm.weight",
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
    "post_attention_layernorm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate_proj": "model.layers.{i}.mlp.gate_proj.weight",
    "up_proj": "model.layers.{i}.mlp.up_proj.weight",
    "down_proj": "model.layers.{i}.mlp.down_proj.weight",
}
#: Linears that share an input in such a layer (AWQ scales each group together).
DECODER_QUANT_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def pre_norm_block(ctx: BlockContext) -> Value:
    """The Llama block: x + attn(norm(x)), then x + mlp(norm(x))."""
    b, x = ctx.b, ctx.hidden
    x = b.top.Add(x, self_attention(ctx, rms_norm(ctx, x, "input_layernorm")))
    return b.top.Add(x, mlp(ctx, rms_norm(ctx, x, "post_attention_layernorm")))
