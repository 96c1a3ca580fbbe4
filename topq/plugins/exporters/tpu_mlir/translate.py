"""Translate one topq Top IR function into the Top MLIR module TPU-MLIR's `model_deploy.py` compiles.

topq's Top IR uses TPU-MLIR's op names, but TPU-MLIR's pipeline needs its own conventions; each rule below was
found necessary by removing it alone (see issue 15, "Feasibility"):

* a named module with `module.chip`, `module.state = "TOP_F32"`, `module.weight_file` (an npz whose keys are
  the weights' locs); the function `@main`; one `top.Input` per argument (integer arguments are `si32`, the
  Input's result is f32 as in TPU-MLIR's own importer);
* every op has a unique name loc; weights are named by their loc (no `name` attribute);
* absent operands are a `none` value (MatMul bias, FAttention's mask and buffer);
* Gather / Concat / Softmax `axis` are si32; FAttention carries `batch`, `dim`, `mq`, `mk`;
* `top.MLP` is split into MatMul / SiLU (or GELU) / Mul / MatMul;
* compiles but computes wrong numbers otherwise: Rope's operand order is (x, sin, cos), the RoPE tables are
  [S, 1, D], the attribute is `rope_mode`, and a causal prefill attention takes an explicit [1, 1, L, K] mask.

Linear weights are stored as TPU-MLIR's own converter stores them: [K, N] without `right_transpose`; norm
weights and biases as [1, ..., 1, N] of the activation's rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from topq.core.quant import QuantizedWeight
from topq.ir.errors import TopqError
from topq.ir.graph import Function, Operation, Value
from topq.ir.printer import format_float, format_string

#: TPU-MLIR accepts these Top IR ops (after the rewrites below); anything else is refused by name.
SUPPORTED_OPS: frozenset[str] = frozenset({
    "top.Weight", "top.Gather", "top.RMSNorm", "top.LayerNorm", "top.MatMul", "top.Add", "top.Mul", "top.MulConst",
    "top.Reshape", "top.Permute", "top.Concat", "top.Slice", "top.Rope", "top.FAttention", "top.MLP", "top.SiLU",
    "top.GELU", "top.Softmax", "top.TopK",
})

#: the names LLM-TPU's runtime and TPU-MLIR's converter give a block's inputs and outputs, by topq stage
STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "prefill": ("input_states", "position_ids", "attention_mask"),
    "prefill_kv": ("input_states", "position_ids", "attention_mask", "history_k", "history_v"),
    "decode": ("input_states", "position_ids", "attention_mask", "history_k", "history_v"),
}
STAGE_OUTPUTS: tuple[str, ...] = ("output_states", "k_cache", "v_cache")
FUNCTION_INPUTS: dict[str, tuple[str, ...]] = {
    "embedding": ("input_ids",), "embedding_cache": ("input_ids",), "lm_head": ("hidden_states",),
}
FUNCTION_OUTPUTS: dict[str, tuple[str, ...]] = {
    "embedding": ("input_states",), "embedding_cache": ("input_states",), "lm_head": ("m_logits",),
}

WeightGetter = Callable[[str], np.ndarray]
#: weight name → topq's quantized values for it (None: export it in float32 for TPU-MLIR to quantize)
QuantizedGetter = Callable[[str], QuantizedWeight | None]


@dataclass(frozen=True)
class NetInput:
    """One input of an exported net, in the order the bmodel takes them."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "f32" or "si32"


@dataclass
class Net:
    """One exported function: the module text, its weights (npz keys = weight locs) and its signature."""

    name: str
    mlir: str
    weights: dict[str, np.ndarray]
    inputs: list[NetInput]
    outputs: list[str]
    stage: str | None = None

    @property
    def weight_file(self) -> str:
        return f"{self.name}_top_weights.npz"


def refuse_unmapped(function: Function) -> None:
    """A TopqError naming the first op TPU-MLIR has no mapping for (raw kernels, W8A8 int8 matmuls, ...)."""
    for op in function.walk():
        if op.name not in SUPPORTED_OPS:
            raise TopqError(f"function {function.name}: op {op.name} has no TPU-MLIR mapping; "
                            f"export supports {', '.join(sorted(SUPPORTED_OPS))}")
        for attr in ("softcap", "window"):  # options top.FAttention has and TPU-MLIR's attention has not
            if op.name == "top.FAttention" and op.attrs.get(attr):
                raise TopqError(f"function {function.name}: top.FAttention {attr}={op.attrs[attr]} has no TPU-MLIR "
                                "mapping")


