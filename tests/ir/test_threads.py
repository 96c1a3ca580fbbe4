"""BLAS threads chosen per call (topq/ir/threads.py): decode single-threaded, prefill at the library's default,
the same results as a fixed thread count, and `TOPQ_BLAS_THREADS` checked."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from topq.core.errors import TopqError
from topq.core.runtime import Session
from topq.ir import threads


def current_threads() -> int:
    return int(threads._blas().info()[0]["num_threads"])


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests run with OPENBLAS_NUM_THREADS=1 (conftest); act as if the library defaulted to 2 threads."""
    monkeypatch.setattr(threads, "max_threads", lambda: 2)
    monkeypatch.delenv(threads.ENV, raising=False)


class Spy:
    """An executor that records the BLAS thread count each function call ran with."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seen = inner, []

    def run(self, name: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        self.seen.append((name, current_threads()))
        return self.inner.run(name, inputs)


@pytest.mark.parametrize(("k", "n"), [(64, 256), (576, 1536), (1536, 576), (576, 4096)])
def test_one_row_products_do_not_depend_on_the_thread_count(k: int, n: int) -> None:
    """What makes single-threaded decode change no result: a matrix-vector product is bit-identical for 1 and 2
    threads (the row and the transposed-weight layouts the interpreters use)."""
    rng = np.random.default_rng(k + n)
    x, w = rng.standard_normal((1, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)
    with threads.blas_threads(1):
        one = (x @ w.T, w @ x[0])
    with threads.blas_threads(2):
        two = (x @ w.T, w @ x[0])
    assert all(np.array_equal(a, b) for a, b in zip(one, two))


def test_decode_is_single_threaded_and_prefill_uses_the_default(two_threads: None, tiny_host: Any) -> None:
    before = current_threads()
    session = Session(tiny_host("llama").bundle)
    spy = Spy(session.executor)
    session.executor = spy
    logits = session.feed([1, 5, 9, 2])
    session.decode(int(np.argmax(logits)))
    by_kind = {name.rstrip("0123456789_"): count for name, count in spy.seen}
    assert by_kind["block"] == 2 and by_kind["embedding"] == 2  # 16 rows (max_input_length): two threads
    assert by_kind["block_cache"] == 1 and by_kind["embedding_cache"] == 1 and by_kind["lm_head"] == 1
    assert current_threads() == before  # the caller's setting is restored


def test_per_call_threads_give_the_results_of_fixed_threads(two_threads: None, tiny_host: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = tiny_host("qwen2").bundle

    def run() -> list[np.ndarray]:
        session = Session(bundle)
        out = [session.feed([3, 1, 4, 1, 5, 9, 2, 6], all_logits=True)]
        for _ in range(4):
            out.append(session.decode(int(np.argmax(out[-1].reshape(-1, out[-1].shape[-1])[-1]))))
        return out

    auto = run()
    monkeypatch.setenv(threads.ENV, "2")  # every call at the library's default: the behaviour before the choice
    fixed = run()
    assert all(np.array_equal(a, b) for a, b in zip(auto, fixed))


def test_fixed_threads_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(threads.ENV, "3")
    assert threads.threads_for(1) == threads.threads_for(4096) == 3
    monkeypatch.setenv(threads.ENV, "auto")
    assert threads.threads_for(1) == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(threads.ENV, bad)
        with pytest.raises(TopqError, match="TOPQ_BLAS_THREADS"):
            threads.threads_for(1)


def test_kernel_info_names_the_library_and_its_core_type() -> None:
    (info, *_) = threads.kernel_info()
    assert info["internal_api"] == "openblas" and info["architecture"]
    assert "OPENBLAS_CORETYPE" in info
