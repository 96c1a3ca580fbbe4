"""The layer loop reuses a layer's values across its runs (topq.quant.reuse): the same results as re-running the
layer from its start for every quant group, with each op of a layer executed once per sample."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from data_paths import AUSTEN

from topq.ir import reference_ops
from topq.ir.interpreter import Interpreter
from topq.plugins.quant import awq, gptq
from topq.quant.calibration import (
    CalibrationResult,
    GroupInputs,
    LayerState,
    run_calibration,
    sample_windows,
    stacked_solver,
)
from topq.quant.grid import output_error, output_errors
from topq.quant.program import calibration_program, program_source
from topq.quant.reuse import LayerValues

SEQ, SAMPLES = 16, 3
OPTIONS = {"bits": 4, "group_size": 32, "symmetric": False, "act_order": True, "damp": 0.01, "block_size": 128,
           "static_groups": False, "scale_search": "minmax", "clip": True, "expert_min_tokens": 4}


def awq_norm_folds(group: GroupInputs, state: LayerState, options: Mapping[str, Any]) -> None:
    """AWQ with scales folded into norms only: kept values are never divided, so reuse changes no bit."""
    fold = group.fold if group.fold is not None and group.fold.kind == "norm" else None
    awq.solve_group(dataclasses.replace(group, fold=fold), state, options)


# AWQ folds scales into earlier ops
SOLVERS = {"gptq": stacked_solver(gptq.solve), "awq": awq.solve_group, "awq-norm-folds": awq_norm_folds}


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


@pytest.mark.parametrize("kind, scheme", [("llama", "gptq"), ("llama", "awq-norm-folds"), ("qwen3_moe", "gptq"),
                                          ("qwen3_5", "gptq")])
def test_reused_values_give_the_results_of_rerunning_the_layer(loaded_tiny: Any, kind: str, scheme: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = loaded_tiny(kind, SEQ)
    assert_same(calibrate(model, scheme, True, monkeypatch), calibrate(model, scheme, False, monkeypatch))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: v_proj has a bias, divided by the fold too
def test_awq_inputs_divided_after_a_fold_give_the_rerun_results_up_to_rounding(loaded_tiny: Any, kind: str,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A fold into v_proj's / up_proj's rows divides the kept attention output / MLP act by s instead of computing
    them again (`topq.quant.reuse`): the same results but for float32 rounding (float32 scales here)."""
    model = loaded_tiny(kind, SEQ)
    divided, rerun = calibrate(model, "awq", True, monkeypatch), calibrate(model, "awq", False, monkeypatch)
    assert sorted(divided) == sorted(rerun) and sorted(divided.float_weights) == sorted(rerun.float_weights)
    for name in rerun:
        a, b = divided[name], rerun[name]
        assert np.mean(a.codes != b.codes) <= 1e-3, name  # a code at a rounding boundary may flip
        np.testing.assert_allclose(a.scales, b.scales, rtol=1e-5, err_msg=name)
        np.testing.assert_array_equal(a.zeros, b.zeros, err_msg=name)
    for name in rerun.float_weights:  # the norms AWQ folded scales into
        np.testing.assert_allclose(divided.float_weights[name], rerun.float_weights[name], rtol=1e-5, err_msg=name)
    assert [r["name"] for r in divided.report] == [r["name"] for r in rerun.report]
    np.testing.assert_allclose([r["error"] for r in divided.report], [r["error"] for r in rerun.report], rtol=1e-5)
    # not the same bits: the divided inputs really were used (a rerun would give identical results)
    assert any(not np.array_equal(divided[n].scales, rerun[n].scales) for n in rerun)


@pytest.mark.parametrize("scheme", ["gptq", "awq"])
def test_each_op_of_a_layer_runs_once_per_sample(loaded_tiny: Any, scheme: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """For AWQ too: the folds into v_proj's and up_proj's rows do not make attention or the MLP act run again."""
    model = loaded_tiny("llama", SEQ)
    module = calibration_program(program_source(model, SEQ), model.family, model.spec)[0]  # the one the loop runs
    blocks = [module[f"block_{i}"] for i in range(model.spec.num_layers)]
    attention = [id(op) for f in blocks for op in f.ops if op.name == "top.FAttention"]
    layer_ops = {id(op) for f in blocks for op in f.ops}
    with executed_ops() as reused:
        calibrate(model, scheme, True, monkeypatch)
    with executed_ops() as rerun:
        calibrate(model, scheme, False, monkeypatch)
    # rerunning: attention runs for the o_proj, gate/up and down captures and the layer output
    assert [rerun[a] for a in attention] == [4 * SAMPLES] * len(attention)
    assert [reused[a] for a in attention] == [SAMPLES] * len(attention)
    norms = {id(op) for f in blocks for op in f.ops if op.name == "top.RMSNorm"}
    assert max(reused[i] for i in layer_ops - norms) == SAMPLES
    # AWQ folds into the two norms: their outputs are computed again (one pass each, exact)
    assert {reused[i] for i in norms} == {SAMPLES if scheme == "gptq" else 2 * SAMPLES}
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
