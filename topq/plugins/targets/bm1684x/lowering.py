"""Top → tpu lowering for one mode (f32, bf16, f16, w8bf16, w4bf16, w8f16, w4f16), as pattern tables.

Choices (those of BM1684X's compiler for LLMs):

* every activation, float weight (norms, biases, embeddings, RoPE tables) and the KV cache is stored in the mode's
  dtype; ops compute norms / softmax / SiLU in f32 and matmuls accumulate in f32, then round at the op boundary;
* linears the pipeline quantized (`job.quantized(name)`, which applies `quant.lm_head` too) become
  `tpu.A16MatMul` on packed weights, the others `tpu.MatMul` on dtype weights;
* `top.MLP` stays fused (`tpu.MLP` / `tpu.A16MLP`): the [L, intermediate] gate/up/act tensors never leave local
  memory, which is the point of the fused kernel and halves the emulator's DDR traffic for decode. A mixed MLP
  (some weights quantized, some not) is split into matmuls + activation + Mul;
* the lm_head matmul writes f32 logits (sampling wants them; rounding logits to bf16 flips near-ties);
* `top.A8MatMul` (int8 activations; its weight's values are the scheme's per-channel int8 `QuantizedWeight`)
  becomes `tpu.MatMulInt8(x, codes, w_scale[, bias])` on the i8 codes (`<w>.qweight`) and the scales in the
  mode's dtype (`<w>.wscale`); static with `out_scale > 0`, the requantizing `tpu.MatMulInt8(x, codes,
  multiplier, rshift[, bias_q])`: the per-channel i32 multipliers, the i8 right shifts and the i32 bias are
  bundle tensors computed here from act_scale, out_scale, the scales and the bias (`topq.ir.int8.requant_params`,
  `quantize_bias`), as TPU-MLIR's BM1684X MatMul LoweringINT8 does; the scales themselves are then not shipped;
* `top.MoE` becomes `tpu.MoE` with every expert (and shared-expert) linear float or all packed alike (one
  kernel configuration); its router and the shared expert's [1, H] gate stay float; the RMSNorm feeding it
  writes f32 so that routing sees the unrounded values;
* `top.Concat(history, new)` feeding `top.FAttention` disappears: the attention reads the history straight from
  the layer's KV-cache region and `tpu.KVStore` writes the new rows into it (no copy of the cache per call);
* a recurrent layer's carried states stay f32, and the op computing each one is marked with its layer and state
  index (`bind_states`): it reads and writes the layer's fixed state region in place (memory.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from topq.core.errors import TopqError
from topq.core.quant import QuantSpec
from topq.core.target import CompileJob
from topq.ir.builder import Builder
from topq.ir.graph import Block, Function, Module, Operation, Value
from topq.ir.int8 import quantize_bias, requant_params, uses_requant
from topq.ir.rewrite import Rewriter, apply_patterns
from topq.ir.types import TensorType, round_to_dtype
from topq.plugins.targets.bm1684x import (
    dialect,  # noqa: F401  (registers the tpu ops)
    raw,
)
from topq.plugins.targets.bm1684x.modes import FLOAT_DTYPES, Mode
from topq.plugins.targets.bm1684x.packing import check_spec, pack, packed_shapes

Pattern = Callable[[Operation, Rewriter], bool]

#: ops kept even when their results are unused
SIDE_EFFECTS = frozenset({"tpu.KVStore"})
#: Top ops whose tpu op has the same operands and attributes (plus `dtype` unless listed in NO_DTYPE)
SAME_SHAPE = ("Gather", "RMSNorm", "LayerNorm", "Add", "Mul", "MulConst", "SiLU", "Tanh", "GELU", "Softmax", "Rope",
              "Reshape", "Permute", "Slice", "Concat", "TopK",
              "Sigmoid", "Softplus", "Exp", "CausalConv1d", "GatedDeltaRule", "ChunkGatedDeltaRule")
#: ops that carry a recurrent layer's state: (Top op, operand index of the state it reads); the state stays f32
STATE_OPERANDS = {"top.CausalConv1d": 2, "top.GatedDeltaRule": 5, "top.ChunkGatedDeltaRule": 5}
#: their tpu ops, which update the layer's state regions in place (`bind_states`)
STATE_OPS = frozenset("tpu." + name.split(".", 1)[1] for name in STATE_OPERANDS)
NO_DTYPE = frozenset({"Reshape", "Permute", "Slice", "Concat"})
SUFFIX = {"weight": ".packed", "scale": ".scale", "zp": ".zp"}


@dataclass(frozen=True)
class TensorSource:
    """How codegen makes one bundle tensor: a float weight in `dtype`, or one part of a packed quantized weight."""

    source: str  # the checkpoint weight name
    #: "float", "weight", "scale", "zp" (packed A16), "int8", "int8_scale" (W8A8 codes, scales) or (W8A8
    #: requant) "multiplier", "rshift", "bias_q"
    part: str
    type: TensorType
    #: requant parts: (act_scale, out_scale) for multiplier / rshift (source: the int8 weight), (act_scale, int8
    #: weight name) for bias_q (source: the float bias)
    params: tuple[Any, ...] = ()


def weight_source(value: Value) -> str | None:
    """The checkpoint name of a weight operand (float weights keep their checkpoint name in the bundle)."""
    owner = value.owner
    if isinstance(owner, Operation) and owner.name in ("top.Weight", "tpu.Weight"):
        return str(owner.attrs["name"])
    return None


def history_of(value: Value) -> tuple[Value, Value] | None:
    """(history arg, new rows) when `value` is the stage template's Concat(history, new) along the sequence axis."""
    owner = value.owner
    if not isinstance(owner, Operation) or owner.name not in ("top.Concat", "tpu.Concat") or len(owner.operands) != 2:
        return None
    if owner.attrs.get("axis") not in (1, -3):
        return None
    history, new = owner.operands
    return (history, new) if isinstance(history.owner, Block) else None


