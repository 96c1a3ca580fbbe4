"""Read and write safetensors files with numpy alone (bf16 via ml_dtypes), checking integrity on open.

Layout: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}, then the data section with no holes. The writer streams tensors to a temp file and renames it
into place, so a failed or interrupted write never leaves a half-written file at the destination.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from topq.core.errors import TopqError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"), "U16": np.dtype("<u2"), "U32": np.dtype("<u4"),
}
_CODES = {dt: code for code, dt in DTYPES.items()}
_MAX_HEADER = 512 * 1024 * 1024
DATA_ALIGN = 4096  # the header is padded so the data section starts page-aligned (clean memory maps)


@dataclass(frozen=True)
class TensorInfo:
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset
    end: int


class SafetensorsFile:
    """A memory-mapped, integrity-checked safetensors file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise TopqError(f"{self.path}: not a safetensors file (too short)")
                (header_len,) = struct.unpack("<Q", head)
                if header_len > min(size - 8, _MAX_HEADER):
                    raise TopqError(f"{self.path}: damaged or truncated safetensors file (header length {header_len})")
                header_bytes = fh.read(header_len)
        except OSError as exc:
            raise TopqError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        try:
            header = json.loads(header_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise TopqError(f"{self.path}: damaged safetensors header (not JSON)") from None
        if not isinstance(header, dict):
            raise TopqError(f"{self.path}: damaged safetensors header")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        base = 8 + header_len
        self.tensors: dict[str, TensorInfo] = {}
        data_end = 0
        for name, entry in header.items():
            try:
                dtype = DTYPES[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                start, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise TopqError(f"{self.path}: damaged header entry for tensor {name!r}") from None
            if end - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or start < 0 or end < start:
                raise TopqError(f"{self.path}: tensor {name} has a byte range that does not match its shape")
            self.tensors[name] = TensorInfo(dtype, shape, base + start, base + end)
            data_end = max(data_end, end)
        if base + data_end != size:
            raise TopqError(f"{self.path}: truncated or damaged: {size} bytes, header says {base + data_end}")
        self._map: np.memmap | None = None
        self.size = size

    def _memmap(self) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if self.size else np.zeros(0, np.uint8)
        return self._map

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> np.ndarray:
        """A read-only view of the stored tensor (no copy)."""
        info = self.tensors[name]
        raw = self._memmap()[info.start:info.end]
        return raw.view(info.dtype).reshape(info.shape)


def _dtype_code(array: np.ndarray) -> str:
    try:
        return _CODES[array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype]
    except KeyError:
        raise TopqError(f"cannot store dtype {array.dtype} in safetensors") from None


def write_safetensors(path: str | Path, tensors: Iterable[tuple[str, np.ndarray]] | dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write atomically: temp file in the destination directory, fsync, rename."""
    items = list(tensors.items()) if isinstance(tensors, dict) else list(tensors)
    header: dict[str, object] = {}
    offset = 0
    for name, array in items:
        if name in header:
            raise TopqError(f"tensor {name} is written twice")
        header[name] = {"dtype": _dtype_code(array), "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((-(8 + len(text))) % DATA_ALIGN)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(struct.pack("<Q", len(text)))
            fh.write(text)
            for _, array in items:
                fh.write(np.ascontiguousarray(array).tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
