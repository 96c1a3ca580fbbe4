"""topq.ir is a leaf at run time too: importing all of it loads no other part of topq (nor pluggy, which only the
core's plugin system needs). import-linter (scripts/lint.sh) checks the import statements; this checks what
actually runs, including topq/__init__.py."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import topq.ir


def test_importing_every_ir_module_loads_nothing_else_of_topq() -> None:
    modules = sorted(f"topq.ir.{m.name}" for m in pkgutil.iter_modules(topq.ir.__path__))
    assert "topq.ir.interpreter" in modules and "topq.ir.parser" in modules
    script = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
              "print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                                       text=True).stdout)
    outside = [m for m in loaded if m.startswith("topq.") and not m.startswith("topq.ir")]
    assert outside == []
    assert "pluggy" not in loaded


def test_hookimpl_is_still_reachable_from_the_package() -> None:
    import topq
    from topq.core.hookspecs import hookimpl

    assert topq.hookimpl is hookimpl
    try:
        topq.no_such_name  # noqa: B018 - the lookup is the test
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("topq.no_such_name did not raise AttributeError")