class Lowering:
    """Lower a Top module in place to the tpu dialect of one mode; remembers which tensors codegen must emit."""

    def __init__(self, job: CompileJob, mode: Mode) -> None:
        self.job = job
        self.mode = mode
        self.dtype = mode.dtype
        self.sources: dict[str, TensorSource] = {}
        self._quant: dict[str, QuantSpec | None] = {}
        self._packed: dict[str, dict[str, np.ndarray]] = {}
        self._requant: dict[Any, tuple[np.ndarray, np.ndarray]] = {}  # W8A8 (multiplier, rshift) being produced
        self._int8: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # W8A8 (codes, scales) of the weight being produced

    # -- driver ----------------------------------------------------------------------------------------
    def run(self, module: Module) -> None:
        for function in module:
            states = state_args(function)
            for arg in function.args:  # activations cross function boundaries in the mode's dtype, states in f32
                if isinstance(arg.type, TensorType) and arg.type.dtype in FLOAT_DTYPES and id(arg) not in states:
                    arg.type = arg.type.with_dtype(self.dtype)
        apply_patterns(module, self.table())
        for function in module:
            for op in function.ops:  # top level: a tpu.DSLRegion's body is kernel IR, staged and inlined below
                if not op.name.startswith("tpu."):
                    raise TopqError(f"bm1684x has no lowering for {op.name} (in @{function.name})")
            eliminate_dead_ops(function)
            insert_kv_stores(function, int(module.attrs.get("topq.seq_length", 0)), self.dtype)
            bind_states(function)
            raw.lower_raw_regions(function)  # after dead-op elimination: staging ops have no results

    def table(self) -> dict[str, list[Pattern]]:
        table: dict[str, list[Pattern]] = {f"top.{name}": [self._same(name)] for name in SAME_SHAPE}
        table["top.Input"] = [lambda op, rw: (rw.replace(op, [op.operands[0]]), True)[1]]
        table["top.Weight"] = [self._weight]
        table["top.MatMul"] = [self._matmul]
        table["top.A8MatMul"] = [self._a8_matmul]
        table["top.MLP"] = [self._mlp]
        table["top.MoE"] = [self._moe]
        table["top.FAttention"] = [self._fattention]
        table["top.DSLRegion"] = [raw.lowering_pattern(self.dtype)]
        return table

    # -- weights ---------------------------------------------------------------------------------------
    def quantized(self, source: str | None) -> QuantSpec | None:
        """The layout of a weight the pipeline quantizes (values are computed only when codegen packs them)."""
        if source is None:
            return None
        if source not in self._quant:
            q = self.job.quant_spec(source)
            if q is not None:
                check_spec(q, source)
            self._quant[source] = q
        return self._quant[source]

    def float_weight(self, b: Builder, source: str, shape: tuple[int, ...]) -> Value:
        t = TensorType(tuple(shape), self.dtype)
        self._record(source, TensorSource(source, "float", t))
        return b.op("tpu.Weight", result_types=[t], name=source)

    def packed_weight(self, b: Builder, source: str, q: QuantSpec) -> list[Value]:
        n, k = q.shape
        shapes = packed_shapes(n, k, q.bits, q.group_size)
        dtypes = {"weight": "i8" if q.symmetric and q.bits == 8 else "ui8", "scale": self.dtype, "zp": "ui8"}
        values = []
        for part in ("weight", "scale") if q.symmetric else ("weight", "scale", "zp"):
            name = source + SUFFIX[part]
            t = TensorType(shapes[part], dtypes[part])
            self._record(name, TensorSource(source, part, t))
            values.append(b.op("tpu.Weight", result_types=[t], name=name))
        return values

    def _record(self, name: str, src: TensorSource) -> None:
        if self.sources.setdefault(name, src) != src:
            raise TopqError(f"tensor {name} is needed as both {self.sources[name].type} and {src.type}")

    def tensor_types(self, module: Module) -> dict[str, TensorType]:
        """The bundle tensors the lowered module references (after dead-op elimination), in first-use order."""
        out: dict[str, TensorType] = {}
        for function in module:
            for op in function.ops:
                if op.name == "tpu.Weight":
                    out.setdefault(op.attrs["name"], op.results[0].type)  # type: ignore[arg-type]
        return out

    def tensors(self, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
        """The arrays of the given tensors, packed or rounded to the mode's dtype, each produced once."""
        for name in names:
            src = self.sources[name]
            if src.part == "float":
                array = self.job.weight_in(src.source, self.dtype)
            elif src.part == "int8":
                array = self._int8_values(src.source)[0]
            elif src.part == "int8_scale":
                array = round_to_dtype(self._int8_values(src.source)[1], self.dtype).astype(src.type.np_dtype)
            elif src.part in ("multiplier", "rshift"):
                key = (src.source, src.params)
                if key not in self._requant:  # one linear's pair at a time (they are adjacent in the manifest)
                    act_scale, out_scale = src.params
                    self._requant = {key: requant_params(act_scale, self._int8_values(src.source)[1], out_scale)}
                array = self._requant[key][0 if src.part == "multiplier" else 1]
            elif src.part == "bias_q":
                act_scale, int8_weight = src.params
                array = quantize_bias(self.job.weights(src.source), act_scale, self._int8_values(int8_weight)[1])
            else:
                if src.source not in self._packed:
                    q = self.job.quantized(src.source)
                    if q is None or q.spec != self.quantized(src.source):
                        raise TopqError(f"{src.source}: quantized values do not match the layout planned for them")
                    self._packed = {src.source: pack(q, self.dtype, src.source)}  # one weight's parts at a time
                array = self._packed[src.source][src.part]
            if tuple(array.shape) != src.type.shape or array.dtype != src.type.np_dtype:
                raise TopqError(f"tensor {name}: produced {array.dtype}{list(array.shape)}, the program expects "
                                f"{src.type}")
            yield name, np.ascontiguousarray(array)

    def _int8_values(self, source: str) -> tuple[np.ndarray, np.ndarray]:
        """(i8 codes [N, K], f32 scales [N]) of a W8A8 linear's weight, from the scheme's values (one at a time)."""
        if source not in self._int8:
            q = self.job.quantized(source)
            if q is None or q.bits != 8 or not q.symmetric or q.group_size != q.codes.shape[1] or np.any(q.zeros):
                raise TopqError(f"{source}: top.A8MatMul needs the scheme's per-channel symmetric int8 values")
            codes = np.asarray(q.codes)
            if codes.size and (np.abs(codes).max() > 127 or not np.array_equal(codes, np.round(codes))):
                raise TopqError(f"{source}: int8 codes must be integers in [-127, 127]")
            self._int8 = {source: (codes.astype(np.int8), np.asarray(q.scales, np.float32)[:, 0])}
        return self._int8[source]

    # -- patterns --------------------------------------------------------------------------------------
    def _same(self, name: str) -> Pattern:
        def pattern(op: Operation, rw: Rewriter) -> bool:
            attrs = dict(op.attrs)
            if name not in NO_DTYPE:
                attrs["dtype"] = self.dtype
            new = rw.builder.create(f"tpu.{name}", op.operands, attrs, loc=op.loc)
            rw.replace(op, new.results)
            return True

        return pattern

    def _weight(self, op: Operation, rw: Rewriter) -> bool:
        value = self.float_weight(rw.builder, op.attrs["name"], op.results[0].type.shape)  # type: ignore[union-attr]
        rw.replace(op, [value])
        return True

    def _linear(self, b: Builder, x: Value, w: Value, bias: list[Value], loc: str | None,
                out_dtype: str | None = None) -> Value:
        """x @ wᵀ (+ bias) for a weight [N, K]: A16MatMul when the pipeline quantized it, MatMul otherwise."""
        source = weight_source(w)
        q = self.quantized(source)
        if q is None:
            return b.op("tpu.MatMul", x, w, *bias, right_transpose=True, dtype=self.dtype, out_dtype=out_dtype,
                        loc=loc)
        assert source is not None
        parts = self.packed_weight(b, source, q)
        return b.op("tpu.A16MatMul", x, *parts, *bias, dtype=self.dtype, out_dtype=out_dtype,
                    weight_bits=q.bits, group_size=q.group_size, symmetric=q.symmetric, has_bias=bool(bias), loc=loc)

    def _matmul(self, op: Operation, rw: Rewriter) -> bool:
        x, w, *bias = op.operands
        out_dtype = "f32" if (op.loc or "").endswith("lm_head") and self.dtype != "f32" else None
        if not op.attrs.get("right_transpose") or len(w.shape) != 2 or weight_source(w) is None:
            new = rw.builder.create("tpu.MatMul", op.operands, {**op.attrs, "dtype": self.dtype,
                                                                 "out_dtype": out_dtype}, loc=op.loc)
            rw.replace(op, new.results)
            return True
        rw.replace(op, [self._linear(rw.builder, x, w, bias, op.loc, out_dtype)])
        return True

    def _a8_matmul(self, op: Operation, rw: Rewriter) -> bool:
        x, w, *bias = op.operands
        source = weight_source(w)
        q = self.quantized(source)
        if source is None or q is None or q.bits != 8 or not q.symmetric or q.group_size != q.shape[1]:
            raise TopqError(f"{op.loc or 'top.A8MatMul'}: its weight must be quantized per channel to symmetric "
                            f"int8 by the scheme (got {q})")
        n, k = q.shape
        b, attrs = rw.builder, {**op.attrs, "dtype": self.dtype}
        codes = TensorSource(source, "int8", TensorType((n, k), "i8"))
        operands = [x, self._int8_weight(b, f"{source}.qweight", codes)]
        act_scale, out_scale = float(op.attrs.get("act_scale", 0.0)), float(op.attrs.get("out_scale", 0.0))
        if not uses_requant(bool(op.attrs.get("dynamic", False)), out_scale):
            scale = TensorSource(source, "int8_scale", TensorType((n,), self.dtype))
            operands += [self._int8_weight(b, f"{source}.wscale", scale), *bias]
            rw.replace(op, [b.op("tpu.MatMulInt8", *operands, **attrs, loc=op.loc)])
            return True
        # Static requantization: multipliers, shifts and the int32 bias are computed now, from the scales.
        bias_name = weight_source(bias[0]) if bias else None
        if bias and bias_name is None:
            raise TopqError(f"{op.loc or 'top.A8MatMul'}: static int8 requantization needs its bias as a weight "
                            f"(the int32 bias is computed at compile time)")
        parts = [(f"{source}.multiplier", TensorSource(source, "multiplier", TensorType((n,), "i32"),
                                                       (act_scale, out_scale))),
                 (f"{source}.rshift", TensorSource(source, "rshift", TensorType((n,), "i8"), (act_scale, out_scale)))]
        if bias_name is not None:
            parts.append((f"{source}.bias_q", TensorSource(bias_name, "bias_q", TensorType((n,), "i32"),
                                                           (act_scale, source))))
        operands += [self._int8_weight(b, name, src) for name, src in parts]
        rw.replace(op, [b.op("tpu.MatMulInt8", *operands, **attrs, loc=op.loc)])
        return True

    def _int8_weight(self, b: Builder, name: str, src: TensorSource) -> Value:
        self._record(name, src)
        return b.op("tpu.Weight", result_types=[src.type], name=name)

    def _mlp(self, op: Operation, rw: Rewriter) -> bool:
        x, *weights = op.operands
        b, act = rw.builder, op.attrs.get("act", "silu")
        quants = [self.quantized(weight_source(w)) for w in weights]
        if all(q is None for q in quants):
            rw.replace(op, [b.op("tpu.MLP", x, *weights, act=act, dtype=self.dtype, loc=op.loc)])
            return True
        keys = {(q.bits, q.group_size, q.symmetric) if q is not None else None for q in quants}
        if len(keys) == 1:
            q = quants[0]
            assert q is not None
            parts = [v for w, qw in zip(weights, quants) for v in self.packed_weight(b, weight_source(w), qw)]  # type: ignore[arg-type]
            rw.replace(op, [b.op("tpu.A16MLP", x, *parts, act=act, dtype=self.dtype, weight_bits=q.bits,
                                 group_size=q.group_size, symmetric=q.symmetric, loc=op.loc)])
            return True
        # Mixed storage: no fused kernel takes it, so it runs as its parts.
        gate = self._linear(b, x, weights[0], [], f"{op.loc}.gate")
        up = self._linear(b, x, weights[1], [], f"{op.loc}.up")
        if act == "silu":
            a = b.op("tpu.SiLU", gate, dtype=self.dtype)
        else:
            a = b.op("tpu.GELU", gate, approximate="tanh" if act == "gelu_tanh" else "none", dtype=self.dtype)
        h = b.op("tpu.Mul", a, up, dtype=self.dtype)
        rw.replace(op, [self._linear(b, h, weights[2], [], f"{op.loc}.down")])
        return True

    def _moe(self, op: Operation, rw: Rewriter) -> bool:
        x, router, *weights = op.operands
        b = rw.builder
        experts = int(op.attrs["num_experts"])
        shared = len(weights) == 3 * experts + 4
        linears, gate = (weights[:-1], weights[-1:]) if shared else (weights, [])
        quants = [self.quantized(weight_source(w)) for w in linears]
        keys = {(q.bits, q.group_size, q.symmetric) if q is not None else None for q in quants}
        if len(keys) != 1:
            raise TopqError(f"bm1684x: {op.loc or 'top.MoE'} has experts stored differently ({sorted(map(str, keys))}"
                            "); every expert linear must be float or quantized alike")
        q = quants[0]
        attrs: dict[str, Any] = {key: op.attrs[key] for key in ("num_experts", "top_k", "scoring", "norm_topk_prob",
                                                                "act") if key in op.attrs}
        attrs.update(shared=shared, dtype=self.dtype)
        if q is None:
            parts = list(linears)
        else:
            parts = [v for w, qw in zip(linears, quants) for v in self.packed_weight(b, weight_source(w), qw)]  # type: ignore[arg-type]
            attrs.update(weight_bits=q.bits, group_size=q.group_size, symmetric=q.symmetric)
        norm = x.owner
        if isinstance(norm, Operation) and norm.name == "tpu.RMSNorm" and self.dtype != "f32":
            # route on the norm's f32 result: a token's expert choice must not hinge on rounding x to dtype
            norm.attrs["out_dtype"] = "f32"
            x.type = x.type.with_dtype("f32")  # type: ignore[union-attr]
        rw.replace(op, [b.op("tpu.MoE", x, router, *parts, *gate, **attrs, loc=op.loc)])
        return True

    def _fattention(self, op: Operation, rw: Rewriter) -> bool:
        q, k, v, *mask = op.operands
        attrs: dict[str, Any] = {key: op.attrs[key] for key in ("q_head", "kv_head", "scale", "softcap", "window")
                                 if key in op.attrs}
        attrs.update(causal=op.attrs.get("causal", True), has_mask=bool(mask), dtype=self.dtype)
        hk, hv = history_of(k), history_of(v)
        operands = [q, k, v, *mask]
        if hk is not None and hv is not None:
            operands = [q, hk[1], hv[1], *mask, hk[0], hv[0]]
            attrs["history"] = hk[0].shape[1]
        new = rw.builder.create("tpu.FAttention", operands, attrs, loc=op.loc)
        rw.replace(op, new.results)
        return True


def state_operand(op: Operation) -> Value | None:
    """The carried state a recurrent op (Top or tpu) reads; None for other ops and a conv without a state."""
    index = STATE_OPERANDS.get("top." + op.name.split(".", 1)[-1])
    if index is None or len(op.operands) <= index:
        return None
    if op.name.endswith("CausalConv1d") and not op.attrs.get("with_state", True):
        return None  # (x, weight, valid): operand 2 is the valid mask
    return op.operands[index]


def state_args(function: Function) -> set[int]:
    """ids of the function's arguments that are a recurrent layer's carried states (read as a state operand)."""
    args = {id(a) for a in function.args}
    return {id(v) for op in function.walk() for v in [state_operand(op)] if v is not None and id(v) in args}


def bind_states(function: Function) -> None:
    """Give a recurrent layer's carried states their fixed DDR regions: the op whose new state is the block's
    result k + 1 gets `layer` and `state = k`; it reads its state operand from region k and writes the new state
    over it. In place is safe only when that op is the old state's one reader (as in the stage template's blocks);
    a state read by other ops too stays a plain argument and result, planned in the activation region."""
    layer = function.attrs.get("layer")
    if layer is None:
        return
    result_index = {id(v): i for i, v in enumerate(function.results)}
    readers: dict[int, list[Operation]] = {}
    for op in function.ops:
        for v in op.operands:
            readers.setdefault(id(v), []).append(op)
    for op in function.ops:
        index = result_index.get(id(op.results[1])) if op.name in STATE_OPS else None
        if not index:  # not a recurrent op, or its new state is not carried (result 0 is the hidden state)
            continue
        old = state_operand(op)
        if old is not None and isinstance(old.owner, Block) and readers.get(id(old)) != [op]:
            continue
        op.attrs.update(layer=int(layer), state=index - 1)


def eliminate_dead_ops(function: Function) -> None:
    used = {id(v) for v in function.results}
    kept: list[Operation] = []
    for op in reversed(function.ops):
        if op.name in SIDE_EFFECTS or any(id(r) in used for r in op.results):
            kept.append(op)
            used.update(id(v) for v in op.operands)
    function.body.ops = kept[::-1]


def insert_kv_stores(function: Function, rows: int, dtype: str) -> None:
    """Write a block's k and v outputs into the layer's KV-cache region, just before the attention: the attention
    reads the new rows from their own buffers, so the stores can wait until the projection group is done."""
    if ("layer" not in function.attrs or len(function.results) != 3 or len(function.args) < 2
            or not any(op.name == "tpu.FAttention" for op in function.ops)):  # a recurrent layer has no KV
        return
    layer, positions = int(function.attrs["layer"]), function.args[1]
    ops = function.body.ops
    index = next((i for i, op in enumerate(ops) if op.name == "tpu.FAttention"), len(ops))
    stores = [Operation("tpu.KVStore", [value, positions], [],
                        {"layer": layer, "kind": kind, "rows": rows, "dtype": dtype},
                        loc=f"layers.{layer}.kv_store_{kind}")
              for kind, value in (("k", function.results[1]), ("v", function.results[2]))]
    ops[index:index] = stores
