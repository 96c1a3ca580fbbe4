"""The plugin manager and the registries it fills.

Built-in plugins load from an explicit list; third-party plugins load from the `topq` entry-point
group. `TOPQ_LOAD_PLUGINS` (comma-separated entry-point or distribution names; empty for none)
restricts which third-party plugins load.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Generic, Protocol, TypeVar

import pluggy

from topq.core import hookspecs
from topq.core.checkpoint import CheckpointFormat
from topq.core.errors import TopqError, UnknownNameError
from topq.core.exporter import Exporter
from topq.core.family import ModelFamily
from topq.core.quant import CORE_QUANT_KEYS, Option, QuantScheme
from topq.core.target import CORE_TARGET_KEYS, Target
from topq.io.schema import merge_options
from topq.ir.extension import IRExtension, KernelSubstitution, install_extension

BUILTIN_PLUGINS: tuple[str, ...] = (
    "topq.plugins.formats.hf",
    "topq.plugins.formats.gguf_file",
    "topq.plugins.models.llama",
    "topq.plugins.models.mistral",
    "topq.plugins.models.gemma2",
    "topq.plugins.models.gemma3",
    "topq.plugins.models.phi3",
    "topq.plugins.models.qwen2",
    "topq.plugins.models.qwen3",
    "topq.plugins.models.qwen2_moe",
    "topq.plugins.models.qwen3_moe",
    "topq.plugins.models.mixtral",
    "topq.plugins.models.qwen3_5",
    "topq.plugins.models.qwen3_next",
    "topq.plugins.quant.float_modes",
    "topq.plugins.quant.auto",
    "topq.plugins.quant.rtn",
    "topq.plugins.quant.gptq",
    "topq.plugins.quant.awq",
    "topq.plugins.quant.autoround",
    "topq.plugins.quant.int8",
    "topq.plugins.targets.host",
    "topq.plugins.targets.bm1684x",
    "topq.raw.plugin",
    "topq.plugins.targets.onnx",
    "topq.plugins.exporters.tpu_mlir",
    "topq.plugins.exporters.hf_quantized",
    "topq.plugins.exporters.onnx_genai",
)

#: hook name → registry kind
HOOKS: dict[str, str] = {
    "register_model_families": "model family",
    "register_checkpoint_formats": "checkpoint format",
    "register_quant_schemes": "quant scheme",
    "register_targets": "target",
    "register_ir_extensions": "IR extension",
    "register_exporters": "exporter",
}

class Named(Protocol):
    """What every registered item has: the name recipes and the CLI use for it."""

    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    """Named objects of one kind; an unknown name is an error that lists the known ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.items: dict[str, T] = {}
        self.owners: dict[str, str] = {}

    def register(self, item: T, owner: str = "?") -> None:
        name = getattr(item, "name", None)
        if not isinstance(name, str) or not name:
            raise TopqError(f"plugin {owner}: a {self.kind} needs a non-empty string `name`")
        if name in self.items:
            raise TopqError(f"{self.kind} {name!r} is registered by both {self.owners[name]} and {owner}")
        self.items[name] = item
        self.owners[name] = owner

    def get(self, name: str) -> T:
        try:
            return self.items[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self.items) from None

    def names(self) -> list[str]:
        return sorted(self.items)

    def __iter__(self) -> Iterator[T]:
        return iter(self.items.values())

    def __contains__(self, name: str) -> bool:
        return name in self.items


