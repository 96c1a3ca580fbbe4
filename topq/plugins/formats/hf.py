"""Hugging Face checkpoint directories: config.json, safetensors weights, fast tokenizer.

Safetensors is read here with numpy rather than the `safetensors` package so that bf16
works without torch (via ml_dtypes) and so that every file is checked on open: a truncated
or damaged download must fail with the file's name, not later with a confusing shape error.
"""

from __future__ import annotations

import topq

import json
import math
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from topq.core.checkpoint import (
    Checkpoint,
    CheckpointFormat,
    normalize_rope,
    tokenizer_files_of,
)
from topq.core.errors import TopqError

__all__ = ["FORMAT", "SafetensorsFile", "SafetensorsStore", "detect", "open_checkpoint"]

# Safetensors dtype tag -> numpy dtype (little-endian, as the format prescribes).
_DTYPES: dict[str, np.dtype] = {
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
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class SafetensorsFile:
    """One validated .safetensors file, memory-mapped read-only."""

    def __init__(self, path: Path) -> None:
        self.path = path
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
        if tag not in _DTYPES:
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
        return _DTYPES[tag], tuple(shape), offsets[0], offsets[1]

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


class SafetensorsStore:
    """A WeightStore over one or more safetensors files (a sharded checkpoint)."""

    def __init__(self, files: list[SafetensorsFile], where: Path) -> None:
        self.where = where  # named in errors: the single file or the shard index
        self.files = files
        self._owner: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.names():
                if name in self._owner:
                    raise TopqError(f"{where}: tensor {name!r} is in both {self._owner[name].path.name} and {f.path.name}")
                self._owner[name] = f

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._owner[name]
        except KeyError:
            raise TopqError(f"tensor {name!r} not found in {self.where}") from None

    def names(self) -> list[str]:
        return list(self._owner)

    def __contains__(self, name: object) -> bool:
        return name in self._owner

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(name)

    def dtype(self, name: str) -> str:
        return self._file(name).dtype(name)

    def get_raw(self, name: str) -> np.ndarray:
        return self._file(name).get_raw(name)

    def get(self, name: str) -> np.ndarray:
        return np.array(self.get_raw(name), dtype=np.float32)  # np.array copies: off the mmap


def detect(path: Path) -> bool:
    """A directory with a config.json or any .safetensors file."""
    path = Path(path)
    return path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.safetensors")))


def _open_weights(d: Path) -> SafetensorsStore:
    single, index = d / "model.safetensors", d / "model.safetensors.index.json"
    if single.is_file():
        return SafetensorsStore([SafetensorsFile(single)], single)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise TopqError(f"{index}: bad shard index ({exc})") from exc
        shards: dict[str, SafetensorsFile] = {}
        for shard in dict.fromkeys(weight_map.values()):
            shard_path = d / str(shard)
            if Path(str(shard)).name != shard or not shard_path.is_file():
                raise TopqError(f"{index}: shard {shard!r} is missing")
            shards[shard] = SafetensorsFile(shard_path)
        for name, shard in weight_map.items():
            if name not in shards[shard]:
                raise TopqError(f"{index}: tensor {name!r} is not in its shard {shard}")
        return SafetensorsStore(list(shards.values()), index)
    others = sorted(d.glob("*.safetensors"))
    if others:
        return SafetensorsStore([SafetensorsFile(p) for p in others], d)
    hint = " (pickle .bin checkpoints are not supported)" if any(d.glob("*.bin")) else ""
    raise TopqError(f"hf checkpoint: no model.safetensors in {d}{hint}")


def _read_config(d: Path) -> dict[str, Any]:
    if not (d / "config.json").is_file():
        raise TopqError(f"hf checkpoint: no config.json in {d}")
    from transformers import AutoConfig  # heavy import, only when a checkpoint is opened

    try:
        config = AutoConfig.from_pretrained(d, local_files_only=True).to_dict()
    except Exception as exc:  # noqa: BLE001 - unknown model_type etc.: fall back to the raw JSON
        try:
            config = json.loads((d / "config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            raise TopqError(f"{d / 'config.json'}: cannot read config ({exc})") from exc
        if not isinstance(config, dict):
            raise TopqError(f"{d / 'config.json'}: not a JSON object") from exc
    config.pop("_name_or_path", None)  # a local path, meaningless once bundled
    config.pop("transformers_version", None)
    if config.get("head_dim") is None and config.get("hidden_size") and config.get("num_attention_heads"):
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return normalize_rope(config)


def _read_tokenizer(d: Path) -> dict[str, str]:
    if not any((d / name).is_file() for name in _TOKENIZER_MARKERS):
        return {}
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(d)
    except Exception as exc:  # transformers raises many kinds; one line for the user
        raise TopqError(f"{d}: cannot load the tokenizer ({exc})") from exc
    return tokenizer_files_of(tokenizer)


def open_checkpoint(path: Path) -> Checkpoint:
    """Open a Hugging Face checkpoint directory."""
    d = Path(path)
    if not d.is_dir():
        raise TopqError(f"hf checkpoint: {d} is not a directory")
    config = _read_config(d)
    weights = _open_weights(d)
    return Checkpoint(path=d, format="hf", config=config, weights=weights, tokenizer_files=_read_tokenizer(d))


FORMAT = CheckpointFormat("hf", detect, open_checkpoint)


@topq.hookimpl
def register_checkpoint_formats(register) -> None:  # type: ignore[no-untyped-def]
    register(FORMAT)
