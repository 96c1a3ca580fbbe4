"""IR types: ranked tensors and scalars, with MLIR's textual spelling.

`tensor<1x512x576xf32>` is a `TensorType((1, 512, 576), "f32")`; a `?` dimension (used by raw-kernel
annotations before specialisation) is stored as `DYNAMIC`. Types are interned value objects, so the
parser can cache them by their text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import ml_dtypes
import numpy as np

from topq.ir.errors import TopqError

#: element type name → numpy dtype used to hold values of it (sub-byte ints are held unpacked).
ELEMENT_TYPES: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f16": np.dtype(np.float16),
    "i64": np.dtype(np.int64),
    "i32": np.dtype(np.int32),
    "i16": np.dtype(np.int16),
    "i8": np.dtype(np.int8),
    "ui8": np.dtype(np.uint8),
    "i4": np.dtype(ml_dtypes.int4),
    "ui4": np.dtype(ml_dtypes.uint4),
    "i1": np.dtype(np.bool_),
}
SCALAR_TYPES = frozenset(ELEMENT_TYPES) | {"index"}
DYNAMIC = -1


class TypeParseError(TopqError):
    """A type string that is not a tensor or scalar type of the IR."""


@dataclass(frozen=True, slots=True)
class ScalarType:
    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str = "f32"

    def __str__(self) -> str:
        dims = "".join(("?" if d == DYNAMIC else str(d)) + "x" for d in self.shape)
        return f"tensor<{dims}{self.dtype}>"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def is_static(self) -> bool:
        return DYNAMIC not in self.shape

    @property
    def np_dtype(self) -> np.dtype:
        return ELEMENT_TYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Storage size; 4-bit types take half a byte each (packed), rounded up."""
        bits = 4 if self.dtype in ("i4", "ui4") else self.np_dtype.itemsize * 8
        return (self.numel * bits + 7) // 8

    def with_shape(self, shape: tuple[int, ...]) -> TensorType:
        return TensorType(tuple(shape), self.dtype)

    def with_dtype(self, dtype: str) -> TensorType:
        return TensorType(self.shape, dtype)


Type = TensorType | ScalarType

_TENSOR_RE = re.compile(r"tensor<((?:(?:\d+|\?)x)*)([a-z][a-z0-9]*)>")


@lru_cache(maxsize=4096)
def parse_type(text: str) -> Type:
    """Parse `tensor<2x?x4xf32>`, `tensor<f32>` (rank 0) or a scalar such as `f32` / `index`."""
    text = text.strip()
    if text in SCALAR_TYPES:
        return ScalarType(text)
    match = _TENSOR_RE.fullmatch(text)
    if not match:
        raise TypeParseError(f"not a type: {text!r} (expected e.g. tensor<1x64xf32> or f32)")
    dims, elem = match.groups()
    if elem not in ELEMENT_TYPES:
        known = ", ".join(sorted(ELEMENT_TYPES))
        raise TypeParseError(f"unknown element type {elem!r} in {text!r}; known: {known}")
    shape = tuple(DYNAMIC if d == "?" else int(d) for d in dims.split("x")[:-1])
    return TensorType(shape, elem)


def tensor(*shape: int, dtype: str = "f32") -> TensorType:
    """Shorthand for graph code: `tensor(1, L, H)`."""
    return TensorType(tuple(int(d) for d in shape), dtype)


def dtype_name(array_dtype: np.dtype) -> str:
    """The IR element type name of a numpy dtype."""
    for name, dt in ELEMENT_TYPES.items():
        if dt == array_dtype:
            return name
    raise TopqError(f"no IR element type for numpy dtype {array_dtype}")


def round_to_dtype(array: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as they are after storing in `dtype` (bf16/f16) and reading back."""
    if dtype == "f32":
        return np.asarray(array, dtype=np.float32)
    if dtype not in ("bf16", "f16"):
        raise TopqError(f"not a float dtype: {dtype}")
    return np.asarray(array, dtype=np.float32).astype(ELEMENT_TYPES[dtype]).astype(np.float32)
