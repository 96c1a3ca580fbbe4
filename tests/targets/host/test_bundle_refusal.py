"""Opening a bundle: a damaged, truncated, newer-format or plain safetensors file is refused with one clear line."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from host_bundles import TinyHost

from topq.core.bundle import FORMAT_VERSION, Bundle
from topq.core.errors import TopqError
from topq.io.safetensors import SafetensorsFile, write_safetensors

TinyFactory = Callable[..., TinyHost]


def refused(path: Path, match: str) -> str:
    with pytest.raises(TopqError, match=match) as info:
        Bundle(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_damaged_bundle_is_refused(tiny_host: TinyFactory, tmp_path: Path) -> None:
    data = bytearray(tiny_host("llama").bundle.path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    start = 8 + header_len
    data[start + (len(data) - start) // 2] ^= 0x40
    path = tmp_path / "damaged.topq"
    path.write_bytes(bytes(data))
    refused(path, r"damaged bundle \(checksum mismatch in tensor ")


def test_truncated_bundle_is_refused(tiny_host: TinyFactory, tmp_path: Path) -> None:
    path = tmp_path / "truncated.topq"
    path.write_bytes(tiny_host("llama").bundle.path.read_bytes()[:-100])
    refused(path, "not a valid topq bundle")


def test_newer_format_version_is_refused(tiny_host: TinyFactory, tmp_path: Path) -> None:
    import hashlib

    source = SafetensorsFile(tiny_host("llama").bundle.path)
    meta = json.loads(source.metadata["topq.meta"])
    assert meta["format_version"] == FORMAT_VERSION
    meta["format_version"] = FORMAT_VERSION + 1
    text = json.dumps(meta, sort_keys=True)
    path = tmp_path / "newer.topq"
    write_safetensors(path, [(name, source.get_raw(name)) for name in source.names()],
                      {"topq.meta": text, "topq.meta_sha256": hashlib.sha256(text.encode()).hexdigest()})
    message = refused(path, "newer than this topq supports")
    assert f"version {FORMAT_VERSION + 1}" in message


def test_plain_safetensors_is_refused(tiny_host: TinyFactory) -> None:
    checkpoint = tiny_host("llama").checkpoint / "model.safetensors"
    refused(checkpoint, "not a topq bundle")
