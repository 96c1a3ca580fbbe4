"""A recipe's `kernels:` entries import only topq's modules, installed plugins' and modules the user names on the
command line (issue 16): a recipe alone cannot make topq import code."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from host_bundles import TINY_STAGES, TinyHost

from topq.core import cli

TinyFactory = Callable[..., TinyHost]


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module on sys.path that leaves a marker file when imported and offers a real kernel."""
    marker = tmp_path / "imported"
    (tmp_path / "my_user_kernels.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\nfrom topq.raw.library import silu  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TOPQ_KERNEL_MODULES", raising=False)
    return marker


def convert(capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path, ref: str,
            *extra: str) -> tuple[int, str]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{path: {json.dumps(str(checkpoint))}}}\nstages: {json.dumps(TINY_STAGES)}\n"
                      f"output: {{path: {json.dumps(str(tmp_path / 'out.topq'))}}}\n"
                      f"kernels: [{{replace: top.SiLU, with: {json.dumps(ref)}}}]\n")
    capsys.readouterr()
    code = cli.main(["convert", str(recipe), "--no-cache", *extra])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("ref", ["my_user_kernels:silu", "this:silu"])
def test_recipe_cannot_import_a_module_of_its_own_choosing(capsys: pytest.CaptureFixture[str],
                                                          tiny_host: TinyFactory, tmp_path: Path, user_module: Path,
                                                          ref: str) -> None:
    code, err = convert(capsys, tiny_host("llama").checkpoint, tmp_path, ref)
    assert code != 0 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "is not part of topq or of an installed topq plugin" in err and "--kernel-module" in err
    assert not user_module.exists()  # never imported
    assert not (tmp_path / "out.topq").exists()


def test_a_module_named_on_the_command_line_is_allowed(capsys: pytest.CaptureFixture[str], tiny_host: TinyFactory,
                                                       tmp_path: Path, user_module: Path) -> None:
    code, err = convert(capsys, tiny_host("llama").checkpoint, tmp_path, "my_user_kernels:silu",
                        "--kernel-module", "my_user_kernels")
    assert code == 0, err
    assert user_module.exists() and (tmp_path / "out.topq").exists()


def test_topq_and_plugin_kernels_need_no_permission(capsys: pytest.CaptureFixture[str], tiny_host: TinyFactory,
                                                    tmp_path: Path, user_module: Path) -> None:
    code, err = convert(capsys, tiny_host("llama").checkpoint, tmp_path, "topq.raw.library:silu")
    assert code == 0, err
