"""Schema-checked YAML documents (recipes): a schema is a nested table of key -> `Field`; reading is parse YAML
(bounded: an alias bomb cannot expand) -> apply `--set a.b=value` overrides -> fill defaults -> check types, ranges
and choices. Every error is a `TopqError` that starts with where the value came from (the file, or the `--set`
override) and names the key path, with a suggestion for a mistyped key."""

from __future__ import annotations

import copy
import difflib
import math
import re
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Union

import yaml

from topq.ir.errors import TopqError


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
    item: Field | Schema | None = None
    path: bool = False


Schema = dict[str, Union[Field, "Schema"]]

PathKey = tuple[str | int, ...]


def fmt_path(path: PathKey) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def show(value: Any) -> str:
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


class Sources:
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
        return TopqError(f"{self.of(path, *also)}: {fmt_path(path)}: {msg}")


def _unknown(where: str, path: PathKey, key: Any, known: Iterable[str]) -> TopqError:
    full = path + (str(key),)
    close = difflib.get_close_matches(str(key), list(known), n=1)
    hint = f" (did you mean {fmt_path(path + (close[0],))}?)" if close else ""
    return TopqError(f"{where}: unknown key {fmt_path(full)}{hint}")

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


def yaml_problem(exc: yaml.YAMLError, lines: bool = True) -> str:
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


def parse_yaml(text: str) -> Any:
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

_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_TYPE_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
               "list": "a list"}


def _check_leaf(spec: Field, value: Any, path: PathKey, src: Sources) -> Any:
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
                raise src.fail(path, f"expected a finite number, got {show(given)}")
    else:
        ok = isinstance(value, str)
        if ok and not value.strip():
            raise src.fail(path, "must not be empty")
    if not ok:
        raise src.fail(path, f"expected {_TYPE_NAMES[kind]}, got {show(value)}")
    if spec.choices and value not in spec.choices:
        close = difflib.get_close_matches(value, spec.choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise src.fail(path, f"expected one of {', '.join(spec.choices)}; got {show(value)}{hint}")
    if spec.ge is not None and value < spec.ge:
        raise src.fail(path, f"must be at least {spec.ge:g}, got {show(value)}")
    if spec.gt is not None and value <= spec.gt:
        raise src.fail(path, f"must be greater than {spec.gt:g}, got {show(value)}")
    if spec.le is not None and value > spec.le:
        raise src.fail(path, f"must be at most {spec.le:g}, got {show(value)}")
    return value


def _check_list(spec: Field, value: Any, path: PathKey, src: Sources) -> list[Any]:
    if not isinstance(value, list):
        raise src.fail(path, f"expected a list, got {show(value)}")
    out: list[Any] = []
    for i, elem in enumerate(value):
        if isinstance(spec.item, Field):
            out.append(_check_leaf(spec.item, elem, path + (i,), src))
        else:
            assert spec.item is not None, "list fields declare their item spec"
            out.append(check_section(spec.item, elem, path + (i,), src))
    return out


def check_section(schema: Schema, raw: Any, path: PathKey, src: Sources) -> dict[str, Any]:
    if raw is None:  # "quant:" with nothing under it is an empty section
        raw = {}
    if not isinstance(raw, dict):
        if path:
            raise src.fail(path, f"expected a mapping, got {show(raw)}")
        raise TopqError(f"{src.file}: expected a mapping at the top level, got {show(raw)}")
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
            out[key] = check_section(spec, raw.get(key), path + (key,), src)
    return out

def _lookup_spec(keys: Sequence[str], where: str, schema: Schema) -> Field | Schema:
    node: Field | Schema = schema
    for i, key in enumerate(keys):
        if isinstance(node, Field):
            raise TopqError(f"{where}: {fmt_path(tuple(keys[:i]))} is a value, not a section")
        if key not in node:
            raise _unknown(where, tuple(keys[:i]), key, node)
        node = node[key]
    return node


def apply_override(raw: dict[Any, Any], text: str, src: Sources, schema: Schema) -> None:
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
        value = parse_yaml(value_text)
    except yaml.YAMLError as exc:
        raise TopqError(f"{where}: {yaml_problem(exc, lines=False)}") from None
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
            raise TopqError(f"{src.of(sub)}: {fmt_path(sub)}: expected a mapping, got {show(child)}")
        node = child
    node[keys[-1]] = value
    src.overrides.append((path, text))

def wrap(value: Any) -> Any:
    """Read-only views of nested values; lists are copies so callers cannot edit the recipe."""
    if isinstance(value, dict):
        return Section(value)
    if isinstance(value, list):
        return [wrap(v) for v in value]
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
            return wrap(self._data[name])
        except KeyError:
            close = difflib.get_close_matches(name, list(self._data), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise AttributeError(f"no recipe key {name!r}{hint}") from None

    def __getitem__(self, name: str) -> Any:
        return wrap(self._data[name])

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

def iter_fields(schema: Schema, prefix: str = "") -> Iterator[tuple[str, Field]]:
    """Every leaf as (dotted path, Field), in schema order."""
    for key, spec in schema.items():
        dotted = f"{prefix}{key}"
        if isinstance(spec, Field):
            yield dotted, spec
        else:
            yield from iter_fields(spec, dotted + ".")


def path_fields(schema: Schema) -> tuple[str, ...]:
    """Dotted paths of the fields that hold file paths."""
    return tuple(p for p, f in iter_fields(schema) if f.path)


def merge_options(owners: Iterable[Any], core_keys: Iterable[str], kind: str, section: str) -> tuple[Any, ...]:
    """The options (`name` + `spec`: a Field) of every owner (schemes, targets: anything with `name` and
    `options`), each once, in registration order; a name declared twice differently (or clashing with a core key
    of the recipe `section`) is an error naming both."""
    merged: dict[str, tuple[Any, str]] = {}
    core = set(core_keys)
    for owner in owners:
        for option in owner.options:
            if option.name in core:
                raise TopqError(f"{kind} {owner.name!r}: option {option.name!r} is a core {section} key")
            seen = merged.get(option.name)
            if seen is None:
                merged[option.name] = (option, owner.name)
            elif seen[0] != option:
                raise TopqError(f"{kind}s {seen[1]!r} and {owner.name!r} declare option {option.name!r} "
                                f"differently ({_describe(seen[0].spec)} vs {_describe(option.spec)})")
    return tuple(option for option, _ in merged.values())


def _describe(spec: Field) -> str:
    """A declaration in a few words: "int, default 64, >= -1"."""
    parts = [spec.type + (" or null" if spec.nullable else ""), f"default {spec.default!r}"]
    parts += [f"one of {'/'.join(spec.choices)}"] if spec.choices else []
    bounds = ((">=", spec.ge), (">", spec.gt), ("<=", spec.le))
    parts += [f"{op} {bound:g}" for op, bound in bounds if bound is not None]
    return ", ".join(parts) + (f", help {spec.help!r}" if spec.help else "")
