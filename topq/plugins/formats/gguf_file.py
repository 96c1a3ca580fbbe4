"""GGUF files (llama.cpp): metadata -> HF-style config, tensors -> HF names and layout.

Which `general.architecture` values are read, and how, is declared by the model families
(`ModelFamily.formats["gguf"]`, a `topq.models.gguf.GGUFArchitecture`): the Hugging Face
architecture, extra metadata keys, tensor names and the inverse of each transform llama.cpp's
converter applied. GGUF stores dims in ggml order (innermost first); numpy views of the data
already come out as [out, in], which is the Hugging Face layout. llama.cpp's converter permutes
the rows of q_proj/k_proj for arch `llama` (rotary pairs interleaved); we undo that exactly as
transformers' GGUF loader does, so weights equal the original HF ones. The row permutation and
the expert slices of stacked MoE tensors apply to raw quantized rows too: a block never spans
two rows, so both are lossless.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

import topq
from topq.core.checkpoint import BaseWeightStore, Checkpoint, CheckpointFormat
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.core.plugins import get_plugins
from topq.core.quant import QuantizedWeight
from topq.io.schema import show
from topq.io.tokenizer import tokenizer_files_of
from topq.models.decoder import normalize_rope
from topq.models.gguf import GGUFArchitecture, gguf_architecture, gguf_architecture_names
from topq.plugins.formats.quantized import GGUF_DEQUANTIZED_BITS, GGUF_EXACT_TYPES, unpack_gguf

__all__ = ["FORMAT", "GGUFStore", "detect", "gguf_to_hf_name", "open_checkpoint", "reverse_permute"]

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")
_PLAIN_NP = {"F32": "float32", "F16": "float16", "F64": "float64",
             "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64"}


def _stem(name: str) -> tuple[str, str | None, str]:
    """(declared name, layer or None, suffix) of a GGUF tensor name: `blk.3.attn_q.bias` → (`blk.{i}.attn_q`,
    "3", "bias"); a name of neither form is its own stem, with no suffix."""
    if m := _BLOCK_RE.fullmatch(name):
        return f"blk.{{i}}.{m.group(2)}", m.group(1), m.group(3)
    if m := _GLOBAL_RE.fullmatch(name):
        return m.group(1), None, m.group(2)
    return name, None, ""


def _architecture(name: Any, path: Path | None = None) -> GGUFArchitecture:
    families = get_plugins().families
    arch = gguf_architecture(families, name) if isinstance(name, str) else None
    if arch is None:
        where = f"{path}: " if path else ""
        raise TopqError(f"{where}unsupported GGUF architecture {name!r}; supported: "
                        f"{', '.join(gguf_architecture_names(families))}")
    return arch


def gguf_to_hf_name(name: str, arch: GGUFArchitecture | str = "llama") -> str:
    """HF name of a GGUF tensor of architecture `arch` (`{e}` left in for a stacked expert tensor); names the
    architecture does not declare are kept as they are."""
    declared = _architecture(arch) if isinstance(arch, str) else arch
    stem, layer, suffix = _stem(name)
    spec = declared.tensor(stem)
    return name if spec is None else f"{spec.hf.format(i=layer, e='{e}')}.{suffix}"


def reverse_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` on dim 0 (transformers'
    `LlamaTensorProcessor._reverse_permute_weights`); `n_head` is the head count of this
    projection (kv heads for k_proj). Works on weights, biases and raw quant-block rows."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


class _Entry(NamedTuple):
    tensor: Any  # gguf.ReaderTensor
    shape: tuple[int, ...]  # HF layout
    heads: int  # > 0: rows to un-permute with this many heads
    expert: int | None = None  # this expert's slice of a tensor with the experts stacked on axis 0
    offset: float = 0.0  # added to the stored values (Gemma's 1 + w norms)


def _f32_literal(value: float) -> float:
    """GGUF keeps hyper-parameters as float32; give back the short decimal they came from (1e-05)."""
    return float(str(np.float32(value)))


class GGUFStore(BaseWeightStore):
    """WeightStore over a GGUF file; tensors are dequantized lazily, one at a time."""

    def __init__(self, path: Path, reader: Any, entries: dict[str, _Entry]) -> None:
        self.path, self._reader, self._entries = path, reader, entries

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise TopqError(f"tensor {name!r} not found in {self.path}") from None

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        entry = self._entry(name)
        if entry.offset:
            return "float32"  # a transformed value is computed in float32
        qtype = entry.tensor.tensor_type.name
        return "bfloat16" if qtype == "BF16" else _PLAIN_NP.get(qtype, qtype)

    def gguf_name(self, name: str) -> str:
        return self._entry(name).tensor.name

    def get_raw(self, name: str) -> np.ndarray:
        """Stored values (read-only view when possible); quantized types as uint8 block rows."""
        entry = self._entry(name)
        if entry.offset:
            return self.get(name)
        data = _stored(entry)
        if entry.tensor.tensor_type.name == "BF16":
            data = data.view(ml_dtypes.bfloat16)  # the reader exposes bf16 as raw bytes
        if entry.heads:
            data = reverse_permute(data, entry.heads)
        return data

    def quantized(self, name: str) -> QuantizedWeight | None:
        """Q4_0 / Q8_0 tensors repacked losslessly (blocks of 32, HF row order); None for every other type.

        Other quantized GGML types (Q4_1, k-quants, ...) have no exact integer form here: `get` dequantizes them,
        `dequantized_bits` gives their width (the `auto` scheme requantizes such linears).
        """
        entry = self._entry(name)
        qtype = entry.tensor.tensor_type.name
        if qtype not in GGUF_EXACT_TYPES or entry.offset:
            return None
        return unpack_gguf(self.get_raw(name), qtype, entry.shape, what=f"{self.path}: {entry.tensor.name}")

    def dequantized_bits(self, name: str) -> int | None:
        """Bits per weight of a quantized tensor without an exact integer form (Q4_1: 4, Q6_K: 6); None otherwise
        (float types, Q4_0 / Q8_0, and a GGML type topq has no width for, which stays float)."""
        return GGUF_DEQUANTIZED_BITS.get(self._entry(name).tensor.tensor_type.name)

    def get(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        entry = self._entry(name)
        tensor, data = entry.tensor, _stored(entry)
        try:
            if tensor.tensor_type.name in _PLAIN_NP:
                values = np.array(data, dtype=np.float32)  # copy off the mmap
            else:
                values = dequantize(data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise TopqError(f"{self.path}: cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc
        values = values.reshape(entry.shape)
        if entry.heads:
            values = reverse_permute(values, entry.heads)
        if entry.offset:
            values = values + np.float32(entry.offset)
        return np.ascontiguousarray(values, dtype=np.float32)


def _stored(entry: _Entry) -> np.ndarray:
    """The entry's part of its GGUF tensor as stored: one expert of a stacked tensor; a [n] tensor read as [1, n]."""
    data = entry.tensor.data
    if entry.expert is not None:
        data = data[entry.expert]
    if data.ndim < len(entry.shape):
        data = data.reshape(1, *data.shape)
    return data


