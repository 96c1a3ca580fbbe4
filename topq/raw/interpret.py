"""Execute kernel IR on the host, in the IR's own float types, vectorising what `vectorize.py` allows.

A vectorised `scf.for` runs its body once with the induction variable as a numpy `arange` laid along its lane
axis, so every op of the body becomes one numpy operation over all iterations (broadcasting across the axes of
nested vectorised loops); loads and stores whose subscripts are induction variables become strided views of the
buffer. Everything else is interpreted op by op with numpy scalars. Both paths apply the same float32 ufuncs
element by element, so results are bit-identical to a numpy formula with the same operation order.

Lane-dependent `scf.if` runs both branches under masks (stores are masked; results merge with `where`).
Buffer accesses are bounds-checked (over active lanes); an out-of-bounds index is a TopqError naming the
kernel source line, the buffer and the index.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from topq.core.errors import TopqError
from topq.ir.graph import Block, Operation
from topq.ir.types import ELEMENT_TYPES, ScalarType
from topq.raw.functions import erf as _erf
from topq.raw.vectorize import plan_lanes, walk_block


@dataclass(frozen=True)
class _IV:
    """A vectorised induction variable: lanes start, start + step, ... (count of them) along `axis`."""

    axis: int
    start: int
    step: int
    count: int


@dataclass(frozen=True)
class _Lanes:
    """The vector context: lane rank, active-lane mask (None = all) and the induction variables in scope."""

    rank: int = 0
    mask: np.ndarray | None = None
    ivs: dict[int, _IV] = field(default_factory=dict)


def _rsqrt(x: Any) -> Any:
    return x.dtype.type(1) / np.sqrt(x)


def _unordered(a: Any, b: Any) -> Any:
    return np.logical_or(np.isnan(a), np.isnan(b))


_CMPF: dict[str, Callable[[Any, Any], Any]] = {
    "oeq": operator.eq, "une": operator.ne, "olt": operator.lt, "ole": operator.le, "ogt": operator.gt,
    "oge": operator.ge,
    "one": lambda a, b: np.logical_and(a != b, np.logical_not(_unordered(a, b))),
    "ueq": lambda a, b: np.logical_or(a == b, _unordered(a, b)),
    "ult": lambda a, b: np.logical_not(a >= b), "ule": lambda a, b: np.logical_not(a > b),
    "ugt": lambda a, b: np.logical_not(a <= b), "uge": lambda a, b: np.logical_not(a < b),
    "ord": lambda a, b: np.logical_not(_unordered(a, b)), "uno": _unordered,
}
_CMPI: dict[str, Callable[[Any, Any], Any]] = {
    "eq": operator.eq, "ne": operator.ne, "slt": operator.lt, "sle": operator.le, "sgt": operator.gt,
    "sge": operator.ge,
}

#: Pure elementwise ops: the same function serves numpy scalars and lane arrays.
_PURE: dict[str, Callable[..., Any]] = {
    "arith.addf": operator.add, "arith.subf": operator.sub, "arith.mulf": operator.mul,
    "arith.divf": operator.truediv, "arith.maximumf": np.maximum, "arith.minimumf": np.minimum,
    "arith.negf": operator.neg,
    "arith.addi": operator.add, "arith.subi": operator.sub, "arith.muli": operator.mul,
    "arith.floordivsi": operator.floordiv, "arith.maxsi": np.maximum, "arith.minsi": np.minimum,
    "arith.andi": np.logical_and, "arith.ori": np.logical_or, "arith.xori": np.logical_xor,
    "math.exp": np.exp, "math.log": np.log, "math.sqrt": np.sqrt, "math.rsqrt": _rsqrt, "math.tanh": np.tanh,
    "math.absf": np.abs, "math.erf": lambda x: _as_type(_erf(x), np.asarray(x).dtype),
}


def _as_type(x: Any, dtype: np.dtype) -> Any:
    """`x` converted to `dtype`, keeping scalars scalar."""
    if isinstance(x, np.ndarray) and x.ndim:
        return x.astype(dtype)
    return dtype.type(x)


def _scalar_dtype(t: Any) -> np.dtype:
    assert isinstance(t, ScalarType)
    return np.dtype(np.int64) if t.name == "index" else ELEMENT_TYPES[t.name]


@dataclass
class _Step:
    op: Operation
    run: Callable[[Operation, list[Any], _Lanes], list[Any]]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


class BlockExecutor:
    """Runs one kernel body (a func.func body or a top.DSLRegion region) on numpy buffers, in place."""

    def __init__(self, block: Block, kernel: str, arg_names: Sequence[str]) -> None:
        self.block = block
        self.kernel = kernel
        self.lanes = plan_lanes(block)
        self.names = {id(a): n for a, n in zip(block.args, arg_names)}
        self.arg_names = list(arg_names)
        self._steps: dict[int, list[_Step]] = {}
        self._env: dict[int, Any] = {}
        # Constants are evaluated once here rather than on every pass through their block.
        self._constants = {id(op.results[0]): self._constant(op, [], _Lanes())[0]
                           for op in walk_block(block) if op.name == "arith.constant"}
        self._handlers: dict[str, Callable[[Operation, list[Any], _Lanes], list[Any]]] = {
            "scf.for": self._for, "scf.if": self._if, "memref.load": self._load, "memref.store": self._store,
            "arith.constant": self._constant, "arith.cmpf": self._cmpf, "arith.cmpi": self._cmpi,
            "arith.select": self._select, "arith.index_cast": self._index_cast, "arith.sitofp": self._sitofp,
        }

    @property
    def vectorised_loops(self) -> int:
        return len(self.lanes)

    def run(self, buffers: Sequence[np.ndarray]) -> list[Any]:
        """Execute with `buffers` bound to the block arguments; return what a final scf.yield yields."""
        if len(buffers) != len(self.block.args):
            raise TopqError(f"{self.kernel}: {len(self.block.args)} buffers expected, got {len(buffers)}")
        for arg, buf in zip(self.block.args, buffers):
            if tuple(buf.shape) != tuple(arg.type.shape):
                raise TopqError(f"{self.kernel}: buffer {self.names[id(arg)]} has shape {list(buf.shape)}, "
                                f"the kernel IR expects {list(arg.type.shape)}")
        self._env = dict(self._constants)
        self._env.update((id(a), b) for a, b in zip(self.block.args, buffers))
        try:
            with np.errstate(all="ignore"):  # IEEE results (inf, nan) as on a chip, no warnings
                return self._block(self.block, _Lanes())
        finally:
            self._env = {}

    # -- blocks ------------------------------------------------------------------------------------------
    def _compile(self, block: Block) -> list[_Step]:
        steps = []
        for op in block.ops:
            if op.name == "arith.constant":
                continue  # in the environment from the start
            run = self._handlers.get(op.name)
            if run is None:
                fn = _PURE.get(op.name)
                if fn is None and op.name != "scf.yield":
                    raise TopqError(f"{self._where(op)}: the host cannot execute {op.name}")
                run = _pure(fn) if fn is not None else _no_op
            steps.append(_Step(op, run, tuple(id(v) for v in op.operands), tuple(id(r) for r in op.results)))
        return steps

    def _block(self, block: Block, lanes: _Lanes) -> list[Any]:
        steps = self._steps.get(id(block))
        if steps is None:
            steps = self._steps[id(block)] = self._compile(block)
        env = self._env
        for step in steps:
            args = [env[i] for i in step.inputs]
            if step.op.name == "scf.yield":
                return args
            for slot, value in zip(step.outputs, step.run(step.op, args, lanes)):
                env[slot] = value
        return []

    def _where(self, op: Operation) -> str:
        return f"{op.loc or '?'}: {self.kernel}"

    # -- control flow ------------------------------------------------------------------------------------
    def _for(self, op: Operation, args: list[Any], lanes: _Lanes) -> list[Any]:
        lb, ub, step = (int(v) for v in args[:3])
        if step <= 0:
            raise TopqError(f"{self._where(op)}: loop step must be positive, got {step}")
        body = op.regions[0].block
        plan = self.lanes.get(id(op))
        env = self._env
        if plan is not None:
            count = len(range(lb, ub, step))
            if count:
                shape = [1] * plan.rank
                shape[plan.axis] = count
                env[id(body.args[0])] = np.arange(lb, lb + count * step, step, dtype=np.int64).reshape(shape)
                ivs = {**lanes.ivs, id(body.args[0]): _IV(plan.axis, lb, step, count)}
                self._block(body, _Lanes(plan.rank, lanes.mask, ivs))
            return []
        carried = args[3:]
        iter_ids = [id(a) for a in body.args[1:]]
        iv = id(body.args[0])
        for i in range(lb, ub, step):
            env[iv] = i
            for slot, value in zip(iter_ids, carried):
                env[slot] = value
            carried = self._block(body, lanes)
        return list(carried)

    def _if(self, op: Operation, args: list[Any], lanes: _Lanes) -> list[Any]:
        cond = args[0]
        then_block, else_block = op.regions[0].block, op.regions[1].block
        if not (isinstance(cond, np.ndarray) and cond.ndim):
            return self._block(then_block if cond else else_block, lanes)
        on = cond if lanes.mask is None else cond & lanes.mask
        off = ~cond if lanes.mask is None else ~cond & lanes.mask
        run_then = bool(on.any())
        run_else = bool(off.any()) or not run_then
        then_out = self._block(then_block, _Lanes(lanes.rank, on, lanes.ivs)) if run_then else None
        else_out = self._block(else_block, _Lanes(lanes.rank, off, lanes.ivs)) if run_else else None
        if then_out is None or else_out is None:
            return list(then_out if else_out is None else else_out)  # type: ignore[arg-type]
        return [np.where(cond, a, b) for a, b in zip(then_out, else_out)]

    # -- scalars -----------------------------------------------------------------------------------------
    def _constant(self, op: Operation, args: list[Any], lanes: _Lanes) -> list[Any]:
        t = op.results[0].type
        value = op.attrs["value"]
        if t.name == "index":
            return [int(value)]
        if t.name == "i1":
            return [np.bool_(value)]
        return [_scalar_dtype(t).type(value)]

    def _cmpf(self, op: Operation, args: list[Any], lanes: _Lanes) -> list[Any]:
        return [_CMPF[op.attrs["predicate"]](args[0], args[1])]

    def _cmpi(self, op: Operation, args: list[Any], lanes: _Lanes) -> list[Any]:
        return [_CMPI[op.attrs["predicate"]](args[0], args[1])]

    def _select(self, op: Operation, args: list[Any], lanes: _Lanes) -> list[Any]:
        cond, a, b = args
        if isinstance(cond, np.ndarray) and cond.ndim:
            return [np.where(cond, a, b)]
        return [a if cond else b]

    def _index_cast(self, op: Operation, args: list[Any], lanes: _Lanes) -> list[Any]:
        x = args[0]
        dtype = _scalar_dtype(op.results[0].type)
        if isinstance(x, np.ndarray) and x.ndim:
            return [x.astype(dtype)]
        return [int(x) if op.results[0].type.name == "index" else dtype.type(x)]

    def _sitofp(self, op: Operation, args: list[Any], lanes: _Lanes) -> list[Any]:
        return [_as_type(args[0], _scalar_dtype(op.results[0].type))]

    # -- buffers -----------------------------------------------------------------------------------------
    def _view(self, buf: np.ndarray, operands: Sequence[Any], indices: list[Any], lanes: _Lanes) -> Any:
        """A strided view of `buf` laid out on the lane axes, or None when the subscripts are not simple or
        leave the buffer (then the general, masked path decides)."""
        basic: list[Any] = []
        axes: list[int] = []
        for value, index, dim in zip(operands, indices, buf.shape):
            iv = lanes.ivs.get(id(value))
            if iv is not None:
                last = iv.start + (iv.count - 1) * iv.step
                if iv.axis in axes or iv.start < 0 or last >= dim:
                    return None
                basic.append(slice(iv.start, last + 1, iv.step))
                axes.append(iv.axis)
            elif isinstance(index, (int, np.integer)) or (isinstance(index, np.ndarray) and index.ndim == 0):
                if not 0 <= index < dim:
                    return None
                basic.append(int(index))
            else:
                return None
        view = buf[tuple(basic)]
        if not axes:
            return view
        order = sorted(range(len(axes)), key=axes.__getitem__)
        if order != list(range(len(axes))):
            view = view.transpose(order)
        present = sorted(axes)
        missing = tuple(a for a in range(lanes.rank) if a not in present)
        return np.expand_dims(view, missing) if missing else view

    def _general_indices(self, op: Operation, buf: np.ndarray, indices: list[Any], lanes: _Lanes,
                         store: bool, extra: Sequence[Any] = ()) -> tuple[tuple[np.ndarray, ...], list[np.ndarray]]:
        """Broadcast subscripts (and `extra` arrays) over the lanes, keep the active lanes, bounds-check them."""
        arrays = [np.asarray(i, dtype=np.int64) for i in indices]
        mask = lanes.mask if lanes.mask is not None else np.bool_(True)
        parts = np.broadcast_arrays(*arrays, mask, *[np.asarray(e) for e in extra])
        active = parts[len(arrays)]
        picked = [p[active] for p in parts]
        index = picked[:len(arrays)]
        for i, dim in zip(index, buf.shape):
            bad = (i < 0) | (i >= dim)
            if bad.any():
                k = int(np.argmax(bad))
                where = [int(x[k]) for x in index]
                self._out_of_bounds(op, buf, where, store)
        return tuple(index), picked[len(arrays) + 1:]

    def _out_of_bounds(self, op: Operation, buf: np.ndarray, index: Sequence[int], store: bool) -> None:
        buffer = op.operands[1 if store else 0]
        name = self.names.get(id(buffer), "?")
        action = "store to" if store else "load from"
        raise TopqError(f"{self._where(op)}: {action} {name}{list(index)} is out of bounds for shape "
                        f"{list(buf.shape)}")

    def _load(self, op: Operation, args: list[Any], lanes: _Lanes) -> list[Any]:
        buf, indices = args[0], args[1:]
        view = self._view(buf, op.operands[1:], indices, lanes)
        if view is not None:
            return [view]
        if lanes.mask is None and all(not isinstance(i, np.ndarray) or i.ndim == 0 for i in indices):
            self._out_of_bounds(op, buf, [int(i) for i in indices], store=False)
        index, _ = self._general_indices(op, buf, indices, lanes, store=False)
        # Inactive lanes read element 0 (any in-bounds element would do: their values are never used).
        full = [np.zeros(np.broadcast_shapes(*[np.shape(i) for i in indices], np.shape(lanes.mask)), np.int64)
                for _ in indices]
        active = np.broadcast_to(lanes.mask if lanes.mask is not None else True, full[0].shape)
        for f, i in zip(full, index):
            f[active] = i
        return [buf[tuple(full)]]

    def _store(self, op: Operation, args: list[Any], lanes: _Lanes) -> list[Any]:
        value, buf, indices = args[0], args[1], args[2:]
        view = self._view(buf, op.operands[2:], indices, lanes)
        if view is not None:
            if isinstance(view, np.ndarray) and view.ndim:
                np.copyto(view, value, where=True if lanes.mask is None else lanes.mask)
            elif lanes.mask is None or bool(np.any(lanes.mask)):
                buf[tuple(int(i) for i in indices)] = value
            return []
        if lanes.mask is None and all(not isinstance(i, np.ndarray) or i.ndim == 0 for i in indices):
            self._out_of_bounds(op, buf, [int(i) for i in indices], store=True)
        index, (picked_value,) = self._general_indices(op, buf, indices, lanes, store=True, extra=[value])
        buf[index] = picked_value
        return []


def _pure(fn: Callable[..., Any]) -> Callable[[Operation, list[Any], _Lanes], list[Any]]:
    def run(op: Operation, args: list[Any], lanes: _Lanes) -> list[Any]:
        return [fn(*args)]

    return run


def _no_op(op: Operation, args: list[Any], lanes: _Lanes) -> list[Any]:
    return []