def _f32(shape: Sequence[int]) -> str:
    return "tensor<" + "".join(f"{d}x" for d in shape) + "f32>"


def _ints(values: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(v)) for v in values) + "]"


def _attrs(items: dict[str, str]) -> str:
    return " {" + ", ".join(f"{k} = {v}" for k, v in sorted(items.items())) + "}" if items else ""


def _bool(flag: bool) -> str:
    return "true" if flag else "false"


def _loc(*names: str) -> str:
    return "loc(fused[" + ", ".join(format_string(n) for n in names) + "])"


@dataclass
class _Emitter:
    """Accumulates the body of @main: SSA names, unique locs and the weight dictionary."""

    function: str
    get_weight: WeightGetter
    quantized: QuantizedGetter | None = None
    lines: list[str] = field(default_factory=list)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # id(topq Value) → SSA name
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # SSA name → exported shape
    used_locs: set[str] = field(default_factory=set)
    weight_ops: dict[tuple[str, str], str] = field(default_factory=dict)  # (weight name, layout) → SSA name
    quantized_cache: dict[str, QuantizedWeight | None] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # SSA name → type text, for weights that are not f32
    counter: int = 1  # %0 is the none value
    prequantized: bool = False  # an A16MatMul was written (the module's platform says so, as TPU-MLIR's does)

    def fresh(self) -> str:
        name = f"%{self.counter}"
        self.counter += 1
        return name

    def unique_loc(self, wanted: str) -> str:
        loc, n = wanted, 1
        while loc in self.used_locs:
            loc = f"{wanted}_{n}"
            n += 1
        self.used_locs.add(loc)
        return loc

    def emit(self, op: str, operands: Sequence[str], result_shapes: Sequence[tuple[int, ...]],
             attrs: dict[str, str], locs: Sequence[str]) -> list[str]:
        base = self.fresh()
        if len(result_shapes) == 1:
            head, results = base, [base]
        else:
            head, results = f"{base}:{len(result_shapes)}", [f"{base}#{i}" for i in range(len(result_shapes))]
        operand_types = ", ".join(self.type_of(v) for v in operands)
        out_types = ", ".join(_f32(s) for s in result_shapes)
        if len(result_shapes) > 1:
            out_types = f"({out_types})"
        unique = [self.unique_loc(loc) for loc in locs]
        self.lines.append(f'    {head} = "{op}"({", ".join(operands)}){_attrs(attrs)} : ({operand_types}) -> '
                          f"{out_types} {_loc(*unique)}")
        for name, shape in zip(results, result_shapes):
            self.shapes[name] = tuple(shape)
        return results

    def type_of(self, ssa: str) -> str:
        if ssa == "%0":
            return "none"
        return self.types.get(ssa) or _f32(self.shapes[ssa])

    def stored(self, loc: str, array: np.ndarray) -> str:
        """A weight op for an array stored as is (uint8 codes, float32 scales) under key `loc`."""
        if loc in self.weights:
            raise TopqError(f"function {self.function}: two weights are named {loc!r}")
        ssa = self.fresh()
        element = {np.dtype(np.uint8): "ui8", np.dtype(np.float32): "f32"}[array.dtype]
        text = "tensor<" + "".join(f"{d}x" for d in array.shape) + f"{element}>"
        self.lines.append(f'    {ssa} = "top.Weight"() : () -> {text} {_loc(self.unique_loc(loc))}')
        self.shapes[ssa] = tuple(array.shape)
        self.types[ssa] = text
        self.weights[loc] = np.ascontiguousarray(array)
        return ssa

    def values(self, wname: str) -> QuantizedWeight | None:
        """topq's quantized values of a linear weight (computed once per function), None for a float one."""
        if self.quantized is None:
            return None
        if wname not in self.quantized_cache:
            self.quantized_cache[wname] = self.quantized(wname)
        return self.quantized_cache[wname]

    def quantized_linear(self, wname: str, x: str, bias: str, out_shape: tuple[int, ...], loc: str) -> str | None:
        """`top.A16MatMul` with topq's own codes for weight `wname` [N, K], or None when it is not quantized."""
        q = self.values(wname)
        if q is None:
            return None
        qweight, scales, zeros = a16_operands(q, wname)
        base = wname.removesuffix(".weight")
        operands = [x, self.stored(f"{base}.qweight", qweight), self.stored(f"{base}.scales", scales),
                    self.stored(f"{base}.qzeros", zeros), bias]
        attrs = {"right_transpose": "true", "q_group_size": f"{q.group_size} : i64", "weight_bits": f"{q.bits} : i64"}
        self.prequantized = True
        return self.emit("top.A16MatMul", operands, [out_shape], attrs, [loc])[0]

    def weight(self, name: str, layout: str, array: np.ndarray) -> str:
        """The SSA value of weight `name` stored in `layout` ("" = as topq has it); one op per layout."""
        key = (name, layout)
        if key in self.weight_ops:
            return self.weight_ops[key]
        loc = name if not any(n == name for n, _ in self.weight_ops) else f"{name}.{layout or 'raw'}"
        loc = self.unique_loc(loc)
        ssa = self.fresh()
        data = np.ascontiguousarray(array, dtype=np.float32)
        self.lines.append(f'    {ssa} = "top.Weight"() : () -> {_f32(data.shape)} {_loc(loc)}')
        self.shapes[ssa] = tuple(data.shape)
        self.weights[loc] = data
        self.weight_ops[key] = ssa
        return ssa


