"""Hybrid families and the checkpoints they meet: Qwen3.5's published multimodal layout (its text model is
converted, said in one line), and what they refuse in one error line (a layer type the family does not know,
Qwen3-Next sparse layers without expert weights or with bad MoE fields)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from host_bundles import TINY_STAGES, TinyHost
from tiny_models import build_tiny_qwen3_5_multimodal, prompt

from topq.core import cli
from topq.core.bundle import Bundle
from topq.core.runtime import Session

TinyFactory = Callable[..., TinyHost]


def write_recipe(directory: Path, model: Path, output: Path) -> Path:
    recipe = directory / "recipe.yaml"
    recipe.write_text(f"model: {{path: {json.dumps(str(model))}}}\ntarget: {{chip: host}}\n"
                      f"stages: {json.dumps(TINY_STAGES)}\noutput: {{path: {json.dumps(str(output))}}}\n")
    return recipe


def convert(capsys: pytest.CaptureFixture[str], directory: Path, model: Path) -> tuple[int, str, Path]:
    output = directory / "out.topq"
    capsys.readouterr()
    code = cli.main(["convert", str(write_recipe(directory, model, output)), "--no-cache"])
    return code, capsys.readouterr().err, output


def edited_copy(tiny_host: TinyFactory, kind: str, directory: Path, **changes: object) -> Path:
    copy = Path(shutil.copytree(tiny_host(kind).checkpoint, directory / "ck", ignore=shutil.ignore_patterns("*.topq")))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **changes}))
    return copy


def assert_one_error(code: int, err: str, output: Path, *fragments: str) -> None:
    assert code != 0
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert not output.exists()


def test_multimodal_checkpoint_converts_its_text_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = build_tiny_qwen3_5_multimodal(tmp_path / "ck")
    code, err, output = convert(capsys, tmp_path, tmp_path / "ck")
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "vision tower" in notes[0] and "text model" in notes[0], err
    bundle = Bundle(output)
    assert not any("visual" in name for name in bundle.tensor_names())
    ids = prompt(20, seed=8)
    got = Session(bundle).feed(ids, all_logits=True)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert float(np.abs(got - ref).max()) <= 1e-4


def test_unknown_layer_type_is_refused_naming_it(tiny_host: TinyFactory, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    ck = edited_copy(tiny_host, "qwen3_5", tmp_path, layer_types=["linear_attention", "sliding_attention"])
    code, err, output = convert(capsys, tmp_path, ck)
    assert_one_error(code, err, output, "layer 1", "'sliding_attention'", "linear_attention")


def test_sparse_layers_without_expert_weights_are_refused_naming_the_tensor(
        tiny_host: TinyFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dense checkpoint whose config makes layer 1 sparse: the router it would read is named, nothing written."""
    ck = edited_copy(tiny_host, "qwen3_next", tmp_path, mlp_only_layers=[0], num_experts=4, num_experts_per_tok=2,
                     decoder_sparse_step=1)
    code, err, output = convert(capsys, tmp_path, ck)
    assert_one_error(code, err, output, "model.layers.1.mlp.gate.weight")


@pytest.mark.parametrize("changes, message", [
    ({"num_experts_per_tok": 5}, "5 experts per token but only 4 experts"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be a positive integer"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers='1' must be a list"),
])
def test_bad_moe_fields_are_refused(tiny_host: TinyFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    changes: dict[str, object], message: str) -> None:
    code, err, output = convert(capsys, tmp_path, edited_copy(tiny_host, "qwen3_next_moe", tmp_path, **changes))
    assert_one_error(code, err, output, message)


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("attention_bias", True),
                                          ("attn_output_gate", False), ("mamba_ssm_dtype", "bfloat16"),
                                          ("linear_conv_kernel_dim", 1)])
def test_config_fields_the_family_does_not_compute_are_refused(tiny_host: TinyFactory, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str], field: str,
                                                               value: object) -> None:
    ck = edited_copy(tiny_host, "qwen3_5", tmp_path, **{field: value})
    code, err, output = convert(capsys, tmp_path, ck)
    assert_one_error(code, err, output, field)
