"""Config fields that change a decoder's numerics: each is honored by a family or refused.

`NUMERIC_FIELDS` lists the Hugging Face config fields of the decoder architectures transformers implements
that change what the model computes, each with its neutral value (the value at which ignoring the field is
exact) and a value that is not neutral (tests use it). A family declares the fields it implements
(`ModelFamily.config_fields`); `refuse_unimplemented` rejects a config that sets any other of them away from
neutral, naming the field, instead of silently computing a different model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from topq.core.errors import TopqError

__all__ = ["NUMERIC_FIELDS", "NumericField", "refuse_unimplemented"]


@dataclass(frozen=True)
class NumericField:
    neutral: Callable[[Any], bool]  # True when the value changes nothing
    example: Any  # a value that is not neutral
    doc: str


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


def _all_full(types: Any) -> bool:
    return all(t == "full_attention" for t in types)


NUMERIC_FIELDS: dict[str, NumericField] = {
    "attention_bias": NumericField(_is(False), True, "biases on the attention projections"),
    "mlp_bias": NumericField(_is(False), True, "biases on the MLP projections"),
    "sliding_window": NumericField(_is(None), 8, "sliding-window attention of this many tokens"),
    "use_sliding_window": NumericField(_is(False), True, "turns the sliding window on (Qwen2, Qwen3)"),
    "layer_types": NumericField(_all_full, ["sliding_attention", "full_attention"],
                                "per-layer attention kind (sliding or full)"),
    "attn_logit_softcapping": NumericField(_is(None, 0, 0.0), 50.0, "tanh soft-capping of attention scores"),
    "final_logit_softcapping": NumericField(_is(None, 0, 0.0), 30.0, "tanh soft-capping of the logits"),
    "query_pre_attn_scalar": NumericField(_is(None), 64, "attention scale = query_pre_attn_scalar ** -0.5"),
    "partial_rotary_factor": NumericField(_is(None, 1, 1.0), 0.5, "RoPE on a fraction of each head"),
    "rope_local_base_freq": NumericField(_is(None), 10000.0, "RoPE base of the sliding-window layers"),
    "use_bidirectional_attention": NumericField(_is(None, False), True, "attention without the causal mask"),
    "logit_scale": NumericField(_is(None, 1, 1.0), 0.5, "logits multiplied by a constant (Cohere)"),
    "logits_scaling": NumericField(_is(None, 1, 1.0), 4.0, "logits divided by a constant (Granite)"),
    "embedding_multiplier": NumericField(_is(None, 1, 1.0), 12.0, "embedding multiplied by a constant"),
    "residual_multiplier": NumericField(_is(None, 1, 1.0), 0.2, "residual branches multiplied by a constant"),
    "attention_multiplier": NumericField(_is(None), 0.1, "attention scale given directly"),
}


def refuse_unimplemented(config: Mapping[str, Any], architecture: str, honored: Iterable[str]) -> None:
    """Raise on the first numerics-changing field that `honored` does not list and the config sets away from
    neutral."""
    honored = set(honored)
    for name, spec in NUMERIC_FIELDS.items():
        value = config.get(name)
        if name in honored or value is None or spec.neutral(value):
            continue
        raise TopqError(f"{architecture}: config field {name}={value!r} is not supported")
