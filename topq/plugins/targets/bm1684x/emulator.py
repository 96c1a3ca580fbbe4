"""The BM1684X-family emulator: runs a compiled tpu program on a simulated DDR with the chip's numerics.

DDR is one numpy uint8 array of the planned size; every DDR tensor is a typed view at its planned address
(weights in the coefficient region, each layer's KV cache in its fixed region, activations in the shared region).
Values a layer group keeps in local memory never get an address: the emulator holds them in a slot list, rounded
to their dtype as the chip stores them. Kernels are in `kernels.py`; a function is compiled once into a flat list
of steps (kernel, operand readers, result writers) like `topq.ir.interpreter.Interpreter`'s plans, whose Top
reference kernels it reuses for the ops that compute in f32.

Weights are decoded once per loaded bundle, on the first function that uses them, from the bytes in DDR:
float weights to f32, W4/W8 weights unpacked and dequantized ((code - zp) * scale, rounded to the compute dtype),
the MLP's gate and up stacked into one matrix (W8A8 requant multipliers, shifts and int32 biases are read as
stored integers). Later calls only run the GEMMs.

KV cache: the runtime's Session owns float32 caches and passes `[1, S, KVH, D]` views of them as history
inputs; the emulator keeps its own copy in the DDR KV regions. The program's `tpu.KVStore` writes each call's new
rows there (as the chip does), and before a call the emulator copies from the caller's array only the rows it has
not mirrored yet: rows below the last write offset that the mask makes visible — for a Session, exactly the rows
the previous call produced (O(new tokens)). The mirror is tied to the caller's array (a weak reference and its
data pointer); another array means a full copy of the visible rows. The one assumption is that a caller does not
rewrite history rows it has already passed without the emulator writing them first (the Session never does);
checker mode verifies the mirror on every call, and `kv_sync="copy"` (or TOPQ_BM_KV_SYNC=copy) copies every
visible row every time.

Recurrent states: each recurrent layer's f32 states live in their fixed DDR regions; the ops that carry them read
the old state there and write the new one over it. A call hands the caller each new state as a read-only copy and
remembers it; when the next call passes back that very array, the region already holds it and nothing is copied
(a Session passes back what it was handed). Any other array (the zero states of a new conversation, states saved
for a truncation, a test's random ones) is copied into the region first; checker mode verifies the region against
the caller's array on every call.

Batched logits: `run("lm_head", [h])` also takes h of [1, T, H] (the runtime's perplexity asks for a segment's
logits at once). The program plans DDR for one position, so those calls run the same steps and kernels on values
the emulator holds itself, each rounded to its dtype as a DDR store rounds it (`_run_positions`).

Checker mode (`checker=True`, recipe `target.checker: true`, or TOPQ_CHECKER=1) tracks which tensor owns each
DDR granule: it fails naming both tensors when a write lands on a live tensor or a read finds its bytes owned by
another one, poisons every freed region with 0xFF (NaN in every float dtype) and fails on a read of a freed
buffer, and checks the KV mirror against the caller's history.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from topq.core.errors import TopqError
from topq.ir.catalogue import CATALOGUE
from topq.ir.graph import Block, Function, Module, Operation, Value
from topq.ir.int8 import uses_requant
from topq.ir.interpreter import other_positions
from topq.ir.parser import parse_module
from topq.ir.reference_ops import REFERENCE_OPS
from topq.ir.types import TensorType
from topq.plugins.targets.bm1684x import (
    dialect,  # noqa: F401  (registers the tpu ops)
    raw,
)
from topq.plugins.targets.bm1684x.dialect import moe_parts
from topq.plugins.targets.bm1684x.kernels import KERNELS, rnd, visible_history
from topq.plugins.targets.bm1684x.layer_group import VIEW_OPS, is_weight, root
from topq.plugins.targets.bm1684x.memory import state_bindings, value_name
from topq.plugins.targets.bm1684x.modes import FLOAT_DTYPES
from topq.plugins.targets.bm1684x.packing import dequantize
from topq.plugins.targets.bm1684x.spec import ChipSpec

F32 = np.float32
POISON = 0xFF
#: tpu ops that compute each position (row) alone and hold no shape of their own: an `lm_head` of only these also
#: runs on [1, T, H] (the runtime's batched logits)
POSITION_WISE = frozenset({"tpu.Weight", "tpu.RMSNorm", "tpu.LayerNorm", "tpu.MatMul", "tpu.A16MatMul",
                           "tpu.MatMulInt8", "tpu.Add", "tpu.Mul", "tpu.MulConst", "tpu.Tanh", "tpu.Cast"})
Reader = Callable[[], np.ndarray]
Writer = Callable[[np.ndarray], None]


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# ------------------------------------------------------------------------------------------- checker


class Checker:
    """Ownership of DDR granules (`spec.global_align` bytes; planned addresses are aligned to it)."""

    def __init__(self, ddr: np.ndarray, granule: int) -> None:
        self.ddr = ddr
        self.g = granule
        count = -(-ddr.size // granule)
        self.owner = np.full(count, -1, np.int64)
        self.alive = np.zeros(count, bool)
        self.names: dict[int, str] = {}

    def register(self, name: str) -> int:
        tid = len(self.names)
        self.names[tid] = name
        return tid

    def _span(self, addr: int, nbytes: int) -> slice:
        return slice(addr // self.g, -(-(addr + max(nbytes, 1)) // self.g))

    def claim(self, tid: int, addr: int, nbytes: int, where: str) -> None:
        span = self._span(addr, nbytes)
        owners, alive = self.owner[span], self.alive[span]
        clash = alive & (owners != tid) & (owners >= 0)
        if clash.any():
            other = int(owners[np.argmax(clash)])
            raise TopqError(f"checker: {where}: writing {self.names[tid]} at 0x{addr:x} (+{nbytes} B) overlaps live "
                            f"{self.names[other]}")
        owners[:] = tid
        alive[:] = True

    def read(self, tid: int, addr: int, nbytes: int, where: str) -> None:
        span = self._span(addr, nbytes)
        owners, alive = self.owner[span], self.alive[span]
        if (owners == tid).all() and alive.all():
            return
        bad = int(np.argmax((owners != tid) | ~alive))
        other = int(owners[bad])
        what = self.names[tid]
        if other == tid:
            raise TopqError(f"checker: {where}: reads {what} at 0x{addr:x} after it was freed (dead buffer)")
        if other < 0:
            raise TopqError(f"checker: {where}: reads {what} at 0x{addr:x}, but no tensor was written there")
        state = "live" if alive[bad] else "dead (freed)"
        raise TopqError(f"checker: {where}: reads {what} at 0x{addr:x}, but that memory holds {state} "
                        f"{self.names[other]}")

    def free(self, tid: int, addr: int, nbytes: int) -> None:
        span = self._span(addr, nbytes)
        mine = self.owner[span] == tid
        self.alive[span][mine] = False
        self.ddr[addr:addr + nbytes] = POISON

    def release(self, base: int, size: int) -> None:
        """Start of a function: the activation region holds nothing live (and is poisoned)."""
        span = self._span(base, size)
        self.owner[span] = -1
        self.alive[span] = False
        self.ddr[base:base + size] = POISON


# ------------------------------------------------------------------------------------------- plans


@dataclass
class DdrRef:
    tid: int  # checker id (-1 without checker)
    addr: int
    nbytes: int


@dataclass
class Step:
    op: Operation
    kernel: Callable[[list[np.ndarray], dict[str, Any]], list[np.ndarray]]
    readers: list[Reader]
    writers: list[Writer]
    attrs: dict[str, Any]
    reads: list[DdrRef] = field(default_factory=list)
    writes: list[DdrRef] = field(default_factory=list)
    frees: list[DdrRef] = field(default_factory=list)


@dataclass
class FunctionPlan:
    function: Function
    args: list[TensorType]
    arg_writers: list[Writer | None]
    arg_refs: list[DdrRef | None]
    history: list[tuple[int, int, str]]  # (arg index, layer, kind)
    mask_arg: int | None
    steps: list[Step]
    outputs: list[Reader]
    output_refs: list[DdrRef | None]
    frees_after_inputs: list[DdrRef] = field(default_factory=list)
    attention_attrs: list[dict[str, Any]] = field(default_factory=list)  # get this call's visible history rows
    states_in: list[tuple[int, tuple[int, int]]] = field(default_factory=list)  # (arg index, state region key)
    states_out: list[tuple[int, tuple[int, int]]] = field(default_factory=list)  # (result index, state region key)


@dataclass
class KVMirror:
    view: np.ndarray  # [rows, KVH, D] in the cache dtype, inside DDR
    tid: int
    addr: int
    owner: Any = None  # weakref to the caller's array, or None
    pointer: int = 0
    trusted: int = 0  # leading rows known equal to the caller's
    copied: int = 0  # rows copied from callers so far (observability: O(new tokens) per call)


@dataclass
class StateRegion:
    """A recurrent layer's carried state in its fixed DDR region."""

    view: np.ndarray  # the f32 state, inside DDR
    tid: int
    addr: int
    handed: Any = None  # weakref to the read-only array the last call returned (what the region holds)
    copied: int = 0  # caller arrays copied in so far (observability: a Session's calls copy none)


