"""Hugging Face checkpoint directories: config.json, safetensors weights, fast tokenizer.

Safetensors is read here with numpy rather than the `safetensors` package so that bf16
works without torch (via ml_dtypes) and so that every file is checked on open: a truncated
or damaged download must fail with the file's name, not later with a confusing shape error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

import topq
from topq.core.checkpoint import (
    BaseWeightStore,
    Checkpoint,
    CheckpointFormat,
    WeightStore,
)
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.io.safetensors import SafetensorsFile
from topq.io.tokenizer import tokenizer_files_of
from topq.models.decoder import normalize_rope
from topq.plugins.formats.quantized import QuantizedStore, read_quantization_config

__all__ = ["FORMAT", "SafetensorsStore", "detect", "open_checkpoint"]

_FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class SafetensorsStore(BaseWeightStore):
    """A WeightStore over one or more safetensors files (a sharded checkpoint)."""

    def __init__(self, files: list[SafetensorsFile], where: Path) -> None:
        self.where = where  # named in errors: the single file or the shard index
        self.files = files
        self._owner: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.names():
                if name in self._owner:
                    raise TopqError(f"{where}: tensor {name!r} is in both {self._owner[name].path.name} "
                                    f"and {f.path.name}")
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
        """The tensor as float32 values; inf or nan is refused: a damaged file, or a dtype tag swapped for another
        of the same width (integer-tagged model weights are refused on open: `_refuse_integer_weights`)."""
        f = self._file(name)
        # Plain reads, not the memory map: a streaming conversion must not keep every page it touched resident.
        values = f.read(name).astype(np.float32, copy=False)
        if not np.isfinite(values).all():
            raise TopqError(f"{f.path}: tensor {name!r} holds inf or nan values (a damaged file, or its dtype tag "
                            f"was changed: it says {f.dtype(name)})")
        return values

    def read_raw(self, name: str) -> np.ndarray:
        """The stored array as a private copy (plain reads, no resident memory map)."""
        return self._file(name).read(name)

    def fingerprint(self, name: str) -> str:
        """Identity of the stored bytes without reading them (file, size, mtime, offset) for build caching."""
        f = self._file(name)
        stat = f.path.stat()
        piece = f.slice_of(name)
        return f"{f.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{piece.offset}:{piece.length}"


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


def _refuse_custom_code(d: Path) -> None:
    """A config naming its own model or tokenizer classes (`auto_map`) makes transformers offer to run the
    checkpoint's Python code (asking on stdout, answered from stdin). topq never runs code from a checkpoint."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            doc = json.loads((d / name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue  # missing or unreadable: the readers below report it
        if isinstance(doc, dict) and "auto_map" in doc:
            raise TopqError(f"{d / name}: the checkpoint ships its own code (auto_map); topq never runs code "
                            "from a checkpoint")


def _read_config(d: Path) -> dict[str, Any]:
    if not (d / "config.json").is_file():
        raise TopqError(f"hf checkpoint: no config.json in {d}")
    from transformers import AutoConfig  # heavy import, only when a checkpoint is opened

    try:
        config = AutoConfig.from_pretrained(d, local_files_only=True, trust_remote_code=False).to_dict()
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
        tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many kinds; one line for the user
        raise TopqError(f"{d}: cannot load the tokenizer ({exc})") from exc
    return tokenizer_files_of(tokenizer)


def _refuse_integer_weights(weights: WeightStore, where: Path) -> None:
    """Model parameters (`*.weight`, `*.bias`) are floating point; packed linears are behind QuantizedStore and
    their integer parts have other names. An integer tag means a damaged header or one swapped for a tag of the
    same width (F32 bits read as I32). Checked from the headers on open, so a conversion stops before any work."""
    packed = set(weights.quantized_names()) if isinstance(weights, QuantizedStore) else set()
    for name in weights.names():
        if (name.endswith((".weight", ".bias")) and name not in packed
                and weights.dtype(name) not in _FLOAT_DTYPES):
            raise TopqError(f"{where}: tensor {name!r} is stored as {weights.dtype(name)}, not a floating-point "
                            "type (a damaged safetensors header, or its dtype tag was changed)")


def open_checkpoint(path: Path) -> Checkpoint:
    """Open a Hugging Face checkpoint directory."""
    d = Path(path)
    if not d.is_dir():
        raise TopqError(f"hf checkpoint: {d} is not a directory")
    _refuse_custom_code(d)
    config = _read_config(d)
    weights: WeightStore = _open_weights(d)
    quantization_config = read_quantization_config(d, config)
    if quantization_config is not None:
        # Pre-quantized (GPTQ / AWQ / AutoRound / compressed-tensors): show packed linears as float weights
        # and keep the integer form reachable through `weights.quantized(name)`.
        config["quantization_config"] = quantization_config
        weights = QuantizedStore.wrap(weights, quantization_config, where=d)
    elif any(n.endswith((".qweight", ".weight_packed")) for n in weights.names()):
        raise TopqError(f"{d}: packed quantized tensors but no quantization_config in config.json")
    _refuse_integer_weights(weights, d)
    return Checkpoint(path=d, format="hf", config=config, weights=weights, tokenizer_files=_read_tokenizer(d))


FORMAT = CheckpointFormat("hf", detect, open_checkpoint)


@topq.hookimpl
def register_checkpoint_formats(register: Register[CheckpointFormat]) -> None:
    register(FORMAT)
