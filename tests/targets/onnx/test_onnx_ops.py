"""Each Top op's ONNX lowering against the reference kernel, one small function at a time (the ops and attribute
values the tiny model families do not reach: slices, permutes, LayerNorm, GELU, interleaved and partial RoPE,
attention without the causal rule, TopK, ...), and attention as GroupQueryAttention on every filled length of a
history the runtime's masks describe."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import pytest

from topq.core.errors import TopqError
from topq.ir.builder import Builder
from topq.ir.graph import Function, Module, Value
from topq.ir.interpreter import Interpreter
from topq.ir.types import TensorType, tensor
from topq.plugins.targets.onnx import gqa
from topq.plugins.targets.onnx.lowering import (
    FunctionLowering,
    Rule,
    StoredTensor,
    check_model,
)

Body = Callable[[Builder, list[Value]], list[Value]]


def lower_and_run(module: Module, weights: dict[str, np.ndarray], inputs: list[np.ndarray],
                  rules: dict[str, Rule] | None = None) -> tuple[list[np.ndarray], set[str]]:
    """ORT's outputs of the lowered function `f`, and the ONNX op types of its graph."""
    function: Function = module["f"]
    types = {op.attrs["name"]: op.results[0].type for op in function.walk() if op.name == "top.Weight"}
    model = FunctionLowering(function, lambda name: StoredTensor(name, types[name]), lambda name: None, rules).run()
    check_model(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    names = [t.name for t in model.graph.initializer if t.external_data]
    options.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(weights[n]) for n in names])
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return list(session.run(None, {f"arg{i}": x for i, x in enumerate(inputs)})), {n.op_type for n in model.graph.node}


def check(arg_types: list[TensorType], body: Body, weights: dict[str, np.ndarray] | None = None,
          atol: float = 1e-5) -> None:
    rng = np.random.default_rng(len(arg_types))
    weights = weights or {}
    b = Builder()
    with b.function("f", *arg_types) as f:
        f.returns(*body(b, f.args))
    inputs = [rng.integers(0, 8, t.shape).astype(np.int32) if t.dtype == "i32"
              else rng.standard_normal(t.shape).astype(np.float32) for t in arg_types]
    ref = Interpreter(b.module, lambda name: weights[name]).run("f", inputs)
    got, _ = lower_and_run(b.module, weights, inputs)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        np.testing.assert_allclose(g, r, atol=atol, rtol=0)


