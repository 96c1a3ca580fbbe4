"""`@kernel`: a Python function with typed parameters, compiled to kernel IR per static shape and run on the host.

    @kernel
    def silu(x: Input["tensor<?x?xf32>"], y: InOut["tensor<?x?xf32>"]):
        for i in range(x.shape[0]):
            for j in range(x.shape[1]):
                v = x[i, j]
                y[i, j] = v / (1.0 + exp(-v))

    y = silu(x, np.empty_like(x))        # numpy in, the InOut results out (a tuple when there are several)

`?` dims bind to the operands' sizes; each distinct set of shapes (and Num values) is lowered once and cached.
The kernel IR of a specialisation is a `func.func` whose arguments follow the Python parameters (Num ones are
constants in the body) and whose results are the InOut buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from topq.core.errors import TopqError
from topq.ir.extension import install_extension
from topq.ir.graph import Block, Function, Module
from topq.ir.printer import print_module
from topq.ir.types import DYNAMIC, ScalarType, TensorType, Type, dtype_name
from topq.raw.annotations import Param, ParamKind
from topq.raw.frontend import KernelSource, Lowering, parse_params, read_source
from topq.raw.interpret import BlockExecutor
from topq.raw.kernel_ops import KERNEL_IR


@dataclass
class Specialisation:
    function: Function
    executor: BlockExecutor


class Kernel:
    """A raw kernel: parameters parsed at decoration (so bad annotations and constructs fail at import)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name: str = fn.__name__
        self.ref = f"{fn.__module__}:{fn.__qualname__}"
        self.source: KernelSource = read_source(fn)
        self.params: list[Param] = parse_params(self.source)
        self.inouts = [p for p in self.params if p.kind is ParamKind.INOUT]
        self.inputs = [p for p in self.params if p.kind is ParamKind.INPUT]
        self.nums = [p for p in self.params if p.kind is ParamKind.NUM]
        self._cache: dict[tuple[Any, ...], Specialisation] = {}
        install_extension(KERNEL_IR)  # lowering builds kernel IR ops: they must be in the catalogue, even before
        # plugins load
        # Lower once with every `?` set to 1 so unsupported constructs are reported where the kernel is defined.
        placeholder = {p.name: _placeholder(p.type) for p in self.params if p.is_tensor}
        self.lower(placeholder, {p.name: 0 for p in self.nums}, [p.name for p in self.params if p.is_tensor])

    def __repr__(self) -> str:
        return f"<raw kernel {self.ref}>"

    # -- specialisation --------------------------------------------------------------------------------------
    def bind(self, param: Param, type_: Type, where: str) -> TensorType:
        """The annotation of `param` with its `?` dims taken from `type_`; a mismatch is a clear error."""
        declared = param.type
        assert isinstance(declared, TensorType)
        if not isinstance(type_, TensorType):
            raise TopqError(f"{where}: {param.name} must be a tensor {declared}, got {type_}")
        ok = type_.dtype == declared.dtype and type_.rank == declared.rank and all(
            d == DYNAMIC or d == s for d, s in zip(declared.shape, type_.shape))
        if not ok:
            raise TopqError(f"{where}: argument {param.name!r} is {type_}, which does not match its annotation "
                            f"{declared} ({self.source.path}:{param.line})")
        return type_

    def check_nums(self, nums: dict[str, Any], where: str) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for p in self.nums:
            if p.name not in nums:
                raise TopqError(f"{where}: missing value for Num parameter {p.name!r}")
            value = nums[p.name]
            if isinstance(value, (np.integer, np.floating)):
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    p.type == ScalarType("index") and not isinstance(value, int)):
                raise TopqError(f"{where}: Num parameter {p.name!r} ({p.type}) got {value!r}")
            out[p.name] = value
        return out

    def lower(self, types: dict[str, Type], nums: dict[str, int | float], order: Sequence[str]) -> Block:
        """A fresh kernel body for these static types, block arguments in `order` (tensor parameter names)."""
        return Lowering(self.source, self.params, types, nums, order).lower()

    def specialise(self, types: dict[str, TensorType], nums: dict[str, int | float]) -> Specialisation:
        key = (tuple((n, t.shape, t.dtype) for n, t in sorted(types.items())), tuple(sorted(nums.items())))
        spec = self._cache.get(key)
        if spec is None:
            tensors = [p.name for p in self.params if p.is_tensor]
            body = self.lower(types, nums, tensors)
            by_name = dict(zip(tensors, body.args))
            function = Function(self.name, body=body, results=[by_name[p.name] for p in self.inouts],
                                attrs={"kernel": self.ref, "arg_names": tensors})
            spec = self._cache[key] = Specialisation(function, BlockExecutor(body, self.ref, tensors))
        return spec

    # -- host execution --------------------------------------------------------------------------------------
    def _bind_call(self, args: Sequence[Any], where: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if len(args) != len(self.params):
            names = ", ".join(p.name for p in self.params)
            raise TopqError(f"{where}: takes {len(self.params)} arguments ({names}), got {len(args)}")
        arrays: dict[str, np.ndarray] = {}
        nums: dict[str, Any] = {}
        for p, a in zip(self.params, args):
            if p.is_tensor:
                if not isinstance(a, np.ndarray):
                    raise TopqError(f"{where}: argument {p.name!r} must be a numpy array, got {type(a).__name__}")
                arrays[p.name] = a
            else:
                nums[p.name] = a
        return arrays, nums

    def __call__(self, *args: Any) -> np.ndarray | tuple[np.ndarray, ...]:
        """Run on numpy arrays (Python parameter order); return the InOut results. Arguments are not modified."""
        where = f"kernel {self.ref}"
        arrays, nums = self._bind_call(args, where)
        types = {}
        for p in self.params:
            if p.is_tensor:
                a = arrays[p.name]
                types[p.name] = self.bind(p, _array_type(a, p, where), where)
        spec = self.specialise(types, self.check_nums(nums, where))
        outs = {p.name for p in self.inouts}
        # InOuts are written in a copy (the caller's array is the result's initial contents, not its storage).
        buffers = [np.array(arrays[n], copy=True) if n in outs else _read_only(arrays[n])
                   for n in spec.executor.arg_names]
        spec.executor.run(buffers)
        by_name = dict(zip(spec.executor.arg_names, buffers))
        results = tuple(by_name[p.name] for p in self.inouts)
        return results[0] if len(results) == 1 else results

    def ir(self, *args: Any) -> str:
        """The kernel IR (a module with one func.func) specialised for these arrays (or numbers for Num)."""
        where = f"kernel {self.ref}"
        arrays, nums = self._bind_call(args, where)
        types = {p.name: self.bind(p, _array_type(arrays[p.name], p, where), where) for p in self.params
                 if p.is_tensor}
        module = Module()
        module.add(self.specialise(types, self.check_nums(nums, where)).function)
        return print_module(module)


def kernel(fn: Callable[..., Any]) -> Kernel:
    """Decorator: turn an annotated Python function into a raw kernel."""
    return Kernel(fn)


def _placeholder(t: Type) -> Type:
    assert isinstance(t, TensorType)
    return t.with_shape(tuple(1 if d == DYNAMIC else d for d in t.shape))


def _array_type(a: np.ndarray, p: Param, where: str) -> TensorType:
    try:
        return TensorType(tuple(int(d) for d in a.shape), dtype_name(a.dtype))
    except TopqError:
        raise TopqError(f"{where}: argument {p.name!r} has dtype {a.dtype}, annotation {p.type}") from None


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False  # an Input is never written; make a frontend bug loud rather than silent
    return view
