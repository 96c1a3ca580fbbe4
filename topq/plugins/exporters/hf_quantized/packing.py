"""Packers: a `QuantizedWeight` as the tensors of a GPTQ, AWQ GEMM or compressed-tensors pack-quantized linear.

The inverse of `topq.plugins.formats.quantized` (whose docstring cites each layout's writing library). One bit
packer serves all three: values LSB-first as one continuous bit stream of little-endian 32-bit words along
an axis. For 2, 4 and 8 bits that is "32 / bits whole fields per word, field i at bit bits*i"; for 3 bits it is
GPTQ's "10 | 1 | 10 | 1 | 10" split over three words (AutoGPTQ's `QuantLinear.pack`). AWQ permutes the eight
columns of each word first (field i holds column ``8c + AWQ_ORDER[i]``).

Every packer takes a weight in unsigned form (`to_unsigned`): codes in [0, 2^bits), zeros the real zero
points in that domain, so ``w = (codes - zeros[:, g]) * scales[:, g]``. The formats differ in what they store
of the zeros: GPTQ v1 ``zero - 1`` (`gptq_v1_zeros` makes every zero at least 1 first, exactly), GPTQ v2 and
AWQ the zeros, compressed-tensors the zeros packed along N for asymmetric weights and nothing for symmetric
ones (zero 2^(bits-1), its signed zero 0).
"""

from __future__ import annotations

import numpy as np

from topq.core.errors import TopqError
from topq.core.quant import QuantizedWeight
from topq.plugins.formats.quantized import AWQ_ORDER

WORD_BITS = 32


def to_unsigned(weight: QuantizedWeight) -> QuantizedWeight:
    """The weight with unsigned codes and real zero points (topq's signed symmetric form gets the offset
    2^(bits-1) on both: the same values)."""
    codes = np.asarray(weight.codes)
    zeros = np.asarray(weight.zeros)
    if codes.dtype.kind == "i" and not np.any(zeros):  # signed symmetric: codes in [-2^(b-1), 2^(b-1))
        offset = 1 << (weight.bits - 1)
        codes, zeros = codes.astype(np.int16) + offset, np.full(zeros.shape, offset, dtype=np.int16)
    top = (1 << weight.bits) - 1
    if codes.size and (codes.min() < 0 or codes.max() > top):
        raise TopqError(f"codes outside [0, {top}] for a {weight.bits}-bit weight")
    if zeros.size and (zeros.min() < 0 or zeros.max() > top):
        raise TopqError(f"zero points outside [0, {top}] for a {weight.bits}-bit weight")
    return QuantizedWeight(codes=codes.astype(np.uint8), scales=np.asarray(weight.scales),
                           zeros=zeros.astype(np.int16), bits=weight.bits, group_size=weight.group_size,
                           symmetric=weight.symmetric, g_idx=weight.g_idx)


