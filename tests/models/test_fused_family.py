"""A third-party family whose checkpoint fuses projections, built with no core edit (issue 11 acceptance).

The family below is what a plugin author writes for Phi-3: the block reads q/k/v and gate/up as usual and the
family's `map_weights` (`weight_map` rules, `topq.models.weightmap`) says how they are cut out of the
checkpoint's fused `qkv_proj` and `gate_up_proj`. A tiny random transformers `Phi3ForCausalLM` is converted to
host bundles and checked against transformers' logits. The rest checks the weight-mapping view on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from tiny_models import hf_logits, prompt

import topq
import topq.core.plugins as plugins_module
from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.family import ModelFamily, ModelSpec
from topq.core.pipeline import convert, load_model
from topq.core.plugins import build_plugins
from topq.core.quant import QuantizedWeight
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session
from topq.core.stages import BlockContext
from topq.io.safetensors import SafetensorsFile
from topq.ir.graph import Value
from topq.ir.types import round_to_dtype
from topq.models.blocks import mlp, rms_norm, self_attention
from topq.models.decoder import DECODER_LAYER_WEIGHTS, DECODER_QUANT_GROUPS, hf_field, read_config
from topq.models.weightmap import (
    AddScalar,
    MappedWeights,
    Rows,
    Stack,
    gate_up_sections,
    qkv_sections,
    split_rows,
    weight_map,
)

ATOL = 1e-4
VOCAB = 256
STAGES: dict[str, Any] = {"seq_length": 64, "max_input_length": 16, "decode_chunks": [32]}
L = DECODER_LAYER_WEIGHTS


# ------------------------------------------------------------------------------- the third-party family


@dataclass(frozen=True)
class FusedConfig:
    """What this family reads from a Phi-3 config (field name = config key unless `hf_field` says otherwise)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_type: str = hf_field("rope_scaling.rope_type", "rope_parameters.rope_type", default="default")
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    c = read_config(FusedConfig, config, "fused-phi3")
    if c.rope_type != "default":  # LongRoPE is issue 12's; a family refuses what it does not compute
        raise TopqError(f"fused-phi3: rope type {c.rope_type!r} is not supported")
    heads = c.num_attention_heads
    return ModelSpec(family="fused-phi3", architecture="Phi3ForCausalLM", hidden_size=c.hidden_size,
                     intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers, num_heads=heads,
                     num_kv_heads=c.num_key_value_heads or heads, head_dim=c.hidden_size // heads,
                     vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                     max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
                     hidden_act=c.hidden_act)


def build_block(ctx: BlockContext) -> Value:
    b, x = ctx.b, ctx.hidden
    x = b.top.Add(x, self_attention(ctx, rms_norm(ctx, x, "input_layernorm")))
    return b.top.Add(x, mlp(ctx, rms_norm(ctx, x, "post_attention_layernorm")))


FAMILY = ModelFamily(
    name="fused-phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    normalize=normalize,
    layer_weights=DECODER_LAYER_WEIGHTS,
    build_block=build_block,
    quant_groups=DECODER_QUANT_GROUPS,
    map_weights=weight_map({
        **split_rows("model.layers.{i}.self_attn.qkv_proj.weight", qkv_sections,
                     L["q_proj"], L["k_proj"], L["v_proj"]),
        **split_rows("model.layers.{i}.mlp.gate_up_proj.weight", 2, L["gate_proj"], L["up_proj"]),
    }),
    description="test: Phi-3 with fused qkv_proj and gate_up_proj",
)


class FusedPlugin:
    @topq.hookimpl
    def register_model_families(self, register: Callable[[ModelFamily], None]) -> None:
        register(FAMILY)


# ------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A tiny random Phi3ForCausalLM (float32), saved as safetensors, and its directory."""
    directory = tmp_path_factory.mktemp("tiny_phi3")
    config = transformers.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.15,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1; perturb them so a wrong norm weight shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return model, directory


