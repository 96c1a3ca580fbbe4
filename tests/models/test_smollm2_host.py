"""SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to float32) on the host runtime against transformers.

The reference model is loaded by transformers' own GGUF code (conftest.smol_torch), not by topq's reader, so a
reader bug shows here. Run with `pytest -s` to see the measured numbers.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from data_paths import AUSTEN
from smol_model import reference_perplexity

from topq.core.bundle import Bundle
from topq.core.runtime import Session, perplexity

WINDOW = 512
PPL_TOKENS = 4 * WINDOW


@pytest.fixture(scope="module")
def persuasion_ids(smol_bundle: Bundle) -> list[int]:
    text = (AUSTEN / "03_Persuasion.txt").read_text(encoding="utf-8")
    ids = list(smol_bundle.tokenizer.encode(text))
    assert len(ids) > PPL_TOKENS
    return ids


def test_prefill_logits_match_transformers(smol_bundle: Bundle, smol_torch: Any, persuasion_ids: list[int]) -> None:
    """150 tokens: a 128-token prefill plus one prefill-with-history segment, every position checked."""
    ids = persuasion_ids[1000:1150]
    session = Session(smol_bundle)
    started = time.perf_counter()
    got = session.feed(ids, all_logits=True)
    elapsed = time.perf_counter() - started
    with torch.no_grad():
        ref = smol_torch(torch.tensor([ids])).logits[0].numpy()
    diff = float(np.abs(got - ref).max())
    print(f"\nSmolLM2 prefill of {len(ids)} tokens: max |Δ logits| = {diff:.2e} (logit range "
          f"{ref.min():.1f}..{ref.max():.1f}), {elapsed:.2f} s")
    assert session.calls.count("block_0") == 1 and session.calls.count("block_kv_0") == 1
    assert diff <= 1e-3
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_perplexity_matches_transformers(smol_bundle: Bundle, smol_torch: Any, persuasion_ids: list[int]) -> None:
    ids = persuasion_ids[:PPL_TOKENS]
    started = time.perf_counter()
    ppl, count = perplexity(smol_bundle, ids, WINDOW)
    elapsed = time.perf_counter() - started
    ref, ref_count = reference_perplexity(smol_torch, ids, WINDOW)
    rel = abs(ppl - ref) / ref
    print(f"\nSmolLM2 perplexity, Persuasion first {PPL_TOKENS} tokens, windows of {WINDOW}: topq {ppl:.4f}, "
          f"transformers {ref:.4f} (rel. diff {rel:.2e}) over {count} predicted tokens; topq {elapsed:.1f} s")
    assert count == ref_count == PPL_TOKENS - 4
    assert rel <= 5e-3
    assert 2 < ppl < 100  # a sane language model on English prose, not a numerically broken one


def test_greedy_generation_matches_transformers(smol_bundle: Bundle, smol_torch: Any) -> None:
    tokenizer = smol_bundle.tokenizer
    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False))
    steps = 12
    session = Session(smol_bundle)
    started = time.perf_counter()
    out = list(session.generate(ids, steps, stop_ids=[]))
    elapsed = time.perf_counter() - started
    tokens = [t for t, _ in out]
    with torch.no_grad():
        ref = smol_torch.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=2,
                                  output_logits=True, return_dict_in_generate=True)
    ref_tokens = ref.sequences[0, len(ids):].tolist()
    diff = max(float(np.abs(logits - r[0].numpy()).max()) for (_, logits), r in zip(out, ref.logits))
    print(f"\nSmolLM2 greedy ({len(ids)}-token chat prompt, {steps} tokens): {tokenizer.decode(tokens)!r}; "
          f"max |Δ logits| per step {diff:.2e}; topq {elapsed:.2f} s")
    assert tokens == ref_tokens
    assert diff <= 1e-3
    assert "Paris" in tokenizer.decode(tokens)
    assert any(c.startswith("block_cache_0_128") for c in session.calls)
