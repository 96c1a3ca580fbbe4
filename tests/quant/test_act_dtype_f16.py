"""`quant.act_dtype: f16` reaches the targets: GPTQ / AWQ / AutoRound give an f16 host bundle and a W4F16 bm1684x
bundle (the chip computes what the host computes); the default stays bf16."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from host_bundles import TinyCheckpoint

from topq.core.bundle import Bundle
from topq.core.pipeline import convert
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session

IDS = [1, 5, 9, 77, 120, 3, 44, 200]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> Path:
    d = tmp_path_factory.mktemp("act_dtype")
    tiny_checkpoint("llama", d)
    (d / "calib.ids").write_text(" ".join(map(str, np.random.default_rng(0).integers(3, 250, 400))))
    return d


def bundle(d: Path, scheme: str, chip: str, **quant: Any) -> Bundle:
    out = d / f"{scheme}_{chip}_{'_'.join(f'{k}{v}' for k, v in quant.items())}.topq"
    recipe = recipe_from_defaults(
        model={"path": str(d)}, target={"chip": chip}, output={"path": str(out)}, stages={"seq_length": 64,
                                                                                          "max_input_length": 16},
        quant={"scheme": scheme, "group_size": 32, "iters": 5, **quant,
               "calibration": {"data": str(d / "calib.ids"), "samples": 2, "seq_len": 16}})
    convert(recipe, progress=False)
    return Bundle(out)


def representable(array: np.ndarray, dtype: Any) -> bool:
    a = np.asarray(array, np.float32)
    return bool(np.array_equal(a.astype(dtype).astype(np.float32), a))


@pytest.mark.parametrize("scheme", ["gptq", "awq", "autoround"])
def test_f16_activations_give_an_f16_host_bundle_and_a_w4f16_chip_bundle(tiny: Path, scheme: str) -> None:
    host = bundle(tiny, scheme, "host", act_dtype="f16")
    # Float tensors are stored after rounding to f16 (the compute dtype), and f16 is not bf16 in disguise; the
    # quantized linears are their exact dequantization (integers times f16 scales, docs/quantization.md).
    quantized = {row["name"] for row in host.meta["quant_report"]}
    names = [n for n in host.tensor_names() if n not in quantized]
    assert quantized and names
    assert all(representable(host.tensor(n), np.float16) for n in names)
    assert not all(representable(host.tensor(n), ml_dtypes.bfloat16) for n in names)

    chip = bundle(tiny, scheme, "bm1684x", act_dtype="f16")
    meta = chip.meta["target_meta"]
    assert (meta["mode"], meta["dtype"]) == (scheme, "f16")
    assert 'dtype = "f16"' in chip.program and "bf16" not in chip.program
    weight = "model.layers.0.mlp.down_proj.weight"
    assert np.asarray(chip.tensor(f"{weight}.packed")).shape[1] == 128 // 2  # W4: two codes a byte
    assert np.asarray(chip.tensor(f"{weight}.scale")).dtype == np.float16
    a, b = Session(host).feed(IDS, all_logits=True), Session(chip).feed(IDS, all_logits=True)
    assert float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.999


def test_default_act_dtype_stays_bf16(tiny: Path) -> None:
    host = bundle(tiny, "gptq", "host")
    quantized = {row["name"] for row in host.meta["quant_report"]}
    assert all(representable(host.tensor(n), ml_dtypes.bfloat16) for n in host.tensor_names() if n not in quantized)
    chip = bundle(tiny, "gptq", "bm1684x")
    assert chip.meta["target_meta"]["dtype"] == "bf16" and 'dtype = "f16"' not in chip.program
    assert np.asarray(chip.tensor("model.layers.0.mlp.down_proj.weight.scale")).dtype == ml_dtypes.bfloat16
