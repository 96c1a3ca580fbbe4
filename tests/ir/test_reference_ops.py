"""Each reference kernel against an independently written formula (loops, einsum, torch, HF)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from topq.core.errors import TopqError
from topq.ir.reference_ops import (
    REFERENCE_OPS,
    erf,
    erfc,
    gelu,
    rope_tables,
    silu,
    softmax,
)

RNG = np.random.default_rng(1234)


def run(op: str, inputs: list[Any], **attrs: Any) -> list[np.ndarray]:
    out = REFERENCE_OPS[op](list(inputs), attrs)
    assert isinstance(out, list)
    return out


def run1(op: str, inputs: list[Any], **attrs: Any) -> np.ndarray:
    (y,) = run(op, inputs, **attrs)
    return y


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


# ------------------------------------------------------------------ catalogue


def test_catalogue_covers_design_ops() -> None:
    # top.Weight is resolved by the interpreter from the weight store, not computed.
    expected = {
        "top.Input", "top.Gather", "top.RMSNorm", "top.LayerNorm", "top.MatMul", "top.Add",
        "top.Mul", "top.MulConst", "top.Reshape", "top.Permute", "top.Concat", "top.Slice",
        "top.Rope", "top.FAttention", "top.MLP", "top.SiLU", "top.GELU", "top.Softmax",
        "top.TopK",
    }  # fmt: skip
    assert expected <= set(REFERENCE_OPS)
    # Every Top op the catalogue declares has a reference kernel, except the ones the interpreter resolves
    # itself (weights) or that carry their own body (raw-kernel regions).
    from topq.ir.catalogue import CATALOGUE

    declared = {name for name in CATALOGUE if name.startswith("top.")} - {"top.Weight", "top.DSLRegion"}
    assert declared <= set(REFERENCE_OPS)


def test_input_is_identity_and_keeps_int_ids() -> None:
    ids = np.array([[3, 1, 4]], dtype=np.int32)
    y = run1("top.Input", [ids])
    assert y.dtype == np.int32 and np.array_equal(y, ids)


def test_wrong_operand_count_is_a_topq_error() -> None:
    with pytest.raises(TopqError, match="operands"):
        run("top.Add", [randn(2)])
    with pytest.raises(TopqError, match="eps"):
        run("top.RMSNorm", [randn(2, 4)])


# --------------------------------------------------------------------- gather


@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
def test_gather_rows(idx_dtype: type) -> None:
    table = randn(10, 6)
    idx = np.array([[0, 9, 3], [3, 3, 1]], dtype=idx_dtype)
    y = run1("top.Gather", [table, idx])
    assert y.shape == (2, 3, 6) and y.dtype == np.float32
    for a in range(2):
        for b in range(3):
            assert np.array_equal(y[a, b], table[int(idx[a, b])])


def test_gather_axis1() -> None:
    table = randn(4, 7)
    idx = np.array([6, 0, 2], dtype=np.int32)
    y = run1("top.Gather", [table, idx], axis=1)
    want = np.stack([table[:, i] for i in idx], axis=1)
    assert np.array_equal(y, want)


def test_gather_rejects_bad_indices() -> None:
    with pytest.raises(TopqError, match="out of range"):
        run("top.Gather", [randn(5, 2), np.array([5], dtype=np.int32)])
    with pytest.raises(TopqError, match="out of range"):
        run("top.Gather", [randn(5, 2), np.array([-1], dtype=np.int32)])
    with pytest.raises(TopqError, match="integers"):
        run("top.Gather", [randn(5, 2), np.array([1.0])])


# ---------------------------------------------------------------------- norms


@pytest.mark.parametrize("with_weight", [True, False])
def test_rmsnorm_vs_torch(with_weight: bool) -> None:
    x, w = randn(2, 5, 64) * 3, randn(64)
    y = run1("top.RMSNorm", [x, w] if with_weight else [x], eps=1e-5)
    want = F.rms_norm(t(x).double(), (64,), t(w).double() if with_weight else None, eps=1e-5)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, want.numpy(), rtol=2e-6, atol=2e-6)


def test_rmsnorm_eps_matters() -> None:
    x = np.full((1, 4), 1e-3, dtype=np.float32)
    y = run1("top.RMSNorm", [x], eps=1e-6)
    np.testing.assert_allclose(y, 1e-3 / math.sqrt(1e-6 + 1e-6), rtol=1e-5)


@pytest.mark.parametrize("n_params", [0, 1, 2])
def test_layernorm_vs_torch(n_params: int) -> None:
    x, w, b = randn(3, 4, 32) * 2 + 1, randn(32), randn(32)
    params = [w, b][:n_params]
    y = run1("top.LayerNorm", [x, *params], eps=1e-5)
    tw = t(w).double() if n_params >= 1 else None
    tb = t(b).double() if n_params >= 2 else None
    want = F.layer_norm(t(x).double(), (32,), tw, tb, eps=1e-5)
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-5, atol=1e-5)


def test_layernorm_bias_without_weight_via_none() -> None:
    x, b = randn(2, 8), randn(8)
    y = run1("top.LayerNorm", [x, None, b], eps=1e-5)
    want = F.layer_norm(t(x), (8,), None, t(b), eps=1e-5)
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------- matmul


def test_matmul_2d_weight_with_bias() -> None:
    a, b, bias = randn(2, 3, 8), randn(8, 5), randn(5)
    y = run1("top.MatMul", [a, b, bias])
    want = np.einsum("blk,kn->bln", a.astype(np.float64), b.astype(np.float64)) + bias
    assert y.shape == (2, 3, 5) and y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_matmul_right_transpose_hf_layout() -> None:
    a, w = randn(1, 4, 16), randn(7, 16)  # [out, in] like nn.Linear
    y = run1("top.MatMul", [a, w], right_transpose=True)
    np.testing.assert_allclose(y, F.linear(t(a), t(w)).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rt", [False, True])
def test_matmul_batched_equal_rank(rt: bool) -> None:
    a = randn(2, 3, 4, 6)
    b = randn(2, 3, 5, 6) if rt else randn(2, 3, 6, 5)
    y = run1("top.MatMul", [a, b], right_transpose=rt)
    want = np.zeros((2, 3, 4, 5))
    for i in range(2):
        for j in range(3):
            bm = b[i, j].T if rt else b[i, j]
            for r in range(4):
                for c in range(5):
                    want[i, j, r, c] = sum(float(a[i, j, r, k]) * float(bm[k, c]) for k in range(6))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_matmul_shape_mismatch() -> None:
    with pytest.raises(TopqError, match="cannot multiply"):
        run("top.MatMul", [randn(2, 8), randn(8, 5)], right_transpose=True)


# -------------------------------------------------------------- elementwise


def test_add_mul_broadcast_vs_loop() -> None:
    a, b = randn(2, 3, 4), randn(3, 1)
    s, p = run1("top.Add", [a, b]), run1("top.Mul", [a, b])
    for i in range(2):
        for j in range(3):
            for k in range(4):
                assert s[i, j, k] == np.float32(a[i, j, k] + b[j, 0])
                assert p[i, j, k] == np.float32(a[i, j, k] * b[j, 0])
    with pytest.raises(TopqError, match="broadcast"):
        run("top.Add", [randn(3), randn(4)])


def test_mulconst() -> None:
    x = randn(3, 3)
    y = run1("top.MulConst", [x], const_val=0.125)
    assert y.dtype == np.float32 and np.array_equal(y, x / 8)


@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=40))
@settings(max_examples=50, deadline=None)
def test_silu_matches_torch(vals: list[float]) -> None:
    x = np.array(vals, dtype=np.float32)
    np.testing.assert_allclose(silu(x), F.silu(t(x).double()).numpy(), rtol=1e-6, atol=1e-7)


def test_silu_extremes() -> None:
    x = np.array([-1e4, -100.0, 0.0, 100.0, 3e38], dtype=np.float32)
    y = run1("top.SiLU", [x])
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, F.silu(t(x)).numpy(), rtol=1e-6, atol=1e-30)


# ------------------------------------------------------------------ erf/GELU


def test_erf_erfc_vs_math() -> None:
    x = np.concatenate([np.linspace(-8, 8, 4001), [0.0, 1e-12, -1e-300, 2.5, -2.5, 30.0]])
    want_erf = np.array([math.erf(v) for v in x])
    want_erfc = np.array([math.erfc(v) for v in x])
    assert np.max(np.abs(erf(x) - want_erf)) < 1e-12
    # relative precision in the right tail, where GELU(-x) needs it
    np.testing.assert_allclose(erfc(x), want_erfc, rtol=1e-9, atol=1e-300)
    assert erf(np.float64(0.5)).shape == ()


@pytest.mark.parametrize("approx", ["none", "tanh"])
def test_gelu_vs_torch(approx: str) -> None:
    x = np.concatenate(
        [np.linspace(-12, 12, 20001, dtype=np.float32), randn(2000) * 50, [0.0, -0.0, 1e30]]
    ).astype(np.float32)
    y = run1("top.GELU", [x], approximate=approx)
    want = F.gelu(t(x).double(), approximate=approx).numpy()
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    # the negative tail keeps relative precision (no 1 + erf cancellation)
    if approx == "none":
        # (torch itself cancels there, so use math.erfc as the reference)
        tail = x[x < -4].astype(np.float64)
        exact = np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in tail])
        np.testing.assert_allclose(y[x < -4], exact, rtol=1e-6, atol=1e-44)


def test_gelu_bad_mode() -> None:
    with pytest.raises(TopqError, match="approximate"):
        gelu(np.ones(2, np.float32), "fast")


# -------------------------------------------------------------------- softmax


def test_softmax_vs_torch_and_axis() -> None:
    x = randn(3, 5, 7) * 20
    np.testing.assert_allclose(
        run1("top.Softmax", [x]), torch.softmax(t(x).double(), -1).numpy(), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(
        run1("top.Softmax", [x], axis=0), torch.softmax(t(x).double(), 0).numpy(), atol=1e-6
    )


def test_softmax_masked_rows() -> None:
    x = np.array([[1000.0, -np.inf, 1000.0], [-np.inf] * 3], dtype=np.float32)
    y = softmax(x, -1)
    assert np.array_equal(y, np.array([[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]], np.float32))


# ---------------------------------------------------------------------- topk


def test_topk_vs_sort_with_ties() -> None:
    x = np.array([[3.0, 1.0, 3.0, 2.0, 3.0, -1.0], [0.0, 0.0, 0.0, 5.0, 0.0, 0.0]], np.float32)
    for largest in (True, False):
        vals, idx = run("top.TopK", [x], k=4, largest=largest)
        assert idx.dtype == np.int32 and vals.dtype == np.float32
        for r in range(2):
            sign = -1 if largest else 1
            ref = sorted(range(6), key=lambda i: (sign * x[r, i], i))[:4]
            assert idx[r].tolist() == ref
            assert vals[r].tolist() == [x[r, i] for i in ref]


@pytest.mark.parametrize("k", [1, 7, 499, 500])
def test_topk_large_rows_vs_python_sort(k: int) -> None:
    # integer-valued rows tie across the k-th place (the partition fast path must not pick
    # an arbitrary member of the tie); continuous rows with planted ties inside the top-k
    ints = RNG.integers(0, 20, size=(3, 500)).astype(np.float32)
    cont = randn(2, 500)
    cont[:, [10, 20, 30]] = 100.0
    x = np.concatenate([ints, cont])
    for largest in (True, False):
        vals, idx = run("top.TopK", [x], k=k, largest=largest)
        sign = -1 if largest else 1
        for r in range(len(x)):
            ref = sorted(range(500), key=lambda i: (sign * float(x[r, i]), i))[:k]
            assert idx[r].tolist() == ref


def test_topk_random_axis0() -> None:
    x = randn(50, 3)
    vals, idx = run("top.TopK", [x], k=5, axis=0)
    assert vals.shape == idx.shape == (5, 3)
    for c in range(3):
        ref = np.argsort(-x[:, c].astype(np.float64))[:5]  # no ties in random data
        assert idx[:, c].tolist() == ref.tolist()
        assert np.array_equal(vals[:, c], x[ref, c])
    with pytest.raises(TopqError, match="k="):
        run("top.TopK", [x], k=51, axis=0)


# --------------------------------------------------------------- shape ops


def test_reshape_permute_concat_slice() -> None:
    x = randn(2, 3, 4)
    r = run1("top.Reshape", [x], shape=[2, -1, 2])
    assert r.shape == (2, 6, 2) and np.array_equal(r.ravel(), x.ravel())
    with pytest.raises(TopqError, match="reshape"):
        run("top.Reshape", [x], shape=[5, -1])

    p = run1("top.Permute", [x], order=[2, 0, 1])
    assert np.array_equal(p, t(x).permute(2, 0, 1).numpy())
    with pytest.raises(TopqError, match="permutation"):
        run("top.Permute", [x], order=[0, 0, 1])

    y = randn(2, 5, 4)
    c = run1("top.Concat", [x, y, x], axis=1)
    assert np.array_equal(c, torch.cat([t(x), t(y), t(x)], 1).numpy())

    s = run1("top.Slice", [x], offset=[1, 0, 3], ends=[2, 3, 0], steps=[1, 2, -2])
    want = np.array([[[x[1, j, k] for k in (3, 1)] for j in (0, 2)]])
    assert np.array_equal(s, want)
    with pytest.raises(TopqError, match="entries"):
        run("top.Slice", [x], offset=[0], ends=[1], steps=[1])


# ------------------------------------------------------------------------ RoPE


def _hf_rotary(head_dim: int, rope_parameters: dict[str, Any]):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters=rope_parameters,
    )
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "default", "rope_theta": 500000.0},
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ],
)
def test_rope_tables_match_hf(params: dict[str, Any]) -> None:
    rot = _hf_rotary(16, params)
    positions = np.array([0, 1, 2, 7, 100, 511, 1023, 4095, 40000])
    hf_cos, hf_sin = rot(torch.zeros(1), t(positions)[None])
    cos, sin = rope_tables(
        positions, rot.inv_freq.numpy(), "contiguous_halves", rot.attention_scaling
    )
    assert cos.shape == (len(positions), 16) and cos.dtype == np.float32
    np.testing.assert_allclose(cos, hf_cos[0].numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(sin, hf_sin[0].numpy(), rtol=0, atol=1e-6)


def test_rope_tables_interleaved_layout() -> None:
    inv = np.array([1.0, 0.1, 0.01], np.float32)
    pos = np.arange(5)
    cos, sin = rope_tables(pos, inv, "interleaved_pairs", attention_scaling=2.0)
    for p in pos:
        for i in range(3):
            ang = float(np.float32(p) * inv[i])
            for col in (2 * i, 2 * i + 1):
                assert abs(cos[p, col] - 2 * math.cos(ang)) < 1e-6
                assert abs(sin[p, col] - 2 * math.sin(ang)) < 1e-6
    with pytest.raises(TopqError, match="mode"):
        rope_tables(pos, inv, "halves")


def test_rope_contiguous_halves_matches_hf() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rot = _hf_rotary(16, {"rope_type": "default", "rope_theta": 10000.0})
    b, seq, hq, hk, d = 2, 6, 4, 2, 16
    q, k = randn(b, seq, hq, d), randn(b, seq, hk, d)
    pos = np.stack([np.arange(seq), np.arange(seq) + 30])  # per-batch positions
    hf_cos, hf_sin = rot(torch.zeros(1), t(pos))
    q_hf, k_hf = apply_rotary_pos_emb(t(q), t(k), hf_cos, hf_sin, unsqueeze_dim=2)
    cos, sin = hf_cos.numpy(), hf_sin.numpy()
    q_ref = run1("top.Rope", [q, cos, sin], mode="contiguous_halves")
    k_ref = run1("top.Rope", [k, cos, sin], mode="contiguous_halves")
    # same float32 tables and the same float32 ops (a - b*s == a + (-b)*s): bit-exact
    np.testing.assert_array_equal(q_ref, q_hf.numpy())
    np.testing.assert_array_equal(k_ref, k_hf.numpy())


def test_rope_partial_rotary_matches_hf() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rot = _hf_rotary(8, {"rope_type": "default", "rope_theta": 10000.0})  # R = 8
    x = randn(1, 5, 3, 20)  # D = 20: dims 8..20 pass through (Phi/NeoX style)
    hf_cos, hf_sin = rot(torch.zeros(1), torch.arange(5)[None])
    x_rot, _ = apply_rotary_pos_emb(t(x[..., :8]), t(x[..., :8]), hf_cos, hf_sin, unsqueeze_dim=2)
    want = np.concatenate([x_rot.numpy(), x[..., 8:]], axis=-1)
    y = run1("top.Rope", [x, hf_cos.numpy(), hf_sin.numpy()], mode="contiguous_halves")
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-6)
    assert np.array_equal(y[..., 8:], x[..., 8:])


def test_rope_interleaved_pairs_vs_loop() -> None:
    b, seq, h, d, r = 1, 4, 2, 10, 6
    x = randn(b, seq, h, d)
    inv = (1.0 / 10000 ** (np.arange(0, r, 2) / r)).astype(np.float32)
    cos, sin = rope_tables(np.arange(seq) + 3, inv, "interleaved_pairs")
    y = run1("top.Rope", [x, cos[None], sin[None]], mode="interleaved_pairs")
    want = x.astype(np.float64).copy()
    for li in range(seq):
        theta = [float(np.float32(li + 3) * inv[i]) for i in range(r // 2)]
        for hh in range(h):
            for i in range(r // 2):
                a, bb = float(x[0, li, hh, 2 * i]), float(x[0, li, hh, 2 * i + 1])
                c, s = math.cos(theta[i]), math.sin(theta[i])
                want[0, li, hh, 2 * i] = a * c - bb * s
                want[0, li, hh, 2 * i + 1] = bb * c + a * s
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-6)


def test_rope_rejects_bad_tables() -> None:
    x = randn(1, 2, 1, 4)
    with pytest.raises(TopqError, match="R even"):
        run("top.Rope", [x, randn(1, 2, 6), randn(1, 2, 6)], mode="contiguous_halves")
    with pytest.raises(TopqError, match="mode"):
        run("top.Rope", [x, randn(1, 2, 4), randn(1, 2, 4)], mode="neox")


# ------------------------------------------------------------------ attention


def naive_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    causal: bool,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """Per batch, per head, per query loop in float64."""
    b, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    full_mask = None if mask is None else np.broadcast_to(mask, (b, hq, lq, lk))
    out = np.zeros((b, lq, hq, d))
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(lq):
                scores, vals = [], []
                for j in range(lk):
                    if causal and j > i + (lk - lq):
                        continue
                    s = scale * float(np.dot(q[bi, i, h].astype(np.float64), k[bi, j, kh]))
                    if full_mask is not None:
                        if full_mask[bi, h, i, j] <= -1e30:  # -inf or finfo.min: masked
                            continue
                        s += float(full_mask[bi, h, i, j])
                    scores.append(s)
                    vals.append(v[bi, j, kh].astype(np.float64))
                if not scores:
                    continue  # every key masked: zeros
                w = np.exp(np.array(scores) - max(scores))
                out[bi, i, h] = (w[:, None] * np.array(vals)).sum(0) / w.sum()
    return out.reshape(b, lq, hq * d)


def attention(q, k, v, mask=None, **attrs):  # type: ignore[no-untyped-def]
    inputs = [q, k, v] + ([mask] if mask is not None else [])
    y = run1("top.FAttention", inputs, q_head=q.shape[2], kv_head=k.shape[2], **attrs)
    assert y.dtype == np.float32 and y.shape == (q.shape[0], q.shape[1], q.shape[2] * q.shape[3])
    return y


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (3, 1)])
def test_fattention_causal_gqa(hq: int, hkv: int) -> None:
    q, k, v = randn(2, 7, hq, 8), randn(2, 7, hkv, 8), randn(2, 7, hkv, 8)
    y = attention(q, k, v, scale=0.35, causal=True)
    np.testing.assert_allclose(y, naive_attention(q, k, v, 0.35, True), rtol=1e-5, atol=1e-5)


def test_fattention_history_offset() -> None:
    q, k, v = randn(1, 3, 4, 8), randn(1, 10, 2, 8), randn(1, 10, 2, 8)
    y = attention(q, k, v, scale=1 / math.sqrt(8), causal=True)
    want = naive_attention(q, k, v, 1 / math.sqrt(8), True)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    # the first query sees keys 0..7 only: changing key 8 must not move it
    k2 = k.copy()
    k2[0, 8] += 10
    y2 = attention(q, k2, v, scale=1 / math.sqrt(8), causal=True)
    assert np.array_equal(y2[:, 0], y[:, 0]) and not np.allclose(y2[:, 1], y[:, 1])


@pytest.mark.parametrize("neg", [-np.inf, np.finfo(np.float32).min])
def test_fattention_decode_with_cache_mask(neg: float) -> None:
    lk, valid = 12, 5  # a KV cache of 12 slots, 5 filled
    q, k, v = randn(1, 1, 6, 16), randn(1, lk, 3, 16), randn(1, lk, 3, 16)
    k[:, valid:] = 1e3  # garbage in unused slots must not leak
    mask = np.zeros((1, 1, 1, lk), np.float32)
    mask[..., valid:] = neg
    y = attention(q, k, v, mask, scale=0.25, causal=True)
    want = naive_attention(q[:, :, :, :], k[:, :valid], v[:, :valid], 0.25, False)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, naive_attention(q, k, v, 0.25, True, mask), rtol=1e-5, atol=1e-5)


def test_fattention_additive_mask_values_count() -> None:
    q, k, v = randn(1, 4, 2, 8), randn(1, 4, 2, 8), randn(1, 4, 2, 8)
    mask = randn(1, 2, 4, 4)  # finite bias, per head
    y = attention(q, k, v, mask, scale=0.5, causal=False)
    np.testing.assert_allclose(y, naive_attention(q, k, v, 0.5, False, mask), rtol=1e-5, atol=1e-5)
    assert not np.allclose(y, attention(q, k, v, scale=0.5, causal=False), atol=1e-3)


@pytest.mark.parametrize("neg", [-np.inf, np.finfo(np.float32).min, -1e9])
def test_fattention_fully_masked_row_is_zero(neg: float) -> None:
    q, k, v = randn(1, 3, 2, 4), randn(1, 3, 1, 4), randn(1, 3, 1, 4)
    mask = np.zeros((1, 1, 3, 3), np.float32)
    mask[0, 0, 1, :] = neg  # query 1 sees nothing
    y = attention(q, k, v, mask, scale=0.5, causal=True)
    assert np.all(np.isfinite(y))
    assert np.array_equal(y[0, 1], np.zeros(8, np.float32))
    keep = [0, 2]
    ref = naive_attention(q, k, v, 0.5, True)
    np.testing.assert_allclose(y[0, keep], ref[0, keep], rtol=1e-5, atol=1e-5)


def test_fattention_more_queries_than_keys_masks_leading_rows() -> None:
    q, k, v = randn(1, 4, 1, 4), randn(1, 2, 1, 4), randn(1, 2, 1, 4)
    y = attention(q, k, v, scale=1.0, causal=True)
    np.testing.assert_allclose(y, naive_attention(q, k, v, 1.0, True), rtol=1e-5, atol=1e-5)
    assert np.array_equal(y[0, :2], np.zeros((2, 4), np.float32))


def test_fattention_matches_torch_sdpa_large_scores() -> None:
    q, k, v = randn(1, 9, 4, 16) * 8, randn(1, 9, 2, 16) * 8, randn(1, 9, 2, 16)
    y = attention(q, k, v, scale=0.25, causal=True)
    want = F.scaled_dot_product_attention(
        t(q).transpose(1, 2).double(),
        t(k).transpose(1, 2).double(),
        t(v).transpose(1, 2).double(),
        is_causal=True,
        scale=0.25,
        enable_gqa=True,
    )
    np.testing.assert_allclose(y, want.transpose(1, 2).reshape(1, 9, 64).numpy(), atol=2e-5)


@pytest.mark.parametrize("window", [0, 50])
def test_fattention_query_blocks_match_torch_sdpa(window: int) -> None:
    """Causal attention runs in blocks of QUERY_BLOCK queries, each against the keys it can see: across block edges
    (150 queries: blocks of 64, 64, 22), with history keys (some masked off), GQA and a sliding window, it is
    torch's float64 attention with the explicit mask."""
    from topq.ir.reference_ops import QUERY_BLOCK

    lq, history, hq, hkv, d = 150, 40, 4, 2, 16
    assert lq > 2 * QUERY_BLOCK
    q, k, v = randn(1, lq, hq, d), randn(1, history + lq, hkv, d), randn(1, history + lq, hkv, d)
    mask = np.zeros((1, 1, 1, history + lq), np.float32)
    mask[..., :7] = -1e9  # history the caller hides
    y = attention(q, k, v, mask, scale=0.25, causal=True, window=window)
    i = np.arange(lq)[:, None] + history  # each query's own key
    j = np.arange(history + lq)[None, :]
    allowed = (j <= i) & (mask[0, 0] == 0)
    if window:
        allowed &= (j < history) | (i - j < window)
    want = F.scaled_dot_product_attention(
        t(q).transpose(1, 2).double(),
        t(k).transpose(1, 2).double(),
        t(v).transpose(1, 2).double(),
        attn_mask=t(allowed),
        scale=0.25,
        enable_gqa=True,
    )
    np.testing.assert_allclose(y, want.transpose(1, 2).reshape(1, lq, hq * d).numpy(), atol=2e-5)


