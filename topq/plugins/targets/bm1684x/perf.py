"""Performance model of the BM1684X family: per-op cost on Top IR → first-token latency and decode speed.

The model (docs/perf.md has the derivation and the calibration):

* **Compute** of an op = cube time + vector time (both run on the one TIU, one after the other).
  Cube: `flops / (peak_ops[dtype] × efficiency)` with one efficiency for matmuls and one for fused
  attention. Vector (norms, elementwise, RoPE, softmax, W4/W8 dequantisation) runs on the EU:
  `element-ops / (lanes × eu_bytes / element_bytes × clock × vector efficiency)`.
* **DMA** of an op = bytes it moves between DDR and local memory / (ddr_bandwidth × achievable fraction):
  weights in their stored size (W4 = 0.5 B + scale/zero per group, W8 = 1 B, BF16 = 2 B), activations
  a group reads from or writes to DDR, the KV history attention reads (once per query head by default:
  `Calibration.kv_per_query_head`; a sliding layer's window at most, whose keys also bound its attention work:
  `attended_keys`). Each transfer is rounded up to the DMA burst (`spec.dma_align`).
* **Layer groups** (approximation of the compiler's): every matmul / MLP / attention is its own group
  with its weights streamed; elementwise, norm and RoPE ops fuse into the next such group (trailing
  ones into the previous). Views (reshape, the in-place history concat) cost nothing. A group takes
  `max(compute, DMA) + per-group overhead` (DMA and compute overlap by double buffering); a function
  call adds a launch overhead.
* **Multi-core** (bm1688): every op is split across `spec.cores` cores — matmuls along N, attention by
  heads, elementwise by elements; each core reads the whole input activation of a matmul. The cores share
  one DDR interface (`ddr_bandwidth`) and each core's DMA engine moves at most `dma_bandwidth`: a group's
  DMA time is the larger of one core's bytes at its engine's rate and all cores' bytes at the interface's.

One `Calibration` (efficiencies, overheads, DDR fraction) holds for every model and chip of the family.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from topq.core.errors import TopqError
from topq.core.family import ModelFamily, ModelSpec, find_family
from topq.core.stages import StageConfig, build_program, stage_window
from topq.ir.graph import Function, Module, Operation, Value
from topq.plugins.targets.bm1684x.raw import element_ops
from topq.plugins.targets.bm1684x.spec import SPECS, ChipSpec

# ------------------------------------------------------------------------------------------ modes


@dataclass(frozen=True)
class QuantMode:
    """How a linear weight is stored and in which dtype the chip computes with it."""

    name: str
    weight_bits: int | None  # None: float weights stored in the activation dtype
    compute: str  # key of ChipSpec.peak_ops used for matmuls
    act_bytes: int  # bytes per activation / float weight element
    group_size: int = 64  # weights per scale (0 or -1: one per output channel)
    symmetric: bool = False
    requant: bool = False  # W8A8 static: i32 multiplier + i8 rshift per channel instead of a bf16 scale

    SCALE_BYTES = 2  # bf16/f16 scale per group
    ZERO_BYTES = 1  # uint8 zero point per group (asymmetric only)
    REQUANT_BYTES = 5  # int32 multiplier + int8 right shift per output channel (tpu.MatMulInt8, static)

    def weight_bytes(self, n: int, k: int) -> float:
        """Stored bytes of an [N, K] linear weight (K is the quantization-group axis)."""
        if self.weight_bits is None:
            return float(n * k * self.act_bytes)
        group = k if self.group_size <= 0 else min(self.group_size, k)
        groups = n * math.ceil(k / group)
        per_group = (self.REQUANT_BYTES if self.requant
                     else self.SCALE_BYTES + (0 if self.symmetric else self.ZERO_BYTES))
        return n * k * self.weight_bits / 8 + groups * per_group

    @property
    def dequant_ops(self) -> int:
        """EU element-ops to turn one stored weight into a compute-dtype weight (0: used as stored)."""
        if self.weight_bits is None or self.compute == "int8":
            return 0
        return 3 if self.weight_bits == 4 else 2  # (unpack +) convert, subtract zero, multiply scale


#: scheme name → (weight bits, compute dtype, activation bytes). Algorithms default to 4-bit bf16.
_SCHEMES: dict[str, tuple[int | None, str, int]] = {
    "f32": (None, "f32", 4),
    "bf16": (None, "bf16", 2),
    "f16": (None, "f16", 2),
    "w8bf16": (8, "bf16", 2),
    "w4bf16": (4, "bf16", 2),
    "w8f16": (8, "f16", 2),
    "w4f16": (4, "f16", 2),
    "int8": (8, "int8", 2),
    "gptq": (4, "bf16", 2),
    "awq": (4, "bf16", 2),
    "autoround": (4, "bf16", 2),
}


def quant_mode(name: str, group_size: int = 64, symmetric: bool = False, bits: int | None = None,
               dynamic: bool = False) -> QuantMode:
    """The mode of a scheme name (`w4bf16`, `bf16`, `int8`, `gptq`, ...); `bits` overrides an algorithm's.
    `int8` is symmetric per channel; static (not `dynamic` tokens) it requantizes with i32 multipliers + i8 shifts."""
    try:
        weight_bits, compute, act_bytes = _SCHEMES[name]
    except KeyError:
        raise TopqError(f"perf model: unknown quant mode {name!r}; known: {', '.join(sorted(_SCHEMES))}") from None
    if bits is not None and weight_bits is not None:
        weight_bits = int(bits)
    if name == "int8":  # W8A8: one scale (dynamic) or multiplier + shift (static) per output channel
        return QuantMode(name, weight_bits, compute, act_bytes, 0, True, requant=not dynamic)
    return QuantMode(name, weight_bits, compute, act_bytes, int(group_size), bool(symmetric))


def _compiled_mode(name: str, bundle: Any, group_size: int, symmetric: bool) -> QuantMode:
    """The mode of a bundle compiled from a scheme the perf model has no entry for: its compute dtype, and the bits
    of its A16 linears (the first one's; float weights when it has none)."""
    dtype = str((bundle.meta.get("target_meta") or {}).get("dtype", "bf16"))
    bits = re.search(r'"tpu\.A16MatMul"\(.*?weight_bits = (\d+)', bundle.program)
    return QuantMode(name, int(bits.group(1)) if bits else None, dtype, 4 if dtype == "f32" else 2, group_size,
                     symmetric)


def _as_mode(mode: QuantMode | str) -> QuantMode:
    return quant_mode(mode) if isinstance(mode, str) else mode


# ------------------------------------------------------------------------------------------ calibration


@dataclass(frozen=True)
class Calibration:
    """The model's free constants: one set for every model and every chip of the family (docs/perf.md)."""

    cube_eff: float = 0.60  # fraction of peak_ops a matmul reaches on the cube
    attn_eff: float = 0.25  # fraction of peak_ops fused attention (QKᵀ, PV) reaches
    vector_eff: float = 0.50  # fraction of the EU's lanes × eu_bytes per cycle that vector ops reach (not fitted)
    ddr_eff: float = 0.65  # achievable fraction of ddr_bandwidth
    group_overhead_s: float = 3e-6  # fixed cost of one layer group (sync, instruction issue)
    launch_s: float = 25e-6  # fixed cost of one function call (runtime launch)
    kv_per_query_head: bool = True  # attention streams K/V once per query head (GQA heads not batched)


CALIBRATION = Calibration()

#: EU element-ops per output element of the vector ops (estimates from the ops' arithmetic, not fitted).
VECTOR_OPS: dict[str, int] = {
    "RMSNorm": 4,  # square, reduce-add, multiply by rsqrt, multiply by weight
    "LayerNorm": 6,
    "Add": 1,
    "Mul": 1,
    "MulConst": 1,
    "SiLU": 4,  # exp, add, reciprocal, multiply
    "Tanh": 4,  # exp, add, reciprocal, multiply (as SiLU)
    "GELU": 8,
    "Softmax": 5,
    "Rope": 3,  # two multiplies and an add (rotate-half is addressing)
    "Permute": 1,  # a copy
    "TopK": 2,
}
SCORE_OPS = 7  # attention, per score element in f32: scale, mask add, max, subtract, exp, sum, divide
SOFTCAP_OPS = 6  # per score element: divide, tanh (4), multiply
MLP_ACT_OPS = {"silu": 4, "gelu": 8, "gelu_tanh": 8}  # + 1 for the gate × up multiply
VIEW_OPS = frozenset({"Input", "Weight", "Reshape", "Concat", "Slice"})  # no data movement of their own
ANCHOR_OPS = frozenset({"MatMul", "MLP", "MoE", "FAttention", "GatedDeltaRule", "ChunkGatedDeltaRule"})  # own groups
STATE_BYTES = 4  # a recurrent layer's states are f32 on the chip, whatever the mode
#: recurrent ops: operand index of the carried state they read (result 1 is the state they write)
STATE_OPERAND = {"GatedDeltaRule": 5, "ChunkGatedDeltaRule": 5, "CausalConv1d": 2}
DELTA_STEP_OPS = 7  # f32 element-ops per state element and token: decay, Sᵀk (mul, add), delta, k⊗delta add, Sᵀq


# ------------------------------------------------------------------------------------------ per-op cost


@dataclass
class OpRow:
    """One op of a function estimate.

    `time_s` is the op's share of its group's time: each op's max(compute, DMA) scaled so the group's ops add up
    to the group's max(Σ compute, Σ DMA), plus the group overhead on the group's matmul/attention op. The rows
    and the launch overhead add up to the function's total.
    """

    name: str
    loc: str | None
    group: int
    flops: float
    bytes: float  # DDR bytes moved, all cores together
    compute_s: float
    dma_s: float
    time_s: float = 0.0


@dataclass
class FunctionEstimate:
    name: str
    rows: list[OpRow]
    groups: int
    launch_s: float
    total_s: float

    @property
    def flops(self) -> float:
        return sum(r.flops for r in self.rows)

    @property
    def bytes(self) -> float:
        return sum(r.bytes for r in self.rows)

    @property
    def compute_s(self) -> float:
        return sum(r.compute_s for r in self.rows)

    @property
    def dma_s(self) -> float:
        return sum(r.dma_s for r in self.rows)

    def table(self) -> str:
        """A per-op text table (the compiler's `--dump` view)."""
        lines = [(f"@{self.name}: {self.total_s * 1e3:.3f} ms in {self.groups} groups "
                  f"(+{self.launch_s * 1e6:.0f} us launch)"),
                 f"{'op':<16}{'loc':<34}{'grp':>4}{'MFLOP':>12}{'KB':>12}"
                 f"{'compute us':>12}{'dma us':>10}{'time us':>10}"]
        for r in self.rows:
            lines.append(f"{r.name:<16}{(r.loc or '-'):<34}{r.group:>4}{r.flops / 1e6:>12.2f}{r.bytes / 1024:>12.1f}"
                         f"{r.compute_s * 1e6:>12.2f}{r.dma_s * 1e6:>10.2f}{r.time_s * 1e6:>10.2f}")
        return "\n".join(lines)


@dataclass
class _Cost:
    flops: float = 0.0  # total over cores
    cube_s: float = 0.0
    vector_s: float = 0.0
    bytes_per_core: float = 0.0


class _Estimator:
    """Costs of the ops of one function on one chip in one mode."""

    def __init__(self, function: Function, chip: ChipSpec, mode: QuantMode, lm_head_mode: QuantMode,
                 cal: Calibration) -> None:
        self.chip, self.mode, self.cal = chip, mode, cal
        self.linear_mode = lm_head_mode if function.name == "lm_head" else mode
        self.cores = max(1, chip.cores)
        self.weights = {id(op.results[0]) for op in function.walk() if _kind(op) == "Weight"}
        self.args = {id(a) for a in function.args}
        self.results = {id(r) for r in function.results}

    # -- primitives
    def numel(self, v: Value) -> int:
        return math.prod(v.shape)

    def transfer(self, nbytes: float, split: bool = True) -> float:
        """Bytes one core moves for a tensor of `nbytes` (split across cores or read by each), DMA-aligned."""
        per_core = nbytes / self.cores if split else nbytes
        if per_core <= 0:
            return 0.0
        align = self.chip.dma_align
        return math.ceil(per_core / align) * align

    def act(self, v: Value, split: bool = True) -> float:
        return self.transfer(self.numel(v) * self.mode.act_bytes, split)

    def cube_s(self, flops: float, dtype: str, eff: float) -> float:
        return flops / self.cores / (self.chip.peak_ops[dtype] * eff)

    def vector_s(self, element_ops: float, element_bytes: int) -> float:
        per_s = self.chip.lanes * self.chip.eu_bytes / element_bytes * self.chip.clock_hz * self.cal.vector_eff
        return element_ops / self.cores / per_s

    def is_weight(self, v: Value) -> bool:
        return id(v) in self.weights

    def io(self, op: Operation) -> float:
        """DDR traffic of a fused (non-anchor) op: only function inputs it reads and results it writes."""
        total = 0.0
        for v in op.operands:
            if id(v) in self.args:
                total += self.act(v)
            elif self.is_weight(v):  # a norm weight: every core reads all of it
                total += self.transfer(self.numel(v) * self.mode.act_bytes, split=False)
        for r in op.results:
            if id(r) in self.results:
                total += self.act(r)
        return total

    # -- ops
    def cost(self, op: Operation) -> _Cost:
        kind = _kind(op)
        if kind in VIEW_OPS:
            return _Cost()
        handler = getattr(self, f"_cost_{kind}", None)
        if handler is not None:
            return handler(op)
        out = op.results[0] if op.results else None
        elements = self.numel(out) if out is not None and hasattr(out.type, "shape") else 0
        ops = VECTOR_OPS.get(kind, 1)
        return _Cost(vector_s=self.vector_s(elements * ops, self.mode.act_bytes), bytes_per_core=self.io(op))

    def _linear(self, rows: int, n: int, k: int) -> _Cost:
        """[rows, K] @ W[N, K]ᵀ with W a stored weight: cube flops, dequantisation on the EU, the weight streamed
        once (split along N across cores)."""
        mode = self.linear_mode
        flops = 2.0 * rows * k * n
        cube = self.cube_s(flops, mode.compute, self.cal.cube_eff)
        vector = self.vector_s(n * k * mode.dequant_ops, 2)
        return _Cost(flops, cube, vector, self.transfer(mode.weight_bytes(n, k)))

    def _cost_MatMul(self, op: Operation) -> _Cost:
        x, w, *bias = op.operands
        out = op.results[0]
        n, k = (w.shape[-2], w.shape[-1]) if op.attrs.get("right_transpose") else (w.shape[-1], w.shape[-2])
        if self.is_weight(w) and len(w.shape) == 2:
            c = self._linear(self.numel(x) // k, n, k)
        else:  # activation × activation (batched): no weight to stream
            flops = 2.0 * self.numel(out) * k
            c = _Cost(flops, self.cube_s(flops, self.mode.compute, self.cal.cube_eff), 0.0, self.act(w))
        c.bytes_per_core += self.act(x, split=False) + self.act(out)
        c.bytes_per_core += sum(self.transfer(self.numel(b) * self.mode.act_bytes) for b in bias)
        return c

    def _cost_MLP(self, op: Operation) -> _Cost:
        x, gate = op.operands[:2]
        inter, hidden = gate.shape
        rows = self.numel(x) // hidden
        c = _Cost()
        for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)):
            part = self._linear(rows, n, k)
            c.flops += part.flops
            c.cube_s += part.cube_s
            c.vector_s += part.vector_s
            c.bytes_per_core += part.bytes_per_core
        act_ops = MLP_ACT_OPS.get(str(op.attrs.get("act", "silu")), 4) + 1
        c.vector_s += self.vector_s(rows * inter * act_ops, self.mode.act_bytes)
        c.bytes_per_core += self.act(x, split=False) + self.act(op.results[0])
        return c

    def _cost_MoE(self, op: Operation) -> _Cost:
        """Router (a float linear), then each token's top_k experts: compute for rows × top_k expert MLPs, weights
        streamed only for the experts some token chose — top_k for one decode token; for `rows` tokens the
        expected number of distinct experts under uniform routing, E·(1 − (1 − top_k/E)^rows). A shared expert
        (and its [1, H] gate) runs on every token."""
        x, router = op.operands[:2]
        experts, top_k = int(op.attrs["num_experts"]), int(op.attrs["top_k"])
        hidden = x.shape[-1]
        inter = op.operands[2].shape[0]
        rows = self.numel(x) // hidden
        active = top_k if rows == 1 else experts * (1 - (1 - top_k / experts) ** rows)
        act_ops = MLP_ACT_OPS.get(str(op.attrs.get("act", "silu")), 4) + 1
        c = self._float_linear(rows, experts, hidden)
        c.vector_s += self.vector_s(rows * experts * VECTOR_OPS["Softmax"], 4)
        self._add_gated_mlp(c, rows * top_k, inter, hidden, streams=active)
        c.vector_s += self.vector_s(rows * top_k * (inter * act_ops + hidden), self.mode.act_bytes)
        if len(op.operands) > 2 + 3 * experts:  # the shared expert and its gate
            shared = op.operands[-4].shape[0]
            self._add_gated_mlp(c, rows, shared, hidden, streams=1)
            gate = self._float_linear(rows, 1, hidden)
            c.flops += gate.flops
            c.cube_s += gate.cube_s
            c.bytes_per_core += gate.bytes_per_core
            c.vector_s += self.vector_s(rows * (shared * act_ops + 2 * hidden), self.mode.act_bytes)
        c.bytes_per_core += self.act(x, split=False) + self.act(op.results[0])
        return c

    def _add_gated_mlp(self, c: _Cost, rows: int, inter: int, hidden: int, streams: float) -> None:
        """Add gate, up and down of an expert MLP computed for `rows` tokens, its weights streamed `streams` times
        (the number of distinct experts read, each with its own weights and dequantisation)."""
        for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)):
            part = self._linear(rows, n, k)
            c.flops += part.flops
            c.cube_s += part.cube_s
            c.vector_s += part.vector_s * streams
            c.bytes_per_core += part.bytes_per_core * streams

    def _float_linear(self, rows: int, n: int, k: int) -> _Cost:
        """[rows, K] @ W[N, K]ᵀ with W kept in the activation dtype (a router: never quantized)."""
        flops = 2.0 * rows * k * n
        compute = "bf16" if self.mode.compute == "int8" else self.mode.compute
        return _Cost(flops, self.cube_s(flops, compute, self.cal.cube_eff), 0.0,
                     self.transfer(n * k * self.mode.act_bytes))

    def _cost_FAttention(self, op: Operation) -> _Cost:
        q, k, v, *mask = op.operands
        _, lq, hq, d = q.shape
        lk, kv_heads = k.shape[1], k.shape[2]
        window = int(op.attrs.get("window") or 0)
        scores = hq * attended_keys(lq, lk, bool(mask), window)
        flops = 4.0 * scores * d  # QKᵀ and PV
        cube = self.cube_s(flops, "bf16" if self.mode.compute == "int8" else self.mode.compute, self.cal.attn_eff)
        vector = self.vector_s(scores * (SCORE_OPS + (SOFTCAP_OPS if op.attrs.get("softcap") else 0)), 4)
        # K/V are re-read once per pass over the queries that fit half of local memory, and (without GQA
        # batching) once per query head of a KV head; a pass of a sliding layer reads only the keys its queries'
        # windows cover (at most `window` keys for a decode token)
        q_bytes = self.numel(q) * self.mode.act_bytes / self.cores
        query_passes = max(1, math.ceil(q_bytes / (self.chip.local_mem / 2)))
        kv_rows = min(lk, math.ceil(lq / query_passes) + window - 1) if window else lk
        passes = query_passes * (max(1, hq // kv_heads) if self.cal.kv_per_query_head else 1)
        kv_read = 2 * self.transfer(kv_rows * kv_heads * d * self.mode.act_bytes)  # K and V
        nbytes = self.act(q) + passes * kv_read + self.act(op.results[0])
        nbytes += sum(self.act(m, split=False) for m in mask)
        return _Cost(flops, cube, vector, nbytes)

    def _cost_DSLRegion(self, op: Operation) -> _Cost:
        """A raw kernel (raw.py): the float ops its body executes (static trip counts) on the EU of one core — a
        kernel's loops are not split across cores — at the kernel's element size; DMA stages every operand into
        local memory and every result back, in the storage dtype."""
        per_s = self.chip.lanes * self.chip.eu_bytes * self.chip.clock_hz * self.cal.vector_eff  # bytes/s
        vector = sum(n * size for size, n in element_ops(op.regions[0].block).items()) / per_s
        nbytes = sum(self.act(v, split=False) for v in [*op.operands, *op.results])
        return _Cost(vector_s=vector, bytes_per_core=nbytes)

    def _state_io(self, op: Operation) -> float:
        """DDR bytes of the f32 state a recurrent op reads from the previous call and writes for the next one."""
        index = STATE_OPERAND[_kind(op)]
        total = 0.0
        if len(op.operands) > index and id(op.operands[index]) in self.args:
            total += self.transfer(self.numel(op.operands[index]) * STATE_BYTES)
        if id(op.results[1]) in self.results:
            total += self.transfer(self.numel(op.results[1]) * STATE_BYTES)
        return total

    def _cost_GatedDeltaRule(self, op: Operation) -> _Cost:
        """The recurrence on the EU in f32: DELTA_STEP_OPS per state element and token."""
        _, length, heads, dv = op.operands[2].shape
        dk = op.operands[0].shape[-1]
        vector = self.vector_s(float(length * heads * dk * dv * DELTA_STEP_OPS), STATE_BYTES)
        return _Cost(vector_s=vector, bytes_per_core=self._state_io(op) + self._io_activations(op))

    def _cost_ChunkGatedDeltaRule(self, op: Operation) -> _Cost:
        """Per chunk of C tokens and value head: k_βkᵀ and qkᵀ (2·C²·DK each), the two unit-triangular solves
        (C²·(DK + DV)), the intra-chunk PV (2·C²·DV) and the three state products (2·C·DK·DV each), on the cube
        in f32 at the attention efficiency."""
        _, length, heads, dv = op.operands[2].shape
        dk = op.operands[0].shape[-1]
        c = min(int(op.attrs.get("chunk_size", 64)), length)
        chunks = math.ceil(length / c)
        flops = heads * chunks * (4.0 * c * c * dk + c * c * (dk + dv) + 2.0 * c * c * dv + 6.0 * c * dk * dv)
        cube = self.cube_s(flops, "f32", self.cal.attn_eff)
        vector = self.vector_s(float(heads * chunks * c * c * 4), STATE_BYTES)  # decay masks and their exp
        return _Cost(flops, cube, vector, self._state_io(op) + self._io_activations(op))

    def _cost_CausalConv1d(self, op: Operation) -> _Cost:
        x, weight = op.operands[:2]
        width = weight.shape[-1]
        vector = self.vector_s(float(self.numel(x) * (2 * width + 4)), STATE_BYTES)  # taps, then SiLU
        return _Cost(vector_s=vector, bytes_per_core=self._state_io(op) + self._io_activations(op))

    def _io_activations(self, op: Operation) -> float:
        """DDR traffic of an op's non-state function inputs and results (as `io`), e.g. a prefill's valid mask."""
        index = STATE_OPERAND[_kind(op)]
        total = sum(self.act(v) for i, v in enumerate(op.operands) if id(v) in self.args and i != index)
        total += sum(self.act(r) for r in op.results[:1] if id(r) in self.results)
        return total + sum(self.transfer(self.numel(v) * self.mode.act_bytes, split=False)
                           for v in op.operands if self.is_weight(v))

    def _cost_Gather(self, op: Operation) -> _Cost:
        _, index = op.operands
        out = op.results[0]
        nbytes = self.act(out)  # only the gathered rows are read
        if id(index) in self.args:
            nbytes += self.transfer(self.numel(index) * 4, split=False)
        if id(out) in self.results:
            nbytes += self.act(out)  # and written back (the embedding)
        return _Cost(bytes_per_core=nbytes)


def attended_keys(queries: int, keys: int, masked: bool, window: int = 0) -> float:
    """Query-key pairs an attention call computes, summed over its queries. Causal and bottom-right aligned, query
    i sees history + i + 1 keys (history = keys - queries); a masked call (a history stage) computes every key,
    since which are visible is known only at run time; a sliding window of `window` keys bounds each query (the
    kernel starts at the query's window, known from its position)."""
    if masked:
        return float(queries * (min(keys, window) if window else keys))
    first = keys - queries + 1  # keys the first query sees
    if not window:
        return queries * (first - 1) + queries * (queries + 1) / 2
    below = max(0, min(queries, window - first))  # queries whose causal keys are fewer than the window
    return below * first + below * (below - 1) / 2 + (queries - below) * window


def _kind(op: Operation) -> str:
    """`top.MatMul` → `MatMul` (works for any dialect that keeps the Top op names)."""
    return op.name.rsplit(".", 1)[-1]


def _groups(ops: list[Operation]) -> list[int]:
    """Group index of each op: an anchor starts a group; other ops join the next anchor's group."""
    anchors = [i for i, op in enumerate(ops) if _kind(op) in ANCHOR_OPS]
    if not anchors:
        return [0] * len(ops)
    groups, g = [], 0
    for i, _ in enumerate(ops):
        while g < len(anchors) and anchors[g] < i:
            g += 1
        groups.append(min(g, len(anchors) - 1))
    return groups


def estimate_function(function: Function, chip: ChipSpec | str, mode: QuantMode | str,
                      lm_head_mode: QuantMode | str = "bf16", cal: Calibration = CALIBRATION) -> FunctionEstimate:
    """Per-op rows and the total time of one call of `function` on `chip` in `mode`.

    `lm_head_mode` is the mode of the matmul of the function named `lm_head`.
    """
    spec = SPECS[chip] if isinstance(chip, str) else chip
    est = _Estimator(function, spec, _as_mode(mode), _as_mode(lm_head_mode), cal)
    # per-core bytes/s: one core's DMA engine, or its share of the DDR interface the cores stream through at once
    bandwidth = min(spec.dma_bandwidth or spec.ddr_bandwidth, spec.ddr_bandwidth / est.cores) * cal.ddr_eff
    # Top level only: a DSLRegion's kernel IR is costed by the region (_cost_DSLRegion), not op by op.
    ops = [op for op in function.ops if _kind(op) not in ("Weight", "Input")]
    group_of = _groups(ops)
    rows: list[OpRow] = []
    for op, g in zip(ops, group_of):
        c = est.cost(op)
        compute = c.cube_s + c.vector_s
        rows.append(OpRow(_kind(op), op.loc, g, c.flops, c.bytes_per_core * est.cores, compute,
                          c.bytes_per_core / bandwidth))
    n_groups = (max(group_of) + 1) if group_of else 0
    for g in range(n_groups):
        members = [r for r in rows if r.group == g]
        compute, dma = sum(r.compute_s for r in members), sum(r.dma_s for r in members)
        time = max(compute, dma)
        solo = sum(max(r.compute_s, r.dma_s) for r in members)
        scale = time / solo if solo > 0 else 0.0
        for r in members:
            r.time_s = max(r.compute_s, r.dma_s) * scale
        anchor = next((r for r in members if r.name in ANCHOR_OPS), members[0])
        anchor.time_s += cal.group_overhead_s
    total = sum(r.time_s for r in rows) + cal.launch_s
    return FunctionEstimate(function.name, rows, n_groups, cal.launch_s, total)


# ------------------------------------------------------------------------------------------ whole model

DEFAULT_CONTEXTS = (512, 1024, 2048)


def _contexts(seq_length: int, extra: Iterable[int] = ()) -> tuple[int, ...]:
    return tuple(sorted({c for c in (*DEFAULT_CONTEXTS, *extra) if 0 < c < seq_length} | {seq_length}))


def _family(spec: ModelSpec) -> ModelFamily:
    from topq.core.plugins import get_plugins

    return get_plugins().families.get(spec.family)


def _variant_for(context: int, variants: Iterable[int]) -> int:
    """The smallest decode variant whose history holds `context` tokens (the runtime's choice)."""
    fitting = [v for v in sorted(variants) if v >= context]
    if not fitting:
        raise TopqError(f"context {context} exceeds the largest decode variant {max(variants)}")
    return fitting[0]


@dataclass
class _Program:
    """The program of a model and the estimates of the functions the runtime calls."""

    module: Module
    spec: ModelSpec
    stages: StageConfig
    estimate: Callable[[str], FunctionEstimate]
    variants: tuple[int, ...] = field(default_factory=tuple)

    def layers(self) -> range:
        return range(self.spec.num_layers)

    def prefill_s(self) -> dict[str, float]:
        blocks = sum(self.estimate(f"block_{i}").total_s for i in self.layers())
        return {"embedding_s": self.estimate("embedding").total_s, "blocks_s": blocks,
                "lm_head_s": self.estimate("lm_head").total_s}

    def prefill_kv_blocks_s(self) -> float:
        return sum(self.estimate(f"block_kv_{i}").total_s for i in self.layers())

    def decode_block(self, layer: int, variant: int) -> str:
        """The decode function of `layer` for a history of `variant` (a recurrent layer has one for every length)."""
        name = f"block_cache_{layer}" if variant == self.stages.seq_length else f"block_cache_{layer}_{variant}"
        return name if name in self.module.functions else f"block_cache_{layer}"

    def decode(self, variant: int) -> dict[str, float]:
        names = ["embedding_cache", *(self.decode_block(i, variant) for i in self.layers()), "lm_head"]
        ests = [self.estimate(n) for n in names]
        return {
            "step_s": sum(e.total_s for e in ests),
            "bytes": sum(e.bytes for e in ests),
            "blocks_s": sum(e.total_s for e in ests[1:-1]),
            "embedding_s": ests[0].total_s,
            "lm_head_s": ests[-1].total_s,
        }


_MODULES: dict[str, Module] = {}  # config-only programs by (family, spec, stages): predictions rebuild nothing


def _build(spec: ModelSpec, family: ModelFamily, stages: StageConfig,
           kernels: tuple[tuple[str, str], ...] = ()) -> Module:
    key = repr((family.name, spec, stages, kernels))
    if key not in _MODULES:
        if len(_MODULES) >= 8:
            _MODULES.pop(next(iter(_MODULES)))
        module = build_program(spec, family, stages, shapes=None)
        if kernels:  # the recipe's raw-kernel substitutions, as the pipeline applies them
            from topq.core.plugins import get_plugins

            get_plugins().kernel_substitution()(module, [{"replace": r, "with": w} for r, w in kernels])
        _MODULES[key] = module
    return _MODULES[key]


def _program(spec: ModelSpec, family: ModelFamily, stages: StageConfig, chip: ChipSpec, mode: QuantMode,
             lm_head_mode: QuantMode, cal: Calibration, kernels: tuple[tuple[str, str], ...] = ()) -> _Program:
    module = _build(spec, family, stages, kernels)
    cache: dict[str, FunctionEstimate] = {}

    def estimate(name: str) -> FunctionEstimate:
        if name not in cache:
            cache[name] = estimate_function(module[name], chip, mode, lm_head_mode, cal)
        return cache[name]

    return _Program(module, spec, stages, estimate, stages.decode_variants)


def predict(spec: ModelSpec, chip: ChipSpec | str, quant: str, seq_length: int, max_input_length: int | None = None,
            lm_head_quant: str = "bf16", group_size: int = 64, *, symmetric: bool = False,
            contexts: Iterable[int] = (), cal: Calibration = CALIBRATION) -> dict[str, Any]:
    """First-token latency, decode speed and DDR bytes per token of a model from its spec alone.

    `ftl_s`: embedding + every `block_i` at max_input_length + lm_head. `decode_tps`: one decode step
    (embedding_cache + every block_cache + lm_head) with the history at seq_length, as a single-variant
    compile runs it; `decode_tps_by_context` with the smallest variant that holds each context.
    """
    chip_spec = SPECS[chip] if isinstance(chip, str) else chip
    max_input_length = max_input_length or seq_length
    mode = quant_mode(quant, group_size, symmetric)
    head = quant_mode(lm_head_quant, group_size, symmetric)
    stages = StageConfig(seq_length, max_input_length, prefill_kv=False, decode_chunks=_contexts(seq_length, contexts))
    prog = _program(spec, _family(spec), stages, chip_spec, mode, head, cal)
    return _summary(prog, chip_spec, mode, head, cal, prompt_length=max_input_length)


def _summary(prog: _Program, chip: ChipSpec, mode: QuantMode, head: QuantMode, cal: Calibration,
             prompt_length: int) -> dict[str, Any]:
    st = prog.stages
    prefill = prog.prefill_s()
    segments = max(0, math.ceil((prompt_length - st.max_input_length) / st.max_input_length))
    if segments and not st.prefill_kv:
        raise TopqError(f"a prompt of {prompt_length} tokens needs prefill_kv (max_input_length {st.max_input_length})")
    kv_s = segments * (prefill["embedding_s"] + prog.prefill_kv_blocks_s()) if segments else 0.0
    ftl = sum(prefill.values()) + kv_s
    full = prog.decode(st.seq_length)
    by_context = {c: prog.decode(c) for c in prog.variants}
    bandwidth = chip.ddr_bandwidth  # the interface all cores share
    family = _family(prog.spec)
    kv_layers = sum(1 for i in prog.layers() if not family.states_of(prog.spec, i))
    state_bytes = sum(math.prod(s.shape) for i in prog.layers() for s in family.states_of(prog.spec, i)) * STATE_BYTES
    # hybrid models' layers differ in their linears: read them off the program
    weights = (_program_weight_bytes(prog, mode, head) if prog.spec.layer_types
               else _weight_bytes(prog.spec, mode, head))
    return {
        "chip": chip.name,
        "cores": chip.cores,
        "quant": mode.name,
        "lm_head_quant": head.name,
        "group_size": mode.group_size,
        "seq_length": st.seq_length,
        "max_input_length": st.max_input_length,
        "prompt_length": prompt_length,
        "ftl_s": ftl,
        "prefill_tokens_per_s": min(prompt_length, st.max_input_length * (segments + 1)) / ftl,
        "decode_tps": 1.0 / full["step_s"],
        "decode_step_s": full["step_s"],
        "bytes_per_token": full["bytes"],
        "weight_bytes_per_token": weights,
        "kv_cache_bytes": kv_bytes(prog.spec, st.seq_length, mode.act_bytes, layers=kv_layers),
        "kv_bytes_per_token": _kv_read_bytes(prog, family, mode.act_bytes, cal.kv_per_query_head),
        # recurrent layers: their f32 states, read and written once per decode step
        "state_bytes": state_bytes,
        "state_bytes_per_token": 2 * state_bytes,
        "ddr_utilization": full["bytes"] / full["step_s"] / bandwidth,
        "decode_tps_by_context": {str(c): 1.0 / d["step_s"] for c, d in by_context.items()},
        "bytes_per_token_by_context": {str(c): d["bytes"] for c, d in by_context.items()},
        "prefill_breakdown_s": {**prefill, "prefill_kv_s": kv_s},
        "decode_breakdown_s": {k: v for k, v in full.items() if k.endswith("_s")},
        "calibration": asdict(cal),
    }


def kv_bytes(spec: ModelSpec, history: int, act_bytes: int = 2, per_query_head: bool = False,
             layers: int | None = None) -> int:
    """K and V of `history` positions in `layers` layers (default all; a hybrid model's attention layers): the
    cache size, or what attention reads when it streams K/V once per query head."""
    heads = spec.num_heads if per_query_head else spec.num_kv_heads
    return 2 * (spec.num_layers if layers is None else layers) * history * heads * spec.head_dim * act_bytes


def _kv_read_bytes(prog: _Program, family: ModelFamily, act_bytes: int, per_query_head: bool) -> int:
    """The K/V a decode step at full context reads: seq_length + 1 positions in each attention layer, at most
    its window in a sliding one."""
    spec, positions = prog.spec, prog.stages.seq_length + 1
    windows = [stage_window(spec, i, prog.stages.seq_length) for i in prog.layers() if not family.states_of(spec, i)]
    return sum(kv_bytes(spec, min(positions, w) if w else positions, act_bytes, per_query_head, layers=1)
               for w in windows)


def _weight_bytes(spec: ModelSpec, mode: QuantMode, head: QuantMode) -> float:
    """Linear weights one decode step streams (the embedding reads one row: not counted here)."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    attention = mode.weight_bytes(q, h) + 2 * mode.weight_bytes(kv, h) + mode.weight_bytes(h, q)

    def mlp(inter: int) -> float:
        return 2 * mode.weight_bytes(inter, h) + mode.weight_bytes(h, inter)

    moe = spec.moe
    total = 0.0
    for layer in range(spec.num_layers):
        if moe is None or not moe.sparse(layer):
            total += attention + mlp(spec.intermediate_size)
            continue
        # a sparse layer: the float router, the top_k chosen experts, the shared expert and its float gate
        total += attention + moe.num_experts * h * mode.act_bytes + moe.top_k * mlp(moe.intermediate_size)
        if moe.shared_intermediate_size:
            total += mlp(moe.shared_intermediate_size) + h * mode.act_bytes
    return total + head.weight_bytes(spec.vocab_size, h)


def _program_weight_bytes(prog: _Program, mode: QuantMode, head: QuantMode) -> float:
    """Linear weights one decode step streams, read off the decode functions (layers of different kinds)."""
    total = 0.0
    for name in [*(prog.decode_block(i, prog.stages.seq_length) for i in prog.layers()), "lm_head"]:
        linear = head if name == "lm_head" else mode
        for op in prog.module[name].walk():
            kind = _kind(op)
            if kind == "MatMul" and op.attrs.get("right_transpose") and len(op.operands[1].shape) == 2:
                total += linear.weight_bytes(*op.operands[1].shape)
            elif kind == "MLP":
                total += sum(linear.weight_bytes(*w.shape) for w in op.operands[1:])
    return total


# ------------------------------------------------------------------------------------------ entry point


def _mode_from_config(config: Mapping[str, Any], quant: str) -> tuple[str, int | None]:
    """`auto`: the mode and group size of the checkpoint's quantization_config, else bf16."""
    if quant != "auto":
        return quant, None
    qc = config.get("quantization_config") or {}
    bits = qc.get("bits") or qc.get("w_bit")
    if not bits:
        return "bf16", None
    if int(bits) not in (4, 8):
        raise TopqError(f"perf model: {bits}-bit checkpoints are not supported (4 or 8)")
    group = qc.get("group_size") or qc.get("q_group_size")
    return f"w{int(bits)}bf16", (int(group) if group else None)


def perf_entry(chip_spec: ChipSpec) -> Callable[..., dict[str, Any]]:
    """The `perf=` callable of a Target: `perf(config=..., quant=..., seq_length=..., ...)` predicts from a
    config.json; `perf(bundle=..., prompt_length=...)` predicts for a compiled bundle and a prompt."""

    def perf(*, config: Mapping[str, Any] | None = None, bundle: Any = None, quant: str | None = None,
             seq_length: int | None = None, max_input_length: int | None = None, lm_head_quant: str = "bf16",
             group_size: int = 64, prompt_length: int | None = None) -> dict[str, Any]:
        if bundle is not None:
            return predict_bundle(bundle, chip_spec, prompt_length)
        if config is None or quant is None or seq_length is None:
            raise TopqError("perf needs config, quant and seq_length (or a bundle)")
        from topq.core.plugins import get_plugins

        family = find_family(get_plugins().families, config)
        spec = family.normalize(config)
        quant, group = _mode_from_config(config, quant)
        return predict(spec, chip_spec, quant, seq_length, max_input_length, lm_head_quant, group or group_size)

    return perf


def predict_bundle(bundle: Any, chip: ChipSpec, prompt_length: int | None = None) -> dict[str, Any]:
    """Prediction for a bundle's own program (its stages and decode variants) and a prompt length."""
    prog, mode, head, stages = _bundle_program(bundle, chip)
    prompt = max(1, int(prompt_length or stages.max_input_length))
    result = _summary(prog, chip, mode, head, CALIBRATION, prompt_length=prompt)
    variant = _variant_for(min(prompt, stages.seq_length), prog.variants)
    at_prompt = prog.decode(variant)
    result.update({
        "decode_variant": variant,
        "decode_tps": 1.0 / at_prompt["step_s"],
        "decode_step_s": at_prompt["step_s"],
        "bytes_per_token": at_prompt["bytes"],
    })
    return result


def bundle_estimates(bundle: Any, chip: ChipSpec, names: Iterable[str]) -> list[FunctionEstimate]:
    """Per-op estimates of some of a bundle's functions (for `topq inspect`)."""
    prog = _bundle_program(bundle, chip)[0]
    return [prog.estimate(name) for name in names]


def _bundle_program(bundle: Any, chip: ChipSpec) -> tuple[_Program, QuantMode, QuantMode, StageConfig]:
    spec = bundle.spec if isinstance(bundle.spec, ModelSpec) else ModelSpec.from_dict(bundle.spec)
    meta = bundle.meta
    st = meta["stages"]
    stages = StageConfig(int(st["seq_length"]), int(st["max_input_length"]), bool(st.get("prefill_kv", False)),
                         tuple(int(v) for v in st.get("decode_variants", ())))
    quant_opts = (bundle.recipe or {}).get("quant", {})
    group_size = int(quant_opts.get("group_size", 64))
    symmetric = bool(quant_opts.get("symmetric", False))
    scheme = str(meta.get("scheme", quant_opts.get("scheme", "bf16")))
    if scheme in _SCHEMES:
        mode = quant_mode(scheme, group_size, symmetric, quant_opts.get("bits"),
                          bool(quant_opts.get("dynamic_tokens", False)))
    else:  # a third-party scheme: what the compiled program stores tells the mode, not the name
        mode = _compiled_mode(scheme, bundle, group_size, symmetric)
    head = quant_mode(str(quant_opts.get("lm_head", "bf16")), group_size, symmetric)
    from topq.core.plugins import get_plugins

    family = get_plugins().families.get(meta.get("family") or spec.family)
    kernels = tuple((str(k["replace"]), str(k["with"])) for k in (bundle.recipe or {}).get("kernels") or ())
    return _program(spec, family, stages, chip, mode, head, CALIBRATION, kernels), mode, head, stages
