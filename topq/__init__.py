"""topq: a plugin-based, multi-target LLM quantization and compilation toolkit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from topq.core.hookspecs import hookimpl

__all__ = ["__version__", "hookimpl"]


def __getattr__(name: str) -> Any:
    # Plugins write `@topq.hookimpl`. It is looked up on first use, not imported here: importing any part of topq
    # runs this file, and the leaf package topq.ir must not pull in topq.core (and pluggy) with it.
    if name == "hookimpl":
        from topq.core.hookspecs import hookimpl

        return hookimpl
    raise AttributeError(f"module 'topq' has no attribute {name!r}")
