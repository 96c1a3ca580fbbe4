"""The plugin system: documented hooks, built-in plugins, entry-point discovery, TOPQ_LOAD_PLUGINS, name errors.

The example plugin must be installed (CI does it in scripts/setup.sh):
    pip install --no-deps examples/topq-example-plugin
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from data_paths import REPO

import topq
from topq.core import hookspecs
from topq.core.errors import TopqError, UnknownNameError
from topq.core.family import ModelFamily, find_family
from topq.core.plugins import BUILTIN_PLUGINS, HOOKS, Plugins, build_plugins

PLUGINS_MD = REPO / "docs" / "plugins.md"
EXAMPLE_DIR = REPO / "examples" / "topq-example-plugin"
INSTALL_HINT = "the example plugin is not installed: run `pip install --no-deps examples/topq-example-plugin`"


@pytest.fixture(autouse=True)
def no_plugin_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with the default (load all entry points), whatever the calling shell set."""
    monkeypatch.delenv("TOPQ_LOAD_PLUGINS", raising=False)


def hook_names() -> list[str]:
    return [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, "topq_spec")]


def info_by_name(plugins: Plugins) -> dict[str, Any]:
    return {info.name: info for info in plugins.info}


def require_example_installed() -> None:
    """Fail (not skip) when the example plugin is missing or its installed copy is stale."""
    found = [ep for ep in metadata.entry_points(group="topq") if ep.name == "example"]
    if not found:
        pytest.fail(INSTALL_HINT)
    import topq_example_plugin

    installed = Path(topq_example_plugin.__file__).read_text(encoding="utf-8")
    source = (EXAMPLE_DIR / "topq_example_plugin" / "__init__.py").read_text(encoding="utf-8")
    if installed != source:
        pytest.fail(f"the installed example plugin is stale ({topq_example_plugin.__file__}); "
                    "reinstall: pip install --no-deps --force-reinstall examples/topq-example-plugin")


# ------------------------------------------------------------------------------------ docs


def test_every_hook_is_documented() -> None:
    docs = PLUGINS_MD.read_text(encoding="utf-8")
    hooks = hook_names()
    assert sorted(hooks) == sorted(HOOKS), "hookspecs.py and plugins.HOOKS disagree"
    for name in hooks:
        assert re.search(rf"^### {name}$", docs, flags=re.M), f"docs/plugins.md has no `### {name}` section"
        fn = getattr(hookspecs, name)
        # The documented signature is the real one (annotations are strings: `from __future__ import annotations`).
        params = ", ".join(f"{p}: {a}" for p, a in fn.__annotations__.items() if p != "return")
        signature = f"def {name}({params}) -> {fn.__annotations__['return']}"
        assert signature in docs, f"docs/plugins.md should show `{signature}`"
    documented = re.findall(r"^### (register_\w+)$", docs, flags=re.M)
    assert sorted(documented) == sorted(hooks), "docs/plugins.md documents a hook that does not exist"


# ------------------------------------------------------------------------------------ loading


BUILTIN_FAMILIES = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"}


def test_builtin_plugins_load_and_register_families() -> None:
    plugins = build_plugins()
    infos = info_by_name(plugins)
    for module in BUILTIN_PLUGINS:
        assert infos[module].source == "builtin"
    assert BUILTIN_FAMILIES <= set(plugins.families.names())
    assert plugins.families.owners["qwen3"] == "topq.plugins.models.qwen3"
    assert infos["topq.plugins.models.llama"].registered == {"model family": ["llama"]}
    # Mistral is a family of its own (its sliding window), no longer an architecture of llama's
    assert plugins.families.get("mistral").accepts({"architectures": ["MistralForCausalLM"]})
    assert not plugins.families.get("llama").accepts({"architectures": ["MistralForCausalLM"]})


def test_example_plugin_is_discovered_through_its_entry_point() -> None:
    require_example_installed()
    plugins = build_plugins()
    info = info_by_name(plugins).get("example")
    assert info is not None, [i.name for i in plugins.info]
    assert info.source.startswith("entry point"), info.source
    assert info.source == "entry point topq-example-plugin 0.1.0"
    assert info.registered == {"model family": ["example-llama"]}
    assert "example-llama" in plugins.families
    assert plugins.families.owners["example-llama"] == "example"
    assert BUILTIN_FAMILIES <= set(plugins.families.names())  # built-ins still there


