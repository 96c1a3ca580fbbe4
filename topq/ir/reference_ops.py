"""Reference semantics of every Top IR op as float32 numpy kernels.

This module is the executable definition of the Top dialect: the host target (the
reference interpreter) runs these kernels and every other target is checked against
them. It deliberately knows nothing about the IR classes: a kernel takes its operand
arrays and its attributes as plain Python values and returns a list of result arrays.

Numerics: activations are float32; reductions accumulate in float32 (numpy's pairwise
summation) or float64 where cancellation matters; index outputs are int32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from topq.ir.errors import TopqError
from topq.ir.products import linear as _linear
from topq.ir.reference_linear_attention import LINEAR_ATTENTION_OPS

Kernel = Callable[[list[np.ndarray], dict[str, Any]], list[np.ndarray]]

__all__ = [
    "Kernel",
    "REFERENCE_OPS",
    "ROPE_MODES",
    "erf",
    "erfc",
    "gelu",
    "mlp_activation",
    "mlp_hidden",
    "moe_expert_tokens",
    "moe_routing",
    "rope_tables",
    "silu",
    "softmax",
]

ROPE_MODES = ("contiguous_halves", "interleaved_pairs")
MLP_ACTS = ("silu", "gelu", "gelu_tanh")

# A softmax row whose largest score is at or below this counts as "every key masked"
# and yields zeros: it covers -inf masks as well as the usual large-negative
# conventions (-1e9, finfo(float32).min), which real q.k scores never reach.
FULLY_MASKED_SCORE = -1e8


# --------------------------------------------------------------------------- helpers


def _f32(x: Any) -> np.ndarray:
    """View (or convert) as float32 without copying float32 input."""
    return np.asarray(x, dtype=np.float32)


def _arity(op: str, inputs: list[np.ndarray], lo: int, hi: int | None = None) -> None:
    hi = lo if hi is None else hi
    if not lo <= len(inputs) <= hi:
        want = str(lo) if lo == hi else f"{lo}..{hi}"
        raise TopqError(f"{op}: expected {want} operands, got {len(inputs)}")


def _opt(inputs: list[np.ndarray], i: int) -> np.ndarray | None:
    """Optional operand i; None when absent (short list or an explicit None)."""
    return inputs[i] if len(inputs) > i and inputs[i] is not None else None


def _attr(op: str, attrs: dict[str, Any], name: str) -> Any:
    if name not in attrs:
        raise TopqError(f"{op}: missing attribute {name!r}")
    return attrs[name]


# --------------------------------------------------------------- scalar functions


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """float32 softmax with max subtraction; a slice that is all -inf gives zeros."""
    x = _f32(x)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, np.float32(0))  # all -inf slice: avoid inf - inf
    e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(s > 0, s, np.float32(1))


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) in float32."""
    x = _f32(x)
    with np.errstate(over="ignore"):  # exp(-x) -> inf for x << 0 gives the right limit -0
        t = np.negative(x)  # x / (1 + exp(-x)) in one buffer: the same operations, no temporaries
        np.exp(t, out=t)
        t += np.float32(1)
        return np.divide(x, t, out=t)


# erf/erfc without scipy: a power series for |z| < _ERF_SPLIT and a continued fraction
# for erfc beyond it, each truncated where the float64 error drops below 1e-12
# (measured against mpmath): far below float32 resolution, and each term is a full
# pass over the array, so more would only cost time.
_ERF_SPLIT = 2.5
_ERF_TERMS = 32
_ERFC_DEPTH = 26
# erf(z) = 2/sqrt(pi) * exp(-z^2) * z * sum_n a_n z^(2n),  a_n = 2^n / (1*3*...*(2n+1));
# all terms are positive, so there is no cancellation.
_ERF_COEFFS = np.cumprod([1.0] + [2.0 / (2 * n + 1) for n in range(1, _ERF_TERMS)])
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _erf_series(z: np.ndarray) -> np.ndarray:
    w = z * z
    s = np.full_like(z, _ERF_COEFFS[-1])
    for c in _ERF_COEFFS[-2::-1]:  # Horner in z^2, in place: this loop dominates GELU
        s *= w
        s += c
    np.negative(w, out=w)
    s *= np.exp(w, out=w)
    s *= z
    s *= _TWO_OVER_SQRT_PI
    return s