def test_fattention_bad_heads() -> None:
    q, k = randn(1, 2, 4, 8), randn(1, 2, 3, 8)
    with pytest.raises(TopqError, match="q_head"):
        run("top.FAttention", [q, k, k], q_head=4, kv_head=3, scale=1.0)
    with pytest.raises(TopqError, match="mask"):
        run("top.FAttention", [q, q, q, randn(2, 1, 1, 2)], q_head=4, kv_head=4, scale=1.0)


# ------------------------------------------------------------------------ MLP


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_mlp_vs_torch(act: str) -> None:
    hidden, inter = 16, 40
    x = randn(2, 3, hidden)
    wg, wu, wd = randn(inter, hidden) * 0.3, randn(inter, hidden) * 0.3, randn(hidden, inter) * 0.3
    y = run1("top.MLP", [x, wg, wu, wd], act=act)
    tx = t(x).double()
    g = F.linear(tx, t(wg).double())
    a = {"silu": F.silu(g), "gelu": F.gelu(g), "gelu_tanh": F.gelu(g, approximate="tanh")}[act]
    want = F.linear(a * F.linear(tx, t(wu).double()), t(wd).double())
    assert y.shape == (2, 3, hidden) and y.dtype == np.float32
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-4, atol=1e-4)


def test_mlp_errors() -> None:
    x, w = randn(1, 4), randn(6, 4)
    with pytest.raises(TopqError, match="act"):
        run("top.MLP", [x, w, w, w.T.copy()], act="relu")
    with pytest.raises(TopqError, match="w_down"):
        run("top.MLP", [x, w, w, w], act="silu")
