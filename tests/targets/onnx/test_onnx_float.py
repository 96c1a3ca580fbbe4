"""The onnx target on the tiny models in float modes: ONNX Runtime computes what the host interpreter computes.

f32 onnx bundles against the host bundle of the same checkpoint (DESIGN §2 scenarios: prefill, greedy decode, chat
on the KV cache, long prompts in segments), the stored graphs (valid ONNX, the Top signatures), and the errors
a user can meet.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from host_bundles import TINY_STAGES, TinyHost

from topq.core import cli
from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.pipeline import convert
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session, perplexity
from topq.ir.parser import parse_module

ATOL = 1e-4
VOCAB = 256
KINDS = ["llama", "qwen2", "qwen3", "llama_tied", "gemma2"]  # gemma2: softcap, window, Tanh
DECODE_RE = re.compile(r"block_cache_\d+(_\d+)?")

TinyFactory = Callable[..., TinyHost]


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


def convert_onnx(checkpoint: Path, output: Path, scheme: str = "f32", **stages: Any) -> Bundle:
    recipe = recipe_from_defaults(model={"path": str(checkpoint)}, quant={"scheme": scheme}, target={"chip": "onnx"},
                                  stages={**TINY_STAGES, **stages}, output={"path": str(output)})
    convert(recipe, progress=False)
    return Bundle(output)


@pytest.fixture(scope="module")
def pair(tiny_host: TinyFactory) -> Callable[[str], tuple[Bundle, Bundle]]:
    """`pair(kind)`: (host bundle, f32 onnx bundle) of the same tiny checkpoint, converted once per module."""
    cache: dict[str, tuple[Bundle, Bundle]] = {}

    def get(kind: str) -> tuple[Bundle, Bundle]:
        if kind not in cache:
            host = tiny_host(kind).bundle
            checkpoint = Path(host.recipe["model"]["path"])
            cache[kind] = (host, convert_onnx(checkpoint, checkpoint / "onnx_f32.topq"))
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_host(pair: Callable[[str], tuple[Bundle, Bundle]], kind: str) -> None:
    host, onnx_bundle = pair(kind)
    ids = prompt(13, seed=1)
    session = Session(onnx_bundle)
    got = session.feed(ids, all_logits=True)
    assert got.shape == (13, VOCAB)
    assert max_diff(got, Session(host).feed(ids, all_logits=True)) <= ATOL
    assert session.calls.count("block_0") == 1


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_32_tokens_and_every_decode_step_match_host(pair: Callable[[str], tuple[Bundle, Bundle]],
                                                          kind: str) -> None:
    host, onnx_bundle = pair(kind)
    ids = prompt(8, seed=2)
    got = list(Session(onnx_bundle).generate(ids, 32, stop_ids=[]))
    ref = list(Session(host).generate(ids, 32, stop_ids=[]))
    assert [t for t, _ in got] == [t for t, _ in ref] and len(got) == 32
    assert max(max_diff(a, b) for (_, a), (_, b) in zip(got, ref)) <= ATOL


@pytest.mark.parametrize("kind", KINDS)
def test_chat_turns_reuse_the_kv_cache_and_equal_one_pass(pair: Callable[[str], tuple[Bundle, Bundle]],
                                                          kind: str) -> None:
    """Three turns on one KV cache (prefill_kv on later turns); each turn's logits equal one fresh pass over the
    whole conversation so far, and the host's."""
    host, onnx_bundle = pair(kind)
    session = Session(onnx_bundle)
    for turn, user in enumerate((prompt(5, seed=10), prompt(7, seed=11), prompt(6, seed=12))):
        start, first_call = session.length, len(session.calls)
        rows = [session.feed(user, all_logits=True)]
        for _ in range(4):
            rows.append(session.decode(int(np.argmax(rows[-1][-1])))[None])
        got = np.concatenate(rows)
        one_pass = Session(onnx_bundle).feed(session.tokens, all_logits=True)[start:]
        assert max_diff(got, one_pass) <= ATOL, f"turn {turn + 1}"
        assert max_diff(got, Session(host).feed(session.tokens, all_logits=True)[start:]) <= ATOL
        calls = session.calls[first_call:]
        assert calls.count("block_kv_0") == (0 if turn == 0 else 1) and calls.count("block_0") == (turn == 0)
        assert sum(1 for c in calls if DECODE_RE.fullmatch(c)) == 4 * 2


@pytest.mark.parametrize("kind", KINDS)
def test_long_prompt_in_segments_equals_one_pass(pair: Callable[[str], tuple[Bundle, Bundle]], kind: str) -> None:
    """56 tokens = 3.5 × max_input_length: one prefill and three prefill_kv segments, equal to one pass (a bundle
    whose max_input_length holds the whole prompt) and to the host."""
    host, onnx_bundle = pair(kind)
    ids = prompt(56, seed=3)
    session = Session(onnx_bundle)
    got = session.feed(ids, all_logits=True)
    assert session.calls.count("block_0") == 1 and session.calls.count("block_kv_0") == 3
    checkpoint = Path(host.recipe["model"]["path"])
    wide = convert_onnx(checkpoint, checkpoint / "onnx_wide.topq", max_input_length=64, decode_chunks=[])
    one = Session(wide)
    assert max_diff(got, one.feed(ids, all_logits=True)) <= ATOL
    assert one.calls.count("block_kv_0") == 0
    assert max_diff(got, Session(host).feed(ids, all_logits=True)) <= ATOL


