"""The reference interpreter: executes Top IR op by op in float32 numpy.

It is the semantic definition of Top IR and the `host` target. Like torch.fx's Interpreter it is
meant to be subclassed: override `kernels` (a table op name → kernel) or `run_op` to execute another
dialect or to change what an op computes, or `load_weight` to read weights from another store. Each
function is compiled once into a flat plan of (kernel, operand slots, result slots, attributes) so the
hot loop does no lookups.

To *observe* execution without changing it (calibration statistics, activation observers, error
reports), pass a `tap`: `run` calls `tap(step, inputs, outputs)` after every op of the plan (every op
but `top.Weight`, whose values are the plan's constants), with the op's operand values and its results.
A tap must not modify them. It may raise to stop the run early (calibration stops once it has seen the
input it wants). `Interpreter.tap` is a property, so one interpreter can be re-tapped between runs; a subclass
may tap with a method of its own (`self.tap = self._observe`), which is kept as its function: a bound method
there would be a reference cycle, and the interpreter's weights would outlive it until the cyclic garbage
collector runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from topq.ir.catalogue import CATALOGUE
from topq.ir.errors import TopqError
from topq.ir.graph import Function, Module, Operation
from topq.ir.reference_ops import REFERENCE_OPS, Kernel

WeightLoader = Callable[[str], np.ndarray]

#: Kernels for ops whose behaviour lives in their regions, shared by every interpreter whatever its `kernels`
#: table (e.g. `top.DSLRegion`, registered by `topq.raw`). Such a kernel has `bind(op) -> Kernel`.
REGION_KERNELS: dict[str, Any] = {}


@dataclass
class Step:
    op: Operation
    kernel: Kernel
    operands: tuple[int, ...]
    results: tuple[int, ...]
    attrs: dict[str, Any]


@dataclass
class Plan:
    num_slots: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    constants: dict[int, np.ndarray]
    steps: list[Step]


#: An observer of execution (see the module doc): (step, operand values, results) → None.
Tap = Callable[["Step", list[np.ndarray], list[np.ndarray]], None]


def other_positions(shape: Sequence[int], expected: Sequence[int]) -> bool:
    """`shape` is `expected` with another length along axis 1 (positions)."""
    return len(shape) == len(expected) > 1 and (shape[0], *shape[2:]) == (expected[0], *expected[2:])


class Interpreter:
    kernels: Mapping[str, Kernel] = REFERENCE_OPS
    #: functions that also run on inputs of any length along axis 1 (positions): set by a subclass for functions
    #: whose ops act on each position alone and carry no shape of their own (the stages' `lm_head`)
    any_positions: frozenset[str] = frozenset()

    def __init__(self, module: Module, weights: WeightLoader, tap: Tap | None = None) -> None:
        self.module = module
        self.weights = weights
        self.tap = tap
        self._plans: dict[str, Plan] = {}
        self._weight_cache: dict[str, np.ndarray] = {}

    @property
    def tap(self) -> Tap | None:
        tap, own = self._tap
        return tap.__get__(self) if own else tap

    @tap.setter
    def tap(self, tap: Tap | None) -> None:
        own = getattr(tap, "__self__", None) is self  # this interpreter's method: kept unbound (see the module doc)
        self._tap: tuple[Any, bool] = (tap.__func__ if own else tap, own)  # type: ignore[union-attr]

    # -- extension points ------------------------------------------------------------------------
    def load_weight(self, op: Operation) -> np.ndarray:
        name = op.attrs["name"]
        array = self._weight_cache.get(name)
        if array is None:
            array = self.weights(name)
            expected = op.results[0].shape
            if tuple(array.shape) != tuple(expected):
                raise TopqError(f"weight {name} has shape {list(array.shape)}, the program expects {list(expected)}")
            self._weight_cache[name] = array
        return array

    def kernel_for(self, op: Operation) -> Kernel:
        kernel = self.kernels.get(op.name)
        if kernel is None and op.name in REGION_KERNELS:
            # It needs the op itself (its region): specialise once per op here, at plan time, not per call.
            return REGION_KERNELS[op.name].bind(op)
        if kernel is None:
            raise TopqError(f"{type(self).__name__} cannot execute {op.name}")
        return kernel

    # -- execution -------------------------------------------------------------------------------
    def plan(self, function: Function) -> Plan:
        plan = self._plans.get(function.name)
        if plan is None:
            plan = self._plans[function.name] = self._compile(function)
        return plan

    def _compile(self, function: Function) -> Plan:
        slots: dict[int, int] = {}

        def slot(value: Any) -> int:
            return slots.setdefault(id(value), len(slots))

        inputs = tuple(slot(a) for a in function.args)
        constants: dict[int, np.ndarray] = {}
        steps: list[Step] = []
        for op in function.ops:
            if op.name == "top.Weight":
                constants[slot(op.results[0])] = self.load_weight(op)
                continue
            opdef = CATALOGUE.get(op.name)
            attrs = opdef.with_defaults(op.attrs) if opdef else dict(op.attrs)
            steps.append(Step(op, self.kernel_for(op), tuple(slots[id(v)] for v in op.operands),
                              tuple(slot(r) for r in op.results), attrs))
        outputs = tuple(slots[id(r)] for r in function.results)
        return Plan(len(slots), inputs, outputs, constants, steps)

    def run(self, name: str, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        function = self.module[name]
        plan = self.plan(function)
        if len(inputs) != len(plan.inputs):
            raise TopqError(f"@{name} takes {len(plan.inputs)} inputs, got {len(inputs)}")
        env: list[Any] = [None] * plan.num_slots
        for s, value, arg in zip(plan.inputs, inputs, function.args):
            if tuple(value.shape) != arg.shape and not (name in self.any_positions
                                                        and other_positions(value.shape, arg.shape)):
                raise TopqError(f"@{name}: input of shape {list(value.shape)}, expected {list(arg.shape)}")
            env[s] = value
        for s, value in plan.constants.items():
            env[s] = value
        tap = self.tap
        for step in plan.steps:
            args = [env[i] for i in step.operands]
            outs = self.run_op(step, args)
            if tap is not None:
                tap(step, args, outs)
            for s, value in zip(step.results, outs):
                env[s] = value
        return [env[s] for s in plan.outputs]

    def run_op(self, step: Step, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return step.kernel(inputs, step.attrs)
