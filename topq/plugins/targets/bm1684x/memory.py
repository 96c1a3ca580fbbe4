"""Static DDR planning: a coefficient region, one fixed KV-cache region per attention layer, one fixed state region
per recurrent layer, a shared activation region.

Layout (every address aligned to `spec.global_align`):

    [ coefficients ][ KV cache: layer 0 k, layer 0 v, ... ][ states: layer 0 state 0, layer 0 state 1, ... ][ act ]

* Coefficients are shared by all functions (a weight used by block_3 and block_cache_3 is stored once).
* Each layer's k and v cache is `[seq_length, KVH, D]` in the mode's dtype; a block's history input *is* that
  region (rows 0..S-1 of it) and `tpu.KVStore` writes new rows into it, so prefill_kv / decode never copy history.
* Each recurrent layer's carried states (f32, e.g. a Gated DeltaNet's conv window and recurrent state) have one
  fixed region per state, the layer's regions side by side: the state arguments of its prefill_kv and decode
  functions *are* those regions, and the ops marked by `lowering.bind_states` write the new states over them
  (prefill writes them first), so no state passes through the activation region.
* Only one function runs at a time, so all functions share the activation region; inside a function the values
  that live in DDR (see `layer_group.ddr_values`) are packed by liveness: a linear scan in definition order puts
  each value at the lowest address not used by a value whose live range overlaps (a value stays live through the
  op that last reads it, so an op never writes over its own inputs). Views share their root's address.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from topq.core.errors import TopqError
from topq.ir.graph import Block, Function, Module, Operation, Value
from topq.ir.types import TensorType
from topq.plugins.targets.bm1684x import raw
from topq.plugins.targets.bm1684x.layer_group import (
    VIEW_OPS,
    ddr_values,
    is_weight,
    root,
)
from topq.plugins.targets.bm1684x.lowering import state_operand
from topq.plugins.targets.bm1684x.spec import ChipSpec


def align(n: int, a: int) -> int:
    return -(-n // a) * a


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclass
class MemoryPlan:
    coeff: tuple[int, int] = (0, 0)  # (base, size)
    kv: tuple[int, int] = (0, 0)
    act: tuple[int, int] = (0, 0)
    weights: dict[str, int] = field(default_factory=dict)  # tensor name → address
    kv_regions: dict[tuple[int, str], int] = field(default_factory=dict)  # (layer, "k"/"v") → address
    kv_rows: int = 0
    state: tuple[int, int] = (0, 0)
    #: (layer, state index) → (address, f32 type) of a recurrent layer's carried state
    state_regions: dict[tuple[int, int], tuple[int, TensorType]] = field(default_factory=dict)
    function_act: dict[str, int] = field(default_factory=dict)  # bytes of the activation region each function uses

    @property
    def total(self) -> int:
        return self.act[0] + self.act[1]

    def state_layers(self) -> list[dict[str, Any]]:
        """Per recurrent layer: its regions' base address, their payload bytes and each state's address and shape."""
        layers: dict[int, dict[str, Any]] = {}
        for (layer, _), (addr, t) in sorted(self.state_regions.items()):
            entry = layers.setdefault(layer, {"layer": layer, "addr": addr, "bytes": 0, "states": []})
            entry["bytes"] += t.nbytes
            entry["states"].append({"addr": addr, "shape": list(t.shape), "dtype": t.dtype})
        return list(layers.values())

    def summary(self) -> dict[str, Any]:
        out = {"total": self.total, "coeff": list(self.coeff), "kv": list(self.kv), "act": list(self.act),
               "kv_rows": self.kv_rows}
        if self.state_regions:  # dense models' plans stay as they were
            out.update(state=list(self.state), state_layers=self.state_layers())
        return out


def _kv_layout(module: Module) -> tuple[int, list[int], tuple[int, ...], str]:
    """(rows, layers, row shape [KVH, D], dtype) from the module's KVStore ops."""
    layers: set[int] = set()
    row_shape: tuple[int, ...] = ()
    dtype, rows = "f32", 0
    for function in module:
        for op in function.ops:
            if op.name == "tpu.KVStore":
                layers.add(int(op.attrs["layer"]))
                row_shape = op.operands[0].shape[2:]
                dtype, rows = op.attrs["dtype"], int(op.attrs["rows"])
    return rows, sorted(layers), row_shape, dtype


def _state_layout(module: Module) -> dict[tuple[int, int], TensorType]:
    """(layer, state index) → the state's f32 type, from the ops `bind_states` tied to a region."""
    out: dict[tuple[int, int], TensorType] = {}
    for function in module:
        for op in function.ops:
            if op.attrs.get("state") is not None:
                key, t = (int(op.attrs["layer"]), int(op.attrs["state"])), op.results[1].type
                assert isinstance(t, TensorType)
                if out.setdefault(key, t) != t:
                    raise TopqError(f"layer {key[0]} state {key[1]} is {out[key]} in one function and {t} in "
                                    f"@{function.name}")
    return out


