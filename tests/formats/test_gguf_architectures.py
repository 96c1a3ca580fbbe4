"""GGUF import of every architecture transformers' GGUF loader reads, through the families' GGUF declarations.

Each tiny random transformers model is written as GGUF the way llama.cpp's converter writes it
(tests/helpers/gguf_writer.py); transformers' own reading of that file is the reference. Its config comes from the
file alone, so the tiny models keep the transformers defaults for what transformers' loader does not read (Qwen3's
head_dim 128, Qwen MoE expert sizes, Gemma's head_dim and query_pre_attn_scalar 256, Gemma 2's soft-caps 50 / 30).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from gguf_writer import load_reference, write_gguf
from host_bundles import TINY_STAGES, convert_host
from tiny_models import build_tiny, hf_logits, max_diff, prompt

import topq
from topq.core import plugins as plugins_module
from topq.core.errors import TopqError
from topq.core.family import ModelFamily
from topq.core.plugins import build_plugins
from topq.core.runtime import Session
from topq.models import decoder
from topq.models.gguf import LLAMA_TENSORS, GGUFArchitecture, GGUFTensor, gguf_architecture_names
from topq.plugins.formats import gguf_file

ATOL = 1e-4
#: name → (tiny_models kind, overrides, GGUF type of the 2-D weights)
GGUF_KINDS: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", {}, "F32"),
    "mistral": ("mistral", {}, "F32"),  # llama.cpp converts Mistral as arch llama
    "qwen2": ("qwen2", {}, "F32"),
    "qwen3": ("qwen3", {"head_dim": 128}, "F32"),
    "qwen2_moe": ("qwen2_moe", {"moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                                "mlp_only_layers": []}, "F32"),
    "qwen3_moe": ("qwen3_moe", {"head_dim": 128, "moe_intermediate_size": 768}, "Q8_0"),
    "phi3": ("phi3", {"sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "F16"),
    "gemma2": ("gemma2", {"head_dim": 256, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0}, "F32"),
    # six layers: five sliding (window 6) and one global, llama.cpp's fixed Gemma 3 pattern
    "gemma3": ("gemma3", {"head_dim": 256, "query_pre_attn_scalar": 256, "num_hidden_layers": 6,
                          "layer_types": None, "rope_parameters": None}, "F16"),
}


class GGUFCase(NamedTuple):
    model: Any  # the original transformers model
    path: Path  # its GGUF file
    reference: Any  # transformers' reading of the file
    bundle: Any  # topq's host bundle converted from the file


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cases: dict[str, GGUFCase] = {}

    def get(name: str) -> GGUFCase:
        if name not in cases:
            kind, overrides, qtype = GGUF_KINDS[name]
            directory = tmp_path_factory.mktemp(f"gguf_{name}")
            model = build_tiny(kind, directory / "hf", overrides=overrides)
            path = write_gguf(model, directory / f"{name}.gguf", qtype)
            cases[name] = GGUFCase(model, path, load_reference(path),
                                   convert_host(path, directory / "host.topq", **TINY_STAGES))
        return cases[name]

    return get


def prefill_and_decode(bundle: Any, ids: list[int], steps: int = 4) -> tuple[np.ndarray, list[int]]:
    """Logits of a prefill over ids and `steps` greedy decode steps on the KV cache, and all the tokens."""
    session = Session(bundle)
    rows = [session.feed(ids, all_logits=True)]
    for _ in range(steps):
        rows.append(session.decode(int(np.argmax(rows[-1][-1])))[None])
    return np.concatenate(rows), session.tokens


@pytest.mark.parametrize("name", list(GGUF_KINDS))
def test_prefill_and_decode_match_transformers_gguf_reading(gguf_case: Any, name: str) -> None:
    case = gguf_case(name)
    # the writer is right: transformers reads back the original model (exactly for F32 files)
    ids = prompt(13, seed=1)
    exact = GGUF_KINDS[name][2] == "F32"
    drift = max_diff(hf_logits(case.reference, ids), hf_logits(case.model, ids))
    assert drift <= (1e-5 if exact else 0.5), drift
    got, tokens = prefill_and_decode(case.bundle, ids)
    assert got.shape == (17, case.model.config.vocab_size)
    assert max_diff(got, hf_logits(case.reference, tokens)) <= ATOL


def test_phi3_longrope_and_window_match_the_original(tmp_path: Path) -> None:
    """Phi-3's LongRoPE factor tensors and window (10 tokens, passed by the 17 positions) are read from the GGUF
    file. transformers' GGUF loader drops both, so the original model is the reference here."""
    model = build_tiny("phi3", tmp_path / "hf")  # longrope, original_max_position_embeddings 64, window 10
    path = write_gguf(model, tmp_path / "phi3.gguf")
    ids = prompt(13, seed=1)
    assert max_diff(hf_logits(load_reference(path), ids), hf_logits(model, ids)) > 1e-3  # what transformers reads
    scaling = gguf_file.open_checkpoint(path).config["rope_scaling"]
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 64
    got, tokens = prefill_and_decode(convert_host(path, tmp_path / "host.topq", **TINY_STAGES), ids)
    assert max_diff(got, hf_logits(model, tokens)) <= ATOL