def _erfc_cf(z: np.ndarray) -> np.ndarray:
    """erfc(z) for z >= _ERF_SPLIT with full relative precision (Laplace continued fraction):
    erfc(z) = exp(-z^2)/sqrt(pi) / (z + (1/2)/(z + 1/(z + (3/2)/(z + ...))))."""
    f = z.copy()
    for k in range(_ERFC_DEPTH, 0, -1):
        np.divide(0.5 * k, f, out=f)
        f += z
    f *= math.sqrt(math.pi)
    return np.exp(-z * z) / f


def erf(x: np.ndarray) -> np.ndarray:
    """The error function in float64 (absolute error < 1e-12)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    small = np.abs(x) < _ERF_SPLIT
    out[small] = _erf_series(x[small])
    big = ~small
    xb = x[big]
    out[big] = np.sign(xb) * (1.0 - _erfc_cf(np.abs(xb)))
    return out


def erfc(x: np.ndarray) -> np.ndarray:
    """1 - erf(x) in float64, with relative precision kept in the right tail."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    small = np.abs(x) < _ERF_SPLIT
    out[small] = 1.0 - _erf_series(x[small])
    right = x >= _ERF_SPLIT
    out[right] = _erfc_cf(x[right])
    left = x <= -_ERF_SPLIT
    out[left] = 2.0 - _erfc_cf(-x[left])
    return out


