"""docs/plugins.md documents every field of the family contract and every weight-mapping rule."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from topq.core.family import ModelFamily
from topq.models.weightmap import AddScalar, GroupedRows, Rows, Stack

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def section(title: str) -> str:
    """The text of the docs section whose heading is `title`, up to the next heading of the same level or higher."""
    text = DOCS.read_text(encoding="utf-8")
    match = re.search(rf"^(#+) {re.escape(title)}$", text, flags=re.MULTILINE)
    assert match, f"docs/plugins.md has no section {title!r}"
    level = len(match.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[match.end():], flags=re.MULTILINE)
    return text[match.end(): match.end() + end.start() if end else len(text)]


def test_every_model_family_field_has_a_row() -> None:
    docs = section("register_model_families")
    for field in dataclasses.fields(ModelFamily):
        assert f"| `{field.name}` |" in docs, f"docs/plugins.md: ModelFamily.{field.name} is not documented"


def test_every_weight_rule_and_its_fields_are_documented() -> None:
    docs = section("Weight mapping (fused projections, `1 + w` norms, stacked experts)")
    for rule in (Rows, AddScalar, Stack, GroupedRows):
        names = [f.name for f in dataclasses.fields(rule)]
        row = next((line for line in docs.splitlines() if line.startswith(f"| `{rule.__name__}(")), None)
        assert row is not None, f"docs/plugins.md: weight rule {rule.__name__} has no row"
        assert row.startswith(f"| `{rule.__name__}({', '.join(names)})`"), row
        for name in names:
            assert f"`{name}:" in row, f"docs/plugins.md: {rule.__name__}.{name} has no type"
