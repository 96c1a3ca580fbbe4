"""The command line on bad input (one `error:` line, non-zero exit, no traceback, output untouched) and on the
happy paths (`--json` documents, `--logits-out` arrays), driven through `topq.core.cli.main`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from data_paths import AUSTEN
from host_bundles import TINY_STAGES, TinyHost
from smol_model import reference_perplexity, smol_path

from topq.core import cli
from topq.core.bundle import Bundle
from topq.io.safetensors import SafetensorsFile, write_safetensors

TinyFactory = Callable[..., TinyHost]
OLD_OUTPUT = b"a previous bundle that a failed convert must not touch"


def call(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()} if directory.exists() else {}


def assert_error(capsys: pytest.CaptureFixture[str], argv: list[Any], *fragments: str,
                 output: Path | None = None) -> str:
    """Run the CLI expecting a failure: exit ≠ 0, nothing on stdout, exactly one `error:` line on stderr that
    contains every fragment, and `output`'s directory exactly as it was (no new file, no temp file left)."""
    before = snapshot(output.parent) if output is not None else {}
    code, out, err = call(capsys, *argv)
    assert code != 0, out
    assert out == ""
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    if output is not None:
        assert snapshot(output.parent) == before
    return err


def write_recipe(directory: Path, model: Path | str, output: Path, text: str = "") -> Path:
    recipe = directory / "recipe.yaml"
    stages = json.dumps(TINY_STAGES)
    recipe.write_text(f"model: {{path: {json.dumps(str(model))}}}\ntarget: {{chip: host}}\nstages: {stages}\n"
                      f"output: {{path: {json.dumps(str(output))}}}\n{text}")
    return recipe


@pytest.fixture
def checkpoint(tiny_host: TinyFactory, tmp_path: Path) -> Path:
    """A private copy of the tiny llama checkpoint, free to damage."""
    return Path(shutil.copytree(tiny_host("llama").checkpoint, tmp_path / "ck",
                                ignore=shutil.ignore_patterns("*.topq")))


@pytest.fixture
def output(tmp_path: Path) -> Path:
    out = tmp_path / "out" / "model.topq"
    out.parent.mkdir()
    out.write_bytes(OLD_OUTPUT)
    return out


# --------------------------------------------------------------------------------------------- convert: bad checkpoints


