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


@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("x_grad", [True, False])  # a tuner's inputs need none; a layer behind a tuned one would
def test_the_mlp_gradients_are_autograds(kind: str, x_grad: bool) -> None:
    """top.MLP computes its weights' gradients itself (`SharedInputLinears` for gate and up,
    `RowMajorGradientLinear` for down); they and the input's are autograd's gradients of the plain expression, to
    the products' rounding."""
    from topq.ir.torch_kernels import torch_kernels

    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[kind]
    rng = np.random.default_rng(3)
    x, wg, wu, wd = (torch.from_numpy(rng.standard_normal(s).astype(np.float32))
                     for s in ((2, 12, 16), (40, 16), (40, 16), (16, 40)))
    upstream = torch.from_numpy(rng.standard_normal((2, 12, 16)).astype(np.float32))

    def gradients(mlp: Any) -> list[Any]:
        leaves = [t.clone().requires_grad_(x_grad if i == 0 else True) for i, t in enumerate((x, wg, wu, wd))]
        out = mlp(*leaves)
        wanted = leaves if x_grad else leaves[1:]
        return [g.float() for g in torch.autograd.grad(out, wanted, grad_outputs=upstream)]

    def plain(x: Any, wg: Any, wu: Any, wd: Any) -> Any:
        f = torch.nn.functional
        x, wg, wu, wd = (t.to(dtype) for t in (x, wg, wu, wd))
        return f.linear(f.silu(f.linear(x, wg)) * f.linear(x, wu), wd).float()

    kernel = torch_kernels(kind)["top.MLP"]
    got = gradients(lambda *a: kernel(list(a), {"act": "silu"})[0])
    want = gradients(plain)
    tolerance = 1e-5 if kind == "f32" else 2e-2
    for name, g, w in zip(["x", "gate", "up", "down"][0 if x_grad else 1:], got, want):
        scale = float(w.abs().max())
        assert scale > 0
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=0, atol=tolerance * scale, err_msg=name)


@pytest.mark.parametrize("rotary", [16, 8])  # full and partial rotary
def test_the_rope_rotation_and_its_gradient_are_autograds_bits(rotary: int) -> None:
    """top.Rope's contiguous halves rotate in a function of their own (`HalvesRotation`); its result and x's
    gradient are bit for bit autograd's of the plain expression x·cos + (−x2, x1)·sin."""
    from topq.ir.torch_kernels import torch_kernels

    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((2, 12, 3, 16)).astype(np.float32))
    cos, sin = (torch.from_numpy(rng.standard_normal((1, 12, rotary)).astype(np.float32)) for _ in range(2))
    upstream = torch.from_numpy(rng.standard_normal((2, 12, 3, 16)).astype(np.float32))

    def plain(x: Any) -> Any:
        c, s, h = cos[..., None, :], sin[..., None, :], rotary // 2
        rotated, rest = x[..., :rotary], x[..., rotary:]
        out = rotated * c + torch.cat([-rotated[..., h:], rotated[..., :h]], dim=-1) * s
        return torch.cat([out, rest], dim=-1)

    def result_and_gradient(rope: Any) -> tuple[Any, Any]:
        leaf = x.clone().requires_grad_(True)
        out = rope(leaf)
        return out.detach(), torch.autograd.grad(out, [leaf], grad_outputs=upstream)[0]

    kernel = torch_kernels("f32")["top.Rope"]
    got = result_and_gradient(lambda t: kernel([t, cos, sin], {"mode": "contiguous_halves"})[0])
    want = result_and_gradient(plain)
    for name, g, w in zip(["result", "gradient"], got, want):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("kind", ["llama", "llama_bias"])
