"""Raw kernels (`top.DSLRegion`, docs/raw_kernels.md) on the BM1684X family: lowering, staging, inlining, local
memory, emulation and the element-op count the performance model uses.

The passes follow FlagTree's TLE-Raw (ConvertArgToMemDesc, then DSLRegionInline):

1. **lowering** (`lowering_pattern`): `top.DSLRegion` → `tpu.DSLRegion`, the same operands (now tpu values in the
   mode's storage dtype) and the same region; results in the storage dtype. It is an ordinary value op here, so
   dead-op elimination treats it like any other.
2. **staging** (`stage_regions`): every operand gets a local buffer typed like the kernel's block argument
   (`tpu.LocalAlloc`) and is copied into it (`tpu.LocalStore`, DDR → local: bf16 → f32 conversion in BF16 mode);
   the region now takes the buffers and its results are the output buffers after the body; each result is
   copied back (`tpu.LocalLoad`, local → DDR, rounded to the storage dtype) and every buffer is released
   (`tpu.LocalFree`).
3. **inlining** (`inline_regions`): the region's body replaces the op, its block arguments replaced by the local
   buffers and its `scf.yield` dropped (the yielded buffers replace the op's results, i.e. the LocalLoad operands).

The program then reads, for one region:

    %a0 = "tpu.LocalAlloc"() {kernel = "...:silu", name = "y", offset = 0}        : () -> tensor<1x64x1536xf32>
    %a1 = "tpu.LocalAlloc"() {kernel = "...:silu", name = "x", offset = 393216}   : () -> tensor<1x64x1536xf32>
    "tpu.LocalStore"(%v, %a0) ...    "tpu.LocalStore"(%v, %a1) ...
    ... kernel IR: scf.for / memref.load %a1 / arith / math / memref.store %a0 ...
    %r = "tpu.LocalLoad"(%a0) {dtype = "bf16"} : (tensor<1x64x1536xf32>) -> tensor<1x64x1536xbf16>
    "tpu.LocalFree"(%a0) ...    "tpu.LocalFree"(%a1) ...

Kernel ops carry no pass attributes (the kernel IR catalogue has none): the layer-group pass makes each staged
region a group of its own (`sections`), places its buffers in local memory (`place_buffers`, which refuses a region
whose buffers exceed the chip's local memory) and gives only the staging ops the group id; the DDR plan skips kernel
ops. The emulator runs each run of consecutive kernel ops with `topq.raw`'s own `BlockExecutor` on numpy views of a
simulated local memory (`LocalSpace`), separate from DDR.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from topq.core.errors import TopqError
from topq.ir.graph import Block, Function, Operation, Value, walk_ops
from topq.ir.rewrite import Rewriter
from topq.ir.types import ELEMENT_TYPES, ScalarType, TensorType
from topq.plugins.targets.bm1684x import dialect  # noqa: F401  (registers the tpu ops, the staging ones included)
from topq.plugins.targets.bm1684x.spec import ChipSpec
from topq.raw.interpret import BlockExecutor

#: the kernel IR dialects (topq/raw/kernel_ops.py): after inlining, these ops sit in a function's body
KERNEL_DIALECTS = ("scf.", "arith.", "memref.", "math.")
STAGING_OPS = frozenset({"tpu.LocalAlloc", "tpu.LocalStore", "tpu.LocalLoad", "tpu.LocalFree"})
#: local buffers start at multiples of this many bytes (one EU row of a lane)
LOCAL_ALIGN = 64
POISON = 0xFF

Reader = Callable[[], np.ndarray]
Writer = Callable[[np.ndarray], None]
StepParts = tuple[Callable[[list[np.ndarray], dict[str, Any]], list[np.ndarray]], list[Reader], list[Writer]]


def is_kernel_op(op: Operation) -> bool:
    return op.name.startswith(KERNEL_DIALECTS)


def is_raw_op(op: Operation) -> bool:
    """A staging op or an inlined kernel op: the ops of a staged raw region in a lowered function."""
    return op.name in STAGING_OPS or op.name.startswith(KERNEL_DIALECTS)


def is_local_buffer(value: Value) -> bool:
    owner = value.owner
    return isinstance(owner, Operation) and owner.name == "tpu.LocalAlloc"


# ------------------------------------------------------------------------------------------------ lowering


def lowering_pattern(dtype: str) -> Callable[[Operation, Rewriter], bool]:
    """`top.DSLRegion` → `tpu.DSLRegion` with results in the storage dtype `dtype` (operands are already lowered)."""

    def pattern(op: Operation, rw: Rewriter) -> bool:
        # Results are inferred as the output operands' types: each output starts as its operand, in storage dtype.
        new = rw.builder.create("tpu.DSLRegion", op.operands, {**op.attrs, "dtype": dtype}, regions=op.regions,
                                loc=op.loc)
        rw.replace(op, new.results)
        return True

    return pattern


def _replace_uses(function: Function, mapping: dict[int, Value]) -> None:
    """Replace every use of the values in `mapping` (by id), nested regions and the function's results included."""
    if not mapping:
        return
    for op in function.walk():
        op.operands = [mapping.get(id(v), v) for v in op.operands]
    function.results = [mapping.get(id(v), v) for v in function.results]


