"""Layer groups: consecutive ops whose working set fits local memory run as one group; only values that cross a
group boundary (or a function boundary) go through DDR.

The local-memory model (an approximation of TPU-MLIR's LmemAllocator, stated so the numbers can be checked):

* a tensor is spread over the NPU lanes: per lane it takes `ceil(bytes / lanes)` rounded up to `eu_bytes`;
* a step of a group holds the group's values that are live at it (a group input from its first to its last use,
  a value made in the group from its definition to its last use there), the op's weight tiles double-buffered
  (weights stream from DDR, never stay resident) and the op's scratch (dequantized weight tile, f32 MLP
  intermediates, flash-attention blocks);
* one bank per lane is reserved so a result never shares a bank with the operands being read;
* ops that touch DDR by address or index (Gather, FAttention on the KV cache, KVStore, Permute, Concat, Slice,
  TopK, MoE — it gathers each expert's tokens) form groups of their own, as global ops do in TPU-MLIR; a MoE
  streams the router and one expert's weights at a time.

An op that does not fit alone is tiled: sequence slices (rows) first when it has more than one row, then output
channel slices, the smallest total number of slices that fits; its `tiling = [seq, channel]` is recorded and it
forms a group of its own. `group` ids number the groups of a function from 0.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from topq.core.errors import TopqError
from topq.ir.graph import Block, Function, Operation, Value
from topq.ir.types import TensorType
from topq.plugins.targets.bm1684x import raw
from topq.plugins.targets.bm1684x.spec import ChipSpec

GLOBAL_OPS = frozenset({"tpu.Gather", "tpu.FAttention", "tpu.KVStore", "tpu.Permute", "tpu.Concat", "tpu.Slice",
                        "tpu.TopK", "tpu.MoE"})
VIEW_OPS = frozenset({"tpu.Reshape"})
WEIGHT_OPS = frozenset({"tpu.MatMul", "tpu.A16MatMul", "tpu.MatMulInt8", "tpu.MLP", "tpu.A16MLP"})
#: keys of the flash-attention model's K/V blocks
KV_BLOCK = 256


def is_weight(value: Value) -> bool:
    return isinstance(value.owner, Operation) and value.owner.name == "tpu.Weight"


def root(value: Value) -> Value:
    """The value whose memory `value` shares (through views)."""
    while isinstance(value.owner, Operation) and value.owner.name in VIEW_OPS:
        value = value.owner.operands[0]
    return value


def _nbytes(value: Value) -> int:
    return _type_bytes(value.type)


@functools.lru_cache(maxsize=4096)
def _type_bytes(t: object) -> int:
    return t.nbytes if isinstance(t, TensorType) else 0


def _divisors(n: int) -> list[int]:
    """Powers of two dividing n, then n itself (slice counts that split n evenly)."""
    out, d = [], 1
    while d <= n and n % d == 0:
        out.append(d)
        d *= 2
    if n not in out:
        out.append(n)
    return out


class LocalMemory:
    """Per-lane byte counts of the chip's local memory model."""

    def __init__(self, chip: ChipSpec) -> None:
        self.chip = chip
        self.bank = chip.local_mem_per_lane // chip.local_mem_banks
        self.capacity = chip.local_mem_per_lane - self.bank

    def lane(self, nbytes: float) -> int:
        per = -(-int(nbytes) // self.chip.lanes)
        eu = self.chip.eu_bytes
        return -(-per // eu) * eu

    def rows(self, op: Operation) -> int:
        """The sequence length an op can be sliced along (1 for decode)."""
        if op.name == "tpu.FAttention":
            return op.operands[0].shape[1]
        shape = op.results[0].shape if op.results else op.operands[0].shape
        return shape[-2] if len(shape) >= 2 else 1

    def channels(self, op: Operation) -> int:
        """The output channels an op can be sliced along (its weights' N, or the MLP's intermediate size)."""
        weights = [v for v in op.operands if is_weight(v)]
        if not weights:
            return 1
        if op.name in ("tpu.MLP", "tpu.A16MLP"):
            return weights[0].shape[0]
        return weights[0].shape[0]

    def weights(self, op: Operation) -> int:
        """Weight bytes streamed through local memory (a gather fetches only its rows: counted as its result)."""
        if op.name == "tpu.Gather":
            return 0
        if op.name == "tpu.MoE":  # the router, then one expert at a time
            per = 3 * (1 if not op.attrs.get("weight_bits") else 2 if op.attrs.get("symmetric") else 3)
            return sum(_nbytes(v) for v in op.operands[1:2 + per])
        return sum(_nbytes(v) for v in op.operands if is_weight(v))

    def scratch(self, op: Operation, seq: int, ch: int) -> int:
        """Per-lane bytes an op needs besides its operands and results."""
        if op.name not in WEIGHT_OPS and op.name != "tpu.FAttention":
            # norms, softmax and activations keep an f32 copy of their input slice
            if op.name in ("tpu.RMSNorm", "tpu.LayerNorm", "tpu.Softmax", "tpu.SiLU", "tpu.GELU", "tpu.Rope"):
                return self.lane(op.operands[0].type.numel * 4 / seq)  # type: ignore[union-attr]
            return 0
        if op.name == "tpu.FAttention":
            q, k = op.operands[0], op.operands[1]
            hq, d = q.shape[2], q.shape[3]
            keys = min(KV_BLOCK, k.shape[1] + int(op.attrs.get("history", 0)))
            item = k.type.np_dtype.itemsize  # type: ignore[union-attr]
            block = keys * k.shape[2] * d * item
            rows = q.shape[1] / seq
            return (2 * 2 * self.lane(block)  # K and V blocks, double-buffered
                    + self.lane(hq * rows * keys * 4)  # scores f32
                    + self.lane(hq * rows * (d + 2) * 4))  # running output, max and sum in f32
        rows = op.operands[0].type.numel / op.operands[0].shape[-1] / seq  # type: ignore[union-attr]
        item = op.results[0].type.np_dtype.itemsize if op.attrs.get("dtype") != "f32" else 4  # type: ignore[union-attr]
        extra = 0
        if op.name.startswith("tpu.A16"):  # the dequantized weight tile in the compute dtype
            n_k = sum(v.shape[0] * v.shape[1] * 8 // op.attrs["weight_bits"]
                      for v in op.operands if is_weight(v) and len(v.shape) == 2 and v.type.dtype in ("ui8", "i8"))  # type: ignore[union-attr]
            extra += self.lane(n_k * item / ch)
        if op.name in ("tpu.MLP", "tpu.A16MLP"):  # gate and up in f32, act*up in dtype
            inter = self.channels(op) / ch
            extra += 2 * self.lane(rows * inter * 4) + self.lane(rows * inter * item)
        return extra

    def footprint(self, op: Operation, seq: int = 1, ch: int = 1) -> int:
        """Per-lane bytes of an op alone, sliced seq × ch."""
        acts = 0
        history = set(map(id, op.operands[-2:])) if op.attrs.get("history") else set()
        for v in list(op.operands) + list(op.results):
            if is_weight(v) or id(v) in history:
                continue
            sliced = seq if not (op.name == "tpu.FAttention" and v in op.operands[1:3]) else 1
            out_ch = ch if v in op.results and op.name in WEIGHT_OPS and op.name not in ("tpu.MLP",
                                                                                       "tpu.A16MLP") else 1
            acts += self.lane(_nbytes(v) / sliced / out_ch)
        return acts + 2 * self.lane(self.weights(op) / ch) + self.scratch(op, seq, ch)

    def tiling(self, op: Operation) -> tuple[int, int]:
        """The fewest slices (seq, channel) with which the op fits alone."""
        rows, chans = self.rows(op), self.channels(op)
        candidates = sorted(((s, c) for s in _divisors(rows) for c in _divisors(chans)),
                            key=lambda sc: (sc[0] * sc[1], -sc[0] if rows > 1 else sc[0]))
        for seq, ch in candidates:
            if self.footprint(op, seq, ch) <= self.capacity:
                return seq, ch
        raise TopqError(f"{op.name} ({op.loc}) does not fit {self.chip.name} local memory even in "
                        f"{rows} x {chans} slices")

    def group_peak(self, ops: list[Operation]) -> int:
        """Largest per-lane working set over the steps of a candidate group."""
        index = {id(op): i for i, op in enumerate(ops)}
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        size: dict[int, int] = {}
        for i, op in enumerate(ops):
            if op.name in VIEW_OPS:
                continue
            for v in op.operands:
                if is_weight(v):
                    continue
                r = root(v)
                key = id(r)
                made_here = isinstance(r.owner, Operation) and id(r.owner) in index
                first.setdefault(key, index[id(r.owner)] if made_here else i)  # type: ignore[arg-type]
                last[key] = i
                size[key] = self.lane(_nbytes(r))
            for r in op.results:
                first.setdefault(id(r), i)
                last.setdefault(id(r), i)
                size[id(r)] = self.lane(_nbytes(r))
        peak = 0
        for i, op in enumerate(ops):
            if op.name in VIEW_OPS:
                continue
            live = sum(size[k] for k in size if first[k] <= i <= last[k])
            peak = max(peak, live + 2 * self.lane(self.weights(op)) + self.scratch(op, 1, 1))
        return peak


@dataclass
class GroupReport:
    function: str
    groups: int = 0
    peak_per_lane: int = 0
    tiled: dict[str, list[int]] = field(default_factory=dict)
    ddr_values: int = 0
    local_values: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"groups": self.groups, "peak_lmem_per_lane": self.peak_per_lane, "tiled": self.tiled,
                "ddr_values": self.ddr_values, "local_values": self.local_values}


def assign_groups(function: Function, chip: ChipSpec) -> GroupReport:
    """Set `group` (and `tiling`) on every op of a lowered function; return the report."""
    lm = LocalMemory(chip)
    report = GroupReport(function.name)
    groups: list[list[Operation]] = []
    current: list[Operation] = []

    def close() -> None:
        nonlocal current
        if current:
            groups.append(current)
            current = []

    # A staged raw kernel (raw.py) is a group of its own: its buffers own local memory while it runs.
    raw_sections = dict(raw.sections(function.ops))
    raw_peaks: dict[int, int] = {}  # group index → per-lane bytes of its staged buffers
    raw_end = 0
    for i, op in enumerate(function.ops):
        if i < raw_end:
            continue
        if i in raw_sections:
            close()
            raw_end = raw_sections[i]
            used = raw.place_buffers(function.ops[i:raw_end], chip, f"@{function.name}")
            raw_peaks[len(groups)] = lm.lane(used)
            groups.append(function.ops[i:raw_end])
            continue
        if op.name == "tpu.Weight":
            continue
        if op.name in VIEW_OPS:
            current.append(op)  # a view costs nothing; it belongs wherever it is
            continue
        seq, ch = lm.tiling(op)
        if op.name in GLOBAL_OPS or (seq, ch) != (1, 1):
            close()
            if (seq, ch) != (1, 1):
                op.attrs["tiling"] = [seq, ch]
                report.tiled[op.loc or op.name] = [seq, ch]
            groups.append([op])
            report.peak_per_lane = max(report.peak_per_lane, lm.footprint(op, seq, ch))
            continue
        if current and lm.group_peak(current + [op]) > lm.capacity:
            close()
        current.append(op)
    close()
    for gid, ops in enumerate(groups):
        for op in ops:
            if not raw.is_kernel_op(op):  # kernel IR ops take no pass attributes; they run in their staging group
                op.attrs["group"] = gid
        if gid in raw_peaks:
            report.peak_per_lane = max(report.peak_per_lane, raw_peaks[gid])
        elif len(ops) > 1 or "tiling" not in ops[0].attrs:
            report.peak_per_lane = max(report.peak_per_lane, lm.group_peak(ops))
    report.groups = len(groups)
    ddr = ddr_values(function)
    report.ddr_values = len(ddr)
    report.local_values = sum(1 for op in function.ops if op.name not in ("tpu.Weight", *VIEW_OPS)
                              and not raw.is_kernel_op(op) for r in op.results if id(r) not in ddr)
    return report


def ddr_values(function: Function) -> dict[int, Value]:
    """Root values that must live in DDR: function arguments and results, and values used outside their group."""
    out: dict[int, Value] = {id(a): a for a in function.args}
    for value in function.results:
        r = root(value)
        out[id(r)] = r
    for op in function.ops:
        if op.name == "tpu.Weight" or raw.is_kernel_op(op):  # kernel ops address local buffers and scalars only
            continue
        group = op.attrs.get("group")
        for v in op.operands:
            if is_weight(v):
                continue
            r = root(v)
            owner = r.owner
            if isinstance(owner, Block) or not isinstance(owner, Operation):
                continue
            if owner.attrs.get("group") != group or op.name in GLOBAL_OPS or owner.name in GLOBAL_OPS:
                out[id(r)] = r
    return out
