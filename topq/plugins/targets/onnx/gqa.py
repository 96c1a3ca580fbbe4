"""`top.FAttention` as ONNX Runtime's fused `com.microsoft.GroupQueryAttention` (the `target.attention` option).

GroupQueryAttention (ContribOperators.md; contrib op 1, checked against ONNX Runtime 1.32's schema) takes the
query and the new keys/values packed per token (BSNH, `[B, L, heads·D]`), the past keys/values head-major (BNSH,
`[B, KVH, P, D]`), `seqlens_k` (int32 `[B]`, the total key count minus one) and `total_sequence_length` (int32
scalar). It applies the causal rule itself — query `s` sees the `P + s + 1` first keys — plus `local_window_size`
(it then sees the last `window` of those, the count that includes itself, like `top.FAttention`'s `window`),
`softcap` and `scale`.

The stage functions map onto it this way:

* prefill (`block_{i}`): no past. The L padded positions all count as keys; a padding row is only seen by
  padding queries, as in the standard-op graph.
* prefill_kv and decode: Top concatenates the history `[1, S, KVH, D]` and the new keys before the attention.
  The lowering takes the two apart: the history's first `P` rows (the filled slots), transposed to BNSH, become
  `past_key` / `past_value`, and GQA reads only those — the standard-op graph works on all `S` slots. `P` comes
  from the stage's mask, the runtime's record of the filled slots: one past the last history slot the first
  query sees (with a sliding window the first slots are hidden too, never the last filled one).

What it cannot express is named by `unfit` (`gqa` refuses it; `auto`, which uses GroupQueryAttention in prefill
only (`rule`), keeps standard ops there): a mask other than the runtime's 0 / −inf key mask (biases), non-causal
attention, a head size that is not a multiple of 8 (the kernel's rule), a one-key window (the mask would show no
filled slot), keys that do not come from this function's history + new keys.

The shared past/present buffer mode is not used: it needs the cache in BNSH in a buffer ORT writes in place
(IO binding), while topq's Session holds the KV cache `[1, S, KVH, D]` and hands each function its history.
RoPE stays `top.Rope`'s graph (`do_rotary` off): topq's tables cover partial and interleaved rotary the same way.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from topq.ir.graph import Block, Operation, Value
from topq.plugins.targets.onnx.conventions import ATTENTION_AUTO, ATTENTION_GQA, ATTENTION_STANDARD
from topq.plugins.targets.onnx.lowering import FunctionLowering, GraphBuilder, Rule, fattention_standard


def _history_concat(value: Value) -> tuple[Value, Value] | None:
    """(history argument, new keys) when `value` is `Concat(history, new, axis=1)` of a function argument."""
    op = value.owner
    if not isinstance(op, Operation) or op.name != "top.Concat" or len(op.operands) != 2:
        return None
    history, new = op.operands
    if int(op.attrs.get("axis", 0)) != 1 or not isinstance(history.owner, Block):
        return None
    return history, new


def unfit(op: Operation) -> str | None:
    """Why this `top.FAttention` cannot become a GroupQueryAttention (None: it can)."""
    q = op.operands[0]
    d, hq, hkv = q.shape[3], int(op.attrs["q_head"]), int(op.attrs["kv_head"])
    if not op.attrs.get("causal", True):
        return "non-causal attention (GroupQueryAttention is causal here)"
    if d % 8:
        return f"head size {d} (GroupQueryAttention needs a multiple of 8)"
    if hq % hkv or q.shape[2] != hq:
        return f"{hq} query heads over {hkv} kv heads"
    if int(op.attrs.get("window") or 0) == 1:
        return "a one-key sliding window"
    if len(op.operands) == 3:
        if op.operands[1].shape[1] != q.shape[1]:
            return "keys of another length than the queries and no history mask"
        return None
    k, v, mask = _history_concat(op.operands[1]), _history_concat(op.operands[2]), op.operands[3]
    if k is None or v is None:
        return "keys that are not this function's history + new keys"
    history = k[0].shape[1]
    if k[1].shape[1] != q.shape[1] or v[0].shape[1] != history:
        return "new keys of another length than the queries"
    if mask.shape[:2] != (1, 1) or mask.shape[3] != history + q.shape[1] or q.shape[0] != 1:
        return f"a mask of shape {list(mask.shape)} (GroupQueryAttention reads the runtime's key mask only)"
    return None


def _filled_slots(g: GraphBuilder, mask: str, slots: int) -> str:
    """P, int64 [1]: one past the last history slot the first query sees (0 where it sees none)."""
    first_row = g.one("Slice", [mask, g.ints([0, 0]), g.ints([1, slots]), g.ints([2, 3])])  # [1, 1, 1, S]
    visible = g.one("Equal", [first_row, g.scalar(0.0)])
    numbers = g.constant(np.arange(1, slots + 1, dtype=np.int64).reshape(1, 1, 1, slots), "slot_numbers")
    last = g.one("Where", [visible, numbers, g.constant(np.zeros((), np.int64), "zero")])
    return g.one("ReduceMax", [g.one("Reshape", [last, g.ints([1, slots])]), g.ints([1])], keepdims=0)


def _past(g: GraphBuilder, history: str, filled: str) -> str:
    """The filled history rows [1, P, KVH, D] as BNSH [1, KVH, P, D]."""
    rows = g.one("Slice", [history, g.ints([0]), filled, g.ints([1])])
    return g.one("Transpose", [rows], perm=[0, 2, 1, 3])


def fattention(lw: FunctionLowering, op: Operation) -> list[str]:
    """`top.FAttention` → GroupQueryAttention (the caller checked `unfit(op)` is None)."""
    g = lw.graph
    b, lq, hq, d = op.operands[0].shape
    hkv = int(op.attrs["kv_head"])
    attrs: dict[str, float | int] = {"num_heads": hq, "kv_num_heads": hkv, "scale": float(op.attrs["scale"])}
    if op.attrs.get("softcap"):
        attrs["softcap"] = float(op.attrs["softcap"])
    if op.attrs.get("window"):
        attrs["local_window_size"] = int(op.attrs["window"])

    def packed(value: Value, heads: int) -> str:  # [B, L, heads, D] → [B, L, heads·D]
        return g.one("Reshape", [lw.name(value), g.ints([b, lq, heads * d])])

    query = packed(op.operands[0], hq)
    if len(op.operands) == 3:  # prefill: no past, all lq keys
        key, value = packed(op.operands[1], hkv), packed(op.operands[2], hkv)
        seqlens = g.constant(np.asarray([lq - 1], np.int32), "seqlens_k")
        total = g.constant(np.asarray(lq, np.int32), "total_sequence_length")
        inputs, outputs = [query, key, value, "", "", seqlens, total], 1
    else:
        k_parts, v_parts = _history_concat(op.operands[1]), _history_concat(op.operands[2])
        assert k_parts is not None and v_parts is not None, "checked by unfit()"
        (history_k, new_k), (history_v, new_v) = k_parts, v_parts
        filled = _filled_slots(g, lw.operand(op, 3), history_k.shape[1])
        keys = g.one("Add", [filled, g.ints([lq])])  # P + Lq
        seqlens = g.one("Cast", [g.one("Sub", [keys, g.ints([1])])], to=TensorProto.INT32)
        total = g.one("Cast", [g.one("Reshape", [keys, g.ints([])])], to=TensorProto.INT32)
        inputs = [query, packed(new_k, hkv), packed(new_v, hkv), _past(g, lw.name(history_k), filled),
                  _past(g, lw.name(history_v), filled), seqlens, total]
        outputs = 3  # with a past, the kernel reads the keys from its present outputs (unused beyond the node)
    return [g.node("GroupQueryAttention", inputs, outputs, domain="com.microsoft", **attrs)[0]]


def rule(mode: str) -> Rule:
    """The `top.FAttention` rule of a `target.attention` mode ('gqa' callers refuse unfit ops beforehand).

    `auto` is what measured faster at equal numerics (benchmarks/onnx_decode.py, docs/onnx.md): GroupQueryAttention
    in prefill (attention without a history), standard ops on a history (prefill_kv, decode), where its slice and
    transpose of the history cost more than its fused kernel saves."""
    if mode == ATTENTION_STANDARD:
        return fattention_standard
    if mode == ATTENTION_GQA:
        return fattention

    def auto(lw: FunctionLowering, op: Operation) -> list[str]:
        prefill = len(op.operands) == 3
        return fattention(lw, op) if prefill and unfit(op) is None else fattention_standard(lw, op)

    assert mode == ATTENTION_AUTO, mode
    return auto
