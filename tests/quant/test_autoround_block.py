"""AutoRound's block objective (`topq.quant.autoround_block`): every linear of a layer tuned on the
layer's output; layers the torch kernels do not run fall back to the per-linear objective; the minibatch shards
give the same bits on any executor (tests/quant/test_calibration_executor.py runs the executors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from data_paths import AUSTEN

from topq.core.errors import TopqError

CALIBRATION = {"samples": 6, "seq_len": 32}


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("autoround_block") / "emma.ids"
    path.write_text(" ".join(str(b) for b in (AUSTEN / "00_EMMA.txt").read_bytes()[:8000]))
    return path


def _calibrate(loaded_tiny: Any, kind: str, ids: Path, **quant: Any) -> Any:
    from topq.core.plugins import get_plugins
    from topq.core.recipe import recipe_from_defaults

    model = loaded_tiny(kind, 32)
    recipe = recipe_from_defaults(model={"path": str(model.checkpoint.path)},
                                  quant={"scheme": "autoround", "group_size": 32, "objective": "block", **quant,
                                         "calibration": {"data": str(ids), **CALIBRATION}},
                                  stages={"seq_length": 32, "max_input_length": 32, "prefill_kv": False})
    return get_plugins().schemes.get("autoround").calibrate(model, recipe)


def test_every_layer_is_tuned_on_its_output_and_beats_rounding_to_nearest(loaded_tiny: Any, ids: Path) -> None:
    result = _calibrate(loaded_tiny, "llama", ids, iters=40, batch_size=4)
    rows = result.report
    assert len(rows) == 2 * 7 and {row["objective"] for row in rows} == {"block"}
    for layer in range(2):  # one layer error for all of a layer's linears
        mine = [row for row in rows if f"layers.{layer}." in row["name"]]
        assert len({row["error"] for row in mine}) == 1 and len(mine) == 7
        assert 0 < mine[0]["ratio"] < 0.9, mine[0]  # the tuned layer's output error is below RTN's
        assert mine[0]["error"] < mine[0]["rtn_error"]


def test_block_and_linear_objectives_differ_and_are_reproducible(loaded_tiny: Any, ids: Path) -> None:
    block = _calibrate(loaded_tiny, "llama", ids, iters=10, batch_size=4)
    again = _calibrate(loaded_tiny, "llama", ids, iters=10, batch_size=4)
    linear = _calibrate(loaded_tiny, "llama", ids, iters=10, objective="linear")
    name = "model.layers.1.self_attn.q_proj.weight"
    np.testing.assert_array_equal(block[name].codes, again[name].codes)
    assert not np.array_equal(block[name].codes, linear[name].codes)
    assert {row["objective"] for row in linear.report} == {"linear"}


def test_layers_without_torch_kernels_use_the_per_linear_objective(loaded_tiny: Any, ids: Path) -> None:
    """Qwen3.5's linear-attention layers (top.ChunkGatedDeltaRule) fall back; its full-attention layers are tuned
    on their output, with the float model's hidden states carried through the fallback layers."""
    result = _calibrate(loaded_tiny, "qwen3_5", ids, iters=5, batch_size=4)
    objectives = {row["name"].split(".layers.")[1].split(".")[0]: row["objective"] for row in result.report}
    assert set(objectives.values()) == {"block", "linear"}, objectives
    model = loaded_tiny("qwen3_5", 32)
    assert [objectives[str(i)] for i in range(model.spec.num_layers)] == \
        ["block" if kind == "full_attention" else "linear" for kind in model.spec.layer_types]


