"""The interpreter's tap (topq/ir/interpreter.py): what observers see, and top.MLP's hidden activation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from topq.core.plugins import get_plugins
from topq.core.stages import StageConfig, build_program
from topq.ir.interpreter import Interpreter, Step
from topq.ir.reference_ops import REFERENCE_OPS, mlp_hidden


def tiny_llama() -> tuple[Any, dict[str, np.ndarray]]:
    family = get_plugins().families.get("llama")
    config = {"architectures": [], "model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50,
              "rms_norm_eps": 1e-5}
    module = build_program(family.normalize(config), family, StageConfig(16, 8, False, ()), None)
    rng = np.random.default_rng(0)
    weights = {}
    for function in module:
        for op in function.walk():
            if op.name == "top.Weight":
                shape = op.results[0].type.shape
                weights[op.attrs["name"]] = rng.standard_normal(shape).astype(np.float32) * 0.2
    return module, weights


def test_the_tap_sees_every_op_with_its_operands_and_results() -> None:
    module, weights = tiny_llama()
    seen: list[tuple[Step, list[np.ndarray], list[np.ndarray]]] = []
    interp = Interpreter(module, weights.__getitem__, tap=lambda step, ins, outs: seen.append((step, ins, outs)))
    hidden = np.random.default_rng(1).standard_normal((1, 8, 32)).astype(np.float32)
    positions = np.arange(8, dtype=np.int32)[None]
    out = interp.run("block_0", [hidden, positions])
    function = module["block_0"]
    computed = [op for op in function.ops if op.name != "top.Weight"]  # weights are the plan's constants
    assert [step.op for step, _, _ in seen] == computed
    assert {"top.RMSNorm", "top.MatMul", "top.FAttention", "top.MLP", "top.Add"} <= {s.op.name for s, _, _ in seen}
    for step, ins, outs in seen:
        assert len(ins) == len(step.op.operands) and len(outs) == len(step.op.results)
        np.testing.assert_array_equal(outs[0], step.kernel(ins, step.attrs)[0])
    last = {id(r): outs[i] for step, _, outs in seen for i, r in enumerate(step.op.results)}
    for value, result in zip(function.results, out):
        np.testing.assert_array_equal(last[id(value)], result)
    # untapped, the same run gives the same results; the tap is an attribute and can be swapped
    interp.tap = None
    seen.clear()
    again = interp.run("block_0", [hidden, positions])
    assert not seen
    for a, b in zip(out, again):
        np.testing.assert_array_equal(a, b)


def test_a_tap_can_stop_the_run() -> None:
    module, weights = tiny_llama()

    class Stop(Exception):
        pass

    names: list[str] = []

    def tap(step: Step, ins: list[np.ndarray], outs: list[np.ndarray]) -> None:
        names.append(step.op.name)
        if step.op.name == "top.FAttention":
            raise Stop

    interp = Interpreter(module, weights.__getitem__, tap=tap)
    with pytest.raises(Stop):
        interp.run("block_0", [np.zeros((1, 8, 32), np.float32), np.arange(8, dtype=np.int32)[None]])
    assert names[-1] == "top.FAttention" and "top.MLP" not in names


def test_a_subclass_tapping_with_its_own_method_is_freed_without_the_cyclic_gc() -> None:
    """`self.tap = self.method` must not be a reference cycle: an interpreter holds a model's weights, and the int8
    scheme's observation pass (~460 MB at SmolLM2) outlived it through the mixed-precision search that way."""
    import gc
    import weakref

    module, weights = tiny_llama()

    class Counting(Interpreter):
        def __init__(self) -> None:
            super().__init__(module, weights.__getitem__, tap=self.count)
            self.ops = 0

        def count(self, step: Step, ins: list[np.ndarray], outs: list[np.ndarray]) -> None:
            self.ops += 1

    gc.disable()
    try:
        interp = Counting()
        interp.run("block_0", [np.zeros((1, 8, 32), np.float32), np.arange(8, dtype=np.int32)[None]])
        assert interp.ops == sum(op.name != "top.Weight" for op in module["block_0"].ops)  # it still taps
        assert interp.tap == interp.count  # and reads back bound
        ref = weakref.ref(interp)
        del interp
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_mlp_hidden_is_what_the_down_projection_reads(act: str) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 5, 16)).astype(np.float32)
    wg, wu = (rng.standard_normal((24, 16)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((16, 24)).astype(np.float32)
    gate, up, hidden = mlp_hidden(x, wg, wu, act)
    assert gate.shape == up.shape == hidden.shape == (5, 24)
    np.testing.assert_allclose(gate, x[0] @ wg.T, rtol=1e-6)
    fused = REFERENCE_OPS["top.MLP"]([x, wg, wu, wd], {"act": act})[0]
    np.testing.assert_allclose(fused.reshape(5, 16), hidden @ wd.T, rtol=1e-5, atol=1e-5)
