"""Pattern rewriting: patterns as a table keyed by op name, a driver that applies them to a fixed point.

A pattern is a function `(op, rewriter) -> bool`. It may build replacement ops with `rewriter.builder`
(they are inserted before `op`) and call `rewriter.replace(op, values)` or `rewriter.erase(op)`;
it returns True when it changed something.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from topq.ir.builder import Builder
from topq.ir.errors import TopqError
from topq.ir.graph import Block, Function, Module, Operation, Value

Pattern = Callable[[Operation, "Rewriter"], bool]
PatternTable = Mapping[str, Sequence[Pattern]]


class Rewriter:
    def __init__(self, module: Module) -> None:
        self.builder = Builder(module)
        # Keyed by id() for speed; each entry also holds the old value so its id cannot be reused by a new
        # object while the rewriter lives (the replaced op may otherwise be garbage-collected).
        self.replacements: dict[int, tuple[Value, Value]] = {}
        self.erased: dict[int, Operation] = {}

    def replace(self, op: Operation, values: Sequence[Value]) -> None:
        if len(values) != len(op.results):
            raise TopqError(f"replacing {op.name}: {len(values)} values for {len(op.results)} results")
        for old, new in zip(op.results, values):
            self.replacements[id(old)] = (old, new)
        self.erased[id(op)] = op

    def erase(self, op: Operation) -> None:
        self.erased[id(op)] = op

    def resolve(self, value: Value) -> Value:
        while id(value) in self.replacements:
            value = self.replacements[id(value)][1]
        return value


def _rewrite_block(block: Block, table: PatternTable, rewriter: Rewriter) -> bool:
    changed = False
    new_ops: list[Operation] = []
    with rewriter.builder.at(Block()) as staging:
        for op in block.ops:
            op.operands = [rewriter.resolve(v) for v in op.operands]
            for region in op.regions:
                for inner in region.blocks:
                    changed |= _rewrite_block(inner, table, rewriter)
            for pattern in table.get(op.name, ()):
                if pattern(op, rewriter):
                    changed = True
                    break
            new_ops.extend(staging.ops)  # ops the pattern built come before the op they replace
            staging.ops.clear()
            if id(op) not in rewriter.erased:
                new_ops.append(op)
    block.ops = new_ops
    return changed


def apply_patterns(module: Module, table: PatternTable, max_iterations: int = 64) -> int:
    """Apply the table to every function until nothing changes; return the number of sweeps that changed IR."""
    sweeps = 0
    for _ in range(max_iterations):
        rewriter = Rewriter(module)
        changed = False
        for function in module:
            changed |= _rewrite_function(function, table, rewriter)
        if not changed:
            return sweeps
        sweeps += 1
    raise TopqError(f"pattern rewriting did not reach a fixed point in {max_iterations} sweeps")


def _rewrite_function(function: Function, table: PatternTable, rewriter: Rewriter) -> bool:
    changed = _rewrite_block(function.body, table, rewriter)
    function.results = [rewriter.resolve(v) for v in function.results]
    return changed
