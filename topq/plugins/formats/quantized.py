"""Checkpoints that are already quantized: exact unpackers to `QuantizedWeight`, and a WeightStore wrapper.

Every unpacker returns a `QuantizedWeight` in Hugging Face Linear orientation ([N = out, K = in]) holding
exactly what the file stores, with one convention for all formats:

* `codes` are the stored *unsigned* integers, uint8 in [0, 2^bits);
* `zeros` are the real zero points in that same unsigned domain (int16), so that
  ``w = (codes - zeros[:, g]) * scales[:, g]`` is the format's own dequantization;
* `scales` keep the stored float dtype (float16 for GPTQ/AWQ, whatever compressed-tensors wrote);
* `symmetric` reports the checkpoint's flag. Symmetric formats store an offset: their zeros are
  2^(bits-1) everywhere (GPTQ sym, compressed-tensors symmetric, GGUF Q4_0 / Q8_0). `to_signed_symmetric`
  turns such a weight into signed codes with zeros 0 (exact) for consumers that want that form;
* `g_idx` is kept only when it is not the trivial ``arange(K) // group_size`` (GPTQ act-order).

Layouts, each checked against the code of the library that writes it:

* GPTQ (`unpack_gptq`): AutoGPTQ ``QuantLinear.pack`` (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py)
  and GPTQModel ``PackableQuantLinear.pack_block`` (gptqmodel/nn_modules/qlinear/__init__.py). ``qweight``
  int32 [K*bits/32, N] and ``qzeros`` int32 [G, N*bits/32] are LSB-first bit streams along K resp. N: every
  `bits` consecutive int32 words hold 32 values, value j at bit 3j for 3-bit (the "10 | 1 | 10 | 1 | 10"
  split across words), at bit bits*j of one word for 2/4/8. v1 checkpoints (``checkpoint_format: gptq``,
  AutoGPTQ) store ``zero - 1``; GPTQModel's ``gptq_v2`` stores the zero itself. GPTQModel writes v1 by one
  whole-word subtraction of a 1 in every field (``convert_gptq_v2_to_v1_format_module``: 0x11111111 for 4 bits),
  so a zero of 0 borrows from its neighbour; 2/4/8-bit v1 zeros are read by adding that word back before
  unpacking (its ``convert_gptq_v1_to_v2_format_module``), 3-bit ones per field as ``(field & mask) + 1``.
* AWQ GEMM (`unpack_awq`): AutoAWQ ``WQLinear_GEMM.from_linear`` (awq/modules/linear/gemm.py): ``qweight``
  int32 [K, N/8], ``qzeros`` int32 [G, N/8], field i (bits 4i..4i+3) of word c holds column
  ``8c + AWQ_ORDER[i]``, AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; zeros are stored as they are.
* AutoRound (intel/auto-round auto_round/export/export_to_autoround/export.py, backend lists in
  auto_round/inference/backend.py): ``packing_format`` "auto_round:auto_gptq" is GPTQ v1 (its
  ``qlinear_torch_zp`` packs ``zeros - 1``), "auto_round" and "auto_round:gptqmodel" are GPTQ with real zeros
  and no ``g_idx`` (``auto_round_extension/torch/qlinear_torch.py``), "auto_round:auto_awq" is AWQ GEMM.
* compressed-tensors ``pack-quantized`` (`unpack_pack_quantized`): ``pack_to_int32`` in
  compressed_tensors/compressors/quantized_compressors/pack_quantized.py: signed values get
  ``+2^(bits-1)``, then ``32 // bits`` of them per int32 word along K (value i at bit bits*i, rows padded);
  ``weight_zero_point`` (asymmetric) is packed the same way along N (``packed_dim=0``) in current versions,
  or stored as signed integers [N, G] in older ones; ``weight_g_idx`` [K] carries activation ordering.
* GGUF Q4_0 / Q8_0 (`unpack_gguf`): llama.cpp ggml-quants.c ``dequantize_row_q4_0`` / ``dequantize_row_q8_0``
  and gguf-py ``gguf/quants.py``: blocks of 32 values; Q4_0 = f16 d + 16 bytes, low nibbles the first 16
  values, high nibbles the last 16, w = (q - 8) * d; Q8_0 = f16 d + 32 int8, w = q * d.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from topq.core.checkpoint import BaseWeightStore, WeightStore
from topq.core.errors import TopqError
from topq.core.quant import QuantizedWeight
from topq.quant.grid import to_signed_symmetric  # re-exported: the unpackers' callers use it from here

__all__ = [
    "AWQ_ORDER",
    "GGUF_DEQUANTIZED_BITS",
    "GGUF_EXACT_TYPES",
    "SUPPORTED_METHODS",
    "CTGroup",
    "QuantFormat",
    "QuantizedStore",
    "parse_quantization_config",
    "read_quantization_config",
    "to_signed_symmetric",
    "unpack_awq",
    "unpack_bitstream",
    "unpack_gguf",
    "unpack_gptq",
    "unpack_pack_quantized",
    "unpack_words",
]

AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)
SUPPORTED_METHODS: tuple[str, ...] = ("gptq", "awq", "auto-round", "compressed-tensors")
GGUF_EXACT_TYPES: tuple[str, ...] = ("Q4_0", "Q8_0")
#: bits per weight of the GGML quantized types without an exact integer form here (`GGUFStore.dequantized_bits`):
#: the width of each block's codes (ggml-common.h block structs; ternary TQ1_0 / TQ2_0 count as 2, the FP4 kinds
#: as 4). Their values are float combinations (Q4_1: d·q + m; k-quants: sub-block scale and minimum codes on top).
GGUF_DEQUANTIZED_BITS: dict[str, int] = {
    "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_1": 8,
    "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q8_K": 8,
    "IQ1_S": 1, "IQ1_M": 1, "IQ2_XXS": 2, "IQ2_XS": 2, "IQ2_S": 2, "IQ3_XXS": 3, "IQ3_S": 3, "IQ4_NL": 4,
    "IQ4_XS": 4, "TQ1_0": 2, "TQ2_0": 2, "MXFP4": 4, "NVFP4": 4,
}
_GPTQ_BITS = (2, 3, 4, 8)
_WORD = 32
#: a 1 in every field of a packed 32-bit word: what GPTQ v1 subtracts from each qzeros word (whole fields only;
#: 3-bit fields straddle words, and its writers subtract 1 per field, which `zero_offset` undoes per field)
_V1_WORD_OFFSET: dict[int, np.uint32] = {b: np.uint32(sum(1 << (b * i) for i in range(_WORD // b))) for b in (2, 4, 8)}


# ------------------------------------------------------------------------------------------------ bit unpacking
def _as_words(array: np.ndarray, what: str) -> np.ndarray:
    """A packed int32 tensor as uint32 words (a view: no copy of the stored data)."""
    array = np.asarray(array)
    if array.dtype not in (np.dtype("<i4"), np.dtype("<u4")):
        raise TopqError(f"{what}: packed tensor must be int32, got {array.dtype}")
    return array.view(np.uint32)


def unpack_bitstream(words: np.ndarray, bits: int, axis: int = 0) -> np.ndarray:
    """Values packed LSB-first as one continuous bit stream along `axis` of 32-bit words.

    Every `bits` consecutive words hold 32 values; value j of such a run starts at bit ``bits * j`` and may
    straddle two words (3-bit). This is the GPTQ layout for 2, 3, 4 and 8 bits. Returns uint8 codes with
    ``32 / bits`` times as many entries along `axis`.
    """
    w = np.moveaxis(np.asarray(words, dtype=np.uint32), axis, 0)
    rows, rest = w.shape[0], w.shape[1:]
    if rows % bits:
        raise TopqError(f"{rows} packed words along the packing axis are not a multiple of {bits} ({bits}-bit)")
    runs = w.reshape(rows // bits, bits, *rest).astype(np.uint64)
    out = np.empty((rows // bits, _WORD, *rest), dtype=np.uint8)
    mask = np.uint64((1 << bits) - 1)
    for j in range(_WORD):
        word, shift = divmod(j * bits, _WORD)
        value = runs[:, word] >> np.uint64(shift)
        if shift + bits > _WORD:  # straddles into the next word
            value = value | (runs[:, word + 1] << np.uint64(_WORD - shift))
        out[:, j] = (value & mask).astype(np.uint8)
    return np.moveaxis(out.reshape(rows // bits * _WORD, *rest), 0, axis)


def unpack_words(words: np.ndarray, bits: int, axis: int = 1, order: tuple[int, ...] | None = None) -> np.ndarray:
    """``32 // bits`` whole fields per 32-bit word along `axis` (no straddling; compressed-tensors, AWQ).

    Field i (bits ``bits*i`` and up) of word c becomes entry ``c * per_word + order[i]`` (``order`` defaults to
    the identity; AWQ passes AWQ_ORDER). Returns uint8 codes.
    """
    per_word = _WORD // bits
    order = tuple(range(per_word)) if order is None else order
    if sorted(order) != list(range(per_word)):
        raise TopqError(f"field order {order} is not a permutation of {per_word} fields")
    w = np.moveaxis(np.asarray(words, dtype=np.uint32), axis, -1)
    out = np.empty((*w.shape, per_word), dtype=np.uint8)
    mask = np.uint32((1 << bits) - 1)
    for i in range(per_word):
        out[..., order[i]] = ((w >> np.uint32(bits * i)) & mask).astype(np.uint8)
    return np.moveaxis(out.reshape(*w.shape[:-1], w.shape[-1] * per_word), -1, axis)


# ------------------------------------------------------------------------------------------------ helpers
def _group_size(k: int, groups: int, configured: int | None, what: str) -> int:
    """The group size for K columns in `groups` groups: the configured one when consistent, else K / groups."""
    if groups < 1:
        raise TopqError(f"{what}: no scale groups")
    if configured is not None and configured > 0 and math.ceil(k / configured) == groups:
        return configured
    if configured is not None and configured <= 0 and groups == 1:
        return k
    if k % groups == 0:
        return k // groups
    raise TopqError(f"{what}: {k} input columns do not split into {groups} groups"
                    + (f" of {configured}" if configured else ""))


def _check_g_idx(g_idx: np.ndarray | None, k: int, groups: int, group_size: int, what: str) -> np.ndarray | None:
    """Validate a g_idx; None when it is the trivial ``arange(K) // group_size``."""
    if g_idx is None:
        return None
    g_idx = np.asarray(g_idx).reshape(-1)
    if g_idx.shape[0] != k:
        raise TopqError(f"{what}: g_idx has {g_idx.shape[0]} entries for {k} input columns")
    g_idx = g_idx.astype(np.int64)
    if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
        raise TopqError(f"{what}: g_idx values outside [0, {groups})")
    if np.array_equal(g_idx, np.arange(k) // group_size):
        return None
    return g_idx.astype(np.int32)


def _scales(array: np.ndarray) -> np.ndarray:
    """A float scale tensor, copied off any memory map, keeping its stored dtype."""
    array = np.asarray(array)
    if not (np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16"):
        raise TopqError(f"scales must be floating point, got {array.dtype}")
    return np.array(array)


# ------------------------------------------------------------------------------------------------ unpackers
def unpack_gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None = None, *,
                bits: int | None = None, group_size: int | None = None, zero_offset: int = 1,
                symmetric: bool = False, what: str = "gptq") -> QuantizedWeight:
    """GPTQ tensors (qweight [K*bits/32, N], qzeros [G, N*bits/32], scales [G, N], g_idx [K]) → QuantizedWeight.

    `zero_offset` is 1 for v1 checkpoints (stored zero - 1) and 0 for v2 (stored zero). `bits` (if given) is
    checked against the shapes, which determine it: ``bits = 32 * qzeros.shape[1] / N``.
    """
    qw, qz = _as_words(qweight, f"{what}.qweight"), _as_words(qzeros, f"{what}.qzeros")
    scales = _scales(scales)
    if qw.ndim != 2 or qz.ndim != 2 or scales.ndim != 2:
        raise TopqError(f"{what}: qweight, qzeros and scales must be 2-D")
    groups, n = scales.shape
    if qz.shape[0] != groups or (qz.shape[1] * _WORD) % n:
        raise TopqError(f"{what}: qzeros {tuple(qz.shape)} does not fit scales {tuple(scales.shape)}")
    shape_bits = qz.shape[1] * _WORD // n
    if shape_bits not in _GPTQ_BITS:
        raise TopqError(f"{what}: {shape_bits}-bit GPTQ packing is not supported (supported: 2, 3, 4, 8)")
    if bits is not None and bits != shape_bits:
        raise TopqError(f"{what}: quantization_config says {bits} bits but the tensors are packed with {shape_bits}")
    bits = shape_bits
    if qw.shape[1] != n or (qw.shape[0] * _WORD) % bits:
        raise TopqError(f"{what}: qweight {tuple(qw.shape)} does not fit {n} outputs at {bits} bits")
    codes = unpack_bitstream(qw, bits, axis=0)  # [K, N]
    k = codes.shape[0]
    if zero_offset and bits in _V1_WORD_OFFSET:
        # v1 writers subtract the offset from the whole packed word (GPTQModel's v2 -> v1 conversion), so a
        # zero point of 0 borrows from the next field: add the word back before unpacking (exact for every zero).
        qz, zero_offset = qz + _V1_WORD_OFFSET[bits], 0  # uint32 arithmetic wraps like the writer's
    zeros = unpack_bitstream(qz, bits, axis=1).astype(np.int16) + np.int16(zero_offset)  # [G, N]
    size = _group_size(k, groups, group_size, what)
    return QuantizedWeight(codes=np.ascontiguousarray(codes.T), scales=np.ascontiguousarray(scales.T),
                           zeros=np.ascontiguousarray(zeros.T), bits=bits, group_size=size, symmetric=symmetric,
                           g_idx=_check_g_idx(g_idx, k, groups, size, what))


def unpack_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, *, bits: int = 4,
               group_size: int | None = None, symmetric: bool = False, what: str = "awq") -> QuantizedWeight:
    """AutoAWQ GEMM tensors (qweight [K, N/8], qzeros [G, N/8], scales [G, N]; 4-bit) → QuantizedWeight."""
    if bits != 4:
        raise TopqError(f"{what}: AWQ GEMM packing is 4-bit only, got {bits}")
    qw, qz = _as_words(qweight, f"{what}.qweight"), _as_words(qzeros, f"{what}.qzeros")
    scales = _scales(scales)
    if qw.ndim != 2 or qz.ndim != 2 or scales.ndim != 2:
        raise TopqError(f"{what}: qweight, qzeros and scales must be 2-D")
    groups, n = scales.shape
    if qw.shape[1] * 8 != n or qz.shape != (groups, n // 8):
        raise TopqError(f"{what}: qweight {tuple(qw.shape)} / qzeros {tuple(qz.shape)} do not fit scales "
                        f"{tuple(scales.shape)} (4-bit AWQ GEMM)")
    codes = unpack_words(qw, 4, axis=1, order=AWQ_ORDER)  # [K, N]
    zeros = unpack_words(qz, 4, axis=1, order=AWQ_ORDER).astype(np.int16)  # [G, N]
    k = codes.shape[0]
    return QuantizedWeight(codes=np.ascontiguousarray(codes.T), scales=np.ascontiguousarray(scales.T),
                           zeros=np.ascontiguousarray(zeros.T), bits=4,
                           group_size=_group_size(k, groups, group_size, what), symmetric=symmetric)


def unpack_pack_quantized(weight_packed: np.ndarray, weight_scale: np.ndarray, weight_shape: Any, *, bits: int,
                          weight_zero_point: np.ndarray | None = None, weight_g_idx: np.ndarray | None = None,
                          group_size: int | None = None, symmetric: bool = True,
                          what: str = "compressed-tensors") -> QuantizedWeight:
    """compressed-tensors ``pack-quantized`` tensors → QuantizedWeight (codes keep the +2^(bits-1) offset)."""
    if not 1 <= bits <= 8:
        raise TopqError(f"{what}: pack-quantized num_bits {bits} is not supported (1..8)")
    n, k = (int(v) for v in np.asarray(weight_shape).reshape(-1)[:2])
    per_word = _WORD // bits
    packed = _as_words(weight_packed, f"{what}.weight_packed")
    if packed.shape != (n, math.ceil(k / per_word)):
        raise TopqError(f"{what}: weight_packed {tuple(packed.shape)} does not fit weight_shape {(n, k)} "
                        f"at {bits} bits")
    codes = unpack_words(packed, bits, axis=1)[:, :k]
    offset = 1 << (bits - 1)
    scale = _scales(weight_scale)
    if scale.ndim == 0 or scale.size == 1:  # tensor strategy: one scale
        scale = np.broadcast_to(scale.reshape(1, 1), (n, 1)).copy()
    elif scale.ndim == 1 and scale.shape[0] == n:
        scale = scale.reshape(n, 1)
    if scale.ndim != 2 or scale.shape[0] != n:
        raise TopqError(f"{what}: weight_scale {tuple(np.shape(weight_scale))} does not fit {n} outputs")
    groups = scale.shape[1]
    if weight_zero_point is None:
        zeros = np.full((n, groups), offset, dtype=np.int16)
    else:
        zp = np.asarray(weight_zero_point)
        if zp.size == 1:  # tensor strategy
            zp = np.broadcast_to(zp.reshape(1, 1), (n, 1))
        if zp.ndim == 1 and zp.shape[0] == n:
            zp = zp.reshape(n, 1)
        if zp.shape == (n, groups):  # signed zero points as they are (older writers)
            if zp.dtype.kind not in "iu":
                raise TopqError(f"{what}: weight_zero_point must be integers, got {zp.dtype}")
            zeros = zp.astype(np.int16) + np.int16(offset)
        elif zp.shape == (math.ceil(n / per_word), groups):  # packed along N (packed_dim=0), offset included
            zeros = unpack_words(_as_words(zp, f"{what}.weight_zero_point"), bits, axis=0)[:n].astype(np.int16)
        else:
            raise TopqError(f"{what}: weight_zero_point {tuple(zp.shape)} does not fit {n} outputs x {groups} groups")
    size = _group_size(k, groups, group_size, what)
    return QuantizedWeight(codes=np.ascontiguousarray(codes), scales=np.ascontiguousarray(scale),
                           zeros=np.ascontiguousarray(zeros), bits=bits, group_size=size, symmetric=symmetric,
                           g_idx=_check_g_idx(weight_g_idx, k, groups, size, what))


def unpack_gguf(raw: np.ndarray, qtype: str, shape: tuple[int, ...], what: str = "gguf") -> QuantizedWeight | None:
    """GGUF Q4_0 / Q8_0 blocks (uint8 rows, HF row order) → QuantizedWeight; None for other GGML types.

    Q4_0 → 4-bit codes 0..15 with zeros 8 and scales d (group 32); Q8_0 → codes q + 128 with zeros 128.
    Both are exact: ``(codes - zeros) * d`` is llama.cpp's value.
    """
    if qtype not in GGUF_EXACT_TYPES:
        return None
    if len(shape) < 1 or shape[-1] % 32:
        raise TopqError(f"{what}: {qtype} rows of {shape[-1] if shape else 0} values are not whole blocks of 32")
    k = int(shape[-1])
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    block_bytes = 18 if qtype == "Q4_0" else 34
    data = np.asarray(raw, dtype=np.uint8)
    if data.size != rows * k // 32 * block_bytes:
        raise TopqError(f"{what}: {data.size} bytes of {qtype} data for shape {tuple(shape)}")
    blocks = data.reshape(rows, k // 32, block_bytes)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]  # [rows, k/32]
    if qtype == "Q4_0":
        qs = blocks[..., 2:]
        codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1).reshape(rows, k)
        bits = 4
    else:
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        codes = (q.astype(np.int16) + 128).astype(np.uint8).reshape(rows, k)
        bits = 8
    zeros = np.full(d.shape, 1 << (bits - 1), dtype=np.int16)
    return QuantizedWeight(codes=np.ascontiguousarray(codes), scales=np.ascontiguousarray(d), zeros=zeros,
                           bits=bits, group_size=32, symmetric=True)


# ------------------------------------------------------------------------------------------------ configs
@dataclass(frozen=True)
class CTGroup:
    """One compressed-tensors config group (weights part)."""

    targets: tuple[str, ...]
    bits: int
    symmetric: bool
    group_size: int | None
    strategy: str


@dataclass(frozen=True)
class QuantFormat:
    """A parsed `quantization_config`: how the packed tensors of this checkpoint are laid out."""

    method: str  # gptq | awq | auto-round | compressed-tensors
    layout: str  # gptq | awq | pack-quantized
    bits: int | None
    group_size: int | None  # None: inferred from the tensors; -1 in configs (per-channel) becomes None
    symmetric: bool
    zero_offset: int = 0  # GPTQ layout: 1 when zeros are stored minus one (v1)
    per_layer: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name or regex → overrides
    ct_groups: tuple[CTGroup, ...] = ()

    def layer_settings(self, prefix: str) -> tuple[int | None, int | None, bool]:
        """(bits, group_size, symmetric) for one layer (module name), after per-layer overrides.

        Override keys (GPTQModel `dynamic`, AutoRound `extra_config`) are an exact module name, a regex the whole
        name must match, or GPTQModel's "+:regex" (re.match); "-:regex" marks skipped modules and sets nothing.
        """
        bits, size, sym = self.bits, self.group_size, self.symmetric
        for key, over in self.per_layer.items():
            if not isinstance(over, Mapping) or key.startswith("-:") or not _key_matches(key, prefix):
                continue
            bits = over.get("bits", bits)
            size = _norm_group(over.get("group_size", size)) if "group_size" in over else size
            sym = bool(over.get("sym", sym))
            break
        return bits, size, sym

    def ct_group(self, prefix: str) -> CTGroup:
        """The compressed-tensors config group whose targets match a layer."""
        for group in self.ct_groups:
            if any(_ct_target_matches(t, prefix) for t in group.targets):
                return group
        if len(self.ct_groups) == 1:
            return self.ct_groups[0]
        raise TopqError(f"compressed-tensors: no config group targets {prefix}")


def _key_matches(key: str, name: str) -> bool:
    if key == name:
        return True
    try:
        if key.startswith("+:"):
            return re.match(key[2:], name) is not None
        return re.fullmatch(key, name) is not None
    except re.error:
        return False


def _ct_target_matches(target: str, name: str) -> bool:
    """compressed-tensors matching: "re:<regex>" (re.match on the module name), an exact name, or a layer class
    name such as "Linear" (every packed tensor belongs to a Linear)."""
    if target.startswith("re:"):
        try:
            return re.match(target[3:], name) is not None
        except re.error:
            return False
    return target == name or ("." not in target and target.endswith("Linear"))


def _norm_group(value: Any) -> int | None:
    if value is None:
        return None
    value = int(value)
    return None if value <= 0 else value


def _first(qc: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if qc.get(key) is not None:
            return qc[key]
    return default


def _unsupported(what: str, value: Any, supported: str) -> TopqError:
    return TopqError(f"quantization_config {what} {value!r} is not supported (supported: {supported})")


def parse_quantization_config(qc: Mapping[str, Any]) -> QuantFormat:
    """Check a `quantization_config` and say how its tensors are packed; unsupported settings raise TopqError."""
    if not isinstance(qc, Mapping):
        raise TopqError("quantization_config is not an object")
    method = str(qc.get("quant_method", "gptq")).lower().replace("_", "-")
    if method in ("intel/auto-round", "autoround"):
        method = "auto-round"
    if method == "gptq":
        return _parse_gptq(qc)
    if method == "awq":
        return _parse_awq(qc)
    if method == "auto-round":
        return _parse_auto_round(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    raise _unsupported("quant_method", qc.get("quant_method"), ", ".join(SUPPORTED_METHODS))


def _check_bits(bits: Any, allowed: tuple[int, ...], method: str) -> int:
    try:
        value = int(bits)
    except (TypeError, ValueError):
        raise _unsupported("bits", bits, ", ".join(map(str, allowed))) from None
    if value not in allowed:
        raise TopqError(f"quantization_config bits {value} is not supported for {method} "
                        f"(supported: {', '.join(map(str, allowed))})")
    return value


def _parse_gptq(qc: Mapping[str, Any]) -> QuantFormat:
    fmt = str(_first(qc, "checkpoint_format", "format", default="gptq")).lower()
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in ("gptq", "gptq_v2"):
        raise _unsupported("checkpoint_format", fmt, "gptq, gptq_v2")
    pack_dtype = str(qc.get("pack_dtype", "int32")).replace("torch.", "")
    if pack_dtype != "int32":
        raise _unsupported("pack_dtype", pack_dtype, "int32")
    bits = _check_bits(_first(qc, "bits", "w_bit", default=4), _GPTQ_BITS, "gptq")
    dynamic = qc.get("dynamic") or {}
    return QuantFormat(method="gptq", layout="gptq", bits=bits, group_size=_norm_group(qc.get("group_size", 128)),
                       symmetric=bool(qc.get("sym", True)), zero_offset=1 if fmt == "gptq" else 0,
                       per_layer=dict(dynamic) if isinstance(dynamic, Mapping) else {})


def _parse_awq(qc: Mapping[str, Any]) -> QuantFormat:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _unsupported("version", qc.get("version"), "gemm")
    bits = _check_bits(_first(qc, "bits", "w_bit", default=4), (4,), "awq")
    zero_point = qc.get("zero_point", True)
    return QuantFormat(method="awq", layout="awq", bits=bits,
                       group_size=_norm_group(_first(qc, "group_size", "q_group_size", default=128)),
                       symmetric=not zero_point)


_AUTO_ROUND_FORMATS = ("auto_round", "auto_round:gptqmodel", "auto_round:auto_gptq", "auto_round:auto_awq")


def _parse_auto_round(qc: Mapping[str, Any]) -> QuantFormat:
    data_type = str(qc.get("data_type", "int")).lower()
    if data_type not in ("int", "int_sym", "int_asym"):
        raise _unsupported("data_type", qc.get("data_type"), "int")
    act_bits = qc.get("act_bits")
    if act_bits is not None and int(act_bits) < 16:
        raise _unsupported("act_bits", act_bits, "16 or more (weight-only)")
    packing = qc.get("packing_format")
    if packing is None:  # intel/auto-round before 0.4 wrote the packing backend as "backend"
        packing = qc.get("backend", "auto_round:auto_gptq")
    packing = str(packing).lower().replace("autoround", "auto_round").replace("auto-round", "auto_round")
    # auto_round/inference/convert_model.py: normalise the spellings it accepts.
    packing = {"auto": "auto_round:auto_gptq", "auto_round:awq": "auto_round:auto_awq",
               "auto_round:gptq": "auto_round:auto_gptq"}.get(packing, packing)
    if "awq" in packing:
        layout, offset = "awq", 0
    elif "gptqmodel" in packing:
        layout, offset = "gptq", 0
    elif "gptq" in packing:
        layout, offset = "gptq", 1
    elif packing.startswith("auto_round") and not any(x in packing for x in ("fp", "mx", "nv", "llm_compressor")):
        layout, offset = "gptq", 0  # auto_round's own QuantLinear: real zeros, no g_idx
    else:
        raise _unsupported("packing_format", qc.get("packing_format", qc.get("backend")),
                           ", ".join(_AUTO_ROUND_FORMATS))
    allowed = (4,) if layout == "awq" else _GPTQ_BITS
    bits = _check_bits(qc.get("bits", 4), allowed, f"auto-round ({packing})")
    extra = qc.get("extra_config") or {}
    return QuantFormat(method="auto-round", layout=layout, bits=bits, group_size=_norm_group(qc.get("group_size", 128)),
                       symmetric=bool(qc.get("sym", True)), zero_offset=offset,
                       per_layer=dict(extra) if isinstance(extra, Mapping) else {})


def _parse_compressed_tensors(qc: Mapping[str, Any]) -> QuantFormat:
    top_format = qc.get("format")
    groups_cfg = qc.get("config_groups") or {}
    if not isinstance(groups_cfg, Mapping) or not groups_cfg:
        raise TopqError("quantization_config (compressed-tensors) has no config_groups")
    sparsity = qc.get("sparsity_config") or {}
    if isinstance(sparsity, Mapping) and sparsity.get("format") not in (None, "dense"):
        raise _unsupported("sparsity_config format", sparsity.get("format"), "dense")
    groups: list[CTGroup] = []
    for name, group in groups_cfg.items():
        if not isinstance(group, Mapping):
            raise TopqError(f"quantization_config config_groups.{name} is not an object")
        fmt = group.get("format") or top_format
        if fmt != "pack-quantized":
            raise _unsupported("format", fmt, "pack-quantized")
        weights = group.get("weights")
        if not isinstance(weights, Mapping):
            raise TopqError(f"quantization_config config_groups.{name} has no weights")
        if group.get("input_activations") or group.get("output_activations"):
            raise _unsupported("activation quantization in", name, "weight-only groups")
        if str(weights.get("type", "int")).lower() != "int":
            raise _unsupported("weights type", weights.get("type"), "int")
        strategy = str(weights.get("strategy", "tensor")).lower()
        if strategy not in ("group", "channel", "tensor"):
            raise _unsupported("weights strategy", strategy, "group, channel, tensor")
        bits = _check_bits(weights.get("num_bits", 8), tuple(range(1, 9)), "compressed-tensors pack-quantized")
        targets = group.get("targets") or ["Linear"]
        groups.append(CTGroup(targets=tuple(str(t) for t in targets), bits=bits,
                              symmetric=bool(weights.get("symmetric", True)),
                              group_size=_norm_group(weights.get("group_size")) if strategy == "group" else None,
                              strategy=strategy))
    return QuantFormat(method="compressed-tensors", layout="pack-quantized", bits=groups[0].bits,
                       group_size=groups[0].group_size, symmetric=groups[0].symmetric, ct_groups=tuple(groups))


# ------------------------------------------------------------------------------------------------ the store
_PARTS = {
    "gptq": {"qweight": "qweight", "qzeros": "qzeros", "scales": "scales", "g_idx": "g_idx"},
    "awq": {"qweight": "qweight", "qzeros": "qzeros", "scales": "scales"},
    "pack-quantized": {"packed": "weight_packed", "scale": "weight_scale", "zero_point": "weight_zero_point",
                       "shape": "weight_shape", "g_idx": "weight_g_idx"},
}
_REQUIRED = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales"),
             "pack-quantized": ("packed", "scale", "shape")}
_MARKER = {"gptq": "qweight", "awq": "qweight", "pack-quantized": "packed"}


@dataclass
class _Layer:
    prefix: str
    parts: dict[str, str]  # role -> stored tensor name


class QuantizedStore(BaseWeightStore):
    """A WeightStore over a pre-quantized checkpoint that looks like a float one.

    Each packed linear (``<prefix>.qweight`` & co. or ``<prefix>.weight_packed`` & co.) appears as
    ``<prefix>.weight`` with its logical [N, K] shape; the packing tensors themselves are not listed. `get`
    dequantizes exactly to float32, `quantized(name)` gives the integer form (None for tensors that are not
    quantized), `dtype` says ``int<bits>``, and `get_raw` gives the main packed tensor as stored. Other
    tensors pass through unchanged.
    """

    def __init__(self, base: WeightStore, fmt: QuantFormat, where: str | Path = "checkpoint") -> None:
        self.base, self.format, self.where = base, fmt, str(where)
        parts = _PARTS[fmt.layout]
        marker = parts[_MARKER[fmt.layout]]
        suffix_role = {f".{suffix}": role for role, suffix in parts.items()}
        self._layers: dict[str, _Layer] = {}
        hidden: set[str] = set()
        base_names = base.names()
        for name in base_names:
            if name.endswith(f".{marker}"):
                prefix = name[: -len(marker) - 1]
                found = {role: f"{prefix}.{suffix}" for role, suffix in parts.items() if f"{prefix}.{suffix}" in base}
                missing = [parts[r] for r in _REQUIRED[fmt.layout] if r not in found]
                if missing:
                    raise TopqError(f"{self.where}: {name} without {', '.join(f'{prefix}.{m}' for m in missing)}")
                logical = f"{prefix}.weight"
                if logical in base:
                    raise TopqError(f"{self.where}: {prefix} has both a packed and a float weight")
                self._layers[logical] = _Layer(prefix, found)
                hidden.update(found.values())
        self._names: list[str] = []
        self._listed: set[str] = set()
        listed = self._listed
        for name in base_names:
            if name in hidden:
                prefix = next((name[: -len(s)] for s in suffix_role if name.endswith(s)), None)
                logical = f"{prefix}.weight"
                if logical in self._layers and logical not in listed:
                    self._names.append(logical)
                    listed.add(logical)
                continue
            self._names.append(name)
            listed.add(name)
        self._shapes: dict[str, tuple[int, ...]] = {}

    @classmethod
    def wrap(cls, base: WeightStore, quantization_config: Mapping[str, Any],
             where: str | Path = "checkpoint") -> QuantizedStore:
        return cls(base, parse_quantization_config(quantization_config), where)

    # -- WeightStore ------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._listed

    def _check(self, name: str) -> None:
        if name not in self._listed:
            raise TopqError(f"tensor {name!r} not found in {self.where}")

    def shape(self, name: str) -> tuple[int, ...]:
        layer = self._layers.get(name)
        if layer is None:
            self._check(name)
            return self.base.shape(name)
        if name not in self._shapes:
            self._shapes[name] = self._logical_shape(layer)
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        layer = self._layers.get(name)
        if layer is None:
            self._check(name)
            return self.base.dtype(name)
        return f"int{self._bits(layer)}"

    def get(self, name: str) -> np.ndarray:
        weight = self.quantized(name)
        if weight is None:
            return self.base.get(name)
        return weight.dequantize()

    def get_raw(self, name: str) -> np.ndarray:
        layer = self._layers.get(name)
        if layer is None:
            self._check(name)
            return self.base.get_raw(name)
        return self.base.get_raw(layer.parts[_MARKER[self.format.layout]])

    # -- quantized access ---------------------------------------------------------------------------------------
    def quantized_names(self) -> list[str]:
        """Logical names of the packed linears."""
        return [n for n in self._names if n in self._layers]

    def quantized(self, name: str) -> QuantizedWeight | None:
        """The stored integer form of a packed linear; None for a tensor that is not quantized."""
        layer = self._layers.get(name)
        if layer is None:
            self._check(name)
            return None
        raw = {role: self.base.get_raw(tensor) for role, tensor in layer.parts.items()}
        what = f"{self.where}: {layer.prefix}"
        fmt = self.format
        if fmt.layout == "gptq":
            bits, size, sym = fmt.layer_settings(layer.prefix)
            checked_bits = None if fmt.per_layer else bits  # with per-layer overrides the shapes decide
            return unpack_gptq(raw["qweight"], raw["qzeros"], raw["scales"], raw.get("g_idx"), bits=checked_bits,
                               group_size=size, zero_offset=fmt.zero_offset, symmetric=sym, what=what)
        if fmt.layout == "awq":
            _, size, sym = fmt.layer_settings(layer.prefix)
            return unpack_awq(raw["qweight"], raw["qzeros"], raw["scales"], group_size=size,
                              symmetric=sym, what=what)
        group = fmt.ct_group(layer.prefix)
        return unpack_pack_quantized(raw["packed"], raw["scale"], raw["shape"], bits=group.bits,
                                     weight_zero_point=raw.get("zero_point"), weight_g_idx=raw.get("g_idx"),
                                     group_size=group.group_size, symmetric=group.symmetric, what=what)

    # -- shapes without unpacking ---------------------------------------------------------------------------------
    def _bits(self, layer: _Layer) -> int:
        fmt = self.format
        if fmt.layout == "awq":
            return 4
        if fmt.layout == "pack-quantized":
            return fmt.ct_group(layer.prefix).bits
        n = self.base.shape(layer.parts["scales"])[-1]
        return self.base.shape(layer.parts["qzeros"])[-1] * _WORD // n

    def _logical_shape(self, layer: _Layer) -> tuple[int, int]:
        fmt = self.format
        if fmt.layout == "pack-quantized":
            n, k = (int(v) for v in np.asarray(self.base.get_raw(layer.parts["shape"])).reshape(-1)[:2])
            return n, k
        n = int(self.base.shape(layer.parts["scales"])[-1])
        rows = int(self.base.shape(layer.parts["qweight"])[0])
        if fmt.layout == "awq":
            return n, rows
        return n, rows * _WORD // self._bits(layer)


def read_quantization_config(directory: Path, config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The raw `quantization_config` of a HF directory: config.json's, else a GPTQ `quantize_config.json`."""
    raw_config = directory / "config.json"
    try:
        raw = json.loads(raw_config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        raw = dict(config)
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if qc is not None:
        if not isinstance(qc, dict):
            raise TopqError(f"{raw_config}: quantization_config is not an object")
        return qc
    legacy = directory / "quantize_config.json"  # AutoGPTQ before transformers integration
    if legacy.is_file():
        try:
            qc = json.loads(legacy.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise TopqError(f"{legacy}: cannot read ({exc})") from exc
        if not isinstance(qc, dict):
            raise TopqError(f"{legacy}: not a JSON object")
        return qc
    return None