def gelu(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """GELU in float32 (computed in float64). "none": x*Phi(x); "tanh": the tanh formula."""
    x64 = np.asarray(x, dtype=np.float64)
    if approximate == "none":
        # 0.5*x*erfc(-x/sqrt2) instead of 0.5*x*(1+erf): no cancellation for x << 0.
        y = 0.5 * x64 * erfc(-x64 / math.sqrt(2.0))
    elif approximate == "tanh":
        # sqrt(2/pi) * (x + 0.044715 x^3), in place (x**3 via np.power is slow)
        t = x64 * x64
        t *= 0.044715
        t += 1.0
        t *= x64
        t *= math.sqrt(2.0 / math.pi)
        np.tanh(t, out=t)
        t += 1.0
        y = 0.5 * x64 * t
    else:
        raise TopqError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
    return y.astype(np.float32)


def mlp_activation(name: str, x: np.ndarray) -> np.ndarray:
    """The activation `top.MLP` applies to the gate projection (its `act` attribute)."""
    if name == "silu":
        return silu(x)
    if name == "gelu":
        return gelu(x, "none")
    if name == "gelu_tanh":
        return gelu(x, "tanh")
    raise TopqError(f"MLP: act must be one of {', '.join(MLP_ACTS)}, got {name!r}")


def mlp_hidden(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray,
               act: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What observers of a `top.MLP` see inside it, on x flattened to [tokens, H]: the gate and up projections
    and the down projection's input act(x W_gᵀ) · (x W_uᵀ) [tokens, I] (the one place taps compute it)."""
    x2 = x.reshape(-1, x.shape[-1])
    gate = _linear(x2, w_gate, True)
    up = _linear(x2, w_up, True)
    return gate, up, mlp_activation(act, gate) * up


def mlp_down(hidden_act: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """`top.MLP`'s down projection of `mlp_hidden`'s act [tokens, I]: the op's result, flattened to [tokens, H]
    (the calibration loop reuses an act it captured and runs only this)."""
    return _linear(hidden_act, _f32(w_down), True)


# --------------------------------------------------------------------------- RoPE


def rope_tables(
    positions: np.ndarray, inv_freq: np.ndarray, mode: str, attention_scaling: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [len(positions), 2*len(inv_freq)] in `mode`'s layout.

    Angles are formed exactly as transformers does (float32 position * float32 inv_freq),
    so they match bit-for-bit; cos/sin of that float32 angle are then evaluated in
    float64 and rounded once, i.e. correctly rounded (torch may differ by 1 ulp).
    """
    pos = np.asarray(positions).reshape(-1).astype(np.float32)
    inv = np.asarray(inv_freq, dtype=np.float32).reshape(-1)
    freqs = pos[:, None] * inv[None, :]  # float32 product, as in HF
    if mode == "contiguous_halves":
        emb = np.concatenate([freqs, freqs], axis=-1)
    elif mode == "interleaved_pairs":
        emb = np.repeat(freqs, 2, axis=-1)
    else:
        raise TopqError(f"rope mode must be one of {', '.join(ROPE_MODES)}, got {mode!r}")
    emb64 = emb.astype(np.float64)
    scale = np.float32(attention_scaling)  # HF multiplies the float32 tables by it
    cos = np.cos(emb64).astype(np.float32) * scale
    sin = np.sin(emb64).astype(np.float32) * scale
    return cos, sin


def _rope(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    _arity("top.Rope", inputs, 3)
    x, cos, sin = (_f32(a) for a in inputs)
    mode = attrs.get("mode", "contiguous_halves")
    if x.ndim != 4:
        raise TopqError(f"top.Rope: x must be [B, L, H, D], got shape {x.shape}")
    r, d = cos.shape[-1], x.shape[-1]
    if sin.shape != cos.shape or r % 2 or r > d:
        raise TopqError(
            f"top.Rope: cos/sin must share a shape [.., L, R] with R even and <= D={d}; "
            f"got {cos.shape} and {sin.shape}"
        )
    # [B, L, R] -> [B, L, 1, R]: the same angles for every head.
    c, s = cos[..., None, :], sin[..., None, :]
    out = np.empty(np.broadcast_shapes(x.shape, c.shape[:-1] + (d,)), dtype=np.float32)
    if mode == "contiguous_halves":
        h = r // 2
        x1, x2 = x[..., :h], x[..., h:r]
        # x*cos + rotate_half(x)*sin with rotate_half = (-x2, x1); a + (-b)*c == a - b*c
        # bit-for-bit, so this matches HF's formula exactly.
        out[..., :h] = x1 * c[..., :h] - x2 * s[..., :h]
        out[..., h:r] = x2 * c[..., h:] + x1 * s[..., h:]
    elif mode == "interleaved_pairs":
        xe, xo = x[..., 0:r:2], x[..., 1:r:2]
        out[..., 0:r:2] = xe * c[..., 0::2] - xo * s[..., 0::2]
        out[..., 1:r:2] = xo * c[..., 1::2] + xe * s[..., 1::2]
    else:
        raise TopqError(f"top.Rope: mode must be one of {', '.join(ROPE_MODES)}, got {mode!r}")
    out[..., r:] = x[..., r:]  # partial rotary: the tail passes through
    return [out]


# ---------------------------------------------------------------------- attention


def soft_cap(scores: np.ndarray, cap: np.float32) -> None:
    """scores ← cap · tanh(scores / cap), in place (Gemma 2's attention and final-logit soft-capping)."""
    scores /= cap
    np.tanh(scores, out=scores)
    scores *= cap


def hide_outside_window(scores: np.ndarray, window: int, first: int = 0) -> None:
    """Sliding window over scores [..., Lb, S] of queries first … first+Lb−1, whose trailing first+Lb keys are the
    new ones (the queries' own tokens, bottom-right aligned; first = 0: the whole square): query i loses new key j
    when i - j ≥ window. History columns are the mask's business."""
    lb, seen = scores.shape[-2:]
    new = min(first + lb, seen)
    i = np.arange(first, first + lb)[:, None]
    j = np.arange(new)[None, :]
    np.copyto(scores[..., seen - new:], np.float32(-np.inf), where=i - j >= window)


#: Causal attention runs in blocks of this many queries, each against only the keys it can see: the masked scores
#: are never computed (at 512 tokens the products and the softmax do 17/32 of the square's work) and a block's
#: scores stay in cache. One SmolLM2 layer's attention at 512 tokens: 29 ms unblocked, 15 ms in blocks of 64.
QUERY_BLOCK = 64


def _fattention(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.FAttention"
    _arity(op, inputs, 3, 4)
    q, k, v = (_f32(a) for a in inputs[:3])
    mask = _opt(inputs, 3)
    hq, hkv = int(_attr(op, attrs, "q_head")), int(_attr(op, attrs, "kv_head"))
    causal = bool(attrs.get("causal", True))
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise TopqError(
            f"{op}: want q [B,Lq,Hq,D], k/v [B,Lk,Hkv,D]; got {q.shape}, {k.shape}, {v.shape}"
        )
    b, lq, _, d = q.shape
    lk = k.shape[1]
    if q.shape[2] != hq or k.shape[2] != hkv or hkv <= 0 or hq % hkv or k.shape[3] != d:
        raise TopqError(
            f"{op}: q_head={hq}, kv_head={hkv} do not fit q {q.shape} and k {k.shape}"
        )
    if mask is not None:
        try:
            mask = np.broadcast_to(_f32(mask), (b, hq, lq, lk))  # a view: each block reads its rows and keys
        except ValueError as e:
            raise TopqError(
                f"{op}: mask {np.shape(mask)} does not broadcast to {(b, hq, lq, lk)}"
            ) from e
    kt = k.transpose(0, 2, 3, 1)  # [B, Hkv, D, Lk]
    vt = v.transpose(0, 2, 1, 3)  # [B, Hkv, Lk, D]
    history = lk - lq  # bottom-right aligned: the first Lk-Lq keys are history every query may see
    block = QUERY_BLOCK if causal else lq
    how = _Attention(np.float32(_attr(op, attrs, "scale")), causal, np.float32(attrs.get("softcap") or 0.0),
                     int(attrs.get("window") or 0), history)
    out = np.empty((b, lq, hq * d), dtype=np.float32)
    for start in range(0, lq, block):
        stop = min(start + block, lq)
        seen = min(lk, max(1, history + stop)) if causal else lk  # the keys queries start..stop-1 may see
        rows = None if mask is None else mask[:, :, start:stop, :seen]
        out[:, start:stop] = _attend(q[:, start:stop], kt[..., :seen], vt[:, :, :seen], rows, start, how)
    return [out]


@dataclass(frozen=True)
class _Attention:
    """A `top.FAttention`'s attributes, read once for all its query blocks; history = Lk − Lq."""

    scale: np.float32
    causal: bool
    softcap: np.float32
    window: int
    history: int


def _attend(q: np.ndarray, kt: np.ndarray, vt: np.ndarray, mask: np.ndarray | None, first: int,
            how: _Attention) -> np.ndarray:
    """Queries first.. (q [B, Lb, Hq, D]) against keys kt [B, Hkv, D, S], values vt [B, Hkv, S, D]: [B, Lb, Hq·D]."""
    b, lb, hq, d = q.shape
    hkv, seen = kt.shape[1], kt.shape[-1]
    g = hq // hkv
    # Query head h = kvh*g + j reads kv head kvh = h // g. Grouping the g query heads of a
    # kv head next to the query axis lets one batched matmul serve the whole group
    # without materialising repeated K/V.
    qg = q.transpose(0, 2, 1, 3).reshape(b, hkv, g * lb, d)  # [B, Hkv, g*Lb, D]
    scores = np.matmul(qg, kt)  # [B, Hkv, g*Lb, S], freshly allocated
    scores *= how.scale
    scores = scores.reshape(b, hq, lb, seen)  # contiguous: a free view
    if how.softcap > 0:
        soft_cap(scores, how.softcap)
    if mask is not None:
        np.add(scores, mask, out=scores)
    if how.causal:  # query first+r sees the keys up to its own, history + first + r
        last = np.arange(first, first + lb)[:, None] + how.history
        np.copyto(scores, np.float32(-np.inf), where=np.arange(seen)[None, :] > last)
    if how.window > 0:
        hide_outside_window(scores, how.window, first)
    m = scores.max(axis=-1, keepdims=True)
    dead = m <= FULLY_MASKED_SCORE
    m[dead] = 0  # exp(score - 0) underflows to 0 for every masked score -> zero row
    scores -= m
    np.exp(scores, out=scores)
    denom = scores.sum(axis=-1, keepdims=True)
    denom[dead] = 1  # dead rows have a zero sum; keep them zero instead of 0/0
    scores /= denom
    out = np.matmul(scores.reshape(b, hkv, g * lb, seen), vt)
    # [B, Hkv, g*Lb, D] -> [B, Hq, Lb, D] -> [B, Lb, Hq*D]
    return out.reshape(b, hq, lb, d).transpose(0, 2, 1, 3).reshape(b, lb, hq * d)


# ----------------------------------------------------------------------- the rest


def _input(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    _arity("top.Input", inputs, 1)
    return [np.asarray(inputs[0])]  # token ids stay integer


def _gather(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.Gather"
    _arity(op, inputs, 2)
    table, idx = np.asarray(inputs[0]), np.asarray(inputs[1])
    axis = int(attrs.get("axis", 0))
    if not np.issubdtype(idx.dtype, np.integer):
        raise TopqError(f"{op}: indices must be integers, got {idx.dtype}")
    n = table.shape[axis]
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise TopqError(f"{op}: index out of range [0, {n}): {idx.min()}..{idx.max()}")
    out = np.take(table, idx, axis=axis)
    return [out if np.issubdtype(out.dtype, np.integer) else _f32(out)]


def _rmsnorm(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.RMSNorm"
    _arity(op, inputs, 1, 2)
    x = _f32(inputs[0])
    w = _opt(inputs, 1)
    eps = np.float32(_attr(op, attrs, "eps"))
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    y = x * (np.float32(1) / np.sqrt(ms + eps))
    return [y * _f32(w) if w is not None else y]


def _layernorm(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.LayerNorm"
    _arity(op, inputs, 1, 3)
    x = _f32(inputs[0])
    w, b = _opt(inputs, 1), _opt(inputs, 2)
    eps = np.float32(_attr(op, attrs, "eps"))
    xc = x - np.mean(x, axis=-1, keepdims=True)
    var = np.mean(np.square(xc), axis=-1, keepdims=True)  # biased, as torch
    y = xc / np.sqrt(var + eps)
    if w is not None:
        y = y * _f32(w)
    if b is not None:
        y = y + _f32(b)
    return [y]


def _matmul(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.MatMul"
    _arity(op, inputs, 2, 3)
    a, b = _f32(inputs[0]), _f32(inputs[1])
    bias = _opt(inputs, 2)
    rt = bool(attrs.get("right_transpose", False))
    k_b = b.shape[-1] if rt else b.shape[-2] if b.ndim >= 2 else -1
    if a.ndim < 1 or b.ndim < 2 or a.shape[-1] != k_b:
        raise TopqError(
            f"{op}: cannot multiply {a.shape} by {b.shape} (right_transpose={rt})"
        )
    if b.ndim == 2:
        y = _linear(a, b, rt)
    else:
        y = np.matmul(a, np.swapaxes(b, -1, -2) if rt else b)
    if bias is not None:
        y = y + _f32(bias)
    return [y]


def _binary(fn: Callable[..., np.ndarray], op: str) -> Kernel:
    def kernel(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
        _arity(op, inputs, 2)
        a, b = _f32(inputs[0]), _f32(inputs[1])
        try:
            return [fn(a, b)]
        except ValueError as e:
            raise TopqError(f"{op}: shapes {a.shape} and {b.shape} do not broadcast") from e

    return kernel


def _mulconst(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    _arity("top.MulConst", inputs, 1)
    return [_f32(inputs[0]) * np.float32(_attr("top.MulConst", attrs, "const_val"))]


def _reshape(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.Reshape"
    _arity(op, inputs, 1)
    x = np.asarray(inputs[0])
    shape = [int(s) for s in _attr(op, attrs, "shape")]
    try:
        return [x.reshape(shape)]
    except ValueError as e:
        raise TopqError(f"{op}: cannot reshape {x.shape} to {shape}") from e


def _permute(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.Permute"
    _arity(op, inputs, 1)
    x = np.asarray(inputs[0])
    order = [int(o) for o in _attr(op, attrs, "order")]
    if sorted(order) != list(range(x.ndim)):
        raise TopqError(f"{op}: order {order} is not a permutation of {x.ndim} axes")
    return [x.transpose(order)]


def _concat(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.Concat"
    if not inputs:
        raise TopqError(f"{op}: needs at least one operand")
    xs = [np.asarray(x) for x in inputs]
    if not all(np.issubdtype(x.dtype, np.integer) for x in xs):
        xs = [_f32(x) for x in xs]
    try:
        return [np.concatenate(xs, axis=int(_attr(op, attrs, "axis")))]
    except (ValueError, np.exceptions.AxisError) as e:
        raise TopqError(f"{op}: {e}") from e


def _slice(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.Slice"
    _arity(op, inputs, 1)
    x = np.asarray(inputs[0])
    offset, ends = _attr(op, attrs, "offset"), _attr(op, attrs, "ends")
    steps = attrs.get("steps", [1] * x.ndim)
    if not len(offset) == len(ends) == len(steps) == x.ndim:
        raise TopqError(f"{op}: offset/ends/steps must each have {x.ndim} entries")
    if any(int(s) == 0 for s in steps):
        raise TopqError(f"{op}: steps must be non-zero, got {steps}")
    key = tuple(slice(int(o), int(e), int(s)) for o, e, s in zip(offset, ends, steps))
    return [x[key]]


def _silu_op(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    _arity("top.SiLU", inputs, 1)
    return [silu(inputs[0])]


def _tanh_op(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    _arity("top.Tanh", inputs, 1)
    return [np.tanh(_f32(inputs[0]))]


def _gelu_op(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    _arity("top.GELU", inputs, 1)
    return [gelu(inputs[0], str(attrs.get("approximate", "none")))]


def _softmax_op(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    _arity("top.Softmax", inputs, 1)
    return [softmax(inputs[0], int(attrs.get("axis", -1)))]


def _mlp(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.MLP"
    _arity(op, inputs, 4)
    x, wg, wu, wd = (_f32(a) for a in inputs)
    hidden, inter = x.shape[-1], wg.shape[0]
    if wg.shape != (inter, hidden) or wu.shape != wg.shape or wd.shape != (hidden, inter):
        raise TopqError(
            f"{op}: want w_gate/w_up [I, {hidden}] and w_down [{hidden}, I]; "
            f"got {wg.shape}, {wu.shape}, {wd.shape}"
        )
    hidden_act = mlp_hidden(x, wg, wu, str(attrs.get("act", "silu")))[2]
    return [mlp_down(hidden_act, wd).reshape(x.shape)]


def moe_routing(x2: np.ndarray, router: np.ndarray, top_k: int, scoring: str = "softmax",
                norm_topk_prob: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """top.MoE's routing of tokens x2 [T, H]: the chosen experts [T, top_k] (int, best first, ties to the lower
    index) and their weights [T, top_k] float32. As transformers' TopKRouter: scores in float32 over all experts
    (softmax, or an elementwise sigmoid), top-k of the scores, then (norm_topk_prob) divided by their sum."""
    logits = _linear(_f32(x2), _f32(router), True)
    if scoring == "softmax":
        scores = softmax(logits, axis=-1)
    elif scoring == "sigmoid":
        scores = np.float32(1) / (np.float32(1) + np.exp(-logits))
    else:
        raise TopqError(f"top.MoE: scoring must be softmax or sigmoid, got {scoring!r}")
    chosen = _smallest_k(-scores, top_k)
    weights = np.take_along_axis(scores, chosen, axis=1)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return chosen, weights.astype(np.float32)


def moe_expert_tokens(chosen: np.ndarray, weights: np.ndarray, expert: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens routed to `expert` (ascending) and their routing weights."""
    tokens, slot = np.nonzero(chosen == expert)
    return tokens, weights[tokens, slot]


def _gated_mlp(x: np.ndarray, wg: np.ndarray, wu: np.ndarray, wd: np.ndarray, act: str) -> np.ndarray:
    hidden = mlp_activation(act, _linear(x, wg, True))
    hidden *= _linear(x, wu, True)
    return _linear(hidden, wd, True)


def _moe(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.MoE"
    experts, top_k = int(_attr(op, attrs, "num_experts")), int(_attr(op, attrs, "top_k"))
    shared = len(inputs) == 2 + 3 * experts + 4
    if len(inputs) != 2 + 3 * experts and not shared:
        raise TopqError(f"{op}: {len(inputs)} operands do not fit num_experts={experts}")
    x = _f32(inputs[0])
    x2 = x.reshape(-1, x.shape[-1])
    act = str(attrs.get("act", "silu"))
    chosen, weights = moe_routing(x2, inputs[1], top_k, str(attrs.get("scoring", "softmax")),
                                  bool(attrs.get("norm_topk_prob", False)))
    out = np.zeros_like(x2)
    # Expert by expert on its own tokens, summed in expert order (transformers' index_add_ order): only the
    # chosen experts' weights are read.
    for e in np.unique(chosen):
        tokens, w = moe_expert_tokens(chosen, weights, int(e))
        wg, wu, wd = (_f32(a) for a in inputs[2 + 3 * e:5 + 3 * e])
        out[tokens] += _gated_mlp(x2[tokens], wg, wu, wd, act) * w[:, None]
    if shared:
        wg, wu, wd, w_gate = (_f32(a) for a in inputs[-4:])
        gate = _linear(x2, w_gate, True)
        out += (np.float32(1) / (np.float32(1) + np.exp(-gate))) * _gated_mlp(x2, wg, wu, wd, act)
    return [out.reshape(x.shape)]


def _topk(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    op = "top.TopK"
    _arity(op, inputs, 1)
    x = _f32(inputs[0])
    k = int(_attr(op, attrs, "k"))
    axis = int(attrs.get("axis", -1))
    largest = bool(attrs.get("largest", True))
    n = x.shape[axis]
    if not 0 < k <= n:
        raise TopqError(f"{op}: k={k} must be in 1..{n}")
    key = np.moveaxis(-x if largest else x, axis, -1)  # ascending key order is the answer
    idx = _smallest_k(key.reshape(-1, n), k).reshape(*key.shape[:-1], k)
    idx = np.moveaxis(idx, -1, axis)
    return [np.take_along_axis(x, idx, axis=axis), idx.astype(np.int32)]


def _smallest_k(key: np.ndarray, k: int) -> np.ndarray:
    """Per row of 2-D `key`: indices of the k smallest, ascending, ties by lower index."""
    n = key.shape[1]
    if k == n:
        return np.argsort(key, axis=1, kind="stable")
    # Fast path (a full sort of a 50k vocabulary per decode step is slow): partition,
    # then order the k survivors by (value, index).
    part = np.argpartition(key, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(key, part, axis=1)
    order = np.lexsort((part, vals), axis=1)
    idx = np.take_along_axis(part, order, axis=1)
    # argpartition picks arbitrary members of a tie at the k-th value; rows where that
    # tie is only partly taken fall back to a stable full sort, which picks lowest indices.
    kth = np.take_along_axis(vals, order[:, -1:], axis=1)
    partial_tie = (key == kth).sum(axis=1) != (vals == kth).sum(axis=1)
    if partial_tie.any():
        idx[partial_tie] = np.argsort(key[partial_tie], axis=1, kind="stable")[:, :k]
    return idx


def _matmul_int8(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    from topq.ir.int8 import matmul_int8

    _arity("top.MatMulInt8", inputs, 3, 4)
    return [matmul_int8(inputs[0], inputs[1], inputs[2], float(attrs.get("act_scale", 0.0)),
                        bool(attrs.get("dynamic", False)), _opt(inputs, 3), float(attrs.get("out_scale", 0.0)))]


def _a8_matmul(inputs: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    from topq.ir.int8 import a8_matmul

    _arity("top.A8MatMul", inputs, 2, 3)
    return [a8_matmul(inputs[0], inputs[1], float(attrs.get("act_scale", 0.0)), bool(attrs.get("dynamic", False)),
                      _opt(inputs, 2), float(attrs.get("out_scale", 0.0)))]


REFERENCE_OPS: dict[str, Kernel] = {
    "top.Input": _input,
    "top.Gather": _gather,
    "top.RMSNorm": _rmsnorm,
    "top.LayerNorm": _layernorm,
    "top.MatMul": _matmul,
    "top.Add": _binary(np.add, "top.Add"),
    "top.Mul": _binary(np.multiply, "top.Mul"),
    "top.MulConst": _mulconst,
    "top.Reshape": _reshape,
    "top.Permute": _permute,
    "top.Concat": _concat,
    "top.Slice": _slice,
    "top.Rope": _rope,
    "top.FAttention": _fattention,
    "top.MLP": _mlp,
    "top.SiLU": _silu_op,
    "top.Tanh": _tanh_op,
    "top.GELU": _gelu_op,
    "top.Softmax": _softmax_op,
    "top.TopK": _topk,
    "top.MoE": _moe,
    "top.MatMulInt8": _matmul_int8,
    "top.A8MatMul": _a8_matmul,
    **LINEAR_ATTENTION_OPS,
}
