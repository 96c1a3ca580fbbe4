"""Gated DeltaNet reference kernels: the chunked and recurrent gated delta rule against a plain per-token,
per-head loop and against transformers' torch implementations; the causal conv with its carried window."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from topq.ir.reference_linear_attention import (
    causal_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    sigmoid,
    softplus,
)

TOL = 1e-5


def random_inputs(length: int, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    f = np.float32
    return dict(q=rng.normal(size=(1, length, hk, dk)).astype(f), k=rng.normal(size=(1, length, hk, dk)).astype(f),
                v=rng.normal(size=(1, length, hv, dv)).astype(f),
                g=-rng.uniform(0.01, 2.0, size=(1, length, hv)).astype(f),
                beta=rng.uniform(0, 1, size=(1, length, hv)).astype(f),
                state=rng.normal(size=(1, hv, dk, dv)).astype(f))


def plain_loop(q, k, v, g, beta, state):
    """The delta rule written out per head and token: S ← aS; S ← S + β k (v − Sᵀk)ᵀ; o = Sᵀq."""
    _, length, hk, dk = q.shape
    hv = v.shape[2]
    out = np.zeros(v.shape)
    final = np.array(state, dtype=np.float64)
    for h in range(hv):
        kh = h // (hv // hk)
        s = final[0, h]
        for t in range(length):
            qt = q[0, t, kh] / np.sqrt(np.sum(q[0, t, kh].astype(np.float64) ** 2) + 1e-6) / np.sqrt(dk)
            kt = k[0, t, kh] / np.sqrt(np.sum(k[0, t, kh].astype(np.float64) ** 2) + 1e-6)
            s = np.exp(float(g[0, t, h])) * s
            s = s + float(beta[0, t, h]) * np.outer(kt, v[0, t, h] - s.T @ kt)
            out[0, t, h] = s.T @ qt
        final[0, h] = s
    return out, final


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (12, 4), (13, 5), (20, 64)])
def test_chunked_and_recurrent_equal_the_plain_loop(length: int, chunk: int) -> None:
    x = random_inputs(length, seed=length)
    ref_out, ref_state = plain_loop(**x)
    rec_out, rec_state = recurrent_gated_delta_rule(**x)
    chunk_out, chunk_state = chunk_gated_delta_rule(**x, chunk_size=chunk)
    for out, state in ((rec_out, rec_state), (chunk_out, chunk_state)):
        assert out.dtype == state.dtype == np.float32
        assert np.abs(out - ref_out).max() <= TOL
        assert np.abs(state - ref_state).max() <= TOL
    assert np.abs(chunk_out - rec_out).max() <= TOL


def test_splitting_the_sequence_hands_the_state_over_exactly() -> None:
    x = random_inputs(11, seed=3)
    whole, whole_state = chunk_gated_delta_rule(**x, chunk_size=4)
    head = {n: a[:, :6] if n != "state" else a for n, a in x.items()}
    tail = {n: a[:, 6:] for n, a in x.items() if n != "state"}
    first, mid = chunk_gated_delta_rule(**head, chunk_size=4)
    second, end = recurrent_gated_delta_rule(**tail, state=mid)
    assert np.abs(np.concatenate([first, second], axis=1) - whole).max() <= TOL
    assert np.abs(end - whole_state).max() <= TOL


def test_tokens_with_zero_beta_and_decay_leave_the_state_alone() -> None:
    """What the families do to padding: g = beta = 0 there, so the state after the prompt ignores it."""
    x = random_inputs(9, seed=4)
    _, real = chunk_gated_delta_rule(**{n: a[:, :5] if n != "state" else a for n, a in x.items()}, chunk_size=4)
    x["g"][:, 5:] = 0
    x["beta"][:, 5:] = 0
    _, padded = chunk_gated_delta_rule(**x, chunk_size=4)
    assert np.abs(padded - real).max() <= 1e-6


@pytest.mark.parametrize("length,chunk", [(10, 4), (3, 64)])
def test_kernels_match_transformers(length: int, chunk: int) -> None:
    x = random_inputs(length, seed=5)
    t = {n: torch.from_numpy(a) for n, a in x.items()}
    common = dict(initial_state=t["state"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_chunk = hf.torch_chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], chunk_size=chunk,
                                                **common)
    ref_rec = hf.torch_recurrent_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], **common)
    for (out, state), (ref_out, ref_state) in (
            (chunk_gated_delta_rule(**x, chunk_size=chunk), ref_chunk), (recurrent_gated_delta_rule(**x), ref_rec)):
        assert np.abs(out - ref_out.numpy()).max() <= TOL
        assert np.abs(state - ref_state.numpy()).max() <= TOL


def test_causal_conv_matches_transformers_and_carries_its_window() -> None:
    rng = np.random.default_rng(6)
    x = rng.normal(size=(1, 9, 5)).astype(np.float32)
    w = rng.normal(size=(5, 1, 4)).astype(np.float32)
    ref = hf.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w[:, 0]), None,
                              activation="silu").transpose(1, 2).numpy()
    y, state = causal_conv1d(x, w)
    assert np.abs(y - ref).max() <= TOL
    np.testing.assert_array_equal(state, x[:, -3:])
    # in two pieces through the state, and with padding after the real tokens of the first piece
    padded = np.concatenate([x[:, :4], rng.normal(size=(1, 3, 5)).astype(np.float32)], axis=1)
    valid = np.array([[1, 1, 1, 1, 0, 0, 0]], np.float32)
    y1, mid = causal_conv1d(padded, w, valid=valid)
    y2, end = causal_conv1d(x[:, 4:], w, mid)
    assert np.abs(np.concatenate([y1[:, :4], y2], axis=1) - ref).max() <= TOL
    np.testing.assert_array_equal(end, state)


def test_elementwise_helpers_match_torch() -> None:
    x = np.linspace(-40, 40, 801, dtype=np.float32)
    t = torch.from_numpy(x)
    assert np.abs(softplus(x) - torch.nn.functional.softplus(t).numpy()).max() <= 1e-5
    assert np.abs(sigmoid(x) - torch.sigmoid(t).numpy()).max() <= 1e-6  # 1 ulp at 1
