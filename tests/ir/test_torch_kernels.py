"""The torch kernels (`topq.ir.torch_kernels`) against the reference interpreter: every decoder layer of the tiny
models whose layers they cover, on a batch of windows, with gradients reaching the weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from topq.core.errors import TopqError
from topq.core.stages import rope_weights
from topq.ir.interpreter import Interpreter
from topq.ir.torch_kernels import TorchFunction, uncovered_ops
from topq.quant.program import calibration_program, program_source

torch = pytest.importorskip("torch")

SEQ = 24
DENSE = ["llama", "llama_bias", "qwen3", "phi3", "gemma2", "gemma3", "mistral_window", "linear_rope"]


def _program(loaded_tiny: Any, kind: str) -> tuple[Any, Any, Any]:
    model = loaded_tiny(kind, SEQ)
    module, _, spec = calibration_program(program_source(model, SEQ))
    extra = rope_weights(spec, SEQ)

    def weight(name: str) -> np.ndarray:
        return np.asarray(extra[name] if name in extra else model.weight(name), dtype=np.float32)

    return module, spec, weight


@pytest.mark.parametrize("kind", DENSE)
def test_every_layer_matches_the_reference_on_a_batch(loaded_tiny: Any, kind: str) -> None:
    module, spec, weight = _program(loaded_tiny, kind)
    reference = Interpreter(module, weight)
    rng = np.random.default_rng(0)
    positions = np.arange(SEQ, dtype=np.int32)[None]
    for layer in range(spec.num_layers):
        name = f"block_{layer}"
        x = rng.standard_normal((3, SEQ, spec.hidden_size)).astype(np.float32)
        fn = TorchFunction(module, name)
        weights = {n: torch.from_numpy(weight(n)) for n in fn.weights}
        got = fn([torch.from_numpy(x), positions], weights)[0].numpy()
        want = np.stack([reference.run(name, [x[b:b + 1], positions])[0][0] for b in range(len(x))])
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"{kind} {name}")


def test_bf16_linears_stay_near_float32_and_gradients_reach_every_weight(loaded_tiny: Any) -> None:
    module, spec, weight = _program(loaded_tiny, "llama")
    positions = np.arange(SEQ, dtype=np.int32)[None]
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((2, SEQ, spec.hidden_size)).astype(np.float32))
    f32, bf16 = TorchFunction(module, "block_0"), TorchFunction(module, "block_0", "bf16")
    weights = {n: torch.from_numpy(weight(n)) for n in f32.weights}
    want = f32([x, positions], weights)[0]
    linears = [n for n in f32.weights if n.endswith("proj.weight")]
    assert len(linears) == 7
    leaves = {n: weights[n].clone().requires_grad_(True) for n in linears}
    got = bf16([x, positions], {**weights, **leaves})[0]
    error = float((got - want).detach().norm() / want.norm())
    assert 1e-5 < error < 2e-2  # bf16 products: rounded, but close
    grads = torch.autograd.grad(got.square().sum(), list(leaves.values()))
    assert all(float(g.abs().sum()) > 0 for g in grads)


def test_layers_with_other_ops_are_refused(loaded_tiny: Any) -> None:
    module, _, _ = _program(loaded_tiny, "qwen3_moe")
    assert uncovered_ops(module["block_0"]) == ["top.MoE"]
    with pytest.raises(TopqError, match="the torch kernels do not run top.MoE"):
        TorchFunction(module, "block_0")


@pytest.mark.parametrize("mode", ["contiguous_halves", "interleaved_pairs"])
@pytest.mark.parametrize("rotary", [16, 8])  # full and partial rotary
def test_rope_is_the_reference_bit_for_bit(mode: str, rotary: int) -> None:
    from topq.ir.reference_ops import REFERENCE_OPS
    from topq.ir.torch_kernels import torch_kernels

    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 12, 3, 16)).astype(np.float32)
    cos, sin = (rng.standard_normal((1, 12, rotary)).astype(np.float32) for _ in range(2))
    attrs = {"mode": mode}
    want = REFERENCE_OPS["top.Rope"]([x, cos, sin], attrs)[0]
    got = torch_kernels()["top.Rope"]([torch.from_numpy(a) for a in (x, cos, sin)], attrs)[0]
    np.testing.assert_array_equal(got.numpy(), want)
