"""Weight-only quantized linears as `com.microsoft.MatMulNBits`, packed as ORT's ContribOperators.md documents it.

For a weight [N, K] with `bits` b ∈ {4, 8} and block size B along K (k_blocks = ceil(K / B)):

* `<w>.qweight`  uint8 [N, k_blocks, B·b/8]: the unsigned codes of each block, bit-packed along K; for 4 bits
  element 2i of a block is the low nibble of byte i and element 2i+1 the high nibble. A last, partial block is
  padded with the block's zero point (it dequantizes to 0; ORT never reads it against real inputs).
* `<w>.scales`   float32 [N, k_blocks] (the type of the activations).
* `<w>.zero_points` uint8 [N, ceil(k_blocks·b/8)], packed like B (asymmetric weights only). Symmetric weights
  (topq's signed codes, zero 0) are stored as code + 2^(b-1) without zero points: ORT's default zero point is
  2^(b-1), so the dequantized values are the same.
* `<w>.perm`     int64 [K] (act-order weights only): the column order that makes each group contiguous. The
  documented `g_idx` input is deprecated, so the graph gathers the activation columns in that order
  (x[..., perm] · W[:, perm]ᵀ = x · Wᵀ) and the weight is packed with its columns permuted.

ORT computes (code − zero_point) · scale, so the weight it multiplies by equals `QuantizedWeight.dequantize()`.
Per-channel weights (one group per row) are stored as blocks of `PER_CHANNEL_BLOCK` that repeat the row's scale
and zero point (any block size holds them exactly).
"""

from __future__ import annotations

import numpy as np

from topq.core.errors import TopqError
from topq.core.quant import QuantizedWeight, QuantSpec
from topq.ir.types import TensorType
from topq.plugins.targets.onnx.lowering import (
    MS_DOMAIN,
    GraphBuilder,
    LinearLowering,
    StoredTensor,
)

BITS = (4, 8)
MIN_BLOCK = 16
PER_CHANNEL_BLOCK = 128
PARTS = ("qweight", "scales", "zero_points", "perm")


def allowed_block(group_size: int) -> bool:
    return group_size >= MIN_BLOCK and group_size & (group_size - 1) == 0


def block_size(spec: QuantSpec) -> int:
    k = spec.shape[1]
    if spec.group_size >= k and not spec.act_order:  # per channel: any block size repeats the row's parameters
        return PER_CHANNEL_BLOCK if k >= PER_CHANNEL_BLOCK else max(MIN_BLOCK, 1 << (k - 1).bit_length())
    return spec.group_size


def check_spec(spec: QuantSpec, name: str) -> None:
    """Refuse what MatMulNBits cannot hold, before any value is computed (one line naming the weight)."""
    if spec.bits not in BITS:
        raise TopqError(f"{name}: the onnx target stores 4- or 8-bit weights (MatMulNBits), not {spec.bits}-bit")
    k = spec.shape[1]
    per_channel = spec.group_size >= k and not spec.act_order
    if not per_channel and not allowed_block(spec.group_size):
        raise TopqError(f"{name}: group size {spec.group_size} cannot be a MatMulNBits block size; "
                        f"allowed: powers of two >= {MIN_BLOCK} (16, 32, 64, 128, ...) or per channel")


def tensor_names(name: str) -> dict[str, str]:
    return {part: f"{name}.{part}" for part in PARTS}


def weight_of(tensor_name: str) -> str:
    """The Top weight a packed tensor belongs to."""
    base, _, part = tensor_name.rpartition(".")
    if part not in PARTS:
        raise TopqError(f"onnx target: {tensor_name} is not a packed MatMulNBits tensor")
    return base


