"""Multi-turn chat through the tokenizer's chat template (KV reuse), the `chat` command, and `convert --dump-ir`."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from topq.core.cli import main
from topq.core.runtime import ChatSession, Session


def test_chat_session_reuses_kv_and_equals_recompute(smol_bundle: Any) -> None:
    chat = ChatSession(smol_bundle)
    first = chat.reply("Name a colour.", max_new_tokens=6)
    calls_before = len(chat.session.calls)
    second = chat.reply("And a fruit?", max_new_tokens=6)
    later_calls = chat.session.calls[calls_before:]
    assert first and second
    # The second turn extends the cache with prefill-with-history, never a fresh prefill.
    assert "block_kv_0" in later_calls and "block_0" not in later_calls
    # The reused cache holds what one from-scratch pass over the same tokens computes.
    tokens = list(chat.session.tokens)
    fresh = Session(smol_bundle)
    fresh.feed(tokens)
    n = len(tokens)
    for layer in (0, smol_bundle.spec.num_layers - 1):
        assert np.abs(chat.session.k_cache[layer][:, :n] - fresh.k_cache[layer][:, :n]).max() <= 1e-3
        assert np.abs(chat.session.v_cache[layer][:, :n] - fresh.v_cache[layer][:, :n]).max() <= 1e-3
    rendered = smol_bundle.tokenizer.apply_chat_template(chat.messages[:-1], add_generation_prompt=True,
                                                         tokenize=True, return_dict=False)
    assert tokens[:len(rendered)] == list(rendered)


def test_chat_command_answers_each_line(smol_bundle: Any, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n"))
    code = main(["chat", str(smol_bundle.path), "--max-new-tokens", "12"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Paris" in out and len(out.strip().splitlines()) == 2


def test_dump_ir_writes_one_checked_file_per_function(tiny_host: Any, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tiny_host("llama").checkpoint
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{path: {checkpoint}}}\ntarget: {{chip: host}}\n"
                      f"stages: {{seq_length: 32, max_input_length: 8, decode_chunks: [16]}}\n"
                      f"output: {{path: {tmp_path / 'm.topq'}}}\n")
    dump = tmp_path / "ir"
    assert main(["convert", str(recipe), "--dump-ir", str(dump), "--json"]) == 0
    names = sorted(p.stem for p in (dump / "top").glob("*.mlir"))
    expected = ["block_0", "block_1", "block_cache_0", "block_cache_0_16", "block_cache_1", "block_cache_1_16",
                "block_kv_0", "block_kv_1", "embedding", "embedding_cache", "lm_head"]
    assert names == expected
    capsys.readouterr()
    assert main(["ir", "check", str(dump / "top" / "block_kv_1.mlir")]) == 0
    text = capsys.readouterr().out
    assert "func.func @block_kv_1(" in text and '"top.FAttention"' in text and '"top.Concat"' in text
