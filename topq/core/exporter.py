"""The exporter contract: hand a recipe's or a bundle's model to another tool (`topq export KIND SOURCE DIR`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from topq.core.recipe import Recipe


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


RECIPE_SUFFIXES = (".yaml", ".yml", ".json")


def source_recipe(source: Path) -> Recipe:
    """The recipe of an exporter's SOURCE: the file itself (YAML / JSON), or the recipe a bundle was built from.

    A bundle holds its target's packed weights; exporters need the checkpoint's values (float weights, or the
    scheme's integers computed again, deterministically), so they re-read the checkpoint the recipe names."""
    from topq.core.recipe import Recipe, load_recipe

    if source.suffix.lower() in RECIPE_SUFFIXES:
        return load_recipe(source)
    from topq.core.bundle import Bundle

    return Recipe.from_dict(Bundle(source).recipe, source=str(source))
