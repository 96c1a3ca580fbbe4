"""Opening a bundle: a damaged, truncated, newer-format or plain safetensors file is refused with one clear line."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from host_bundles import TinyHost

from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.io.bundle import FORMAT_VERSION
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


def _recrafted(source_path: Path, path: Path, edit: Callable[[dict[str, object]], object]) -> Path:
    """The bundle with its metadata document edited and its metadata checksum recomputed (a crafted file)."""
    import hashlib

    source = SafetensorsFile(source_path)
    doc = edit(json.loads(source.metadata["topq.meta"]))
    text = json.dumps(doc, sort_keys=True)
    write_safetensors(path, [(name, source.get_raw(name)) for name in source.names()],
                      {"topq.meta": text, "topq.meta_sha256": hashlib.sha256(text.encode()).hexdigest()})
    return path


def _without(key: str) -> Callable[[dict[str, object]], object]:
    return lambda doc: {k: v for k, v in doc.items() if k != key}


def _with(key: str, value: object) -> Callable[[dict[str, object]], object]:
    return lambda doc: {**doc, key: value}


@pytest.mark.parametrize(("edit", "match"), [
    (lambda doc: [doc], r"not a topq bundle \(format 'list'\)"),
    (_without("checksums"), r"damaged bundle \(metadata 'checksums' is missing"),
    (_without("spec"), r"damaged bundle \(metadata 'spec' is missing"),
    (_without("stages"), r"damaged bundle \(metadata 'stages' is missing"),
    (_without("target"), r"damaged bundle \(metadata 'target' is missing"),
    (_with("program", 7), r"damaged bundle \(metadata 'program' is missing or not a str"),
    (_with("checksums", {"x": 1}), r"damaged bundle \(checksums are not strings\)"),
    (_with("format_version", 0), r"format_version 0 is not a version number"),
    (_with("format_version", True), r"format_version True is not a version number"),
    (_with("format_version", "1"), r"format_version '1' is not a version number"),
], ids=["list", "no-checksums", "no-spec", "no-stages", "no-target", "program-int", "checksum-int", "version-0",
        "version-true", "version-string"])
def test_crafted_metadata_is_refused(tiny_host: TinyFactory, tmp_path: Path,
                                     edit: Callable[[dict[str, object]], object], match: str) -> None:
    refused(_recrafted(tiny_host("llama").bundle.path, tmp_path / "crafted.topq", edit), match)