def test_attention_output_kept_narrow_changes_no_bit(loaded_tiny: Any, kind: str) -> None:
    """In bf16, attention's output reaches only o_proj, which narrows it again: its kernel skips the exact float32
    round trip (`keep_narrow_results`). The layer's output and every weight's gradient are bit for bit those with
    the round trip."""
    from topq.ir.torch_kernels import NARROW_RESULT

    module, spec, weight = _program(loaded_tiny, kind)
    positions = np.arange(SEQ, dtype=np.int32)[None]
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, SEQ, spec.hidden_size)).astype(np.float32))
    kept, plain = TorchFunction(module, "block_0", "bf16"), TorchFunction(module, "block_0", "bf16")
    assert [step.op.name for step in kept._plan.steps if step.attrs.get(NARROW_RESULT)] == ["top.FAttention"]
    for step in plain._plan.steps:
        step.attrs = {k: v for k, v in step.attrs.items() if k != NARROW_RESULT}
    weights = {n: torch.from_numpy(weight(n)) for n in kept.weights}

    def output_and_gradients(fn: TorchFunction) -> list[Any]:
        leaves = {n: weights[n].to(torch.bfloat16).requires_grad_(True) for n in fn.weights
                  if n.endswith("proj.weight")}
        out = fn([x, positions], {**weights, **leaves})[0]
        return [out.detach(), *torch.autograd.grad(out, list(leaves.values()), grad_outputs=torch.ones_like(out))]

    for got, want in zip(output_and_gradients(kept), output_and_gradients(plain), strict=True):
        assert torch.equal(got, want)


def test_rope_refuses_angles_that_need_a_gradient() -> None:
    """`HalvesRotation` differentiates x only: angles that require a gradient are refused, not silently left out."""
    from topq.ir.torch_kernels import torch_kernels

    x = torch.zeros((1, 4, 2, 8), requires_grad=True)
    cos = torch.ones((1, 4, 8), requires_grad=True)
    with pytest.raises(TopqError, match="no gradient to cos and sin"):
        torch_kernels("f32")["top.Rope"]([x, cos, torch.zeros((1, 4, 8))], {"mode": "contiguous_halves"})


@pytest.mark.parametrize("length", [100, 128])  # a last query block shorter than the others, and whole blocks
def test_bf16_causal_attention_in_query_blocks_is_as_close_as_sdpa(length: int) -> None:
    """bf16 causal self-attention runs in query blocks (`CausalAttention`): its result and q's, k's and v's
    gradients are as close to a float64 reference as torch's bf16 SDPA (GQA, a scale that is not a power of two), and
    a query never reads a later key: changing the last position's k and v leaves every earlier output bit for bit."""
    from topq.ir.torch_kernels import QUERY_BLOCK, torch_kernels

    assert length > QUERY_BLOCK
    f = torch.nn.functional
    rng = np.random.default_rng(6)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, length, heads, 16)).astype(np.float32))
               for heads in (6, 2, 2))
    upstream = torch.from_numpy(rng.standard_normal((2, length, 6 * 16)).astype(np.float32))
    attrs = {"scale": 0.3, "causal": True}
    kernel = torch_kernels("bf16")["top.FAttention"]

    def blocked(q: Any, k: Any, v: Any) -> Any:
        return kernel([q, k, v], attrs)[0]

    def sdpa(q: Any, k: Any, v: Any) -> Any:
        out = f.scaled_dot_product_attention(*(t.to(torch.bfloat16).transpose(1, 2) for t in (q, k, v)),
                                             is_causal=True, scale=0.3, enable_gqa=True)
        return out.float().transpose(1, 2).reshape(2, length, 96)

    def reference(q: Any, k: Any, v: Any) -> Any:
        q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
        k, v = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
        scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(torch.ones(length, length).triu(1).bool(), -torch.inf)
        return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(2, length, 96)

    def result_and_gradients(fn: Any, dtype: Any = torch.float32) -> list[Any]:
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        return [out.detach().double(), *(g.double() for g in
                                          torch.autograd.grad(out, leaves, grad_outputs=upstream.to(dtype)))]

    want = result_and_gradients(reference, torch.float64)
    for name, got, near, ref in zip(["result", "q", "k", "v"], result_and_gradients(blocked),
                                    result_and_gradients(sdpa), want):
        error, sdpa_error = (float((x - ref).norm() / ref.norm()) for x in (got, near))
        assert error < 1.5 * sdpa_error and error < 1e-2, (name, error, sdpa_error)
    later = [t.clone() for t in (k, v)]
    for t in later:
        t[:, -1] += 1.0
    assert torch.equal(blocked(q, *later)[:, :-1], blocked(q, k, v)[:, :-1])
    assert not torch.equal(blocked(q, *later)[:, -1], blocked(q, k, v)[:, -1])
