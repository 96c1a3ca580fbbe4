"""`ModelSpec`: a model's normalised configuration, what the graph needs, in one vocabulary for every family.

It is stored in every bundle (`spec`), so its fields and `to_dict()` are part of the bundle format. Its own
module so that the weight mapping and the family contract can both use it without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from topq.core.errors import TopqError
from topq.io.documents import checked_document

__all__ = ["MoESpec", "ModelSpec"]


@dataclass(frozen=True)
class MoESpec:
    """The sparse mixture-of-experts feed-forward of a model (the `top.MoE` operands and attributes).

    A layer is sparse unless it is in `dense_layers` (those use the plain MLP of `intermediate_size`).
    `shared_intermediate_size` 0 means no shared expert."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = False
    scoring: str = "softmax"
    shared_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopqError(f"MoE: {name} = {value!r} in the config; it must be a positive integer")
        if self.top_k > self.num_experts:
            raise TopqError(f"MoE: {self.top_k} experts per token but only {self.num_experts} experts")

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


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
    attention_bias: bool = False  # q/k/v biases
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    attention_scale: float = 0.0  # 0: 1/sqrt(head_dim); Gemma: query_pre_attn_scalar ** -0.5
    attn_softcap: float = 0.0  # 0: none; else scores ← c·tanh(scores/c) (Gemma 2)
    final_softcap: float = 0.0  # the same on the logits, applied by the family's head hook
    layer_windows: tuple[int, ...] = ()  # per layer sliding window in tokens, 0 = full attention; () = all full
    local_rope_theta: float = 0.0  # RoPE base (default type) of the sliding-window layers; 0 = the global RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoESpec | None = None  # a mixture-of-experts feed-forward (None: dense)
    #: per layer, its token mixer when a model mixes kinds (hybrid linear attention); () for all attention
    layer_types: tuple[str, ...] = ()
    #: a linear-attention layer's sizes: key_heads, value_heads, key_head_dim, value_head_dim, conv_kernel
    linear_attention: dict[str, int] | None = None

    #: sizes the graph divides by or allocates: a config giving 0, a negative or a non-integer is refused here
    POSITIVE = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "vocab_size", "max_position_embeddings")

    WRITTEN_WHEN_SET = ("o_proj_bias", "mlp_bias", "attention_scale", "attn_softcap", "final_softcap", "layer_windows",
                        "local_rope_theta", "moe", "layer_types", "linear_attention")

    def __post_init__(self) -> None:
        for name in self.POSITIVE:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopqError(f"{self.architecture}: {name} = {value!r} in the config; it must be a positive "
                                "integer")
        if self.num_heads % self.num_kv_heads:
            raise TopqError(f"{self.architecture}: {self.num_heads} attention heads are not a multiple of "
                            f"{self.num_kv_heads} key/value heads")

        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise TopqError(f"{self.architecture}: {len(self.layer_windows)} layer windows for {self.num_layers} "
                            "layers")

    def window(self, layer: int) -> int:
        """The sliding window of `layer` in tokens (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_windows"] = list(self.layer_windows)
        d["layer_types"] = list(self.layer_types)
        if self.moe is not None:
            d["moe"]["dense_layers"] = list(self.moe.dense_layers)
        # Fields added after the bundle format settled are written only when used, so the bundles of models
        # that do not use them stay byte-identical to earlier ones.
        for f in fields(self):
            if f.name in self.WRITTEN_WHEN_SET and getattr(self, f.name) == f.default:
                del d[f.name]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelSpec:
        d = checked_document(cls, d, "model spec", {"MoESpec | None": lambda v: v is None or isinstance(v, dict)})
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["layer_windows"] = tuple(d.get("layer_windows", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        if d.get("moe") is not None:
            moe = checked_document(MoESpec, d["moe"], "model spec moe")
            moe["dense_layers"] = tuple(moe.get("dense_layers", ()))
            d["moe"] = MoESpec(**moe)
        return cls(**d)