def test_q8_0_experts_keep_their_integer_blocks(gguf_case: Any) -> None:
    """Each expert of a stacked Q8_0 tensor is its own lossless Q8_0 weight, equal to its dequantized values."""
    store = gguf_file.open_checkpoint(gguf_case("qwen3_moe").path).weights
    for e in range(4):
        name = f"model.layers.1.mlp.experts.{e}.down_proj.weight"
        q = store.quantized(name)
        assert q is not None and q.bits == 8 and q.codes.shape == store.shape(name) == (64, 768)
        np.testing.assert_array_equal(q.dequantize(), store.get(name))
    assert store.quantized("model.layers.1.mlp.gate.weight") is None  # routers stay F32, as llama.cpp keeps them


def test_every_declared_architecture_is_one_transformers_reads() -> None:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    declared = gguf_architecture_names(plugins_module.get_plugins().families)
    assert declared == ["gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen2moe", "qwen3", "qwen3moe"]
    renamed = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # transformers' spelling of llama.cpp's names
    assert all(renamed.get(n, n) in GGUF_SUPPORTED_ARCHITECTURES for n in declared)


def _write(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_feed_forward_length(128)
    writer.add_vocab_size(256)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("arch", "tensor", "message"), [
    ("llama", "blk.0.ffn_gate_exps.weight", r"experts in a GGUF file of architecture llama \(Mixtral\)"),
    ("llama", "rope_freqs.weight", r"Llama 3 RoPE frequency factors \(rope_freqs\) are not supported"),
    ("phi3", "rope_factors_long.weight", "rope_factors_long without rope_factors_short"),
    ("qwen2", "blk.0.attn_rot_embd.weight", "not part of GGUF architecture 'qwen2'"),
    ("qwen3next", "blk.0.attn_norm.weight", "unsupported GGUF architecture 'qwen3next'; supported: gemma2, "),
])
def test_what_cannot_be_read_is_refused(tmp_path: Path, arch: str, tensor: str, message: str) -> None:
    path = _write(tmp_path / "x.gguf", arch, {tensor: np.ones((2, 64, 32), np.float32)})
    with pytest.raises(TopqError, match=message):
        gguf_file.open_checkpoint(path)


@pytest.mark.parametrize("shape", [(64,), (1, 64)])
def test_shared_expert_gate_squeezed_or_not(tmp_path: Path, shape: tuple[int, ...]) -> None:
    """Converters that squeeze every tensor store Qwen2-MoE's shared-expert gate as [H], newer ones as [1, H]."""
    gate = np.arange(64, dtype=np.float32).reshape(shape)
    store = gguf_file.open_checkpoint(_write(tmp_path / "x.gguf", "qwen2moe",
                                             {"blk.0.ffn_gate_inp_shexp.weight": gate})).weights
    name = "model.layers.0.mlp.shared_expert_gate.weight"
    assert store.shape(name) == (1, 64)
    np.testing.assert_array_equal(store.get(name), gate.reshape(1, 64))
    np.testing.assert_array_equal(store.get_raw(name), gate.reshape(1, 64))


# ------------------------------------------------------------------ a third-party family's own GGUF architecture
EXT_GGUF = GGUFArchitecture(
    name="extllama", architecture="ExtLlamaForCausalLM", model_type="ext_llama",
    tensors={**LLAMA_TENSORS, "blk.{i}.attn_q": GGUFTensor("model.layers.{i}.self_attn.q_proj", permute="heads"),
             "blk.{i}.attn_k": GGUFTensor("model.layers.{i}.self_attn.k_proj", permute="kv_heads")})
EXT_FAMILY = ModelFamily(name="ext_llama", architectures=("ExtLlamaForCausalLM",), model_types=("ext_llama",),
                         normalize=lambda config: decoder.normalize_llama_like(config, "ext_llama"),
                         layer_weights=decoder.DECODER_LAYER_WEIGHTS, build_block=decoder.pre_norm_block,
                         formats={"gguf": EXT_GGUF})


class ExtPlugin:
    @topq.hookimpl
    def register_model_families(self, register: Any) -> None:
        register(EXT_FAMILY)


def test_a_plugin_family_adds_its_gguf_architecture(gguf_case: Any, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A family outside topq declares GGUF architecture `extllama`; its files convert with no core or format edit."""
    monkeypatch.setenv("TOPQ_LOAD_PLUGINS", "")  # only the built-ins and this one
    monkeypatch.setattr(plugins_module, "_PLUGINS", build_plugins(extra=(ExtPlugin(),)))
    case = gguf_case("llama")
    path = write_gguf(case.model, tmp_path / "ext.gguf", arch_name="extllama")
    checkpoint = gguf_file.open_checkpoint(path)
    assert checkpoint.config["architectures"] == ["ExtLlamaForCausalLM"]
    bundle = convert_host(path, tmp_path / "host.topq", **TINY_STAGES)
    assert bundle.spec.family == "ext_llama"
    ids = prompt(13, seed=1)
    assert max_diff(Session(bundle).feed(ids, all_logits=True), hf_logits(case.reference, ids)) <= ATOL
