"""top.MoE: shape inference, and the reference kernel against a token-by-token float64 reading of its definition
(transformers' MoE blocks are compared with the host through the qwen2_moe / qwen3_moe / mixtral families)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from topq.ir.builder import Builder
from topq.ir.catalogue import InferError
from topq.ir.graph import Module
from topq.ir.reference_ops import REFERENCE_OPS
from topq.ir.types import tensor

H, INTER, E = 8, 6, 4


def weights(experts: int, shared: bool, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = [rng.normal(size=(experts, H)).astype(np.float32)]
    for _ in range(experts + shared):
        out += [rng.normal(size=(INTER, H)).astype(np.float32), rng.normal(size=(INTER, H)).astype(np.float32),
                rng.normal(size=(H, INTER)).astype(np.float32) / 4]
    if shared:
        out.append(rng.normal(size=(1, H)).astype(np.float32))
    return out


def expected(x: np.ndarray, ws: list[np.ndarray], top_k: int, scoring: str, norm: bool) -> np.ndarray:
    def sigmoid(v: Any) -> Any:
        return 1 / (1 + np.exp(-v))

    def mlp(t: np.ndarray, g: np.ndarray, u: np.ndarray, d: np.ndarray) -> np.ndarray:
        gate = t @ g.T
        return (gate * sigmoid(gate) * (t @ u.T)) @ d.T

    w = [a.astype(np.float64) for a in ws]
    router = w[0]
    out = np.zeros((len(x), H))
    for n, t in enumerate(x.astype(np.float64)):
        logits = router @ t
        scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum() if scoring == "softmax" \
            else sigmoid(logits)
        chosen = sorted(range(len(scores)), key=lambda e: (-scores[e], e))[:top_k]
        picked = scores[chosen] / (scores[chosen].sum() if norm else 1)
        for e, p in zip(chosen, picked):
            out[n] += p * mlp(t, *w[1 + 3 * e:4 + 3 * e])
        if len(w) % 3 == 2:  # shared expert + gate
            out[n] += sigmoid(w[-1] @ t)[0] * mlp(t, *w[-4:-1])
    return out


@pytest.mark.parametrize("scoring, norm, shared", [("softmax", True, False), ("softmax", False, True),
                                                   ("sigmoid", True, False), ("sigmoid", False, True)])
def test_kernel_matches_the_definition(scoring: str, norm: bool, shared: bool) -> None:
    x = np.random.default_rng(1).normal(size=(1, 9, H)).astype(np.float32)
    ws = weights(E, shared)
    attrs = {"num_experts": E, "top_k": 2, "scoring": scoring, "norm_topk_prob": norm, "act": "silu"}
    (got,) = REFERENCE_OPS["top.MoE"]([x, *ws], attrs)
    assert got.shape == x.shape and got.dtype == np.float32
    np.testing.assert_allclose(got[0], expected(x[0], ws, 2, scoring, norm), rtol=1e-4, atol=1e-4)


def build(experts: int, shared: bool, **attrs: Any) -> None:
    b = Builder(Module())
    with b.function("f", tensor(1, 3, H)) as f:
        ws = [b.weight(f"w{i}", tensor(*a.shape)) for i, a in enumerate(weights(experts, shared))]
        f.returns(b.top.MoE(f.args[0], *ws, **{"num_experts": experts, "top_k": 2, **attrs}))


def test_shape_inference() -> None:
    build(E, False)
    build(E, True, scoring="sigmoid")
    with pytest.raises(InferError, match="num_experts=5 takes 17 or 21 operands, got 14"):
        build(E, False, num_experts=E + 1)
    with pytest.raises(InferError, match="top_k = 5 is out of range"):
        build(E, False, top_k=5)
