"""Every numerics-changing config field is honored or refused (issue 12), and the RoPE registry computes what
transformers computes.

For each built-in family, each field of `topq.models.fields.NUMERIC_FIELDS` that the family does not implement
is set to a non-neutral value in a real transformers config of the family and must be refused naming the field;
each field it does implement must not be. The two cases the issue found silently wrong (a Mistral
sliding window, Llama MLP biases) are checked against transformers past the window in every stage by
tests/models/test_host_models.py (kinds `mistral_window`, `llama_bias`); here, that the window changes the
logits, so those comparisons could fail.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import transformers
from tiny_models import COMMON, HYBRID_KINDS, KINDS, prompt

from topq.core.errors import TopqError
from topq.core.plugins import get_plugins
from topq.core.spec import ModelSpec
from topq.ir.rope import ROPE_TYPES, rope_inv_freq
from topq.models.decoder import normalize_rope
from topq.models.fields import NUMERIC_FIELDS

#: built-in family → the tiny kind whose transformers config it is checked with
FAMILY_KINDS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                "gemma3": "gemma3", "phi3": "phi3", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe",
                "mixtral": "mixtral", "qwen3_5": "qwen3_5", "qwen3_next": "qwen3_next"}


def hf_config(kind: str, **overrides: Any) -> dict[str, Any]:
    """The config.json transformers writes for the tiny model of `kind`, as topq's checkpoint reader sees it."""
    config_cls, model_cls, kind_overrides = {**KINDS, **HYBRID_KINDS}[kind]
    config = getattr(transformers, config_cls)(**{**COMMON, **kind_overrides}).to_dict()
    config["architectures"] = [model_cls]
    return normalize_rope({**config, **overrides})


def test_every_built_in_family_is_checked() -> None:
    import importlib

    from topq.core.plugins import BUILTIN_PLUGINS

    modules = [importlib.import_module(m) for m in BUILTIN_PLUGINS if m.startswith("topq.plugins.models.")]
    assert set(FAMILY_KINDS) == {module.FAMILY.name for module in modules}


@pytest.mark.parametrize("family_name", list(FAMILY_KINDS))
def test_unimplemented_fields_are_refused(family_name: str) -> None:
    family = get_plugins().families.get(family_name)
    arch = family.architectures[0]
    family.normalize(hf_config(FAMILY_KINDS[family_name]))  # the neutral config converts
    refused = [name for name in NUMERIC_FIELDS if name not in family.config_fields]
    assert refused, family_name
    for name in refused:
        example = NUMERIC_FIELDS[name].example
        with pytest.raises(TopqError) as e:
            family.normalize(hf_config(FAMILY_KINDS[family_name], **{name: example}))
        assert str(e.value) == f"{arch}: config field {name}={example!r} is not supported"


@pytest.mark.parametrize("family_name", list(FAMILY_KINDS))
def test_implemented_fields_are_read_not_refused(family_name: str) -> None:
    family = get_plugins().families.get(family_name)
    for name in family.config_fields:
        assert name in NUMERIC_FIELDS, f"{family_name} declares {name}, which NUMERIC_FIELDS does not list"
        value = NUMERIC_FIELDS[name].example
        if name == "layer_types":
            value = ["sliding_attention", "full_attention"]
        try:
            family.normalize(hf_config(FAMILY_KINDS[family_name], **{name: value}))
        except TopqError as e:
            assert "is not supported" not in str(e), e


def test_gemma3_message_names_the_field() -> None:
    gemma3 = get_plugins().families.get("gemma3")
    with pytest.raises(TopqError, match=r"^Gemma3ForCausalLM: config field use_bidirectional_attention=True is "
                                        r"not supported$"):
        gemma3.normalize(hf_config("gemma3", use_bidirectional_attention=True))


def test_windows_and_biases_reach_the_spec() -> None:
    families = get_plugins().families
    mistral = families.get("mistral").normalize(hf_config("mistral", sliding_window=8))
    assert mistral.layer_windows == (8, 8)
    qwen2 = families.get("qwen2").normalize(hf_config("qwen2_window"))
    assert qwen2.layer_windows == (0, 6)  # max_window_layers = 1: only layer 1 slides
    assert families.get("qwen2").normalize(hf_config("qwen2", sliding_window=8)).layer_windows == ()  # off
    gemma2 = families.get("gemma2").normalize(hf_config("gemma2"))
    assert gemma2.layer_windows == (6, 0) and gemma2.attn_softcap == 5.0 and gemma2.final_softcap == 3.0
    assert gemma2.attention_scale == pytest.approx(24 ** -0.5)
    gemma3 = families.get("gemma3").normalize(hf_config("gemma3"))
    assert gemma3.local_rope_theta == 1e4 and gemma3.rope_theta == 1e6 and gemma3.qk_norm
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    phi3 = families.get("phi3").normalize(hf_config("phi3"))
    assert phi3.layer_windows == (10, 10) and phi3.rope_scaling is not None
    assert phi3.rope_scaling["rope_type"] == "longrope" and phi3.rope_scaling["original_max_position_embeddings"] == 64
    llama = families.get("llama").normalize(hf_config("llama_bias"))
    assert llama.attention_bias and llama.o_proj_bias and llama.mlp_bias
    with pytest.raises(TopqError, match="layer_types has chunked_attention"):
        families.get("gemma2").normalize(hf_config("gemma2", layer_types=["chunked_attention", "full_attention"]))


