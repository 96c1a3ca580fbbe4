"""TPU-MLIR's own LLM converter, `llm_convert.py`, against topq's `export tpu-mlir` of the same model.

* Pre-quantized: `topq export gptq` of a topq GPTQ bundle is a Hugging Face GPTQ checkpoint that llm_convert.py
  compiles (`-q w4bf16`, TPU-MLIR unpacks the codes itself); on TPU-MLIR's simulator its layer-0 prefill and
  decode nets give outputs bit-identical to topq's pre-quantized export of the bundle, and within the issue's
  bound of topq's bm1684x emulator.
* Float: the float checkpoint through `llm_convert.py -q bf16` and topq's BF16 bundle through the float route
  give bit-identical outputs too.

The model has two layers because llm_convert.py folds the final norm into the last block (its last block's hidden
output differs from topq's by design); layer 0 is compared. llm_convert.py imports torch: scripts/test.sh sets
the venv up with it (TOPQ_TPU_MLIR_LLM_CONVERT=1), and so does this file's fixture for a venv without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tpu_mlir_nets import OUTPUTS, STAGES, block_inputs, cosine, tpu_mlir_installation, write_recipe

from topq.core.bundle import Bundle
from topq.core.cli import main
from topq.core.pipeline import convert
from topq.core.plugins import get_plugins
from topq.core.recipe import load_recipe
from topq.plugins.exporters.tpu_mlir.deploy import TpuMlir, run_bmodel, run_tool

NETS = ("block_0", "block_cache_0")


@pytest.fixture(scope="module")
def tpu_mlir() -> TpuMlir:
    return tpu_mlir_installation(llm_convert=True)


def llm_convert(tpu: TpuMlir, checkpoint: Path, out: Path, quantize: str, group_size: int) -> Path:
    """TPU-MLIR's whole conversion of `checkpoint` at topq's stage lengths; the directory holding its nets."""
    out.mkdir(parents=True)
    run_tool(tpu, "llm_convert.py", ["-m", str(checkpoint), "-s", str(STAGES["seq_length"]),
                                     "--max_input_length", str(STAGES["max_input_length"]), "-q", quantize,
                                     "-g", str(group_size), "-c", "bm1684x", "-o", str(out)], out, "llm_convert.log")
    (nets,) = out.glob("*_static")
    return nets


@pytest.mark.parametrize(("scheme", "quant", "route", "llm_quantize"), [
    ("gptq", {"group_size": 32, "symmetric": False, "calibration": {"samples": 4, "seq_len": 32}}, "prequantized",
     "w4bf16"),
    ("bf16", {}, "float", "bf16"),
])
def test_llm_convert_nets_equal_topq_export(tpu_mlir: TpuMlir, tmp_path: Path, scheme: str, quant: dict[str, Any],
                                            route: str, llm_quantize: str) -> None:
    import torch
    from tiny_models import build_tiny

    # two layers; llm_convert.py takes a float checkpoint only as bf16/f16 (as published), GPTQ's other tensors in f32
    dtype = torch.float32 if route == "prequantized" else torch.bfloat16
    model = build_tiny("qwen2", tmp_path / "model", dtype=dtype)
    if "calibration" in quant:
        ids = np.random.default_rng(0).integers(3, 250, 400)
        (tmp_path / "calib.ids").write_text(" ".join(map(str, ids)), encoding="utf-8")
        quant = {**quant, "calibration": {**quant["calibration"], "data": str(tmp_path / "calib.ids")}}
    convert(load_recipe(write_recipe(tmp_path, tmp_path / "model", scheme=scheme, quant=quant)), progress=False)
    bundle = Bundle(tmp_path / f"{scheme}.topq")
    topq_out = tmp_path / "topq"
    assert main(["export", "tpu-mlir", str(bundle.path), str(topq_out), "--tpu-mlir", str(tpu_mlir.python),
                 "--option", f"nets={','.join(NETS)}", "--option", "combine=false", "--option", f"route={route}",
                 "--jobs", "2", "--json"]) == 0
    if route == "prequantized":
        checkpoint = tmp_path / "hf_gptq"
        assert main(["export", "gptq", str(bundle.path), str(checkpoint), "--json"]) == 0
    else:
        checkpoint = tmp_path / "model"
    theirs_dir = llm_convert(tpu_mlir, checkpoint, tmp_path / "llm_convert", llm_quantize,
                             quant.get("group_size", 64))

    emulator = get_plugins().targets.get("bm1684x").open(bundle)
    config = model.config
    feeds = block_inputs(config.num_key_value_heads, config.hidden_size // config.num_attention_heads)
    for net in NETS:
        emu_inputs, tpu_inputs = feeds[net]
        ours = run_bmodel(tpu_mlir, topq_out / net / f"{net}.bmodel", tpu_inputs, tmp_path / "run_topq" / net)
        theirs = run_bmodel(tpu_mlir, theirs_dir / net / f"{net}.bmodel", tpu_inputs, tmp_path / "run_llmc" / net)
        for name, want in zip(OUTPUTS, emulator.run(net, emu_inputs)):
            assert theirs[name].shape == ours[name].shape == np.asarray(want).shape, (net, name)
            assert np.array_equal(theirs[name], ours[name]), f"{scheme} {net}.{name}: llm_convert differs from topq"
            similarity = cosine(theirs[name], np.asarray(want, np.float32))
            assert similarity >= (0.999 if route == "prequantized" else 0.9999), (net, name, similarity)
