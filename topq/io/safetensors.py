"""Read and write safetensors files with numpy alone (bf16 via ml_dtypes), checking integrity on open.

Layout: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}, then the data section with no holes. The writer streams tensors to a temp file and renames it
into place, so a failed or interrupted write never leaves a half-written file at the destination.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import math
import os
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from topq.io.files import raise_if_interrupted, umask
from topq.ir.errors import TopqError

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
        # Untrusted JSON: Any until the checks below have seen each value's type.
        tag: Any = info.get("dtype")
        shape: Any = info.get("shape")
        offsets: Any = info.get("data_offsets")
        if not isinstance(tag, str) or tag not in DTYPES:
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

    def read(self, name: str) -> np.ndarray:
        """A private copy read with plain file I/O: no memory map stays resident (streaming conversion)."""
        dtype, shape, offset = self._entries[name]
        count = math.prod(shape)
        with open(self.path, "rb") as fh:
            fh.seek(offset)
            array = np.fromfile(fh, dtype=dtype, count=count)
        if array.size != count:
            raise TopqError(f"{self.path}: file ended while reading tensor {name}")
        return array.reshape(shape)

    def slice_of(self, name: str) -> FileSlice:
        dtype, shape, offset = self._entries[name]
        return FileSlice(self.path, offset, math.prod(shape) * dtype.itemsize)

    def get_raw(self, name: str) -> np.ndarray:
        dtype, shape, offset = self._entries[name]
        if math.prod(shape) == 0:
            return np.zeros(shape, dtype)
        if self._mm is None:  # mapped on first read: opening many shards stays cheap
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return np.ndarray(shape, dtype=dtype, buffer=self._mm, offset=offset)



_CODES = {dt: code for code, dt in DTYPES.items()}


def _code_of(dtype: np.dtype) -> str:
    try:
        return _CODES[dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype]
    except KeyError:
        raise TopqError(f"cannot store dtype {dtype} in safetensors") from None


def _remove_stale_temp_files(path: Path) -> None:
    """Temp files of earlier writes of `path` whose writer process is gone (killed before it could clean up).
    Their names carry the writer's pid; a live writer's file (e.g. a concurrent conversion) is left alone."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*-*.tmp"):
        pid_text = tmp.name[len(path.name) + 2:].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (PermissionError, OverflowError):
            pass  # another user's live process, or no such pid at all on this system: leave it


@dataclass(frozen=True)
class FileSlice:
    """Bytes of another file, copied in chunks (a cached tensor goes into a bundle without being loaded)."""

    path: Path
    offset: int
    length: int
    sha256: str | None = None  # known digest of these bytes: copied without hashing again


TensorData = np.ndarray | FileSlice
_CHUNK = 64 * 1024 * 1024


