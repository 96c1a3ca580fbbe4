"""The site finder (topq/quant/sites.py): the linears of a layer, their shared-input groups and fold targets.

Both groupings are checked against copies of the finders they replaced (calibration's and int8's, which
disagree on purpose-built inputs: LayerNorm and attention folds), so conversions keep their results."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from topq.core.errors import TopqError
from topq.core.plugins import get_plugins
from topq.core.stages import StageConfig, build_program
from topq.ir.analysis import linear_weight_names
from topq.ir.builder import Builder
from topq.ir.graph import Function, Module, Operation, Value
from topq.ir.types import tensor
from topq.plugins.quant.int8 import find_sites
from topq.quant.calibration import _find_groups
from topq.quant.sites import MLP_HIDDEN, FoldRules, group_sites, shared_input_sites


def tiny(family_name: str, **extra: Any) -> tuple[Module, Any, Any]:
    family = get_plugins().families.get(family_name)
    config = {"architectures": [], "model_type": family_name, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
              "rms_norm_eps": 1e-5, **extra}
    spec = family.normalize(config)
    return build_program(spec, family, StageConfig(32, 8, True, (16,)), None), family, spec


# ------------------------------------------------------------------------ the finders before the refactor

def _name(value: Value) -> str | None:
    owner = value.owner
    return str(owner.attrs["name"]) if isinstance(owner, Operation) and owner.name == "top.Weight" else None


def _users(function: Function) -> dict[int, list[Operation | None]]:
    table: dict[int, list[Operation | None]] = {}
    for op in function.ops:
        for v in op.operands:
            table.setdefault(id(v), []).append(op)
    for v in function.results:
        table.setdefault(id(v), []).append(None)
    return table


def old_calibration_sites(function: Function, groups: list[tuple[str, ...]]) -> list[tuple[Any, ...]]:
    uses: dict[str, tuple[Operation, str]] = {}
    for op in function.ops:
        if op.name == "top.MatMul":
            name = _name(op.operands[1])
            if name:
                uses[name] = (op, "matmul")
        elif op.name == "top.MLP":
            for role, v in zip(("gate", "up", "down"), op.operands[1:4]):
                name = _name(v)
                if name:
                    uses[name] = (op, role)
    users, order, plans = _users(function), {id(op): i for i, op in enumerate(function.ops)}, []
    for names in groups:
        roles = {uses[n][1] for n in names}
        ops = {id(uses[n][0]): uses[n][0] for n in names}
        if roles == {"down"}:
            op = uses[names[0]][0]
            plans.append((names, op, "mlp_hidden", op.operands[3].shape[-1], ("rows", _name(op.operands[2]) or "",
                                                                             None, None)))
            continue
        first = min(ops.values(), key=lambda o: order[id(o)])
        x = first.operands[0]
        plans.append((names, first, "input", x.shape[-1], _old_fold(x, set(ops), users)))
    plans.sort(key=lambda p: order[id(p[1])] + (0.5 if p[2] == "mlp_hidden" else 0))
    return plans


def _old_fold(x: Value, group_ops: set[int], users: Mapping[int, list[Operation | None]]) -> Any:
    if any(u is None or id(u) not in group_ops for u in users.get(id(x), [])):
        return None
    producer = x.owner
    if not isinstance(producer, Operation):
        return None
    if producer.name == "top.RMSNorm" and len(producer.operands) == 2:
        weight = _name(producer.operands[1])
        return ("norm", weight, None, None) if weight else None
    if producer.name == "top.LayerNorm" and len(producer.operands) == 3:
        weight, bias = _name(producer.operands[1]), _name(producer.operands[2])
        return ("norm", weight, bias, None) if weight and bias else None
    if producer.name == "top.FAttention" and len(producer.operands) == 3:
        v = producer.operands[2]
        reshape = v.owner
        if not (isinstance(reshape, Operation) and reshape.name == "top.Reshape"):
            return None
        if any(u is not producer and u is not None for u in users.get(id(v), [])) \
                or len(users.get(id(reshape.operands[0]), [])) != 1:
            return None
        linear = reshape.operands[0].owner
        if not (isinstance(linear, Operation) and linear.name == "top.MatMul" and linear.attrs.get("right_transpose")):
            return None
        weight = _name(linear.operands[1])
        bias = _name(linear.operands[2]) if len(linear.operands) > 2 else None
        if weight is None:
            return None
        q_head, kv_head, d = int(producer.attrs["q_head"]), int(producer.attrs["kv_head"]), v.shape[-1]
        channel = np.arange(q_head * d)
        return ("rows", weight, bias, tuple((channel // d) // (q_head // kv_head) * d + channel % d))
    return None


def old_int8_sites(function: Function, linears: frozenset[str]) -> list[tuple[Any, ...]]:
    users = _users(function)

    def is_linear(op: Operation) -> str | None:
        if op.name == "top.MatMul" and op.attrs.get("right_transpose") and len(op.operands[1].shape) == 2:
            name = _name(op.operands[1])
            return name if name in linears else None
        return None

    def fold_of(x: Value, consumers: set[int]) -> tuple[str, str | None]:
        producer = x.owner
        only_ours = all(u is not None and id(u) in consumers for u in users.get(id(x), []))
        if only_ours and isinstance(producer, Operation) and producer.name == "top.RMSNorm" \
                and len(producer.operands) == 2 and _name(producer.operands[1]) is not None:
            return "norm", _name(producer.operands[1])
        return "mul", None

    by_input: dict[int, tuple[Value, list[str], Operation]] = {}
    sites: list[tuple[Any, ...]] = []
    for op in function.ops:
        name = is_linear(op)
        if name is not None:
            by_input.setdefault(id(op.operands[0]), (op.operands[0], [], op))[1].append(name)
        elif op.name == "top.MLP":
            names = [_name(v) for v in op.operands[1:4]]
            if all(n in linears for n in names):
                x = op.operands[0]
                sites += [((names[0], names[1]), "input", x.shape[-1], *fold_of(x, {id(op)}), op),
                          ((names[2],), "mlp_hidden", op.operands[3].shape[-1], "up", names[1], op)]
    for x, names, first in by_input.values():
        ops = {id(u) for u in users.get(id(x), []) if u is not None and is_linear(u)}
        sites.append((tuple(names), "input", x.shape[-1], *fold_of(x, ops), first))
    return sites


# ------------------------------------------------------------------------ helpers

def calibration_view(sites: list[Any]) -> list[tuple[Any, ...]]:
    return [(s.names, s.op, s.kind, s.k, None if s.fold is None else
             (s.fold.kind, s.fold.weight, s.fold.bias, None if s.fold.tie is None else tuple(s.fold.tie)))
            for s in sites]


def int8_view(function: Function, linears: frozenset[str]) -> list[tuple[Any, ...]]:
    sites, at_op = find_sites(function, linears)
    where = {id(site): op_id for op_id, listed in at_op.items() for site in listed}
    ops = {id(op): op for op in function.ops}
    assert len(where) == len(sites)  # every site is observed at exactly one op
    return [(s.names, s.kind, s.k, s.fold, s.fold_weight, ops[where[id(s)]]) for s in sites]


FAMILIES = [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 32}), ("llama", {"tie_word_embeddings": True})]


# ------------------------------------------------------------------------ tests

def test_llama_groups_and_fold_targets() -> None:
    module, family, spec = tiny("llama")
    plans = _find_groups(module["block_0"], family, spec, 0)
    layer = "model.layers.0."
    assert [(p.keys, p.kind, p.k, p.op.name) for p in plans] == [
        (("q_proj", "k_proj", "v_proj"), "input", 64, "top.MatMul"),
        (("o_proj",), "input", 64, "top.MatMul"),
        (("gate_proj", "up_proj"), "input", 64, "top.MLP"),
        (("down_proj",), MLP_HIDDEN, 128, "top.MLP")]
    folds = [p.fold for p in plans]
    assert all(f is not None for f in folds)
    assert [(f.kind, f.weight, f.bias) for f in folds if f is not None] == [
        ("norm", layer + "input_layernorm.weight", None),
        ("rows", layer + "self_attn.v_proj.weight", None),
        ("norm", layer + "post_attention_layernorm.weight", None),
        ("rows", layer + "mlp.up_proj.weight", None)]
    # o_proj's 4 query heads × 16 dims read 2 value heads: heads 0, 1 → value head 0; heads 2, 3 → value head 1
    tie = folds[1].tie  # type: ignore[union-attr]
    assert tie is not None and tie.shape == (64,)
    np.testing.assert_array_equal(tie[[0, 15, 16, 31, 32, 63]], [0, 15, 0, 15, 16, 31])


def test_qwen3_int8_sites_and_folds() -> None:
    module, _, _ = tiny("qwen3", head_dim=32)
    layer = "model.layers.1."
    linears = linear_weight_names(module)
    sites, at_op = find_sites(module["block_1"], linears)
    assert [(s.names, s.kind, s.k, s.fold, s.fold_weight) for s in sites] == [
        ((layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"), "input", 64, "norm",
         layer + "post_attention_layernorm.weight"),
        ((layer + "mlp.down_proj.weight",), MLP_HIDDEN, 128, "up", layer + "mlp.up_proj.weight"),
        (tuple(layer + f"self_attn.{p}_proj.weight" for p in "qkv"), "input", 64, "norm",
         layer + "input_layernorm.weight"),
        ((layer + "self_attn.o_proj.weight",), "input", 128, "mul", None)]  # 4 heads × head_dim 32
    assert sum(len(v) for v in at_op.values()) == 4


@pytest.mark.parametrize(("family", "extra"), FAMILIES)
def test_both_groupings_match_the_old_finders(family: str, extra: dict[str, Any]) -> None:
    module, fam, spec = tiny(family, **extra)
    linears = linear_weight_names(module)
    for layer in range(spec.num_layers):
        for name in (f"block_{layer}", f"block_kv_{layer}", f"block_cache_{layer}"):
            function = module[name]
            groups = [tuple(fam.layer_weights[k].format(i=layer) for k in g) for g in fam.quant_groups]
            new = calibration_view(group_sites(function, groups, lambda g: str(g)))
            assert new == old_calibration_sites(function, groups), name
            assert int8_view(function, linears) == old_int8_sites(function, linears), name
        plans = _find_groups(module[f"block_{layer}"], fam, spec, layer)
        assert [p.names for p in plans] == [s[0] for s in old_calibration_sites(
            module[f"block_{layer}"], [tuple(fam.layer_weights[k].format(i=layer) for k in g)
                                       for g in fam.quant_groups])]


def test_decode_attention_with_a_mask_is_no_fold_target() -> None:
    module, fam, _ = tiny("llama")
    groups = [tuple(fam.layer_weights[k].format(i=0) for k in g) for g in fam.quant_groups]
    o_proj = group_sites(module["block_cache_0"], groups, str)[1]
    assert o_proj.names == ("model.layers.0.self_attn.o_proj.weight",) and o_proj.fold is None
    assert group_sites(module["block_0"], groups, str)[1].fold is not None


def norm_block(kind: str) -> Function:
    """x → norm → q, k (shared input) → add → out; kind: layernorm (weight + bias), layernorm_w (weight only),
    rmsnorm, rmsnorm_bare (no weight)."""
    module = Module()
    b = Builder(module)
    with b.function("f", tensor(1, 4, 8)) as f:
        (x,) = f.args
        params = {"layernorm": ["w", "b"], "layernorm_w": ["w"], "rmsnorm": ["w"], "rmsnorm_bare": []}[kind]
        values = [b.weight(n, tensor(8)) for n in params]
        op = "top.LayerNorm" if kind.startswith("layernorm") else "top.RMSNorm"
        h = b.op(op, x, *values, eps=1e-5)
        q = b.top.MatMul(h, b.weight("q", tensor(8, 8)), right_transpose=True)
        k = b.top.MatMul(h, b.weight("k", tensor(8, 8)), right_transpose=True)
        f.returns(b.top.Add(q, k))
    return module["f"]


@pytest.mark.parametrize("kind", ["layernorm", "layernorm_w", "rmsnorm", "rmsnorm_bare"])
def test_norm_folds_follow_each_callers_rules(kind: str) -> None:
    function = norm_block(kind)
    calibrated = group_sites(function, [("q", "k")], str)
    assert calibration_view(calibrated) == old_calibration_sites(function, [("q", "k")])
    assert int8_view(function, frozenset({"q", "k"})) == old_int8_sites(function, frozenset({"q", "k"}))
    expected = {"layernorm": ("norm", "w", "b"), "layernorm_w": None, "rmsnorm": ("norm", "w", None),
                "rmsnorm_bare": None}[kind]
    fold = calibrated[0].fold
    assert (None if fold is None else (fold.kind, fold.weight, fold.bias)) == expected
    # int8 divides no bias: it folds into an RMSNorm only; everything else gets an explicit top.Mul
    (site,), _ = find_sites(function, frozenset({"q", "k"}))
    assert (site.fold, site.fold_weight) == (("norm", "w") if kind == "rmsnorm" else ("mul", None))
    no_bias = shared_input_sites(function, lambda use: True)[0].fold
    with_bias = shared_input_sites(function, lambda use: True, FoldRules(norm_bias=True))[0].fold
    assert (with_bias is not None) == (kind in ("layernorm", "rmsnorm"))
    assert (no_bias is not None) == (kind == "rmsnorm")


def test_a_group_that_does_not_share_its_input_is_refused() -> None:
    module, _, _ = tiny("llama")

    with pytest.raises(TopqError, match="does not share one input"):
        group_sites(module["block_0"], [("model.layers.0.self_attn.q_proj.weight",
                                         "model.layers.0.self_attn.o_proj.weight")], lambda g: "q/o")
    with pytest.raises(TopqError, match="is not a linear of block_0"):
        group_sites(module["block_0"], [("model.layers.0.input_layernorm.weight",)], lambda g: "norm")


def test_calibration_captures_each_group_right_after_its_input_is_computed() -> None:
    from topq.quant.calibration import _capture_point

    module, family, spec = tiny("llama")
    plans = _find_groups(module["block_0"], family, spec, 0)
    points = [_capture_point(p) for p in plans]
    assert [op.name for op in points] == ["top.RMSNorm", "top.FAttention", "top.RMSNorm", "top.RMSNorm"]
    for plan, point in zip(plans, points):  # the producer of what the group's op reads
        assert point.results[0] is plan.op.operands[0]
