"""`ModelSpec`: a model's normalised configuration, what the graph needs, in one vocabulary for every family.

It is stored in every bundle (`spec`), so its fields and `to_dict()` are part of the bundle format. Its own
module so that the weight mapping and the family contract can both use it without importing each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from topq.core.errors import TopqError
from topq.io.schema import show

__all__ = ["ModelSpec"]


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

    #: sizes the graph divides by or allocates: a config giving 0, a negative or a non-integer is refused here
    POSITIVE = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "vocab_size", "max_position_embeddings")

    def __post_init__(self) -> None:
        for name in self.POSITIVE:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopqError(f"{self.architecture}: {name} = {value!r} in the config; it must be a positive "
                                "integer")
        if self.num_heads % self.num_kv_heads:
            raise TopqError(f"{self.architecture}: {self.num_heads} attention heads are not a multiple of "
                            f"{self.num_kv_heads} key/value heads")

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
        missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING]
        if missing:
            raise TopqError(f"model spec lacks {', '.join(missing)}")
        for f in fields(cls):
            check = _FIELD_CHECKS.get(str(f.type))
            if f.name in d and check is not None and not check(d[f.name]):
                raise TopqError(f"model spec field {f.name} = {show(d[f.name])} does not fit its type {f.type}")
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_float(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: a stored spec comes from a file: each field's value is checked against its annotation before use
_FIELD_CHECKS: dict[str, Callable[[Any], bool]] = {
    "int": _is_int,
    "float": _is_float,
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "int | None": lambda v: v is None or _is_int(v),
    "dict[str, Any] | None": lambda v: v is None or (isinstance(v, dict) and all(isinstance(k, str) for k in v)),
    "tuple[int, ...]": lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) for x in v),
}
