"""The chip's numerics for tpu ops, as numpy kernels on float32 arrays holding dtype values.

The emulator reads operands from DDR (bf16/f16 → f32 is exact), calls a kernel, and rounds each result to its
storage dtype when it writes it (DDR or local memory): that is the op-boundary rounding. Inside a kernel:

* norms, softmax, SiLU/GELU and RoPE compute in f32 — they are Top's reference kernels, run on dtype values;
* matmuls multiply dtype values and accumulate in f32 (a product of two bf16 is exact in f32, so an f32 GEMM on
  the rounded operands is the chip's arithmetic up to summation order);
* fused ops round where the chip's fused kernels store to local memory in dtype: the MLP's gate, up, act and
  act*up; the attention's probabilities before the PV matmul.

Weights arrive pre-decoded: `[N, K]` float32 arrays (dequantized W4/W8 weights are already rounded to dtype).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from topq.core.errors import TopqError
from topq.ir.reference_ops import FULLY_MASKED_SCORE, REFERENCE_OPS, gelu, hide_outside_window, silu, soft_cap
from topq.plugins.targets.bm1684x.modes import NP_DTYPES

F32 = np.float32


def rnd(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values after a store in `dtype` (a copy; f32 stays f32)."""
    if dtype == "f32":
        return np.array(x, dtype=F32)
    return np.asarray(x, dtype=F32).astype(NP_DTYPES[dtype]).astype(F32)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x[..., K] @ wᵀ for w [N, K] in float32 (one GEMV for a single row: faster than a 1-row GEMM here)."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    y = np.dot(w, x2[0])[None] if x2.shape[0] == 1 else np.dot(x2, w.T)
    return y.reshape(*lead, w.shape[0])


