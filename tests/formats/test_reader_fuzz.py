"""Hypothesis fuzzing of the readers of untrusted files (issue 16): safetensors, GGUF, bundles and recipes.

Each fuzzer starts from a small valid file written by the format's own library (or topq's writer), damages it
(byte flips, truncation, crafted headers or metadata) and reads it the way a conversion or `topq run` would.
Whatever happens, only topq's own error type may escape: anything else would be a traceback for the user.
Example counts are bounded and `derandomize=True` makes every run try the same inputs (fast, reproducible).
"""

from __future__ import annotations

import hashlib
import json
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_values import add_value
from host_bundles import TinyHost
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topq.core import cli
from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.recipe import load_recipe
from topq.io.safetensors import SafetensorsFile, write_safetensors
from topq.plugins.formats import gguf_file

FUZZ = settings(max_examples=60, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

#: JSON values of every kind, nested a little: what a crafted header or metadata document may hold
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                 max_size=3),
                    max_leaves=8)
#: byte edits of a file: (position as a fraction of the file, new byte)
EDITS = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=6)


def damaged(data: bytes, edits: list[tuple[float, int]], keep: float) -> bytes:
    out = bytearray(data)
    for where, value in edits:
        out[int(where * len(out))] = value
    return bytes(out[: max(1, int(keep * len(out)))])


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="topq-fuzz-") as d:
        yield Path(d)


# ----------------------------------------------------------------------------------------------- safetensors

def read_all_safetensors(path: Path) -> None:
    f = SafetensorsFile(path)
    for name in f.names():
        f.read(name)
        np.asarray(f.get_raw(name)).sum()


def small_safetensors() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.safetensors"
        rng = np.random.default_rng(0)
        write_safetensors(path, {"a": rng.standard_normal((4, 8)).astype(np.float32),
                                 "b": np.arange(6, dtype=np.int32).reshape(2, 3),
                                 "c": np.ones(5, np.float16)}, {"k": "v"})
        data = path.read_bytes()
    # drop the writer's page-alignment padding so that random edits land in the header or the data
    (hlen,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + hlen].rstrip(b" ")
    return struct.pack("<Q", len(header)) + header + data[8 + hlen:]


SAFETENSORS = small_safetensors()


@FUZZ
@given(edits=EDITS, keep=st.floats(0.5, 1))
def test_damaged_safetensors_bytes(scratch: Path, edits: list[tuple[float, int]], keep: float) -> None:
    path = scratch / "x.safetensors"
    path.write_bytes(damaged(SAFETENSORS, edits, keep))
    try:
        read_all_safetensors(path)
    except TopqError as exc:
        assert "\n" not in str(exc)


ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "I32", "BF16", "U8", "BOOL", "F8_E4M3", "X", ""]) | JSON,
    "shape": st.lists(st.integers(-2, 2**40), max_size=3) | JSON,
    "data_offsets": st.lists(st.integers(-8, 2**62), min_size=0, max_size=3) | JSON,
})


@FUZZ
@given(header=st.dictionaries(st.text(max_size=4) | st.just("__metadata__"), ENTRY | JSON, max_size=4),
       data=st.binary(max_size=64))
def test_crafted_safetensors_headers(scratch: Path, header: dict[str, Any], data: bytes) -> None:
    text = json.dumps(header, allow_nan=True).encode()
    path = scratch / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    try:
        read_all_safetensors(path)
    except TopqError:
        pass


# ----------------------------------------------------------------------------------------------- GGUF