def a16_operands(q: QuantizedWeight, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TPU-MLIR's A16MatMul operands for topq's values: uint8 codes [N, K] (4-bit: two per byte along K, the
    even column in the low nibble), float32 scales and uint8 zero points [N, K / group_size]."""
    if q.bits not in (4, 8):
        raise TopqError(f"{name}: {q.bits}-bit weights have no TPU-MLIR A16MatMul form (4 or 8 bits)")
    n, k = q.codes.shape
    if q.g_idx is not None and not np.array_equal(q.g_idx, np.arange(k) // q.group_size):
        raise TopqError(f"{name}: act-order weights (a column permutation) have no TPU-MLIR A16MatMul form")
    codes = np.asarray(q.codes).astype(np.int32)
    zeros = np.asarray(q.zeros).astype(np.int32)
    if codes.min() < 0:  # topq's signed symmetric form: the same values with the offset TPU-MLIR stores
        codes, zeros = codes + (1 << (q.bits - 1)), zeros + (1 << (q.bits - 1))
    if codes.min() < 0 or codes.max() >= 1 << q.bits or zeros.min() < 0 or zeros.max() >= 1 << q.bits:
        raise TopqError(f"{name}: codes or zero points outside [0, {1 << q.bits})")
    packed = codes.astype(np.uint8)
    if q.bits == 4:
        packed = (packed[:, 0::2] | (packed[:, 1::2] << 4)).astype(np.uint8)
    return packed, np.asarray(q.scales, dtype=np.float32).reshape(n, -1), zeros.astype(np.uint8).reshape(n, -1)


def _producer(value: Value) -> Operation | None:
    return value.owner if isinstance(value.owner, Operation) else None


def _weight_name(value: Value) -> str | None:
    op = _producer(value)
    return str(op.attrs["name"]) if op is not None and op.name == "top.Weight" else None


def _users(function: Function) -> dict[int, list[Operation]]:
    users: dict[int, list[Operation]] = {}
    for op in function.walk():
        for value in op.operands:
            users.setdefault(id(value), []).append(op)
    return users


def _prefill_mask_shape(function: Function) -> tuple[int, ...] | None:
    """[1, 1, L, K] when a causal attention over L > 1 queries needs TPU-MLIR's explicit mask, else None."""
    for op in function.walk():
        if op.name == "top.FAttention" and op.attrs.get("causal", True):
            q, k = op.operands[0].shape, op.operands[1].shape
            if q[1] > 1:
                return (1, 1, q[1], k[1])
    return None


def translate_function(function: Function, get_weight: WeightGetter, net_name: str | None = None,
                       quantized: QuantizedGetter | None = None, module_name: str | None = None) -> Net:
    """The TPU-MLIR Top module of `function` (weights read with `get_weight`) for net directory `net_name`.

    `module_name` (default `net_name`) names the bmodel net: decode chunks share their block_cache's name, so
    `model_tool --combine` makes them stages of one net, as LLM-TPU's runtime expects.

    With `quantized`, every linear it gives values for becomes `top.A16MatMul` with those codes (the
    pre-quantized route); the others stay float32 MatMuls for TPU-MLIR to quantize."""
    refuse_unmapped(function)
    name = net_name or function.name
    stage = function.attrs.get("stage")
    stage = stage if isinstance(stage, str) else None
    em = _Emitter(name, get_weight, quantized)
    users = _users(function)
    mask_shape = _prefill_mask_shape(function)
    block = function.body
    args = list(block.args)

    # The signature: topq's arguments, with the prefill mask put where LLM-TPU expects it (third).
    arg_names = list(STAGE_INPUTS.get(stage or "", FUNCTION_INPUTS.get(function.name, ())))
    old_mask_arg = _small_mask_arg(function) if mask_shape is not None else None
    inputs: list[tuple[str, tuple[int, ...], str, Value | None]] = []  # name, shape, dtype, topq arg
    for i, arg in enumerate(args):
        label = arg_names[i] if i < len(arg_names) else f"arg{i}"
        shape = mask_shape if arg is old_mask_arg and mask_shape is not None else arg.shape
        inputs.append((label, tuple(shape), "si32" if arg.dtype.startswith(("i", "si", "ui")) else "f32", arg))
    if mask_shape is not None and old_mask_arg is None:
        inputs.insert(min(2, len(inputs)), ("attention_mask", mask_shape, "f32", None))
    mask_ssa: str | None = None
    for index, (label, shape, dtype, input_arg) in enumerate(inputs):
        ssa = em.fresh()
        arg_type = "tensor<" + "".join(f"{d}x" for d in shape) + f"{dtype}>"
        loc = _loc(em.unique_loc(label))
        em.lines.append(f'    {ssa} = "top.Input"(%arg{index}) : ({arg_type}) -> {_f32(shape)} {loc}')
        em.shapes[ssa] = shape
        if input_arg is not None:
            em.names[id(input_arg)] = ssa
        if label == "attention_mask" or input_arg is old_mask_arg:
            mask_ssa = ssa if mask_shape is not None else None

    result_names = _result_names(function, stage)
    rope_tables = _rope_table_gathers(function, users)
    for op in block.ops:
        _translate_op(em, op, rope_tables, mask_ssa, result_names)

    returns = [em.names[id(v)] for v in function.results]
    signature = ", ".join(
        f"%arg{i}: tensor<{''.join(f'{d}x' for d in shape)}{dtype}> loc(unknown)"
        for i, (_, shape, dtype, _) in enumerate(inputs))
    out_types = [em.type_of(r) for r in returns]
    out_text = out_types[0] if len(out_types) == 1 else "(" + ", ".join(out_types) + ")"
    platform = "LLM_QUANTIZED" if em.prequantized else "LLM"
    header = (f"module @{format_string(module_name or name)} attributes "
              f"{{module.chip = \"ALL\", module.platform = \"{platform}\", "
              f"module.state = \"TOP_F32\", module.top_run_mode = \"STATIC\", "
              f"module.weight_file = {format_string(f'{name}_top_weights.npz')}}} {{")
    text = "\n".join([
        header,
        f"  func.func @main({signature}) -> {out_text} {{",
        '    %0 = "top.None"() : () -> none loc(unknown)',
        *em.lines,
        f"    return {', '.join(returns)} : {', '.join(out_types)} loc(unknown)",
        "  } loc(unknown)",
        "} loc(unknown)",
        "",
    ])
    return Net(name=name, mlir=text, weights=em.weights,
               inputs=[NetInput(label, shape, dtype) for label, shape, dtype, _ in inputs],
               outputs=[result_names.get(id(v), "") for v in function.results], stage=stage)


def _small_mask_arg(function: Function) -> Value | None:
    """The [1,1,1,K] key-mask argument a causal multi-query attention reads (topq's block_kv), if any."""
    args = {id(a): a for a in function.body.args}
    for op in function.walk():
        if op.name == "top.FAttention" and len(op.operands) > 3 and id(op.operands[3]) in args:
            return args[id(op.operands[3])]
    return None


def _result_names(function: Function, stage: str | None) -> dict[int, str]:
    wanted = STAGE_OUTPUTS if stage else FUNCTION_OUTPUTS.get(function.name, ())
    names: dict[int, str] = {}
    for i, value in enumerate(function.results):
        if id(value) not in names:
            names[id(value)] = wanted[i] if i < len(wanted) else f"output_{i}"
    return names


def _rope_table_gathers(function: Function, users: dict[int, list[Operation]]) -> set[int]:
    """ids of the Gather ops that fetch RoPE cos/sin rows (every user a Rope reading it as a table)."""
    found: set[int] = set()
    for op in function.walk():
        if op.name != "top.Gather" or _weight_name(op.operands[0]) is None:
            continue
        readers = users.get(id(op.results[0]), [])
        if readers and all(r.name == "top.Rope" and r.operands[0] is not op.results[0] for r in readers):
            found.add(id(op))
    return found


def _op_loc(em: _Emitter, op: Operation, suffix: str) -> str:
    return op.loc or f"{em.function}.{op.name.removeprefix('top.').lower()}{suffix}"


def _translate_op(em: _Emitter, op: Operation, rope_tables: set[int], mask_ssa: str | None,
                  result_names: dict[int, str]) -> None:
    if op.name == "top.Weight":
        return  # emitted where used, in the layout its user needs
    loc = result_names.get(id(op.results[0])) or _op_loc(em, op, "")

    def operand(i: int) -> str:
        return em.names[id(op.operands[i])]

    def bind(results: Sequence[str]) -> None:
        for value, ssa in zip(op.results, results):
            em.names[id(value)] = ssa

    def plain(i: int) -> str:
        """Operand i: an activation, or a weight kept as topq stores it."""
        wname = _weight_name(op.operands[i])
        if wname is None:
            return operand(i)
        return em.weight(wname, "", em.get_weight(wname))

    def row_weight(i: int, rank: int) -> str:
        """A per-channel weight [N] (norm gamma/beta, bias) as TPU-MLIR's [1, ..., 1, N]."""
        wname = _weight_name(op.operands[i])
        if wname is None:
            return operand(i)
        array = np.asarray(em.get_weight(wname), dtype=np.float32)
        return em.weight(wname, f"rank{rank}", array.reshape((1,) * (rank - 1) + (array.shape[-1],)))

    def linear_weight(i: int, transposed: bool) -> str:
        """A matmul's right operand as [K, N]; topq's [N, K] + right_transpose is transposed once here."""
        wname = _weight_name(op.operands[i])
        if wname is None:
            if transposed:
                raise TopqError(f"function {em.function}: {op.name} {op.loc or ''} transposes an activation; "
                                "TPU-MLIR export supports right_transpose on weights only")
            return operand(i)
        if not transposed:
            return em.weight(wname, "", em.get_weight(wname))
        return em.weight(wname, "kn", np.asarray(em.get_weight(wname), dtype=np.float32).T)

    out_shapes = [tuple(v.shape) for v in op.results]
    name = op.name
    if name == "top.Gather":
        table = _weight_name(op.operands[0])
        if id(op) in rope_tables and table is not None:
            array = np.asarray(em.get_weight(table), dtype=np.float32)
            table_ssa = em.weight(table, "s1d", array.reshape(array.shape[0], 1, array.shape[1]))
            shape = out_shapes[0][:-1] + (1, out_shapes[0][-1])
            bind(em.emit(name, [table_ssa, operand(1)], [shape], {"axis": f"{op.attrs.get('axis', 0)} : si32"},
                         [loc]))
        else:
            bind(em.emit(name, [plain(0), operand(1)], out_shapes, {"axis": f"{op.attrs.get('axis', 0)} : si32"},
                         [loc]))
    elif name == "top.RMSNorm":
        rank = len(op.operands[0].shape)
        gamma = row_weight(1, rank) if len(op.operands) > 1 else "%0"
        bind(em.emit(name, [operand(0), gamma], out_shapes, {"eps": f"{format_float(float(op.attrs['eps']))} : f64"},
                     [loc]))
    elif name == "top.LayerNorm":
        rank = len(op.operands[0].shape)
        weight = row_weight(1, rank) if len(op.operands) > 1 else "%0"
        bias = row_weight(2, rank) if len(op.operands) > 2 else "%0"
        attrs = {"eps": f"{format_float(float(op.attrs['eps']))} : f64", "axis": f"{rank - 1} : si32",
                 "normalized_shape": _ints([op.operands[0].shape[-1]])}
        bind(em.emit(name, [operand(0), weight, bias], out_shapes, attrs, [loc]))
    elif name == "top.MatMul":
        rank = len(out_shapes[0])
        wname = _weight_name(op.operands[1])
        if wname is not None and op.attrs.get("right_transpose", False) and em.values(wname) is not None:
            bias = row_weight(2, rank) if len(op.operands) > 2 else "%0"
            bind([em.quantized_linear(wname, operand(0), bias, out_shapes[0], loc) or ""])
        else:
            right = linear_weight(1, bool(op.attrs.get("right_transpose", False)))
            bias = row_weight(2, rank) if len(op.operands) > 2 else "%0"
            bind(em.emit(name, [operand(0), right, bias], out_shapes, {}, [loc]))
    elif name in ("top.Add", "top.Mul"):
        bind(em.emit(name, [plain(i) for i in range(len(op.operands))], out_shapes, {}, [loc]))
    elif name == "top.MulConst":
        bind(em.emit(name, [operand(0)], out_shapes,
                     {"const_val": f"{format_float(float(op.attrs['const_val']))} : f64"}, [loc]))
    elif name == "top.Reshape":
        bind(em.emit(name, [operand(0)], out_shapes, {"shape": _ints(out_shapes[0])}, [loc]))
    elif name == "top.Permute":
        bind(em.emit(name, [operand(0)], out_shapes, {"order": _ints(op.attrs["order"])}, [loc]))
    elif name == "top.Concat":
        bind(em.emit(name, [plain(i) for i in range(len(op.operands))], out_shapes,
                     {"axis": f"{op.attrs['axis']} : si32"}, [loc]))
    elif name == "top.Slice":
        attrs = {"offset": _ints(op.attrs["offset"]), "ends": _ints(op.attrs["ends"]),
                 "steps": _ints(op.attrs["steps"]), "axes": "[]"}
        bind(em.emit(name, [operand(0), "%0", "%0", "%0"], out_shapes, attrs, [loc]))
    elif name == "top.Rope":
        # topq: Rope(x, cos, sin); TPU-MLIR: Rope(x, sin, cos) with `rope_mode`.
        bind(em.emit(name, [operand(0), operand(2), operand(1)], out_shapes,
                     {"rope_mode": format_string(str(op.attrs.get("mode", "contiguous_halves")))}, [loc]))
    elif name == "top.FAttention":
        q, k = op.operands[0].shape, op.operands[1].shape
        mask = operand(3) if len(op.operands) > 3 else "%0"
        if q[1] > 1 and op.attrs.get("causal", True):
            if mask_ssa is None:
                raise TopqError(f"function {em.function}: causal attention without a mask input")
            mask = mask_ssa
        attrs = {"scale": f"{format_float(float(op.attrs['scale']))} : f64", "batch": f"{q[0]} : i64",
                 "q_head": f"{op.attrs['q_head']} : i64", "kv_head": f"{op.attrs['kv_head']} : i64",
                 "dim": f"{q[-1]} : i64", "mq": f"{q[1]} : i64", "mk": f"{k[1]} : i64", "keep_dims": "false"}
        bind(em.emit(name, [operand(0), operand(1), operand(2), mask, "%0"], out_shapes, attrs, [loc]))
    elif name == "top.MLP":
        bind(_split_mlp(em, op, operand(0), loc))
    elif name == "top.SiLU":
        bind(em.emit(name, [operand(0)], out_shapes, {}, [loc]))
    elif name == "top.GELU":
        mode = "tanh" if op.attrs.get("approximate") == "tanh" else "normal"
        bind(em.emit(name, [operand(0)], out_shapes, {"approx_mode": format_string(mode)}, [loc]))
    elif name == "top.Softmax":
        bind(em.emit(name, [operand(0)], out_shapes, {"axis": f"{op.attrs.get('axis', -1)} : si32"}, [loc]))
    elif name == "top.TopK":
        rank = len(op.operands[0].shape)
        axis = int(op.attrs.get("axis", -1)) % rank
        largest = _bool(bool(op.attrs.get("largest", True)))
        attrs = {"K": f"{op.attrs['k']} : i64", "axis": f"{axis} : i64", "largest": largest}
        locs = [result_names.get(id(v)) or f"{loc}.{part}" for v, part in zip(op.results, ("values", "indices"))]
        bind(em.emit(name, [operand(0)], out_shapes, attrs, locs))
    else:  # refuse_unmapped ran first; a new entry in SUPPORTED_OPS needs a branch here
        raise TopqError(f"function {em.function}: op {name} has no TPU-MLIR mapping")


def _split_mlp(em: _Emitter, op: Operation, x: str, loc: str) -> list[str]:
    """top.MLP(x, gate, up, down) as TPU-MLIR's converter writes it: down(act(gate(x)) * up(x))."""
    hidden = tuple(op.results[0].shape)
    names = [_weight_name(v) for v in op.operands[1:4]]
    if any(n is None for n in names):
        raise TopqError(f"function {em.function}: top.MLP {op.loc or ''} needs weight operands")
    prefix = op.loc or loc
    gate_name, up_name, down_name = (n for n in names if n is not None)
    inter = hidden[:-1] + (int(op.operands[1].shape[0]),)
    for wname in (gate_name, up_name, down_name):  # float weights first, in TPU-MLIR's order
        if em.values(wname) is None:
            em.weight(wname, "kn", np.asarray(em.get_weight(wname), dtype=np.float32).T)

    def linear(wname: str, source: str, shape: tuple[int, ...], at: str) -> str:
        a16 = em.quantized_linear(wname, source, "%0", shape, at)
        if a16 is not None:
            return a16
        weight = em.weight(wname, "kn", np.asarray(em.get_weight(wname), dtype=np.float32).T)
        return em.emit("top.MatMul", [source, weight, "%0"], [shape], {}, [at])[0]

    gate = linear(gate_name, x, inter, f"{prefix}.gate_proj")
    act = str(op.attrs.get("act", "silu"))
    if act == "silu":
        activated = em.emit("top.SiLU", [gate], [inter], {}, [f"{op.loc or loc}.gate_proj.silu"])[0]
    else:
        mode = "tanh" if act == "gelu_tanh" else "normal"
        activated = em.emit("top.GELU", [gate], [inter], {"approx_mode": format_string(mode)},
                            [f"{op.loc or loc}.gate_proj.gelu"])[0]
    up = linear(up_name, x, inter, f"{prefix}.up_proj")
    product = em.emit("top.Mul", [activated, up], [inter], {}, [f"{prefix}.up_proj.mul"])[0]
    return [linear(down_name, product, hidden, loc if loc != op.loc else f"{loc}.down_proj")]


def greedy_head(vocab_size: int) -> Net:
    """LLM-TPU's `greedy_head` net: logits [1, V] → the arg-max token id [1, 1] (TopK with K = 1)."""
    text = "\n".join([
        ('module @"greedy_head" attributes {module.chip = "ALL", module.platform = "LLM", module.state = "TOP_F32", '
         'module.top_run_mode = "STATIC", module.weight_file = "greedy_head_top_weights.npz"} {'),
        f"  func.func @main(%arg0: {_f32((1, vocab_size))} loc(unknown)) -> {_f32((1, 1))} {{",
        '    %0 = "top.None"() : () -> none loc(unknown)',
        f'    %1 = "top.Input"(%arg0) : ({_f32((1, vocab_size))}) -> {_f32((1, vocab_size))} {_loc("m_logits")}',
        (f'    %2:2 = "top.TopK"(%1) {{K = 1 : i64, axis = 1 : i64}} : ({_f32((1, vocab_size))}) -> '
         f'({_f32((1, 1))}, {_f32((1, 1))}) {_loc("token_value", "token_id")}'),
        f"    return %2#1 : {_f32((1, 1))} loc(unknown)",
        "  } loc(unknown)",
        "} loc(unknown)",
        "",
    ])
    return Net("greedy_head", text, {}, [NetInput("m_logits", (1, vocab_size), "f32")], ["token_id"])