def edit_tensors(checkpoint: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    path = checkpoint / "model.safetensors"
    source = SafetensorsFile(path)
    tensors = {name: np.array(source.get_raw(name)) for name in source.names()}
    metadata = dict(source.metadata)
    del source
    edit(tensors)
    write_safetensors(path, tensors, metadata)


def test_missing_config(capsys: pytest.CaptureFixture[str], checkpoint: Path, output: Path, tmp_path: Path) -> None:
    (checkpoint / "config.json").unlink()
    assert_error(capsys, ["convert", write_recipe(tmp_path, checkpoint, output)], "config.json", output=output)


def test_missing_tensor(capsys: pytest.CaptureFixture[str], checkpoint: Path, output: Path, tmp_path: Path) -> None:
    edit_tensors(checkpoint, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    assert_error(capsys, ["convert", write_recipe(tmp_path, checkpoint, output)],
                 "model.layers.1.mlp.down_proj.weight", output=output)


def test_wrong_tensor_shape(capsys: pytest.CaptureFixture[str], checkpoint: Path, output: Path,
                            tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"

    def shrink(tensors: dict[str, np.ndarray]) -> None:
        tensors[name] = tensors[name][:, :48].copy()

    edit_tensors(checkpoint, shrink)
    assert_error(capsys, ["convert", write_recipe(tmp_path, checkpoint, output)], name, "[32, 48]", "[32, 64]",
                 output=output)


def test_unknown_architecture(capsys: pytest.CaptureFixture[str], checkpoint: Path, output: Path,
                              tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(architectures=["FrobnicatorForCausalLM"], model_type="frobnicator")
    (checkpoint / "config.json").write_text(json.dumps(config))
    err = assert_error(capsys, ["convert", write_recipe(tmp_path, checkpoint, output)], output=output)
    assert "FrobnicatorForCausalLM" in err and "known:" in err
    for known in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):  # it lists what is supported
        assert known in err


def test_truncated_safetensors(capsys: pytest.CaptureFixture[str], checkpoint: Path, output: Path,
                               tmp_path: Path) -> None:
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    assert_error(capsys, ["convert", write_recipe(tmp_path, checkpoint, output)], "model.safetensors",
                 output=output)


@pytest.mark.parametrize("corruption", ["garbage", "truncated"])
def test_corrupt_gguf(capsys: pytest.CaptureFixture[str], output: Path, tmp_path: Path, corruption: str) -> None:
    gguf = tmp_path / "broken.gguf"
    if corruption == "garbage":  # the right magic, then noise
        gguf.write_bytes(b"GGUF" + np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    else:  # a real header whose tensor data is cut off
        with smol_path().open("rb") as fh:
            gguf.write_bytes(fh.read(8 << 20))
    assert_error(capsys, ["convert", write_recipe(tmp_path, gguf, output)], "broken.gguf", output=output)


# --------------------------------------------------------------------------------------------- convert: bad recipes


def test_bad_recipe_key(capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path) -> None:
    output = tmp_path / "never.topq"
    recipe = write_recipe(tmp_path, checkpoint, output, "quant: {scheme: f32, grup_size: 64}\n")
    assert_error(capsys, ["convert", recipe], "quant.grup_size", "quant.group_size", output=output)
    assert not output.exists()


@pytest.mark.parametrize(("setting", "fragments"), [
    ("stages.seq_length=abc", ("stages.seq_length", "expected an integer")),
    ("stages.max_input_length=128", ("exceeds stages.seq_length",)),
    ("stages.seq_length", ("expected KEY=VALUE",)),
    ("stages.seq_lenght=64", ("unknown key stages.seq_lenght",)),
])
def test_bad_set_value(capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path, setting: str,
                       fragments: tuple[str, ...]) -> None:
    output = tmp_path / "never.topq"
    recipe = write_recipe(tmp_path, checkpoint, output)
    assert_error(capsys, ["convert", recipe, "--set", setting], *fragments, output=output)
    assert not output.exists()


@pytest.mark.parametrize(("setting", "fragments"), [
    ("quant.scheme=w3bf99", ("w3bf99", "known:", "f32", "bf16")),
    ("target.chip=tpu9000", ("tpu9000", "known:", "host")),
    ("model.family=gpt9", ("gpt9", "known:", "llama", "qwen3")),
])
def test_unknown_names_list_known_ones(capsys: pytest.CaptureFixture[str], checkpoint: Path, output: Path,
                                       tmp_path: Path, setting: str, fragments: tuple[str, ...]) -> None:
    recipe = write_recipe(tmp_path, checkpoint, output)
    assert_error(capsys, ["convert", recipe, "--set", setting], *fragments, output=output)


# --------------------------------------------------------------------------------------------- bad bundles and prompts


@pytest.fixture
def damaged_bundle(tiny_host: TinyFactory, tmp_path: Path) -> Path:
    data = bytearray(tiny_host("llama").bundle.path.read_bytes())
    data[-7] ^= 0x01  # inside the last tensor's bytes
    path = tmp_path / "damaged.topq"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("command", ["run", "eval", "inspect"])
def test_damaged_bundle(capsys: pytest.CaptureFixture[str], damaged_bundle: Path, tmp_path: Path,
                        command: str) -> None:
    logits = tmp_path / "logits" / "x.npy"
    logits.parent.mkdir()
    text = tmp_path / "text.txt"
    text.write_text("hello there")
    extra = {"run": ["--prompt-ids", "5,6,7", "--logits-out", logits], "eval": ["--text", text],
             "inspect": []}[command]
    assert_error(capsys, [command, damaged_bundle, *extra], "damaged bundle", "damaged.topq", output=logits)


def test_prompt_longer_than_seq_length(capsys: pytest.CaptureFixture[str], tiny_host: TinyFactory,
                                       tmp_path: Path) -> None:
    bundle = tiny_host("llama", prefill_kv=False).bundle
    logits = tmp_path / "logits.npy"
    ids = ",".join(str(3 + i % 250) for i in range(70))
    assert_error(capsys, ["run", bundle.path, "--prompt-ids", ids, "--logits-out", logits],
                 "70 tokens", "seq_length 64", output=logits)
    assert not logits.exists()


@pytest.mark.parametrize(("args", "fragment"), [
    (["--prompt-ids", "5,x,7"], "comma-separated integers"),
    (["--prompt-ids", "5,256"], "[0, 256)"),
    (["--prompt-ids", "5", "--prompt", "hi"], "exactly one of --prompt and --prompt-ids"),
    (["--prompt", "hello"], "no tokenizer"),
    (["--prompt-ids", "5", "--top-p", "0"], "--top-p"),
])
def test_bad_run_arguments(capsys: pytest.CaptureFixture[str], tiny_host: TinyFactory, tmp_path: Path,
                           args: list[str], fragment: str) -> None:
    logits = tmp_path / "logits.npy"
    assert_error(capsys, ["run", tiny_host("llama").bundle.path, *args, "--logits-out", logits], fragment,
                 output=logits)


def test_missing_bundle_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert_error(capsys, ["inspect", tmp_path / "nope.topq"], "nope.topq")


# --------------------------------------------------------------------------------------------- ir check

GOOD_IR = """\
module {
  func.func @f(%arg0: tensor<1x4x8xf32>, %arg1: tensor<1x4x8xf32>) -> tensor<1x4x8xf32> {
    %0 = "top.Add"(%arg0, %arg1) : (tensor<1x4x8xf32>, tensor<1x4x8xf32>) -> tensor<1x4x8xf32>
    %1 = "top.SiLU"(%0) : (tensor<1x4x8xf32>) -> tensor<1x4x8xf32>
    return %1 : tensor<1x4x8xf32>
  }
}
"""

BAD_IR = {  # name -> (the program with one defect, a fragment of the error)
    "malformed": (GOOD_IR.replace('"top.SiLU"(%0)', '"top.SiLU"(%0,)'), "good.mlir:4:"),
    "unknown_op": (GOOD_IR.replace("top.SiLU", "top.Silly"), "unknown op"),
    "operand_count": (GOOD_IR.replace('"top.Add"(%arg0, %arg1) : (tensor<1x4x8xf32>, tensor<1x4x8xf32>)',
                                      '"top.Add"(%arg0) : (tensor<1x4x8xf32>)'), "expected 2 operands, got 1"),
    # top.Add's declared result (and everything downstream) is 1x8x4: consistent text, wrong shape inference
    "shape_mismatch": (GOOD_IR.replace("-> tensor<1x4x8xf32>", "-> tensor<1x8x4xf32>")
                       .replace("(%0) : (tensor<1x4x8xf32>)", "(%0) : (tensor<1x8x4xf32>)")
                       .replace("return %1 : tensor<1x4x8xf32>", "return %1 : tensor<1x8x4xf32>"),
                       "top.Add: result type (tensor<1x8x4xf32>) does not match the inferred (tensor<1x4x8xf32>)"),
}


def test_ir_check_prints_canonical_text(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    source = tmp_path / "good.mlir"
    source.write_text(GOOD_IR.replace("  ", " "))  # same program, different spacing
    code, out, err = call(capsys, "ir", "check", source)
    assert code == 0 and err == ""
    assert out == GOOD_IR


@pytest.mark.parametrize("case", list(BAD_IR))
def test_ir_check_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path, case: str) -> None:
    text, fragment = BAD_IR[case]
    assert text != GOOD_IR
    source = tmp_path / "good.mlir"
    source.write_text(text)
    assert_error(capsys, ["ir", "check", source], fragment, output=source)


# --------------------------------------------------------------------------------------------- happy paths


def test_convert_json(capsys: pytest.CaptureFixture[str], checkpoint: Path, output: Path, tmp_path: Path) -> None:
    code, out, err = call(capsys, "convert", write_recipe(tmp_path, checkpoint, output), "--json")
    assert code == 0, err
    summary = json.loads(out)  # exactly one JSON document
    assert summary["output"] == str(output) and summary["target"] == "host" and summary["family"] == "llama"
    layers = 2
    assert summary["functions"] == 2 + layers * (1 + 1 + 3) + 1  # embeddings, block/kv/3 decode per layer, lm_head
    assert output.read_bytes() != OLD_OUTPUT and summary["bytes"] == output.stat().st_size
    assert Bundle(output).meta["stages"]["decode_variants"] == [16, 32, 64]
    assert sorted(p.name for p in output.parent.iterdir()) == ["model.topq"]  # no temp files left behind


def reference_generation(model: Any, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return ref.sequences[0, len(ids):].tolist(), torch.cat(ref.logits).float().numpy()


def test_run_json_and_logits_out(capsys: pytest.CaptureFixture[str], tiny_host: TinyFactory,
                                 tmp_path: Path) -> None:
    case = tiny_host("qwen2")
    ids = [11, 42, 7, 99, 150, 3]
    tokens, ref_logits = reference_generation(case.model, ids, 6)
    logits = tmp_path / "sub" / "logits.npy"
    code, out, err = call(capsys, "run", case.bundle.path, "--prompt-ids", ",".join(map(str, ids)),
                          "--max-new-tokens", 6, "--greedy", "--json", "--logits-out", logits)
    assert code == 0, err
    result = json.loads(out)
    assert result["tokens"] == tokens
    assert result["prompt_tokens"] == len(ids)
    assert isinstance(result["host_tokens_per_s"], float) and result["host_tokens_per_s"] > 0
    saved = np.load(logits, allow_pickle=False)
    assert saved.dtype == np.float32 and saved.shape == (6, 256)
    assert np.abs(saved - ref_logits).max() <= 1e-4
    # without --json the tokens are printed (the bundle has no tokenizer)
    code, out, err = call(capsys, "run", case.bundle.path, "--prompt-ids", ",".join(map(str, ids)),
                          "--max-new-tokens", 6)
    assert code == 0, err
    assert out.split() == [str(t) for t in tokens]


def test_inspect_json(capsys: pytest.CaptureFixture[str], tiny_host: TinyFactory) -> None:
    bundle = tiny_host("qwen3").bundle
    code, out, err = call(capsys, "inspect", bundle.path, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["target"] == "host" and info["family"] == "qwen3"
    assert info["stages"] == {"seq_length": 64, "max_input_length": 16, "prefill_kv": True,
                              "decode_variants": [16, 32, 64]}
    functions = {f["name"]: f for f in info["functions"]}
    for layer in range(2):
        assert {f"block_{layer}", f"block_kv_{layer}", f"block_cache_{layer}", f"block_cache_{layer}_16",
                f"block_cache_{layer}_32"} <= set(functions)
    assert functions["block_cache_0_16"]["inputs"][2] == "tensor<1x1x1x17xf32>"
    assert functions["block_kv_0"]["inputs"][2] == "tensor<1x1x1x80xf32>"
    assert info["tensor_bytes"] == sum(bundle.tensor(n).nbytes for n in bundle.tensor_names())


def test_plugins_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = call(capsys, "plugins", "--json")
    assert code == 0, err
    registered: dict[str, set[str]] = {}
    for plugin in json.loads(out)["plugins"]:
        for kind, names in plugin["registered"].items():
            registered.setdefault(kind, set()).update(names)
    assert {"hf", "gguf"} <= registered["checkpoint format"]
    assert {"llama", "qwen2", "qwen3"} <= registered["model family"]
    assert "host" in registered["target"] and "f32" in registered["quant scheme"]


def test_eval_json(capsys: pytest.CaptureFixture[str], smol_bundle: Bundle, smol_torch: Any) -> None:
    text = AUSTEN / "03_Persuasion.txt"
    code, out, err = call(capsys, "eval", smol_bundle.path, "--text", text, "--max-tokens", 97, "--window", 48,
                          "--json")
    assert code == 0, err
    result = json.loads(out)
    ids = smol_bundle.tokenizer.encode(text.read_text(encoding="utf-8"))[:97]
    expected, count = reference_perplexity(smol_torch, ids, 48)
    assert result["tokens"] == count == 47 + 47  # windows [0, 48) and [48, 96); one token left predicts nothing
    assert result["perplexity"] == pytest.approx(expected, rel=1e-3)
    print(f"\neval --json: topq {result['perplexity']:.4f} transformers {expected:.4f} over {count} tokens")