@pytest.fixture(scope="module", autouse=True)
def fused_plugin() -> Any:
    """The family registered as a third-party plugin for every conversion and session of this module."""
    saved = plugins_module._PLUGINS
    plugins_module._PLUGINS = build_plugins(extra=(FusedPlugin(),))
    yield plugins_module._PLUGINS
    plugins_module._PLUGINS = saved


def recipe(checkpoint: Path, output: Path, scheme: str) -> Any:
    return recipe_from_defaults(model={"path": str(checkpoint)}, quant={"scheme": scheme},
                                target={"chip": "host"}, stages=STAGES, output={"path": str(output)})


@pytest.fixture(scope="module")
def f32_bundle(phi3: tuple[Any, Path]) -> Bundle:
    _, directory = phi3
    convert(recipe(directory, directory / "f32.topq", "f32"), progress=False)
    return Bundle(directory / "f32.topq")


# ------------------------------------------------------------------------------- end to end


def test_checkpoint_really_is_fused(phi3: tuple[Any, Path]) -> None:
    names = SafetensorsFile(phi3[1] / "model.safetensors").names()
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.1.mlp.gate_up_proj.weight" in names
    assert not any(n.endswith((".q_proj.weight", ".k_proj.weight", ".gate_proj.weight", ".up_proj.weight"))
                   for n in names)


def test_program_reads_the_split_tensors(phi3: tuple[Any, Path], tmp_path: Path) -> None:
    model, directory = phi3
    loaded = load_model(recipe(directory, tmp_path / "unused.topq", "f32"))  # verifies the program
    assert loaded.family is FAMILY
    store = loaded.checkpoint.weights
    assert isinstance(store, MappedWeights)
    qkv = model.model.layers[1].self_attn.qkv_proj.weight.detach().numpy()
    gate_up = model.model.layers[1].mlp.gate_up_proj.weight.detach().numpy()
    np.testing.assert_array_equal(loaded.weight("model.layers.1.self_attn.q_proj.weight"), qkv[:64])
    np.testing.assert_array_equal(loaded.weight("model.layers.1.self_attn.k_proj.weight"), qkv[64:96])
    np.testing.assert_array_equal(loaded.weight("model.layers.1.self_attn.v_proj.weight"), qkv[96:])
    np.testing.assert_array_equal(loaded.weight("model.layers.1.mlp.gate_proj.weight"), gate_up[:128])
    np.testing.assert_array_equal(loaded.weight("model.layers.1.mlp.up_proj.weight"), gate_up[128:])
    assert store.shape("model.layers.0.self_attn.k_proj.weight") == (32, 64)
    assert "model.layers.0.self_attn.qkv_proj.weight" not in store.names()
    # file order: the parts take the fused tensor's place
    names = store.names()
    i = names.index("model.layers.0.self_attn.q_proj.weight")
    assert names[i:i + 3] == [L[k].format(i=0) for k in ("q_proj", "k_proj", "v_proj")]


def test_f32_host_bundle_matches_transformers(phi3: tuple[Any, Path], f32_bundle: Bundle) -> None:
    model, _ = phi3
    names = set(f32_bundle.file.names())
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    ids = prompt(13, seed=1)
    got = Session(f32_bundle).feed(ids, all_logits=True)
    assert float(np.abs(got - hf_logits(model, ids)).max()) <= ATOL
    # prefill + decode steps, against a fresh transformers forward over the growing sequence
    session = Session(f32_bundle)
    ids = prompt(9, seed=2)
    rows = [session.feed(ids)]
    for _ in range(4):
        rows.append(session.decode(int(np.argmax(rows[-1]))))
    ref = hf_logits(model, session.tokens)[len(ids) - 1:]
    got = np.stack([np.asarray(r).reshape(-1) for r in rows])
    assert got.shape == ref.shape == (5, VOCAB)
    assert float(np.abs(got - ref).max()) <= ATOL
    assert any(c.startswith("block_cache_") for c in session.calls)


