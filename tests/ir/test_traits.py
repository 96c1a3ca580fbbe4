"""Op traits (topq/ir/catalogue.py) and the match helpers built on them (topq/ir/analysis.py)."""

from __future__ import annotations

from typing import Any

import pytest

from topq.core.plugins import get_plugins
from topq.core.stages import StageConfig, build_program
from topq.ir.analysis import linear_uses, linear_weight_names, users, weight_name
from topq.ir.builder import Builder
from topq.ir.catalogue import CATALOGUE, NO_TRAITS, traits_of
from topq.ir.graph import Module
from topq.ir.types import tensor
from topq.raw.extension import RAW, install


def tiny_program(family_name: str, **extra: Any) -> Module:
    family = get_plugins().families.get(family_name)
    config = {"architectures": [], "model_type": family_name, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
              "rms_norm_eps": 1e-5, **extra}
    return build_program(family.normalize(config), family, StageConfig(32, 8, True, (16,)), None)


def test_every_top_op_declares_its_traits() -> None:
    top = [name for name in CATALOGUE if name.startswith("top.")]
    assert "top.MLP" in top and "top.MatMulInt8" in top
    undeclared = [name for name in top if CATALOGUE[name].traits is None]
    assert not undeclared, f"Top ops without traits: {undeclared}"
    install()
    assert all(op.traits is not None for op in RAW.ops)  # the raw extension's ops (incl. top.DSLRegion) too


def test_trait_operands_are_within_each_ops_arity() -> None:
    for name, opdef in CATALOGUE.items():
        traits = traits_of(name)
        most = opdef.operands[1]
        indices = [*traits.weights, *(i for lin in traits.linears for i in (lin.weight, lin.input, lin.bias,
                                                                            lin.scales_input) if i is not None)]
        indices += [i for i in (traits.norm_scale, traits.norm_bias, traits.mixes_heads_of) if i is not None]
        assert all(0 <= i and (most is None or i < most) for i in indices), (name, traits)
        if traits.norm_scale is not None:
            assert traits.norm_scale in traits.weights, name
        for linear in traits.linears:
            assert linear.weight in traits.weights, name
            if linear.layout_attr is not None:
                assert opdef.attrs[linear.layout_attr].kind == "bool", name


def test_traits_classify_ops() -> None:
    assert [lin.role for lin in traits_of("top.MLP").linears] == ["gate", "up", "down"]
    assert traits_of("top.MatMul").linears[0].layout_attr == "right_transpose"
    assert traits_of("top.MatMulInt8").linears == ()  # codes already: no weight-quantization site
    (a8,) = traits_of("top.A8MatMul").linears  # int8 activations on a weight the scheme quantizes
    assert (a8.weight, a8.input, a8.bias, a8.layout_attr) == (1, 0, 2, None)
    assert {n for n in CATALOGUE if n.startswith("top.") and traits_of(n).elementwise} == {
        "top.Add", "top.Mul", "top.MulConst", "top.SiLU", "top.Tanh", "top.GELU", "top.Sigmoid", "top.Softplus",
        "top.Exp"}
    assert {n for n in CATALOGUE if n.startswith("top.") and traits_of(n).view} == {
        "top.Reshape", "top.Permute", "top.Slice", "top.Concat"}
    assert (traits_of("top.LayerNorm").norm_scale, traits_of("top.LayerNorm").norm_bias) == (1, 2)
    assert (traits_of("top.RMSNorm").norm_scale, traits_of("top.RMSNorm").norm_bias) == (1, None)
    assert traits_of("top.FAttention").mixes_heads_of == 2
    assert traits_of("no.SuchOp") is NO_TRAITS


def test_weight_name_looks_through_views_only_when_asked() -> None:
    module = Module()
    b = Builder(module)
    with b.function("f", tensor(2, 8)) as f:
        (x,) = f.args
        w = b.weight("w", tensor(4, 8))
        flat = b.top.Reshape(w, shape=[32])
        again = b.top.Reshape(flat, shape=[4, 8])
        y = b.top.MatMul(x, again, right_transpose=True)
        f.returns(y)
    function = module["f"]
    assert weight_name(w) == "w"
    assert weight_name(again) is None
    assert weight_name(again, through_views=True) == "w"
    assert weight_name(x, through_views=True) is None  # a function argument
    table = users(function)
    assert table[id(y)] == [None]  # returned by the function
    assert [op.name for op in table[id(w)]] == ["top.Reshape"]
    assert linear_uses(function) == []  # its weight is no named weight: not a linear site


def _old_linear_weight_names(module: Module) -> frozenset[str]:
    """pipeline.linear_weight_names before traits: matmul right operands and top.MLP's three weights."""
    producers, names = {}, set()
    for function in module:
        for op in function.walk():
            if op.name == "top.Weight":
                producers[id(op.results[0])] = op.attrs["name"]
            elif op.name == "top.MatMul":
                name = producers.get(id(op.operands[1]))
                if name:
                    names.add(name)
            elif op.name == "top.MLP":
                names.update(producers[id(v)] for v in op.operands[1:] if id(v) in producers)
    return frozenset(names)


@pytest.mark.parametrize(("family", "extra"), [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 32}),
                                               ("llama", {"tie_word_embeddings": True})])
def test_linear_weight_names_from_traits_match_the_old_rule(family: str, extra: dict[str, Any]) -> None:
    module = tiny_program(family, **extra)
    names = linear_weight_names(module)
    assert names == _old_linear_weight_names(module)
    assert "model.layers.1.mlp.down_proj.weight" in names and "model.layers.0.self_attn.o_proj.weight" in names
    assert not any("norm" in n for n in names)


def test_moe_declares_each_experts_linears() -> None:
    from topq.ir.catalogue import declared_linears
    from topq.ir.top_ops import moe_expert_weights, moe_operands

    linears = declared_linears("top.MoE", moe_operands(3, shared=True))
    assert [(lin.role, lin.expert) for lin in linears] == [
        (role, e) for e in range(3) for role in ("gate", "up", "down")] + [
        ("shared_gate", None), ("shared_up", None), ("shared_down", None)]
    for e in range(3):
        gate, up, down = linears[3 * e:3 * e + 3]
        assert (gate.weight, up.weight, down.weight) == moe_expert_weights(e)
        assert down.input is None and down.scales_input == up.weight and down.hidden_from == (0, gate.weight,
                                                                                            up.weight)
    assert linears[-1].weight == moe_operands(3, shared=False) + 2  # the shared down; its gate [1, H] stays float
    assert len(declared_linears("top.MoE", moe_operands(4, shared=False))) == 12
    assert declared_linears("top.MLP", 4) == traits_of("top.MLP").linears
