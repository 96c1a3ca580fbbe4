"""IR extensions through the plugin hook: raw kernels register their ops and host kernel, not import side effects."""

from __future__ import annotations

import subprocess
import sys

import pluggy
import pytest

from topq.core.errors import TopqError
from topq.core.plugins import BUILTIN_PLUGINS, Plugins, Registry, build_plugins
from topq.ir.catalogue import CATALOGUE
from topq.ir.interpreter import REGION_KERNELS


def fresh_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_raw_registers_nothing_loading_plugins_does() -> None:
    out = fresh_python(
        "import topq.raw\n"
        "from topq.ir.catalogue import CATALOGUE\n"
        "from topq.ir.interpreter import REGION_KERNELS\n"
        "before = ('scf.for' in CATALOGUE, 'top.DSLRegion' in CATALOGUE, 'top.DSLRegion' in REGION_KERNELS)\n"
        "from topq.core.plugins import build_plugins\n"
        "plugins = build_plugins()\n"
        "after = ('scf.for' in CATALOGUE, 'top.DSLRegion' in CATALOGUE, 'top.DSLRegion' in REGION_KERNELS)\n"
        "print(before, after, plugins.ir_extensions.owners['raw'])\n")
    assert out == "(False, False, False) (True, True, True) topq.raw.plugin"


def test_core_and_the_host_target_do_not_import_raw() -> None:
    out = fresh_python(
        "import sys\n"
        "import topq.core.pipeline, topq.core.cli, topq.plugins.targets.host\n"
        "print(sorted(m for m in sys.modules if m.startswith('topq.raw')))\n")
    assert out == "[]"


def test_raw_is_a_builtin_plugin_offering_the_kernel_substitution() -> None:
    assert "topq.raw.plugin" in BUILTIN_PLUGINS
    plugins = build_plugins()
    raw = plugins.ir_extensions.get("raw")
    assert plugins.kernel_substitution() is raw.substitute_kernels
    assert {op.name for op in raw.ops} <= set(CATALOGUE) and "top.DSLRegion" in REGION_KERNELS
    info = next(i for i in plugins.info if i.name == "topq.raw.plugin")
    assert info.registered == {"IR extension": ["raw"]}


def test_recipe_kernels_without_an_extension_offering_them_is_an_error() -> None:
    empty = Plugins(pluggy.PluginManager("topq"), Registry("model family"), Registry("checkpoint format"),
                    Registry("quant scheme"), Registry("target"), [])
    with pytest.raises(TopqError, match="recipe kernels need exactly one IR extension"):
        empty.kernel_substitution()
