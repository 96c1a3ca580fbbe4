"""Where conversion tasks run: in this process, in a local process pool, or on a Ray cluster.

A task is a module-level function and JSON-able arguments, so every executor runs the same code; results come
back in submission order, which keeps bundles byte-identical whatever runs them.

Large state many tasks read (a layer's weights during calibration) is handed over once with `share(obj)`: the
returned handle goes in the tasks' arguments (as a top-level argument) and a task turns it back into the object
with `resolve(handle)`. In this process the handle is the object; a forked pool stores it in a module table and
forks fresh workers, which inherit it (copy-on-write, nothing is serialised); Ray stores it once in its object
store (`ray.put`) and resolves it in the worker.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Protocol

from topq.core.errors import TopqError


class TaskExecutor(Protocol):
    name: str
    jobs: int  # tasks that run at once
    shares_memory: bool  # tasks see the parent's memory as of the last `share` / `refresh` (no serialisation)

    def map(self, fn: Callable[..., Any], tasks: Sequence[tuple[Any, ...]]) -> Iterator[Any]:
        """fn(*task) for every task; results in task order."""
        ...

    def share(self, obj: Any) -> Any:
        """A handle for `obj` to pass as a top-level task argument; tasks call `resolve(handle)`."""
        ...

    def release(self, handle: Any) -> None:
        """The tasks reading `handle` are done."""
        ...

    def refresh(self) -> None:
        """The parent's state changed: workers that inherit it must be forked again before the next `map`."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SharedKey:
    """A handle of an object shared with forked workers: its key in this module's `_SHARED` table."""

    key: str


#: objects shared with forked workers (they inherit this table when they fork)
_SHARED: dict[str, Any] = {}


def resolve(handle: Any) -> Any:
    """The object behind a `share` handle (in a task)."""
    return _SHARED[handle.key] if isinstance(handle, SharedKey) else handle


class InlineExecutor:
    name = "inline"
    jobs = 1
    shares_memory = True

    def map(self, fn: Callable[..., Any], tasks: Sequence[tuple[Any, ...]]) -> Iterator[Any]:
        for task in tasks:  # lazily: each task runs when its result is asked for
            yield fn(*task)

    def share(self, obj: Any) -> Any:
        return obj

    def release(self, handle: Any) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def _die_with_parent(parent: int) -> None:
    """Pool worker start-up: the kernel kills this worker when the converting process dies, even by SIGKILL
    (otherwise workers of a killed conversion live on, adopted by init, holding hundreds of MB each)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: workers still exit when their task queue closes
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    # The parent owns interruption: a worker ends quietly when the pool stops it (SIGTERM) and leaves Ctrl-C,
    # which the terminal sends to the whole group, to the parent (the CLI's handlers are inherited by fork).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


_WORKER_DIED = "a conversion worker process died (killed, or out of memory); the conversion stopped and wrote nothing"


def _results(futures: list[Any]) -> Iterator[Any]:
    try:
        for future in futures:
            yield future.result()
    except BrokenProcessPool:
        raise TopqError(_WORKER_DIED) from None


class LocalExecutor:
    """A pool of worker processes. They fork from the parent, so state it prepared (the compiled program,
    the open checkpoint) is inherited instead of rebuilt."""

    name = "local"
    shares_memory = True

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self._pool: ProcessPoolExecutor | None = None

    def map(self, fn: Callable[..., Any], tasks: Sequence[tuple[Any, ...]]) -> Iterator[Any]:
        if not tasks:
            return iter(())
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=multiprocessing.get_context("fork"),
                                             initializer=_die_with_parent, initargs=(os.getpid(),))
        try:
            futures = [self._pool.submit(fn, *task) for task in tasks]
        except BrokenProcessPool:
            raise TopqError(_WORKER_DIED) from None
        return _results(futures)

    def share(self, obj: Any) -> Any:
        key = uuid.uuid4().hex
        _SHARED[key] = obj
        self.refresh()  # workers forked before this point do not have it
        return SharedKey(key)

    def release(self, handle: Any) -> None:
        if isinstance(handle, SharedKey):
            _SHARED.pop(handle.key, None)

    def refresh(self) -> None:
        # Forking a pool is cheap (copy-on-write); the next `map` forks one from the current state.
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class RayExecutor:
    """The same tasks on a Ray cluster (`address`: "auto", "ray://host:port", or None to start a local instance)."""

    name = "ray"
    shares_memory = False

    def __init__(self, address: str | None = None, jobs: int | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise TopqError("executor 'ray' needs the optional dependency: pip install 'topq[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=address, num_cpus=jobs if address is None else None, include_dashboard=False,
                     log_to_driver=False, ignore_reinit_error=True)
        self.jobs = jobs if jobs and address is None else max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._remote: dict[Callable[..., Any], Any] = {}

    def map(self, fn: Callable[..., Any], tasks: Sequence[tuple[Any, ...]]) -> Iterator[Any]:
        remote = self._remote.get(fn)
        if remote is None:  # registered once per function, not once per map (calibration maps hundreds of times)
            remote = self._remote[fn] = self.ray.remote(fn)
        refs = [remote.remote(*task) for task in tasks]
        return (self.ray.get(ref) for ref in refs)

    def share(self, obj: Any) -> Any:
        # An ObjectRef passed as a top-level task argument arrives in the task as the object itself.
        return self.ray.put(obj)

    def release(self, handle: Any) -> None:
        pass  # the object is freed when the last reference (the caller's) goes

    def refresh(self) -> None:
        pass  # workers share nothing with this process: every task carries what it reads

    def close(self) -> None:
        pass  # the cluster outlives one conversion; a local instance ends with this process


def make_executor(name: str = "local", jobs: int | None = None, address: str | None = None) -> TaskExecutor:
    jobs = jobs or os.cpu_count() or 1
    if name == "local":
        return InlineExecutor() if jobs == 1 else LocalExecutor(jobs)
    if name == "ray":
        return RayExecutor(address, jobs)
    raise TopqError(f"unknown executor {name!r}; known: local, ray")