W = np.random.default_rng(7).standard_normal((6, 8)).astype(np.float32)
CASES: dict[str, tuple[list[TensorType], Body, dict[str, np.ndarray]]] = {
    "slice_permute_reshape": ([tensor(2, 6, 8)], lambda b, a: [b.top.Reshape(
        b.top.Permute(b.top.Slice(a[0], offset=[0, 1, 0], ends=[2, 6, 8], steps=[1, 2, 1]), order=[2, 0, 1]),
        shape=[8, 6])], {}),
    "concat_mulconst_add_mul": ([tensor(1, 3, 8), tensor(1, 2, 8)], lambda b, a: [b.top.Mul(
        b.top.Add(b.top.MulConst(b.top.Concat(a[0], a[1], axis=1), const_val=0.5), b.top.Concat(a[1], a[0], axis=1)),
        b.top.Concat(a[0], a[1], axis=1))], {}),
    "layernorm_with_and_without_params": ([tensor(1, 4, 8)], lambda b, a: [
        b.top.LayerNorm(a[0], b.weight("g", tensor(8)), b.weight("beta", tensor(8)), eps=1e-5),
        b.top.LayerNorm(a[0], eps=1e-6)],
        {"g": np.linspace(0.5, 1.5, 8, dtype=np.float32), "beta": np.linspace(-1, 1, 8, dtype=np.float32)}),
    "rmsnorm_without_weight": ([tensor(1, 4, 8)], lambda b, a: [b.top.RMSNorm(a[0], eps=1e-6)], {}),
    "activations_softmax": ([tensor(2, 8)], lambda b, a: [
        b.top.SiLU(a[0]), b.top.GELU(a[0]), b.top.GELU(a[0], approximate="tanh"), b.top.Softmax(a[0], axis=0)], {}),
    "matmul_activation_operands_and_bias": ([tensor(2, 3, 8), tensor(2, 5, 8)], lambda b, a: [
        b.top.MatMul(a[0], a[1], right_transpose=True),
        b.top.MatMul(a[0], b.weight("w", tensor(6, 8)), b.weight("bias", tensor(6)), right_transpose=True)],
        {"w": W, "bias": np.arange(6, dtype=np.float32)}),
    "gather_rows": ([tensor(1, 5, dtype="i32")], lambda b, a: [
        b.top.Gather(b.weight("table", tensor(8, 6)), a[0], axis=0)],
        {"table": np.arange(48, dtype=np.float32).reshape(8, 6)}),
    "topk_values_and_int32_indices": ([tensor(3, 8)], lambda b, a: list(b.top.TopK(a[0], k=3, axis=-1)), {}),
    "rope_interleaved_partial": ([tensor(1, 3, 2, 8), tensor(1, 3, 4), tensor(1, 3, 4)], lambda b, a: [
        b.top.Rope(a[0], a[1], a[2], mode="interleaved_pairs"), b.top.Rope(a[0], a[1], a[2])], {}),
    "attention_gqa_mask_not_causal": ([tensor(1, 3, 4, 8), tensor(1, 5, 2, 8), tensor(1, 5, 2, 8),
                                       tensor(1, 1, 1, 5)], lambda b, a: [
        b.top.FAttention(a[0], a[1], a[2], a[3], q_head=4, kv_head=2, scale=0.35, causal=False),
        b.top.FAttention(a[0], a[1], a[2], q_head=4, kv_head=2, scale=0.35, causal=True)], {}),
    "mlp_gelu_tanh": ([tensor(1, 2, 8)], lambda b, a: [b.top.MLP(
        a[0], b.weight("g", tensor(6, 8)), b.weight("u", tensor(6, 8)), b.weight("d", tensor(8, 6)), act="gelu_tanh")],
        {"g": W, "u": W[::-1].copy(), "d": W.T.copy()}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lowering_matches_the_reference_kernel(case: str) -> None:
    arg_types, body, weights = CASES[case]
    check(arg_types, body, weights)


def test_an_op_without_a_lowering_is_refused_naming_it() -> None:
    b = Builder()
    with b.function("f", tensor(1, 4, 8)) as f:
        f.returns(b.top.RMSNorm(f.args[0], eps=1e-6))
    function = b.module["f"]
    function.ops[0].name = "top.Frobnicate"
    with pytest.raises(TopqError, match=r"@f: op top\.Frobnicate has no ONNX lowering"):
        FunctionLowering(function, lambda name: StoredTensor(name, tensor(1)), lambda name: None).run()


def history_mask(filled: int, slots: int, queries: int, window: int) -> np.ndarray:
    """The key mask topq's Session gives a history stage (runtime.Session._history_mask): `filled` of `slots`
    history rows visible, minus those a sliding window hides (one row per query then), the new keys 0."""
    rows = queries if window and queries > 1 else 1
    mask = np.zeros((1, 1, rows, slots + queries), np.float32)
    mask[..., filled:slots] = -np.inf
    if window:
        i, j = np.arange(rows)[:, None], np.arange(slots)[None, :]
        mask[0, 0, :, :slots][j <= filled + i - window] = -np.inf
    return mask


@pytest.mark.parametrize("queries,window,softcap", [(5, 0, 0.0), (1, 0, 0.0), (5, 3, 0.0), (1, 3, 4.0)],
                         ids=["prefill_kv", "decode", "prefill_kv_window", "decode_window_softcap"])
def test_group_query_attention_matches_the_reference_on_every_filled_length(queries: int, window: int,
                                                                              softcap: float) -> None:
    """A history stage's attention (Concat(history, new) keys, the runtime's mask) as GroupQueryAttention: equal
    to the reference kernel for every filled length 0…S, the unfilled slots holding garbage it must not read."""
    slots, hq, hkv, d = 8, 4, 2, 16
    b = Builder()
    with b.function("f", tensor(1, queries, hq, d), tensor(1, queries, hkv, d), tensor(1, queries, hkv, d),
                    tensor(1, 1, queries if window and queries > 1 else 1, slots + queries),
                    tensor(1, slots, hkv, d), tensor(1, slots, hkv, d)) as f:
        q, k, v, mask, history_k, history_v = f.args
        options = {**({"window": window} if window else {}), **({"softcap": softcap} if softcap else {})}
        f.returns(b.top.FAttention(q, b.top.Concat(history_k, k, axis=1), b.top.Concat(history_v, v, axis=1), mask,
                                   q_head=hq, kv_head=hkv, scale=0.3, causal=True, **options))
    assert gqa.unfit(b.module["f"].ops[-1]) is None
    rng = np.random.default_rng(queries + window)
    for filled in range(slots + 1):
        x = [rng.standard_normal(t.shape).astype(np.float32) for t in b.module["f"].input_types]
        x[3] = history_mask(filled, slots, queries, window)
        x[4][:, filled:] = x[5][:, filled:] = 1e4  # unfilled slots: values that would show if read
        ref = Interpreter(b.module, lambda name: np.zeros(0)).run("f", x)
        got, ops = lower_and_run(b.module, {}, x, {"top.FAttention": gqa.rule("gqa")})
        assert "GroupQueryAttention" in ops and "Concat" not in ops
        np.testing.assert_allclose(got[0], ref[0], atol=1e-5, rtol=0, err_msg=f"filled {filled}")


def test_group_query_attention_prefill_matches_the_reference() -> None:
    check([tensor(1, 6, 4, 16), tensor(1, 6, 2, 16), tensor(1, 6, 2, 16)], lambda b, a: [
        b.top.FAttention(a[0], a[1], a[2], q_head=4, kv_head=2, scale=0.25, causal=True),
        b.top.FAttention(a[0], a[1], a[2], q_head=4, kv_head=2, scale=0.25, causal=True, window=2, softcap=3.0)])
    b = Builder()
    with b.function("f", tensor(1, 6, 4, 16), tensor(1, 6, 2, 16)) as f:
        f.returns(b.top.FAttention(f.args[0], f.args[1], f.args[1], q_head=4, kv_head=2, scale=0.25, causal=True))
    x = [np.random.default_rng(1).standard_normal(t.shape).astype(np.float32) for t in b.module["f"].input_types]
    got, ops = lower_and_run(b.module, {}, x, {"top.FAttention": gqa.rule("gqa")})
    assert "GroupQueryAttention" in ops
    np.testing.assert_allclose(got[0], Interpreter(b.module, lambda name: np.zeros(0)).run("f", x)[0], atol=1e-5)


@pytest.mark.parametrize("case,reason", [
    ("head_dim_12", "head size 12"), ("not_causal", "non-causal"), ("bias_mask", "a mask of shape"),
    ("keys_not_history", "keys that are not this function's history")])
def test_what_group_query_attention_cannot_express_is_named(case: str, reason: str) -> None:
    b = Builder()
    d = 12 if case == "head_dim_12" else 16
    with b.function("f", tensor(1, 3, 4, d), tensor(1, 3, 2, d), tensor(1, 1, 3, 3), tensor(1, 5, 2, d),
                    tensor(1, 4, 3, 8)) as f:
        q, k, mask, history, head_bias = f.args
        if case == "keys_not_history":  # a mask, but keys that are no Concat of an argument and the new keys
            f.returns(b.top.FAttention(q, k, k, mask, q_head=4, kv_head=2, scale=0.3, causal=True))
        elif case == "bias_mask":  # one bias per head: no key mask of the runtime's
            keys = b.top.Concat(history, k, axis=1)
            f.returns(b.top.FAttention(q, keys, keys, head_bias, q_head=4, kv_head=2, scale=0.3, causal=True))
        else:
            f.returns(b.top.FAttention(q, k, k, q_head=4, kv_head=2, scale=0.3, causal=case != "not_causal"))
    why = gqa.unfit(b.module["f"].ops[-1])
    assert why is not None and why.startswith(reason), why
