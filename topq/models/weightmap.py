"""A family's weight mapping: how each tensor the Top IR names is made from checkpoint tensors.

Most checkpoints store exactly the tensors a family's block reads. Some do not: Phi-3 fuses q/k/v into one
`qkv_proj` and gate/up into one `gate_up_proj`, Gemma stores norm weights as `w` for a `(1 + w)` norm, MoE
checkpoints store one tensor per expert. A family declares `ModelFamily.map_weights = weight_map({...})`, IR
tensor name → rule (the MLC-LLM "weight mapping with transforms"), in a small vocabulary:

* `Rows(source, sections, index)` — one row block of a fused tensor (split qkv by heads × head_dim, gate_up in
  halves);
* `AddScalar(source, value)` — an elementwise `w + value` in float32 (`1 + w` norms);
* `Stack(source, count)` — per-expert tensors stacked on a new leading axis;
* `GroupedRows(source, groups, parts, take)` — the same parts taken from every head group of a tensor fused
  per group (Qwen3-Next's `in_proj_qkvz`: [q, k, v, z] per key head).

Names contain `{i}` for the layer (and, in a `Stack` source, `{e}` for the expert). A derived tensor carries
the IR name the block reads (e.g. `model.layers.0.self_attn.q_proj.weight` made from
`model.layers.0.self_attn.qkv_proj.weight`); an in-place transform keeps its source's name. That is also its
name in the bundle.

`MappedWeights` presents a checkpoint's `WeightStore` under those names: derived tensors are computed when
read, one at a time, never the whole model, so graph shapes, weight reads, quantization (including a
pre-quantized checkpoint's integer form), calibration and the build cache's fingerprints all see the logical
model. Families without a weight map get the checkpoint's store unchanged.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from topq.core.errors import TopqError
from topq.core.spec import ModelSpec

if TYPE_CHECKING:
    from topq.core.checkpoint import WeightStore
    from topq.core.quant import QuantizedWeight

__all__ = ["AddScalar", "GroupedRows", "MappedWeights", "Rows", "Stack", "WeightRule", "gate_up_sections",
           "qkv_sections", "split_rows"]

#: A number n of equal row blocks, or a function of the spec that gives each block's row count.
Sections = int | Callable[[ModelSpec], Sequence[int]]


@dataclass(frozen=True)
class Rows:
    """Row block `index` of `source` cut along axis 0 into consecutive `sections`."""

    source: str
    sections: Sections
    index: int


@dataclass(frozen=True)
class AddScalar:
    """`source + value`, elementwise in float32 (a `(1 + w)` norm stores `w`)."""

    source: str
    value: float


@dataclass(frozen=True)
class Stack:
    """`source.format(i=layer, e=e)` for each expert e < `count`, stacked on a new axis 0."""

    source: str
    count: int | Callable[[ModelSpec], int]


@dataclass(frozen=True)
class GroupedRows:
    """Rows of a tensor fused per head group: `source`'s rows are `groups` equal blocks, each cut into consecutive
    `parts` (row counts); the result is parts `take` of every group, part by part (take[0] of groups 0, 1, …,
    then take[1] of groups 0, 1, …)."""

    source: str
    groups: int | Callable[[ModelSpec], int]
    parts: Callable[[ModelSpec], Sequence[int]]
    take: tuple[int, ...]

    def rows(self, spec: ModelSpec) -> np.ndarray:
        groups = self.groups if isinstance(self.groups, int) else int(self.groups(spec))
        parts = [int(p) for p in self.parts(spec)]
        starts = np.cumsum([0, *parts[:-1]])
        per_group = sum(parts)
        return np.concatenate([np.arange(g * per_group + starts[t], g * per_group + starts[t] + parts[t])
                               for t in self.take for g in range(groups)])


WeightRule = Rows | AddScalar | Stack | GroupedRows


def qkv_sections(spec: ModelSpec) -> tuple[int, int, int]:
    """Rows of a fused [q; k; v] projection: query heads, then key and value heads, each × head_dim."""
    kv = spec.num_kv_heads * spec.head_dim
    return spec.num_heads * spec.head_dim, kv, kv


def gate_up_sections(spec: ModelSpec) -> tuple[int, int]:
    """Rows of a fused [gate; up] projection."""
    return spec.intermediate_size, spec.intermediate_size


def split_rows(source: str, sections: Sections, *names: str) -> dict[str, WeightRule]:
    """`{names[k]: Rows(source, sections, k)}`: every part of one fused tensor."""
    return {name: Rows(source, sections, k) for k, name in enumerate(names)}


@dataclass(frozen=True)
class _Derived:
    """One derived tensor, resolved for a layer: its rule, concrete source names and (Rows) its row range."""

    rule: WeightRule
    sources: tuple[str, ...]
    start: int = 0
    stop: int = 0
    index: tuple[int, ...] = ()  # GroupedRows: the source rows, in order

    @property
    def rows(self) -> slice | np.ndarray:
        """The source rows a row rule takes."""
        return np.asarray(self.index) if isinstance(self.rule, GroupedRows) else slice(self.start, self.stop)

    def describe(self) -> list[Any]:
        """What decides the tensor besides its sources' bytes (part of its build-cache fingerprint)."""
        if isinstance(self.rule, Rows):
            return ["rows", self.start, self.stop]
        if isinstance(self.rule, GroupedRows):
            return ["grouped_rows", hashlib.sha256(np.asarray(self.index, np.int64).tobytes()).hexdigest()]
        if isinstance(self.rule, AddScalar):
            return ["add", float(self.rule.value)]
        return ["stack", len(self.sources)]


