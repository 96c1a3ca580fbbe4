"""Errors that the CLI reports as one clear line (no traceback)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class TopqError(Exception):
    """Bad input or an unsupported request: the message is shown to the user as one line."""


class UnknownNameError(TopqError, KeyError):
    """A name that no registry knows; the message lists the known names."""

    def __init__(self, kind: str, name: str, known: Iterable[str]) -> None:
        known = sorted(known)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        listing = ", ".join(known) if known else "none"
        super().__init__(f"unknown {kind} {name!r}{hint}; known: {listing}")
        self.kind, self.name, self.known = kind, name, known

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])
