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
import math
from typing import Any
from pathlib import Path

import ml_dtypes
import numpy as np

from topq.core.errors import TopqError

# Safetensors dtype tag -> numpy dtype (little-endian, as the format prescribes).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit; guards against garbage lengths
DATA_ALIGN = 4096  # the header is padded so the data section starts page-aligned (clean memory maps)


class SafetensorsFile:
    """One validated .safetensors file, memory-mapped read-only."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metadata: dict[str, str] = {}
        # name -> (dtype, shape, absolute byte offset); insertion order is file order.
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        self._mm: np.memmap | None = None
        self._validate()

    def _bad(self, why: str) -> TopqError:
        return TopqError(f"{self.path}: damaged safetensors file ({why})")

    def _validate(self) -> None:
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise self._bad("shorter than its 8-byte header length")
                (hlen,) = struct.unpack("<Q", head)
                if hlen > _MAX_HEADER or 8 + hlen > size:
                    raise self._bad(f"header length {hlen} does not fit in {size} bytes")
                raw = fh.read(hlen)
        except OSError as exc:
            raise TopqError(f"{self.path}: cannot read ({exc.strerror or exc})") from exc
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._bad(f"header is not valid JSON: {exc}") from exc
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise self._bad("__metadata__ is not an object")
        self.metadata = {str(k): str(v) for k, v in meta.items()}

        data_start = 8 + hlen
        data_len = size - data_start
        ranges: list[tuple[int, int, str]] = []
        for name, info in header.items():
            dtype, shape, begin, end = self._parse_entry(name, info)
            nbytes = math.prod(shape) * dtype.itemsize
            if end - begin != nbytes:
                raise self._bad(f"tensor {name!r}: {end - begin} bytes for {shape} x {dtype.name}")
            if end > data_len:
                raise self._bad(f"tensor {name!r} ends at byte {end} but the data has {data_len} (truncated?)")
            ranges.append((begin, end, name))
            self._entries[name] = (dtype, shape, data_start + begin)
        # The format requires the tensors to tile the data buffer exactly: no overlaps, no holes.
        pos = 0
        for begin, end, name in sorted(ranges):
            if begin != pos:
                raise self._bad(f"tensor {name!r} starts at {begin}, expected {pos} (overlap or hole)")
            pos = end
        if pos != data_len:
            raise self._bad(f"file is {size} bytes, expected {data_start + pos}")

    def _parse_entry(self, name: str, info: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
        if not isinstance(info, dict):
            raise self._bad(f"tensor {name!r}: entry is not an object")
        tag, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if tag not in DTYPES:
            raise self._bad(f"tensor {name!r}: unsupported dtype {tag!r}")
        ok_shape = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        ok_offsets = (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        )
        if not (ok_shape and ok_offsets):
            raise self._bad(f"tensor {name!r}: bad shape or data_offsets")
        return DTYPES[tag], tuple(shape), offsets[0], offsets[1]

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> str:
        return self._entries[name][0].name

    def get_raw(self, name: str) -> np.ndarray:
        dtype, shape, offset = self._entries[name]
        if math.prod(shape) == 0:
            return np.zeros(shape, dtype)
        if self._mm is None:  # mapped on first read: opening many shards stays cheap
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return np.ndarray(shape, dtype=dtype, buffer=self._mm, offset=offset)



def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_CODES = {dt: code for code, dt in DTYPES.items()}


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
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
