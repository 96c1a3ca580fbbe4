"""`target.attention`: the onnx target's attention as GroupQueryAttention or as standard ops, on the tiny models.

test_onnx_float.py runs the default (`auto`: GroupQueryAttention in prefill, standard ops on a history) through
every scenario on five families; here each mode runs one conversation that reaches every stage — a prompt of 2.5 ×
max_input_length (prefill + two prefill_kv segments), decode steps, a second turn on the same KV cache
(prefill_kv) and more decode steps — against the host bundle, on a plain model and on windowed ones whose
6-token window every stage runs past. Plus the graphs each mode builds and what `gqa` refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from host_bundles import TINY_STAGES, TinyHost
from tiny_models import build_tiny

from topq.core import cli
from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.pipeline import convert
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session

ATOL = 1e-4
TinyFactory = Callable[..., TinyHost]


def convert_onnx(checkpoint: Path, output: Path, attention: str) -> Bundle:
    recipe = recipe_from_defaults(model={"path": str(checkpoint)}, quant={"scheme": "f32"},
                                  target={"chip": "onnx", "attention": attention}, stages=dict(TINY_STAGES),
                                  output={"path": str(output)})
    convert(recipe, progress=False)
    return Bundle(output)


def conversation(bundle: Bundle) -> tuple[np.ndarray, list[str]]:
    """Every logits row of: a 40-token prompt, 5 greedy decode steps, a 7-token second turn, 4 more steps."""
    session = Session(bundle)
    rng = np.random.default_rng(5)
    rows = [session.feed(rng.integers(3, 256, 40).tolist(), all_logits=True)]
    for turn in (0, 1):
        for _ in range(5 if turn == 0 else 4):
            rows.append(session.decode(int(np.argmax(rows[-1][-1])))[None])
        if turn == 0:
            rows.append(session.feed(rng.integers(3, 256, 7).tolist(), all_logits=True))
    return np.concatenate(rows), session.calls


def graph_nodes(bundle: Bundle, function: str) -> list[onnx.NodeProto]:
    entry = bundle.meta["target_meta"]["functions"][function]
    return list(onnx.load_from_string(bytes(bundle.tensor(entry["graph"]))).graph.node)


@pytest.mark.parametrize("kind,attention", [
    ("llama", "gqa"), ("qwen3", "gqa"), ("gemma2", "gqa"), ("qwen2_window", "gqa"),  # q/k norms; soft-cap + window
    ("llama", "standard"), ("gemma2", "standard"), ("llama", "auto")])
def test_every_stage_matches_host(tiny_host: TinyFactory, kind: str, attention: str) -> None:
    host = tiny_host(kind).bundle
    checkpoint = Path(host.recipe["model"]["path"])
    bundle = convert_onnx(checkpoint, checkpoint / f"onnx_{attention}.topq", attention)
    got, calls = conversation(bundle)
    ref, _ = conversation(host)
    assert got.shape == ref.shape == (40 + 5 + 7 + 4, 256)
    assert float(np.abs(got - ref).max()) <= ATOL
    assert calls.count("block_0") == 1 and calls.count("block_kv_0") == 3  # 16 + 2 × 16 (last 8), then turn 2
    gqa_nodes = bundle.meta["target_meta"]["gqa_nodes"]
    functions = [f for f in bundle.meta["target_meta"]["functions"] if f.startswith("block")]
    if attention == "gqa":  # every block function (prefill, prefill_kv, each decode variant) of both layers
        assert gqa_nodes == len(functions) == 2 * (2 + len(TINY_STAGES["decode_chunks"]) + 1)
        # the history (arg3, arg4) is only sliced to its filled rows, never concatenated with the new keys
        readers = {n.op_type for n in graph_nodes(bundle, "block_cache_0") if {"arg3", "arg4"} & set(n.input)}
        assert readers == {"Slice"}
    else:  # standard ops everywhere, or (auto) GroupQueryAttention in prefill only
        assert gqa_nodes == (2 if attention == "auto" else 0)
        assert ("GroupQueryAttention" in {n.op_type for n in graph_nodes(bundle, "block_1")}) == (attention == "auto")
        assert "GroupQueryAttention" not in {n.op_type for n in graph_nodes(bundle, "block_kv_1")}


def test_auto_uses_group_query_attention_where_it_fits_and_standard_ops_elsewhere(
        tmp_path: Path, tiny_host: TinyFactory, capsys: pytest.CaptureFixture[str]) -> None:
    """Head size 12 (not a multiple of 8): `auto` keeps the standard ops in prefill too and still equals
    transformers; `gqa` is refused before any graph is built, naming the function and the reason."""
    model = build_tiny("llama", tmp_path / "hf", overrides={"head_dim": 12})
    auto = convert_onnx(tmp_path / "hf", tmp_path / "auto.topq", "auto")
    assert auto.meta["target_meta"]["gqa_nodes"] == 0 and auto.meta["target_meta"]["attention"] == "auto"
    import torch

    ids = np.random.default_rng(2).integers(3, 256, 20).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    assert float(np.abs(Session(auto).feed(ids, all_logits=True) - ref).max()) <= ATOL
    with pytest.raises(TopqError, match=r"target.attention = gqa: @block_0 has head size 12 \(GroupQueryAttention "
                                        r"needs a multiple of 8\); use target.attention: auto or standard"):
        convert_onnx(tmp_path / "hf", tmp_path / "gqa.topq", "gqa")
    assert not (tmp_path / "gqa.topq").exists()
    # the default bundle of a fitting model: inspect names the mode and the fused nodes
    assert cli.main(["inspect", str(auto.path)]) == 0
    assert "attention auto (0 GroupQueryAttention)" in capsys.readouterr().out


def test_a_bad_attention_value_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{path: {tmp_path}}}\ntarget: {{chip: onnx, attention: flash}}\n")
    assert cli.main(["convert", str(recipe)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "target.attention" in err[0] and "auto, gqa, standard" in err[0], err
    assert "Traceback" not in err[0]
