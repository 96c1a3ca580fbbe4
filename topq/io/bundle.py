"""The bundle container: one memory-mappable safetensors file holding a compiled model.

Tensors are the (packed) weights and tables; the metadata holds one JSON document (`topq.meta`):
format version, target, the program text, the model spec, the recipe, the tokenizer files, and
checksums (sha256 of each tensor's bytes and of the document itself). Foreign, damaged, truncated or
newer-format files are refused with one clear error. What the document means (the model spec) is the
core's `topq.core.bundle.Bundle`, which extends `BundleFile` through `check_document`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from topq.io.safetensors import SafetensorsFile, SafetensorsWriter, TensorData
from topq.io.tokenizer import load_tokenizer
from topq.ir.errors import TopqError

FORMAT = "topq-bundle"
FORMAT_VERSION = 1
#: what every reader of a bundle relies on, by type (a crafted file with a sound checksum may still lack them)
_REQUIRED: dict[str, type] = {"checksums": dict, "target": str, "program": str, "spec": dict, "stages": dict,
                              "recipe": dict}


def _positive_int(value: Any) -> bool:
    return type(value) is int and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _report_row(row: Any) -> bool:
    """A calibration report row as `topq inspect` prints it: a name, numbers or nothing for the errors (an expert
    that no calibration token reached has none), and a mode word when the row has one (`rtn` for a fallback)."""
    return (isinstance(row, dict) and isinstance(row.get("name"), str)
            and all(row.get(k) is None or _number(row[k]) for k in ("error", "rtn_error", "ratio"))
            and (row.get("mode") is None or isinstance(row["mode"], str)))


#: what the readers of a bundle (runtime, inspect, targets) take from the document besides _REQUIRED, by check
_STAGE_FIELDS: dict[str, Callable[[Any], bool]] = {
    "seq_length": _positive_int,
    "max_input_length": _positive_int,
    "prefill_kv": lambda v: isinstance(v, bool),
    "decode_variants": lambda v: isinstance(v, list) and bool(v) and all(_positive_int(x) for x in v),
}
_OPTIONAL_FIELDS: dict[str, Callable[[Any], bool]] = {
    "tokenizer": lambda v: isinstance(v, dict) and all(isinstance(t, str) for t in v.values()),
    "target_meta": lambda v: isinstance(v, dict),
    "quant_report": lambda v: isinstance(v, list) and all(_report_row(r) for r in v),
    "scheme": lambda v: isinstance(v, str),
    "family": lambda v: isinstance(v, str),
}


def _document_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with a bundle document whose checksum is sound (a crafted file), or None."""
    for key, ok in _STAGE_FIELDS.items():
        if not ok(meta["stages"].get(key)):
            return f"stages.{key} is missing or malformed"
    for key, ok in _OPTIONAL_FIELDS.items():
        if meta.get(key) is not None and not ok(meta[key]):
            return f"{key!r} is malformed"
    return None


def _tensor_digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data).hexdigest()


def _meta_metadata(doc: dict[str, Any]) -> dict[str, str]:
    text = json.dumps(doc, sort_keys=True)
    return {"topq.meta": text, "topq.meta_sha256": hashlib.sha256(text.encode()).hexdigest()}


def write_bundle(path: str | Path, manifest: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
                 tensors: Iterable[tuple[str, TensorData]], meta: dict[str, Any]) -> None:
    """Stream a bundle to `path` atomically: tensors arrive one at a time in manifest order.

    `meta` needs at least target, program, spec, recipe. Checksums are computed while streaming; the header is
    first written with same-width placeholders and rewritten at the end.
    """
    doc = dict(meta)
    doc["format"], doc["format_version"] = FORMAT, FORMAT_VERSION
    doc["checksums"] = {name: "0" * 64 for name, _, _ in manifest}
    with SafetensorsWriter(path, list(manifest), _meta_metadata(doc)) as writer:
        for name, data in tensors:
            doc["checksums"][name] = writer.write(name, data)
        writer.finish(_meta_metadata(doc))


def write_bundle_arrays(path: str | Path, tensors: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
    """write_bundle for tensors already in memory (tests, small tools)."""
    write_bundle(path, [(n, a.dtype, tuple(a.shape)) for n, a in tensors.items()], tensors.items(), meta)


class BundleFile:
    """An opened bundle container. Tensors are read-only memory-mapped views; `verify()` checks every checksum.

    Opening checks the container and its document (`check_document`, which a subclass extends), then, with
    `verify`, every tensor's checksum."""

    def __init__(self, path: str | Path, verify: bool = True) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise TopqError(f"{self.path}: no such bundle file")
        try:
            self.file = SafetensorsFile(self.path)
        except TopqError as exc:
            raise TopqError(f"not a valid topq bundle: {exc}") from None
        text = self.file.metadata.get("topq.meta")
        if text is None:
            raise TopqError(f"{self.path}: not a topq bundle (a safetensors file without topq metadata)")
        if hashlib.sha256(text.encode()).hexdigest() != self.file.metadata.get("topq.meta_sha256"):
            raise TopqError(f"{self.path}: damaged bundle (metadata checksum mismatch)")
        try:
            meta = json.loads(text)
        except ValueError:
            raise TopqError(f"{self.path}: damaged bundle (its metadata is not JSON)") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise TopqError(f"{self.path}: not a topq bundle (format {found!r})")
        self.meta: dict[str, Any] = meta
        version = meta.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise TopqError(f"{self.path}: damaged bundle (format_version {version!r} is not a version number)")
        if version > FORMAT_VERSION:
            raise TopqError(f"{self.path}: bundle format version {version} is newer than this topq "
                            f"supports ({FORMAT_VERSION}); upgrade topq")
        for key, kind in _REQUIRED.items():
            if not isinstance(meta.get(key), kind):
                raise TopqError(f"{self.path}: damaged bundle (metadata {key!r} is missing or not a "
                                f"{kind.__name__})")
        if not all(isinstance(d, str) for d in meta["checksums"].values()):
            raise TopqError(f"{self.path}: damaged bundle (checksums are not strings)")
        if set(self.meta["checksums"]) != set(self.file.names()):
            raise TopqError(f"{self.path}: damaged bundle (tensor list does not match its checksums)")
        self.check_document()
        if verify:
            self.verify()

    def check_document(self) -> None:
        """Refuse a document whose checksum is sound but whose content is not (a crafted file)."""
        if (problem := _document_problem(self.meta)) is not None:
            raise TopqError(f"{self.path}: damaged bundle (metadata {problem})")

    def verify(self) -> None:
        for name, digest in self.meta["checksums"].items():
            if _tensor_digest(self.file.get_raw(name)) != digest:
                raise TopqError(f"{self.path}: damaged bundle (checksum mismatch in tensor {name})")

    @property
    def target(self) -> str:
        return str(self.meta["target"])

    @property
    def program(self) -> str:
        return str(self.meta["program"])

    @property
    def recipe(self) -> dict[str, Any]:
        return dict(self.meta["recipe"])

    def tensor(self, name: str) -> np.ndarray:
        if name not in self.file:
            raise TopqError(f"{self.path}: bundle has no tensor {name}")
        return self.file.get_raw(name)

    def tensor_names(self) -> list[str]:
        return self.file.names()

    @cached_property
    def tokenizer(self) -> Any:
        files = self.meta.get("tokenizer") or {}
        if not files:
            raise TopqError(f"{self.path}: bundle has no tokenizer; use --prompt-ids")
        return load_tokenizer(files)