def _read(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf raises ValueError, IndexError, KeyError, OSError...: all mean "not usable"
        raise TopqError(f"{path}: not a valid GGUF file ({type(exc).__name__}: {exc})") from exc
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + int(t.n_bytes) > size or t.data.nbytes != int(t.n_bytes):
            raise TopqError(f"{path}: damaged GGUF file (tensor {t.name} runs past the end; truncated?)")
    return reader


def _metadata(reader: Any) -> dict[str, Any]:
    """Every metadata field's value (None for a malformed one, which reads as absent); the reader's fields are
    dropped. gguf keeps each element of an array field as a memmap view of its own: ~85 MiB for SmolLM2's 49k-token
    vocabulary and merges, alive as long as the reader (the whole conversion), against ~8 MiB as Python values."""
    values = {}
    for key, f in reader.fields.items():
        try:
            values[key] = f.contents()
        except Exception:  # noqa: BLE001 - a malformed value is treated as absent
            values[key] = None
    reader.fields.clear()
    return values


def _field(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key)
    return default if value is None else value


class _Metadata:
    """Typed reads of one architecture's GGUF keys: a value of the wrong type or range is one clear error (a
    crafted or damaged file must not reach the model code as a string size or a zero head count)."""

    def __init__(self, metadata: Mapping[str, Any], arch: str, path: Path) -> None:
        self.metadata, self.arch, self.path = metadata, arch, path

    def _bad(self, key: str, value: Any, want: str) -> TopqError:
        return TopqError(f"{self.path}: GGUF metadata {key} must be {want}, got {show(value)}")

    def raw(self, key: str, default: Any = None) -> Any:
        return _field(self.metadata, key, default)

    def count(self, suffix: str, default: Any = None, *, required: bool = False, minimum: int = 1) -> Any:
        """A positive integer `<arch>.<suffix>` (None when absent and not required)."""
        key = f"{self.arch}.{suffix}"
        value = self.raw(key, default)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._bad(key, value, "a positive integer" if minimum == 1 else f"an integer >= {minimum}")
        return value

    def number(self, suffix: str, default: float) -> float:
        """A finite, positive float `<arch>.<suffix>`, given back as the short decimal it was written as."""
        key = f"{self.arch}.{suffix}"
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self._bad(key, value, "a positive finite number")
        return _f32_literal(value)

    def value(self, suffix: str) -> int | float | None:
        """A non-negative finite number `<arch>.<suffix>` (an architecture's own key), None when absent."""
        key = f"{self.arch}.{suffix}"
        value = self.raw(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise self._bad(key, value, "a non-negative finite number")
        return value if isinstance(value, int) else _f32_literal(value)

    def token_id(self, name: str) -> int | None:
        key = f"tokenizer.ggml.{name}"
        value = self.raw(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise self._bad(key, value, "a token id (an integer >= 0)")
        return value


def _config(reader: Any, metadata: Mapping[str, Any], declared: GGUFArchitecture, tensor_names: set[str],
            path: Path) -> dict[str, Any]:
    arch = declared.name
    meta = _Metadata(metadata, arch, path)
    for suffix in ("embedding_length", "block_count", "attention.head_count"):
        if meta.raw(f"{arch}.{suffix}") is None:
            raise TopqError(f"{path}: GGUF metadata lacks {arch}.{suffix} (needs {arch}.embedding_length, "
                            f"block_count, attention.head_count)")
    hidden = meta.count("embedding_length", required=True)
    heads = meta.count("attention.head_count", required=True)
    kv_key = f"{arch}.attention.head_count_kv"
    kv_heads = meta.raw(kv_key, heads)
    if isinstance(kv_heads, list):  # per-layer counts in some files; uniform models repeat one value
        if not kv_heads or not all(type(v) is int and v >= 1 for v in kv_heads):
            raise meta._bad(kv_key, kv_heads, "a positive integer or a list of them")
        kv_heads = max(kv_heads)
    kv_heads = meta.count("attention.head_count_kv", kv_heads, required=True)
    rotary = meta.count("rope.dimension_count")
    head_dim = meta.count("attention.key_length") or (None if declared.rotary_dims else rotary) or hidden // heads
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if isinstance(tokens, list) else meta.count("vocab_size")
    scaling = None
    rope_type = meta.raw(f"{arch}.rope.scaling.type")
    if rope_type is not None and not isinstance(rope_type, str):
        raise meta._bad(f"{arch}.rope.scaling.type", rope_type, "a string")
    if rope_type not in (None, "none"):
        scaling = {"rope_type": rope_type, "factor": meta.number("rope.scaling.factor", 1.0)}
        if (orig := meta.count("rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = orig
    config: dict[str, Any] = {
        "architectures": [declared.architecture],
        "model_type": declared.model_type,
        "hidden_size": hidden,
        "intermediate_size": meta.count("feed_forward_length"),
        "num_hidden_layers": meta.count("block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.number("rope.freq_base", 10000.0),
        "rope_scaling": scaling,
        "max_position_embeddings": meta.count("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.token_id("bos_token_id"),
        "eos_token_id": meta.token_id("eos_token_id"),
    }
    if (pad := meta.token_id("padding_token_id")) is not None:
        config["pad_token_id"] = pad
    if declared.rotary_dims and rotary is not None and rotary != head_dim:
        config["partial_rotary_factor"] = rotary / head_dim
    for tensor in reader.tensors:
        if (hf_field := declared.config_tensors.get(_stem(tensor.name)[0])) is not None:
            values = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
            if tensor.tensor_type.name not in ("F32", "F16") or not np.isfinite(values).all():
                raise TopqError(f"{path}: {tensor.name} must hold finite F32 / F16 values")
            config[hf_field] = [float(np.float32(v)) for v in values]
    config.update(declared.defaults)
    for key, hf_field in declared.metadata.items():
        if (value := meta.value(key)) is not None:
            config[hf_field] = value
    for hf_field, suffix in declared.flags.items():
        config[hf_field] = any(n.endswith(suffix) for n in tensor_names)
    if declared.derive is not None:
        config.update(declared.derive(config))
    return normalize_rope(config)


def _entries(reader: Any, config: dict[str, Any], declared: GGUFArchitecture, path: Path) -> dict[str, _Entry]:
    heads = {"heads": config["num_attention_heads"], "kv_heads": config["num_key_value_heads"]}
    entries: dict[str, _Entry] = {}

    def add(hf: str, entry: _Entry) -> None:
        if hf in entries:
            raise TopqError(f"{path}: two tensors map to {hf}")
        entries[hf] = entry

    for t in reader.tensors:
        if t.tensor_type.name.startswith("I"):  # model weights are float or quantized; checked before any work
            raise TopqError(f"{path}: tensor {t.name} is stored as {t.tensor_type.name}, not a floating-point or "
                            "quantized type (a damaged file, or its type was changed)")
        stem, layer, suffix = _stem(t.name)
        if stem in declared.config_tensors:  # read into the config, not a weight
            continue
        if stem in declared.refused:
            raise TopqError(f"{path}: tensor {t.name}: {declared.refused[stem]}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        spec = declared.tensor(stem)
        if spec is None:
            if layer is not None:  # a block tensor the family does not read would be silently dropped
                raise TopqError(f"{path}: tensor {t.name} is not part of GGUF architecture {declared.name!r} as "
                                f"topq reads it ({declared.architecture})")
            add(t.name, _Entry(t, shape, 0))  # kept under its GGUF name (e.g. rope_freqs)
            continue
        n_heads = heads[spec.permute] if spec.permute else 0
        if n_heads and shape[0] % (2 * n_heads):
            raise TopqError(f"{path}: {t.name} has {shape[0]} rows, not a multiple of 2 x {n_heads} heads")
        if spec.row and len(shape) == 1:
            shape = (1, *shape)
        hf = f"{spec.hf.format(i=layer, e='{e}')}.{suffix}"
        if "{e}" not in spec.hf:
            add(hf, _Entry(t, shape, n_heads, offset=spec.offset))
            continue
        if len(shape) != 3:
            raise TopqError(f"{path}: {t.name} has shape {list(shape)}, not [experts, rows, columns]")
        for e in range(shape[0]):
            add(hf.format(e=e), _Entry(t, shape[1:], n_heads, e, spec.offset))
    return entries


def _tokenizer_files(path: Path, metadata: Mapping[str, Any]) -> dict[str, str]:
    if "tokenizer.ggml.model" not in metadata:
        return {}
    # AutoTokenizer would re-read the whole GGUF through transformers' config path (~10 s) only to pick
    # this same fast-tokenizer class; asking for the class directly converts the vocabulary alone.
    from transformers import TokenizersBackend

    try:
        tokenizer = TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # transformers' conversion raises many kinds
        raise TopqError(f"{path}: cannot convert the GGUF tokenizer ({type(exc).__name__}: {exc})") from exc
    return tokenizer_files_of(tokenizer)


class _Parsed:
    """A GGUF file's reader (its tensors), its metadata values and, once asked for, its converted tokenizer files."""

    def __init__(self, path: Path, reader: Any) -> None:
        self.path, self.reader, self.metadata = path, reader, _metadata(reader)
        self._tokenizer: tuple[Any, dict[str, str]] | None = None  # (the converter that made it, its files)

    def tokenizer_files(self) -> dict[str, str]:
        convert = _tokenizer_files  # looked up now: a replaced converter (a test's stand-in) is not served stale
        if self._tokenizer is None or self._tokenizer[0] is not convert:
            self._tokenizer = (convert, convert(self.path, self.metadata))
        return dict(self._tokenizer[1])


_PARSED: dict[tuple[str, int, str], _Parsed] = {}
_PARSED_KEEP = 2  # files whose parsed metadata this process keeps


def _parsed(path: Path) -> _Parsed:
    """The parsed metadata of `path`, once per process and file content.

    gguf's reader builds every metadata field eagerly and transformers' tokenizer conversion reads the file
    again: ~15 s each for SmolLM2's 49k-entry vocabulary and merges, paid by every conversion (benchmark rows,
    test fixtures) although the file never changes. The key is the file's content digest (≈0.2 s for 100 MB),
    so a file rewritten in place, even to the same size within one clock tick, is parsed anew."""
    import hashlib

    with path.open("rb") as fh:
        digest = hashlib.file_digest(fh, "blake2b").hexdigest()
    key = (str(path.resolve()), path.stat().st_size, digest)
    if key not in _PARSED:
        parsed = _Parsed(path, _read(path))
        while len(_PARSED) >= _PARSED_KEEP:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[key] = parsed
    return _PARSED[key]


def detect(path: Path) -> bool:
    """A file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with path.open("rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def open_checkpoint(path: Path) -> Checkpoint:
    """Open a .gguf file of an architecture some registered family declares (`ModelFamily.formats["gguf"]`)."""
    path = Path(path)
    if not path.is_file():
        raise TopqError(f"gguf checkpoint: no such file {path}")
    parsed = _parsed(path)
    reader = parsed.reader
    declared = _architecture(_field(parsed.metadata, "general.architecture"), path)
    tensor_names = {t.name for t in reader.tensors}
    config = _config(reader, parsed.metadata, declared, tensor_names, path)
    weights = GGUFStore(path, reader, _entries(reader, config, declared, path))
    return Checkpoint(path=path, format="gguf", config=config, weights=weights,
                      tokenizer_files=parsed.tokenizer_files())


FORMAT = CheckpointFormat("gguf", detect, open_checkpoint)


@topq.hookimpl
def register_checkpoint_formats(register: Register[CheckpointFormat]) -> None:
    register(FORMAT)