def stage_regions(function: Function) -> int:
    """ConvertArgToLocal: bracket each `tpu.DSLRegion` with LocalAlloc + LocalStore before and LocalLoad +
    LocalFree after; the region then operates on the buffers. Return the number of regions staged."""
    ops: list[Operation] = []
    mapping: dict[int, Value] = {}
    staged = 0
    for op in function.ops:
        if op.name != "tpu.DSLRegion" or all(is_local_buffer(v) for v in op.operands):
            ops.append(op)
            continue
        body = op.regions[0].block
        n = int(op.attrs["num_outputs"])
        names = list(op.attrs.get("arg_names") or [f"arg{i}" for i in range(len(body.args))])
        kernel = str(op.attrs.get("kernel", ""))
        if len(body.args) != len(op.operands):
            raise TopqError(f"{kernel or 'tpu.DSLRegion'} ({op.loc}): {len(op.operands)} operands but the region "
                            f"takes {len(body.args)} buffers")
        allocs = [Operation("tpu.LocalAlloc", [], [arg.type], {"name": name, "kernel": kernel}, loc=op.loc)
                  for arg, name in zip(body.args, names)]
        buffers = [a.results[0] for a in allocs]
        stores = [Operation("tpu.LocalStore", [x, b], [], {}, loc=op.loc) for x, b in zip(op.operands, buffers)]
        region = Operation("tpu.DSLRegion", buffers, [b.type for b in buffers[:n]], dict(op.attrs), op.regions,
                           op.loc)
        loads = [Operation("tpu.LocalLoad", [r], [old.type], {"dtype": op.attrs["dtype"]}, loc=op.loc)
                 for r, old in zip(region.results, op.results)]
        frees = [Operation("tpu.LocalFree", [b], [], {}, loc=op.loc) for b in buffers]
        mapping.update((id(old), load.results[0]) for old, load in zip(op.results, loads))
        ops += [*allocs, *stores, region, *loads, *frees]
        staged += 1
    function.body.ops = ops
    _replace_uses(function, mapping)
    return staged


def inline_regions(function: Function) -> int:
    """DSLRegionInline: replace each staged `tpu.DSLRegion` by its body (block arguments → the local buffers,
    results → the yielded buffers). Return the number of regions inlined."""
    ops: list[Operation] = []
    mapping: dict[int, Value] = {}
    inlined = 0
    for op in function.ops:
        if op.name != "tpu.DSLRegion":
            ops.append(op)
            continue
        if not all(is_local_buffer(v) for v in op.operands):
            raise TopqError(f"{op.attrs.get('kernel') or 'tpu.DSLRegion'} ({op.loc}): a region must be staged "
                            f"into local memory before it is inlined")
        body = op.regions[0].block
        if not body.ops or body.ops[-1].name != "scf.yield":
            raise TopqError(f"{op.attrs.get('kernel') or 'tpu.DSLRegion'} ({op.loc}): the region does not end in "
                            f"scf.yield")
        args = {id(arg): buf for arg, buf in zip(body.args, op.operands)}
        for inner in walk_ops(body.ops):
            inner.operands = [args.get(id(v), v) for v in inner.operands]
        *kernel_ops, terminator = body.ops
        mapping.update((id(r), y) for r, y in zip(op.results, terminator.operands))
        ops += kernel_ops
        inlined += 1
    function.body.ops = ops
    _replace_uses(function, mapping)
    return inlined


