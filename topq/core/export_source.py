"""What an exporter reads: the recipe of `topq export KIND SOURCE DIR`'s SOURCE (a recipe file or a bundle)."""

from __future__ import annotations

from pathlib import Path

from topq.core.recipe import Recipe, load_recipe

RECIPE_SUFFIXES = (".yaml", ".yml", ".json")


def source_recipe(source: Path) -> Recipe:
    """The file itself (YAML / JSON), or the recipe a bundle was built from.

    A bundle holds its target's packed weights; exporters need the checkpoint's values (float weights, or the
    scheme's integers computed again, deterministically), so they re-read the checkpoint the recipe names."""
    if source.suffix.lower() in RECIPE_SUFFIXES:
        return load_recipe(source)
    from topq.core.bundle import Bundle

    return Recipe.from_dict(Bundle(source).recipe, source=str(source))