def matmul(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    """tpu.MatMul / tpu.A16MatMul with a decoded weight [N, K] (+ bias)."""
    y = linear(args[0], args[1])
    if len(args) > 2:
        y += args[2]
    return [y]


def matmul_int8(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    """tpu.MatMulInt8: x (dtype values) → int8 with the static scale or per-row absmax/127 (std::round, clamp ±127),
    int8 × int8 summed exactly (the chip's int32 accumulator; float64 is exact here), then int32 → f32 times the
    f32 per-channel requant scale f32(scale_x) · w_scale[n] (one f32 multiply each, as the chip's dequant step).

    Static with out_scale > 0 (args x, codes, multiplier i32, rshift i8[, bias_q i32]): the accumulator plus bias_q
    is requantized in int64 — clamp(RightShiftRound(acc · M[n], s[n], half up), -128, 127) — and the int8 code
    converted to f32 times f32(out_scale) (`int8_math.requant_linear`, shared with the host kernel)."""
    from topq.ir.int8 import (
        int8_matmul,
        quantize_act,
        requant_linear,
        token_scales,
        uses_requant,
    )

    x, codes = args[0], args[1]
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if uses_requant(bool(attrs.get("dynamic")), attrs.get("out_scale", 0.0)):
        qx = quantize_act(x2, F32(attrs["act_scale"]))
        bias_q = args[4] if len(args) > 4 else None
        y = requant_linear(qx, codes, args[2], args[3], bias_q, attrs["out_scale"])
        return [y.reshape(*lead, codes.shape[0])]
    w_scale = args[2]
    sx = token_scales(x2) if attrs.get("dynamic") else np.full((x2.shape[0], 1), attrs["act_scale"], F32)
    acc = int8_matmul(quantize_act(x2, sx), codes)
    requant = sx * w_scale.astype(F32)[None, :]  # f32 product
    y = acc.astype(F32) * requant  # int32 → f32 convert, then one f32 multiply
    if len(args) > 3:
        y += args[3]
    return [y.reshape(*lead, codes.shape[0])]


def activation(name: str, x: np.ndarray) -> np.ndarray:
    if name == "silu":
        return silu(x)
    return gelu(x, "tanh" if name == "gelu_tanh" else "none")


def mlp(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Fused gated MLP: args x, [gate; up] stacked [2I, H], down [H, I]."""
    x, gate_up, down = args
    dtype = attrs["dtype"]
    inter = down.shape[1]
    gu = linear(x, gate_up)
    gate, up = rnd(gu[..., :inter], dtype), rnd(gu[..., inter:], dtype)
    h = rnd(activation(attrs.get("act", "silu"), gate), dtype)
    h *= up
    return [linear(rnd(h, dtype), down)]


def moe(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    """top.MoE: args x, router [E, H], ([gate; up] [2I, H], down [H, I]) per expert, then the shared expert's pair
    and its gate [1, H] when `shared`. Routing in f32 on the stored x; each chosen expert runs the fused MLP
    kernel on its own tokens (only those experts' weights are read); the weighted sum accumulates in f32."""
    from topq.ir.reference_ops import moe_expert_tokens, moe_routing

    x, router = args[0], args[1]
    experts, shared = int(attrs["num_experts"]), bool(attrs.get("shared", False))
    x2 = x.reshape(-1, x.shape[-1])
    chosen, weights = moe_routing(x2, router, int(attrs["top_k"]), str(attrs.get("scoring", "softmax")),
                                  bool(attrs.get("norm_topk_prob", False)))
    x2 = rnd(x2, attrs["dtype"])  # routing read x as given (f32 from the norm); the experts' MACs take dtype
    out = np.zeros(x2.shape, dtype=F32)
    for e in np.unique(chosen):
        tokens, w = moe_expert_tokens(chosen, weights, int(e))
        gate_up, down = args[2 + 2 * int(e)], args[3 + 2 * int(e)]
        out[tokens] += mlp([x2[tokens], gate_up, down], attrs)[0] * w[:, None]
    if shared:
        gate_up, down, gate = args[2 + 2 * experts:5 + 2 * experts]
        out += (F32(1) / (F32(1) + np.exp(-linear(x2, gate)))) * mlp([x2, gate_up, down], attrs)[0]
    return [out.reshape(x.shape)]


def gather(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Row gather straight from the table's DDR view (only the gathered rows are converted)."""
    table, idx = args
    axis = int(attrs.get("axis", 0))
    n = table.shape[axis]
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise TopqError(f"tpu.Gather: index out of range [0, {n}): {idx.min()}..{idx.max()}")
    return [np.take(table, idx, axis=axis).astype(F32)]


def visible_history(mask: np.ndarray | None, history: int, new: int) -> int:
    """Rows of the history a query can see: 1 + the last history column the mask does not hide (all of it
    without a mask). Hidden columns contribute exactly 0 after the softmax, so skipping them is exact."""
    if mask is None or mask.shape[-1] != history + new:
        return history
    if mask.size == history + new:  # the runtime's [1, 1, 1, S + L] key mask
        cols = mask.reshape(-1)[:history] > FULLY_MASKED_SCORE
    else:
        cols = (mask[..., :history].reshape(-1, history) > FULLY_MASKED_SCORE).any(axis=0)
    seen = np.flatnonzero(cols)
    return int(seen[-1]) + 1 if seen.size else 0


def fattention(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Causal GQA attention; with `history`, the last two args are the KV-cache region views (storage dtype)."""
    history = int(attrs.get("history", 0))
    q, k, v = args[:3]
    mask = args[3] if attrs.get("has_mask") else None
    dtype = attrs["dtype"]
    hq, hkv = int(attrs["q_head"]), int(attrs["kv_head"])
    b, lq, _, d = q.shape
    lk = k.shape[1]
    g = hq // hkv
    qg = q.transpose(0, 2, 1, 3).reshape(b, hkv, g * lq, d)
    scores = [np.matmul(qg, k.transpose(0, 2, 3, 1))]  # [B, Hkv, g*Lq, Lk]
    values = [v]
    visible = 0
    if history:
        visible = attrs["visible"] if "visible" in attrs else visible_history(mask, history, lk)
        if visible:
            hk = args[-2][:, :visible].astype(F32)
            hv = args[-1][:, :visible].astype(F32)
            scores.insert(0, np.matmul(qg, hk.transpose(0, 2, 3, 1)))
            values.insert(0, hv)
    s = np.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    s *= F32(attrs["scale"])
    total = s.shape[-1]
    s = s.reshape(b, hq, lq, total)
    if attrs.get("softcap"):
        soft_cap(s, F32(attrs["softcap"]))
    if mask is not None:
        if history and mask.shape[-1] == history + lk:  # drop the hidden history columns with their rows
            mask = np.concatenate([mask[..., :visible], mask[..., history:]], axis=-1)
        s += mask
    if attrs.get("causal", True) and lk > 1:  # one new key: nothing to hide
        i = np.arange(lq)[:, None]
        j = np.arange(lk)[None, :]
        # bottom-right aligned over the new keys; every history row precedes all queries
        np.copyto(s[..., total - lk:], F32(-np.inf), where=j > i + (lk - lq))
    if attrs.get("window"):
        hide_outside_window(s, int(attrs["window"]))
    top = s.max(axis=-1, keepdims=True)
    dead = top <= FULLY_MASKED_SCORE
    top[dead] = 0
    s -= top
    np.exp(s, out=s)
    denom = s.sum(axis=-1, keepdims=True)
    denom[dead] = 1
    s /= denom
    p = rnd(s, dtype).reshape(b, hkv, g * lq, total)
    out = None
    start = 0
    for val in values:
        n = val.shape[1]
        part = np.matmul(p[..., start:start + n], val.transpose(0, 2, 1, 3))
        out = part if out is None else out + part
        start += n
    assert out is not None
    return [out.reshape(b, hq, lq, d).transpose(0, 2, 1, 3).reshape(b, lq, hq * d)]


def rmsnorm(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Top's RMSNorm arithmetic (f32 mean of squares, x * 1/sqrt(ms + eps) * w) without its checks."""
    x = args[0]
    ms = np.square(x).sum(axis=-1, keepdims=True)
    ms /= F32(x.shape[-1])
    ms += F32(attrs["eps"])
    y = x * (F32(1) / np.sqrt(ms))
    if len(args) > 1:
        y *= args[1]
    return [y]


def rope(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Full-width contiguous-halves RoPE with Top's float operations (x1 c - x2 s, x2 c + x1 s); other layouts go
    to the reference kernel."""
    x, cos, sin = args
    d = x.shape[-1]
    if attrs.get("mode", "contiguous_halves") != "contiguous_halves" or cos.shape[-1] != d or x.ndim != 4:
        return _ref("Rope")(args, attrs)
    h = d // 2
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = x * c
    rotated = np.concatenate([x[..., h:], x[..., :h]], axis=-1) * s
    out[..., :h] -= rotated[..., :h]
    out[..., h:] += rotated[..., h:]
    return [out]


def cast(args: list[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    return [args[0]]  # the store rounds to the new dtype


def _ref(name: str) -> Any:
    return REFERENCE_OPS[f"top.{name}"]


#: tpu op → kernel (MatMul with an activation right operand uses Top's reference matmul, see the emulator)
KERNELS: dict[str, Any] = {
    "tpu.Gather": gather,
    "tpu.MatMul": matmul,
    "tpu.A16MatMul": matmul,
    "tpu.MatMulInt8": matmul_int8,
    "tpu.MLP": mlp,
    "tpu.A16MLP": mlp,
    "tpu.MoE": moe,
    "tpu.FAttention": fattention,
    "tpu.Cast": cast,
    "tpu.RMSNorm": rmsnorm,
    "tpu.Rope": rope,
    **{f"tpu.{n}": _ref(n) for n in ("LayerNorm", "Add", "Mul", "MulConst", "SiLU", "Tanh", "GELU", "Softmax",
                                     "Reshape", "Permute", "Slice", "Concat", "TopK")},
    # linear attention: f32 arithmetic on dtype inputs and the f32 state; the writes round the output to dtype
    **{f"tpu.{n}": _ref(n) for n in ("Sigmoid", "Softplus", "Exp", "CausalConv1d", "GatedDeltaRule",
                                     "ChunkGatedDeltaRule")},
}
