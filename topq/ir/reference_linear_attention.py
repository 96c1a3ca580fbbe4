"""Reference kernels of the linear-attention (Gated DeltaNet) ops and their elementwise helpers.

Part of the Top dialect's executable definition (`reference_ops.REFERENCE_OPS` includes `LINEAR_ATTENTION_OPS`).
Layouts follow transformers' `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`:
q, k `[B, L, HK, DK]`, v `[B, L, HV, DV]` (HV a multiple of HK: key head h serves value heads h·G … h·G+G-1),
the log-space decay g and the write strength beta `[B, L, HV]`, the recurrent state `[B, HV, DK, DV]`. One step:

    S ← exp(g_t) · S;   S ← S + k_t ⊗ beta_t (v_t − Sᵀ k_t);   o_t = Sᵀ q_t      (q scaled, q/k optionally L2-normed)

The chunked form computes the same thing with a UT transform per chunk (a chunk size that does not divide L is
padded with tokens whose beta and g are 0, which leave the state unchanged). Both compute in float64 and
return float32: the state is the one quantity of the model that accumulates over the whole context.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from topq.ir.errors import TopqError

__all__ = ["LINEAR_ATTENTION_OPS", "causal_conv1d", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]

#: the epsilon of transformers' (and the FLA library's) l2norm: x · rsqrt(Σx² + eps)
L2NORM_EPS = 1e-6
#: torch.nn.functional.softplus's default threshold: above it softplus(x) is x
SOFTPLUS_THRESHOLD = 20.0


def _prepare(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
             state: np.ndarray | None, qk_l2norm: bool, scale: float, op: str) -> tuple[np.ndarray, ...]:
    """Heads-first float64 operands [B, HV, L, ·], q/k repeated to the value heads, normalised and scaled."""
    q, k, v, g, beta = (np.asarray(a, dtype=np.float64) for a in (q, k, v, g, beta))
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        raise TopqError(f"{op}: want q, k [B, L, HK, DK] and v [B, L, HV, DV]; got {q.shape}, {k.shape}, {v.shape}")
    b, length, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if hv % hk or g.shape != (b, length, hv) or beta.shape != g.shape:
        raise TopqError(f"{op}: {hv} value heads are not a multiple of {hk} key heads, or g {g.shape} / "
                        f"beta {beta.shape} are not [B, L, HV] = {(b, length, hv)}")
    if hv != hk:
        q, k = np.repeat(q, hv // hk, axis=2), np.repeat(k, hv // hk, axis=2)
    if qk_l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + L2NORM_EPS)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + L2NORM_EPS)
    q = q * scale
    if state is None:
        s = np.zeros((b, hv, dk, dv))
    else:
        s = np.array(state, dtype=np.float64)
        if s.shape != (b, hv, dk, dv):
            raise TopqError(f"{op}: state {s.shape} is not [B, HV, DK, DV] = {(b, hv, dk, dv)}")
    heads_first = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    return (*heads_first, g.transpose(0, 2, 1), beta.transpose(0, 2, 1), s)


def recurrent_gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                               state: np.ndarray | None = None, qk_l2norm: bool = True,
                               scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule token by token: (out [B, L, HV, DV], final state [B, HV, DK, DV]), float32."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state, qk_l2norm, scale, "top.GatedDeltaRule")
    out = np.empty_like(v)
    for t in range(v.shape[2]):
        s *= np.exp(g[:, :, t])[..., None, None]
        remembered = np.einsum("bhkv,bhk->bhv", s, k[:, :, t])
        delta = (v[:, :, t] - remembered) * beta[:, :, t, None]
        s += k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = np.einsum("bhkv,bhk->bhv", s, q[:, :, t])
    return out.transpose(0, 2, 1, 3).astype(np.float32), s.astype(np.float32)


def _solve_unit_lower(a: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """x with (I + strictly_lower(a)) x = rhs, by forward substitution over the chunk's rows."""
    x = np.empty_like(rhs)
    for i in range(rhs.shape[-2]):
        x[..., i, :] = rhs[..., i, :] - np.einsum("...j,...jd->...d", a[..., i, :i], x[..., :i, :])
    return x