def layout(spec: QuantSpec) -> dict[str, TensorType]:
    n, k = spec.shape
    block = block_size(spec)
    blocks = -(-k // block)
    types = {"qweight": TensorType((n, blocks, block * spec.bits // 8), "ui8"),
             "scales": TensorType((n, blocks), "f32")}
    if not spec.symmetric:
        types["zero_points"] = TensorType((n, -(-blocks * spec.bits // 8)), "ui8")
    if spec.act_order:
        types["perm"] = TensorType((k,), "i64")
    return types


def lowering(name: str, spec: QuantSpec, accuracy_level: int) -> LinearLowering:
    names = tensor_names(name)
    types = layout(spec)
    tensors = [StoredTensor(names[part], t) for part, t in types.items()]
    n, k = spec.shape

    def emit(graph: GraphBuilder, x: str, weight: str) -> str:
        if "perm" in types:
            x = graph.one("Gather", [x, names["perm"]], axis=-1)
        inputs = [x, names["qweight"], names["scales"]]
        if "zero_points" in types:
            inputs.append(names["zero_points"])
        return graph.one("MatMulNBits", inputs, domain=MS_DOMAIN, K=k, N=n, bits=spec.bits,
                         block_size=block_size(spec), accuracy_level=accuracy_level)

    return LinearLowering(tensors, emit)


def pack(q: QuantizedWeight, name: str) -> dict[str, np.ndarray]:
    """The stored tensors of one quantized weight, keyed by bundle tensor name."""
    spec = q.spec
    check_spec(spec, name)
    n, k = spec.shape
    codes = np.asarray(q.codes).astype(np.int32)
    scales = np.asarray(q.scales, dtype=np.float32)
    zeros = np.asarray(q.zeros, dtype=np.float64)
    offset = 1 << (q.bits - 1) if q.symmetric else 0
    if q.symmetric and np.any(zeros):
        raise TopqError(f"{name}: symmetric weights with non-zero zero points cannot be stored as MatMulNBits")
    if not q.symmetric and not np.array_equal(zeros, np.round(zeros)):
        raise TopqError(f"{name}: zero points must be integers for MatMulNBits (got fractional ones)")
    codes = codes + offset
    if codes.size and (codes.min() < 0 or codes.max() >= 1 << q.bits):
        raise TopqError(f"{name}: codes outside the {q.bits}-bit range")
    zeros_int = zeros.astype(np.int32) + offset
    if zeros_int.size and (zeros_int.min() < 0 or zeros_int.max() >= 1 << q.bits):
        raise TopqError(f"{name}: zero points outside the {q.bits}-bit range")
    out: dict[str, np.ndarray] = {}
    names = tensor_names(name)
    if spec.act_order:
        perm, codes = act_order_columns(q, codes, name)
        out[names["perm"]] = perm
    block = block_size(spec)
    blocks = -(-k // block)
    # the group of each stored block's columns (per channel: every block of a row shares the row's group)
    group_of_block = np.arange(blocks) * block // q.group_size if q.group_size < k else np.zeros(blocks, np.int64)
    block_scales = scales[:, group_of_block]
    block_zeros = zeros_int[:, group_of_block]
    padded = np.repeat(block_zeros, block, axis=1)  # the pad value of a partial last block: its zero point
    padded[:, :k] = codes
    out[names["qweight"]] = pack_bits(padded.reshape(n, blocks, block), q.bits)
    out[names["scales"]] = np.ascontiguousarray(block_scales)
    if not q.symmetric:
        out[names["zero_points"]] = pack_bits(block_zeros, q.bits)
    return out


def act_order_columns(q: QuantizedWeight, codes: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(perm, codes[:, perm]) with perm the stable order of columns by group: every group must be group_size wide."""
    assert q.g_idx is not None
    g_idx = np.asarray(q.g_idx, dtype=np.int64)
    perm = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[perm], np.arange(g_idx.size) // q.group_size):
        raise TopqError(f"{name}: act-order groups of unequal size cannot be stored as MatMulNBits blocks")
    return perm.astype(np.int64), np.ascontiguousarray(codes[:, perm])


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values < 2^bits packed along the last axis: 8-bit as bytes; 4-bit two per byte, low nibble first
    (an odd count is padded with a zero nibble)."""
    values = np.asarray(values).astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(values)
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros(values.shape[:-1] + (1,), np.uint8)], axis=-1)
    return np.ascontiguousarray(values[..., 0::2] | (values[..., 1::2] << 4))
