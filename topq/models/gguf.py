"""GGUF architectures: what a family declares so the GGUF reader (topq.plugins.formats.gguf_file) can turn a llama.cpp
file of its `general.architecture` into a Hugging Face config and Hugging Face tensors.

A family sets `ModelFamily.formats = {"gguf": GGUFArchitecture(...)}`; the reader finds the declaration whose `name`
is the file's `general.architecture`. Everything is data: the GGUF tensor names (`blk.{i}.attn_q`, without the
`.weight` / `.bias` suffix, which carries over) → Hugging Face names, each with the inverse of what llama.cpp's
`convert_hf_to_gguf.py` did to it (`GGUFTensor`), the metadata keys beyond the ones every decoder has, fixed config
values llama.cpp assumes for the architecture, and tensors whose presence sets a flag (q/k/v biases). The tables
below are the ones the built-in families share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GEMMA_TENSORS", "LLAMA_TENSORS", "MOE_METADATA", "QK_NORM_TENSORS", "QWEN_MOE_TENSORS",
           "QWEN_SHARED_EXPERT_TENSORS", "GGUFArchitecture", "GGUFTensor", "gguf_architecture",
           "gguf_architecture_names"]


@dataclass(frozen=True)
class GGUFTensor:
    """One GGUF tensor's Hugging Face name and the undoing of llama.cpp's conversion.

    `hf` names the tensor without its suffix, `{i}` the layer; `{e}` marks a GGUF tensor with the experts stacked on
    its first axis (`ffn_gate_exps` [E, I, H]), read as one Hugging Face tensor per expert. `permute` is "heads" or
    "kv_heads" for the q / k rows llama.cpp interleaved for its rotary layout (arch llama). `offset` is added to the
    stored values (Gemma's converter stores norms as 1 + w; the Hugging Face checkpoint holds w). `row`: a [n] GGUF
    tensor the Hugging Face checkpoint keeps as [1, n] (older converters squeeze every tensor)."""

    hf: str
    permute: str | None = None
    offset: float = 0.0
    row: bool = False


@dataclass(frozen=True)
class GGUFArchitecture:
    """A family's reading of GGUF files whose `general.architecture` is `name`.

    `architecture` / `model_type` go into the config (the family accepts them). `tensors`: GGUF tensor name (no
    suffix; `blk.{i}.` for block tensors) → Hugging Face name or `GGUFTensor`; a block tensor not listed is an error
    (never silently dropped). `metadata`: `<name>.<key>` → Hugging Face config field, for keys beyond the decoder ones
    the reader always reads (sizes, heads, norm eps, RoPE). `defaults`: config values the file does not store because
    llama.cpp assumes them for the architecture. `flags`: config field → tensor suffix whose presence makes it True
    (`{"attention_bias": "attn_q.bias"}`). `refused`: GGUF tensor name → why such a file cannot be read (say what it
    is, e.g. Mixtral experts in an arch-llama file). `rotary_dims`: `rope.dimension_count` is the rotary width, not the
    head size (partial rotary). `config_tensors`: GGUF tensor name → config field that receives its values as a list
    of floats (Phi-3's LongRoPE factors; not a weight). `derive(config)` returns more config fields computed from
    the ones read (Gemma's attention scale, Phi-3's `rope_scaling`)."""

    name: str
    architecture: str
    model_type: str
    tensors: Mapping[str, str | GGUFTensor]
    metadata: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    flags: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)
    rotary_dims: bool = False
    config_tensors: Mapping[str, str] = field(default_factory=dict)
    derive: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None

    def tensor(self, gguf_name: str) -> GGUFTensor | None:
        """The declaration of a GGUF tensor name without suffix (`blk.{i}.attn_q` form), None if not declared."""
        spec = self.tensors.get(gguf_name)
        return GGUFTensor(spec) if isinstance(spec, str) else spec


#: llama.cpp's names for a Llama-style decoder (gguf-py's tensor_mapping), to Hugging Face's.
LLAMA_TENSORS: dict[str, str | GGUFTensor] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
#: Qwen3's and Gemma 3's RMSNorm on each query / key head.
QK_NORM_TENSORS: dict[str, str | GGUFTensor] = {
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
}
#: Qwen MoE experts (stacked per layer in GGUF, one tensor per expert in Hugging Face checkpoints) and the router.
QWEN_MOE_TENSORS: dict[str, str | GGUFTensor] = {
    "blk.{i}.ffn_gate_inp": "model.layers.{i}.mlp.gate",
    "blk.{i}.ffn_gate_exps": "model.layers.{i}.mlp.experts.{e}.gate_proj",
    "blk.{i}.ffn_up_exps": "model.layers.{i}.mlp.experts.{e}.up_proj",
    "blk.{i}.ffn_down_exps": "model.layers.{i}.mlp.experts.{e}.down_proj",
}
#: Qwen2-MoE's shared expert and its sigmoid gate ([H] in GGUF files of squeezing converters, [1, H] in HF).
QWEN_SHARED_EXPERT_TENSORS: dict[str, str | GGUFTensor] = {
    "blk.{i}.ffn_gate_shexp": "model.layers.{i}.mlp.shared_expert.gate_proj",
    "blk.{i}.ffn_up_shexp": "model.layers.{i}.mlp.shared_expert.up_proj",
    "blk.{i}.ffn_down_shexp": "model.layers.{i}.mlp.shared_expert.down_proj",
    "blk.{i}.ffn_gate_inp_shexp": GGUFTensor("model.layers.{i}.mlp.shared_expert_gate", row=True),
}
#: the MoE sizes llama.cpp writes (`expert_*`) → Qwen MoE config fields.
MOE_METADATA: dict[str, str] = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}

_GEMMA_NAMES = {
    **LLAMA_TENSORS,
    "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.pre_feedforward_layernorm",  # before the MLP, as in Llama; not after it
    "blk.{i}.post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm",
    **QK_NORM_TENSORS,
}
#: Gemma 2 / 3: four norms per layer, each stored by llama.cpp as 1 + w (its RMSNorm multiplies by the weight).
GEMMA_TENSORS: dict[str, str | GGUFTensor] = {
    name: GGUFTensor(str(hf), offset=-1.0) if name.endswith("norm") else hf for name, hf in _GEMMA_NAMES.items()
}


def gguf_architecture(families: Any, name: str) -> GGUFArchitecture | None:
    """The declaration, among the registered families, of GGUF architecture `name` (None when no family reads it)."""
    found = [arch for family in families if isinstance(arch := family.formats.get("gguf"), GGUFArchitecture)
             and arch.name == name]
    return found[0] if found else None


def gguf_architecture_names(families: Any) -> list[str]:
    """Every GGUF architecture a registered family reads, sorted."""
    return sorted(arch.name for family in families if isinstance(arch := family.formats.get("gguf"), GGUFArchitecture))