def test_w4_rtn_conversion_quantizes_the_split_linears(phi3: tuple[Any, Path], f32_bundle: Bundle,
                                                       fused_plugin: Any) -> None:
    """Each split linear is quantized on its own (group-wise RTN of its rows), exactly as an unfused one would be."""
    model, directory = phi3
    out = directory / "w4.topq"
    w4 = recipe(directory, out, "w4bf16")
    assert convert(w4, progress=False)["family"] == "fused-phi3"
    bundle = Bundle(out)
    scheme = fused_plugin.schemes.get("w4bf16")
    qkv = model.model.layers[0].self_attn.qkv_proj.weight.detach().numpy()
    for name, rows in (("q_proj", qkv[:64]), ("v_proj", qkv[96:])):
        stored = np.asarray(bundle.tensor(f"model.layers.0.self_attn.{name}.weight"), dtype=np.float32)
        expected = scheme.quantize(rows, w4.to_dict()["quant"]).dequantize()  # the host stores it exactly
        np.testing.assert_array_equal(stored, expected)
        assert not np.array_equal(stored, round_to_dtype(rows, "bf16"))  # really quantized
    ids = prompt(9, seed=3)
    got, ref = Session(bundle).feed(ids, all_logits=True), Session(f32_bundle).feed(ids, all_logits=True)
    cosine = float((got * ref).sum() / np.linalg.norm(got) / np.linalg.norm(ref))
    assert cosine > 0.9, cosine


@pytest.fixture(scope="module")
def llama_twin(phi3: tuple[Any, Path]) -> Path:
    """The same model saved unfused, as a Llama checkpoint (Phi-3 with default RoPE is a Llama with fused
    tensors): the built-in llama family reads it with no weight map."""
    model, directory = phi3
    config = model.config
    twin = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, vocab_size=VOCAB, max_position_embeddings=256,
        rms_norm_eps=config.rms_norm_eps, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    state = {}
    for name, tensor in model.state_dict().items():
        if "qkv_proj" in name:
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split([64, 32, 32])):
                state[name.replace("qkv_proj", part)] = rows
        elif "gate_up_proj" in name:
            for part, rows in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                state[name.replace("gate_up_proj", part)] = rows
        else:
            state[name] = tensor
    twin.load_state_dict(state, strict=True)
    twin.save_pretrained(directory / "llama_twin", safe_serialization=True)
    return directory / "llama_twin"


