"""Progress bars, one switch per process: inside `showing_progress(False)` every `progress_bar` stays hidden, on any
thread (a global, not a context variable: calibration makes bars on the layer loop's threads)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

_shown = True


@contextmanager
def showing_progress(shown: bool) -> Iterator[None]:
    """Show (or hide) every `progress_bar` made inside the block; nests, and restores the outer setting."""
    global _shown
    outer, _shown = _shown, _shown and shown
    try:
        yield
    finally:
        _shown = outer


def progress_bar(iterable: Iterable[Any] | None = None, *, disable: bool = False, **kwargs: Any) -> tqdm:
    """`tqdm(iterable, **kwargs)`, hidden when `disable` or inside `showing_progress(False)`."""
    return tqdm(iterable, disable=disable or not _shown, **kwargs)
