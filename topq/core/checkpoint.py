"""Format-independent checkpoint contract: what every checkpoint reader hands to the core.

A reader turns a path into a `Checkpoint`: a Hugging Face-style config dict, a lazy
`WeightStore` keyed by Hugging Face tensor names, and the tokenizer as the texts of a saved
Hugging Face fast tokenizer (so it can travel inside a bundle without pickle; `topq.io.tokenizer`).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from topq.core.quant import QuantizedWeight

if TYPE_CHECKING:
    from topq.core.quant import QuantizedWeight

__all__ = [
    "WEIGHT_STORE_METHODS",
    "BaseWeightStore",
    "Checkpoint",
    "CheckpointFormat",
    "QuantizedWeightStore",
    "WeightStore",
]


@runtime_checkable
class WeightStore(Protocol):
    """Lazy, read-only access to a checkpoint's tensors by Hugging Face name.

    Readers derive their stores from `BaseWeightStore`, which gives the last three methods their defaults."""

    def names(self) -> list[str]:
        """All tensor names, in file order."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical shape in Hugging Face layout ([out, in] for linears)."""
        ...

    def dtype(self, name: str) -> str:
        """numpy/ml_dtypes name of the stored type ("bfloat16"), or a GGUF quant type ("Q4_1")."""
        ...

    def __contains__(self, name: object) -> bool: ...

    def get(self, name: str) -> np.ndarray:
        """The tensor as a fresh float32 array; a missing name raises TopqError."""
        ...

    def get_raw(self, name: str) -> np.ndarray:
        """The stored array without conversion (read-only; GGUF quant blocks as uint8 rows)."""
        ...

    def read_raw(self, name: str) -> np.ndarray | None:
        """The stored array as a private copy read without a memory map, when the store can do that cheaply
        (float tensors then stream at their stored size); None: the caller converts `get(name)` instead."""
        ...

    def quantized(self, name: str) -> QuantizedWeight | None:
        """The integer form the checkpoint stores for a linear (pre-quantized checkpoints, GGUF Q4_0 / Q8_0);
        None for a tensor without one. The `auto` scheme keeps it."""
        ...

    def dequantized_bits(self, name: str) -> int | None:
        """The bits per weight of a tensor the checkpoint stores quantized in a form `quantized` cannot give as
        exact integers (GGUF Q4_1: 4, Q6_K: 6; `get` gives its dequantization); None for float tensors and for
        those `quantized` gives. The `auto` scheme requantizes such linears."""
        ...

    def fingerprint(self, name: str) -> str:
        """A string that changes whenever the tensor's stored bytes change (build-cache keys)."""
        ...


#: the methods `WeightStore` declares (named in the error for a store that lacks some)
WEIGHT_STORE_METHODS: tuple[str, ...] = (
    "names", "shape", "dtype", "__contains__", "get", "get_raw", "read_raw", "quantized", "dequantized_bits",
    "fingerprint")


class BaseWeightStore(ABC):
    """What a reader implements for a `WeightStore`; the optional parts default to "not available"."""

    @abstractmethod
    def names(self) -> list[str]: ...

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]: ...

    @abstractmethod
    def dtype(self, name: str) -> str: ...

    @abstractmethod
    def __contains__(self, name: object) -> bool: ...

    @abstractmethod
    def get(self, name: str) -> np.ndarray: ...

    @abstractmethod
    def get_raw(self, name: str) -> np.ndarray: ...

    def read_raw(self, name: str) -> np.ndarray | None:
        return None  # no cheap private read: callers convert `get(name)`

    def quantized(self, name: str) -> QuantizedWeight | None:
        return None  # a float checkpoint

    def dequantized_bits(self, name: str) -> int | None:
        return None  # every quantized tensor (if any) has its exact integer form

    def fingerprint(self, name: str) -> str:
        # Hashing the bytes is always right; stores that know their files do it without reading them.
        return hashlib.sha256(self.get_raw(name).tobytes()).hexdigest()


@runtime_checkable
class QuantizedWeightStore(WeightStore, Protocol):
    """A WeightStore of an already-quantized checkpoint (GPTQ / AWQ / AutoRound / compressed-tensors, GGUF)."""

    def quantized(self, name: str) -> QuantizedWeight | None:
        """The checkpoint's own integers for a linear weight, unrequantized; None for a weight stored as float."""
        ...


@dataclass
class Checkpoint:
    """An opened checkpoint: config, weights and tokenizer texts."""

    path: Path
    format: str
    config: dict[str, Any]
    weights: WeightStore
    tokenizer_files: dict[str, str] = field(default_factory=dict)


@dataclass
class CheckpointFormat:
    """A registered reader (see the `register_checkpoint_formats` hook)."""

    name: str
    detect: Callable[[Path], bool]
    open: Callable[[Path], Checkpoint]