def test_the_float_outputs_overwrite_the_float_inputs_and_are_the_float_models(
        loaded_tiny: Any, ids: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner writes the float layer's outputs (its targets, and the next layer's float inputs) into the float
    inputs' buffer, not a second [samples, L, H] array; and they are transformers' float hidden states."""
    import torch
    from transformers import AutoModelForCausalLM

    import topq.quant.calibration as calibration
    from topq.quant.calibration import LayerInputs, LayerState, LayerTuner

    run_calibration = calibration.run_calibration
    seen: list[tuple[bool, bool, np.ndarray]] = []
    windows: list[np.ndarray] = []

    def spying(*args: Any, layer_tuner: LayerTuner, **kwargs: Any) -> Any:
        def tune(layer: LayerInputs, state: LayerState, options: Any) -> np.ndarray:
            float_inputs, inputs = layer.float_inputs, layer.inputs.copy()
            out = layer_tuner.tune(layer, state, options)
            seen.append((out is float_inputs, np.array_equal(layer.inputs, inputs), out.copy()))
            return out

        windows.append(np.asarray(args[1]))
        return run_calibration(*args, layer_tuner=LayerTuner(layer_tuner.covers, tune), **kwargs)

    monkeypatch.setattr(calibration, "run_calibration", spying)
    _calibrate(loaded_tiny, "llama", ids, iters=2, batch_size=4)
    assert [(same, kept) for same, kept, _ in seen] == [(True, True), (True, True)]  # the quantized inputs kept
    hf = AutoModelForCausalLM.from_pretrained(loaded_tiny("llama", 32).checkpoint.path, dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.from_numpy(windows[0]).long(), output_hidden_states=True).hidden_states
    # layer 0's float outputs are the float model's hidden states after it (the last entry is after the final norm)
    np.testing.assert_allclose(seen[0][2], states[1].numpy(), rtol=1e-4, atol=1e-4)
    assert not np.allclose(seen[1][2], seen[0][2], atol=1e-2)  # layer 1 ran on layer 0's outputs


def test_a_bad_objective_and_a_batch_without_minibatches_are_refused(loaded_tiny: Any, ids: Path) -> None:
    with pytest.raises(TopqError, match="objective"):
        _calibrate(loaded_tiny, "llama", ids, objective="layer")
    with pytest.raises(TopqError, match="quant.batch_size is for quant.objective: block"):
        _calibrate(loaded_tiny, "llama", ids, objective="linear", batch_size=4)


def test_minibatches_are_seeded_epochs_of_every_window() -> None:
    """auto-round's IndexSampler: each epoch a fresh shuffle of all windows cut into batches, the short tail
    dropped; the same seed gives the same draws."""
    from itertools import islice

    from topq.quant.autoround_block import minibatches

    draws = list(islice(minibatches(10, 4, (42, 0)), 6))  # 2 batches per epoch: 3 epochs
    assert all(len(d) == 4 for d in draws)
    for epoch in range(3):
        seen = np.concatenate(draws[2 * epoch:2 * epoch + 2])
        assert len(set(seen.tolist())) == 8 and set(seen.tolist()) <= set(range(10))
    assert not np.array_equal(np.concatenate(draws[:2]), np.concatenate(draws[2:4]))  # reshuffled
    again = list(islice(minibatches(10, 4, (42, 0)), 6))
    np.testing.assert_array_equal(np.stack(draws), np.stack(again))
    other = list(islice(minibatches(10, 4, (42, 1)), 6))  # another layer's seed
    assert not np.array_equal(np.stack(draws), np.stack(other))
    # a batch of all windows: every draw is every window
    assert all(sorted(d.tolist()) == list(range(5)) for d in islice(minibatches(5, 5, 0), 3))


def test_the_shards_gradients_are_summed_with_the_bits_of_widening_each() -> None:
    """`summed` adds the shards' bf16 (or float32) gradients into one float32 sum in shard order: bit for bit what
    widening each to float32 and summing gives, for row-major and transposed gradients alike, and row-major."""
    import torch

    from topq.quant.autoround_block import summed

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for transposed in (False, True):
            # magnitudes over most of the exponent range, so that a sum in bf16 (or a lost widening) would show
            scales = [10.0 ** torch.randint(-30, 30, (24, 40), generator=g) for _ in range(3)]
            parts = [(torch.randn(24, 40, generator=g) * s).to(dtype) for s in scales]
            parts = [p.t() if transposed else p for p in parts]
            for n in (1, 2, 3):
                widened = [p.to(torch.float32).numpy() for p in parts[:n]]
                total = summed(parts[:n])
                assert total.dtype == np.float32 and total.flags["C_CONTIGUOUS"]
                np.testing.assert_array_equal(total, sum(widened[1:], widened[0]))
                assert np.array_equal(np.signbit(total), np.signbit(sum(widened[1:], widened[0])))
    # in bf16 the same sum rounds: the check above would see it
    a, b = (torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0 ** -9], dtype=torch.bfloat16))
    assert float(summed([a, b])[0]) == 1.0 + 2.0 ** -9 and float((a + b)[0]) == 1.0