def groups_of(weight: QuantizedWeight) -> np.ndarray:
    """The group of every input column ([K] int64)."""
    k = weight.codes.shape[1]
    return (np.asarray(weight.g_idx, dtype=np.int64) if weight.g_idx is not None
            else np.arange(k, dtype=np.int64) // weight.group_size)


def is_offset_symmetric(weight: QuantizedWeight) -> bool:
    """Unsigned weight whose zeros are all 2^(bits-1) (what "sym" means in every format)."""
    return bool(np.all(weight.zeros == 1 << (weight.bits - 1)))


def pack_bits(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned values (< 2^bits) along `axis` as an LSB-first bit stream of little-endian int32 words."""
    v = np.moveaxis(np.asarray(values, dtype=np.uint8), axis, -1)
    count = v.shape[-1]
    if (count * bits) % WORD_BITS:
        raise TopqError(f"{count} values of {bits} bits do not fill whole 32-bit words")
    stream = np.unpackbits(v[..., None], axis=-1, count=bits, bitorder="little")  # [..., count, bits]
    packed = np.packbits(stream.reshape(*v.shape[:-1], count * bits), axis=-1, bitorder="little")
    words = np.ascontiguousarray(packed).view("<u4")
    return np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32)


def pad_to_words(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Zero-pad `axis` to whole words of ``32 // bits`` values (compressed-tensors pads the packed dim)."""
    per_word = WORD_BITS // bits
    missing = -values.shape[axis] % per_word
    if not missing:
        return values
    pad = [(0, 0)] * values.ndim
    pad[axis] = (0, missing)
    return np.pad(values, pad)


# ------------------------------------------------------------------------------------------------ GPTQ
def gptq_v1_zeros(weight: QuantizedWeight, what: str) -> tuple[QuantizedWeight, int]:
    """A weight whose zeros are all at least 1, with the same values, and how many groups were shifted.

    GPTQ v1 stores ``zero - 1`` per field, so a zero of 0 does not exist in it (AutoGPTQ's packing and
    GPTQModel's whole-word v2 -> v1 subtraction both corrupt a neighbouring field then). A group with zero 0
    whose codes stay below 2^bits - 1 is shifted exactly: every code + 1, zero 1. A group that also uses the
    top code cannot be written as v1; it is refused (gptq_v2 stores it)."""
    fix = weight.zeros == 0
    if not fix.any():
        return weight, 0
    groups = groups_of(weight)
    top = (1 << weight.bits) - 1
    highest = np.zeros(weight.zeros.shape[::-1], dtype=np.uint8)  # [G, N]
    np.maximum.at(highest, groups, weight.codes.T)
    if np.any(fix & (highest.T == top)):
        raise TopqError(f"{what}: a group with zero point 0 uses code {top}; GPTQ v1 cannot store it "
                        "(use --option checkpoint_format=gptq_v2)")
    codes = weight.codes + fix[:, groups].astype(np.uint8)
    zeros = np.where(fix, 1, weight.zeros).astype(np.int16)
    return QuantizedWeight(codes=codes, scales=weight.scales, zeros=zeros, bits=weight.bits,
                           group_size=weight.group_size, symmetric=weight.symmetric, g_idx=weight.g_idx), int(fix.sum())


def pack_gptq(weight: QuantizedWeight, scale_dtype: np.dtype, v1: bool) -> dict[str, np.ndarray]:
    """qweight int32 [K*bits/32, N], qzeros int32 [G, N*bits/32] (v1: zero - 1), scales [G, N], g_idx int32 [K]."""
    stored_zeros = weight.zeros - 1 if v1 else weight.zeros
    if stored_zeros.size and stored_zeros.min() < 0:
        raise TopqError("GPTQ v1 zeros must be at least 1 (gptq_v1_zeros first)")
    return {"qweight": pack_bits(weight.codes.T, weight.bits, axis=0),
            "qzeros": pack_bits(stored_zeros.T, weight.bits, axis=1),
            "scales": np.ascontiguousarray(weight.scales.T).astype(scale_dtype),
            "g_idx": groups_of(weight).astype(np.int32)}


# ------------------------------------------------------------------------------------------------ AWQ
def awq_interleave(values: np.ndarray) -> np.ndarray:
    """Columns [.., N] reordered so that plain packing puts column 8c + AWQ_ORDER[i] into field i of word c."""
    n = values.shape[-1]
    order = (np.arange(n) // 8) * 8 + np.asarray(AWQ_ORDER)[np.arange(n) % 8]
    return values[..., order]


def pack_awq(weight: QuantizedWeight, scale_dtype: np.dtype) -> dict[str, np.ndarray]:
    """qweight int32 [K, N/8], qzeros int32 [G, N/8], scales [G, N] (4-bit, zeros as they are)."""
    return {"qweight": pack_bits(awq_interleave(weight.codes.T), 4, axis=1),
            "qzeros": pack_bits(awq_interleave(weight.zeros.T), 4, axis=1),
            "scales": np.ascontiguousarray(weight.scales.T).astype(scale_dtype)}


# ------------------------------------------------------------------------------------------------ compressed-tensors
def pack_compressed(weight: QuantizedWeight, scale_dtype: np.dtype, symmetric: bool) -> dict[str, np.ndarray]:
    """weight_packed int32 [N, ceil(K*bits/32)], weight_scale [N, G], weight_shape int64 [2], weight_zero_point
    int32 [ceil(N*bits/32), G] (asymmetric), weight_g_idx int32 [K] (act-order)."""
    n, k = weight.codes.shape
    bits = weight.bits
    out = {"weight_packed": pack_bits(pad_to_words(weight.codes, bits, axis=1), bits, axis=1),
           "weight_scale": np.ascontiguousarray(weight.scales).astype(scale_dtype),
           "weight_shape": np.array([n, k], dtype=np.int64)}
    if not symmetric:
        out["weight_zero_point"] = pack_bits(pad_to_words(weight.zeros, bits, axis=0), bits, axis=0)
    if weight.g_idx is not None:
        out["weight_g_idx"] = np.asarray(weight.g_idx, dtype=np.int32)
    return out