def test_the_window_changes_the_logits(tiny_host: Any) -> None:
    """transformers' Mistral with and without its window differ past it, so matching it is no accident."""
    model = tiny_host("mistral_window").model
    ids = torch.tensor([prompt(20, seed=5)])
    with torch.no_grad():
        windowed = model(ids).logits[0].numpy()
        model.config.sliding_window = None  # the session's model: put back below
        try:
            full = model(ids).logits[0].numpy()
        finally:
            model.config.sliding_window = 6
    assert np.abs(windowed[:6] - full[:6]).max() < 1e-5
    assert np.abs(windowed[6:] - full[6:]).max() > 1e-2


# ------------------------------------------------------------------------------------------------ RoPE


def hf_rope(config: Any, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = config.rope_parameters["rope_type"]
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
    return inv_freq.numpy(), float(scaling)


ROPE_CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("linear", {"rope_type": "linear", "factor": 4.0}, {}),
    ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, {}),
    ("dynamic", {"rope_type": "dynamic", "factor": 2.0}, {}),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, {}),
    ("yarn-mscale", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.7,
                     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}, {}),
    ("longrope", {"rope_type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(16)],
                  "long_factor": [1.0 + 0.9 * i for i in range(16)], "original_max_position_embeddings": 64},
     {"max_position_embeddings": 512}),
]


@pytest.mark.parametrize(("name", "params", "extra"), ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
def test_rope_types_match_transformers(name: str, params: dict[str, Any], extra: dict[str, Any]) -> None:
    max_pos = extra.get("max_position_embeddings", 256)
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=max_pos,
                                      rope_parameters={"rope_theta": 50000.0, **params})
    spec = ModelSpec(family="llama", architecture="LlamaForCausalLM", hidden_size=128, intermediate_size=256,
                     num_layers=1, num_heads=4, num_kv_heads=4, head_dim=32, vocab_size=16, rope_theta=50000.0,
                     rope_scaling=params, max_position_embeddings=max_pos)
    for seq_len in (64, 128) if name == "longrope" else (128,):
        got, got_scale = rope_inv_freq(spec, seq_len)
        want, want_scale = hf_rope(config, seq_len if name == "longrope" else None)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
        assert got_scale == pytest.approx(want_scale, rel=1e-12)


def test_unknown_rope_type_is_refused() -> None:
    spec = ModelSpec(family="llama", architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=64,
                     num_layers=1, num_heads=4, num_kv_heads=4, head_dim=16, vocab_size=16,
                     rope_scaling={"rope_type": "spiral", "factor": 2.0})
    with pytest.raises(TopqError, match=r"rope type 'spiral' is not supported \(default, dynamic, linear"):
        rope_inv_freq(spec, 64)
    assert {"default", "linear", "llama3", "dynamic", "yarn", "longrope", "su"} <= set(ROPE_TYPES)


def test_dynamic_rope_beyond_its_length_is_refused() -> None:
    spec = ModelSpec(family="llama", architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=64,
                     num_layers=1, num_heads=4, num_kv_heads=4, head_dim=16, vocab_size=16,
                     max_position_embeddings=128, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(TopqError, match="seq_length=256 must not exceed it"):
        rope_inv_freq(spec, 256)


def test_models_doc_table_matches_the_families() -> None:
    """docs/models.md lists each built-in family with exactly the fields it honors and the ones it refuses."""
    from data_paths import REPO

    docs = (REPO / "docs" / "models.md").read_text()
    for family_name in FAMILY_KINDS:
        family = get_plugins().families.get(family_name)
        honored = ", ".join(f"`{n}`" for n in sorted(family.config_fields))
        refused = ", ".join(f"`{n}`" for n in NUMERIC_FIELDS if n not in family.config_fields)
        row = f"| `{family_name}` | {', '.join(family.architectures)} | {honored} | {refused} |"
        assert row in docs, f"docs/models.md has no row {row}"


@pytest.mark.parametrize(("family", "config_class"), [("gemma2", "Gemma2Config"), ("gemma3", "Gemma3TextConfig")])
def test_gemma_ties_embeddings_when_the_config_does_not_say(family: str, config_class: str) -> None:
    """A Gemma config.json without `tie_word_embeddings` (published ones omit it) ties, as transformers does."""
    import transformers

    from topq.core.plugins import get_plugins

    config = {"architectures": [f"{family.capitalize()}ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 256, "sliding_window": 8}
    assert getattr(transformers, config_class)(**config).tie_word_embeddings
    normalize = get_plugins().families.get(family).normalize
    assert normalize(normalize_rope(dict(config))).tie_word_embeddings
    assert not normalize(normalize_rope({**config, "tie_word_embeddings": False})).tie_word_embeddings