def test_graphs_are_valid_onnx_with_the_top_signatures(pair: Callable[[str], tuple[Bundle, Bundle]]) -> None:
    _, bundle = pair("qwen3")
    module = parse_module(bundle.program)
    functions = bundle.meta["target_meta"]["functions"]
    assert set(functions) == set(module.functions)
    names = set(bundle.tensor_names())
    for function in module:
        entry = functions[function.name]
        model = onnx.load_from_string(bytes(bundle.tensor(entry["graph"])))
        assert {o.domain or "" for o in model.opset_import} == {"", "com.microsoft"}
        assert max(o.version for o in model.opset_import if not o.domain) >= 17
        shapes = [[d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input]
        assert shapes == [list(t.shape) for t in function.input_types]
        shapes = [[d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.output]
        assert shapes == [list(t.shape) for t in function.result_types]
        external = {t.name for t in model.graph.initializer if t.external_data}
        assert external == set(entry["initializers"]) and external <= names
        assert not {n.op_type for n in model.graph.node} & {"MatMulNBits"}  # f32: plain MatMul
    # every weight is stored once, in float32, beside the graphs
    assert bundle.tensor("model.layers.0.self_attn.q_proj.weight").dtype == np.float32


def test_bf16_bundle_stores_bf16_weights_and_matches_host(tiny_host: TinyFactory, tmp_path: Path) -> None:
    checkpoint = tiny_host("llama").checkpoint
    ids = prompt(11, seed=5)
    bf16 = convert_onnx(checkpoint, tmp_path / "onnx_bf16.topq", scheme="bf16")
    host_recipe = recipe_from_defaults(model={"path": str(checkpoint)}, quant={"scheme": "bf16"},
                                       target={"chip": "host"}, stages=TINY_STAGES,
                                       output={"path": str(tmp_path / "host_bf16.topq")})
    convert(host_recipe, progress=False)
    assert bf16.tensor("model.layers.0.mlp.up_proj.weight").dtype.name == "bfloat16"
    got = Session(bf16).feed(ids, all_logits=True)
    assert max_diff(got, Session(Bundle(tmp_path / "host_bf16.topq")).feed(ids, all_logits=True)) <= ATOL


def test_cli_run_inspect_and_eval_work_unchanged(pair: Callable[[str], tuple[Bundle, Bundle]],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    host, bundle = pair("llama")
    capsys.readouterr()
    assert cli.main(["run", str(bundle.path), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "6", "--json"]) == 0
    got = capsys.readouterr().out
    assert cli.main(["run", str(host.path), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "6", "--json"]) == 0
    ref = capsys.readouterr().out
    assert json.loads(got)["tokens"] == json.loads(ref)["tokens"]
    assert cli.main(["inspect", str(bundle.path)]) == 0
    text = capsys.readouterr().out
    assert "target   onnx" in text and "onnx: opset 21 + com.microsoft" in text
    # `topq eval` runs this (the tiny checkpoints have no tokenizer for the command itself)
    ids = prompt(40, seed=9)
    got, ref = perplexity(bundle, ids, window=16), perplexity(host, ids, window=16)
    assert got[1] == ref[1] == 37 and got[0] == pytest.approx(ref[0], rel=1e-5)


def test_opening_without_onnxruntime_names_what_to_install(pair: Callable[[str], tuple[Bundle, Bundle]],
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    _, bundle = pair("llama")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` now raises ImportError
    with pytest.raises(TopqError, match=r"needs ONNX Runtime.*pip install 'onnxruntime"):
        Session(bundle)
    capsys.readouterr()
    assert cli.main(["run", str(bundle.path), "--prompt-ids", "5,6"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "onnxruntime" in err


def test_a_bundle_for_another_target_is_refused(pair: Callable[[str], tuple[Bundle, Bundle]]) -> None:
    from topq.plugins.targets.onnx.executor import OnnxExecutor

    host, _ = pair("llama")
    with pytest.raises(TopqError, match="compiled for host, not onnx"):
        OnnxExecutor(host)


def test_bundle_bytes_do_not_depend_on_who_builds_the_units(pair: Callable[[str], tuple[Bundle, Bundle]],
                                                           tmp_path: Path) -> None:
    """Two worker processes (units built in parallel, streamed from the build cache) write the same bytes."""
    import hashlib

    _, bundle = pair("llama")
    recipe = recipe_from_defaults(**{**bundle.recipe, "output": {"path": str(tmp_path / "jobs2.topq")}})
    convert(recipe, progress=False, jobs=2, use_cache=True, cache_dir=tmp_path / "cache")
    digest = [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in (bundle.path, tmp_path / "jobs2.topq")]
    assert digest[0] == digest[1]


def test_converting_without_the_onnx_package_names_what_to_install(pair: Callable[[str], tuple[Bundle, Bundle]],
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    _, bundle = pair("llama")
    monkeypatch.setitem(sys.modules, "onnx", None)
    recipe = recipe_from_defaults(**{**bundle.recipe, "output": {"path": str(tmp_path / "x.topq")}})
    with pytest.raises(TopqError, match=r"needs the onnx package.*pip install 'onnx>=1.17,<2'"):
        convert(recipe, progress=False)