def plan_memory(module: Module, tensors: dict[str, TensorType], chip: ChipSpec) -> MemoryPlan:
    """Assign every DDR address (weights, KV regions, activations); set the `addr`/`addrs` attributes and each
    function's `arg_addrs`; raise when the model does not fit the chip's DDR."""
    a = chip.global_align
    plan = MemoryPlan()
    cursor = 0
    for name, t in tensors.items():
        plan.weights[name] = cursor
        cursor = align(cursor + t.nbytes, a)
    plan.coeff = (0, cursor)
    rows, layers, row_shape, dtype = _kv_layout(module)
    plan.kv_rows = rows
    kv_base = cursor
    if layers:
        region = align(TensorType((rows, *row_shape), dtype).nbytes, a)
        for layer in layers:
            for kind in ("k", "v"):
                plan.kv_regions[(layer, kind)] = cursor
                cursor += region
    plan.kv = (kv_base, cursor - kv_base)
    state_base = cursor
    for key, t in sorted(_state_layout(module).items()):
        plan.state_regions[key] = (cursor, t)
        cursor = align(cursor + t.nbytes, a)
    plan.state = (state_base, cursor - state_base)
    act_base = cursor
    for function in module:
        plan.function_act[function.name] = _plan_function(function, plan, act_base, a)
    plan.act = (act_base, align(max(plan.function_act.values(), default=0), a))
    for function in module:
        for op in function.ops:
            if op.name == "tpu.Weight":
                op.attrs["addr"] = plan.weights[op.attrs["name"]]
            elif op.name == "tpu.KVStore":
                op.attrs["addr"] = plan.kv_regions[(int(op.attrs["layer"]), op.attrs["kind"])]
    if plan.total > chip.ddr_size:
        states = f"states {human(plan.state[1])}, " if plan.state_regions else ""
        raise TopqError(
            f"model does not fit {chip.name} DDR: needs {human(plan.total)} (weights {human(plan.coeff[1])}, "
            f"KV cache {human(plan.kv[1])}, {states}activations {human(plan.act[1])}), the chip has "
            f"{human(chip.ddr_size)}")
    module.attrs.update({"bm.chip": chip.name, "bm.ddr": [plan.total, chip.ddr_size], "bm.coeff": list(plan.coeff),
                         "bm.kv": list(plan.kv), "bm.act": list(plan.act), "bm.kv_rows": rows})
    if plan.state_regions:
        module.attrs["bm.state"] = list(plan.state)
    return plan


def state_bindings(function: Function) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
    """(argument index → (layer, state index), result index → (layer, state index)): the function's inputs and
    outputs that are a recurrent layer's state regions (the ops `bind_states` marked, their state operand and
    new state)."""
    results = {id(v): i for i, v in enumerate(function.results)}
    args: dict[int, tuple[int, int]] = {}
    outs: dict[int, tuple[int, int]] = {}
    for op in function.ops:
        if op.attrs.get("state") is None:
            continue
        key = (int(op.attrs["layer"]), int(op.attrs["state"]))
        outs[results[id(op.results[1])]] = key
        old = state_operand(op)
        if old is not None and isinstance(old.owner, Block):
            args[old.index] = key
    return args, outs


def history_bindings(function: Function) -> dict[int, str]:
    """Argument index → "k" / "v" for the history inputs (the operands FAttention reads as the KV cache)."""
    out: dict[int, str] = {}
    for op in function.ops:
        if op.name == "tpu.FAttention" and op.attrs.get("history"):
            for kind, v in zip(("k", "v"), op.operands[-2:]):
                if isinstance(v.owner, Block):
                    out[v.index] = kind
    return out


def _plan_function(function: Function, plan: MemoryPlan, base: int, a: int) -> int:
    ops = [op for op in function.ops if op.name != "tpu.Weight"]
    position = {id(op): i for i, op in enumerate(ops)}
    ddr = ddr_values(function)
    bound = history_bindings(function)
    layer = function.attrs.get("layer")
    # live range [start, end] of each DDR root, in op positions (arguments are written before op 0)
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    for key, value in ddr.items():
        start[key] = -1 if isinstance(value.owner, Block) else position[id(value.owner)]
        end[key] = start[key]
    for i, op in enumerate(ops):
        for v in op.operands:
            if not is_weight(v):
                key = id(root(v))
                if key in end:
                    end[key] = max(end[key], i)
    for v in function.results:
        end[id(root(v))] = len(ops)
    addr: dict[int, int] = {}
    for index, kind in bound.items():
        if layer is None:
            raise TopqError(f"@{function.name} reads a KV history but has no layer attribute")
        addr[id(function.args[index])] = plan.kv_regions[(int(layer), kind)]
    state_args, state_results = state_bindings(function)
    for index, key in state_args.items():
        addr[id(function.args[index])] = plan.state_regions[key][0]
    for index, key in state_results.items():
        addr[id(root(function.results[index]))] = plan.state_regions[key][0]
    active: list[tuple[int, int, int]] = []  # (end, offset, size)
    used = 0
    for key in sorted((k for k in ddr if k not in addr), key=lambda k: (start[k], -_size(ddr[k], a))):
        size = _size(ddr[key], a)
        active = [blk for blk in active if blk[0] >= start[key]]
        offset = 0
        for _, o, s in sorted(active, key=lambda blk: blk[1]):
            if offset + size <= o:
                break
            offset = max(offset, o + s)
        active.append((end[key], offset, size))
        addr[key] = base + offset
        used = max(used, offset + size)
    function.attrs["arg_addrs"] = [addr[id(arg)] for arg in function.args]
    for op in ops:
        if not op.results or raw.is_kernel_op(op):  # kernel IR results are scalars (no pass attributes)
            continue
        addrs = [addr.get(id(root(r)), -1) for r in op.results]
        if op.name in VIEW_OPS and addrs[0] < 0:
            continue  # a view of a local value
        if len(addrs) == 1:
            if addrs[0] >= 0:
                op.attrs["addr"] = addrs[0]
        else:
            op.attrs["addrs"] = addrs
    return used


def _size(value: Value, a: int) -> int:
    t = value.type
    return align(t.nbytes if isinstance(t, TensorType) else 0, a) or a


def value_name(value: Value) -> str:
    """A readable name for messages: the producing op's location (or name) and result index, or the argument."""
    owner = value.owner
    if isinstance(owner, Operation):
        base = f"{owner.loc or owner.name} ({owner.name}"
        return base + (f" result {value.index})" if len(owner.results) > 1 else ")")
    return f"argument %arg{value.index}"