class Emulator:
    """Executor of a compiled program: `run(name, inputs) -> outputs` (the runtime's Executor protocol)."""

    def __init__(self, program: str | Module, tensor: Callable[[str], np.ndarray], chip: ChipSpec,
                 checker: bool = False, kv_sync: str = "incremental") -> None:
        self.module = parse_module(program, source="bm1684x program") if isinstance(program, str) else program
        self.chip = chip
        if kv_sync not in ("incremental", "copy"):
            raise TopqError(f"kv_sync must be 'incremental' or 'copy', got {kv_sync!r}")
        self.kv_sync = kv_sync
        attrs = self.module.attrs
        try:
            total = int(attrs["bm.ddr"][0])
            self.act_region = tuple(int(x) for x in attrs["bm.act"])
        except (KeyError, TypeError, IndexError):
            raise TopqError("not a bm1684x program: the module has no DDR plan (bm.ddr / bm.act)") from None
        self.ddr = np.zeros(total, np.uint8)
        self.checker = Checker(self.ddr, chip.global_align) if checker else None
        self.local = raw.LocalSpace(chip, checked=checker)  # raw kernels' staged buffers (a space apart from DDR)
        self._decoded: dict[Any, np.ndarray] = {}
        self._plans: dict[str, FunctionPlan] = {}
        self._weight_ids: dict[str, int] = {}
        self.kv: dict[tuple[int, str], KVMirror] = {}
        self.states: dict[tuple[int, int], StateRegion] = {}  # (layer, state index) → its region
        self._load(tensor)
        head = self.module.functions.get("lm_head")
        #: the runtime's batched logits (`Executor` doc): lm_head on any number of positions
        self.lm_head_rows = head is not None and all(op.name in POSITION_WISE for op in head.ops)
        self._position_plans: dict[str, FunctionPlan] = {}

    # -- loading -----------------------------------------------------------------------------------
    def view(self, addr: int, t: TensorType) -> np.ndarray:
        if addr < 0 or addr + t.nbytes > self.ddr.size:
            raise TopqError(f"address 0x{addr:x} (+{t.nbytes} B) is outside the {self.ddr.size}-byte DDR")
        return self.ddr[addr:addr + t.nbytes].view(t.np_dtype).reshape(t.shape)

    def _load(self, tensor: Callable[[str], np.ndarray]) -> None:
        loaded: dict[str, tuple[int, TensorType]] = {}
        for function in self.module:
            for op in function.ops:
                if op.name == "tpu.Weight":
                    name, addr, t = op.attrs["name"], int(op.attrs["addr"]), op.results[0].type
                    if name in loaded:
                        if loaded[name] != (addr, t):
                            raise TopqError(f"tensor {name} is planned twice differently")
                        continue
                    loaded[name] = (addr, t)  # type: ignore[assignment]
                elif op.name == "tpu.KVStore":
                    key = (int(op.attrs["layer"]), op.attrs["kind"])
                    if key not in self.kv:
                        t = TensorType((int(op.attrs["rows"]), *op.operands[0].shape[2:]), op.attrs["dtype"])
                        addr = int(op.attrs["addr"])
                        tid = self.checker.register(f"KV cache layer {key[0]} {key[1]}") if self.checker else -1
                        self.kv[key] = KVMirror(self.view(addr, t), tid, addr)
                        if self.checker:
                            self.checker.claim(tid, addr, t.nbytes, "load")
                elif op.attrs.get("state") is not None:
                    key = (int(op.attrs["layer"]), int(op.attrs["state"]))
                    if key not in self.states:
                        t, addr = op.results[1].type, int(op.attrs["addrs"][1])
                        assert isinstance(t, TensorType)
                        tid = self.checker.register(f"state {key[1]} of layer {key[0]}") if self.checker else -1
                        self.states[key] = StateRegion(self.view(addr, t), tid, addr)
                        if self.checker:
                            self.checker.claim(tid, addr, t.nbytes, "load")
        for name, (addr, t) in loaded.items():
            array = np.asarray(tensor(name))
            if tuple(array.shape) != t.shape or array.dtype != t.np_dtype:
                raise TopqError(f"bundle tensor {name} is {array.dtype}{list(array.shape)}, the program expects {t}")
            self.view(addr, t)[...] = array
            if self.checker:
                tid = self._weight_ids[name] = self.checker.register(f"weight {name}")
                self.checker.claim(tid, addr, t.nbytes, "load")

    # -- decoded weights ------------------------------------------------------------------------------
    def _weight_view(self, value: Value) -> np.ndarray:
        op = value.owner
        assert isinstance(op, Operation)
        if self.checker:
            self.checker.read(self._weight_ids[op.attrs["name"]], int(op.attrs["addr"]), value.type.nbytes,  # type: ignore[union-attr]
                              f"weight {op.attrs['name']}")
        return self.view(int(op.attrs["addr"]), value.type)  # type: ignore[arg-type]

    def float_weight(self, value: Value) -> np.ndarray:
        key = ("f", value.owner.attrs["addr"])  # type: ignore[union-attr]
        if key not in self._decoded:
            self._decoded[key] = np.ascontiguousarray(self._weight_view(value).astype(F32))
        return self._decoded[key]

    def quant_weight(self, parts: Sequence[Value], attrs: dict[str, Any]) -> np.ndarray:
        key = ("q", parts[0].owner.attrs["addr"])  # type: ignore[union-attr]
        if key not in self._decoded:
            views = [self._weight_view(v) for v in parts]
            zp = None if attrs.get("symmetric", False) else views[2]
            self._decoded[key] = dequantize(views[0], views[1], zp, int(attrs["weight_bits"]),
                                            int(attrs["group_size"]), attrs["dtype"])
        return self._decoded[key]

    def _stacked(self, key: Any, make: Callable[[], np.ndarray]) -> np.ndarray:
        if key not in self._decoded:
            self._decoded[key] = np.ascontiguousarray(make())
        return self._decoded[key]

    # -- planning -------------------------------------------------------------------------------------
    def plan(self, name: str) -> FunctionPlan:
        plan = self._plans.get(name)
        if plan is None:
            plan = self._plans[name] = _Planner(self, self.module[name]).build()
        return plan

    # -- execution -----------------------------------------------------------------------------------
    def run(self, name: str, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        plan = self.plan(name)
        if len(inputs) != len(plan.args):
            raise TopqError(f"@{name} takes {len(plan.args)} inputs, got {len(inputs)}")
        arrays = [np.asarray(x) for x in inputs]
        for i, (array, t) in enumerate(zip(arrays, plan.args)):
            if tuple(array.shape) != t.shape:
                if name == "lm_head" and self.lm_head_rows and other_positions(array.shape, t.shape):
                    return self._run_positions(name, arrays)
                raise TopqError(f"@{name}: input {i} of shape {list(array.shape)}, expected {list(t.shape)}")
        checker = self.checker
        if checker:
            checker.release(*self.act_region)
        for i, writer in enumerate(plan.arg_writers):
            if writer is not None:
                ref = plan.arg_refs[i]
                if checker and ref is not None:
                    checker.claim(ref.tid, ref.addr, ref.nbytes, f"@{name} input {i}")
                writer(arrays[i])
        if plan.history:
            mask = arrays[plan.mask_arg] if plan.mask_arg is not None else None
            visible = visible_history(mask, plan.args[plan.history[0][0]].shape[1], plan.args[0].shape[1])
            for index, layer, kind in plan.history:
                self._sync(layer, kind, arrays[index], visible, name)
            for attrs in plan.attention_attrs:
                attrs["visible"] = visible
        for index, key in plan.states_in:
            self._sync_state(key, arrays[index], name)
        if checker:
            self._run_checked(plan, name)
        else:
            for step in plan.steps:
                outs = step.kernel([r() for r in step.readers], step.attrs)
                for writer, value in zip(step.writers, outs):
                    writer(value)
        if checker:
            for i, ref in enumerate(plan.output_refs):
                if ref is not None:
                    checker.read(ref.tid, ref.addr, ref.nbytes, f"@{name} output {i}")
        outputs = [r() for r in plan.outputs]
        for index, key in plan.states_out:  # the region now holds this state: a caller passing it back copies nothing
            outputs[index].setflags(write=False)
            self.states[key].handed = weakref.ref(outputs[index])
        return outputs

    def _run_positions(self, name: str, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """A position-wise function on T positions. The chip program plans DDR for one; here the same steps and
        kernels run with every value held locally, rounded to its dtype as a store in DDR rounds it (nothing is
        written to DDR, so the checker has nothing to check)."""
        plan = self._position_plans.get(name)
        if plan is None:
            plan = self._position_plans[name] = _Planner(self, self.module[name], local=True).build()
        for writer, array in zip(plan.arg_writers, arrays):
            assert writer is not None  # a position-wise function reads no KV or state region
            writer(array)
        for step in plan.steps:
            for writer, value in zip(step.writers, step.kernel([r() for r in step.readers], step.attrs)):
                writer(value)
        return [r() for r in plan.outputs]

    def _sync_state(self, key: tuple[int, int], array: np.ndarray, name: str) -> None:
        region = self.states[key]
        handed = region.handed() if region.handed is not None else None
        if handed is not array or self.kv_sync == "copy":
            region.view[...] = array
            region.copied += 1
            region.handed = None
        elif self.checker is not None and not np.array_equal(region.view, array):
            raise TopqError(f"checker: @{name}: state {key[1]} of layer {key[0]} in DDR differs from the array the "
                            f"caller passed back; the caller changed a state it was handed")

    def _run_checked(self, plan: FunctionPlan, name: str) -> None:
        checker = self.checker
        assert checker is not None
        self.local.begin()
        for ref in plan.frees_after_inputs:
            checker.free(ref.tid, ref.addr, ref.nbytes)
        for step in plan.steps:
            where = f"@{name}: {step.op.loc or ''} ({step.op.name})"
            for ref in step.reads:
                checker.read(ref.tid, ref.addr, ref.nbytes, where)
            outs = step.kernel([r() for r in step.readers], step.attrs)
            for ref in step.writes:
                checker.claim(ref.tid, ref.addr, ref.nbytes, where)
            for writer, value in zip(step.writers, outs):
                writer(value)
            for ref in step.frees:
                checker.free(ref.tid, ref.addr, ref.nbytes)
        self.local.finish(f"@{name}")  # every staged local buffer was freed (exactly once: free checks it)

    # -- KV cache mirror ------------------------------------------------------------------------------
    def _sync(self, layer: int, kind: str, history: np.ndarray, visible: int, name: str) -> None:
        mirror = self.kv.get((layer, kind))
        if mirror is None:
            raise TopqError(f"@{name}: no KV region for layer {layer} {kind}")
        base = history.base if history.base is not None else history
        pointer = history.__array_interface__["data"][0]
        same = (self.kv_sync == "incremental" and mirror.owner is not None and mirror.owner() is base
                and mirror.pointer == pointer)
        if not same:
            try:
                mirror.owner = weakref.ref(base)
            except TypeError:  # a base that cannot be referenced weakly: never trust it
                mirror.owner = None
            mirror.pointer = pointer
            mirror.trusted = 0
        if visible > mirror.trusted:
            mirror.view[mirror.trusted:visible] = history[0, mirror.trusted:visible]
            mirror.copied += visible - mirror.trusted
            mirror.trusted = visible
        if self.checker is not None:
            expected = history[0, :visible].astype(mirror.view.dtype)
            if not np.array_equal(mirror.view[:visible].view(np.uint8), expected.view(np.uint8)):
                raise TopqError(f"checker: @{name}: the KV mirror of layer {layer} {kind} differs from the history "
                                f"the caller passed (rows 0..{visible}); the caller rewrote rows it had passed before")

    def kv_written(self, layer: int, kind: str, row: int) -> None:
        mirror = self.kv[(layer, kind)]
        mirror.trusted = min(mirror.trusted, max(row, 0))

    def kv_store(self, layer: int, kind: str) -> Callable[[list[np.ndarray], dict[str, Any]], list[np.ndarray]]:
        mirror = self.kv[(layer, kind)]
        rows = mirror.view.shape[0]

        def store(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
            x, positions = args
            start = int(positions[0, 0])
            if start < 0:
                raise TopqError(f"tpu.KVStore: negative position {start}")
            count = max(0, min(x.shape[1], rows - start))
            if count:
                mirror.view[start:start + count] = x[0, :count]
            self.kv_written(layer, kind, start)
            return []

        return store


# ------------------------------------------------------------------------------------------- planner


class _Planner:
    """Turns one function into a FunctionPlan (readers/writers bound to DDR views or local slots)."""

    def __init__(self, emu: Emulator, function: Function, local: bool = False) -> None:
        self.emu = emu
        self.f = function
        self.all_local = local  # every value in a slot, none in DDR (`Emulator._run_positions`)
        self.checker = None if local else emu.checker
        self.slots: list[Any] = []
        self.local: dict[int, int] = {}  # value id → slot
        self.addr: dict[int, int] = {}  # root value id → DDR address
        self.tids: dict[int, int] = {}  # root value id → checker id
        self.kv_args: dict[int, tuple[int, str]] = {}
        self.state_args, self.state_results = state_bindings(function)
        self.raw: raw.RawSteps | None = None

    # values ----------------------------------------------------------------------------------------
    def _tid(self, value: Value) -> int:
        if self.checker is None:
            return -1
        key = id(value)
        if key not in self.tids:
            self.tids[key] = self.checker.register(value_name(value))
        return self.tids[key]

    def ref(self, value: Value) -> DdrRef | None:
        """The DDR location of a value (through views), or None when it is local."""
        if self.all_local:
            return None
        r = root(value)
        if isinstance(r.owner, Block) and r.index in self.kv_args:
            mirror = self.emu.kv[self.kv_args[r.index]]
            return DdrRef(mirror.tid, mirror.addr, value.type.nbytes)  # type: ignore[union-attr]
        key = self._state_key(r)
        if key is not None:
            region = self.emu.states[key]
            return DdrRef(region.tid, region.addr, value.type.nbytes)  # type: ignore[union-attr]
        addr = self._own_addr(value)
        if addr is None:
            return None
        return DdrRef(self._tid(r), addr, value.type.nbytes)  # type: ignore[union-attr]

    def _state_key(self, value: Value) -> tuple[int, int] | None:
        """The state region a root value is (a state argument, or the new state a marked op writes), else None."""
        owner = value.owner
        if isinstance(owner, Block):
            return self.state_args.get(value.index)
        if isinstance(owner, Operation) and value.index == 1 and owner.attrs.get("state") is not None:
            return int(owner.attrs["layer"]), int(owner.attrs["state"])
        return None

    def _own_addr(self, value: Value) -> int | None:
        """A value's planned address from its own op's attributes (a view carries its root's address)."""
        owner = value.owner
        if isinstance(owner, Block):
            return int(self.f.attrs["arg_addrs"][value.index])
        assert isinstance(owner, Operation)
        if "addrs" in owner.attrs:
            a = int(owner.attrs["addrs"][value.index])
            return a if a >= 0 else None
        if "addr" in owner.attrs:
            return int(owner.attrs["addr"])
        return None

    def reader(self, value: Value, raw: bool = False) -> Reader:
        if is_weight(value):
            array = self.emu._weight_view(value) if raw else self.emu.float_weight(value)
            return lambda: array
        ref = self.ref(value)
        if ref is None:
            slot = self.local[id(root(value))]
            shape = value.shape
            slots = self.slots
            if root(value) is value:
                return lambda: slots[slot]
            return lambda: slots[slot].reshape(shape)
        view = self.emu.view(ref.addr, value.type)  # type: ignore[arg-type]
        if raw:
            return lambda: view
        if value.type.dtype in FLOAT_DTYPES:  # type: ignore[union-attr]
            return lambda: view.astype(F32)
        return lambda: view.copy()

    def writer(self, value: Value) -> Writer:
        ref = self.ref(value)
        if ref is None:
            slot = len(self.slots)
            self.slots.append(None)
            self.local[id(value)] = slot
            slots = self.slots
            dtype = value.type.dtype  # type: ignore[union-attr]
            if dtype in FLOAT_DTYPES:
                def write_local(x: np.ndarray) -> None:
                    slots[slot] = rnd(x, dtype)
            else:
                def write_local(x: np.ndarray) -> None:
                    slots[slot] = np.array(x)
            return write_local
        view = self.emu.view(ref.addr, value.type)  # type: ignore[arg-type]

        def write_ddr(x: np.ndarray) -> None:
            np.copyto(view, x, casting="unsafe")

        return write_ddr

    # build -----------------------------------------------------------------------------------------
    def build(self) -> FunctionPlan:
        f = self.f
        layer = f.attrs.get("layer")
        mask_arg: int | None = None
        for op in f.ops:
            if op.name == "tpu.FAttention" and op.attrs.get("history"):
                for kind, v in zip(("k", "v"), op.operands[-2:]):
                    if isinstance(v.owner, Block):
                        self.kv_args[v.index] = (int(layer), kind)  # type: ignore[arg-type]
                if op.attrs.get("has_mask") and isinstance(op.operands[3].owner, Block):
                    mask_arg = op.operands[3].index
        if self.checker:
            self._static_checks()
        args = [a.type for a in f.args]
        arg_writers: list[Writer | None] = []
        arg_refs: list[DdrRef | None] = []
        for a in f.args:
            if a.index in self.kv_args or a.index in self.state_args:  # bound to their regions: synced in run()
                arg_writers.append(None)
                arg_refs.append(None)
                continue
            arg_refs.append(self.ref(a))
            arg_writers.append(self.writer(a))
        ops = [op for op in f.ops if op.name != "tpu.Weight"]
        last_use = self._last_uses(ops)
        steps = []
        for i, op in enumerate(ops):
            step = self._step(op)
            if step is None:
                continue
            if self.checker:
                step.reads = [r for r in (self.ref(v) for v in op.operands if not is_weight(v)) if r is not None]
                step.writes = [r for r in (self.ref(v) for v in op.results) if r is not None]
                if op.name == "tpu.KVStore":
                    mirror = self.emu.kv[(int(op.attrs["layer"]), op.attrs["kind"])]
                    step.writes.append(DdrRef(mirror.tid, mirror.addr, mirror.view.nbytes))
                step.frees = [ref for value, end in last_use.items() if end == i
                              for ref in [self.ref(value)] if ref is not None]
            steps.append(step)
        frees_first = [ref for value, end in last_use.items() if end == -1
                       for ref in [self.ref(value)] if ref is not None] if self.checker else []
        outputs = [self.reader(v) for v in f.results]
        output_refs = [self.ref(v) for v in f.results]
        history = [(index, lk[0], lk[1]) for index, lk in sorted(self.kv_args.items())]
        # the history rows the mask leaves visible are computed once per call (from the caller's mask)
        attention = [s.attrs for s in steps if s.op.name == "tpu.FAttention" and s.attrs.get("history")
                     and s.attrs.get("has_mask") and mask_arg is not None and s.op.operands[3] is f.args[mask_arg]]
        return FunctionPlan(f, args, arg_writers, arg_refs, history, mask_arg, steps, outputs, output_refs,
                            frees_first, attention, sorted(self.state_args.items()),
                            sorted(self.state_results.items()))

    def _last_uses(self, ops: list[Operation]) -> dict[Value, int]:
        """Step index after which each DDR root (not a result, not the KV cache) is dead (-1: unused argument)."""
        last: dict[int, int] = {}
        values: dict[int, Value] = {}
        for a in self.f.args:
            if a.index not in self.kv_args and a.index not in self.state_args:  # regions are never freed
                last[id(a)], values[id(a)] = -1, a
        for i, op in enumerate(ops):
            for r in op.results:
                if op.name not in VIEW_OPS:
                    last[id(r)], values[id(r)] = i, r
            for v in op.operands:
                rv = root(v)
                if id(rv) in last:
                    last[id(rv)] = max(last[id(rv)], i)
        for v in self.f.results:
            last.pop(id(root(v)), None)
        return {values[k]: end for k, end in last.items()}

    def _step(self, op: Operation) -> Step | None:
        emu = self.emu
        attrs = CATALOGUE[op.name].with_defaults(op.attrs) if op.name in CATALOGUE else dict(op.attrs)
        if raw.is_raw_op(op):  # staging copies and inlined kernel IR (raw.py)
            if self.raw is None:
                self.raw = raw.RawSteps(emu.local, self.f, self.reader, self.writer)
            parts = self.raw.step(op)
            return None if parts is None else Step(op, *parts, attrs)
        if op.name in VIEW_OPS:
            return None  # a view shares its root's bytes (DDR) or slot (local): readers reshape
        if op.name == "tpu.KVStore":
            return Step(op, emu.kv_store(int(op.attrs["layer"]), op.attrs["kind"]),
                        [self.reader(v) for v in op.operands], [], attrs)
        operands = list(op.operands)
        if op.name == "tpu.MatMul" and not (is_weight(operands[1]) and attrs.get("right_transpose")
                                             and len(operands[1].shape) == 2):
            kernel = REFERENCE_OPS["top.MatMul"]  # activations, or a weight in another layout
            readers = [self.reader(v) for v in operands]
        elif op.name == "tpu.MatMul":
            kernel = KERNELS[op.name]
            readers = [self.reader(operands[0]), self._const(emu.float_weight(operands[1]))]
            readers += [self.reader(v) for v in operands[2:]]
        elif op.name == "tpu.A16MatMul":
            per = 2 if attrs.get("symmetric") else 3
            kernel = KERNELS[op.name]
            readers = [self.reader(operands[0]), self._const(emu.quant_weight(operands[1:1 + per], attrs))]
            readers += [self.reader(v) for v in operands[1 + per:]]
        elif op.name == "tpu.MatMulInt8" and uses_requant(bool(attrs.get("dynamic")), attrs.get("out_scale", 0.0)):
            kernel = KERNELS[op.name]  # multiplier, rshift, bias_q: read as stored (an i32 multiplier is not an f32)
            readers = [self.reader(operands[0]), self.reader(operands[1])]
            readers += [self.reader(v, raw=True) for v in operands[2:]]
        elif op.name in ("tpu.MLP", "tpu.A16MLP"):
            kernel = KERNELS[op.name]
            readers = [self.reader(operands[0])] + [self._const(w) for w in self._mlp_weights(op, attrs)]
        elif op.name == "tpu.MoE":
            kernel = KERNELS[op.name]
            readers = [self.reader(operands[0])] + [self._const(w) for w in self._moe_weights(op, attrs)]
        elif op.name == "tpu.Gather":
            kernel = KERNELS[op.name]
            readers = [self.reader(operands[0], raw=True), self.reader(operands[1])]
        elif op.name == "tpu.FAttention":
            kernel = KERNELS[op.name]
            history = 2 if attrs.get("history") else 0
            readers = [self.reader(v) for v in operands[:len(operands) - history]]
            readers += [self.reader(v, raw=True) for v in operands[len(operands) - history:]]
        else:
            kernel = KERNELS.get(op.name)
            if kernel is None:
                raise TopqError(f"the bm1684x emulator cannot execute {op.name}")
            readers = [self.reader(v) for v in operands]
        return Step(op, kernel, readers, [self.writer(r) for r in op.results], attrs)

    def _const(self, array: np.ndarray) -> Reader:
        return lambda: array

    def _mlp_weights(self, op: Operation, attrs: dict[str, Any]) -> list[np.ndarray]:
        """[gate; up] stacked (one GEMM for both) and down, decoded once per bundle load."""
        per = 1 if op.name == "tpu.MLP" else (2 if attrs.get("symmetric") else 3)
        return self._gated_weights(list(op.operands[1:]), per, attrs)

    def _gated_weights(self, weights: list[Value], per: int, attrs: dict[str, Any]) -> list[np.ndarray]:
        """A gated MLP's weights (gate, up, down; each 1 float tensor or `per` packed parts) as [gate; up] and down."""
        emu = self.emu
        parts = [list(weights[i * per:(i + 1) * per]) for i in range(3)]

        def decode(p: list[Value]) -> np.ndarray:
            return emu.float_weight(p[0]) if per == 1 else emu.quant_weight(p, attrs)
        key = ("gu",) + tuple(p[0].owner.attrs["addr"] for p in parts[:2])  # type: ignore[union-attr]

        def stack() -> np.ndarray:
            gate_up = np.concatenate([decode(parts[0]), decode(parts[1])], axis=0)
            for p in parts[:2]:  # only the stack is needed from now on
                emu._decoded.pop(("f" if per == 1 else "q", p[0].owner.attrs["addr"]), None)  # type: ignore[union-attr]
            return gate_up

        return [emu._stacked(key, stack), decode(parts[2])]

    def _moe_weights(self, op: Operation, attrs: dict[str, Any]) -> list[np.ndarray]:
        """The router, then [gate; up] and down of each expert (and of the shared expert, then its gate)."""
        per = moe_parts(attrs)
        experts, shared = int(attrs["num_experts"]), bool(attrs.get("shared"))
        weights = list(op.operands[2:])
        out = [self.emu.float_weight(op.operands[1])]
        for e in range(experts + shared):
            out += self._gated_weights(weights[3 * per * e:3 * per * (e + 1)], per, attrs)
        if shared:
            out.append(self.emu.float_weight(weights[-1]))
        return out

    def _static_checks(self) -> None:
        """Addresses a checker can reject without running: misaligned, or outside their region."""
        a = self.emu.chip.global_align
        lo, size = self.emu.act_region
        for op in self.f.ops:
            if op.name in ("tpu.Weight", "tpu.KVStore"):
                continue
            for r in op.results:
                addr = self._own_addr(r)
                if addr is None:
                    continue
                key = self._state_key(r)
                if key is not None:
                    if addr != self.emu.states[key].addr:
                        raise TopqError(f"checker: @{self.f.name}: {value_name(r)} at 0x{addr:x} is not its state "
                                        f"region at 0x{self.emu.states[key].addr:x}")
                    continue
                if addr % a:
                    raise TopqError(f"checker: @{self.f.name}: {value_name(r)} at 0x{addr:x} is not aligned to {a}")
                if not (lo <= addr and addr + r.type.nbytes <= lo + size):  # type: ignore[union-attr]
                    raise TopqError(f"checker: @{self.f.name}: {value_name(r)} at 0x{addr:x} is outside the "
                                    f"activation region")


def checker_requested(recipe: dict[str, Any] | None) -> bool:
    if env_flag("TOPQ_CHECKER"):
        return True
    target = (recipe or {}).get("target", {}) or {}
    return bool(target.get("checker", False))
