"""Errors that the CLI reports as one clear line (no traceback). Defined in the IR leaf package, which every
other part of topq may import; this module is where the rest of topq takes them from."""

from topq.ir.errors import TopqError, UnknownNameError

__all__ = ["TopqError", "UnknownNameError"]
