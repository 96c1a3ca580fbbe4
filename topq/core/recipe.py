"""Recipes: the YAML file that says what to convert and how (DESIGN §8).

The schema is data: a nested table of key -> ``Field`` (the checking machinery is ``topq.io.schema``).
``CORE_SCHEMA`` holds the core's keys; the ``quant`` section gains the options every loaded scheme declares
(``recipe_schema``; ``default_schema`` is the loaded plugins').  Loading is read YAML -> apply ``--set a.b=value``
overrides -> fill defaults -> check types, ranges, cross-field rules, resolve paths (``pkg:`` confined to its
package) and refuse an output that would overwrite an input.  Names of schemes, chips and families are *not*
checked here: plugins own those names and check them later.

Every error is a ``TopqError`` whose message starts with where the bad value came
from (the recipe file, or the ``--set`` override itself) and names the key path.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from topq.core.errors import TopqError
from topq.io import schema as _schema
from topq.io.files import package_file
from topq.io.schema import (
    Field,
    PathKey,
    Schema,
    Section,
    Sources,
    apply_override,
    check_section,
    fmt_path,
    parse_yaml,
    show,
    wrap,
    yaml_problem,
)

__all__ = [
    "CORE_SCHEMA",
    "Field",
    "Recipe",
    "Schema",
    "Section",
    "default_schema",
    "iter_fields",
    "load_recipe",
    "path_fields",
    "recipe_from_defaults",
    "recipe_schema",
]


# --------------------------------------------------------------------------- schema


_POS = 1  # sizes are counts of tokens/elements: at least one

CORE_SCHEMA: Schema = {
    "model": {
        "path": Field("str", required=True, path=True,
                      help="checkpoint file or directory; 'pkg:PACKAGE/FILE' names a file inside an installed package"),
        "family": Field("str", "auto", help="model family plugin, or auto-detect"),
        "format": Field("str", "auto", help="checkpoint format plugin, or auto-detect"),
        "trust_remote_code": Field("bool", False, help="allow model code shipped with the checkpoint"),
    },
    "quant": {
        "scheme": Field("str", "f32", help="quantization scheme (f32, bf16, w4bf16, int8, gptq, ..., auto)"),
        # ... then the options of every loaded scheme (recipe_schema), then calibration
        "lm_head": Field("str", "bf16", help="mode of the lm_head (and tied embedding) matmul"),
        "calibration": {
            "data": Field("str", None, nullable=True, path=True, help="text or jsonl calibration file"),
            "samples": Field("int", 128, ge=_POS, help="number of calibration samples"),
            "seq_len": Field("int", 512, ge=_POS, help="tokens per calibration sample"),
            "seed": Field("int", 0, ge=0, help="sampling seed"),
        },
    },
    "target": {
        "chip": Field("str", "host", help="registered target (host, bm1684x, bm1688, ...)"),
        "checker": Field("bool", False, help="run the target's numerical checker after compiling"),
    },
    "stages": {
        "seq_length": Field("int", 2048, ge=_POS, help="maximum total tokens (KV cache length)"),
        "max_input_length": Field("int", 512, ge=_POS, help="maximum prompt tokens in one prefill"),
        "prefill_kv": Field("bool", True, help="prefill can continue from an existing KV cache"),
        "decode_chunks": Field("list", (), item=Field("int", ge=_POS),
                               help="KV lengths of extra decode functions (each <= seq_length)"),
    },
    "output": {
        "path": Field("str", "out/model.topq", path=True, help="bundle to write"),
    },
    "kernels": Field("list", (), item={
        "replace": Field("str", required=True, help="kernel to replace"),
        "with": Field("str", required=True, help="kernel to use instead"),
    }, help="kernel substitutions"),
}


def recipe_schema(options: Iterable[tuple[str, Field]],
                  target_options: Iterable[tuple[str, Field]] = ()) -> Schema:
    """The core schema with scheme options (name, Field) added to `quant`, after the core keys and before
    `calibration` (`topq.io.schema.merge_options` has already refused clashes), and target options added to
    `target` after its core keys."""
    schema = dict(CORE_SCHEMA)
    core_target = CORE_SCHEMA["target"]
    assert isinstance(core_target, dict)
    schema["target"] = {**core_target, **dict(target_options)}
    core_quant = CORE_SCHEMA["quant"]
    assert isinstance(core_quant, dict)
    quant: Schema = {k: v for k, v in core_quant.items() if k != "calibration"}
    for name, spec in options:
        quant[name] = spec
    quant["calibration"] = core_quant["calibration"]
    schema["quant"] = quant
    return schema


_SCHEMAS: dict[tuple[str, ...], Schema] = {}


def default_schema() -> Schema:
    """The schema of the loaded plugins: the core keys plus every scheme's and target's options (built once per
    set)."""
    from topq.core.plugins import get_plugins  # plugins import schemes, which import recipes: load lazily

    plugins = get_plugins()
    options, target_options = plugins.scheme_options, plugins.target_options
    key = tuple(f"{o.name}={o.spec!r}" for o in options) + tuple(f"target.{o.name}={o.spec!r}" for o in target_options)
    if key not in _SCHEMAS:
        _SCHEMAS[key] = recipe_schema(((o.name, o.spec) for o in options), ((o.name, o.spec) for o in target_options))
    return _SCHEMAS[key]


def iter_fields(schema: Schema | None = None, prefix: str = "") -> Iterator[tuple[str, Field]]:
    """Every leaf as (dotted path, Field), in schema order (for help text and tests); default: the loaded
    plugins' schema."""
    return _schema.iter_fields(default_schema() if schema is None else schema, prefix)


