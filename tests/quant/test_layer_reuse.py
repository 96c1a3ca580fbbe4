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
from topq.ir.analysis import producer, weight_name
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
from topq.quant.reuse import LayerValues, inner_key

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


def calibrate(model: Any, scheme: str, reuse: bool, monkeypatch: pytest.MonkeyPatch,
              matmul: str = "f32") -> CalibrationResult:
    with monkeypatch.context() as patch:
        if not reuse:  # nothing is kept: every run starts from the layer input, as before reuse existed
            patch.setattr(LayerValues, "frontier", lambda self, pending: frozenset())
        options = {**OPTIONS, "calibration_matmul": matmul}
        return run_calibration(model, windows(model.spec.vocab_size), SOLVERS[scheme], options, progress=False,
                               folds=scheme != "gptq")  # as the schemes run it: GPTQ's solver folds nothing


def assert_same(a: CalibrationResult, b: CalibrationResult) -> None:
    assert sorted(a) == sorted(b) and sorted(a.float_weights) == sorted(b.float_weights)
    for name in a:
        for field in ("codes", "scales", "zeros", "g_idx"):
            np.testing.assert_array_equal(getattr(a[name], field), getattr(b[name], field), err_msg=name)
    for name in a.float_weights:
        np.testing.assert_array_equal(a.float_weights[name], b.float_weights[name], err_msg=name)
    assert a.report == b.report


@pytest.mark.parametrize("kind, scheme, matmul", [("llama", "gptq", "f32"), ("llama", "awq-norm-folds", "f32"),
                                                  ("qwen3_moe", "gptq", "f32"), ("qwen3_5", "gptq", "f32"),
                                                  ("llama", "gptq", "bf16")])  # bf16: the act kept as bf16
