"""Model families: the contract between a family plugin and the core's stage template.

A family is data plus one function (the MLC-LLM shape): which architectures it accepts, how it turns a
Hugging Face config into a `ModelSpec`, its weight names, and `build_block`, the transformer block
written once. The stage template (`stages.py`) wraps that block into prefill, prefill-with-history and
decode functions through a `BlockContext`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar, get_type_hints

from topq.core.errors import TopqError
from topq.core.weightmap import MappedWeights, WeightRule

if TYPE_CHECKING:
    # Type-only: stages imports this module at run time (family → stages would be a cycle).
    from topq.core.checkpoint import WeightStore
    from topq.core.stages import BlockContext

C = TypeVar("C")


@dataclass(frozen=True)
class ModelSpec:
    """A normalised model configuration: what the graph needs, in one vocabulary for every family."""

    family: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_mode: str = "contiguous_halves"
    rotary_dim: int = 0  # 0 = head_dim
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelSpec:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise TopqError(f"model spec has unknown fields: {', '.join(sorted(unknown))}")
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


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
    for f in fields(cls):  # type: ignore[arg-type]
        keys = f.metadata.get("hf_keys") or (f.name,)
        value = next((v for v in (_lookup(config, k) for k in keys) if v is not None), None)
        if value is None:
            if f.default is MISSING and f.default_factory is MISSING:
                raise TopqError(f"config is missing {keys[0]!r} (needed by the {family} family)")
            continue
        kind = hints[f.name]
        scalar = next((t for t in (bool, int, float, str) if kind is t or kind == t | None), None)
        try:
            values[f.name] = scalar(value) if scalar is not None else value
        except (TypeError, ValueError):
            raise TopqError(f"config field {keys[0]}={value!r} is not a {scalar.__name__} "
                            f"(read by the {family} family)") from None
    return cls(**values)


def normalize_llama_like(config: Mapping[str, Any], family: str, **overrides: Any) -> ModelSpec:
    """The config table shared by Llama-style decoders (the role optimum's NormalizedConfig plays)."""
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        spec = dict(
            family=family,
            architecture=(config.get("architectures") or [config.get("model_type", family)])[0],
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config_get(config, "num_key_value_heads", default=heads)),
            head_dim=int(config_get(config, "head_dim", default=hidden // heads)),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config_get(config, "rms_norm_eps", default=1e-6)),
            rope_theta=float(config_get(config, "rope_theta", default=10000.0)),
            rope_scaling=_rope_scaling(config),
            max_position_embeddings=int(config_get(config, "max_position_embeddings", default=4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            hidden_act=str(config_get(config, "hidden_act", "hidden_activation", default="silu")),
            attention_bias=bool(config.get("attention_bias", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_eos_ids(config.get("eos_token_id")),
        )
    except KeyError as exc:
        raise TopqError(f"config is missing {exc.args[0]!r} (needed by the {family} family)") from None
    partial = config.get("partial_rotary_factor")
    if partial:
        spec["rotary_dim"] = int(spec["head_dim"] * float(partial))
    spec.update(overrides)
    return ModelSpec(**spec)


def _rope_scaling(config: Mapping[str, Any]) -> dict[str, Any] | None:
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


@dataclass(frozen=True)
class ModelFamily:
    """What a family plugin registers.

    `layer_weights` maps the block's logical weight keys to tensor names with `{i}` for the layer;
    `global_weights` names the embedding, final norm and lm_head. These are the names the Top IR and the bundle
    use. `weight_map` says how a name is made from checkpoint tensors when the checkpoint does not store it as
    such (IR name template → `Rows` / `AddScalar` / `Stack`, see `topq.core.weightmap`); a name it does not
    list is read from the checkpoint as is. `quant_groups` lists the linears that share an input (AWQ scales
    them together). `build_block(ctx)` builds one transformer block.
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
    weight_map: Mapping[str, WeightRule] = field(default_factory=dict)

    def weights(self, spec: ModelSpec, store: WeightStore) -> WeightStore:
        """The checkpoint's tensors under the names the Top IR reads (derived lazily; `store` itself when the
        family maps nothing)."""
        if not self.weight_map:
            return store
        return MappedWeights(store, self.weight_map, spec, self.name)

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
