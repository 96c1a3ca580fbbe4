"""The scalar functions a raw kernel may call, importable so kernel modules read naturally.

    from topq.raw import kernel, Input, InOut, exp

Inside a kernel the frontend recognises these by name (`exp(v)`, also `math.exp(v)` / `np.exp(v)`) and lowers
them to `math.*` ops; `max`, `min`, `abs` and `float` are Python's builtins. Outside a kernel they compute the
same thing in float32 numpy, so a kernel's source can be unit-tested as plain Python.
"""

from __future__ import annotations

import numpy as np

from topq.ir.reference_ops import erf as _erf64


def exp(x: np.ndarray | float) -> np.ndarray:
    return np.exp(np.float32(x))


def log(x: np.ndarray | float) -> np.ndarray:
    return np.log(np.float32(x))


def sqrt(x: np.ndarray | float) -> np.ndarray:
    return np.sqrt(np.float32(x))


def rsqrt(x: np.ndarray | float) -> np.ndarray:
    return np.float32(1) / np.sqrt(np.float32(x))


def tanh(x: np.ndarray | float) -> np.ndarray:
    return np.tanh(np.float32(x))


def erf(x: np.ndarray | float) -> np.ndarray:
    return np.asarray(_erf64(np.asarray(x, np.float64)), np.float32)


#: name in kernel source → math op (besides the builtins abs → math.absf, max/min → arith.maximumf/minimumf)
MATH_CALLS: dict[str, str] = {name: f"math.{name}" for name in ("exp", "log", "sqrt", "rsqrt", "tanh", "erf")}