def test_reused_values_give_the_results_of_rerunning_the_layer(loaded_tiny: Any, kind: str, scheme: str,
                                                                matmul: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = loaded_tiny(kind, SEQ)
    assert_same(calibrate(model, scheme, True, monkeypatch, matmul),
                calibrate(model, scheme, False, monkeypatch, matmul))


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


def test_a_layers_kept_values_are_only_those_a_later_run_reads(loaded_tiny: Any) -> None:
    """Between the down projection's capture and the layer output the loop keeps the MLP's act and the attention
    residual, not the MLP's input (the act replaces it) nor the K / V the block returns for the KV cache (the
    loop reads only the hidden state); the output run then executes the down projection and the last add."""
    model = loaded_tiny("llama", SEQ)
    block = calibration_program(program_source(model, SEQ), model.family, model.spec)[0]["block_0"]
    values = LayerValues.of(block, read=(0,))
    ops = [op for op in block.ops if op.name != "top.Weight"]
    at: dict[str, list[int]] = {}
    for op in ops:
        at.setdefault(op.name, []).append(values.at(op))
    (mlp,), (_, post_norm), (residual, out) = at["top.MLP"], at["top.RMSNorm"], at["top.Add"]
    kv = {values.at(producer(r)) for r in block.results[1:]}
    down = weight_name(ops[mlp].operands[3])
    kept = values.frontier({down})
    assert kept == {inner_key(mlp), residual}
    assert values.needed(kept, {out}) == {mlp, out}
    assert post_norm not in kept and not kv & kept
    # a caller that reads every result (as a KV cache would) keeps K / V; from o_proj's capture on, they are final
    assert kv <= LayerValues.of(block).frontier({down}) and not kv & values.frontier({weight_name(
        ops[at["top.MatMul"][-1]].operands[1])})
    # without the act (not captured), the MLP's input is computed again from the kept residual
    assert values.needed({residual}, {out}) == {post_norm, mlp, out}


@pytest.mark.parametrize("folds, matmul", [(False, "f32"), (True, "f32"), (False, "bf16"), (True, "bf16")])
def test_gptq_keeps_only_what_the_next_run_reads(loaded_tiny: Any, monkeypatch: pytest.MonkeyPatch,
                                                 folds: bool, matmul: str) -> None:
    """What each sample keeps after each step of a layer, for GPTQ (which folds nothing): the attention output for
    o_proj, the residual and the MLP's input for gate / up, the residual and the act for down — the act in bf16
    when the down projection's product rounds it so anyway. A solver that may fold (AWQ) keeps the same values, the
    act in float32: a fold into v_proj's / up_proj's rows divides the kept attention output / act
    (`_divide_kept_input`), so nothing before them is computed again; a fold into a norm changes values that are
    computed again anyway (the norm's output). From gate / up's step on, the residual is kept in the layer input's
    buffer: no run reads that input again."""
    from topq.quant import calibration

    model = loaded_tiny("llama", SEQ)
    block = calibration_program(program_source(model, SEQ), model.family, model.spec)[0]["block_0"]
    values = LayerValues.of(block)
    position = {op.name + str(i): values.at(op) for i, op in enumerate(o for o in block.ops if o.name != "top.Weight")}
    name_of = {p: n.rstrip("0123456789") for n, p in position.items()} | {
        inner_key(p): "act" for n, p in position.items() if n.startswith("top.MLP")}
    kept: list[list[str]] = []
    in_input: list[list[str]] = []  # kept values held in the layer input's buffer (`_store_in_input`)
    act_dtypes = set()
    run = calibration._map_samples

    def spy(executor: Any, step: Any, hidden: np.ndarray, caches: list[Any], chunk: int) -> Iterator[Any]:
        yield from run(executor, step, hidden, caches, chunk)
        if step.layer == 0:
            kept.append(sorted(name_of[k] for k in caches[0]))
            in_input.append(sorted(name_of[k] for k, v in caches[-1].items() if np.shares_memory(v[0], hidden[-1])))
        act_dtypes.update(str(v[0].dtype) for cache in caches for k, v in cache.items() if name_of[k] == "act")

    monkeypatch.setattr(calibration, "_map_samples", spy)
    run_calibration(model, windows(model.spec.vocab_size), SOLVERS["gptq"],
                    {**OPTIONS, "calibration_matmul": matmul}, progress=False, folds=folds)
    assert act_dtypes == {"bfloat16" if matmul == "bf16" and not folds else "float32"}
    assert kept == [["top.RMSNorm"], ["top.FAttention"], ["top.Add", "top.RMSNorm"], ["act", "top.Add"], []]
    # once o_proj is solved no run reads the layer input again: the residual takes its place
    assert in_input == [[], [], ["top.Add"], ["top.Add"], []]


def test_a_write_behind_the_stored_residual_is_refused(loaded_tiny: Any) -> None:
    """A solver that writes a weight it did not declare (here the input norm, at down_proj's step) after the loop
    stopped keeping the layer input would need that input again: one clear error, not stale values."""
    from topq.core.errors import TopqError

    model = loaded_tiny("llama", SEQ)
    solve = SOLVERS["gptq"]

    def rogue(group: GroupInputs, state: LayerState, options: Mapping[str, Any]) -> None:
        solve(group, state, options)
        if "down_proj" in group.names[0]:
            norm = group.names[0].replace("mlp.down_proj", "input_layernorm")
            state.set_float(norm, state.float_weight(norm) * 2)

    with pytest.raises(TopqError, match="layer 0: a solver changed weights that values computed from the layer "
                                        "input depend on"):
        run_calibration(model, windows(model.spec.vocab_size), rogue, OPTIONS, progress=False)


def test_only_awq_has_the_loop_keep_values_for_folds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schemes tell the layer loop whether their solver folds scales into earlier ops (`folds`)."""
    from topq.core.recipe import recipe_from_defaults
    from topq.plugins.quant import autoround
    from topq.quant import calibration

    folds: dict[str, bool] = {}
    monkeypatch.setattr(calibration, "calibration_windows", lambda model, recipe: None)
    for scheme in (gptq.SCHEME, awq.SCHEME, autoround.SCHEME):
        monkeypatch.setattr(calibration, "run_calibration",
                            lambda *args, name=scheme.name, **kwargs: folds.update({name: kwargs["folds"]}))
        scheme.calibrate(None, recipe_from_defaults(model={"path": "unused"}, quant={"scheme": scheme.name}))
    assert folds == {"gptq": False, "awq": True, "autoround": False}


def test_the_embedding_table_is_freed_before_the_layers_run(loaded_tiny: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop reads the embedding once, for every sample's layer-0 input; its float copy is gone (without the
    cyclic GC) when the first group is solved."""
    import gc
    import weakref

    model = loaded_tiny("llama", SEQ)
    read, weight = {}, model.weight

    def tracked(name: str) -> np.ndarray:
        array = np.array(weight(name), dtype=np.float32)
        read[name] = weakref.ref(array)
        return array

    alive: list[bool] = []

    def solve(group: GroupInputs, state: LayerState, options: Mapping[str, Any]) -> None:
        alive.append(read["model.embed_tokens.weight"]() is not None)
        SOLVERS["gptq"](group, state, options)

    monkeypatch.setattr(model, "weight", tracked)
    gc.disable()
    try:
        run_calibration(model, windows(model.spec.vocab_size), solve, OPTIONS, progress=False)
    finally:
        gc.enable()
    assert alive and not any(alive)


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