@pytest.fixture(scope="module")
def calibration_ids(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from data_paths import AUSTEN

    path = tmp_path_factory.mktemp("fused_calibration") / "emma.ids"
    path.write_text(" ".join(str(b) for b in (AUSTEN / "00_EMMA.txt").read_bytes()[:4000]))  # bytes < VOCAB
    return path


def bundle_tensors(path: Path) -> dict[str, bytes]:
    bundle = Bundle(path)
    return {name: np.asarray(bundle.tensor(name)).tobytes() for name in bundle.file.names()}


@pytest.mark.parametrize("scheme, chip", [("gptq", "host"), ("awq", "host"), ("int8", "host"), ("w4bf16", "bm1684x")])
def test_schemes_give_the_unfused_twins_tensors(phi3: tuple[Any, Path], llama_twin: Path, calibration_ids: Path,
                                                scheme: str, chip: str) -> None:
    """Calibration, AWQ's grouped scales and norm folding, int8's sites and the chip's packing all read the split
    tensors: the fused checkpoint's bundle holds exactly the tensors of its unfused Llama twin's."""
    _, directory = phi3
    tensors = []
    for source in (directory, llama_twin):
        out = directory / f"{scheme}_{chip}_{source.name}.topq"
        r = recipe_from_defaults(
            model={"path": str(source)}, target={"chip": chip}, stages=STAGES, output={"path": str(out)},
            quant={"scheme": scheme, **({} if scheme == "int8" else {"group_size": 32}),
                   "calibration": {"data": str(calibration_ids), "samples": 2, "seq_len": 32}})
        assert convert(r, progress=False)["family"] == ("fused-phi3" if source == directory else "llama")
        tensors.append(bundle_tensors(out))
    assert list(tensors[0]) == list(tensors[1])
    assert tensors[0] == tensors[1]


def test_cached_parallel_build_equals_the_inline_one(phi3: tuple[Any, Path], f32_bundle: Bundle,
                                                     tmp_path: Path) -> None:
    """Units compiled in worker processes and keyed by the derived tensors' fingerprints; a second conversion
    reuses every unit, and both bundles equal the inline one byte for byte."""
    _, directory = phi3
    first, second = tmp_path / "a.topq", tmp_path / "b.topq"
    runs = [convert(recipe(directory, out, "f32"), progress=False, jobs=2, cache_dir=tmp_path / "cache",
                    use_cache=True) for out in (first, second)]
    assert runs[0]["units_built"] == runs[0]["units"] > 1 and runs[1]["units_reused"] == runs[1]["units"]
    assert first.read_bytes() == second.read_bytes() == f32_bundle.path.read_bytes()


# ------------------------------------------------------------------------------- the mapping on its own


class DictStore:
    """A minimal WeightStore over a dict (float32 and bf16 arrays), optionally with an integer form."""

    def __init__(self, tensors: dict[str, np.ndarray], quantized: dict[str, QuantizedWeight] | None = None) -> None:
        self.tensors, self._quantized = tensors, quantized or {}
        self.reads: list[str] = []

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> str:
        return str(self.tensors[name].dtype)

    def get(self, name: str) -> np.ndarray:
        self.reads.append(name)
        return self.tensors[name].astype(np.float32)

    def get_raw(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def quantized(self, name: str) -> QuantizedWeight | None:
        return self._quantized.get(name)


def spec(layers: int = 2, heads: int = 4, kv: int = 2, head_dim: int = 2, inter: int = 3) -> ModelSpec:
    return ModelSpec(family="t", architecture="T", hidden_size=heads * head_dim, intermediate_size=inter,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, vocab_size=10)


def arange(*shape: int) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)


def test_rows_split_lists_parts_in_place_and_reads_the_fused_tensor_once() -> None:
    s = spec(layers=1)
    base = DictStore({"emb": arange(10, 8), "l.0.qkv": arange(16, 8), "l.0.norm": arange(8)})
    store = MappedWeights(base, split_rows("l.{i}.qkv", qkv_sections, "l.{i}.q", "l.{i}.k", "l.{i}.v"), s, "t")
    assert store.names() == ["emb", "l.0.q", "l.0.k", "l.0.v", "l.0.norm"]
    assert "l.0.qkv" not in store and "l.0.q" in store
    assert [store.shape(n) for n in ("l.0.q", "l.0.k", "l.0.v")] == [(8, 8), (4, 8), (4, 8)]
    base.reads.clear()
    parts = [store.get(n) for n in ("l.0.q", "l.0.k", "l.0.v")]
    assert base.reads == ["l.0.qkv"]  # q, k and v in turn cost one read of the fused tensor
    np.testing.assert_array_equal(np.concatenate(parts), base.tensors["l.0.qkv"])
    parts[0][:] = -1  # a caller's copy: the next read is unaffected
    np.testing.assert_array_equal(store.get("l.0.q"), base.tensors["l.0.qkv"][:8])
    np.testing.assert_array_equal(store.get("emb"), base.tensors["emb"])
    with pytest.raises(TopqError, match="l.0.qkv"):
        store.get("l.0.qkv")


def test_rows_keep_the_stored_dtype_and_integer_form() -> None:
    import ml_dtypes

    fused = arange(6, 4).astype(ml_dtypes.bfloat16)
    codes = np.arange(24, dtype=np.int8).reshape(6, 4)
    q = QuantizedWeight(codes, np.full((6, 2), 0.5, np.float32), np.arange(12, dtype=np.float32).reshape(6, 2),
                        bits=4, group_size=2, symmetric=False)
    base = DictStore({"l.0.gate_up": fused}, {"l.0.gate_up": q})
    store = MappedWeights(base, split_rows("l.{i}.gate_up", gate_up_sections, "l.{i}.gate", "l.{i}.up"), spec(1), "t")
    assert store.dtype("l.0.up") == "bfloat16"
    assert store.read_raw("l.0.up").dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(store.get_raw("l.0.up"), fused[3:])
    up = store.quantized("l.0.up")
    assert up is not None and up.spec.shape == (3, 4)
    np.testing.assert_array_equal(up.codes, codes[3:])
    np.testing.assert_array_equal(up.zeros, q.zeros[3:])
    np.testing.assert_array_equal(up.dequantize(), q.dequantize()[3:])


def test_wrong_sections_name_the_tensor() -> None:
    base = DictStore({"l.0.qkv": arange(15, 8)})
    with pytest.raises(TopqError, match=r"l\.0\.qkv has 15 rows; l\.0\.q is part 0 of \[8, 4, 4\]"):
        MappedWeights(base, split_rows("l.{i}.qkv", qkv_sections, "l.{i}.q", "l.{i}.k", "l.{i}.v"), spec(1), "t")
    with pytest.raises(TopqError, match="not 2 equal parts"):
        MappedWeights(base, {"l.{i}.gate": Rows("l.{i}.qkv", 2, 0)}, spec(1), "t")


def test_add_scalar_in_place_and_stack_of_experts() -> None:
    base = DictStore({"norm": arange(4), "l.0.e0": arange(2, 3), "l.0.e1": arange(2, 3) + 10,
                      "l.0.e2": arange(2, 3) + 20, "tail": arange(1)})
    rules = {"norm": AddScalar("norm", 1.0), "l.{i}.experts": Stack("l.{i}.e{e}", lambda s: 3)}
    store = MappedWeights(base, rules, spec(1), "t")
    assert store.names() == ["norm", "l.0.experts", "tail"]
    np.testing.assert_array_equal(store.get("norm"), arange(4) + 1)
    assert store.dtype("norm") == "float32" and store.quantized("norm") is None
    assert store.shape("l.0.experts") == (3, 2, 3)
    np.testing.assert_array_equal(store.get("l.0.experts")[2], arange(2, 3) + 20)


def test_fingerprints_follow_the_rule_and_the_sources() -> None:
    base = DictStore({"l.0.gu": arange(4, 2), "n": arange(2)})
    halves = MappedWeights(base, split_rows("l.{i}.gu", 2, "l.{i}.g", "l.{i}.u"), spec(1), "t")
    uneven = MappedWeights(base, {"l.{i}.g": Rows("l.{i}.gu", lambda s: (1, 3), 0)}, spec(1), "t")
    assert halves.fingerprint("l.0.g") != halves.fingerprint("l.0.u") != uneven.fingerprint("l.0.g")
    before = halves.fingerprint("l.0.g")
    base.tensors["l.0.gu"] = arange(4, 2) + 1
    assert halves.fingerprint("l.0.g") != before
    assert halves.fingerprint("n") == MappedWeights(base, {}, spec(1), "t").fingerprint("n")


def test_a_family_without_a_weight_map_reads_the_checkpoint_as_is() -> None:
    base = DictStore({"x": arange(2)})
    llama = build_plugins().families.get("llama")
    assert llama.weights(spec(1), base) is base
    assert isinstance(FAMILY.weights(spec(1), base), MappedWeights)


def test_config_dataclass_reads_keys_and_refuses_what_is_missing() -> None:
    config = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
              "vocab_size": 10, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}
    c = read_config(FusedConfig, config, "fused-phi3")
    assert (c.hidden_size, c.num_key_value_heads, c.rope_type, c.rms_norm_eps) == (8, None, "longrope", 1e-5)
    with pytest.raises(TopqError, match="rope type 'longrope' is not supported"):
        normalize(config)
    with pytest.raises(TopqError, match="config is missing 'vocab_size' \\(needed by the fused-phi3 family\\)"):
        read_config(FusedConfig, {k: v for k, v in config.items() if k != "vocab_size"}, "fused-phi3")