def lower_raw_regions(function: Function) -> None:
    """The two passes after the pattern lowering: staging, then inlining."""
    if any(op.name == "tpu.DSLRegion" for op in function.ops):
        stage_regions(function)
        inline_regions(function)


# ------------------------------------------------------------------------------------------------ layer groups


def sections(ops: Sequence[Operation]) -> Iterator[tuple[int, int]]:
    """[start, end) index ranges of the staged regions in a lowered function's op list: maximal runs of raw ops,
    split where a LocalFree is followed by a LocalAlloc (two regions back to back are two groups)."""
    i = 0
    while i < len(ops):
        if not is_raw_op(ops[i]):
            i += 1
            continue
        j = i + 1
        while j < len(ops) and is_raw_op(ops[j]) and not (
                ops[j].name == "tpu.LocalAlloc" and ops[j - 1].name == "tpu.LocalFree"):
            j += 1
        yield i, j
        i = j


def place_buffers(ops: Sequence[Operation], chip: ChipSpec, where: str) -> int:
    """Give each LocalAlloc of one staged region its byte `offset` in local memory (the region's group owns all of
    it while it runs); raise when the buffers do not fit. Return the bytes used."""
    allocs = [op for op in ops if op.name == "tpu.LocalAlloc"]
    cursor = 0
    for op in allocs:
        op.attrs["offset"] = cursor
        cursor += -(-op.results[0].type.nbytes // LOCAL_ALIGN) * LOCAL_ALIGN  # type: ignore[union-attr]
    if cursor > chip.local_mem:
        kernel = next((op.attrs.get("kernel") for op in allocs if op.attrs.get("kernel")), "") or "raw kernel"
        sizes = ", ".join(f"{op.attrs.get('name') or '?'} {op.results[0].type} {op.results[0].type.nbytes} B"  # type: ignore[union-attr]
                          for op in allocs)
        raise TopqError(f"{where}: raw kernel {kernel} ({allocs[0].loc}) stages {cursor} B into local memory "
                        f"({sizes}), more than {chip.name}'s {chip.local_mem} B ({chip.lanes} lanes x "
                        f"{chip.local_mem_per_lane} B)")
    return cursor


# ------------------------------------------------------------------------------------------------ emulator


class LocalSpace:
    """The chip's local memory as one flat byte array (lanes × local_mem_per_lane), separate from DDR.

    With `checked`, every buffer's life is tracked per call: a LocalAlloc must find its bytes free (and poisons
    them with 0xFF = NaN), any use needs the buffer live, a LocalFree needs it live (so a buffer is freed exactly
    once; it is poisoned again), and at the end of the call no buffer may still be live."""

    def __init__(self, chip: ChipSpec, checked: bool = False) -> None:
        self.chip = chip
        self.mem = np.zeros(chip.local_mem, np.uint8)
        self.checked = checked
        self.live: dict[int, tuple[str, int, int]] = {}  # buffer key → (name, offset, nbytes)
        self.freed: set[int] = set()

    def view(self, offset: int, t: TensorType) -> np.ndarray:
        if offset < 0 or offset + t.nbytes > self.mem.size or offset % t.np_dtype.itemsize:
            raise TopqError(f"local buffer at offset {offset} (+{t.nbytes} B) is outside the "
                            f"{self.mem.size}-byte local memory or misaligned")
        return self.mem[offset:offset + t.nbytes].view(t.np_dtype).reshape(t.shape)

    def begin(self) -> None:
        """Start of a checked call: nothing is live."""
        self.live.clear()
        self.freed.clear()

    def alloc(self, key: int, name: str, offset: int, nbytes: int, where: str) -> None:
        if key in self.live:
            raise TopqError(f"checker: {where}: local buffer {name} allocated again while live")
        for other_name, o, s in self.live.values():
            if offset < o + s and o < offset + nbytes:
                raise TopqError(f"checker: {where}: local buffer {name} at {offset} (+{nbytes} B) overlaps live "
                                f"local buffer {other_name}")
        self.live[key] = (name, offset, nbytes)
        self.freed.discard(key)
        self.mem[offset:offset + nbytes] = POISON

    def use(self, key: int, name: str, where: str) -> None:
        if key not in self.live:
            state = "after it was freed" if key in self.freed else "before it was allocated"
            raise TopqError(f"checker: {where}: uses local buffer {name} {state}")

    def free(self, key: int, name: str, where: str) -> None:
        if key not in self.live:
            state = "twice" if key in self.freed else "before it was allocated"
            raise TopqError(f"checker: {where}: local buffer {name} freed {state}")
        _, offset, nbytes = self.live.pop(key)
        self.freed.add(key)
        self.mem[offset:offset + nbytes] = POISON

    def finish(self, where: str) -> None:
        if self.live:
            names = ", ".join(name for name, _, _ in self.live.values())
            self.live.clear()
            raise TopqError(f"checker: {where}: local buffers never freed: {names}")


class RawSteps:
    """Emulator steps for the raw ops of one function: staging copies, and each run of consecutive kernel ops as one
    `BlockExecutor` (topq.raw's interpreter) whose block arguments are the run's local buffers."""

    def __init__(self, space: LocalSpace, function: Function, reader: Callable[[Value], Reader],
                 writer: Callable[[Value], Writer]) -> None:
        self.space = space
        self.function = function
        self.reader = reader
        self.writer = writer
        self.runs: dict[int, list[Operation]] = {}  # id(first op of a run of kernel ops) → the run
        self.in_run: set[int] = set()
        ops = function.ops
        i = 0
        while i < len(ops):
            if is_kernel_op(ops[i]):
                j = i
                while j < len(ops) and is_kernel_op(ops[j]):
                    j += 1
                self.runs[id(ops[i])] = ops[i:j]
                self.in_run.update(id(op) for op in ops[i:j])
                i = j
            else:
                i += 1
        self.keys: dict[int, int] = {}  # id(buffer value) → key in the LocalSpace

    def _buffer(self, value: Value) -> tuple[int, str, np.ndarray]:
        owner = value.owner
        if not is_local_buffer(value):
            raise TopqError(f"@{self.function.name}: a kernel op addresses {value.type}, which is not a local buffer")
        assert isinstance(owner, Operation)
        if "offset" not in owner.attrs:
            raise TopqError(f"@{self.function.name}: local buffer {owner.attrs.get('name')} has no offset "
                            f"(the program was not placed by the layer-group pass)")
        key = self.keys.setdefault(id(value), len(self.keys))
        return key, str(owner.attrs.get("name") or "?"), self.space.view(int(owner.attrs["offset"]), value.type)  # type: ignore[arg-type]

    def _where(self, op: Operation) -> str:
        return f"@{self.function.name}: {op.loc or ''} ({op.name})"

    def step(self, op: Operation) -> StepParts | None:
        """The (kernel, readers, writers) of one raw op, or None when it needs no step of its own."""
        space, checked, where = self.space, self.space.checked, self._where(op)
        if op.name == "tpu.LocalAlloc":
            if not checked:
                return None  # the buffer is a fixed view; only the checker tracks its life
            key, name, view = self._buffer(op.results[0])
            offset = int(op.attrs["offset"])

            def alloc(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
                space.alloc(key, name, offset, view.nbytes, where)
                return []

            return alloc, [], []
        if op.name == "tpu.LocalFree":
            if not checked:
                return None
            key, name, _ = self._buffer(op.operands[0])

            def free(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
                space.free(key, name, where)
                return []

            return free, [], []
        if op.name == "tpu.LocalStore":
            key, name, view = self._buffer(op.operands[1])

            def store(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
                if checked:
                    space.use(key, name, where)
                np.copyto(view, args[0], casting="unsafe")  # storage dtype → the kernel's dtype (exact for floats)
                return []

            return store, [self.reader(op.operands[0])], []
        if op.name == "tpu.LocalLoad":
            key, name, view = self._buffer(op.operands[0])

            def load(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
                if checked:
                    space.use(key, name, where)
                return [view]  # the result's writer rounds to the storage dtype as it copies

            return load, [], [self.writer(op.results[0])]
        if id(op) in self.in_run:
            run = self.runs.get(id(op))
            return None if run is None else self._kernel(run, where)
        raise TopqError(f"the bm1684x emulator cannot execute {op.name}")

    def _kernel(self, run: list[Operation], where: str) -> StepParts:
        buffers: dict[int, Value] = {}
        for inner in walk_ops(run):
            for v in inner.operands:
                if isinstance(v.type, TensorType):
                    buffers.setdefault(id(v), v)
        values = list(buffers.values())
        parts = [self._buffer(v) for v in values]
        names = [name for _, name, _ in parts]
        kernel = next((str(v.owner.attrs.get("kernel")) for v in values  # type: ignore[union-attr]
                       if v.owner.attrs.get("kernel")), "raw kernel")  # type: ignore[union-attr]
        # A synthetic block: its "arguments" are the local buffer values the run addresses, so the interpreter binds
        # them to the local-memory views exactly as it binds a region's block arguments on the host.
        executor = BlockExecutor(Block(values, list(run)), kernel, names)
        views = [view for _, _, view in parts]
        space, checked = self.space, self.space.checked

        def execute(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
            if checked:
                for key, name, _ in parts:
                    space.use(key, name, where)
            executor.run(views)
            return []

        return execute, [], []


# ------------------------------------------------------------------------------------------------ perf model

#: kernel IR ops the vector unit executes once per element (index arithmetic and loads/stores are addressing)
ELEMENT_OPS = frozenset({
    "arith.addf", "arith.subf", "arith.mulf", "arith.divf", "arith.maximumf", "arith.minimumf", "arith.negf",
    "arith.cmpf", "arith.select", "arith.sitofp",
    "math.exp", "math.log", "math.sqrt", "math.rsqrt", "math.tanh", "math.absf", "math.erf",
})


def _index(value: Value, env: dict[int, int]) -> int | None:
    """The static value of an index expression (constants, known induction variables, index arithmetic)."""
    if id(value) in env:
        return env[id(value)]
    op = value.owner
    if not isinstance(op, Operation):
        return None
    if op.name == "arith.constant":
        return int(op.attrs["value"])
    fn = {"arith.addi": lambda a, b: a + b, "arith.subi": lambda a, b: a - b, "arith.muli": lambda a, b: a * b,
          "arith.floordivsi": lambda a, b: a // b, "arith.maxsi": max, "arith.minsi": min,
          "arith.index_cast": lambda a: a}.get(op.name)
    if fn is None:
        return None
    args = [_index(v, env) for v in op.operands]
    return None if any(a is None for a in args) else int(fn(*args))  # type: ignore[misc]


def _element_bytes(op: Operation) -> int:
    t = op.operands[-1].type if op.name in ("arith.cmpf", "arith.select") else op.results[0].type
    return ELEMENT_TYPES[t.name].itemsize if isinstance(t, ScalarType) and t.name in ELEMENT_TYPES else 4


def _count(block: Block, env: dict[int, int]) -> dict[int, float] | None:
    """Element ops per element size executed by one run of `block`; None when a loop bound needs an induction
    variable not in `env` (the caller then enumerates its loop)."""
    total: dict[int, float] = {}

    def add(part: dict[int, float], times: float = 1.0) -> None:
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + v * times

    for op in block.ops:
        if op.name == "scf.for":
            bounds = [_index(v, env) for v in op.operands[:3]]
            if any(b is None for b in bounds):
                return None
            lb, ub, step = bounds
            trips = range(lb, ub, step) if step and step > 0 else range(0)  # type: ignore[arg-type]
            body = op.regions[0].block
            inner = _count(body, env)
            if inner is not None:
                add(inner, len(trips))
                continue
            for i in trips:  # bounds inside depend on this loop's variable (a triangular nest)
                part = _count(body, {**env, id(body.args[0]): i})
                if part is None:
                    raise TopqError("perf model: a raw kernel loop bound depends on a loop-carried value")
                add(part)
        elif op.name == "scf.if":
            # Lanes that disagree run both branches under masks on a SIMD unit: count both.
            for region in op.regions:
                part = _count(region.block, env)
                if part is None:
                    return None
                add(part)
        elif op.name in ELEMENT_OPS:
            add({_element_bytes(op): 1.0})
    return total


def element_ops(block: Block) -> dict[int, float]:
    """Element ops (by element size in bytes) one run of a kernel body executes: each float op once per dynamic
    execution (static loop trip counts; both branches of an `if`)."""
    counts = _count(block, {})
    if counts is None:
        raise TopqError("perf model: a raw kernel loop bound is not static")
    return counts
