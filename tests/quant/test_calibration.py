"""Calibration data (formats, windows, errors) and the layer loop (captured inputs, quantized propagation, folding)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from data_paths import AUSTEN

from topq.core.errors import TopqError
from topq.core.recipe import recipe_from_defaults
from topq.io.tokenizer import tokenizer_files_of
from topq.ir.interpreter import Interpreter
from topq.ir.products import gram_upper, matmul, products
from topq.plugins.quant.autoround import SCHEME as autoround_scheme
from topq.plugins.quant.awq import SCHEME as awq_scheme
from topq.plugins.quant.gptq import SCHEME as gptq_scheme
from topq.quant.calibration import (
    HessianStats,
    InputStats,
    LayerState,
    calibration_windows,
    read_token_stream,
    run_calibration,
    sample_windows,
)
from topq.quant.grid import rtn

WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog"]


@pytest.fixture(scope="module")
def tokenizer_files() -> dict[str, str]:
    """A word-level tokenizer (id = index in WORDS), saved like a checkpoint's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer_files_of(PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]"))


# ------------------------------------------------------------------------------------------- formats


def test_token_id_files(tmp_path: Path) -> None:
    (tmp_path / "a.ids").write_text("1, 2,3\n4\t5  6,\n")
    np.save(tmp_path / "b.npy", np.array([[7, 8], [9, 10]], dtype=np.int16))
    np.testing.assert_array_equal(read_token_stream(tmp_path / "a.ids"), [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(read_token_stream(tmp_path / "b.npy"), [7, 8, 9, 10])
    # A directory: every file, in sorted path order (a.ids before b.npy before sub/c.ids); hidden files skipped.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.ids").write_text("11")
    (tmp_path / ".hidden.ids").write_text("99")
    np.testing.assert_array_equal(read_token_stream(tmp_path), list(range(1, 12)))


def test_text_and_jsonl_use_the_checkpoint_tokenizer(tmp_path: Path, tokenizer_files: dict[str, str]) -> None:
    (tmp_path / "t.txt").write_text("the cat sat\n\non the mat")
    (tmp_path / "r.jsonl").write_text(json.dumps({"text": "a dog"}) + "\n\n" + json.dumps({"text": "the zebra"}) + "\n")
    np.testing.assert_array_equal(read_token_stream(tmp_path / "t.txt", tokenizer_files), [1, 2, 3, 4, 1, 5])
    np.testing.assert_array_equal(read_token_stream(tmp_path / "r.jsonl", tokenizer_files), [6, 7, 1, 0])


def test_long_text_is_tokenized_in_chunks_without_losing_tokens(tmp_path: Path,
                                                                tokenizer_files: dict[str, str]) -> None:
    paragraph = "the cat sat on the mat " * 20 + "\n\n"
    (tmp_path / "long.txt").write_text(paragraph * 400)  # ~190 kB: several tokenizer calls
    tokens = read_token_stream(tmp_path / "long.txt", tokenizer_files, progress=False)
    assert len(tokens) == 400 * 20 * 6
    np.testing.assert_array_equal(tokens[:6], [1, 2, 3, 4, 1, 5])


def test_text_split_points() -> None:
    from topq.quant.calibration import _split_text

    text = ("word " * 50 + "\n\n") * 30
    for size in (7, 100, 1000, 10**6):
        pieces = _split_text(text, size)
        assert "".join(pieces) == text and max(map(len, pieces)) <= size
    assert all(p.endswith("\n\n") for p in _split_text(text, 1000)[:-1])  # after paragraph breaks when possible
    assert _split_text("ab cd ef", 4) == ["ab", " cd", " ef"]  # else before a space (BPE's word start)
    assert _split_text("abcdefghij", 4) == ["abcd", "efgh", "ij"]


@pytest.mark.parametrize("name, content, message", [
    ("missing.ids", None, "calibration data not found"),
    ("empty.ids", " \n", "has no tokens"),
    ("bad.ids", "1 2 x3", "'x3' is not a token id"),
    ("big.ids", "1 300 2", "token id 300 is outside the vocabulary \\[0, 256\\)"),
    ("neg.ids", "1 -4 2", "token id -4 is outside the vocabulary"),
    ("rec.jsonl", '{"txt": "a"}', "rec.jsonl:1: expected an object with a string field 'text'"),
    ("broken.jsonl", '{"text": ', "broken.jsonl:1: invalid JSON"),
    ("float.npy", np.zeros(4, dtype=np.float32), "token ids must be integers"),
    ("plain.txt", "some text", "is text but the checkpoint has no tokenizer"),
])
def test_data_errors(tmp_path: Path, name: str, content: Any, message: str) -> None:
    path = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(path, content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(TopqError, match=message):
        read_token_stream(path, tokenizer_files=None, vocab_size=256)


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(TopqError, match="has no files"):
        read_token_stream(tmp_path)


# ------------------------------------------------------------------------------------------- windows


def test_windows_are_deterministic_distinct_slices() -> None:
    tokens = np.arange(1000, dtype=np.int64)
    a = sample_windows(tokens, 8, 50, seed=3)
    assert a.shape == (8, 50) and a.dtype == np.int32
    np.testing.assert_array_equal(a, sample_windows(tokens, 8, 50, seed=3))
    assert not np.array_equal(a, sample_windows(tokens, 8, 50, seed=4))
    starts = a[:, 0]
    np.testing.assert_array_equal(a, starts[:, None] + np.arange(50))  # contiguous slices of the stream
    assert (np.diff(np.sort(starts)) >= 50).all()  # never overlapping
    exact = sample_windows(tokens, 20, 50, seed=0)  # exactly enough tokens: the whole stream, in order
    np.testing.assert_array_equal(exact.reshape(-1), tokens)


def test_too_short() -> None:
    with pytest.raises(TopqError, match=r"needs 128 tokens \(4 samples × 32\), has 100"):
        sample_windows(np.arange(100), 4, 32, seed=0, source="x.ids")


def test_scheme_without_data(tmp_path: Path) -> None:
    model = SimpleNamespace(checkpoint=SimpleNamespace(tokenizer_files={}), spec=SimpleNamespace(vocab_size=256))
    recipe = recipe_from_defaults(model={"path": str(tmp_path)}, quant={"scheme": "gptq"})
    with pytest.raises(TopqError, match="scheme gptq needs calibration data: set quant.calibration.data"):
        calibration_windows(model, recipe)  # type: ignore[arg-type]
    (tmp_path / "few.ids").write_text("1 2 3")
    recipe = recipe_from_defaults(model={"path": str(tmp_path)},
                                  quant={"scheme": "gptq", "calibration": {"data": str(tmp_path / "few.ids"),
                                                                           "samples": 2, "seq_len": 8}})
    with pytest.raises(TopqError, match="needs 16 tokens"):
        calibration_windows(model, recipe)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- the layer loop

SEQ = 16


def windows(samples: int = 3, seed: int = 0) -> np.ndarray:
    text = (AUSTEN / "00_EMMA.txt").read_bytes()[:4000]
    return sample_windows(np.frombuffer(text, dtype=np.uint8).astype(np.int64), samples, SEQ, seed)


def hidden_states(model: Any, ids: np.ndarray, weights: dict[str, np.ndarray], upto: int) -> np.ndarray:
    """Input of layer `upto` for each window, by the plain reference interpreter with `weights` overriding."""
    interp = Interpreter(model.module, lambda n: weights[n] if n in weights else model.weight(n))
    positions = np.arange(SEQ, dtype=np.int32)[None]
    out = []
    for w in ids:
        h = interp.run("embedding", [w[None]])[0]
        for layer in range(upto):
            h = interp.run(f"block_{layer}", [h, positions])[0]
        out.append(h[0])
    return np.stack(out)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rtn_solver(seen: dict[tuple[int, tuple[str, ...]], InputStats]) -> Any:
    def solve(group: Any, state: LayerState, options: Any) -> None:
        seen[(group.layer, group.keys)] = group.stats
        stacked = np.concatenate([state.float_weight(n) for n in group.names])
        state.set_quantized_rows(group.names, rtn(stacked, 4, 32, False))

    return solve


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_the_hessian_is_the_mean_of_the_samples_upper_triangles_mirrored(kind: str) -> None:
    """InputStats sums only the Grams' upper strips (float64, sample order) and mirrors them: the bits of each
    sample's upper triangle summed, on both sides of the diagonal. In float32 that is the whole products' sum (numpy's
    product is symmetric)."""
    rng = np.random.default_rng(6)
    k = 300  # two strips, the second narrower
    stats, upper, whole = InputStats(k), np.zeros((k, k)), np.zeros((k, k))
    with products(kind):
        for _ in range(3):
            x = rng.standard_normal((2, 70, k), dtype=np.float32) * rng.uniform(0.1, 4.0, k).astype(np.float32)
            stats.add(x)
            x2 = x.reshape(-1, k)
            for start, strip in zip(range(0, k, 256), gram_upper(x2)):
                upper[start:start + 256, start:] += np.triu(strip, 0)  # on and above the diagonal
            whole += matmul(x2.T, x2)
    h = stats.hessian()
    expected = np.triu(upper) + np.triu(upper, 1).T
    np.testing.assert_array_equal(h, expected / 420)
    np.testing.assert_array_equal(h, h.T)
    assert stats.count == 420
    if kind == "f32":
        np.testing.assert_array_equal(h, whole / 420)
    else:
        np.testing.assert_allclose(h, whole / 420, rtol=2.0 ** -6, atol=0.02 * float(np.abs(whole).max()) / 420)


def test_hessian_stats_are_input_stats_without_the_magnitudes() -> None:
    """GPTQ's and AutoRound's observer: the same H bits as InputStats', and no Σ|x| (AWQ's), refused if asked."""
    rng = np.random.default_rng(5)
    full, lean = InputStats(48), HessianStats(48)
    for _ in range(3):
        x = rng.standard_normal((2, 40, 48), dtype=np.float32)
        full.add(x)
        lean.add_summary(HessianStats.summarize(x))
    np.testing.assert_array_equal(lean.hessian(), full.hessian())
    assert lean.count == full.count == 240
    assert HessianStats.summarize(x)[1] is None
    with pytest.raises(TopqError, match=r"^HessianStats does not collect mean \|x\|: observe with InputStats$"):
        lean.abs_mean()
    assert gptq_scheme.observe is HessianStats and autoround_scheme.observe is HessianStats
    assert awq_scheme.observe is InputStats  # AWQ's scales read mean |x|


def test_groups_capture_the_right_inputs_and_see_quantized_layers(loaded_tiny: Any) -> None:
    model = loaded_tiny("llama", SEQ)
    ids = windows()
    seen: dict[tuple[int, tuple[str, ...]], InputStats] = {}
    result = run_calibration(model, ids, rtn_solver(seen), {"group_size": 32}, progress=False)
    names = {n for n in model.checkpoint.weights.names() if n.endswith("proj.weight")}
    assert set(result) == names  # every decoder linear, nothing else (no lm_head / embedding)
    assert [k for (layer, k) in seen if layer == 0] == [("q_proj", "k_proj", "v_proj"), ("o_proj",),
                                                         ("gate_proj", "up_proj"), ("down_proj",)]
    eps = model.spec.rms_norm_eps

    # Layer 0, q/k/v: RMSNorm(embedding) — and nothing quantized upstream.
    x0 = rms_norm(hidden_states(model, ids, {}, 0), model.weight("model.layers.0.input_layernorm.weight"), eps)
    x0 = x0.reshape(-1, x0.shape[-1]).astype(np.float64)
    stats = seen[(0, ("q_proj", "k_proj", "v_proj"))]
    assert stats.count == 3 * SEQ
    np.testing.assert_allclose(stats.hessian(), x0.T @ x0 / len(x0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats.abs_mean(), np.abs(x0).mean(axis=0), rtol=1e-5)

    # Layer 1, q/k/v: its input comes through layer 0 with RTN weights, not the float layer 0.
    quantized = {n: qw.dequantize() for n, qw in result.items() if ".layers.0." in n}
    norm1 = model.weight("model.layers.1.input_layernorm.weight")
    x1q = rms_norm(hidden_states(model, ids, quantized, 1), norm1, eps).reshape(-1, norm1.size).astype(np.float64)
    x1f = rms_norm(hidden_states(model, ids, {}, 1), norm1, eps).reshape(-1, norm1.size).astype(np.float64)
    h1 = seen[(1, ("q_proj", "k_proj", "v_proj"))].hessian()
    np.testing.assert_allclose(h1, x1q.T @ x1q / len(x1q), rtol=1e-4, atol=1e-5)
    assert not np.allclose(h1, x1f.T @ x1f / len(x1f), rtol=1e-3, atol=1e-5)

    # Layer 0, down_proj: the MLP's internal activation silu(x Wgᵀ) * (x Wuᵀ) — the MLP input computed with the
    # quantized q/k/v/o, then the quantized gate/up (true sequential order).
    mlp_inputs: list[np.ndarray] = []

    class Spy(Interpreter):
        def run_op(self, step: Any, inputs: list[np.ndarray]) -> list[np.ndarray]:
            if step.op.name == "top.MLP":
                mlp_inputs.append(inputs[0].reshape(-1, inputs[0].shape[-1]).astype(np.float64))
            return super().run_op(step, inputs)

    spy = Spy(model.module, lambda n: quantized[n] if n in quantized else model.weight(n))
    for h in hidden_states(model, ids, {}, 0):
        spy.run("block_0", [h[None], np.arange(SEQ, dtype=np.int32)[None]])
    x = np.concatenate(mlp_inputs)
    gate = x @ quantized["model.layers.0.mlp.gate_proj.weight"].T
    act = gate / (1 + np.exp(-gate)) * (x @ quantized["model.layers.0.mlp.up_proj.weight"].T)
    seen_down = seen[(0, ("down_proj",))]
    assert seen_down.k == model.spec.intermediate_size
    np.testing.assert_allclose(seen_down.hessian(), act.T @ act / len(act), rtol=1e-3, atol=1e-6)


def test_bf16_products_calibrate_on_the_bf16_forward(loaded_tiny: Any) -> None:
    """`calibration_matmul: bf16`: a group's Hessian is the Gram of its input as the bf16-product forward computes
    it (through the quantized layers before it), with the Gram's own bf16 rounding; not the float32 one."""
    import ml_dtypes

    model = loaded_tiny("llama", SEQ)
    ids = windows()
    seen_f32: dict[tuple[int, tuple[str, ...]], InputStats] = {}
    seen: dict[tuple[int, tuple[str, ...]], InputStats] = {}
    run_calibration(model, ids, rtn_solver(seen_f32), {"group_size": 32}, progress=False)
    result = run_calibration(model, ids, rtn_solver(seen), {"group_size": 32, "calibration_matmul": "bf16"},
                             progress=False)
    quantized = {n: qw.dequantize() for n, qw in result.items() if ".layers.0." in n}
    norm1 = model.weight("model.layers.1.input_layernorm.weight")
    with products("bf16"):
        h = hidden_states(model, ids, quantized, 1)
    x = rms_norm(h, norm1, model.spec.rms_norm_eps).astype(ml_dtypes.bfloat16).astype(np.float64)  # [3, SEQ, H]
    grams = np.einsum("sti,stj->sij", x, x)
    reference, scale = grams.sum(axis=0) / x[..., 0].size, np.abs(grams).sum(axis=0) / x[..., 0].size
    h1 = seen[(1, ("q_proj", "k_proj", "v_proj"))].hessian()
    assert np.all(np.abs(h1 - reference) <= 2.0 ** -7 * scale + 1e-6)  # each sample's Gram rounded to bf16
    h1_f32 = seen_f32[(1, ("q_proj", "k_proj", "v_proj"))].hessian()
    assert not np.allclose(h1, h1_f32, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(h1, h1_f32, rtol=0.05, atol=0.05 * float(np.abs(h1_f32).max()))


def test_fold_targets(loaded_tiny: Any) -> None:
    model = loaded_tiny("llama", SEQ)
    folds: dict[tuple[str, ...], Any] = {}

    def solve(group: Any, state: LayerState, options: Any) -> None:
        if group.layer == 0:
            folds[group.keys] = group.fold

    run_calibration(model, windows(1), solve, {}, progress=False)
    assert folds[("q_proj", "k_proj", "v_proj")].kind == "norm"
    assert folds[("q_proj", "k_proj", "v_proj")].weight == "model.layers.0.input_layernorm.weight"
    assert folds[("gate_proj", "up_proj")].weight == "model.layers.0.post_attention_layernorm.weight"
    down = folds[("down_proj",)]
    assert (down.kind, down.weight, down.tie) == ("rows", "model.layers.0.mlp.up_proj.weight", None)
    o = folds[("o_proj",)]
    assert (o.kind, o.weight) == ("rows", "model.layers.0.self_attn.v_proj.weight")
    # 4 query heads on 2 value heads, head_dim 16: query heads 0, 1 read value head 0; 2, 3 read value head 1.
    d = model.spec.head_dim
    expected = np.concatenate([np.arange(d), np.arange(d), np.arange(d, 2 * d), np.arange(d, 2 * d)])
    np.testing.assert_array_equal(o.tie, expected)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_folded_scales_keep_the_float_function(loaded_tiny: Any, kind: str) -> None:
    """Scaling every group's weights by s and folding 1/s into the producers (AWQ's rewrite, without rounding)
    leaves the model's hidden states unchanged — norms, GQA-tied value rows, value biases and up_proj rows."""
    model = loaded_tiny(kind, SEQ)
    rng = np.random.default_rng(0)
    folded = []

    def solve(group: Any, state: LayerState, options: Any) -> None:
        fold = group.fold
        assert fold is not None, group.keys
        producer = int(fold.tie.max()) + 1 if fold.tie is not None else group.stats.k
        s_fold = rng.uniform(0.5, 2.0, size=producer)
        s = s_fold[fold.tie] if fold.tie is not None else s_fold
        state.fold_input_scale(fold, s_fold)
        for name in group.names:
            state.set_float(name, state.float_weight(name) * s)
        folded.append(fold.bias)

    result = run_calibration(model, windows(1), solve, {}, progress=False)
    assert len(result) == 0 and result.float_weights
    if kind == "qwen2":
        assert "model.layers.0.self_attn.v_proj.bias" in folded
    ids = windows(2, seed=5)
    layers = model.spec.num_layers
    np.testing.assert_allclose(hidden_states(model, ids, result.float_weights, layers),
                               hidden_states(model, ids, {}, layers), rtol=1e-4, atol=1e-4)
    assert not np.allclose(result.float_weights["model.layers.0.input_layernorm.weight"],
                           model.weight("model.layers.0.input_layernorm.weight"))


def test_scale_rows_of_a_quantized_linear_is_exact() -> None:
    w = np.random.default_rng(1).normal(size=(6, 64)).astype(np.float32)
    state = LayerState(lambda name: w)
    state.set_quantized("x", rtn(w, 4, 32, False))
    before = state.current_weight("x").copy()
    factor = np.linspace(0.5, 2.0, 6)
    state.scale_rows("x", factor)
    np.testing.assert_allclose(state.current_weight("x"), before * factor[:, None], rtol=1e-6)
    np.testing.assert_array_equal(state.result["x"].codes, rtn(w, 4, 32, False).codes)


def test_scales_are_stored_in_the_compute_dtype() -> None:
    import ml_dtypes

    w = np.random.default_rng(2).normal(size=(4, 64)).astype(np.float32)
    state = LayerState(lambda name: w, scale_dtype="bf16")
    state.set_quantized("x", rtn(w, 4, 32, False))
    scales = state.result["x"].scales
    np.testing.assert_array_equal(scales, scales.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_awq_scheme_publishes_rewritten_norms(loaded_tiny: Any, tmp_path: Path) -> None:
    """The AWQ scheme's float rewrites reach `model.weight` (what every target compiles) once the pipeline's
    quantizer installs them, and its report shows each linear's output error next to RTN's."""
    from topq.core.pipeline import linear_weight_names, make_quantizer
    from topq.core.plugins import get_plugins

    model = loaded_tiny("qwen2", SEQ)
    ids = tmp_path / "ids.ids"
    ids.write_text(" ".join(map(str, windows(4).reshape(-1))))
    recipe = recipe_from_defaults(model={"path": str(model.checkpoint.path)},
                                  quant={"scheme": "awq", "group_size": 32,
                                         "calibration": {"data": str(ids), "samples": 4, "seq_len": SEQ}})
    norm = "model.layers.1.post_attention_layernorm.weight"
    original = model.checkpoint.weights.get(norm)
    try:
        quantizer = make_quantizer(model, recipe, get_plugins(), linear_weight_names(model.module))
        result = quantizer.precomputed
        assert set(result.float_weights) <= set(model.extra_weights)
        np.testing.assert_array_equal(model.weight(norm), result.float_weights[norm])
        assert not np.allclose(model.weight(norm), original)
        assert {r["name"] for r in result.report} == set(result)
        assert sum(r["error"] for r in result.report) < sum(r["rtn_error"] for r in result.report)
    finally:
        for name in list(model.extra_weights):
            if not name.startswith("rope."):
                del model.extra_weights[name]
