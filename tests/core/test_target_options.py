"""Target options (`Target.options`, recipe keys `target.<name>`): merged when plugins load, typed by the recipe
schema, listed by `topq plugins`. (The onnx target's `accuracy_level` end to end: tests/targets/onnx.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

import topq
from topq.core import cli
from topq.core.errors import TopqError
from topq.core.plugins import build_plugins
from topq.core.quant import Option
from topq.core.recipe import iter_fields
from topq.core.target import Target
from topq.io.schema import Field


def target_plugin(*options: Option, name: str = "optchip") -> Any:
    class Plugin:
        @topq.hookimpl
        def register_targets(self, register: Any) -> None:
            register(Target(name, "a target with options", compile=lambda job: None,  # type: ignore[arg-type,return-value]
                            open=lambda bundle: None, options=options))  # type: ignore[arg-type,return-value]

    return Plugin()


def test_a_target_option_named_like_a_core_key_or_declared_twice_differently_is_refused() -> None:
    with pytest.raises(TopqError, match="target 'optchip': option 'chip' is a core target key"):
        build_plugins(extra=(target_plugin(Option("chip", Field("str", "x", help="clash"))),))
    other = Option("accuracy_level", Field("int", 1, help="another declaration"))
    differently = "targets '(optchip|onnx)' and '(onnx|optchip)' declare option 'accuracy_level' differently"
    with pytest.raises(TopqError, match=differently):
        build_plugins(extra=(target_plugin(other),))
    shared = build_plugins(extra=(target_plugin(Option("tiles", Field("int", 2, ge=1, help="tiles")), name="a"),
                                  target_plugin(Option("tiles", Field("int", 2, ge=1, help="tiles")), name="b")))
    assert sorted(o.name for o in shared.target_options) == ["accuracy_level", "attention", "tiles"]


def test_the_recipe_schema_and_topq_plugins_carry_them(capsys: pytest.CaptureFixture[str]) -> None:
    fields = dict(iter_fields())
    assert fields["target.accuracy_level"] == Field("int", 0, help=fields["target.accuracy_level"].help, ge=0, le=4)
    assert cli.main(["plugins", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["target_options"]
    assert [o["name"] for o in listed["onnx"]] == ["accuracy_level", "attention"] and listed["host"] == []
