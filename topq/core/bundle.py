"""The bundle: one memory-mappable safetensors file holding a compiled model.

Tensors are the (packed) weights and tables; the metadata holds one JSON document (`topq.meta`):
format version, target, the program text, the model spec, the recipe, the tokenizer files, and
checksums (sha256 of each tensor's bytes and of the document itself). Foreign, damaged, truncated or
newer-format files are refused with one clear error.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from topq.core.errors import TopqError
from topq.core.family import ModelSpec
from topq.core.safetensors_io import SafetensorsFile, write_safetensors

FORMAT = "topq-bundle"
FORMAT_VERSION = 1


def _tensor_digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).reshape(-1)).hexdigest()


def write_bundle(path: str | Path, tensors: Iterable[tuple[str, np.ndarray]] | Mapping[str, np.ndarray],
                 meta: dict[str, Any]) -> None:
    """Write a bundle atomically. `meta` needs at least target, program, spec, recipe."""
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    # Larger element types first keeps every tensor naturally aligned in the data section.
    items.sort(key=lambda item: -item[1].dtype.itemsize)
    doc = dict(meta)
    doc["format"], doc["format_version"] = FORMAT, FORMAT_VERSION
    doc["checksums"] = {name: _tensor_digest(array) for name, array in items}
    text = json.dumps(doc, sort_keys=True)
    write_safetensors(path, items, {"topq.meta": text, "topq.meta_sha256": hashlib.sha256(text.encode()).hexdigest()})


class Bundle:
    """A loaded bundle. Tensors are read-only memory-mapped views; `verify()` checks every checksum."""

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
        self.meta: dict[str, Any] = json.loads(text)
        if self.meta.get("format") != FORMAT:
            raise TopqError(f"{self.path}: not a topq bundle (format {self.meta.get('format')!r})")
        version = self.meta.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise TopqError(f"{self.path}: bundle format version {version} is newer than this topq "
                            f"supports ({FORMAT_VERSION}); upgrade topq")
        if set(self.meta["checksums"]) != set(self.file.names()):
            raise TopqError(f"{self.path}: damaged bundle (tensor list does not match its checksums)")
        if verify:
            self.verify()

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

    @cached_property
    def spec(self) -> ModelSpec:
        return ModelSpec.from_dict(self.meta["spec"])

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
        from topq.core.checkpoint import load_tokenizer

        files = self.meta.get("tokenizer") or {}
        if not files:
            raise TopqError(f"{self.path}: bundle has no tokenizer; use --prompt-ids")
        return load_tokenizer(files)
