"""Who computes the linears' matrix products of the reference kernels: numpy float32 (the reference, always) or,
inside `products("bf16")`, torch in bfloat16.

The bf16 products exist for calibration (`quant.calibration_matmul: bf16`): on a CPU with bf16 matrix units
(AMX, AVX512-BF16) torch multiplies bf16 matrices 3–5× faster than numpy's float32 BLAS
(`benchmarks/calibration_kernels.py`), and the calibration layer loop is mostly such products. Operands are
rounded to bf16 (nearest even), accumulated in float32 inside oneDNN, and the result is rounded to bf16 and
widened back to float32 — what a bf16 target computes for a linear, not what the float32 reference computes.

Which products: a `top.MatMul` by a 2-D matrix (the linears), `top.MLP`'s three projections, `top.MoE`'s router
and experts — all through `linear` —, through `gram_upper` the calibration Hessians' Gram sums
(`topq.quant.calibration.InputStats`), and through `matmul` AutoRound's per-step D·H. Attention's score and value
products, batched `top.MatMul`s, norms and activations stay float32 numpy, as does everything outside a `products`
block.

The choice is a context variable, so it holds for the thread (or task) that set it and nothing else: a worker
thread or process sets it itself (the calibration tasks do, from their step). Determinism: oneDNN's bf16 product
gives the same bits for any torch thread count on the same operands (tests/ir/test_products.py checks the
calibration shapes), so results do not depend on the executor or the job count; they may depend on the CPU's
instruction set, as float32 BLAS results do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from topq.ir.errors import TopqError

__all__ = ["GRAM_STRIP", "KINDS", "bf16_operand", "check_kind", "gram_upper", "linear", "matmul", "products",
           "torch_thread_count", "torch_threads"]

#: the kinds `products` takes: "f32" is numpy float32 (the reference), "bf16" torch bfloat16
KINDS = ("f32", "bf16")

#: rows of xᵀx per product of `gram_upper`
GRAM_STRIP = 256


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # torch is optional: only this kind needs it
        raise TopqError("bf16 calibration products need torch (pip install torch)") from None
    return torch


def _bf16_tensor(torch: Any, a: np.ndarray) -> Any:
    if a.dtype == ml_dtypes.bfloat16:  # already rounded (`bf16_operand`): its bits as they are
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    # torch.asarray shares the array (a read-only one too, which torch.from_numpy warns about)
    return torch.asarray(a).to(torch.bfloat16)


def _bf16_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    torch = _torch()
    y = torch.matmul(_bf16_tensor(torch, a), _bf16_tensor(torch, b))
    return y.to(torch.float32).numpy()


def _f32_gram_upper(x: np.ndarray) -> list[np.ndarray]:
    gram = x.T @ x  # numpy hands xᵀx to BLAS syrk: one triangle computed, mirrored
    return [gram[start:start + GRAM_STRIP, start:] for start in range(0, x.shape[1], GRAM_STRIP)]


def _bf16_gram_upper(x: np.ndarray) -> list[np.ndarray]:
    torch = _torch()
    xb = _bf16_tensor(torch, x)  # rounded once for every strip, both sides
    return [torch.matmul(xb[:, start:start + GRAM_STRIP].T, xb[:, start:]).to(torch.float32).numpy()
            for start in range(0, x.shape[1], GRAM_STRIP)]


def bf16_operand(x: np.ndarray) -> np.ndarray:
    """float32 `x` stored as bfloat16 (nearest even, as torch rounds a bf16 product's operands), in half the
    memory: a bf16 product of the result is the product of `x`, bit for bit. (The calibration loop keeps a value so
    when its only reader is such a product.)"""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class _Kind:
    """How one kind computes each product the module offers."""

    matmul: Callable[[np.ndarray, np.ndarray], np.ndarray]
    gram_upper: Callable[[np.ndarray], list[np.ndarray]]


_KIND_PRODUCTS = {"f32": _Kind(np.matmul, _f32_gram_upper), "bf16": _Kind(_bf16_matmul, _bf16_gram_upper)}

_PRODUCTS: ContextVar[_Kind] = ContextVar("topq_products", default=_KIND_PRODUCTS["f32"])


def check_kind(kind: str, what: str = "products") -> str:
    """`kind` if it is one of KINDS and can run here (bf16 needs torch); else a TopqError naming `what`."""
    if kind not in _KIND_PRODUCTS:
        raise TopqError(f"{what}: expected one of {', '.join(KINDS)}; got {kind!r}")
    if kind == "bf16":
        _torch()
    return kind


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b with the products of the current `products` block (float32 numpy outside any)."""
    return _PRODUCTS.get().matmul(a, b)


def gram_upper(x: np.ndarray) -> list[np.ndarray]:
    """The upper triangle of xᵀx (x float32 [tokens, K]) with the current block's products, as row strips: strip i
    is rows [iS, iS + S) and columns [iS, K) of xᵀx, S = GRAM_STRIP.

    A Gram is symmetric. numpy's float32 product computes one triangle already (syrk; the strips are views of its
    whole result); torch has no syrk, so in bf16 only the strips are multiplied, ~0.6× a whole product's time at
    K = 1,536 (`benchmarks/calibration_kernels.py`). On an AVX512-BF16 CPU the strips are the very bits of those
    rows of one whole bf16 product, which is symmetric to the bit (docs/speed.md, twenty-fifth round), so a Gram
    mirrored from its strips is the whole product's; another CPU's kernels may sum in another order (within bf16
    rounding: tests/ir/test_products.py). Either way the strips depend on nothing but x: not on the jobs."""
    return _PRODUCTS.get().gram_upper(x)


def linear(x: np.ndarray, w: np.ndarray, transpose: bool) -> np.ndarray:
    """x[..., K] @ w (w: [K, N], or [N, K] if transpose) as one 2-D product."""
    wt = w.T if transpose else w  # a transposed view: BLAS takes it without a copy
    lead = x.shape[:-1]
    # Flattening the leading axes turns numpy's per-batch loop into a single sgemm.
    y = matmul(x.reshape(-1, x.shape[-1]), wt)
    return y.reshape(*lead, wt.shape[-1])


@contextmanager
def products(kind: str) -> Iterator[None]:
    """Run the block's linear products (see the module doc) as `kind`: "f32" (numpy) or "bf16" (torch)."""
    token = _PRODUCTS.set(_KIND_PRODUCTS[check_kind(kind)])
    try:
        yield
    finally:
        _PRODUCTS.reset(token)


@contextmanager
def torch_threads(kind: str, count: int) -> Iterator[None]:
    """For bf16 products, torch's intra-op threads set to `count` for the block (the calibration tasks are the
    parallel part, as for BLAS: `topq.ir.threads`); nothing for float32 products (torch may be absent)."""
    if kind != "bf16":
        yield
        return
    with torch_thread_count(count):
        yield


@contextmanager
def torch_thread_count(count: int) -> Iterator[None]:
    """torch's intra-op threads set to `count` for the block, then restored. The setting is the process's: the
    thread that owns the task threads sets it, and a task's own call is then a no-op (in a worker process it sets
    the worker's)."""
    torch = _torch()
    before = torch.get_num_threads()
    if before != count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