@dataclass
class PluginInfo:
    name: str
    source: str  # "builtin" or "entry point <dist> <version>"
    registered: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class Plugins:
    manager: pluggy.PluginManager
    families: Registry[ModelFamily]
    formats: Registry[CheckpointFormat]
    schemes: Registry[QuantScheme]
    targets: Registry[Target]
    info: list[PluginInfo]
    #: every loaded scheme's recipe options, each once (the recipe schema adds them to the core's keys)
    scheme_options: tuple[Option, ...] = ()
    #: every loaded target's recipe options (`target.<name>`), each once
    target_options: tuple[Option, ...] = ()
    ir_extensions: Registry[IRExtension] = field(default_factory=lambda: Registry("IR extension"))
    exporters: Registry[Exporter] = field(default_factory=lambda: Registry("exporter"))

    def registry(self, hook: str) -> Registry[Any]:
        registries: dict[str, Registry[Any]] = {
            "register_model_families": self.families,
            "register_checkpoint_formats": self.formats,
            "register_quant_schemes": self.schemes,
            "register_targets": self.targets,
            "register_ir_extensions": self.ir_extensions,
            "register_exporters": self.exporters,
        }
        return registries[hook]

    def kernel_substitution(self) -> KernelSubstitution:
        """What applies a recipe's `kernels:` section: the one registered IR extension that offers it."""
        offers = [e for e in self.ir_extensions if e.substitute_kernels is not None]
        if len(offers) != 1:
            found = ", ".join(e.name for e in offers) or "none"
            raise TopqError(f"recipe kernels need exactly one IR extension that substitutes kernels (the raw "
                            f"plugin); found: {found}")
        substitute = offers[0].substitute_kernels
        assert substitute is not None
        return substitute


#: modules a recipe's `kernels:` entries may import besides topq's and installed plugins' (comma-separated module
#: names; `topq convert --kernel-module` sets it)
KERNEL_MODULES_ENV = "TOPQ_KERNEL_MODULES"


def third_party_entry_points() -> list[tuple[metadata.EntryPoint, metadata.Distribution | None]]:
    wanted = os.environ.get("TOPQ_LOAD_PLUGINS")
    names = None if wanted is None else {n.strip() for n in wanted.split(",") if n.strip()}
    found = []
    for ep in metadata.entry_points(group="topq"):
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else ""
        if names is None or ep.name in names or dist_name in names:
            found.append((ep, dist))
    return sorted(found, key=lambda pair: pair[0].name)


def build_plugins(extra: tuple[object, ...] = ()) -> Plugins:
    """Load every plugin and fill the registries (tests pass `extra` plugin objects)."""
    manager = pluggy.PluginManager("topq")
    manager.add_hookspecs(hookspecs)
    info: dict[str, PluginInfo] = {}
    for module_name in BUILTIN_PLUGINS:
        manager.register(importlib.import_module(module_name), name=module_name)
        info[module_name] = PluginInfo(module_name, "builtin")
    for ep, dist in third_party_entry_points():
        try:
            module = ep.load()
        except Exception as exc:  # a broken third-party plugin must not take the tool down silently
            raise TopqError(f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
        manager.register(module, name=ep.name)
        source = f"entry point {dist.metadata['Name']} {dist.version}" if dist is not None else "entry point"
        info[ep.name] = PluginInfo(ep.name, source)
    for obj in extra:
        name = manager.register(obj) or repr(obj)
        info[name] = PluginInfo(name, "extra")

    plugins = Plugins(manager, Registry("model family"), Registry("checkpoint format"),
                      Registry("quant scheme"), Registry("target"), list(info.values()))
    for hook, kind in HOOKS.items():
        registry = plugins.registry(hook)
        # Call each implementation on its own so we know which plugin registered what.
        for impl in reversed(getattr(manager.hook, hook).get_hookimpls()):
            impl.function(register=_registrar(registry, kind, info[impl.plugin_name]))
    # Two schemes declaring one option differently stop here, when plugins load, not when a recipe is read.
    plugins.scheme_options = merge_options(plugins.schemes, CORE_QUANT_KEYS, "quant scheme", "quant")
    plugins.target_options = merge_options(plugins.targets, CORE_TARGET_KEYS, "target", "target")
    for extension in plugins.ir_extensions:  # their ops and kernels are needed from here on
        install_extension(extension)
    return plugins


def _registrar(registry: Registry[Any], kind: str, plugin: PluginInfo) -> hookspecs.Register[Any]:
    """The `register` callback one plugin's hook implementation receives."""

    def register(item: Any, /) -> None:
        registry.register(item, plugin.name)
        plugin.registered.setdefault(kind, []).append(item.name)

    return register


_PLUGINS: Plugins | None = None


def get_plugins() -> Plugins:
    global _PLUGINS
    if _PLUGINS is None:
        _PLUGINS = build_plugins()
    return _PLUGINS
