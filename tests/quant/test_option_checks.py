"""Recipe options against the scheme and target, before any work (issue 16): an option the chosen scheme does not
read is named in a warning; what the target cannot store (act-order groups on bm1684x) is refused before
calibration."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from host_bundles import TINY_STAGES, TinyHost

from topq.core.errors import TopqError
from topq.core.pipeline import convert
from topq.core.recipe import recipe_from_defaults

TinyFactory = Callable[..., TinyHost]


def recipe(checkpoint: Path, out: Path, chip: str, **quant: object) -> object:
    return recipe_from_defaults(model={"path": str(checkpoint)}, quant=quant, target={"chip": chip},
                                stages=TINY_STAGES, output={"path": str(out)})


def test_act_order_on_bm1684x_is_refused_before_calibration(tiny_host: TinyFactory, tmp_path: Path) -> None:
    checkpoint = tiny_host("llama").checkpoint
    missing = {"data": str(tmp_path / "no-such-calibration.txt"), "samples": 2, "seq_len": 16}
    with pytest.raises(TopqError, match=r"^target bm1684x cannot run act-order \(permuted g_idx\) groups"):
        convert(recipe(checkpoint, tmp_path / "x.topq", "bm1684x", scheme="gptq", act_order=True,
                       calibration=missing), progress=False)
    assert not (tmp_path / "x.topq").exists()


@pytest.mark.parametrize(("quant", "warned"), [
    ({"scheme": "w4bf16", "group_size": 32, "act_order": True}, ["quant.act_order = True"]),
    ({"scheme": "w4bf16", "group_size": 32, "observer": "kl", "iters": 5},
     ["quant.observer = 'kl'", "quant.iters = 5"]),
    ({"scheme": "w4bf16", "group_size": 32}, []),
    ({"scheme": "f32"}, []),
])
def test_options_the_scheme_does_not_read_are_named(capsys: pytest.CaptureFixture[str], tiny_host: TinyFactory,
                                                    tmp_path: Path, quant: dict[str, object],
                                                    warned: list[str]) -> None:
    capsys.readouterr()
    convert(recipe(tiny_host("llama").checkpoint, tmp_path / "x.topq", "host", **quant), progress=False)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == len(warned)
    for line, fragment in zip(warnings, warned):
        assert fragment in line and f"does not apply to scheme {quant['scheme']}" in line, line
