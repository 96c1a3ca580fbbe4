"""Generate realistic Top IR for tests and benchmarks, and the op table of docs/ir.md.

`build_module()` writes a Llama-style model straight with the Builder (not through `stages.py`, so IR
tests do not depend on the stage template): per layer a prefill, a prefill-with-history and a decode
function, plus one function whose ops and attributes use every attribute kind the printer knows.

    python -m tests.helpers.ir_gen --op-table     # print the op table for docs/ir.md
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from topq.ir.builder import Builder
from topq.ir.catalogue import CATALOGUE, REQUIRED, OpDef
from topq.ir.graph import Module, Value
from topq.ir.printer import format_attr
from topq.ir.types import ScalarType, tensor
from topq.raw.extension import install as install_raw

install_raw()  # top.DSLRegion (an IR extension, registered by the raw plugin) is in the op table

#: Strings that stress the printer's escaping: quote, backslash, newline, tab, non-ASCII, emoji.
NASTY_STRING = 'a "quoted" \\path\\ with\nnewline,\ttab, caf\u00e9, \u4e2d\u6587 and \U0001f600'

#: Values for every attribute kind; kept as data so tests can compare parsed attributes against them.
EVERY_KIND_ATTRS: dict[str, object] = {
    "int": 7,
    "neg_int": -3,
    "big_int": 2**62,
    "float": 1e-5,
    "huge": 1e30,
    "neg_float": -2.5,
    "neg_zero": -0.0,
    "tiny": 5e-324,
    "inf": math.inf,
    "yes": True,
    "no": False,
    "str": NASTY_STRING,
    "empty_str": "",
    "ints": [1, -2, 3],
    "floats": [0.5, -1e-5, 1e30],
    "empty": [],
    "mixed": [1, 2.0, "three", True, [4, [5]], {"k": "v"}],
    "nested": {"outer": {"inner": [1, 2, {"deep": 1e-5}], "flag": False}, "name": "x\"y"},
    "empty_dict": {},
    "tensor_type": tensor(4, 8, dtype="bf16"),
    "dynamic_type": tensor(-1, 64, dtype="i4"),
    "scalar_type": ScalarType("f32"),
}


@dataclass(frozen=True)
class Dims:
    """SmolLM-135M-like sizes (9 query heads sharing 3 KV heads)."""

    layers: int = 32
    hidden: int = 576
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    inter: int = 1536
    vocab: int = 49152
    max_input: int = 512  # L
    seq: int = 2048  # S
    eps: float = 1e-5


def _block(b: Builder, d: Dims, layer: int, hidden: Value, positions: Value,
           mask: Value | None, history_k: Value | None, history_v: Value | None) -> tuple[Value, Value, Value]:
    """One Llama block (the shape of topq.plugins.models.llama); returns hidden, k, v."""
    w = f"model.layers.{layer}."

    def linear(x: Value, name: str, out: int) -> Value:
        weight = b.weight(f"{w}self_attn.{name}.weight" if name[0] in "qkvo" else f"{w}mlp.{name}.weight",
                          tensor(out, x.shape[-1]))
        return b.top.MatMul(x, weight, right_transpose=True, loc=name)

    def heads(x: Value, count: int) -> Value:
        return b.top.Reshape(x, shape=[1, x.shape[1], count, d.head_dim], loc="heads")

    cos = b.top.Gather(b.weight("rope.cos", tensor(d.seq, d.head_dim)), positions, axis=0, loc="rope_cos")
    sin = b.top.Gather(b.weight("rope.sin", tensor(d.seq, d.head_dim)), positions, axis=0, loc="rope_sin")
    h = b.top.RMSNorm(hidden, b.weight(f"{w}input_layernorm.weight", tensor(d.hidden)), eps=d.eps,
                      loc="input_layernorm")
    q = heads(linear(h, "q_proj", d.heads * d.head_dim), d.heads)
    k = heads(linear(h, "k_proj", d.kv_heads * d.head_dim), d.kv_heads)
    v = heads(linear(h, "v_proj", d.kv_heads * d.head_dim), d.kv_heads)
    q = b.top.Rope(q, cos, sin, mode="contiguous_halves", loc="rope_q")
    k = b.top.Rope(k, cos, sin, loc="rope_k")  # mode left to its default
    k_all, v_all = k, v
    if history_k is not None and history_v is not None:
        k_all = b.top.Concat(history_k, k, axis=1, loc="history_k")
        v_all = b.top.Concat(history_v, v, axis=1, loc="history_v")
    operands = (q, k_all, v_all) if mask is None else (q, k_all, v_all, mask)
    attn = b.top.FAttention(*operands, q_head=d.heads, kv_head=d.kv_heads, scale=1.0 / math.sqrt(d.head_dim),
                            causal=True, loc="attention")
    x = b.top.Add(hidden, linear(attn, "o_proj", d.hidden), loc="residual_attn")
    h = b.top.RMSNorm(x, b.weight(f"{w}post_attention_layernorm.weight", tensor(d.hidden)), eps=d.eps,
                      loc="post_attention_layernorm")
    mlp = b.top.MLP(h, b.weight(f"{w}mlp.gate_proj.weight", tensor(d.inter, d.hidden)),
                    b.weight(f"{w}mlp.up_proj.weight", tensor(d.inter, d.hidden)),
                    b.weight(f"{w}mlp.down_proj.weight", tensor(d.hidden, d.inter)), act="silu", loc="mlp")
    return b.top.Add(x, mlp, loc="residual_mlp"), k, v


def _block_functions(b: Builder, d: Dims, layer: int) -> None:
    H, KVH, D, L, S = d.hidden, d.kv_heads, d.head_dim, d.max_input, d.seq
    stages = (
        # name, stage, length, history (0 = prefill without history)
        (f"block_{layer}", "prefill", L, 0),
        (f"block_kv_{layer}", "prefill_kv", L, S),
        (f"block_cache_{layer}", "decode", 1, S),
    )
    for name, stage, length, history in stages:
        inputs = [tensor(1, length, H), tensor(1, length, dtype="i32")]
        if history:
            inputs += [tensor(1, 1, 1, history + length), tensor(1, history, KVH, D), tensor(1, history, KVH, D)]
        with b.function(name, *inputs, attrs={"stage": stage, "layer": layer}) as f, b.scope(f"layers.{layer}."):
            hidden, positions, *rest = f.args
            mask, hk, hv = rest if rest else (None, None, None)
            f.returns(*_block(b, d, layer, hidden, positions, mask, hk, hv))


def _attribute_zoo(b: Builder, d: Dims) -> None:
    """Ops whose attributes cover every kind: int/float/bool/str/array on ops (checked by the verifier),
    nested dict and type attributes on the function (ops of the Top dialect have no such attribute)."""
    with b.function("attribute_zoo", tensor(1, 4, 32), attrs=dict(EVERY_KIND_ATTRS)) as f:
        (x,) = f.args
        # quotes / backslash / newline / unicode in a string attribute and in a loc
        w = b.op("top.Weight", result_types=[tensor(32)], name=NASTY_STRING, loc=NASTY_STRING)
        y = b.top.RMSNorm(x, w, eps=1e-5, loc="eps 1e-5")
        y = b.top.MulConst(y, const_val=1e30, loc="huge")
        y = b.top.MulConst(y, const_val=-2.5e-7, loc="negative")
        y = b.top.LayerNorm(y, eps=1e-12)  # no loc
        s = b.top.Slice(y, offset=[0, 1, 0], ends=[1, 4, 32], steps=[1, 2, 1], loc="slice")
        p = b.top.Permute(s, order=[2, 0, 1], loc="permute")
        r = b.top.Reshape(p, shape=[-1, 2], loc="reshape")
        sm = b.top.Softmax(r, axis=-1, loc="softmax")
        g = b.top.GELU(sm, approximate="tanh", loc="gelu")
        values, indices = b.top.TopK(g, k=1, axis=0, largest=False, loc="topk")  # two results
        act = b.top.SiLU(values, loc="silu")
        prod = b.top.Mul(act, values, loc="mul")
        logits = b.top.MatMul(prod, b.weight("zoo.w", tensor(2, 3)), right_transpose=False, loc="no_transpose")
        f.returns(logits, indices, y)


def build_module(dims: Dims = Dims()) -> Module:
    b = Builder()
    b.module.attrs = {"topq.seq_length": dims.seq, "topq.max_input_length": dims.max_input,
                      "topq.decode_variants": [dims.seq], "topq.note": NASTY_STRING}
    with b.function("embedding", tensor(1, dims.max_input, dtype="i32")) as f:
        table = b.weight("model.embed_tokens.weight", tensor(dims.vocab, dims.hidden))
        f.returns(b.top.Gather(table, f.args[0], axis=0, loc="embed"))
    for layer in range(dims.layers):
        _block_functions(b, dims, layer)
    with b.function("lm_head", tensor(1, 1, dims.hidden)) as f:
        h = b.top.RMSNorm(f.args[0], b.weight("model.norm.weight", tensor(dims.hidden)), eps=dims.eps)
        f.returns(b.top.MatMul(h, b.weight("lm_head.weight", tensor(dims.vocab, dims.hidden)),
                               right_transpose=True, loc="lm_head"))
    _attribute_zoo(b, dims)
    return b.module


# ------------------------------------------------------------------------------------- op table


def _arity(opdef: OpDef) -> str:
    low, high = opdef.operands
    if low == high:
        return str(low)
    return f"{low}+" if high is None else f"{low}–{high}"


def _attr_text(name: str, opdef: OpDef) -> str:
    spec = opdef.attrs[name]
    text = f"`{name}`: {spec.kind}"
    if spec.choices:
        text += " (" + " \\| ".join(f"`{c}`" for c in spec.choices) + ")"
    if spec.default is REQUIRED:
        text += ", required"
    elif spec.default is not None:
        text += f" = `{format_attr(spec.default, nested=True)}`"  # the IR spelling of the default
    return text


def op_table_rows(prefix: str = "top.") -> list[str]:
    """One Markdown row per catalogue op with this prefix: name, operands, results, attributes."""
    rows = []
    for name in sorted(n for n in CATALOGUE if n.startswith(prefix)):
        opdef = CATALOGUE[name]
        attrs = "; ".join(_attr_text(a, opdef) for a in opdef.attrs) or "—"
        results = "n" if opdef.results is None else str(opdef.results)
        rows.append(f"| `{name}` | {_arity(opdef)} | {results} | {attrs} |")
    return rows


def op_table(prefix: str = "top.") -> str:
    head = ["| op | operands | results | attributes |", "|---|---|---|---|"]
    return "\n".join(head + op_table_rows(prefix)) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--op-table"]:
        sys.stdout.write(op_table())
    else:
        module = build_module()
        print(f"{module.num_ops()} ops in {len(module.functions)} functions")
