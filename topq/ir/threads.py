"""BLAS threads chosen per call (threadpoolctl), so small products do not oversubscribe a busy machine.

A decode step is a chain of matrix-vector products of a few microseconds each: a second BLAS thread only adds
a wake-up and a join per product, and on a loaded 2-core machine the threads wait for each other (measured:
2.0 tokens/s with OpenBLAS's default threads, 16.4 with one). Products with many rows (prefill, calibration)
do gain from a second core. So the runtime asks for `threads_for(rows)` around each call of a program
function and calibration around its layer loop; `TOPQ_BLAS_THREADS=N` fixes every call to N threads instead
(the benchmark's "fixed" setting; `auto`, the default, is the per-call choice).

The ceiling is what the BLAS library would use on its own (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, else the
cores it sees), read once, so a user's thread setting is never exceeded.

Results: a one-row product (matrix-vector, all a decode step has) is bit-identical for any thread count, so
running decode single-threaded changes no result; products with many rows may differ in the last bit between
thread counts (OpenBLAS picks other kernels and blockings), so big products keep the library's default count
— exactly what ran before this choice existed (tests/ir/test_threads.py checks both).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

from topq.ir.errors import TopqError

#: rows of a product (tokens of a call) from which a second thread pays for its wake-up
MIN_ROWS_FOR_THREADS = 16
ENV = "TOPQ_BLAS_THREADS"


@cache
def _blas() -> Any:
    """threadpoolctl's controller of the BLAS libraries loaded in this process (numpy's OpenBLAS)."""
    import numpy  # noqa: F401  (loads the BLAS library the controller must see)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


@cache
def max_threads() -> int:
    """The threads the BLAS library uses by default (its own environment / core count), at least 1."""
    counts = [int(info.get("num_threads") or 1) for info in _blas().info()]
    return max([1, *counts])


def fixed_threads() -> int | None:
    """`TOPQ_BLAS_THREADS` as a number, or None for the per-call choice (`auto` or unset)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if not value.isdigit() or int(value) < 1:
        raise TopqError(f"{ENV}={value!r}: expected 'auto' or a positive number of threads")
    return int(value)


def threads_for(rows: int) -> int:
    """BLAS threads for products with `rows` rows: one for decode-sized products, the library's default for big
    ones (or the fixed `TOPQ_BLAS_THREADS`)."""
    fixed = fixed_threads()
    if fixed is not None:
        return fixed
    return 1 if rows < MIN_ROWS_FOR_THREADS else max_threads()


@contextmanager
def blas_threads(count: int) -> Iterator[None]:
    """Run the block with `count` BLAS threads, then restore the previous setting; no library call when the
    setting already is `count` (the common nested case costs nothing)."""
    blas = _blas()
    current = [int(info.get("num_threads") or 1) for info in blas.info()]
    if all(c == count for c in current):
        yield
        return
    with blas.limit(limits=count):
        yield


def kernel_info() -> list[dict[str, Any]]:
    """Which BLAS ran: library, version, the core type it chose (OpenBLAS `architecture`), threads; plus
    OPENBLAS_CORETYPE when the environment forces one (benchmarks print this beside their numbers)."""
    rows = []
    for info in _blas().info():
        rows.append({key: info.get(key) for key in ("internal_api", "version", "architecture", "threading_layer",
                                                       "num_threads", "filepath")})
    forced = os.environ.get("OPENBLAS_CORETYPE")
    return [{**row, "OPENBLAS_CORETYPE": forced} for row in rows]


def kernel_name(info: dict[str, Any]) -> str:
    """One `kernel_info` row as benchmarks print it: library, version, core type and any forced core type."""
    return (f"{info['internal_api']} {info['version']} core type {info['architecture']} "
            f"(OPENBLAS_CORETYPE={info['OPENBLAS_CORETYPE']})")
