"""GGUF files (llama.cpp): metadata -> HF-style config, tensors -> HF names and layout.

GGUF stores dims in ggml order (innermost first); numpy views of the data already come out
as [out, in], which is the Hugging Face layout. llama.cpp's converter permutes the rows of
q_proj/k_proj for arch `llama` (rotary pairs interleaved); we undo that exactly as
transformers' GGUF loader does, so weights equal the original HF ones. The row permutation
is applied to raw quantized rows too: a block never spans two rows, so it is lossless.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

import topq
from topq.core.checkpoint import BaseWeightStore, Checkpoint, CheckpointFormat, normalize_rope, tokenizer_files_of
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.core.quant import QuantizedWeight
from topq.io.schema import show
from topq.plugins.formats.quantized import GGUF_DEQUANTIZED_BITS, GGUF_EXACT_TYPES, unpack_gguf

__all__ = ["FORMAT", "GGUFStore", "detect", "gguf_to_hf_name", "open_checkpoint", "reverse_permute"]

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")
_PLAIN_NP = {"F32": "float32", "F16": "float16", "F64": "float64",
             "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64"}


def gguf_to_hf_name(name: str) -> str:
    """HF name of a GGUF tensor; names without an HF equivalent are kept as they are."""
    if m := _BLOCK_RE.fullmatch(name):
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif (m := _GLOBAL_RE.fullmatch(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return name


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
        qtype = self._entry(name).tensor.tensor_type.name
        return "bfloat16" if qtype == "BF16" else _PLAIN_NP.get(qtype, qtype)

    def gguf_name(self, name: str) -> str:
        return self._entry(name).tensor.name

    def get_raw(self, name: str) -> np.ndarray:
        """Stored values (read-only view when possible); quantized types as uint8 block rows."""
        entry = self._entry(name)
        data = entry.tensor.data
        if entry.tensor.tensor_type.name == "BF16":
            data = data.view(ml_dtypes.bfloat16)  # the reader exposes bf16 as raw bytes
        if entry.heads:
            data = reverse_permute(data, entry.heads)
        return data

    def quantized(self, name: str) -> QuantizedWeight | None:
        """Q4_0 / Q8_0 tensors repacked losslessly (blocks of 32, HF row order); None for every other type.

        Other quantized GGML types (Q4_1, k-quants, ...) have no exact integer form here: `get` dequantizes them,
        `dequantized_bits` gives their width (the `auto` scheme requantizes such linears) and
        `Checkpoint.config["topq_gguf_dequantized"]` counts them per type.
        """
        entry = self._entry(name)
        qtype = entry.tensor.tensor_type.name
        if qtype not in GGUF_EXACT_TYPES:
            return None
        return unpack_gguf(self.get_raw(name), qtype, entry.shape, what=f"{self.path}: {entry.tensor.name}")

    def dequantized_bits(self, name: str) -> int | None:
        """Bits per weight of a quantized tensor without an exact integer form (Q4_1: 4, Q6_K: 6); None otherwise
        (float types, Q4_0 / Q8_0, and a GGML type topq has no width for, which stays float)."""
        return GGUF_DEQUANTIZED_BITS.get(self._entry(name).tensor.tensor_type.name)

    def dequantized_types(self) -> dict[str, int]:
        """{GGML type: tensor count} of the quantized tensors that are not repacked exactly (e.g. {"Q4_1": 210})."""
        counts: dict[str, int] = {}
        for entry in self._entries.values():
            qtype = entry.tensor.tensor_type.name
            if qtype not in _PLAIN_NP and qtype != "BF16" and qtype not in GGUF_EXACT_TYPES:
                counts[qtype] = counts.get(qtype, 0) + 1
        return dict(sorted(counts.items()))

    def get(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        entry = self._entry(name)
        tensor = entry.tensor
        try:
            if tensor.tensor_type.name in _PLAIN_NP:
                values = np.array(tensor.data, dtype=np.float32)  # copy off the mmap
            else:
                values = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise TopqError(f"{self.path}: cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc
        values = values.reshape(entry.shape)
        if entry.heads:
            values = reverse_permute(values, entry.heads)
        return np.ascontiguousarray(values, dtype=np.float32)


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


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - a malformed value is treated as absent
        return default


class _Metadata:
    """Typed reads of one architecture's GGUF keys: a value of the wrong type or range is one clear error (a
    crafted or damaged file must not reach the model code as a string size or a zero head count)."""

    def __init__(self, reader: Any, arch: str, path: Path) -> None:
        self.reader, self.arch, self.path = reader, arch, path

    def _bad(self, key: str, value: Any, want: str) -> TopqError:
        return TopqError(f"{self.path}: GGUF metadata {key} must be {want}, got {show(value)}")

    def raw(self, key: str, default: Any = None) -> Any:
        return _field(self.reader, key, default)

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

    def token_id(self, name: str) -> int | None:
        key = f"tokenizer.ggml.{name}"
        value = self.raw(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise self._bad(key, value, "a token id (an integer >= 0)")
        return value


def _config(reader: Any, arch: str, tensor_names: set[str], path: Path) -> dict[str, Any]:
    meta = _Metadata(reader, arch, path)
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
    head_dim = meta.count("attention.key_length") or meta.count("rope.dimension_count") or hidden // heads
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else meta.count("vocab_size")
    scaling = None
    rope_type = meta.raw(f"{arch}.rope.scaling.type")
    if rope_type is not None and not isinstance(rope_type, str):
        raise meta._bad(f"{arch}.rope.scaling.type", rope_type, "a string")
    if rope_type not in (None, "none"):
        scaling = {"rope_type": rope_type, "factor": meta.number("rope.scaling.factor", 1.0)}
        if (orig := meta.count("rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = orig
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
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
    if arch == "qwen2":
        config["attention_bias"] = any(n.endswith("attn_q.bias") for n in tensor_names)
    return normalize_rope(config)


def _entries(reader: Any, config: dict[str, Any], arch: str, path: Path) -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for t in reader.tensors:
        hf = gguf_to_hf_name(t.name)
        if t.tensor_type.name.startswith("I"):  # model weights are float or quantized; checked before any work
            raise TopqError(f"{path}: tensor {t.name} is stored as {t.tensor_type.name}, not a floating-point or "
                            "quantized type (a damaged file, or its type was changed)")
        heads = 0
        if arch == "llama" and (m := _BLOCK_RE.fullmatch(t.name)) and m.group(2) in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if m.group(2) == "attn_q" else config["num_key_value_heads"]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if heads and shape[0] % (2 * heads):
            raise TopqError(f"{path}: {t.name} has {shape[0]} rows, not a multiple of 2 x {heads} heads")
        if hf in entries:
            raise TopqError(f"{path}: two tensors map to {hf}")
        entries[hf] = _Entry(t, shape, heads)
    return entries


def _tokenizer_files(path: Path, reader: Any) -> dict[str, str]:
    if "tokenizer.ggml.model" not in reader.fields:
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
    """A GGUF file's reader and, once asked for, its converted tokenizer files."""

    def __init__(self, path: Path, reader: Any) -> None:
        self.path, self.reader = path, reader
        self._tokenizer: tuple[Any, dict[str, str]] | None = None  # (the converter that made it, its files)

    def tokenizer_files(self) -> dict[str, str]:
        convert = _tokenizer_files  # looked up now: a replaced converter (a test's stand-in) is not served stale
        if self._tokenizer is None or self._tokenizer[0] is not convert:
            self._tokenizer = (convert, convert(self.path, self.reader))
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
    """Open a .gguf file (llama, qwen2, qwen3 architectures)."""
    path = Path(path)
    if not path.is_file():
        raise TopqError(f"gguf checkpoint: no such file {path}")
    parsed = _parsed(path)
    reader = parsed.reader
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise TopqError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")
    tensor_names = {t.name for t in reader.tensors}
    config = _config(reader, arch, tensor_names, path)
    weights = GGUFStore(path, reader, _entries(reader, config, arch, path))
    config["topq_gguf_dequantized"] = weights.dequantized_types()  # GGML types with no exact repack: warn
    return Checkpoint(path=path, format="gguf", config=config, weights=weights,
                      tokenizer_files=parsed.tokenizer_files())


FORMAT = CheckpointFormat("gguf", detect, open_checkpoint)


@topq.hookimpl
def register_checkpoint_formats(register: Register[CheckpointFormat]) -> None:
    register(FORMAT)
