"""Host runtime acceptance: every tiny model family, compiled to a host bundle, against transformers.

Covers the runtime scenarios of DESIGN §2 (prefill + decode, multi-turn chat on the KV cache, prompts longer
than max_input_length, decode-variant choice) and bundles without prefill_kv. Sampling and bundle refusal are
tests/targets/host/test_sampling.py and test_bundle_refusal.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from host_bundles import TinyHost
from tiny_models import KINDS, VOCAB, hf_logits, max_diff, prompt

from topq.core import cli
from topq.core.runtime import Session

ATOL = 1e-4
KIND_NAMES = list(KINDS)
PREFILL_RE = re.compile(r"block_\d+")
PREFILL_KV_RE = re.compile(r"block_kv_\d+")
DECODE_RE = re.compile(r"block_cache_\d+(_\d+)?")

TinyFactory = Callable[..., TinyHost]


def count(calls: Sequence[str], pattern: re.Pattern[str]) -> int:
    return sum(1 for c in calls if pattern.fullmatch(c))


def cli_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_prefill_logits_match_transformers(tiny_host: TinyFactory, kind: str) -> None:
    case = tiny_host(kind)
    ids = prompt(13, seed=1)
    session = Session(case.bundle)
    got = session.feed(ids, all_logits=True)
    assert got.shape == (13, VOCAB)
    assert max_diff(got, hf_logits(case.model, ids)) <= ATOL
    assert session.calls.count("block_0") == 1 and count(session.calls, PREFILL_KV_RE) == 0


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_greedy_generation_matches_transformers(tiny_host: TinyFactory, kind: str) -> None:
    case = tiny_host(kind)
    ids = prompt(8, seed=2)
    steps = list(Session(case.bundle).generate(ids, 32, stop_ids=[]))
    tokens = [t for t, _ in steps]
    with torch.no_grad():
        ref = case.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
                                  output_logits=True, return_dict_in_generate=True)
    assert tokens == ref.sequences[0, len(ids):].tolist()
    assert len(ref.logits) == len(steps) == 32
    worst = max(max_diff(logits, ref_logits[0].float().numpy()) for (_, logits), ref_logits in zip(steps, ref.logits))
    assert worst <= ATOL


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_multi_turn_reuses_kv_cache(tiny_host: TinyFactory, kind: str) -> None:
    """Three turns on one KV cache; each turn's logits equal a fresh forward over the whole conversation."""
    case = tiny_host(kind)
    session = Session(case.bundle)
    for turn, user in enumerate((prompt(5, seed=10), prompt(7, seed=11), prompt(6, seed=12))):
        start, first_call = session.length, len(session.calls)
        rows = [session.feed(user, all_logits=True)]
        for _ in range(4):  # greedy reply of four tokens, kept in the cache
            rows.append(session.decode(int(np.argmax(rows[-1][-1])))[None])
        got = np.concatenate(rows)
        assert session.length == start + len(user) + 4
        ref = hf_logits(case.model, session.tokens)[start:]
        assert max_diff(got, ref) <= ATOL, f"turn {turn + 1}"
        calls = session.calls[first_call:]
        if turn == 0:
            assert count(calls, PREFILL_RE) == 2 and count(calls, PREFILL_KV_RE) == 0
        else:  # later turns run prefill-with-history on the cached KV, never a fresh prefill
            assert count(calls, PREFILL_RE) == 0 and count(calls, PREFILL_KV_RE) == 2, calls
        assert count(calls, DECODE_RE) == 4 * 2


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_long_prompt_is_fed_in_segments(tiny_host: TinyFactory, kind: str) -> None:
    """56 tokens = 3.5 × max_input_length: one prefill plus three prefill_kv segments, equal to one forward."""
    case = tiny_host(kind)
    ids = prompt(56, seed=3)
    session = Session(case.bundle)
    got = session.feed(ids, all_logits=True)
    assert max_diff(got, hf_logits(case.model, ids)) <= ATOL
    assert session.calls.count("embedding") == 4
    assert session.calls.count("block_0") == 1 and session.calls.count("block_kv_0") == 3
    assert count(session.calls, DECODE_RE) == 0


# (history length before the decode step, decode function it must run)
VARIANT_CASES = [(10, "block_cache_0_16"), (16, "block_cache_0_16"), (17, "block_cache_0_32"),
                 (20, "block_cache_0_32"), (32, "block_cache_0_32"), (33, "block_cache_0"), (40, "block_cache_0")]


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_decode_picks_smallest_variant(tiny_host: TinyFactory, kind: str) -> None:
    case = tiny_host(kind)
    assert Session(case.bundle).decode_variants == [16, 32, 64]
    ids = prompt(41, seed=4)
    for history, expected in VARIANT_CASES:
        small = Session(case.bundle)
        small.feed(ids[:history])
        first = len(small.calls)
        got = small.decode(ids[history])
        decode_calls = [c for c in small.calls[first:] if c.startswith("block_cache_0")]
        assert decode_calls == [expected], (history, decode_calls)

        full = Session(case.bundle)
        full.decode_variants = [64]
        full.feed(ids[:history])
        first = len(full.calls)
        ref = full.decode(ids[history])
        assert [c for c in full.calls[first:] if c.startswith("block_cache_0")] == ["block_cache_0"]
        assert max_diff(got, ref) <= 1e-5, history
    # and the last one against transformers, so the comparison above is not between two wrong answers
    assert max_diff(got, hf_logits(case.model, ids[:41])[-1]) <= ATOL


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_bundle_without_prefill_kv(tiny_host: TinyFactory, kind: str) -> None:
    """Without block_kv_*, a prompt longer than max_input_length is a prefill plus decode steps."""
    case = tiny_host(kind, prefill_kv=False)
    assert "block_kv_0" not in case.bundle.program and case.bundle.meta["stages"]["prefill_kv"] is False
    ids = prompt(20, seed=5)
    session = Session(case.bundle)
    got = session.feed(ids, all_logits=True)
    assert max_diff(got, hf_logits(case.model, ids)) <= ATOL
    assert count(session.calls, PREFILL_RE) == 2 and count(session.calls, PREFILL_KV_RE) == 0
    assert count(session.calls, DECODE_RE) == 4 * 2
    # a second turn goes through decode steps too, still equal to the whole conversation
    more = prompt(5, seed=6)
    got = session.feed(more, all_logits=True)
    assert max_diff(got, hf_logits(case.model, ids + more)[20:]) <= ATOL


@pytest.mark.parametrize("prefill_kv", [False, True])
def test_prompt_longer_than_seq_length_is_a_clear_cli_error(tiny_host: TinyFactory, prefill_kv: bool,
                                                            capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    bundle = tiny_host("llama", prefill_kv=prefill_kv).bundle
    logits_out = tmp_path / "logits.npy"
    ids = ",".join(map(str, prompt(65, seed=7)))
    code, out, err = cli_run(capsys, "run", str(bundle.path), "--prompt-ids", ids, "--logits-out", str(logits_out))
    assert code != 0 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert "65" in err and "seq_length 64" in err
    assert not logits_out.exists()
    # exactly seq_length tokens fit: the prompt fills the cache and one token comes out
    ids = ",".join(map(str, prompt(64, seed=7)))
    code, out, err = cli_run(capsys, "run", str(bundle.path), "--prompt-ids", ids, "--max-new-tokens", "4", "--json")
    assert code == 0, err
    assert len(json.loads(out)["tokens"]) == 1
