"""Which `scf.for` loops of a kernel body the host executor may run as one numpy operation per op.

A loop is *vectorised* when all its iterations can run in lockstep, each lane being one iteration:

1. it has no iter_args (nothing is carried from one iteration to the next in SSA), and
2. nothing is carried through memory either: for every buffer the loop body stores to, there is a subscript
   position where all loads and stores of that buffer in the body use the loop's induction variable itself
   (so each iteration touches only its own slice of the buffer: `y[i, j] = y[i - 1, j]` in a loop over `j`
   is fine, in a loop over `i` it is not), and
3. the bounds of every loop nested in it do not depend on its induction variable (lanes stay rectangular).

`scf.if` inside a vectorised loop needs no rule: a lane-dependent condition runs both branches under masks.
Loops with iter_args (reductions) are never vectorised, so their float32 sums keep the source's order.

The result maps each vectorised loop to its lane axis (how many vectorised loops enclose it) and the rank of
lane arrays in its nest (1 + the deepest axis under the outermost vectorised loop).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from topq.ir.graph import Block, Operation, Value


@dataclass(frozen=True)
class LaneAxis:
    axis: int
    rank: int


def walk_block(block: Block) -> Iterator[Operation]:
    """Every op in a block, nested regions included, in program order."""
    for op in block.ops:
        yield op
        for region in op.regions:
            for inner in region.blocks:
                yield from walk_block(inner)


def _varying(body: Block, iv: Value) -> set[int]:
    """Ids of the values in `body` that may differ between the loop's lanes (a fixed point of data flow)."""
    varying = {id(iv)}
    changed = True
    while changed:
        changed = False
        for op in walk_block(body):
            inputs = list(op.operands)
            if op.name in ("scf.for", "scf.if"):
                # A region op varies if anything computed inside it does (e.g. a sum over lane-varying loads).
                inputs += [v for region in op.regions for b in region.blocks for o in walk_block(b) for v in o.operands]
            if any(id(v) in varying for v in inputs):
                outs = list(op.results)
                if op.name == "scf.for":
                    outs += op.regions[0].block.args[1:]
                for v in outs:
                    if id(v) not in varying:
                        varying.add(id(v))
                        changed = True
    return varying


def is_vectorisable(loop: Operation) -> bool:
    if len(loop.operands) != 3 or loop.results:
        return False
    body = loop.regions[0].block
    iv = body.args[0]
    varying = _varying(body, iv)
    accesses: dict[int, list[tuple[int, ...]]] = {}
    stored: set[int] = set()
    for op in walk_block(body):
        if op.name == "scf.for" and any(id(v) in varying for v in op.operands[:3]):
            return False
        if op.name == "memref.load":
            accesses.setdefault(id(op.operands[0]), []).append(tuple(id(v) for v in op.operands[1:]))
        elif op.name == "memref.store":
            stored.add(id(op.operands[1]))
            accesses.setdefault(id(op.operands[1]), []).append(tuple(id(v) for v in op.operands[2:]))
    for buffer in stored:
        # Positions where every access to the buffer subscripts with the induction variable itself: a lane
        # then only ever touches elements whose coordinate there is its own iteration number.
        common = set.intersection(*({p for p, v in enumerate(index) if v == id(iv)} for index in accesses[buffer]))
        if not common:
            return False
    return True


def plan_lanes(block: Block) -> dict[int, LaneAxis]:
    """id(scf.for op) → its lane axis, for every loop in `block` (recursively) that is vectorised."""
    axes: dict[int, int] = {}

    def visit(b: Block, depth: int) -> int:
        """Assign axes below `b`; return the deepest axis assigned (-1 for none)."""
        deepest = -1
        for op in b.ops:
            vector = op.name == "scf.for" and is_vectorisable(op)
            if vector:
                axes[id(op)] = depth
                deepest = max(deepest, depth)
            for region in op.regions:
                for inner in region.blocks:
                    deepest = max(deepest, visit(inner, depth + 1 if vector else depth))
        return deepest

    plan: dict[int, LaneAxis] = {}

    def nests(b: Block) -> None:
        """Give every loop of each outermost vectorised nest the nest's lane rank."""
        for op in b.ops:
            if id(op) in axes and axes[id(op)] == 0:
                rank = 1 + visit_rank(op)
                for inner in [op, *walk_block(op.regions[0].block)]:
                    if id(inner) in axes:
                        plan[id(inner)] = LaneAxis(axes[id(inner)], rank)
            else:
                for region in op.regions:
                    for inner in region.blocks:
                        nests(inner)

    def visit_rank(op: Operation) -> int:
        return max(axes[id(o)] for o in [op, *walk_block(op.regions[0].block)] if id(o) in axes)

    visit(block, 0)
    nests(block)
    return plan
