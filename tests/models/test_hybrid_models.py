"""Hybrid linear-attention families (Gated DeltaNet + full attention every 2nd layer) on the host, against
transformers: prefill, every decode step, greedy generation, chat turns on the carried state (and going back in a
conversation), long prompts in segments, and the stage layout recurrent layers get (no KV, no decode variants)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from host_bundles import TinyHost
from tiny_models import HYBRID_KINDS, hf_logits, max_diff, prompt

from topq.core.bundle import Bundle
from topq.core.runtime import Session

ATOL = 1e-4
KINDS = list(HYBRID_KINDS)
#: the kinds with sparse MoE layers (layer 1 sparse, layer 0 dense)
SPARSE = ("qwen3_next_moe",)
TinyFactory = Callable[..., TinyHost]


@pytest.mark.parametrize("kind", KINDS)
def test_stage_layout_of_recurrent_and_attention_layers(tiny_host: TinyFactory, kind: str) -> None:
    bundle = tiny_host(kind).bundle
    carries = bundle.meta["stages"]["layer_states"]
    assert [bool(c) for c in carries] == [True, False]  # linear, full
    assert [name for name, _ in carries[0]] == ["conv", "recurrent"]
    program = bundle.program
    assert "func @block_cache_0(" in program and "@block_cache_0_16" not in program  # the recurrent layer: one decode
    assert "@block_cache_1_16(" in program and "@block_cache_1_32(" in program  # variants only for attention
    assert "top.ChunkGatedDeltaRule" in program and "top.GatedDeltaRule" in program
    # the sparse layer's feed-forward is one top.MoE in each of its functions (prefill, prefill_kv, 3 decodes)
    assert program.count("top.MoE") == (5 if kind in SPARSE else 0)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_and_every_decode_step_match_transformers(tiny_host: TinyFactory, kind: str) -> None:
    case = tiny_host(kind)
    ids = prompt(8, seed=2)
    session = Session(case.bundle)
    prefill = session.feed(ids, all_logits=True)
    assert max_diff(prefill, hf_logits(case.model, ids)) <= ATOL
    session.reset()
    steps = list(session.generate(ids, 32, stop_ids=[]))
    with torch.no_grad():
        ref = case.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
                                  output_logits=True, return_dict_in_generate=True)
    assert [t for t, _ in steps] == ref.sequences[0, len(ids):].tolist()
    assert len(steps) == len(ref.logits) == 32
    worst = max(max_diff(logits, r[0].float().numpy()) for (_, logits), r in zip(steps, ref.logits))
    assert worst <= ATOL
    # 31 decode steps, each through the recurrent layer's single decode function and an attention variant
    assert session.calls.count("block_cache_0") == 31
    assert sum(c.startswith("block_cache_1") for c in session.calls) == 31


@pytest.mark.parametrize("kind", KINDS)
def test_chat_turns_hand_the_state_over(tiny_host: TinyFactory, kind: str) -> None:
    """Three turns on one session: each turn's logits equal a fresh forward over the whole conversation; later
    turns run prefill-with-history from the carried state, never a fresh prefill."""
    case = tiny_host(kind)
    session = Session(case.bundle)
    for turn, user in enumerate((prompt(5, seed=10), prompt(7, seed=11), prompt(6, seed=12))):
        start, first_call = session.length, len(session.calls)
        rows = [session.feed(user, all_logits=True)]
        for _ in range(4):
            rows.append(session.decode(int(np.argmax(rows[-1][-1])))[None])
        assert max_diff(np.concatenate(rows), hf_logits(case.model, session.tokens)[start:]) <= ATOL, turn
        calls = session.calls[first_call:]
        assert calls.count("block_0") == (1 if turn == 0 else 0)
        assert calls.count("block_kv_0") == (0 if turn == 0 else 1)


@pytest.mark.parametrize("kind", KINDS)
def test_going_back_in_a_conversation_restores_the_state(tiny_host: TinyFactory, kind: str) -> None:
    """A state cannot be cut back: truncating goes back to the states saved after a feed and feeds again."""
    case = tiny_host(kind)
    session = Session(case.bundle)
    first, second = prompt(9, seed=20), prompt(6, seed=21)
    session.feed(first)
    session.feed(second)
    for _ in range(3):
        session.decode(7)
    session.truncate(len(first) + 2)  # inside the second turn: back to the first turn's states, then 2 tokens
    assert session.tokens == first + second[:2]
    other = prompt(4, seed=22)
    got = session.feed(other, all_logits=True)
    assert max_diff(got, hf_logits(case.model, first + second[:2] + other)[-4:]) <= ATOL
    session.reset()
    assert session.length == 0
    assert max_diff(session.feed(other, all_logits=True), hf_logits(case.model, other)) <= ATOL


@pytest.mark.parametrize("kind", KINDS)
def test_long_prompt_in_segments_equals_one_pass(tiny_host: TinyFactory, kind: str) -> None:
    """56 tokens = 3.5 × max_input_length: a prefill and three prefill_kv segments, the last one half padding."""
    case = tiny_host(kind)
    ids = prompt(56, seed=3)
    session = Session(case.bundle)
    got = session.feed(ids, all_logits=True)
    assert max_diff(got, hf_logits(case.model, ids)) <= ATOL
    assert session.calls.count("block_0") == 1 and session.calls.count("block_kv_0") == 3
    # the padding of the last segment did not reach the state: decoding on from it still matches
    next_logits = session.decode(int(np.argmax(got[-1])))
    assert max_diff(next_logits, hf_logits(case.model, session.tokens)[-1]) <= ATOL


@pytest.mark.parametrize("kind", KINDS)
def test_without_prefill_kv_later_tokens_are_decode_steps(tiny_host: TinyFactory, kind: str) -> None:
    case = tiny_host(kind, prefill_kv=False)
    ids = prompt(20, seed=5)
    session = Session(case.bundle)
    got = session.feed(ids, all_logits=True)
    assert max_diff(got, hf_logits(case.model, ids)) <= ATOL
    assert session.calls.count("block_0") == 1 and session.calls.count("block_cache_0") == 4


@pytest.mark.parametrize("kind", KINDS)
def test_w4bf16_runs_close_to_float(tiny_host: TinyFactory, kind: str, tmp_path: Path) -> None:
    from topq.core.pipeline import convert
    from topq.core.recipe import recipe_from_defaults

    case = tiny_host(kind)
    out = tmp_path / "w4.topq"
    recipe = recipe_from_defaults(model={"path": str(case.checkpoint)}, quant={"scheme": "w4bf16", "group_size": 16},
                                  target={"chip": "host"}, stages={"seq_length": 64, "max_input_length": 16},
                                  output={"path": str(out)})
    convert(recipe, progress=False)
    ids = prompt(20, seed=6)
    quantized = Session(Bundle(out)).feed(ids, all_logits=True)
    reference = hf_logits(case.model, ids)
    assert np.isfinite(quantized).all()
    cos = float((quantized * reference).sum() / np.linalg.norm(quantized) / np.linalg.norm(reference))
    # a random tiny model at 4 bits: the dense qwen3 tiny model gives 0.97 here, these 0.94..0.96; the sparse
    # kind 0.88: 4-bit noise flips some tokens' top-2 experts (at w8bf16 it gives 0.998)
    assert (0.8 if kind in SPARSE else 0.9) <= cos < 0.9999, cos
    bundle = Bundle(out)
    quantized_linears = ["model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.out_proj.weight",
                         "model.layers.1.self_attn.q_proj.weight"]  # the linear layers' linears are quantized too
    if kind in SPARSE:  # and so are the experts, the shared one included
        quantized_linears += ["model.layers.1.mlp.experts.3.down_proj.weight",
                              "model.layers.1.mlp.shared_expert.up_proj.weight"]
    for name in quantized_linears:
        groups = bundle.tensor(name).astype(np.float32).reshape(-1, 16)
        assert max(len(np.unique(g)) for g in groups) <= 16, name
    conv = bundle.tensor("model.layers.0.linear_attn.conv1d.weight").astype(np.float32)
    assert len(np.unique(conv)) > 16  # not a linear: kept


@pytest.mark.parametrize("kind", KINDS)
def test_bundles_of_kv_models_keep_their_stage_metadata(tiny_host: TinyFactory, kind: str) -> None:
    assert "layer_states" not in tiny_host("llama").bundle.meta["stages"]
    assert "layer_types" not in tiny_host("llama").bundle.meta["spec"]
    assert tiny_host(kind).bundle.spec.layer_types == ("linear_attention", "full_attention")


@pytest.mark.parametrize("kind, scheme", [("qwen3_5", "gptq"), ("qwen3_5", "awq"), ("qwen3_next_moe", "gptq"),
                                           ("qwen3_next_moe", "awq")])
def test_calibrated_schemes_run_through_both_layer_kinds(tiny_host: TinyFactory, kind: str, scheme: str,
                                                         tmp_path: Path) -> None:
    """Calibration runs each layer's prefill (a recurrent one with its `valid` input) and takes the quant groups
    of that layer's kind (and a sparse layer's experts); at 8 bits the model stays the float model (AWQ's folded
    scales included)."""
    from topq.core.pipeline import convert
    from topq.core.recipe import recipe_from_defaults

    case = tiny_host(kind)
    ids = tmp_path / "calibration.ids"
    ids.write_text(" ".join(map(str, prompt(256, seed=30))))
    out = tmp_path / f"{scheme}.topq"
    convert(recipe_from_defaults(
        model={"path": str(case.checkpoint)}, target={"chip": "host"}, output={"path": str(out)},
        stages={"seq_length": 64, "max_input_length": 16},
        quant={"scheme": scheme, "bits": 8, "group_size": 16,
               "calibration": {"data": str(ids), "samples": 4, "seq_len": 32}}), progress=False)
    ids20 = prompt(20, seed=6)
    got, ref = Session(Bundle(out)).feed(ids20, all_logits=True), hf_logits(case.model, ids20)
    cos = float((got * ref).sum() / np.linalg.norm(got) / np.linalg.norm(ref))
    assert 0.999 <= cos < 0.9999999, cos


def test_only_the_last_feeds_states_are_kept(tiny_host: TinyFactory) -> None:
    """Going back past the saved states feeds again from the start, still exactly."""
    from topq.core.runtime import SAVED_STATES

    case = tiny_host("qwen3_5")
    session = Session(case.bundle)
    turns = [prompt(3, seed=40 + i) for i in range(SAVED_STATES + 2)]
    for turn in turns:
        session.feed(turn)
    assert len(session._saved) == SAVED_STATES
    first = len(session.calls)
    session.truncate(4)  # inside the second turn: no saved states that early
    assert session.calls[first:].count("block_0") == 1  # fed again from a fresh prefill
    more = prompt(5, seed=50)
    got = session.feed(more, all_logits=True)
    assert max_diff(got, hf_logits(case.model, (turns[0] + turns[1])[:4] + more)[-5:]) <= ATOL
