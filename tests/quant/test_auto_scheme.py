"""`quant.scheme: auto`: a pre-quantized checkpoint's own integers, repacked for the target without requantizing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf_llama import block_scales, dequantized, write_gguf_llama
from host_bundles import TinyCheckpoint
from quantized_writers import GROUP, write_quantized_llama

from topq.core.bundle import Bundle
from topq.core.cli import main
from topq.core.pipeline import convert
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session
from topq.plugins.targets.bm1684x.packing import dequantize as chip_dequantize
from topq.plugins.targets.bm1684x.packing import unpack_codes

IDS = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 200]


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> Path:
    d = tmp_path_factory.mktemp("auto_float")
    tiny_checkpoint("llama", d)
    return d


def _bundle(checkpoint: Path, out: Path, chip: str, scheme: str = "auto", **quant: object) -> Bundle:
    recipe = recipe_from_defaults(model={"path": str(checkpoint)}, quant={"scheme": scheme, **quant},
                                  target={"chip": chip},
                                  stages={"seq_length": 64, "max_input_length": 16}, output={"path": str(out)})
    convert(recipe, progress=False)
    return Bundle(out)


@pytest.mark.parametrize("fmt", ["awq", "ct"])
def test_auto_keeps_the_checkpoint_integers_on_bm1684x(float_dir: Path, tmp_path: Path, fmt: str) -> None:
    qdir = tmp_path / fmt
    dequantized = write_quantized_llama(float_dir, qdir, fmt)
    chip = _bundle(qdir, tmp_path / "chip.topq", "bm1684x")
    host = _bundle(qdir, tmp_path / "host.topq", "host", scheme="f32")
    # Every quantized linear is an A16 weight whose stored integers dequantize to the checkpoint's values.
    name = "model.layers.1.mlp.down_proj.weight"
    parts = {p: np.asarray(chip.tensor(f"{name}.{p}")) for p in ("packed", "scale", "zp")
             if f"{name}.{p}" in chip.tensor_names()}
    got = chip_dequantize(parts["packed"], parts["scale"], parts.get("zp"), 4, GROUP, "f32")
    np.testing.assert_allclose(got, dequantized[name], rtol=0, atol=np.abs(dequantized[name]).max() * 1e-2)
    a, b = Session(chip).feed(IDS, all_logits=True), Session(host).feed(IDS, all_logits=True)
    cos = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
    assert cos >= 0.999, cos


AUTO_ROUND_V1 = {"quant_method": "auto-round", "bits": 4, "group_size": GROUP, "sym": False,
                 "packing_format": "auto_round:auto_gptq"}  # intel/auto-round's GPTQ v1 packing


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct", "autoround"])
def test_auto_on_host_dequantizes_exactly(float_dir: Path, tmp_path: Path, fmt: str) -> None:
    """The host keeps the checkpoint's arithmetic: (code - zero) * f16 scale in float32, not rounded to bf16."""
    import ml_dtypes

    qdir = tmp_path / fmt
    dequantized = write_quantized_llama(float_dir, qdir, "gptq" if fmt == "autoround" else fmt)
    if fmt == "autoround":  # the same GPTQ v1 tensors, described as AutoRound writes them
        config = json.loads((qdir / "config.json").read_text())
        config["quantization_config"] = AUTO_ROUND_V1
        (qdir / "config.json").write_text(json.dumps(config))
    bundle = _bundle(qdir, tmp_path / "a.topq", "host")
    rounded = 0
    for name, weight in dequantized.items():  # the helper's own dequantization, independent of topq's unpackers
        stored = np.asarray(bundle.tensor(name))
        np.testing.assert_array_equal(stored, weight)
        rounded += not np.array_equal(stored, weight.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert rounded == len(dequantized)  # bf16 rounding would have changed every linear


def test_act_order_gptq_is_refused_by_bm1684x(float_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    qdir = tmp_path / "gptq"
    write_quantized_llama(float_dir, qdir, "gptq")
    recipe = tmp_path / "r.yaml"
    out = tmp_path / "x.topq"
    recipe.write_text(f"model: {{path: {qdir}}}\nquant: {{scheme: auto}}\ntarget: {{chip: bm1684x}}\n"
                      f"stages: {{seq_length: 64, max_input_length: 16}}\noutput: {{path: {out}}}\n")
    assert main(["convert", str(recipe), "--jobs", "1", "--no-cache"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "act-order" in err[0] and not out.exists()


# ------------------------------------------------------------------------------------------------ GGUF under auto
#: one GGML type per linear of a 2-layer Llama 256 wide (k-quants need rows of 256): exact (Q4_0, Q8_0), requantized
#: to W4 (Q4_1, Q4_K, Q3_K, Q2_K) or to W8 (Q5_0, Q5_1, Q5_K, Q6_K); layer 1's gate/up/down stay F32
GGUF_TYPES = {"blk.0.attn_q.weight": "Q4_1", "blk.0.attn_k.weight": "Q4_0", "blk.0.attn_v.weight": "Q8_0",
              "blk.0.attn_output.weight": "Q4_K", "blk.0.ffn_gate.weight": "Q5_K", "blk.0.ffn_up.weight": "Q6_K",
              "blk.0.ffn_down.weight": "Q5_1", "blk.1.attn_q.weight": "Q5_0", "blk.1.attn_k.weight": "Q8_0",
              "blk.1.attn_v.weight": "Q3_K", "blk.1.attn_output.weight": "Q2_K", "output.weight": "Q4_1"}
EXACT = ("Q4_0", "Q8_0")
W4 = ("Q4_1", "Q4_K", "Q3_K", "Q2_K")


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[str, np.ndarray]]]:
    from tiny_models import build_tiny

    d = tmp_path_factory.mktemp("auto_gguf")
    build_tiny("llama", d / "hf", overrides={"hidden_size": 256, "intermediate_size": 256})
    write_gguf_llama(d / "hf", d / "model.gguf", GGUF_TYPES)
    linears = {name: value for name, value in dequantized(d / "model.gguf").items() if name != "lm_head.weight"}
    return d / "model.gguf", linears


def numpy_rtn(w: np.ndarray, bits: int, dtype: type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Written here, not taken from topq: groups of 32 along K, range widened to contain 0, scale = range / (2^b - 1)
    in float64, zero = round(-min / scale), codes = clamp(round(w / scale) + zero); scales then stored in `dtype`."""
    maxq = 2 ** bits - 1
    g = w.astype(np.float64).reshape(w.shape[0], -1, 32)
    lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    scale = (hi - lo) / maxq
    scale = np.where(scale > 1e-12, scale, 1.0)
    zero = np.clip(np.round(-lo / scale), 0, maxq)
    codes = np.clip(np.round(g / scale[..., None]) + zero[..., None], 0, maxq).reshape(w.shape)
    return codes, zero, scale.astype(np.float32).astype(dtype)


def requant_expected(w: np.ndarray, bits: int, dtype: type) -> np.ndarray:
    codes, zero, scale = numpy_rtn(w, bits, dtype)
    rows = np.repeat(np.arange(w.shape[1] // 32), 32)
    return ((codes.astype(np.float32) - zero[:, rows].astype(np.float32)) * scale[:, rows].astype(np.float32))


def test_auto_gguf_on_host_exact_and_requantized(gguf_model: tuple[Path, dict], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Q4_0 / Q8_0 dequantize exactly as the file does; every other type is requantized to group 32 on topq's grid,
    equal to an independent RTN of gguf-py's dequantization, within a rounding step of it, and reported."""
    import ml_dtypes

    path, reference = gguf_model
    bundle = _bundle(path, tmp_path / "host.topq", "host")
    err = capsys.readouterr().err
    rows = {row["name"]: row for row in bundle.meta["quant_report"]}
    assert "lm_head.weight" not in rows  # quant.lm_head (bf16) decides the head (a Q4_1 tensor), not auto
    assert set(rows) == set(reference)
    for name, (qtype, w) in reference.items():
        stored, row = np.asarray(bundle.tensor(name)), rows[name]
        assert row["source"] == qtype
        if qtype in EXACT:
            np.testing.assert_array_equal(stored, w)
            assert row["mode"] == "exact" and row["bits"] == (4 if qtype == "Q4_0" else 8)
            continue
        bits = 4 if qtype in W4 else 8
        expected = requant_expected(w, bits, ml_dtypes.bfloat16)
        np.testing.assert_array_equal(stored, expected)
        # against the float it came from: half a step, plus the scale's bf16 rounding times the largest code
        step = numpy_rtn(w, bits, np.float32)[2]
        bound = np.repeat(step * (0.5 + (2 ** bits - 1) * 2.0 ** -8), 32, axis=1)
        assert np.all(np.abs(stored - w) <= bound * (1 + 1e-6)), name
        relative = np.linalg.norm(stored - w) / np.linalg.norm(w)
        assert row["mode"] == "requant" and row["bits"] == bits
        assert row["error"] == pytest.approx(relative, rel=1e-5)
        assert relative < (0.1 if bits == 4 else 0.01), (name, relative)
    requant = [n for n, (t, _) in reference.items() if t not in EXACT]
    lines = [line for line in err.splitlines() if line.startswith("warning: auto:")]
    assert any(f"{len(requant)} linears" in line and "Q4_K" in line and "W4/W8 group 32" in line for line in lines)
    # bf16 compute: the exact routes' f16 scales are rounded where a target stores scales in the compute dtype
    worst = 0.0
    for name, d16 in block_scales(path).items():
        d = d16.astype(np.float32)
        worst = max(worst, float(np.max(np.abs(d.astype(ml_dtypes.bfloat16).astype(np.float32) - d) / np.abs(d))))
        assert rows[name]["scale_error"] > 0
    assert max(r.get("scale_error", 0.0) for r in rows.values()) == pytest.approx(worst, rel=1e-6)
    assert any(f"{100 * worst:.3f} %" in line and "rounded to bf16" in line for line in lines), lines


def test_auto_gguf_f16_scales_exact_on_bm1684x(gguf_model: tuple[Path, dict], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """act_dtype f16: Q4_0 / Q8_0 become W4F16 / W8F16 weights holding the file's codes and its f16 d bit for bit;
    the requantized weights hold the independent RTN's codes, zero points and f16 scales; nothing is rounded."""
    path, reference = gguf_model
    chip = _bundle(path, tmp_path / "chip.topq", "bm1684x", act_dtype="f16")
    assert chip.meta["target_meta"]["dtype"] == "f16"
    assert "rounded to" not in capsys.readouterr().err
    scales = block_scales(path)
    for name, (qtype, w) in reference.items():
        packed, scale = np.asarray(chip.tensor(f"{name}.packed")), np.asarray(chip.tensor(f"{name}.scale"))
        assert scale.dtype == np.float16
        if qtype in EXACT:
            np.testing.assert_array_equal(scale.view(np.uint16), scales[name].view(np.uint16))
            codes = unpack_codes(packed, 4 if qtype == "Q4_0" else 8, symmetric=True)
            rows = np.repeat(np.arange(w.shape[1] // 32), 32)
            np.testing.assert_array_equal(codes * scales[name][:, rows].astype(np.float32), w)  # the file's codes
            assert f"{name}.zp" not in chip.tensor_names()
            continue
        bits = 4 if qtype in W4 else 8
        codes, zero, want = numpy_rtn(w, bits, np.float16)
        np.testing.assert_array_equal(scale.view(np.uint16), want.view(np.uint16))
        np.testing.assert_array_equal(np.asarray(chip.tensor(f"{name}.zp")), zero)
        np.testing.assert_array_equal(unpack_codes(packed, bits, symmetric=False), codes)
    host = _bundle(path, tmp_path / "host.topq", "host", act_dtype="f16")
    a, b = Session(chip).feed(IDS, all_logits=True), Session(host).feed(IDS, all_logits=True)
    cos = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
    assert cos >= 0.999, cos


def test_auto_gguf_bits_sets_the_requantized_width(gguf_model: tuple[Path, dict], tmp_path: Path) -> None:
    """quant.bits 8 requantizes every inexact type at 8 bits (Q4_1 too); the exact ones keep their codes; a width
    auto cannot store is refused before the checkpoint is read."""
    import ml_dtypes

    from topq.core.errors import TopqError

    path, reference = gguf_model
    bundle = _bundle(path, tmp_path / "w8.topq", "host", bits=8)
    rows = {row["name"]: row for row in bundle.meta["quant_report"]}
    for name, (qtype, w) in reference.items():
        assert rows[name]["bits"] == (4 if qtype == "Q4_0" else 8)
        if qtype == "Q4_1":
            np.testing.assert_array_equal(np.asarray(bundle.tensor(name)), requant_expected(w, 8, ml_dtypes.bfloat16))
            assert rows[name]["error"] < 0.01
    with pytest.raises(TopqError, match="quant.bits 3: scheme auto requantizes to 4 or 8 bits"):
        _bundle(path, tmp_path / "w3.topq", "host", bits=3)
    assert not (tmp_path / "w3.topq").exists()
