"""Hooks are typed: implementations annotate `register: Register[T]` (no `type: ignore`), the registries are typed
by kind, and what inspect asks of a target is declared on Target."""

from __future__ import annotations

import re
from pathlib import Path

import topq
from topq.core.hookspecs import Register
from topq.core.plugins import build_plugins, get_plugins
from topq.core.quant import QuantScheme
from topq.core.target import Target

ROOT = Path(__file__).resolve().parents[2]


def test_a_typed_hook_implementation_registers() -> None:
    class Plugin:
        @topq.hookimpl
        def register_quant_schemes(self, register: Register[QuantScheme]) -> None:
            register(QuantScheme("typed-f16", "a test scheme", compute_dtype="f16"))

    plugins = build_plugins(extra=(Plugin(),))
    scheme = plugins.schemes.get("typed-f16")
    assert isinstance(scheme, QuantScheme) and scheme.compute_dtype == "f16"


def test_no_hook_implementation_needs_a_type_ignore() -> None:
    hook = re.compile(r"^def register_\w+\((.*)\) -> None:(.*)$", re.M)
    found = 0
    for path in [*ROOT.glob("topq/plugins/**/*.py"), *ROOT.glob("examples/**/*.py")]:
        for params, rest in hook.findall(path.read_text(encoding="utf-8")):
            found += 1
            assert params.startswith("register: Register["), f"{path}: untyped register ({params})"
            assert "type: ignore" not in rest, f"{path}: {rest.strip()}"
    assert found >= 14  # every built-in plugin and the example's two


def test_inspect_reports_come_from_a_declared_target_field() -> None:
    targets = get_plugins().targets
    assert "report" in Target.__dataclass_fields__
    assert targets.get("host").report is None
    assert callable(targets.get("bm1684x").report)
