"""Build-cache and output faults (issue 16): a damaged cached unit is never copied into a bundle, and an output on
another file system than the cache (tmpfs) is written by a plain copy."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from host_bundles import TINY_STAGES, TinyHost

from topq.core import cli

TinyFactory = Callable[..., TinyHost]


def convert(capsys: pytest.CaptureFixture[str], recipe: Path, cache: Path, output: Path) -> str:
    capsys.readouterr()
    code = cli.main(["convert", str(recipe), "--cache-dir", str(cache), "--set", f"output.path={output}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return err


@pytest.fixture
def recipe(tiny_host: TinyFactory, tmp_path: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    model = json.dumps(str(tiny_host("llama").checkpoint))
    path.write_text(f"model: {{path: {model}}}\nquant: {{scheme: w4bf16, group_size: 32}}\ntarget: {{chip: bm1684x}}\n"
                    f"stages: {json.dumps(TINY_STAGES)}\noutput: {{path: out.topq}}\n")
    return path


def units(cache: Path) -> list[Path]:
    return sorted((cache / "units").glob("*.safetensors"))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_unit_is_rebuilt(capsys: pytest.CaptureFixture[str], recipe: Path, tmp_path: Path,
                                 damage: str) -> None:
    cache = tmp_path / "cache"
    first = tmp_path / "first.topq"
    convert(capsys, recipe, cache, first)
    victim = units(cache)[-1]
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x40  # inside the last tensor
    else:
        del data[len(data) // 2:]
    victim.write_bytes(bytes(data))
    again = tmp_path / "again.topq"
    err = convert(capsys, recipe, cache, again)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and victim.name in warnings[0] and "rebuilding" in warnings[0], err
    assert again.read_bytes() == first.read_bytes()
    third = tmp_path / "third.topq"  # the rebuilt unit is sound: no warning any more
    assert "warning:" not in convert(capsys, recipe, cache, third)
    assert third.read_bytes() == first.read_bytes()


def test_output_on_another_file_system(capsys: pytest.CaptureFixture[str], recipe: Path, tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    assert shm.is_dir() and shm.stat().st_dev != tmp_path.stat().st_dev  # the case under test
    cache = tmp_path / "cache"
    local = tmp_path / "local.topq"
    convert(capsys, recipe, cache, local)  # builds the units
    with tempfile.TemporaryDirectory(dir=shm) as directory:
        remote = Path(directory) / "model.topq"
        convert(capsys, recipe, cache, remote)  # every unit reused: copied from the disk cache to the tmpfs
        assert remote.read_bytes() == local.read_bytes()
        assert sorted(p.name for p in Path(directory).iterdir()) == ["model.topq"]  # no temp file left
