"""Issue 12's dense families on the bm1684x emulator against the host bundle of the same scheme: sliding windows
(all three stages), attention and final soft-capping (`tpu.Tanh`), per-layer RoPE tables, MLP biases, fused
checkpoint tensors and LongRoPE."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from host_bundles import TinyCheckpoint
from test_bm1684x import function_cosines, recipe

from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.pipeline import convert
from topq.ir.parser import parse_module
from topq.plugins.exporters.tpu_mlir.translate import translate_function

KINDS = ["mistral_window", "qwen2_window", "llama_bias", "gemma2", "gemma3", "phi3"]
SCHEMES = [("bf16", {}, 0.9999), ("w4bf16", {"group_size": 32}, 0.99)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> dict[str, Path]:
    out = {}
    for kind in KINDS:
        out[kind] = tmp_path_factory.mktemp(f"bm_dense_{kind}")
        tiny_checkpoint(kind, out[kind])
    return out


@pytest.mark.parametrize(("scheme", "quant", "threshold"), SCHEMES, ids=[s for s, _, _ in SCHEMES])
@pytest.mark.parametrize("kind", KINDS)
def test_every_function_matches_host(checkpoints: dict[str, Path], tmp_path: Path, kind: str, scheme: str,
                                     quant: dict[str, Any], threshold: float) -> None:
    bundles = {}
    for chip in ("host", "bm1684x"):
        convert(recipe(checkpoints[kind], chip, scheme, tmp_path / f"{chip}.topq", **quant), progress=False)
        bundles[chip] = Bundle(tmp_path / f"{chip}.topq")
    cos = function_cosines(bundles["bm1684x"], bundles["host"])
    assert min(cos.values()) >= threshold, cos
    program = bundles["bm1684x"].program
    if kind in ("mistral_window", "qwen2_window", "gemma2", "gemma3"):
        assert "window = 6" in program  # the lowered attention carries the window
    if kind == "gemma2":
        assert "tpu.Tanh" in program and "softcap = 5.0" in program


def test_tpu_mlir_export_refuses_attention_options_by_name(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """TPU-MLIR's attention has no soft-capping or window: the export names the option instead of dropping it."""
    convert(recipe(checkpoints["gemma2"], "host", "f32", tmp_path / "g.topq"), progress=False)
    module = parse_module(Bundle(tmp_path / "g.topq").program)
    functions = {f.name: f for f in module}
    with pytest.raises(TopqError, match=r"function block_0: top.FAttention softcap=5.0 has no TPU-MLIR mapping"):
        translate_function(functions["block_0"], lambda name: None)