def write_tiny_gguf(path: Path, metadata: Callable[[Any], None] | None = None) -> None:
    """A one-layer llama GGUF (64 wide, 4 heads, 2 KV heads) with F32, F16 and Q8_0 tensors, no tokenizer."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(1)
    writer = GGUFWriter(str(path), "llama")
    if metadata is None:
        writer.add_embedding_length(64)
        writer.add_block_count(1)
        writer.add_head_count(4)
        writer.add_head_count_kv(2)
        writer.add_feed_forward_length(128)
        writer.add_context_length(64)
    else:
        metadata(writer)
    writer.add_tensor("token_embd.weight", rng.standard_normal((32, 64)).astype(np.float16))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    writer.add_tensor("blk.0.attn_q.weight",
                      quantize(rng.standard_normal((64, 64)).astype(np.float32), GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_all_gguf(path: Path) -> None:
    ck = gguf_file.open_checkpoint(path)
    for name in ck.weights.names():
        ck.weights.get(name)
        ck.weights.quantized(name)


def small_gguf() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.gguf"
        write_tiny_gguf(path)
        return path.read_bytes()


GGUF = small_gguf()


def test_the_fuzzed_gguf_is_valid(scratch: Path) -> None:
    path = scratch / "x.gguf"
    path.write_bytes(GGUF)
    read_all_gguf(path)  # the starting point reads cleanly, so the damage is what the fuzzer tests


@FUZZ
@given(edits=EDITS, keep=st.floats(0.3, 1), head=st.booleans())
def test_damaged_gguf_bytes(scratch: Path, edits: list[tuple[float, int]], keep: float, head: bool) -> None:
    # `head`: confine the edits to the header and metadata (the first KiB), where a flip changes structure
    data = GGUF
    if head:
        edits = [(where * 1024 / len(data), value) for where, value in edits]
    path = scratch / "x.gguf"
    path.write_bytes(damaged(data, edits, keep))
    try:
        read_all_gguf(path)
    except TopqError as exc:
        assert "\n" not in str(exc)


GGUF_KEYS = ["llama.embedding_length", "llama.block_count", "llama.attention.head_count",
             "llama.attention.head_count_kv", "llama.feed_forward_length", "llama.context_length",
             "llama.attention.key_length", "llama.rope.dimension_count", "llama.attention.layer_norm_rms_epsilon",
             "llama.rope.freq_base", "llama.rope.scaling.type", "llama.rope.scaling.factor", "general.architecture",
             "tokenizer.ggml.bos_token_id", "llama.vocab_size"]
GGUF_VALUES = (st.integers(-2**31, 2**32 - 1) | st.floats(width=32) | st.text(max_size=6) | st.booleans()
               | st.lists(st.integers(-3, 2**31 - 1), min_size=1, max_size=3))


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(GGUF_KEYS), GGUF_VALUES, max_size=8),
       base=st.booleans())
def test_crafted_gguf_metadata(scratch: Path, fields: dict[str, Any], base: bool) -> None:
    def metadata(writer: Any) -> None:
        defaults = {"llama.embedding_length": 64, "llama.block_count": 1, "llama.attention.head_count": 4,
                    "llama.attention.head_count_kv": 2, "llama.feed_forward_length": 128}
        for key, value in ({**defaults, **fields} if base else fields).items():
            if key != "general.architecture":
                add_value(writer, key, value)

    path = scratch / "x.gguf"
    try:
        write_tiny_gguf(path, metadata)
    except (ValueError, TypeError, OverflowError, struct.error):
        return  # the gguf library itself refuses to write this value: nothing to read
    try:
        read_all_gguf(path)
    except TopqError as exc:
        assert "\n" not in str(exc)


# ----------------------------------------------------------------------------------------------- bundles

TinyFactory = Callable[..., TinyHost]


@pytest.fixture(scope="module")
def bundle_parts(tiny_host: TinyFactory) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    source = SafetensorsFile(tiny_host("llama").bundle.path)
    return {n: np.array(source.get_raw(n)) for n in source.names()}, json.loads(source.metadata["topq.meta"])


def mutate(doc: Any, path: list[str], value: Any) -> Any:
    """`doc` with the entry at `path` (keys or indices, as far as they go) replaced by `value`."""
    if not path:
        return value
    if isinstance(doc, dict) and doc:
        keys = sorted(doc)
        key = keys[hash(path[0]) % len(keys)] if path[0] not in doc else path[0]
        return {**doc, key: mutate(doc[key], path[1:], value)}
    if isinstance(doc, list) and doc:
        i = len(path[0]) % len(doc)
        return [*doc[:i], mutate(doc[i], path[1:], value), *doc[i + 1:]]
    return value


META_KEYS = st.sampled_from(["spec", "stages", "target", "program", "recipe", "checksums", "tokenizer",
                             "format_version", "hidden_size", "num_layers", "num_heads", "head_dim",
                             "vocab_size", "seq_length", "decode_chunks", "prefill", "x"])


@FUZZ
@given(path=st.lists(META_KEYS, min_size=1, max_size=3), value=JSON)
def test_crafted_bundle_metadata(scratch: Path, bundle_parts: tuple[dict[str, np.ndarray], dict[str, Any]],
                                 path: list[str], value: Any, capsys: pytest.CaptureFixture[str]) -> None:
    tensors, meta = bundle_parts
    text = json.dumps(mutate(meta, path, value), sort_keys=True)
    bundle = scratch / "b.topq"
    write_safetensors(bundle, tensors.items(), {"topq.meta": text,
                                                "topq.meta_sha256": hashlib.sha256(text.encode()).hexdigest()})
    try:
        b = Bundle(bundle)
        b.spec, b.program, b.target, b.tokenizer  # noqa: B018 - every property a command reads
    except TopqError:
        pass  # (the CLI prints any TopqError as one line)
    capsys.readouterr()
    code = cli.main(["inspect", str(bundle)])  # the command reads the whole document: nothing but TopqError
    err = capsys.readouterr().err
    assert code == 0 or (err.startswith("error: ") and err.count("\n") == 1), err


# ----------------------------------------------------------------------------------------------- recipes

YAML_SCALARS = st.sampled_from(["~", "true", "0", "-1", "1e400", ".nan", "'x'", "[]", "{}", "*a", "&a 1", "!!str 1",
                                "!!python/object:os.system 1", "\"\\x00\"", "2**64", "pkg:../x", "/dev/null"])
RECIPE_KEYS = st.sampled_from(["model", "path", "family", "quant", "scheme", "bits", "group_size", "target",
                               "chip", "stages", "seq_length", "decode_chunks", "output", "kernels", "<<", "x"])


def yaml_text(doc: Any, depth: int = 0) -> str:
    if isinstance(doc, dict):
        pad = "  " * depth
        return "".join(f"\n{pad}{k}: {yaml_text(v, depth + 1)}" for k, v in doc.items()) or "{}"
    if isinstance(doc, list):
        return "[" + ", ".join(yaml_text(v, depth) for v in doc) + "]"
    return str(doc)


YAML_DOCS = st.recursive(YAML_SCALARS, lambda inner: st.dictionaries(RECIPE_KEYS, inner, max_size=4)
                         | st.lists(inner, max_size=3), max_leaves=10)


@FUZZ
@given(doc=st.dictionaries(RECIPE_KEYS, YAML_DOCS, max_size=5) | YAML_DOCS, raw=st.binary(max_size=16))
def test_random_recipe_files(scratch: Path, doc: Any, raw: bytes) -> None:
    path = scratch / "r.yaml"
    path.write_bytes(yaml_text(doc).lstrip("\n").encode() + (raw if raw[:1] == b"#" else b""))
    try:
        load_recipe(path)
    except TopqError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 2000
