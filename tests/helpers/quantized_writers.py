"""Writers of pre-quantized checkpoints (GPTQ, AWQ, AutoRound, compressed-tensors, GGUF Q4_0/Q8_0 blocks).

Each packer follows the writing library's own algorithm (cited per packer) and never calls topq's unpackers
backwards; `write_quantized_llama` quantizes a saved tiny Llama into one of the formats. Used by
tests/formats/test_quantized_import.py and tests/quant/test_auto_scheme.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from topq.io.safetensors import SafetensorsFile, write_safetensors

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ WQLinear_GEMM.from_linear `order_map`


# ------------------------------------------------------------------------------------------------ reference packers
def gptq_pack_along_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ `QuantLinear.pack` (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py): [K, N] ints -> int32
    [K*bits/32, N]; 2/4/8 bits: 32/bits values per word; 3 bits: the 10 | 1 | 10 | 1 | 10 split over 3 words."""
    iw = values.astype(np.uint32)
    out = np.zeros((iw.shape[0] // 32 * bits, iw.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < out.shape[0]:
        if bits in (2, 4, 8):
            for j in range(i, i + 32 // bits):
                out[row] |= iw[j] << np.uint32(bits * (j - i))
            i += 32 // bits
            row += 1
        else:
            assert bits == 3
            for j in range(i, i + 10):
                out[row] |= iw[j] << np.uint32(3 * (j - i))
            i += 10
            out[row] |= iw[i] << np.uint32(30)
            row += 1
            out[row] |= (iw[i] >> np.uint32(2)) & np.uint32(1)
            i += 1
            for j in range(i, i + 10):
                out[row] |= iw[j] << np.uint32(3 * (j - i) + 1)
            i += 10
            out[row] |= iw[i] << np.uint32(31)
            row += 1
            out[row] |= (iw[i] >> np.uint32(1)) & np.uint32(0x3)
            i += 1
            for j in range(i, i + 10):
                out[row] |= iw[j] << np.uint32(3 * (j - i) + 2)
            i += 10
            row += 1
    return out.view(np.int32)


def gptq_pack_zeros(zeros: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's qzeros loop: the same packing along the columns of [G, N] (qzeros[:, col] |= zeros[:, j] << ...)."""
    return np.ascontiguousarray(gptq_pack_along_rows(np.ascontiguousarray(zeros.T), bits).T)


def auto_round_pack(codes_nk: np.ndarray, zeros_ng: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """auto_round_extension/torch/qlinear_torch.py `pack_248_bits` (packing_format "auto_round"): intweight [N, K]
    reshaped to [N, K*bits/32, 32/bits], shifted by arange*bits and summed, transposed; zeros packed unchanged."""
    n, k = codes_nk.shape
    per = 32 // bits
    shifts = np.arange(per, dtype=np.int64) * bits
    w = (codes_nk.astype(np.int64).reshape(n, k // per, per) << shifts).sum(-1) & 0xFFFFFFFF
    qweight = np.ascontiguousarray(w.T).astype(np.uint32).view(np.int32)
    z = zeros_ng.T.astype(np.int64)  # [G, N]
    qz = np.zeros((z.shape[0], z.shape[1] // per), dtype=np.int64)
    for col in range(qz.shape[1]):
        qz[:, col] = (z[:, col * per:(col + 1) * per] << shifts).sum(-1)
    return qweight, (qz & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def awq_pack(values: np.ndarray) -> np.ndarray:
    """AutoAWQ `WQLinear_GEMM.from_linear` (awq/modules/linear/gemm.py), 4-bit: [R, N] -> int32 [R, N/8],
    field i of word `col` holds column col*8 + order_map[i]."""
    v = values.astype(np.uint32)
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for col in range(out.shape[1]):
        for i in range(8):
            out[:, col] |= v[:, col * 8 + AWQ_ORDER_MAP[i]] << np.uint32(i * 4)
    return out.view(np.int32)


def ct_pack_to_int32(signed: np.ndarray, bits: int, packed_dim: int = 1) -> np.ndarray:
    """compressed-tensors `pack_to_int32` (compressors/quantized_compressors/pack_quantized.py): add 2^(bits-1),
    pad the packed dim to whole words, 32//bits values per int32 at shifts bits*i."""
    value = (signed.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
    if packed_dim == 0:
        value = value.T
    rows, cols = value.shape
    per = 32 // bits
    padded = -(-cols // per) * per
    value = np.pad(value, ((0, 0), (0, padded - cols)))
    shifts = np.arange(per, dtype=np.int64) * bits
    packed = ((value.reshape(rows, padded // per, per).astype(np.int64) << shifts).sum(-1) & 0xFFFFFFFF)
    packed = packed.astype(np.uint32).view(np.int32)
    return np.ascontiguousarray(packed.T if packed_dim == 0 else packed)


def q4_0_blocks(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """ggml `block_q4_0` rows: f16 d then 16 bytes, byte j = code[j] | code[j + 16] << 4 (dequantize_row_q4_0)."""
    n, k = codes.shape
    c = codes.reshape(n, k // 32, 32).astype(np.uint8)
    qs = c[..., :16] | (c[..., 16:] << np.uint8(4))
    return np.concatenate([d.astype(np.float16).reshape(n, k // 32, 1).view(np.uint8), qs], -1).reshape(n, -1)


def q8_0_blocks(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """ggml `block_q8_0` rows: f16 d then 32 int8."""
    n, k = q.shape
    qs = q.astype(np.int8).reshape(n, k // 32, 32).view(np.uint8)
    return np.concatenate([d.astype(np.float16).reshape(n, k // 32, 1).view(np.uint8), qs], -1).reshape(n, -1)



def reference_dequant(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """w[n, k] = (code - zero[n, g(k)]) * scale[n, g(k)], in float32 (the formats' definition)."""
    return ((codes.astype(np.float32) - zeros[:, groups].astype(np.float32))
            * scales[:, groups].astype(np.float32)).astype(np.float32)


# ------------------------------------------------------------------------------------------ a quantized tiny Llama
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP = 32


def rtn(w: np.ndarray, bits: int, g_idx: np.ndarray, sym: bool) -> dict[str, np.ndarray]:
    """Round-to-nearest per (row, group) with f16 scales: codes [N, K], zeros and scales [N, G] (unsigned form)."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    codes = np.zeros((n, k), np.uint8)
    scales = np.zeros((n, groups), np.float16)
    zeros = np.zeros((n, groups), np.int16)
    for g in range(groups):
        cols = np.flatnonzero(g_idx == g)
        block = w[:, cols]
        if sym:
            s = (np.abs(block).max(1) / ((maxq + 1) // 2 - 1)).astype(np.float16)
            z = np.full(n, (maxq + 1) // 2)
        else:
            lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
            s = ((hi - lo) / maxq).astype(np.float16)
            z = np.clip(np.round(-lo / s.astype(np.float32)), 0, maxq)
        s32 = s.astype(np.float32)
        codes[:, cols] = np.clip(np.round(block / s32[:, None]) + z[:, None], 0, maxq).astype(np.uint8)
        scales[:, g], zeros[:, g] = s, z
    return {"codes": codes, "scales": scales, "zeros": zeros, "g_idx": g_idx.astype(np.int32)}


def write_quantized_llama(src: Path, dst: Path, fmt: str) -> dict[str, np.ndarray]:
    """Quantize every decoder linear of a saved tiny Llama into `fmt`; return the dequantized weights."""
    source = SafetensorsFile(src / "model.safetensors")
    rng = np.random.default_rng(99)
    tensors: dict[str, np.ndarray] = {}
    dequantized: dict[str, np.ndarray] = {}
    for name in source.names():
        array = np.asarray(source.get_raw(name))
        prefix = name[: -len(".weight")]
        if not any(prefix.endswith(lin) for lin in LINEARS):
            tensors[name] = array
            continue
        n, k = array.shape
        if fmt == "gptq":  # v1, asymmetric, act-order
            fx = rtn(array, 4, rng.permutation(np.arange(k) // GROUP), sym=False)
            fx["zeros"] = np.maximum(fx["zeros"], 1)  # v1 cannot store a zero of 0 (it writes zero - 1)
            fx["codes"] = np.clip(np.round(array / fx["scales"][:, fx["g_idx"]].astype(np.float32))
                                  + fx["zeros"][:, fx["g_idx"]], 0, 15).astype(np.uint8)
            tensors.update({f"{prefix}.qweight": gptq_pack_along_rows(np.ascontiguousarray(fx["codes"].T), 4),
                            f"{prefix}.qzeros": gptq_pack_zeros(np.ascontiguousarray((fx["zeros"] - 1).T), 4),
                            f"{prefix}.scales": np.ascontiguousarray(fx["scales"].T), f"{prefix}.g_idx": fx["g_idx"]})
        elif fmt == "awq":
            fx = rtn(array, 4, np.arange(k) // GROUP, sym=False)
            tensors.update({f"{prefix}.qweight": awq_pack(np.ascontiguousarray(fx["codes"].T)),
                            f"{prefix}.qzeros": awq_pack(np.ascontiguousarray(fx["zeros"].T)),
                            f"{prefix}.scales": np.ascontiguousarray(fx["scales"].T)})
        else:  # compressed-tensors, symmetric 4-bit groups
            fx = rtn(array, 4, np.arange(k) // GROUP, sym=True)
            tensors.update({f"{prefix}.weight_packed": ct_pack_to_int32(fx["codes"].astype(np.int16) - 8, 4),
                            f"{prefix}.weight_shape": np.array([n, k], dtype=np.int64),
                            f"{prefix}.weight_scale": fx["scales"]})
        dequantized[name] = reference_dequant(fx["codes"], fx["zeros"], fx["scales"], fx["g_idx"])
    qc = {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
                 "checkpoint_format": "gptq"},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
        "ct": {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}},
               "ignore": ["lm_head"]},
    }[fmt]
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    write_safetensors(dst / "model.safetensors", tensors)
    return dequantized
