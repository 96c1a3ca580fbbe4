"""The exporter contract: hand a recipe's or a bundle's model to another tool (`topq export KIND SOURCE DIR`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ExportRequest:
    """What `topq export` passes to an exporter.

    `source` is a recipe (YAML) or a bundle; `tool` is the other tool's interpreter or installation when the
    exporter can drive it (None: write the files only); `options` are the `--option KEY=VALUE` pairs.
    """

    source: Path
    out_dir: Path
    tool: str | None = None
    options: Mapping[str, str] = field(default_factory=dict)
    jobs: int = 1
    progress: bool = True


@dataclass(frozen=True)
class Exporter:
    """What an exporter plugin registers: `export(request)` writes `request.out_dir` and returns a JSON-able
    summary (what it wrote)."""

    name: str
    description: str
    export: Callable[[ExportRequest], dict[str, Any]]
