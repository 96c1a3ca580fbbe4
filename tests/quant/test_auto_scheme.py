"""`quant.scheme: auto`: a pre-quantized checkpoint's own integers, repacked for the target without requantizing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from host_bundles import TinyCheckpoint
from quantized_writers import GROUP, write_quantized_llama

from topq.core.bundle import Bundle
from topq.core.cli import main
from topq.core.pipeline import convert
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session
from topq.plugins.targets.bm1684x.packing import dequantize as chip_dequantize

IDS = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 200]


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> Path:
    d = tmp_path_factory.mktemp("auto_float")
    tiny_checkpoint("llama", d)
    return d


def _bundle(checkpoint: Path, out: Path, chip: str, scheme: str = "auto") -> Bundle:
    recipe = recipe_from_defaults(model={"path": str(checkpoint)}, quant={"scheme": scheme}, target={"chip": chip},
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


def test_auto_warns_about_dequantized_gguf_types(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from smol_model import smol_path

    recipe = recipe_from_defaults(model={"path": str(smol_path())}, quant={"scheme": "auto"},
                                  target={"chip": "host"}, stages={"seq_length": 32, "max_input_length": 8},
                                  output={"path": str(tmp_path / "s.topq")})
    from topq.core.pipeline import prepare

    prepare(recipe)
    err = capsys.readouterr().err
    assert "warning:" in err and "Q4_1" in err


