"""A transformers model written as GGUF the way llama.cpp's convert_hf_to_gguf.py writes it, and transformers' own
reading of such a file (the reference topq's GGUF reader is checked against).

Tensor names come from gguf-py's `TensorNameMap` (llama.cpp's own table, not topq's); the transforms are the
converter's: Llama's q/k row permutation (`LlamaModel.permute`), Gemma's `norm.weight + 1`, MoE experts stacked per
layer (gate / up halves of transformers' fused `gate_up_proj`), the shared-expert gate squeezed to [H] (converters
before the squeeze was dropped; transformers' loader expects it), norms, 1-D tensors and routers kept F32.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

#: transformers model_type → gguf-py MODEL_ARCH member (llama.cpp converts Mistral as Llama)
ARCHS = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "qwen2_moe": "QWEN2MOE",
         "qwen3_moe": "QWEN3MOE", "phi3": "PHI3", "gemma2": "GEMMA2", "gemma3_text": "GEMMA3"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute (n_head: this projection's head count)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(model: Any) -> list[tuple[str, np.ndarray]]:
    """(HF name without the experts' split, float32 array) as the converter sees them, fused experts split."""
    out: list[tuple[str, np.ndarray]] = []
    for name, value in model.state_dict().items():
        data = value.detach().float().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows first
            half = data.shape[1] // 2
            base = name.removesuffix(".gate_up_proj")
            out += [(f"{base}.gate_proj.weight", data[:, :half]), (f"{base}.up_proj.weight", data[:, half:])]
        elif name.endswith("mlp.experts.down_proj"):
            out.append((f"{name}.weight", data))
        else:
            out.append((name, data))
    return out


def _metadata(writer: Any, config: Any, arch: str) -> None:
    c = config
    rope = c.rope_parameters.get("full_attention", c.rope_parameters) if hasattr(c, "layer_types") and \
        "full_attention" in c.rope_parameters else c.rope_parameters
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    if c.pad_token_id is not None:
        writer.add_pad_token_id(c.pad_token_id)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if "head_dim" in c.to_dict():
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size)
                                        // c.num_attention_heads)
        writer.add_sliding_window(c.sliding_window or 0)
        if rope.get("rope_type") == "longrope":  # Phi3MiniModel.generate_extra_tensors
            scale = c.max_position_embeddings / c.original_max_position_embeddings
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
                c.original_max_position_embeddings)) if scale > 1 else 1.0)
            writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
            writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(c.sliding_window)
    if arch == "gemma3" and c.final_logit_softcapping:
        writer.add_final_logit_softcapping(c.final_logit_softcapping)


def write_gguf(model: Any, path: Path, qtype: str = "F32", arch_name: str | None = None) -> Path:
    """Write `model` (a transformers *ForCausalLM) as `path`, 2-D weights as `qtype` (F32, F16 or Q8_0);
    `arch_name` overrides `general.architecture` (and its key prefix), the conversion staying the same."""
    import gguf

    config = model.config
    arch_id = getattr(gguf.MODEL_ARCH, ARCHS[config.model_type])
    arch = gguf.MODEL_ARCH_NAMES[arch_id]
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch_name or arch)
    _metadata(writer, config, arch)
    tied = config.tie_word_embeddings or arch.startswith("gemma")
    for name, data in _tensors(model):
        if name == "lm_head.weight" and tied:
            continue
        base, _, suffix = name.rpartition(".")
        gguf_name = names.get_name(base)
        assert gguf_name is not None, name
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            data = _permute(data, heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1
        data = np.ascontiguousarray(data.squeeze() if gguf_name.endswith("ffn_gate_inp_shexp") else data)
        full = f"{gguf_name}.{suffix}"
        if data.ndim <= 1 or gguf_name.endswith(("_norm", "ffn_gate_inp")) or qtype == "F32":
            writer.add_tensor(full, data.astype(np.float32))
        elif qtype == "Q8_0" and data.shape[-1] % 32 == 0:
            q = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(full, gguf.quants.quantize(data, q), raw_dtype=q)
        else:  # F16, and llama.cpp's fallback for rows Q8_0 blocks do not fit
            writer.add_tensor(full, data.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_reference(path: Path) -> Any:
    """transformers' own reading of a GGUF file: `load_gguf_checkpoint` (what `from_pretrained(gguf_file=...)` runs;
    that entry point needs accelerate) maps names and undoes the conversion; the config is the file's alone."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.for_model(**load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    with torch.device("meta"):  # only its parameter names are used, to map GGUF names
        meta = AutoModelForCausalLM.from_config(config)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta, torch_dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = model.load_state_dict(loaded["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if "lm_head.weight" in missing:
        model.tie_weights()
    return model.float()