def chunk_gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                           state: np.ndarray | None = None, qk_l2norm: bool = True, scale: float | None = None,
                           chunk_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule over chunks of `chunk_size` tokens (the prefill form); same results as the recurrence."""
    op = "top.ChunkGatedDeltaRule"
    if chunk_size < 1:
        raise TopqError(f"{op}: chunk_size must be positive, got {chunk_size}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state, qk_l2norm, scale, op)
    b, h, length, dv = v.shape
    c = chunk_size
    pad = -length % c
    if pad:  # beta = g = 0 on the padding: no write, no decay
        q, k, v = (np.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (np.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    n = (length + pad) // c
    q, k, v = (x.reshape(b, h, n, c, -1) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = np.cumsum(g, axis=-1)  # log of the decay from the chunk's start to each position
    later = np.triu(np.ones((c, c), dtype=bool), 1)
    with np.errstate(over="ignore"):  # the masked (later-key) differences may overflow before exp(-inf) = 0
        pair = np.exp(np.where(later, -np.inf, cum[..., :, None] - cum[..., None, :]))
    kk = (k_beta @ k.swapaxes(-1, -2)) * pair
    qk = (q @ k.swapaxes(-1, -2)) * pair
    new_values = _solve_unit_lower(kk, v_beta)
    k_cumdecay = _solve_unit_lower(kk, k_beta * np.exp(cum)[..., None])
    q_decayed = q * np.exp(cum)[..., None]
    k_to_end = k * np.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = np.exp(cum[..., -1])[..., None, None]
    out = np.empty_like(v)
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q_decayed[:, :, i] @ s + qk[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k_to_end[:, :, i].swapaxes(-1, -2) @ v_new
    out = out.reshape(b, h, n * c, dv)[:, :, :length]
    return out.transpose(0, 2, 1, 3).astype(np.float32), s.astype(np.float32)


def causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray | None = None,
                  valid: np.ndarray | None = None, act: str = "silu") -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv over time with a carried window: (y [B, L, C], new state [B, K-1, C]).

    `state` holds the K-1 inputs before x (zeros when None); `valid` [B, L] marks the real tokens, a prefix of
    ones: the new state is the last K-1 inputs up to the last real token, so padding never reaches it.
    """
    op = "top.CausalConv1d"
    x64 = np.asarray(x, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    if x64.ndim != 3 or w.ndim != 3 or w.shape[:2] != (x64.shape[2], 1):
        raise TopqError(f"{op}: want x [B, L, C] and weight [C, 1, K]; got {x64.shape} and {w.shape}")
    b, length, channels = x64.shape
    width = w.shape[2] - 1
    prev = np.zeros((b, width, channels)) if state is None else np.asarray(state, dtype=np.float64)
    if prev.shape != (b, width, channels):
        raise TopqError(f"{op}: state {prev.shape} is not [B, K-1, C] = {(b, width, channels)}")
    window = np.concatenate([prev, x64], axis=1)  # [B, K-1+L, C]
    y = np.zeros((b, length, channels))
    for j in range(width + 1):
        y += window[:, j:j + length] * w[:, 0, j]
    if act == "silu":
        y = y / (1.0 + np.exp(-y))
    elif act != "none":
        raise TopqError(f"{op}: act must be 'silu' or 'none', got {act!r}")
    real = length if valid is None else _valid_count(valid, b, length, op)
    return y.astype(np.float32), window[:, real:real + width].astype(np.float32)


def _valid_count(valid: np.ndarray, batch: int, length: int, op: str) -> int:
    mask = np.asarray(valid) != 0
    if mask.shape != (batch, length):
        raise TopqError(f"{op}: valid {mask.shape} is not [B, L] = {(batch, length)}")
    counts = mask.sum(axis=1)
    if len(set(counts.tolist())) != 1 or any(not row[:n].all() for row, n in zip(mask, counts)):
        raise TopqError(f"{op}: valid must be a prefix of ones, the same in every batch row")
    return int(counts[0])


# ------------------------------------------------------------------------------------------ op kernels


def _arity(op: str, inputs: list[np.ndarray], lo: int, hi: int) -> None:
    if not lo <= len(inputs) <= hi:
        raise TopqError(f"{op}: expected {lo}..{hi} operands, got {len(inputs)}")


def _gated_delta_op(chunked: bool) -> Any:
    op = "top.ChunkGatedDeltaRule" if chunked else "top.GatedDeltaRule"

    def kernel(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
        _arity(op, inputs, 5, 6)
        q, k, v, g, beta = inputs[:5]
        state = inputs[5] if len(inputs) == 6 else None
        qk_l2norm, scale = bool(attrs.get("qk_l2norm", True)), float(attrs["scale"])
        if chunked:
            return list(chunk_gated_delta_rule(q, k, v, g, beta, state, qk_l2norm, scale,
                                               int(attrs.get("chunk_size", 64))))
        return list(recurrent_gated_delta_rule(q, k, v, g, beta, state, qk_l2norm, scale))

    return kernel


def _conv_op(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.CausalConv1d"
    with_state = bool(attrs.get("with_state", True))
    _arity(op, inputs, 3 if with_state else 2, 4 if with_state else 3)
    x, weight, *rest = inputs
    state = rest.pop(0) if with_state else None
    return list(causal_conv1d(x, weight, state, rest[0] if rest else None, str(attrs.get("act", "silu"))))


def sigmoid(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):  # exp(-x) → inf for x ≪ 0 gives the right limit 0
        return np.float32(1) / (np.float32(1) + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + eˣ), and x itself above torch's threshold (as torch.nn.functional.softplus)."""
    x64 = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        return np.where(x64 > SOFTPLUS_THRESHOLD, x64, np.log1p(np.exp(x64))).astype(np.float32)


def _unary(fn: Any, op: str) -> Any:
    def kernel(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
        _arity(op, inputs, 1, 1)
        return [np.asarray(fn(inputs[0]), dtype=np.float32)]

    return kernel


def _exp(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.exp(np.asarray(x, dtype=np.float32))


LINEAR_ATTENTION_OPS = {
    "top.GatedDeltaRule": _gated_delta_op(chunked=False),
    "top.ChunkGatedDeltaRule": _gated_delta_op(chunked=True),
    "top.CausalConv1d": _conv_op,
    "top.Sigmoid": _unary(sigmoid, "top.Sigmoid"),
    "top.Softplus": _unary(softplus, "top.Softplus"),
    "top.Exp": _unary(_exp, "top.Exp"),
}
