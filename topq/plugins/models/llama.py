"""Llama family (also SmolLM): pre-norm decoder, GQA attention with RoPE, gated SiLU MLP, optional attention
and MLP biases (`attention_bias`, `mlp_bias`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import topq
from topq.core.family import ModelFamily, ModelSpec
from topq.core.hookspecs import Register
from topq.models import decoder
from topq.models.gguf import LLAMA_TENSORS, GGUFArchitecture, GGUFTensor


def normalize(config: Mapping[str, Any]) -> ModelSpec:
    return decoder.normalize_llama_like(config, "llama")


_EXPERTS = ("experts in a GGUF file of architecture llama (Mixtral) are not supported: transformers' GGUF loader "
            "cannot read them either, so there is no reference to check a reading against")
#: llama.cpp writes Llama (and Mistral, which it converts as Llama without a window) with q/k rows permuted.
GGUF = GGUFArchitecture(
    name="llama", architecture="LlamaForCausalLM", model_type="llama",
    tensors={**LLAMA_TENSORS, "blk.{i}.attn_q": GGUFTensor("model.layers.{i}.self_attn.q_proj", permute="heads"),
             "blk.{i}.attn_k": GGUFTensor("model.layers.{i}.self_attn.k_proj", permute="kv_heads")},
    flags={"attention_bias": "attn_q.bias", "mlp_bias": "ffn_up.bias"},
    refused={"blk.{i}.ffn_gate_inp": _EXPERTS, "blk.{i}.ffn_gate_exps": _EXPERTS,
             # llama.cpp stores Llama 3's RoPE scaling as per-frequency divisors; ignoring them would be wrong RoPE
             "rope_freqs": "Llama 3 RoPE frequency factors (rope_freqs) are not supported: the model would run "
                           "with unscaled RoPE; convert the Hugging Face checkpoint instead"})

FAMILY = ModelFamily(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    normalize=normalize,
    layer_weights=decoder.DECODER_LAYER_WEIGHTS,
    build_block=decoder.pre_norm_block,
    quant_groups=decoder.DECODER_QUANT_GROUPS,
    description="Llama 2/3, SmolLM",
    config_fields=decoder.DECODER_FIELDS,
    formats={"gguf": GGUF},
)


@topq.hookimpl
def register_model_families(register: Register[ModelFamily]) -> None:
    register(FAMILY)
