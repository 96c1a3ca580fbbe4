"""`topq export gptq | awq | compressed-tensors`: standard quantized Hugging Face checkpoints.

Byte layouts are checked against the reference packers of tests/helpers/quantized_writers.py (loops written after
AutoGPTQ's `QuantLinear.pack`, AutoAWQ's `WQLinear_GEMM.from_linear` and compressed-tensors' `pack_to_int32`,
independent of topq's vectorised packer), and the exported model is read back three ways: topq's importer
(`quant.scheme: auto`), independent numpy readers written after the readers of TPU-MLIR's `llm_convert`
(`LlmConverter.unpack_weights`, GPTQ v1 zeros + 1, AWQ column order [0, 4, 1, 5, 2, 6, 3, 7]) and
compressed-tensors (`unpack_from_int32`), and a host bundle compared with the source bundle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from host_bundles import TinyCheckpoint
from quantized_writers import awq_pack, ct_pack_to_int32, gptq_pack_along_rows, gptq_pack_zeros

from topq.core import cli
from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.pipeline import convert, linear_weight_names, load_model, make_quantizer
from topq.core.plugins import get_plugins
from topq.core.quant import QuantizedWeight
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session
from topq.io.safetensors import SafetensorsFile
from topq.ir.types import round_to_dtype
from topq.plugins.exporters.hf_quantized import normalized
from topq.plugins.exporters.hf_quantized.packing import gptq_v1_zeros, pack_awq, pack_compressed, pack_gptq
from topq.plugins.formats.quantized import unpack_awq, unpack_gptq, unpack_pack_quantized

F16 = np.dtype(np.float16)
IDS = [1, 5, 9, 77, 120, 3, 44, 200]


def random_weight(rng: np.random.Generator, n: int, k: int, bits: int, group: int, *, sym: bool = False,
                  act_order: bool = False, zero_low: int = 1) -> QuantizedWeight:
    groups = -(-k // group)
    codes = rng.integers(0, 1 << bits, (n, k)).astype(np.uint8)
    zeros = (np.full((n, groups), 1 << (bits - 1)) if sym
             else rng.integers(zero_low, 1 << bits, (n, groups))).astype(np.int16)
    scales = rng.uniform(0.002, 0.05, (n, groups)).astype(np.float32)
    g_idx = rng.permutation(np.arange(k) // group).astype(np.int32) if act_order else None
    return QuantizedWeight(codes, scales, zeros, bits, group, sym, g_idx)


def assert_same(a: QuantizedWeight, b: QuantizedWeight) -> None:
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.zeros, b.zeros)
    np.testing.assert_array_equal(a.scales, b.scales)
    assert (a.g_idx is None) == (b.g_idx is None)
    if a.g_idx is not None:
        np.testing.assert_array_equal(a.g_idx, b.g_idx)


# ------------------------------------------------------------------------------------------------ byte layouts
@pytest.mark.parametrize("bits,v1,act_order", [(2, True, False), (3, True, True), (4, True, True), (4, False, False),
                                               (8, True, False)])
def test_gptq_bytes_match_autogptq_and_read_back(bits: int, v1: bool, act_order: bool) -> None:
    rng = np.random.default_rng(bits)
    w = random_weight(rng, 64, 128, bits, 32, act_order=act_order, zero_low=1 if v1 else 0)
    packed = pack_gptq(w, F16, v1)
    np.testing.assert_array_equal(packed["qweight"], gptq_pack_along_rows(np.ascontiguousarray(w.codes.T), bits))
    stored_zeros = w.zeros - 1 if v1 else w.zeros
    np.testing.assert_array_equal(packed["qzeros"], gptq_pack_zeros(np.ascontiguousarray(stored_zeros.T), bits))
    assert packed["qweight"].dtype == packed["qzeros"].dtype == np.int32 and packed["scales"].dtype == F16
    g_idx = w.g_idx if w.g_idx is not None else np.arange(128) // 32
    np.testing.assert_array_equal(packed["g_idx"], g_idx)
    back = unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], bits=bits,
                       group_size=32, zero_offset=int(v1))
    expected = QuantizedWeight(w.codes, w.scales.astype(F16), w.zeros, bits, 32, False, w.g_idx)
    assert_same(back, expected)


def test_awq_bytes_match_autoawq_and_read_back() -> None:
    w = random_weight(np.random.default_rng(7), 48, 96, 4, 32, zero_low=0)
    packed = pack_awq(w, F16)
    np.testing.assert_array_equal(packed["qweight"], awq_pack(np.ascontiguousarray(w.codes.T)))
    np.testing.assert_array_equal(packed["qzeros"], awq_pack(np.ascontiguousarray(w.zeros.T)))
    assert packed["qweight"].shape == (96, 6) and packed["qzeros"].shape == (3, 6)
    back = unpack_awq(packed["qweight"], packed["qzeros"], packed["scales"], group_size=32)
    assert_same(back, QuantizedWeight(w.codes, w.scales.astype(F16), w.zeros, 4, 32, False))


@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (8, False)])
def test_compressed_tensors_bytes_match_pack_to_int32_and_read_back(bits: int, sym: bool) -> None:
    # K = 40 and N = 13 are not whole words at 4 bits: both packed dims are zero-padded as compressed-tensors pads
    w = random_weight(np.random.default_rng(bits + sym), 13, 40, bits, 8, sym=sym, zero_low=0)
    packed = pack_compressed(w, F16, symmetric=sym)
    offset = 1 << (bits - 1)
    np.testing.assert_array_equal(packed["weight_packed"], ct_pack_to_int32(w.codes.astype(np.int16) - offset, bits))
    np.testing.assert_array_equal(packed["weight_shape"], [13, 40])
    assert packed["weight_shape"].dtype == np.int64
    if sym:
        assert "weight_zero_point" not in packed
    else:
        np.testing.assert_array_equal(packed["weight_zero_point"],
                                      ct_pack_to_int32(w.zeros - offset, bits, packed_dim=0))
    back = unpack_pack_quantized(packed["weight_packed"], packed["weight_scale"], packed["weight_shape"], bits=bits,
                                 weight_zero_point=packed.get("weight_zero_point"), group_size=8, symmetric=sym)
    assert_same(back, QuantizedWeight(w.codes, w.scales.astype(F16), w.zeros, bits, 8, sym))


def test_gptq_v1_shifts_a_zero_point_of_zero_exactly_or_refuses() -> None:
    """v1 stores zero - 1: a zero of 0 is shifted (codes + 1, zero 1: the same values) when the group leaves room."""
    w = random_weight(np.random.default_rng(3), 8, 64, 4, 32)
    zeros, codes = w.zeros.copy(), w.codes.copy()
    zeros[2, 1] = 0
    codes[2, 32:] = np.minimum(codes[2, 32:], 14)
    room = QuantizedWeight(codes, w.scales, zeros, 4, 32, False)
    shifted, count = gptq_v1_zeros(room, "layer")
    assert count == 1 and shifted.zeros.min() == 1
    np.testing.assert_array_equal(shifted.dequantize(), room.dequantize())
    codes[2, 40] = 15
    with pytest.raises(TopqError, match="layer: a group with zero point 0 uses code 15.*gptq_v2"):
        gptq_v1_zeros(QuantizedWeight(codes, w.scales, zeros, 4, 32, False), "layer")


# ------------------------------------------------------------------------------------------------ independent readers
def read_gptq_like_tpu_mlir(t: dict[str, np.ndarray], prefix: str, bits: int) -> np.ndarray:
    """TPU-MLIR `LlmConverter.unpack_weights` (quant_mode gptq, 4/8 bits) + GPTQ v1 dequantization with g_idx."""
    per, mask = 32 // bits, (1 << bits) - 1
    qw = t[f"{prefix}.qweight"].view(np.uint32)
    qz = t[f"{prefix}.qzeros"].view(np.uint32)
    codes = np.stack([(qw[row // per] >> (bits * (row % per))) & mask for row in range(qw.shape[0] * per)])
    zeros = np.stack([(qz[:, col // per] >> (bits * (col % per))) & mask for col in range(qz.shape[1] * per)], 1) + 1
    g = t[f"{prefix}.g_idx"]
    w_kn = (codes.astype(np.float32) - zeros[g]) * t[f"{prefix}.scales"][g].astype(np.float32)
    return w_kn.T


def read_awq_like_tpu_mlir(t: dict[str, np.ndarray], prefix: str, group: int) -> np.ndarray:
    """TPU-MLIR `LlmConverter.unpack_weights` (quant_mode awq): column c is field order_map[c % 8] of word c // 8."""
    order_map = [0, 4, 1, 5, 2, 6, 3, 7]
    qw, qz = t[f"{prefix}.qweight"].view(np.uint32), t[f"{prefix}.qzeros"].view(np.uint32)
    n = qw.shape[1] * 8
    codes = np.stack([(qw[:, c // 8] >> (4 * order_map[c % 8])) & 0xF for c in range(n)], 1)
    zeros = np.stack([(qz[:, c // 8] >> (4 * order_map[c % 8])) & 0xF for c in range(n)], 1)
    g = np.arange(codes.shape[0]) // group
    return ((codes.astype(np.float32) - zeros[g]) * t[f"{prefix}.scales"][g].astype(np.float32)).T


def read_ct_like_compressed_tensors(t: dict[str, np.ndarray], prefix: str, bits: int, group: int) -> np.ndarray:
    """compressed-tensors `unpack_from_int32` (entries i::pack_factor, minus the offset) and `dequantize`."""
    per, mask, offset = 32 // bits, (1 << bits) - 1, 1 << (bits - 1)
    packed = t[f"{prefix}.weight_packed"].view(np.uint32)
    n, k = (int(v) for v in t[f"{prefix}.weight_shape"])
    q = np.zeros((packed.shape[0], packed.shape[1] * per), np.int32)
    for i in range(per):
        q[:, i::per] = (packed >> (bits * i)) & mask
    q = q[:, :k] - offset
    zp = np.zeros_like(t[f"{prefix}.weight_scale"], dtype=np.int32)
    if f"{prefix}.weight_zero_point" in t:
        z = t[f"{prefix}.weight_zero_point"].view(np.uint32)
        full = np.zeros((z.shape[0] * per, z.shape[1]), np.int32)
        for i in range(per):
            full[i::per] = (z >> (bits * i)) & mask
        zp = full[:n] - offset
    g = np.arange(k) // group
    return (q - zp[:, g]).astype(np.float32) * t[f"{prefix}.weight_scale"][:, g].astype(np.float32)


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> Path:
    d = tmp_path_factory.mktemp("hf_export")
    tiny_checkpoint("llama", d)
    (d / "calib.ids").write_text(" ".join(map(str, np.random.default_rng(0).integers(3, 250, 400))))
    return d


def tiny_bundle(d: Path, scheme: str, chip: str = "host", **quant: Any) -> Path:
    out = d / f"{scheme}_{chip}_{len(list(d.glob('*.topq')))}.topq"
    recipe = recipe_from_defaults(
        model={"path": str(d)}, target={"chip": chip}, output={"path": str(out)},
        quant={"scheme": scheme, "group_size": 32, **quant,
               "calibration": {"data": str(d / "calib.ids"), "samples": 4, "seq_len": 32}},
        stages={"seq_length": 64, "max_input_length": 16})
    convert(recipe, progress=False)
    return out


def export(capsys: pytest.CaptureFixture[str], kind: str, bundle: Path, out: Path, *options: str) -> dict[str, Any]:
    capsys.readouterr()
    argv = ["export", kind, str(bundle), str(out), "--json"] + [a for o in options for a in ("--option", o)]
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def scheme_values(bundle: Path) -> dict[str, QuantizedWeight]:
    """The scheme's integers for every linear, computed from the bundle's recipe (what the export must hold)."""
    from topq.core.recipe import Recipe

    recipe = Recipe.from_dict(Bundle(bundle).recipe)
    model = load_model(recipe)
    quantizer = make_quantizer(model, recipe, get_plugins(), linear_weight_names(model.module))
    return {n: normalized(q) for n in quantizer.linear_names if (q := quantizer.values(n)) is not None}


def imported(directory: Path) -> Any:
    return get_plugins().formats.get("hf").open(directory).weights


CASES = {  # export kind, source scheme, its options, config fields, the independent reader
    "gptq": ("gptq", {"act_order": True, "symmetric": False},
             {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
              "checkpoint_format": "gptq"}, lambda t, p: read_gptq_like_tpu_mlir(t, p, 4)),
    "awq": ("awq", {"symmetric": False},
            {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
            lambda t, p: read_awq_like_tpu_mlir(t, p, 32)),
    "compressed-tensors": ("gptq", {"symmetric": True},
                           {"quant_method": "compressed-tensors", "format": "pack-quantized",
                            "quantization_status": "compressed"},
                           lambda t, p: read_ct_like_compressed_tensors(t, p, 4, 32)),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_export_reads_back_exactly(tiny_dir: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    """A topq bundle exported as `kind`: the same integers through topq's importer, the same dequantized weights
    through an independent reader, the same numbers as the source bundle (f32 scales: bit for bit; f16 scales:
    the scales rounded once), the source's float tensors, config and tokenizer."""
    scheme, quant, fields, reader = CASES[kind]
    bundle = tiny_bundle(tiny_dir, scheme, **quant)
    expected = scheme_values(bundle)
    source = Bundle(bundle)

    exact_dir = tiny_dir / f"{kind}_f32"
    summary = export(capsys, kind, bundle, exact_dir, "scale_dtype=float32")
    assert summary["quantized"] == 14 and summary["output"] == str(exact_dir)
    store = imported(exact_dir)
    assert sorted(store.quantized_names()) == sorted(expected)
    for name, q in expected.items():
        back = store.quantized(name)
        np.testing.assert_array_equal(back.codes, q.codes)
        np.testing.assert_array_equal(back.zeros, q.zeros)
        # the host bundle stored this weight as exactly its dequantized values: the export holds them
        np.testing.assert_array_equal(back.dequantize(), np.asarray(source.tensor(name)))

    out = tiny_dir / kind
    export(capsys, kind, bundle, out)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert {k: qc[k] for k in fields} == fields
    original = json.loads((tiny_dir / "config.json").read_text())
    dtype_keys = [key for key in ("dtype", "torch_dtype") if key in original]
    assert dtype_keys and all(config[key] == "bfloat16" for key in dtype_keys)  # the scheme's compute dtype
    assert {k: v for k, v in config.items() if k != "quantization_config" and k not in dtype_keys} == \
        {k: v for k, v in original.items() if k not in dtype_keys}
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert (out / "generation_config.json").read_text() == (tiny_dir / "generation_config.json").read_text()
    tensors = {n: np.asarray(SafetensorsFile(out / "model.safetensors").get_raw(n))
               for n in SafetensorsFile(out / "model.safetensors").names()}
    store = imported(out)
    for name, q in expected.items():
        prefix = name[: -len(".weight")]
        f16 = QuantizedWeight(q.codes, q.scales.astype(F16), q.zeros, q.bits, q.group_size, q.symmetric, q.g_idx)
        np.testing.assert_array_equal(store.get(name), f16.dequantize())
        np.testing.assert_array_equal(reader(tensors, prefix), f16.dequantize())
    original_file = SafetensorsFile(tiny_dir / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        np.testing.assert_array_equal(tensors[name], np.asarray(original_file.get_raw(name)))
    if kind == "awq":  # AWQ folded its scales into the norms: the export carries the rewritten norms (in the
        # checkpoint's float32; the bundle holds them in the scheme's bf16)
        norm = "model.layers.0.post_attention_layernorm.weight"
        assert tensors[norm].dtype == np.float32
        np.testing.assert_array_equal(round_to_dtype(tensors[norm], "bf16"), np.asarray(source.tensor(norm)))
        assert not np.array_equal(tensors[norm], np.asarray(original_file.get_raw(norm)))

    if kind == "gptq":  # and `auto` converts the f32-scale export to a bundle computing what the source computes
        recipe = recipe_from_defaults(model={"path": str(exact_dir)}, quant={"scheme": "auto"},
                                      target={"chip": "host"}, output={"path": str(tiny_dir / "auto.topq")},
                                      stages={"seq_length": 64, "max_input_length": 16})
        convert(recipe, progress=False)
        np.testing.assert_array_equal(Session(Bundle(tiny_dir / "auto.topq")).feed(IDS, all_logits=True),
                                      Session(source).feed(IDS, all_logits=True))


def test_export_refusals(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One error line, non-zero exit, nothing written."""
    def refused(argv: list[str], fragment: str) -> None:
        capsys.readouterr()
        assert cli.main(argv) != 0
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if line.strip()]
        assert out == "" and len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], err

    act_order = tiny_bundle(tiny_dir, "gptq", act_order=True, symmetric=False)
    float_bundle = tiny_bundle(tiny_dir, "f32")
    taken = tiny_dir / "taken"
    taken.mkdir()
    (taken / "keep").write_text("x")
    refused(["export", "awq", str(act_order), str(tiny_dir / "a")],
            "act-order groups (g_idx), which cannot be exported as awq")
    refused(["export", "gptq", str(float_bundle), str(tiny_dir / "b")], "quantizes no weights")
    refused(["export", "gptq", str(act_order), str(taken)], "exists and is not an empty directory")
    refused(["export", "gptq", str(act_order), str(tiny_dir / "c"), "--option", "bits=3"], "unknown option 'bits'")
    refused(["export", "awq", str(act_order), str(tiny_dir / "d"), "--option", "checkpoint_format=gptq"],
            "unknown option 'checkpoint_format'")
    refused(["export", "gptq", str(act_order), str(tiny_dir / "e"), "--option", "scale_dtype=int8"],
            "scale_dtype: 'int8' is not one of")
    assert [p.name for p in tiny_dir.iterdir() if p.name in "abcde" or p.name.startswith(".")] == []
    assert (taken / "keep").read_text() == "x"
