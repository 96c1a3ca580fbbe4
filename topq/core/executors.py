"""Where conversion tasks run: in this process, in a local process pool, or on a Ray cluster.

A task is a module-level function and JSON-able arguments, so every executor runs the same code; results come
back in submission order, which keeps bundles byte-identical whatever runs them.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Protocol

from topq.core.errors import TopqError


class TaskExecutor(Protocol):
    name: str

    def map(self, fn: Callable[..., Any], tasks: Sequence[tuple[Any, ...]]) -> Iterator[Any]:
        """fn(*task) for every task; results in task order."""
        ...

    def close(self) -> None: ...


class InlineExecutor:
    name = "inline"

    def map(self, fn: Callable[..., Any], tasks: Sequence[tuple[Any, ...]]) -> Iterator[Any]:
        for task in tasks:
            yield fn(*task)

    def close(self) -> None:
        pass


class LocalExecutor:
    """A pool of worker processes. They fork from the parent, so state it prepared (the compiled program,
    the open checkpoint) is inherited instead of rebuilt."""

    name = "local"

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self._pool: ProcessPoolExecutor | None = None

    def map(self, fn: Callable[..., Any], tasks: Sequence[tuple[Any, ...]]) -> Iterator[Any]:
        if not tasks:
            return iter(())
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=multiprocessing.get_context("fork"))
        futures = [self._pool.submit(fn, *task) for task in tasks]
        return (f.result() for f in futures)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class RayExecutor:
    """The same tasks on a Ray cluster (`address`: "auto", "ray://host:port", or None to start a local instance)."""

    name = "ray"

    def __init__(self, address: str | None = None, jobs: int | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise TopqError("executor 'ray' needs the optional dependency: pip install 'topq[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=address, num_cpus=jobs if address is None else None, include_dashboard=False,
                     log_to_driver=False, ignore_reinit_error=True)

    def map(self, fn: Callable[..., Any], tasks: Sequence[tuple[Any, ...]]) -> Iterator[Any]:
        remote = self.ray.remote(fn)
        refs = [remote.remote(*task) for task in tasks]
        return (self.ray.get(ref) for ref in refs)

    def close(self) -> None:
        pass  # the cluster outlives one conversion; a local instance ends with this process


def make_executor(name: str = "local", jobs: int | None = None, address: str | None = None) -> TaskExecutor:
    jobs = jobs or os.cpu_count() or 1
    if name == "local":
        return InlineExecutor() if jobs == 1 else LocalExecutor(jobs)
    if name == "ray":
        return RayExecutor(address, jobs)
    raise TopqError(f"unknown executor {name!r}; known: local, ray")
