"""AutoRound's block objective (Cheng et al. 2023, and auto-round's default): every linear of a decoder layer tuned
together on the layer's output.

Each step takes the next `batch_size` calibration windows of a seeded shuffle (`minibatches`: the same draws
every run, every window about equally often) and runs them through the layer in torch (`topq.ir.torch_kernels`)
with every linear at its current quantize-dequantize Ŵ (scales rounded as they are stored). The loss is
||layer_q(x_q) − layer(x_f)||²: the quantized layer on what the quantized model feeds it against the float layer
on what the float model feeds it (auto-round's `enable_quanted_input`), so a layer also makes up for the error of
the layers before it. Its gradient with respect to each Ŵ — through attention, the norms and the MLP — goes through
the straight-through quantizer of the per-linear objective (`learned_rounding.Rounding`) into the offsets V and range
factors α, β, stepped by SignSGD with the learning rate decaying linearly to 0. The layer keeps the parameters of
its lowest minibatch loss (step 0 is round-to-nearest), as auto-round does.

Unlike the per-linear objective, q_proj and k_proj tune their ranges too: the block loss sees q·kᵀ and the softmax.

Parallel work and determinism: a minibatch is cut into shards of SHARD windows, each a task on the loop's threads
(`LayerInputs.map`, torch on one intra-op thread each), and the shards' losses and gradients are summed in shard
order; each linear's quantizer step, with its next quantize-dequantize, is a task too. Any executor and job
count give the same bits.

The report rows of a tuned layer give the layer's relative output error (not each linear's): on the first
`batch_size` windows, sqrt(loss / ||layer(x_f)||²) with the tuned weights (`error`) and with round-to-nearest
(`rtn_error`), and their loss ratio (`ratio`), with `objective: block`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from topq.ir.graph import Function
from topq.ir.products import torch_thread_count
from topq.ir.torch_kernels import TorchFunction, require_torch, uncovered_ops
from topq.quant.calibration import LayerInputs, LayerState, LayerTuner
from topq.quant.learned_rounding import Rounding, step_size

#: windows per gradient task (a minibatch of 8 is two tasks: the two cores of a small machine)
SHARD = 4
#: the minibatch draws' seed (auto-round's default seed)
SEED = 42


def covers(function: Function, options: Mapping[str, Any]) -> bool:
    """The block objective is chosen and torch runs every op of the layer (else: the per-linear objective)."""
    return options["objective"] == "block" and not uncovered_ops(function)


def tune(layer: LayerInputs, state: LayerState, options: Mapping[str, Any]) -> np.ndarray:
    """Quantize every linear of `layer` on the layer's output (see the module doc); the float layer's outputs."""
    torch = require_torch()
    fn = TorchFunction(layer.module, layer.name, options["calibration_matmul"])
    roundings = [Rounding(state.float_weight(n), options["bits"], options["group_size"], options["symmetric"],
                          state.scale_dtype) for n in layer.linears]  # the scales as `state` stores them
    tuned = set(layer.linears)
    others = {n: torch.asarray(state.current_weight(n)) for n in fn.weights if n not in tuned}
    samples, seq_len = layer.inputs.shape[:2]
    positions = torch.arange(seq_len, dtype=torch.int32)[None]

    def run(x: np.ndarray, weights: Mapping[str, Any]) -> Any:
        return fn([torch.asarray(x), positions], {**others, **weights})[0]

    # the linears in the products' dtype, cast once per step for all shards (bf16 leaves get bf16 gradients: only
    # their signs, summed in float32, step the parameters)
    linear_dtype = torch.bfloat16 if options["calibration_matmul"] == "bf16" else torch.float32

    def for_products(array: np.ndarray) -> Any:
        return torch.asarray(array).to(linear_dtype)

    def weights_of(arrays: Sequence[np.ndarray]) -> dict[str, Any]:
        return {n: for_products(a) for n, a in zip(layer.linears, arrays)}

    def shards(rows: np.ndarray) -> list[np.ndarray]:
        return [rows[a:a + SHARD] for a in range(0, len(rows), SHARD)]

    float_weights = weights_of([r.w for r in roundings])

    # the float layer's outputs: the targets, and the next layer's float inputs. Each shard overwrites its own rows
    # of the float inputs, which nothing reads after (`LayerInputs`): one [samples, L, H] buffer, not two
    targets = layer.float_inputs

    def float_outputs(rows: np.ndarray) -> None:
        with torch.no_grad():
            targets[rows] = run(targets[rows], float_weights).numpy()

    def loss_of(rows: np.ndarray, weights: Mapping[str, Any]) -> float:
        with torch.no_grad():
            return float((run(layer.inputs[rows], weights) - torch.asarray(targets[rows])).square().sum())

    def loss_and_grads(rows: np.ndarray, w_hat: Mapping[str, Any], last: bool) -> tuple[float, list[Any]]:
        if last:  # the last draw only scores the final parameters: no backward pass
            return loss_of(rows, w_hat), []
        leaves = {n: w.detach().requires_grad_(True) for n, w in w_hat.items()}
        diff = run(layer.inputs[rows], leaves) - torch.asarray(targets[rows])
        error = diff.detach()
        # d loss / d out = 2 (out − target), given as it is: the same bits as autograd's square and sum backward
        grads = torch.autograd.grad(diff, list(leaves.values()), grad_outputs=2 * error)
        return float(error.square().sum()), list(grads)  # in the products' dtype: `advance` sums them

    iters, lr = int(options["iters"]), float(options["lr"])
    batch = min(int(options["batch_size"]), samples)
    draws = minibatches(samples, batch, (SEED, layer.layer))
    # the linears' tasks largest first, so that the threads finish together
    order = sorted(range(len(roundings)), key=lambda i: -roundings[i].w.size)

    def advance(i: int, shard_grads: Sequence[Any], previous: Any, lr_now: np.float32) -> tuple[Any, Any]:
        """Linear i's SignSGD step on its shards' gradients (`summed` in shard order; none before step 0), then
        its next quantize-dequantize, and that in the products' dtype for the shards."""
        rounding = roundings[i]
        if shard_grads:
            rounding.step(summed(shard_grads), previous, lr_now)
        forward = rounding.forward()
        return forward, for_products(forward.y.reshape(rounding.shape))

    def advance_all(parts: Sequence[tuple[float, list[Any]]], previous: Sequence[Any],
                    lr_now: np.float32) -> tuple[list[Any], dict[str, Any]]:
        done = dict(zip(order, layer.map(
            lambda i: advance(i, [part[1][i] for part in parts], previous[i] if parts else None, lr_now), order)))
        return [done[i][0] for i in range(len(roundings))], {n: done[i][1] for i, n in enumerate(layer.linears)}

    with torch_thread_count(1):  # the shards are the parallel part: each runs torch on the thread that runs it
        layer.map(float_outputs, shards(np.arange(samples)))
        best_loss, best = np.inf, [r.params() for r in roundings]
        forwards, step_weights = advance_all([], [], np.float32(0))
        rtn = [f.y.reshape(r.shape) for f, r in zip(forwards, roundings)]  # V = 0, α = β = 1, for the report
        for step in range(iters + 1):
            drawn = shards(next(draws))
            parts = layer.map(lambda rows, w=step_weights, last=step == iters: loss_and_grads(rows, w, last), drawn)
            loss = sum(part[0] for part in parts)
            if loss < best_loss:
                best_loss, best = loss, [r.params() for r in roundings]
            if step == iters:
                break
            forwards, step_weights = advance_all(parts, forwards, step_size(lr, step, iters))
        quantized = [r.quantized(p) for r, p in zip(roundings, best)]
        for name, qw in zip(layer.linears, quantized):
            state.set_quantized(name, qw)
        first = np.arange(batch)
        reference = float(np.square(targets[first], dtype=np.float64).sum())
        rtn_weights = weights_of(rtn)
        tuned_weights = weights_of([state.current_weight(n) for n in layer.linears])
        rtn_loss = sum(layer.map(lambda rows: loss_of(rows, rtn_weights), shards(first)))
        tuned_loss = sum(layer.map(lambda rows: loss_of(rows, tuned_weights), shards(first)))
    _report(state, layer, tuned_loss, rtn_loss, reference)
    return targets


