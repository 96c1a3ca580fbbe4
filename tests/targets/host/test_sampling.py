"""Sampling on the host runtime: seeded temperature / top-k / top-p picks and the repetition penalty, against
transformers' logits warpers and `generate` on the tiny models."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from host_bundles import TinyHost
from tiny_models import VOCAB, prompt
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from topq.core.bundle import Bundle
from topq.core.runtime import Sampling, Session

TinyFactory = Callable[..., TinyHost]


def sample(bundle: Bundle, ids: list[int], sampling: Sampling, n: int = 16) -> list[tuple[int, np.ndarray]]:
    return list(Session(bundle).generate(ids, n, sampling, stop_ids=[]))


def test_seeded_sampling_is_reproducible_and_respects_top_k_top_p(tiny_host: TinyFactory) -> None:
    bundle = tiny_host("llama").bundle
    ids = prompt(6, seed=8)

    def settings(seed: int) -> Sampling:
        return Sampling(greedy=False, temperature=0.8, top_k=20, top_p=0.9, seed=seed)

    first = sample(bundle, ids, settings(7))
    tokens = [t for t, _ in first]
    assert tokens == [t for t, _ in sample(bundle, ids, settings(7))]
    assert tokens != [t for t, _ in sample(bundle, ids, settings(8))]
    greedy = [t for t, _ in sample(bundle, ids, Sampling())]
    assert tokens != greedy  # it really sampled
    for token, logits in first:  # every pick is inside the top-k and inside the top-p nucleus
        scaled = logits.astype(np.float64) / 0.8
        order = np.argsort(-scaled, kind="stable")
        rank = int(np.nonzero(order == token)[0][0])
        assert rank < 20
        kept = scaled[order[:20]]
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        assert probs[:rank].sum() < 0.9


def test_top_k_1_and_zero_temperature_are_greedy(tiny_host: TinyFactory) -> None:
    bundle = tiny_host("qwen2").bundle
    ids = prompt(6, seed=9)
    greedy = [t for t, _ in sample(bundle, ids, Sampling())]
    assert [t for t, _ in sample(bundle, ids, Sampling(greedy=False, temperature=1.5, top_k=1, seed=1))] == greedy
    assert [t for t, _ in sample(bundle, ids, Sampling(greedy=False, temperature=0.0, seed=1))] == greedy


def test_sampling_distribution_matches_transformers_warpers() -> None:
    """Frequencies of 4000 seeded picks follow transformers' temperature → top-k → top-p distribution."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(64).astype(np.float32) * 2
    scores = torch.from_numpy(logits)[None]
    ids = torch.zeros(1, 1, dtype=torch.long)
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(8), TopPLogitsWarper(0.8)):
        scores = warper(ids, scores)
    expected = torch.softmax(scores, dim=-1)[0].numpy()
    sampling = Sampling(greedy=False, temperature=0.7, top_k=8, top_p=0.8, seed=123)
    picks = np.array([sampling.pick(logits) for _ in range(4000)])
    freq = np.bincount(picks, minlength=64) / picks.size
    assert set(np.nonzero(freq)[0]) <= set(np.nonzero(expected)[0])  # never outside the kept set
    assert np.abs(freq - expected).max() < 0.03


@pytest.mark.parametrize("shift", [0.0, -10.0])  # positive and all-negative logits: both branches of the rule
def test_repetition_penalty_like_transformers(shift: float) -> None:
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal(VOCAB) + shift).astype(np.float32)
    history = [int(np.argmax(logits)), 7, 9, 7]
    processed = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([history]), torch.from_numpy(logits)[None])
    expected = int(processed[0].argmax())
    assert expected != int(np.argmax(logits))  # the penalty changes the pick
    assert Sampling(repetition_penalty=1.8).pick(logits, history) == expected
    assert Sampling().pick(logits, history) == int(np.argmax(logits))


def test_repetition_penalty_generation_matches_transformers(tiny_host: TinyFactory) -> None:
    case = tiny_host("llama")
    ids = prompt(8, seed=13)
    tokens = [t for t, _ in sample(case.bundle, ids, Sampling(repetition_penalty=1.5), n=24)]
    with torch.no_grad():
        ref = case.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=24, do_sample=False, repetition_penalty=1.5, eos_token_id=None,
                                  pad_token_id=0)
    assert tokens == ref[0, len(ids):].tolist()
    assert tokens != [t for t, _ in sample(case.bundle, ids, Sampling(), n=24)]


def test_head_nll_is_token_nll_without_the_whole_logits() -> None:
    """`head_nll` (int8's search) is `token_nll` of the head's product, a few positions' logits at a time: the same
    value (to 1e-6 relative on any BLAS; bit for bit with the OpenBLAS kernels measured) with a last chunk shorter
    than the others, and its largest allocation a chunk's logits, not the [T, V] array."""
    import tracemalloc

    from topq.ir.sampling import head_nll, token_nll

    rng = np.random.default_rng(1)
    hidden = rng.normal(size=(150, 96)).astype(np.float32)
    head = (rng.normal(size=(4096, 96)) * 0.2).astype(np.float32)
    targets = rng.integers(0, 4096, size=150)
    want = token_nll(hidden @ head.T, targets)
    assert abs(head_nll(hidden, head, targets, rows=64) - want) <= 1e-6 * abs(want)
    assert head_nll(hidden, head, targets, rows=200) == token_nll(hidden @ head.T, targets)  # one chunk: the same
    tracemalloc.start()
    try:
        head_nll(hidden, head, targets, rows=32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    chunk, whole = 32 * 4096 * 4, 150 * 4096 * 4
    assert chunk <= peak < chunk + whole // 4


def test_token_nll_matches_torch_cross_entropy_on_a_49k_vocabulary() -> None:
    """`token_nll` (float32 exponentials, float64 sums; what perplexity and int8's search use) against torch's
    float64 cross entropy on SmolLM2-sized logits: within 1e-6 nats per token."""
    from topq.ir.sampling import token_nll

    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(64, 49152)) * 4 + rng.normal(size=(64, 1)) * 10).astype(np.float32)
    targets = rng.integers(0, 49152, size=64)
    want = float(torch.nn.functional.cross_entropy(torch.from_numpy(logits).double(), torch.from_numpy(targets),
                                                   reduction="sum"))
    assert abs(token_nll(logits, targets) - want) < 1e-6 * len(targets)
    # the work buffer may be the caller's logits (int8's search): the same value to the last bit
    assert token_nll(logits.copy(), targets, overwrite=True) == token_nll(logits, targets)
