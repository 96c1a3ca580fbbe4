"""A saved tiny Llama written as a GGUF file with chosen GGML types per linear (tests of GGUF import under `auto`).

Types gguf-py can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) quantize the model's own weights; the k-quants, which
gguf-py can only dequantize, are random blocks with sensible super-block scales (every byte pattern is a valid
k-quant block), so those linears hold whatever the blocks say. `dequantized(path)` is gguf-py's dequantization of
each linear in Hugging Face layout, independent of topq's reader.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from topq.io.safetensors import SafetensorsFile

_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: ggml-common.h block_q*_K: block bytes, the byte offsets of their f16 super-block scales (d, dmin), and the
#: largest |value| per unit of d (sub-block scale code times weight code: Q4_K 63 x 15), to size d for weights ~0.5
K_QUANTS: dict[str, tuple[int, tuple[int, ...], int]] = {
    "Q2_K": (84, (80, 82), 15 * 3),  # scales[16] (4-bit scale and min), qs[64], d, dmin
    "Q3_K": (110, (108,), 32 * 4),  # hmask[32], qs[64], scales[12] (6-bit, offset 32), d
    "Q4_K": (144, (0, 2), 63 * 15),  # d, dmin, scales[12] (6-bit scale and min), qs[128]
    "Q5_K": (176, (0, 2), 63 * 31),  # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": (210, (208,), 128 * 32),  # ql[128], qh[64], scales[16] (int8), d
}


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{parts[3]}"
    return f"{_GLOBAL[parts[0]]}.{parts[1]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: q/k rows as llama.cpp stores them."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(qtype: str, rows: int, k: int, rng: np.random.Generator, largest: float = 0.5) -> np.ndarray:
    """Random `qtype` blocks [rows, k / 256 * block bytes], super-block scales sized for values up to ~`largest`."""
    size, halves, span = K_QUANTS[qtype]
    scale = largest / span
    blocks = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    for offset in halves:
        d = rng.uniform(0.5, 1.5, (rows, k // 256)).astype(np.float16) * np.float16(scale)
        blocks[..., offset:offset + 2] = d.reshape(rows, k // 256, 1).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf_llama(src: Path, path: Path, types: Mapping[str, str], seed: int = 5) -> None:
    """Write the tiny Llama saved in `src` as `path`; `types` maps GGUF tensor names (blk.0.attn_q.weight) to a
    GGML type name; every other tensor is F32. No tokenizer: the vocabulary size is in the metadata."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    config = json.loads((src / "config.json").read_text())
    weights = SafetensorsFile(src / "model.safetensors")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    names = [f"{g}.weight" for g in ("token_embd", "output_norm", "output")]
    names += [f"blk.{i}.{p}.weight" for i in range(config["num_hidden_layers"]) for p in _BLOCK]
    for name in names:
        w = np.asarray(weights.get_raw(hf_name(name)), dtype=np.float32)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            w = llama_cpp_permute(w, heads if "attn_q" in name else kv_heads)
        qtype = types.get(name)
        if qtype is None:
            writer.add_tensor(name, w)
        elif qtype in K_QUANTS:
            writer.add_tensor(name, random_k_blocks(qtype, *w.shape, rng), raw_dtype=GGMLQuantizationType[qtype])
        else:
            writer.add_tensor(name, quantize(w, GGMLQuantizationType[qtype]), raw_dtype=GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dequantized(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """{HF name: (GGML type, float32 weight [N, K] in HF row order)} of every quantized tensor, by gguf-py alone."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    out = {}
    for t in reader.tensors:
        if t.tensor_type.name in ("F32", "F16"):
            continue
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):  # undo the permutation: its inverse, by search
            n = heads if "attn_q" in t.name else kv_heads
            inverse = np.argsort(llama_cpp_permute(np.arange(w.shape[0]), n))
            w = w[inverse]
        out[hf_name(t.name)] = (t.tensor_type.name, np.asarray(w, dtype=np.float32))
    return out


def block_scales(path: Path) -> dict[str, np.ndarray]:
    """{HF name: float16 d [N, K / 32]} of every Q4_0 / Q8_0 tensor: the first two bytes of each block (ggml
    block_q4_0 / block_q8_0), rows in HF order."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    out = {}
    for t in reader.tensors:
        if t.tensor_type.name not in ("Q4_0", "Q8_0"):
            continue
        size = 18 if t.tensor_type.name == "Q4_0" else 34
        rows = np.asarray(t.data).reshape(int(t.shape[1]), -1, size)
        d = np.ascontiguousarray(rows[..., :2]).view(np.float16)[..., 0]
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            d = d[np.argsort(llama_cpp_permute(np.arange(d.shape[0]), heads if "attn_q" in t.name else kv_heads))]
        out[hf_name(t.name)] = d
    return out