def summed(grads: Sequence[Any]) -> np.ndarray:
    """Torch gradients (bf16 or float32) summed in float32 in their order, as a row-major array: the first widened
    into the sum, the others added to it, each widened exactly on the way — the bits of widening each and summing,
    in fewer passes (and the gate/up gradients, transposed views, read once)."""
    torch = require_torch()
    total = torch.empty(grads[0].shape, dtype=torch.float32).copy_(grads[0])
    for g in grads[1:]:
        total.add_(g)
    return total.numpy()


def minibatches(samples: int, batch: int, seed: Any) -> Iterator[np.ndarray]:
    """Endless minibatches of `batch` sample indices, as auto-round's IndexSampler draws them: each epoch a new
    seeded shuffle of all samples cut into batches (an incomplete last batch is dropped), so every window is seen
    about equally often."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(samples)
        for a in range(0, samples - batch + 1, batch):
            yield order[a:a + batch]


def _report(state: LayerState, layer: LayerInputs, tuned: float, rtn: float, reference: float) -> None:
    def rel(loss: float) -> float:
        return float(np.sqrt(loss / reference)) if reference > 0 else 0.0

    for name in layer.linears:
        state.result.report.append({"name": name, "objective": "block", "error": rel(tuned), "rtn_error": rel(rtn),
                                    "ratio": tuned / rtn if rtn > 0 else 0.0})


LAYER_TUNER = LayerTuner(covers, tune)
