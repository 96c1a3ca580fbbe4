"""topq: a plugin-based, multi-target LLM quantization and compilation toolkit."""

__version__ = "0.1.0"

from topq.core.hookspecs import hookimpl  # noqa: E402  (plugins write `@topq.hookimpl`)

__all__ = ["__version__", "hookimpl"]