def path_fields(schema: Schema | None = None) -> tuple[str, ...]:
    """Dotted paths of the fields that hold file paths (resolved when a recipe is made)."""
    return _schema.path_fields(default_schema() if schema is None else schema)


# Install hints for packages that ship data used by bundled recipes.



def _check_cross(data: dict[str, Any], src: Sources) -> None:
    st = data["stages"]
    seq = st["seq_length"]
    seq_key: PathKey = ("stages", "seq_length")
    if st["max_input_length"] > seq:
        key: PathKey = ("stages", "max_input_length")
        raise src.fail(key, f"{st['max_input_length']} exceeds stages.seq_length {seq}", seq_key)
    for i, chunk in enumerate(st["decode_chunks"]):
        if chunk > seq:
            raise src.fail(("stages", "decode_chunks", i), f"{chunk} exceeds stages.seq_length {seq}", seq_key)
    if data["model"]["trust_remote_code"]:
        raise src.fail(("model", "trust_remote_code"), "topq never runs code shipped with a checkpoint; only false "
                       "is accepted")


def _resolve_path(text: str, path: PathKey, src: Sources) -> str:
    """Absolute path for ``text``: ``pkg:PACKAGE/FILE`` (model.path only) or relative to the current directory."""
    if not text.startswith("pkg:"):
        return os.path.abspath(os.path.expanduser(text))
    try:
        resolved = package_file(text)
    except ValueError as exc:
        raise src.fail(path, str(exc)) from None
    if path != ("model", "path"):
        raise src.fail(path, "pkg: names a file shipped inside an installed package: only model.path may use it")
    return resolved


def _resolve_paths(data: dict[str, Any], src: Sources, paths: Iterable[str]) -> dict[str, str]:
    original: dict[str, str] = {}
    for dotted in paths:
        keys = tuple(dotted.split("."))
        node = data
        for k in keys[:-1]:
            node = node[k]
        text = node[keys[-1]]
        if text is not None:
            original[dotted] = text
            node[keys[-1]] = _resolve_path(text, keys, src)
    return original


