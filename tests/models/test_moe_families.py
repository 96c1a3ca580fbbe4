"""The mixture-of-experts families' configs: what they read into the spec, and the fields they refuse.

Their numerics against transformers are tests/models/test_host_models.py (kinds qwen3_moe, qwen2_moe, mixtral)."""

from __future__ import annotations

from typing import Any

import pytest
import transformers
from tiny_models import COMMON, HYBRID_KINDS, KINDS

from topq.core.errors import TopqError
from topq.core.family import find_family
from topq.core.plugins import get_plugins


def hf_config(kind: str, **overrides: Any) -> dict[str, Any]:
    """The config.json transformers writes for the tiny model of `kind` (with overrides)."""
    config_cls, model_cls, kind_overrides = {**KINDS, **HYBRID_KINDS}[kind]
    config = getattr(transformers, config_cls)(**{**COMMON, **kind_overrides, **overrides})
    return {**config.to_dict(), "architectures": [model_cls]}


def normalize(config: dict[str, Any]) -> Any:
    return find_family(get_plugins().families, config).normalize(config)


def test_specs_read_the_moe_fields() -> None:
    qwen3 = normalize(hf_config("qwen3_moe"))
    assert qwen3.family == "qwen3_moe" and qwen3.qk_norm
    assert (qwen3.moe.num_experts, qwen3.moe.top_k, qwen3.moe.intermediate_size, qwen3.moe.norm_topk_prob,
            qwen3.moe.shared_intermediate_size, qwen3.moe.dense_layers) == (4, 2, 32, True, 0, ())
    qwen2 = normalize(hf_config("qwen2_moe"))
    assert qwen2.attention_bias and qwen2.moe.shared_intermediate_size == 64 and qwen2.moe.dense_layers == (1,)
    assert not qwen2.moe.norm_topk_prob
    assert not normalize(hf_config("qwen2_moe", qkv_bias=False)).attention_bias
    mixtral = normalize(hf_config("mixtral"))
    assert mixtral.moe.norm_topk_prob and mixtral.moe.intermediate_size == 32  # Mixtral always renormalises
    # decoder_sparse_step: every second layer is sparse, the others dense
    assert normalize(hf_config("qwen3_moe", decoder_sparse_step=2, num_hidden_layers=4)).moe.dense_layers == (0, 2)


def test_qwen3_next_reads_its_sparse_layers_and_its_own_defaults() -> None:
    spec = normalize(hf_config("qwen3_next_moe"))
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.intermediate_size, spec.moe.norm_topk_prob,
            spec.moe.shared_intermediate_size, spec.moe.dense_layers) == (4, 2, 32, True, 48, (0,))
    assert normalize(hf_config("qwen3_next")).moe.dense_layers == (0, 1)  # mlp_only_layers covers both
    # a config.json without the MoE fields: Qwen3NextConfig's defaults (not the Qwen2-MoE-like ones of MoEConfig)
    moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
    bare = {k: v for k, v in hf_config("qwen3_next_moe").items() if k not in moe_keys}
    built = transformers.Qwen3NextConfig(**{k: v for k, v in bare.items() if k != "architectures"})
    defaults = normalize(bare).moe
    assert (defaults.num_experts, defaults.top_k, defaults.intermediate_size, defaults.norm_topk_prob,
            defaults.shared_intermediate_size, defaults.dense_layers) == (
        built.num_experts, built.num_experts_per_tok, built.moe_intermediate_size, built.norm_topk_prob,
        built.shared_expert_intermediate_size, ())


def test_spec_round_trips_through_the_bundle_form() -> None:
    from topq.core.spec import ModelSpec

    spec = normalize(hf_config("qwen2_moe"))
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    dense = normalize(hf_config("qwen3"))
    assert "moe" not in dense.to_dict()  # dense bundles' specs are unchanged


# Unimplemented config fields (use_sliding_window, sliding_window, …) are refused by the check every family
# shares: tests/models/test_config_fields.py.


@pytest.mark.parametrize("overrides, message", [
    ({"num_experts_per_tok": 5}, "5 experts per token but only 4 experts"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be a positive integer"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers='1' must be a list"),
])
def test_bad_moe_fields_are_clear_errors(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(TopqError, match=message):
        normalize({**hf_config("qwen3_moe"), **overrides})
