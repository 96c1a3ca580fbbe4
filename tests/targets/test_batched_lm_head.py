"""Perplexity (`topq eval`) runs lm_head once per prompt segment on all its positions, on every target.

For host, the bm1684x emulator (W4BF16) and onnx, one tiny llama bundle each: the batched logits equal the
per-position ones within float tolerance (a [T, H] x [H, V] GEMM sums in another order than T matrix-vector
products), the perplexity is the same to 1e-6, and the runtime makes one lm_head call per segment instead of one
per position. Batched runs are deterministic (the same call twice gives the same bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from host_bundles import TINY_STAGES, TinyCheckpoint

from topq.core.bundle import Bundle
from topq.core.pipeline import convert
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session, open_executor, perplexity
from topq.core.target import Executor

VOCAB = 256
#: target → (chip, scheme)
TARGETS = {"host": ("host", "f32"), "bm1684x": ("bm1684x", "w4bf16"), "onnx": ("onnx", "f32")}


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> Callable[[str], Bundle]:
    directory = tmp_path_factory.mktemp("batched_lm_head")
    tiny_checkpoint("llama", directory)
    cache: dict[str, Bundle] = {}

    def get(target: str) -> Bundle:
        if target not in cache:
            chip, scheme = TARGETS[target]
            out = directory / f"{target}.topq"
            convert(recipe_from_defaults(model={"path": str(directory)}, quant={"scheme": scheme},
                                         target={"chip": chip}, stages=TINY_STAGES, output={"path": str(out)}),
                    progress=False)
            cache[target] = Bundle(out)
        return cache[target]

    return get


def per_position(executor: Any) -> Executor:
    """The same executor with batched lm_head calls turned off: the runtime's one-call-per-position path."""
    executor.lm_head_rows = False
    return executor


@pytest.mark.parametrize("target", list(TARGETS))
def test_batched_logits_equal_per_position_logits(tiny_bundle: Callable[[str], Bundle], target: str) -> None:
    bundle = tiny_bundle(target)
    ids = np.random.default_rng(3).integers(3, VOCAB, size=40).tolist()  # 16 + 16 + 8: prefill, two with history
    batched = Session(bundle, open_executor(bundle))
    assert batched.executor.lm_head_rows, f"{target}: lm_head should run on all positions at once"
    got = batched.feed(ids, all_logits=True)
    one_by_one = Session(bundle, per_position(open_executor(bundle)))
    ref = one_by_one.feed(ids, all_logits=True)
    assert got.shape == ref.shape == (40, VOCAB)
    assert batched.calls.count("lm_head") == 3 and one_by_one.calls.count("lm_head") == 40
    scale = float(np.abs(ref).max())
    assert float(np.abs(got - ref).max()) <= 1e-5 * scale
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    again = Session(bundle, batched.executor).feed(ids, all_logits=True)
    assert again.tobytes() == got.tobytes()  # deterministic: the same call gives the same bytes
    # a decode step after a batched prompt still runs lm_head on its one position
    assert batched.decode(int(got[-1].argmax())).shape == (VOCAB,)


@pytest.mark.parametrize("target", list(TARGETS))
def test_perplexity_batched_equals_per_position(tiny_bundle: Callable[[str], Bundle], target: str) -> None:
    bundle = tiny_bundle(target)
    ids = np.random.default_rng(5).integers(3, VOCAB, size=90).tolist()
    got = perplexity(bundle, ids, window=48, executor=open_executor(bundle))
    ref = perplexity(bundle, ids, window=48, executor=per_position(open_executor(bundle)))
    assert got[1] == ref[1] == 88
    assert got[0] == pytest.approx(ref[0], rel=1e-6)


def test_bm1684x_batched_lm_head_under_the_checker(tiny_bundle: Callable[[str], Bundle]) -> None:
    """With the checker on, the one-position calls are checked as before and the batched call gives the same
    logits as without it (it writes no DDR)."""
    from topq.plugins.targets.bm1684x import open_bundle
    from topq.plugins.targets.bm1684x.spec import BM1684X

    bundle = tiny_bundle("bm1684x")
    ids = np.random.default_rng(7).integers(3, VOCAB, size=20).tolist()
    checked = Session(bundle, open_bundle(bundle, BM1684X, checker=True)).feed(ids, all_logits=True)
    plain = Session(bundle, open_bundle(bundle, BM1684X, checker=False)).feed(ids, all_logits=True)
    assert checked.tobytes() == plain.tobytes()


@pytest.mark.parametrize("target", ["host", "bm1684x"])
def test_other_hidden_sizes_are_still_refused(tiny_bundle: Callable[[str], Bundle], target: str) -> None:
    from topq.core.errors import TopqError

    executor = open_executor(tiny_bundle(target))
    with pytest.raises(TopqError, match=r"@lm_head: input.* of shape \[1, 3, 32\], expected \[1, 1, 64\]"):
        executor.run("lm_head", [np.zeros((1, 3, 32), np.float32)])