class MappedWeights:
    """A WeightStore over a checkpoint's store in which a family's derived tensors appear under their IR names.

    Tensors a `Rows` or `Stack` rule consumes are not listed (their parts are, at the source's place in file
    order); a derived tensor whose sources are absent is not listed either, so a missing tensor is reported
    by the graph builder under the name the block reads. Every other tensor passes through unchanged.
    """

    def __init__(self, base: WeightStore, rules: Mapping[str, WeightRule], spec: ModelSpec, family: str) -> None:
        self.base, self.family = base, family
        self._derived: dict[str, _Derived] = {}
        for template, rule in rules.items():
            layers = range(spec.num_layers) if "{i}" in template else (None,)
            for layer in layers:
                name = template.format(i=layer) if layer is not None else template
                derived = self._resolve(rule, layer, spec, name)
                if derived is not None:
                    self._derived[name] = derived
        consumed = {s for d in self._derived.values() if not isinstance(d.rule, AddScalar) for s in d.sources}
        consumed -= set(self._derived)
        by_first_source: dict[str, list[str]] = {}
        for name, derived in self._derived.items():
            by_first_source.setdefault(derived.sources[0], []).append(name)
        self._names: list[str] = []
        for name in base.names():
            self._names += by_first_source.get(name, []) if name in consumed else [name]
        # Derived tensors whose first source is not consumed (an AddScalar under a new name) come last.
        self._names = list(dict.fromkeys([*self._names, *self._derived]))
        self._listed = frozenset(self._names)
        self._last: tuple[str, np.ndarray] | None = None  # the last fused source read (q, k and v read it in turn)

    def _resolve(self, rule: WeightRule, layer: int | None, spec: ModelSpec, name: str) -> _Derived | None:
        if isinstance(rule, Stack):
            count = rule.count if isinstance(rule.count, int) else int(rule.count(spec))
            sources = tuple(rule.source.format(i=layer, e=e) for e in range(count))
        else:
            sources = (rule.source.format(i=layer),)
        if not all(s in self.base for s in sources):
            return None
        if isinstance(rule, GroupedRows):
            index = rule.rows(spec)
            rows = int(self.base.shape(sources[0])[0])
            groups = rule.groups if isinstance(rule.groups, int) else int(rule.groups(spec))
            if groups * sum(int(p) for p in rule.parts(spec)) != rows:
                raise TopqError(f"family {self.family}: {sources[0]} has {rows} rows, not {groups} groups of "
                                f"{list(rule.parts(spec))}")
            return _Derived(rule, sources, index=tuple(int(i) for i in index))
        if not isinstance(rule, Rows):
            return _Derived(rule, sources)
        rows = int(self.base.shape(sources[0])[0])
        if isinstance(rule.sections, int):
            if rule.sections <= 0 or rows % rule.sections:
                raise TopqError(f"family {self.family}: {sources[0]} has {rows} rows, not {rule.sections} equal parts")
            sizes = [rows // rule.sections] * rule.sections
        else:
            sizes = [int(s) for s in rule.sections(spec)]
        if sum(sizes) != rows or not 0 <= rule.index < len(sizes):
            raise TopqError(f"family {self.family}: {sources[0]} has {rows} rows; {name} is part {rule.index} "
                            f"of {sizes}")
        start = sum(sizes[: rule.index])
        return _Derived(rule, sources, start, start + sizes[rule.index])

    # -- WeightStore ------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._listed

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def _check(self, name: str) -> _Derived | None:
        if name not in self._listed:
            raise TopqError(f"tensor {name!r} not found (family {self.family})")
        return self._derived.get(name)

    def shape(self, name: str) -> tuple[int, ...]:
        d = self._check(name)
        if d is None:
            return tuple(self.base.shape(name))
        first = tuple(self.base.shape(d.sources[0]))
        if isinstance(d.rule, Rows):
            return (d.stop - d.start, *first[1:])
        if isinstance(d.rule, GroupedRows):
            return (len(d.index), *first[1:])
        if isinstance(d.rule, Stack):
            return (len(d.sources), *first)
        return first

    def dtype(self, name: str) -> str:
        d = self._check(name)
        if d is None:
            return self.base.dtype(name)
        # A transformed value is computed in float32; a slice or stack keeps the stored type.
        return "float32" if isinstance(d.rule, AddScalar) else self.base.dtype(d.sources[0])

    def _fused(self, source: str) -> np.ndarray:
        if self._last is None or self._last[0] != source:
            self._last = (source, self.base.get(source))
        return self._last[1]

    def get(self, name: str) -> np.ndarray:
        d = self._check(name)
        if d is None:
            return self.base.get(name)
        if isinstance(d.rule, (Rows, GroupedRows)):
            return self._fused(d.sources[0])[d.rows].copy()
        if isinstance(d.rule, AddScalar):
            return (self.base.get(d.sources[0]) + np.float32(d.rule.value)).astype(np.float32)
        return self._stack([self.base.get(s) for s in d.sources], d.sources)

    def _stack(self, arrays: list[np.ndarray], sources: tuple[str, ...]) -> np.ndarray:
        if len({a.shape for a in arrays}) > 1:
            raise TopqError(f"family {self.family}: cannot stack {sources[0]}…: the tensors differ in shape")
        return np.stack(arrays)

    def _stored(self, name: str, read: Callable[[str], np.ndarray]) -> np.ndarray:
        d = self._check(name)
        if d is None:
            return read(name)
        if isinstance(d.rule, (Rows, GroupedRows)):
            return np.array(read(d.sources[0])[d.rows])  # a private copy: the fused tensor is not kept
        if isinstance(d.rule, AddScalar):
            return self.get(name)
        return self._stack([np.asarray(read(s)) for s in d.sources], d.sources)

    def get_raw(self, name: str) -> np.ndarray:
        return self._stored(name, self.base.get_raw)

    def read_raw(self, name: str) -> np.ndarray:
        """The tensor in its stored type (see `dtype`), as a private copy."""
        read = getattr(self.base, "read_raw", None) or self.base.get_raw
        return self._stored(name, read)

    def quantized(self, name: str) -> QuantizedWeight | None:
        """The checkpoint's integer form (pre-quantized checkpoints); a row block keeps its rows' codes, scales and
        zeros. None where the checkpoint has none, and for transformed or stacked tensors."""
        from_base = getattr(self.base, "quantized", None)
        d = self._check(name)
        if from_base is None or (d is not None and not isinstance(d.rule, (Rows, GroupedRows))):
            return None
        if d is None:
            return from_base(name)
        q = from_base(d.sources[0])
        if q is None:
            return None
        rows = d.rows
        return replace(q, codes=q.codes[rows], scales=q.scales[rows], zeros=q.zeros[rows])

    def dequantized_bits(self, name: str) -> int | None:
        """The base store's for a passed-through tensor or a row block of one (rows keep their blocks: GGUF blocks
        never span two rows); None for transformed or stacked tensors."""
        from_base = getattr(self.base, "dequantized_bits", None)
        d = self._check(name)
        if from_base is None or (d is not None and not isinstance(d.rule, (Rows, GroupedRows))):
            return None
        return from_base(name if d is None else d.sources[0])

    def fingerprint(self, name: str) -> str:
        """Identity for build caching: the base store's for a passed-through tensor; for a derived one its rule
        and its sources' identities."""
        d = self._check(name)
        if d is None:
            return self._base_fingerprint(name)
        key = json.dumps([d.describe(), [self._base_fingerprint(s) for s in d.sources]])
        return hashlib.sha256(key.encode()).hexdigest()

    def _base_fingerprint(self, name: str) -> str:
        if hasattr(self.base, "fingerprint"):
            return str(self.base.fingerprint(name))
        return hashlib.sha256(np.ascontiguousarray(self.base.get_raw(name)).tobytes()).hexdigest()


def weight_map(rules: Mapping[str, WeightRule]) -> Callable[[ModelSpec, WeightStore], WeightStore]:
    """A family's `map_weights` from declarative rules (IR name template → a `WeightRule`): the
    checkpoint's store seen through them, every derived tensor computed when it is read."""
    frozen = dict(rules)

    def map_weights(spec: ModelSpec, store: WeightStore) -> WeightStore:
        return MappedWeights(store, frozen, spec, spec.family)

    return map_weights