def _check_output(data: dict[str, Any], src: Sources) -> None:
    """The bundle must not land on an input: the checkpoint (its file, or a file of its directory other than an
    earlier .topq bundle), the calibration data or the int8 table. Paths are compared resolved (symlinks, `..`)."""
    output = os.path.realpath(data["output"]["path"])
    inputs: dict[PathKey, Any] = {("model", "path"): data["model"]["path"],
                                  ("quant", "calibration", "data"): data["quant"]["calibration"]["data"],
                                  ("quant", "table"): data["quant"].get("table")}
    for key, value in inputs.items():
        if value is None:
            continue
        source = os.path.realpath(value)
        in_checkpoint_dir = (os.path.isdir(source) and os.path.dirname(output) == source
                             and os.path.exists(output) and not output.endswith(".topq"))
        if output == source or in_checkpoint_dir:
            raise src.fail(("output", "path"), f"{data['output']['path']} would overwrite the input {fmt_path(key)}",
                           key)


def _validate(raw: Any, src: Sources, schema: Schema) -> Recipe:
    data = check_section(schema, raw, (), src)
    _check_cross(data, src)
    paths = path_fields(schema)
    original = _resolve_paths(data, src, paths)
    _check_output(data, src)
    return Recipe(data, src.file, original, paths)



# --------------------------------------------------------------------------- Recipe


class Recipe(Section):
    """A validated, fully defaulted recipe.

    Path fields (``path_fields()``) hold absolute paths, resolved when the recipe was
    made; ``original(key)`` gives the text as written.  Build one with
    ``load_recipe``, ``Recipe.from_dict`` or ``recipe_from_defaults``.
    """

    __slots__ = ("source", "_original", "_paths")
    source: str
    _original: dict[str, str]
    _paths: tuple[str, ...]

    def __init__(self, data: dict[str, Any], source: str, original: Mapping[str, str] | None = None,
                 paths: Sequence[str] = ()) -> None:
        super().__init__(data)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "_original", dict(original or {}))
        object.__setattr__(self, "_paths", tuple(paths))

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>", schema: Schema | None = None) -> Recipe:
        """Validate a plain nested dict (e.g. a bundle's stored recipe) like a file (default schema: the loaded
        plugins')."""
        return _validate(copy.deepcopy(d), Sources(source), default_schema() if schema is None else schema)

    def get(self, dotted: str) -> Any:
        """``recipe.get("quant.calibration.seed")``; KeyError for an unknown path."""
        node: Any = self._data
        for key in dotted.split("."):
            if not isinstance(node, dict) or key not in node:
                raise KeyError(dotted)
            node = node[key]
        return wrap(node)

    def original(self, dotted: str) -> str | None:
        """A path field as written in the recipe (e.g. ``pkg:...`` or a relative path)."""
        if dotted not in self._paths:
            raise KeyError(f"{dotted} is not a path field; path fields: {', '.join(self._paths)}")
        return self._original.get(dotted)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Recipe) and self._data == other._data

    def __repr__(self) -> str:
        return f"Recipe(source={self.source!r}, {self._data!r})"


def load_recipe(path: str | os.PathLike[str], overrides: Iterable[str] = (), schema: Schema | None = None) -> Recipe:
    """Read a recipe file, apply ``--set KEY=VALUE`` overrides, fill defaults, validate (default schema: the
    loaded plugins')."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TopqError(f"{name}: recipe file not found") from None
    except UnicodeDecodeError:
        raise TopqError(f"{name}: recipe file is not UTF-8 text") from None
    except OSError as exc:
        raise TopqError(f"{name}: cannot read recipe file ({exc.strerror or exc})") from None
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as exc:
        raise TopqError(f"{name}: {yaml_problem(exc)}") from None
    except RecursionError:
        raise TopqError(f"{name}: YAML is nested too deeply") from None
    if not isinstance(raw, dict):
        raise TopqError(f"{name}: expected a mapping at the top level, got {show(raw)}")
    schema = default_schema() if schema is None else schema
    src = Sources(name)
    for text_override in overrides:
        apply_override(raw, text_override, src, schema)
    return _validate(raw, src, schema)


def recipe_from_defaults(**sections: Any) -> Recipe:
    """``recipe_from_defaults(model={"path": "m.gguf"}, quant={"scheme": "w4bf16"})``."""
    return Recipe.from_dict(sections, source="<defaults>")