class SafetensorsWriter:
    """Stream tensors of a known manifest into `path`, atomically.

    The header (names, dtypes, shapes, offsets) is written first from the manifest; tensors follow one at a time
    (each sha256 is returned); `finish(metadata)` rewrites the header in place with the final metadata, which must
    serialise to no more bytes than the first (fixed-width fields such as checksums keep it so), then renames the
    temp file into place. An exception before `finish` removes the temp file: no half-written output.
    """

    def __init__(self, path: str | Path, manifest: list[tuple[str, np.dtype, tuple[int, ...]]],
                 metadata: dict[str, str]) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self._entries: dict[str, object] = {}
        offset = 0
        for name, dtype, shape in manifest:
            if name in self._entries:
                raise TopqError(f"tensor {name} is written twice")
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            self._entries[name] = {"dtype": _code_of(np.dtype(dtype)), "shape": list(shape),
                                   "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        first = self._header(metadata)
        self._header_len = len(first) + ((-(8 + len(first))) % DATA_ALIGN)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temp_files(self.path)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.{os.getpid()}-", suffix=".tmp", dir=self.path.parent)
        self.tmp = Path(tmp)
        self._fh = os.fdopen(fd, "wb")
        self._next = 0
        try:
            self._write_header(metadata)
        except BaseException:
            self.abort()
            raise

    def _header(self, metadata: dict[str, str]) -> bytes:
        header = dict(self._entries)
        if metadata:
            header["__metadata__"] = metadata
        return json.dumps(header, separators=(",", ":")).encode("utf-8")

    def _write_header(self, metadata: dict[str, str]) -> None:
        text = self._header(metadata)
        if len(text) > self._header_len:
            raise TopqError(f"{self.path}: final metadata is larger than the space reserved for it")
        self._fh.seek(0)
        self._fh.write(struct.pack("<Q", self._header_len))
        self._fh.write(text + b" " * (self._header_len - len(text)))

    def write(self, name: str, data: TensorData) -> str:
        """Append the next tensor of the manifest; return its sha256."""
        if self._next >= len(self.manifest) or self.manifest[self._next][0] != name:
            expected = self.manifest[self._next][0] if self._next < len(self.manifest) else "nothing"
            raise TopqError(f"{self.path}: got tensor {name}, expected {expected}")
        _, dtype, shape = self.manifest[self._next]
        self._next += 1
        digest = hashlib.sha256()
        if isinstance(data, FileSlice):
            if data.length != self._entries[name]["data_offsets"][1] - self._entries[name]["data_offsets"][0]:  # type: ignore[index]
                raise TopqError(f"{self.path}: tensor {name} has the wrong size")
            if data.sha256 is not None and hasattr(os, "copy_file_range") and self._copy_in_kernel(data, name):
                return data.sha256  # digest known: the bytes need not pass through Python
            with open(data.path, "rb") as src:
                src.seek(data.offset)
                left = data.length
                while left:
                    chunk = src.read(min(_CHUNK, left))
                    if not chunk:
                        raise TopqError(f"{data.path}: ended early while copying {name}")
                    if data.sha256 is None:
                        digest.update(chunk)
                    self._fh.write(chunk)
                    left -= len(chunk)
            if data.sha256 is not None:
                return data.sha256
        else:
            if data.dtype != np.dtype(dtype) or tuple(data.shape) != tuple(shape):
                raise TopqError(f"{self.path}: tensor {name} is {data.dtype}{list(data.shape)}, the manifest says "
                                f"{np.dtype(dtype)}{list(shape)}")
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            digest.update(raw.data)
            self._fh.write(raw.data)
        return digest.hexdigest()

    def _copy_in_kernel(self, data: FileSlice, name: str) -> bool:
        """Copy without reading the bytes into Python; False (nothing written) where the kernel cannot, e.g. from
        the build cache into an output on another file system (EXDEV): the caller copies through user space."""
        self._fh.flush()
        start = self._fh.tell()
        with open(data.path, "rb") as src:
            offset, left = data.offset, data.length
            while left:
                try:
                    done = os.copy_file_range(src.fileno(), self._fh.fileno(), left, offset)
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    self._fh.seek(start)
                    self._fh.truncate()
                    return False
                if done <= 0:
                    raise TopqError(f"{data.path}: ended early while copying {name}")
                offset += done
                left -= done
        self._fh.seek(0, os.SEEK_END)
        return True

    def finish(self, metadata: dict[str, str]) -> None:
        try:
            if self._next != len(self.manifest):
                raise TopqError(f"{self.path}: only {self._next} of {len(self.manifest)} tensors were written")
            self._write_header(metadata)
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            os.chmod(self.tmp, 0o666 & ~umask())  # mkstemp makes 0600; give the file the usual permissions
            raise_if_interrupted()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is not None:
            self.abort()


def write_safetensors(path: str | Path, tensors: Iterable[tuple[str, np.ndarray]] | dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write a whole safetensors file atomically (small files, test fixtures)."""
    items = list(tensors.items()) if isinstance(tensors, dict) else list(tensors)
    manifest = [(name, array.dtype, tuple(array.shape)) for name, array in items]
    with SafetensorsWriter(path, manifest, metadata or {}) as writer:
        for name, array in items:
            writer.write(name, array)
        writer.finish(metadata or {})
