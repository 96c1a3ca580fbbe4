"""Writing files safely: an output appears whole or not at all (temp file beside it, then rename), and an
unwritable location is found before the work that would fill it, not after."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from topq.ir.errors import TopqError

__all__ = ["atomic_file", "check_writable", "umask"]


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