def test_example_family_builds_the_llama_graph() -> None:
    """The third-party family goes through the same stage template; its block equals the built-in Llama one."""
    require_example_installed()
    from topq.core.stages import StageConfig, build_program
    from topq.ir.printer import print_module
    from topq.ir.verifier import verify_module

    plugins = build_plugins()
    config = {"architectures": ["ExampleLlamaForCausalLM"], "model_type": "example_llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 100, "rms_norm_eps": 1e-5}
    family = find_family(plugins.families, config)
    assert family.name == "example-llama"
    assert find_family(plugins.families, {"model_type": "example_llama"}).name == "example-llama"
    spec = family.normalize(config)
    assert (spec.family, spec.num_kv_heads, spec.head_dim) == ("example-llama", 2, 16)
    stages = StageConfig(seq_length=32, max_input_length=8, prefill_kv=True, decode_chunks=(16,))
    program = build_program(spec, family, stages)
    verify_module(program)
    assert len(program.functions) == 2 + 2 * 4 + 1  # embeddings, 4 block functions per layer, lm_head
    llama = plugins.families.get("llama")
    assert print_module(program) == print_module(build_program(llama.normalize(config), llama, stages))


def test_empty_topq_load_plugins_excludes_third_party(monkeypatch: pytest.MonkeyPatch) -> None:
    require_example_installed()
    monkeypatch.setenv("TOPQ_LOAD_PLUGINS", "")
    plugins = build_plugins()
    assert "example" not in info_by_name(plugins)
    assert "example-llama" not in plugins.families
    assert BUILTIN_FAMILIES <= set(plugins.families.names())  # built-ins always load


@pytest.mark.parametrize("wanted", ["example", "topq-example-plugin", " other , example "])
def test_topq_load_plugins_selects_by_entry_point_or_distribution(monkeypatch: pytest.MonkeyPatch,
                                                                  wanted: str) -> None:
    require_example_installed()
    monkeypatch.setenv("TOPQ_LOAD_PLUGINS", wanted)
    plugins = build_plugins()
    assert "example" in info_by_name(plugins)
    assert "example-llama" in plugins.families


def test_topq_load_plugins_naming_another_plugin_excludes_example(monkeypatch: pytest.MonkeyPatch) -> None:
    require_example_installed()
    monkeypatch.setenv("TOPQ_LOAD_PLUGINS", "someone-else")
    assert "example-llama" not in build_plugins().families


# ------------------------------------------------------------------------------------ names


def test_unknown_family_lists_known_names_and_suggests() -> None:
    plugins = build_plugins()
    with pytest.raises(UnknownNameError) as info:
        plugins.families.get("lama")
    message = str(info.value)
    assert message.startswith("unknown model family 'lama' (did you mean 'llama'?); known: ")
    for name in ("llama", "qwen2", "qwen3"):
        assert name in message.split("known: ", 1)[1]
    assert isinstance(info.value, TopqError)
    with pytest.raises(UnknownNameError, match="did you mean 'qwen3'"):
        find_family(plugins.families, {}, requested="qwen-3")


def test_unknown_name_without_close_match_has_no_suggestion() -> None:
    with pytest.raises(UnknownNameError) as info:
        build_plugins().families.get("gpt-neox-20b")
    assert "did you mean" not in str(info.value)
    assert "known: " in str(info.value)


class _Plugin:
    """A test plugin object; pluggy names it by `__name__`."""

    def __init__(self, name: str, register_with: Callable[[Callable[[Any], None]], None]) -> None:
        self.__name__ = name
        self._register_with = register_with

    @topq.hookimpl
    def register_model_families(self, register: Callable[[ModelFamily], None]) -> None:
        self._register_with(register)


def test_two_families_with_one_name_is_an_error_naming_both_owners() -> None:
    llama = build_plugins().families.get("llama")
    clone = _Plugin("my_llama_clone", lambda register: register(dataclasses.replace(llama, description="clone")))
    with pytest.raises(TopqError) as info:
        build_plugins(extra=(clone,))
    message = str(info.value)
    assert "model family 'llama' is registered by both" in message
    assert "topq.plugins.models.llama" in message and "my_llama_clone" in message


def test_extra_plugin_registers_a_new_family() -> None:
    llama = build_plugins().families.get("llama")
    extra = _Plugin("tiny_family", lambda register: register(dataclasses.replace(llama, name="tiny")))
    plugins = build_plugins(extra=(extra,))
    assert plugins.families.owners["tiny"] == "tiny_family"
    assert info_by_name(plugins)["tiny_family"].registered == {"model family": ["tiny"]}


def test_registering_something_without_a_name_is_an_error() -> None:
    nameless = _Plugin("nameless", lambda register: register(object()))
    with pytest.raises(TopqError, match="plugin nameless: a model family needs a non-empty string `name`"):
        build_plugins(extra=(nameless,))
