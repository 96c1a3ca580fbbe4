"""Storage layout of weight-only quantized linears on the BM1684X family (what tpu.A16MatMul reads).

For a weight [N, K] quantized with `bits` and `group_size` g (as TPU-MLIR's A16MatMul weight reorder stores it):

* W4: `[N, K/2]` uint8; byte j of row n holds the code of k = 2j in its low nibble and k = 2j+1 in its high nibble.
  Asymmetric codes are unsigned 0..15; symmetric codes are signed -8..7 in two's complement nibbles.
* W8: `[N, K]` uint8 (asymmetric) or int8 (symmetric).
* scales: `[N, K/g]` in the compute dtype (bf16 / f16); zero points: `[N, K/g]` uint8, asymmetric only.

The dequantized weight the MACs see is `(code - zp) * scale`, rounded to the compute dtype.
"""

from __future__ import annotations

import numpy as np

from topq.core.errors import TopqError
from topq.core.quant import QuantizedWeight, QuantSpec
from topq.plugins.targets.bm1684x.modes import NP_DTYPES


def packed_shapes(n: int, k: int, bits: int, group_size: int) -> dict[str, tuple[int, ...]]:
    return {"weight": (n, k * bits // 8), "scale": (n, k // group_size), "zp": (n, k // group_size)}


def check_spec(q: QuantSpec, name: str) -> None:
    """Refuse a layout the A16MatMul storage cannot hold (one line naming the weight)."""
    k = q.shape[1]
    if q.bits not in (4, 8):
        raise TopqError(f"{name}: bm1684x stores 4- or 8-bit weights, not {q.bits}-bit")
    if q.act_order:
        raise TopqError(f"{name}: bm1684x cannot run act-order (permuted g_idx) groups; requantize without act_order")
    if k % q.group_size or (q.bits == 4 and k % 2):
        raise TopqError(f"{name}: K = {k} must be a multiple of the group size {q.group_size}"
                        + (" and even for 4-bit packing" if q.bits == 4 else ""))


def check_quantized(q: QuantizedWeight, name: str) -> None:
    """check_spec, plus what only the values tell."""
    check_spec(q.spec, name)
    if not q.symmetric and not np.array_equal(q.zeros, np.round(q.zeros)):
        raise TopqError(f"{name}: zero points must be integers for bm1684x (got fractional ones)")


def pack(q: QuantizedWeight, dtype: str, name: str = "weight") -> dict[str, np.ndarray]:
    """The stored tensors of one quantized weight: {"weight", "scale"[, "zp"]}."""
    check_quantized(q, name)
    codes = np.asarray(q.codes).astype(np.int16)
    lo, hi = (-(1 << (q.bits - 1)), (1 << (q.bits - 1)) - 1) if q.symmetric else (0, (1 << q.bits) - 1)
    if codes.size and (codes.min() < lo or codes.max() > hi):
        raise TopqError(f"{name}: codes outside [{lo}, {hi}] for {q.bits}-bit "
                        f"{'symmetric' if q.symmetric else 'asymmetric'} storage")
    if q.bits == 8:
        weight = codes.astype(np.int8 if q.symmetric else np.uint8)
    else:
        nibbles = (codes & 0xF).astype(np.uint8)  # two's complement for signed codes
        weight = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    out = {"weight": np.ascontiguousarray(weight),
           "scale": np.asarray(q.scales, dtype=np.float32).astype(NP_DTYPES[dtype])}
    if not q.symmetric:
        out["zp"] = np.asarray(q.zeros).astype(np.uint8)
    return out


def unpack_codes(weight: np.ndarray, bits: int, symmetric: bool) -> np.ndarray:
    """Integer codes [N, K] (int16) from the stored weight bytes."""
    if bits == 8:
        return weight.view(np.int8 if symmetric else np.uint8).astype(np.int16)
    raw = weight.view(np.uint8)
    n, half = raw.shape
    codes = np.empty((n, half * 2), np.int16)
    codes[:, 0::2] = raw & 0xF
    codes[:, 1::2] = raw >> 4
    if symmetric:
        codes[codes >= 8] -= 16
    return codes


def dequantize(weight: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, bits: int, group_size: int,
               dtype: str) -> np.ndarray:
    """The float32 [N, K] weight the chip's MACs see: (code - zp) * scale, rounded to the compute dtype."""
    codes = unpack_codes(weight, bits, zp is None)
    n, k = codes.shape
    groups = codes.reshape(n, k // group_size, group_size).astype(np.float32)
    if zp is not None:
        groups -= zp.astype(np.float32)[..., None]
    groups *= scale.astype(np.float32)[..., None]
    return groups.reshape(n, k).astype(NP_DTYPES[dtype]).astype(np.float32)
