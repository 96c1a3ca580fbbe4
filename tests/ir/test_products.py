"""The linears' products (topq/ir/products.py): float32 numpy outside any block and inside `products("f32")`;
torch bf16 inside `products("bf16")` — operands and result rounded to bf16, the same bits for any torch thread
count — for this thread only; refused kinds and a missing torch are one clear error."""

from __future__ import annotations

import sys
import threading

import ml_dtypes
import numpy as np
import pytest
import torch

from topq.ir import products
from topq.ir.errors import TopqError
from topq.ir.reference_ops import REFERENCE_OPS, mlp_hidden

# SmolLM2-135M's calibration shapes (a 512-token window): linears, MLP projections, Hessian Grams, and AutoRound's
# D·H on a chunk of rows
SHAPES = [(512, 576, 576), (512, 576, 1536), (512, 1536, 576), (576, 512, 576), (1536, 512, 1536),
          (256, 576, 576), (256, 1536, 1536)]


def _pair(m: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def test_float32_products_are_numpys_bit_for_bit() -> None:
    x, w = _pair(7, 64, 48)
    expected = np.matmul(x, w)
    np.testing.assert_array_equal(products.matmul(x, w), expected)
    with products.products("f32"):
        np.testing.assert_array_equal(products.linear(x[None], w.T, True)[0], expected)


def test_bf16_products_round_operands_and_result_to_bf16() -> None:
    x, w = _pair(64, 256, 96)
    with products.products("bf16"):
        y = products.matmul(x, w)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, _bf16(y))  # a bf16 result, widened
    exact = _bf16(x).astype(np.float64) @ _bf16(w).astype(np.float64)  # rounded operands, exact sums
    # the result's own bf16 rounding (2^-9 relative) plus the float32 accumulation's
    assert np.all(np.abs(y - exact) <= np.abs(exact) * 2.0 ** -8 + 1e-4 * np.sqrt(256))
    f32 = x @ w
    assert not np.array_equal(y, f32)
    assert np.abs(y - f32).max() < 0.05 * np.abs(f32).max()


def test_the_reference_linears_take_the_blocks_products() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 16, 64), dtype=np.float32)
    wg, wu = (rng.standard_normal((96, 64), dtype=np.float32) for _ in range(2))
    wd = rng.standard_normal((64, 96), dtype=np.float32)
    linear = REFERENCE_OPS["top.MatMul"]
    f32 = linear([x, wg], {"right_transpose": True})[0]
    mlp_f32 = REFERENCE_OPS["top.MLP"]([x, wg, wu, wd], {"act": "silu"})[0]
    with products.products("bf16"):
        bf16 = linear([x, wg], {"right_transpose": True})[0]
        gate = mlp_hidden(x, wg, wu, "silu")[0]
        mlp_bf16 = REFERENCE_OPS["top.MLP"]([x, wg, wu, wd], {"act": "silu"})[0]
    np.testing.assert_array_equal(bf16, _bf16(bf16))
    np.testing.assert_array_equal(gate, bf16.reshape(gate.shape))  # the same product as top.MatMul's
    np.testing.assert_array_equal(mlp_bf16, _bf16(mlp_bf16))  # the down projection too
    assert not np.array_equal(bf16, f32) and not np.array_equal(mlp_bf16, mlp_f32)
    np.testing.assert_allclose(mlp_bf16, mlp_f32, rtol=0.05, atol=0.05 * float(np.abs(mlp_f32).max()))


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_bf16_products_do_not_depend_on_torchs_thread_count(m: int, k: int, n: int) -> None:
    """What makes bf16 calibration give the same bundle on any executor and job count."""
    x, w = _pair(m, k, n, seed=m + n)
    results = []
    for count in (1, 2):
        with products.torch_threads("bf16", count), products.products("bf16"):
            assert torch.get_num_threads() == count
            results.append(products.matmul(x, w))
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize(("tokens", "k"), [(512, 576), (512, 1536), (256, 600), (40, 48)])
def test_the_gram_strips_are_the_whole_products_rows(kind: str, tokens: int, k: int) -> None:
    """The Hessians' Gram sums mirror the strips' upper triangle. In float32 the strips are views of numpy's one
    (syrk, symmetric) product. In bf16 they are products of their own (torch has no syrk): bf16 results, within the
    bf16 rounding of the whole product's rows (on AVX512-BF16 CPUs the very bits, docs/speed.md, twenty-fifth
    round; other CPUs' kernels may sum in another order)."""
    x = np.random.default_rng(k).standard_normal((tokens, k), dtype=np.float32)
    x *= np.exp(np.random.default_rng(1).standard_normal(k, dtype=np.float32))  # channels of unequal scale
    with products.products(kind):
        whole = products.matmul(x.T, x)
        strips = products.gram_upper(x)
    starts = list(range(0, k, products.GRAM_STRIP))
    assert len(strips) == len(starts)
    bound = np.abs(_bf16(x)).T @ np.abs(_bf16(x)) * 2.0 ** -7  # two bf16 roundings of a sum of these magnitudes
    for start, strip in zip(starts, strips):
        assert strip.dtype == np.float32 and strip.shape == (min(products.GRAM_STRIP, k - start), k - start)
        rows = slice(start, start + products.GRAM_STRIP)
        if kind == "f32":
            np.testing.assert_array_equal(strip, whole[rows, start:])
        else:
            np.testing.assert_array_equal(strip, _bf16(strip))  # bf16 products, not numpy's
            assert np.all(np.abs(strip - whole[rows, start:]) <= bound[rows, start:])
    if kind == "f32":
        np.testing.assert_array_equal(whole, whole.T)
    else:
        assert not np.array_equal(strips[0], (x.T @ x)[:products.GRAM_STRIP])


def test_torch_threads_are_restored_and_untouched_for_float32() -> None:
    before = torch.get_num_threads()
    with products.torch_threads("f32", before + 1):
        assert torch.get_num_threads() == before
    with products.torch_threads("bf16", before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before


def test_the_choice_holds_for_the_thread_that_made_it() -> None:
    x, w = _pair(8, 64, 32)
    seen: list[np.ndarray] = []
    with products.products("bf16"):
        worker = threading.Thread(target=lambda: seen.append(products.matmul(x, w)))
        worker.start()
        worker.join()
        inside = products.matmul(x, w)
    np.testing.assert_array_equal(seen[0], x @ w)  # another thread: float32
    np.testing.assert_array_equal(inside, _bf16(inside))
    np.testing.assert_array_equal(products.matmul(x, w), x @ w)  # after the block: float32 again


def test_an_unknown_kind_and_a_missing_torch_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TopqError, match=r"^quant.calibration_matmul: expected one of f32, bf16; got 'bf8'$"):
        products.check_kind("bf8", "quant.calibration_matmul")
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    assert products.check_kind("f32") == "f32"
    with pytest.raises(TopqError, match=r"^bf16 calibration products need torch \(pip install torch\)$"):
        with products.products("bf16"):
            pass
