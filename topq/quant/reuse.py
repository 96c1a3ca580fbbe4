"""Which values of a decoder layer the layer loop's next run of that layer can take from its previous runs.

The layer loop runs one layer several times per sample: up to each quant group's input (true-sequential: that
input comes through the groups quantized before it), then whole for the layer's output. Between two runs only
the weights just solved changed (and, for AWQ, the op a scale was folded into), so every value that depends on
none of them is the same as in the run before. `LayerValues` knows, per op of the block function, the weights its
results depend on (transitively); from that it tells

* `frontier(pending)`: the ops whose results a later run will want while `pending` (the weights still to be
  solved or folded in this layer) may change — results that depend on none of them, consumed by an op that
  does (or a function result). Only these are kept, so memory stays at a few activations per sample;
* `still_valid(cache, changed)`: the kept results that depend on none of the weights that did change (correctness
  does not rest on `pending` being right: anything a write touched is dropped and recomputed);
* `needed(cached, targets)`: the ops a run must execute to produce `targets` given the kept results.

A fused `top.MLP` has one more reusable value inside it: its down projection's input act(x W_gᵀ)·(x W_uᵀ), which
the down projection's capture computes anyway (`mlp_hidden`). It is kept under the key `inner_key(i)` of the op's
position `i` and depends on the op's weights but the down projection, so the layer's output run computes only
`x_act W_dᵀ` (`mlp_down`) instead of the whole MLP again; the MLP's input x is then not kept beside it (an op
with its inner value reads none of its operands).

A run that reuses values computes bit-identical results: the same kernels on the same operands. One exception,
made on purpose: when AWQ folds a group's input scale s into the rows of the linear that produces the input
(`LayerState.fold_input_scale`: v_proj's rows under attention, up_proj's rows under the MLP act), x becomes x / s
exactly in real arithmetic, so the loop divides the kept x by s (`refreshed`) instead of running attention or the
MLP's gate / up again — and so keeps nothing before x for such a fold. The result differs from a recomputation
by rounding: float32's, and the fold's own rounding of the producer's scales to their stored dtype (bf16 scales:
up to 2⁻⁹ relative per group of the producer's row).

`reads_input(cached, targets)` tells when the later runs no longer read the layer input (from o_proj's solve on:
the residual h + attention is kept and final); the loop then keeps the residual in the input's buffer instead of
beside it (`calibration._store_in_input`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from topq.ir.graph import Function, Operation, walk_ops

#: kept results of one sample's runs of a layer: op position → the op's results (`inner_key(position)` → the
#: op's inner value, one array)
Cache = dict[int, list[np.ndarray]]


def inner_key(position: int) -> int:
    """The cache key of the inner value of the op at `position` (negative: never an op position)."""
    return -1 - position


@dataclass(frozen=True)
class LayerValues:
    """The dependency structure of one block function (its top-level ops but `top.Weight`, by position)."""

    position: dict[int, int]  # id(op) → position
    producers: tuple[tuple[int, ...], ...]  # per op: the positions of the ops producing its operands
    consumers: tuple[tuple[int, ...], ...]
    weights: tuple[frozenset[str], ...]  # per op: every weight its results depend on
    outputs: frozenset[int]  # ops producing a function result that the runs are read for
    inner: dict[int, frozenset[str]]  # top.MLP position → every weight its inner value (mlp_hidden's act) depends on
    input_readers: frozenset[int] = frozenset()  # the ops reading the function's first argument (the layer input)

    @classmethod
    def of(cls, function: Function, read: Sequence[int] | None = None) -> LayerValues:
        """`read`: the function results the caller reads (their indices; default all). The calibration loop reads
        only the hidden state, so the K / V a block also returns for the KV cache are not kept between its runs."""
        weight_of: dict[int, str] = {}  # id(value) → weight name, for top.Weight results
        made_by: dict[int, int] = {}  # id(value) → producing op's position
        position: dict[int, int] = {}
        producers: list[tuple[int, ...]] = []
        weights: list[frozenset[str]] = []
        inner: dict[int, frozenset[str]] = {}
        first = function.args[0] if function.args else None
        input_readers: set[int] = set()
        for op in function.ops:
            if op.name == "top.Weight":
                weight_of[id(op.results[0])] = str(op.attrs["name"])
                continue
            i = position[id(op)] = len(producers)
            if any(v is first for o in walk_ops([op]) for v in o.operands):  # nested regions included
                input_readers.add(i)
            ops = tuple(dict.fromkeys(made_by[id(v)] for v in op.operands if id(v) in made_by))
            producers.append(ops)
            weights.append(frozenset(weight_of[id(v)] for v in op.operands if id(v) in weight_of).union(
                *(weights[p] for p in ops)))
            made_by.update((id(r), i) for r in op.results)
            if op.name == "top.MLP" and id(op.operands[3]) in weight_of:  # all but w_down (operand 3)
                inner[i] = weights[i] - {weight_of[id(op.operands[3])]}
        consumers: list[list[int]] = [[] for _ in producers]
        for i, ops in enumerate(producers):
            for p in ops:
                consumers[p].append(i)
        results = function.results if read is None else [function.results[i] for i in read]
        outputs = frozenset(made_by[id(v)] for v in results if id(v) in made_by)
        return cls(position, tuple(producers), tuple(tuple(c) for c in consumers), tuple(weights), outputs, inner,
                   frozenset(input_readers))

    def frontier(self, pending: Iterable[str]) -> frozenset[int]:
        """The inner values that depend on no `pending` weight inside an op whose result does; and the ops whose
        results depend on no `pending` weight but feed an op that does and will read them — not an op whose inner
        value is kept, which reads none of its operands again (`needed`) — or are a function result read."""
        pending = frozenset(pending)
        final = [not (w & pending) for w in self.weights]
        inner = frozenset(i for i, w in self.inner.items() if not final[i] and not (w & pending))
        return frozenset(i for i, ok in enumerate(final) if ok and (
            i in self.outputs or any(not final[c] and c not in inner for c in self.consumers[i]))) | \
            frozenset(inner_key(i) for i in inner)

    def depends_on(self, key: int) -> frozenset[str]:
        """The weights a cached value (an op's results, or an inner value) depends on."""
        return self.weights[key] if key >= 0 else self.inner[inner_key(key)]

    def still_valid(self, cache: Mapping[int, list[np.ndarray]], changed: Iterable[str],
                    refreshed: Mapping[int, frozenset[str]] | None = None) -> Cache:
        """The kept values that no `changed` weight touched, or only weights the loop already brought that value
        up to date with (`refreshed`: key → weights; a scale folded into the value's producer)."""
        changed, refreshed = frozenset(changed), refreshed or {}
        return {i: v for i, v in cache.items() if not self.depends_on(i) & (changed - refreshed.get(i, frozenset()))}

    def needed(self, cached: Iterable[int], targets: Iterable[int]) -> frozenset[int]:
        """The ops to execute so that every target's results are known, given the `cached` ones."""
        cached = frozenset(cached)
        run: set[int] = set()
        todo = [t for t in targets if t not in cached]
        while todo:
            i = todo.pop()
            if i in run:
                continue
            run.add(i)
            if inner_key(i) in cached:  # the op computes its result from its inner value and its own weight
                continue
            todo.extend(p for p in self.producers[i] if p not in cached and p not in run)
        return frozenset(run)

    def reads_input(self, cached: Iterable[int], targets: Iterable[int]) -> bool:
        """Whether producing `targets` from the `cached` results reads the layer input (the function's first
        argument)."""
        return bool(self.needed(cached, targets) & self.input_readers)

    def at(self, op: Operation) -> int:
        return self.position[id(op)]
