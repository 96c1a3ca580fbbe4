"""The layer loop reuses a layer's values across its runs (topq.quant.reuse): the same results as re-running the
layer from its start for every quant group, with each op of a layer executed once per sample."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from data_paths import AUSTEN

from topq.ir import reference_ops
from topq.ir.interpreter import Interpreter
from topq.plugins.quant import awq, gptq
from topq.quant.calibration import CalibrationResult, run_calibration, sample_windows, stacked_solver
from topq.quant.grid import output_error, output_errors
from topq.quant.program import calibration_program, program_source
from topq.quant.reuse import LayerValues

SEQ, SAMPLES = 16, 3
OPTIONS = {"bits": 4, "group_size": 32, "symmetric": False, "act_order": True, "damp": 0.01, "block_size": 128,
           "static_groups": False, "scale_search": "minmax", "clip": True, "expert_min_tokens": 4}
SOLVERS = {"gptq": stacked_solver(gptq.solve), "awq": awq.solve_group}  # AWQ folds scales into earlier ops


def windows(vocab: int) -> np.ndarray:
    text = (AUSTEN / "00_EMMA.txt").read_bytes()[:4000]
    return sample_windows(np.frombuffer(text, dtype=np.uint8).astype(np.int64) % vocab, SAMPLES, SEQ, 0)


@contextmanager
def executed_ops() -> Iterator[Counter[Any]]:
    """Counts how often each op is executed (by id), in any interpreter of this process, and (key "mlp act") how
    often a top.MLP's gate / up projections and activation are computed, by the op or by a capture."""
    counts: Counter[Any] = Counter()
    original, activation = Interpreter.run_op, reference_ops.mlp_activation

    def counting(self: Interpreter, step: Any, inputs: list[np.ndarray]) -> list[np.ndarray]:
        counts[id(step.op)] += 1
        return original(self, step, inputs)

    def counting_activation(name: str, x: np.ndarray) -> np.ndarray:
        counts["mlp act"] += 1
        return activation(name, x)

    Interpreter.run_op = counting  # type: ignore[method-assign]
    reference_ops.mlp_activation = counting_activation  # type: ignore[assignment]
    try:
        yield counts
    finally:
        Interpreter.run_op = original  # type: ignore[method-assign]
        reference_ops.mlp_activation = activation  # type: ignore[assignment]


def calibrate(model: Any, scheme: str, reuse: bool, monkeypatch: pytest.MonkeyPatch) -> CalibrationResult:
    with monkeypatch.context() as patch:
        if not reuse:  # nothing is kept: every run starts from the layer input, as before reuse existed
            patch.setattr(LayerValues, "frontier", lambda self, pending: frozenset())
        return run_calibration(model, windows(model.spec.vocab_size), SOLVERS[scheme], OPTIONS, progress=False)


def assert_same(a: CalibrationResult, b: CalibrationResult) -> None:
    assert sorted(a) == sorted(b) and sorted(a.float_weights) == sorted(b.float_weights)
    for name in a:
        for field in ("codes", "scales", "zeros", "g_idx"):
            np.testing.assert_array_equal(getattr(a[name], field), getattr(b[name], field), err_msg=name)
    for name in a.float_weights:
        np.testing.assert_array_equal(a.float_weights[name], b.float_weights[name], err_msg=name)
    assert a.report == b.report


@pytest.mark.parametrize("kind, scheme", [("llama", "gptq"), ("llama", "awq"), ("qwen2", "awq"),
                                          ("qwen3_moe", "gptq"), ("qwen3_5", "gptq")])
def test_reused_values_give_the_results_of_rerunning_the_layer(loaded_tiny: Any, kind: str, scheme: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = loaded_tiny(kind, SEQ)
    assert_same(calibrate(model, scheme, True, monkeypatch), calibrate(model, scheme, False, monkeypatch))


def test_each_op_of_a_layer_runs_once_per_sample(loaded_tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = loaded_tiny("llama", SEQ)
    module = calibration_program(program_source(model, SEQ), model.family, model.spec)[0]  # the one the loop runs
    blocks = [module[f"block_{i}"] for i in range(model.spec.num_layers)]
    attention = [id(op) for f in blocks for op in f.ops if op.name == "top.FAttention"]
    layer_ops = {id(op) for f in blocks for op in f.ops}
    with executed_ops() as reused:
        calibrate(model, "gptq", True, monkeypatch)
    with executed_ops() as rerun:
        calibrate(model, "gptq", False, monkeypatch)
    # rerunning: attention runs for the o_proj, gate/up and down captures and the layer output
    assert [rerun[a] for a in attention] == [4 * SAMPLES] * len(attention)
    assert [reused[a] for a in attention] == [SAMPLES] * len(attention)
    assert max(reused[i] for i in layer_ops) == SAMPLES
    assert sum(reused[i] for i in layer_ops) < sum(rerun[i] for i in layer_ops) / 2
    # the MLP's act, computed for the down projection's capture, serves the layer output too: gate / up run once
    assert reused["mlp act"] == SAMPLES * len(blocks) and rerun["mlp act"] == 2 * SAMPLES * len(blocks)


def test_batched_report_products_match_the_float64_reference() -> None:
    """`output_errors` (one float32 GEMM for all of a group's report rows) against `output_error` (float64), on a
    GPTQ error — the case where the products cancel most (GPTQ makes ΔW H ΔWᵀ small on purpose)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048, 96)) @ rng.standard_normal((96, 96))  # correlated inputs
    h = x.T @ x / len(x)
    w = rng.standard_normal((48, 96))
    w_hat = gptq.gptq(w, h, group_size=32).dequantize()
    parts = [w - w_hat, w[:7], w]
    batched = output_errors(parts, h)
    reference = np.array([output_error(p, np.zeros_like(p), h).sum() for p in parts])
    np.testing.assert_allclose(batched, reference, rtol=1e-5)
    assert batched[0] < 0.05 * batched[2]  # a real cancellation: GPTQ's error is far below ||X Wᵀ||²
