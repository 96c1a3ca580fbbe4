"""docs/plugins.md documents every field of the scheme contract (QuantScheme, SchemeProduct, the options' Field)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from topq.core.quant import QuantScheme, SchemeProduct
from topq.core.recipe import Field
from topq.core.target import Target

PLUGINS_MD = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


@pytest.mark.parametrize("contract", [QuantScheme, SchemeProduct, Field])
def test_every_contract_field_has_a_table_row(contract: type) -> None:
    docs = PLUGINS_MD.read_text()
    for f in dataclasses.fields(contract):
        # a row names the field first: "| `name` |", or "| `ge` / `gt` / `le` |" for a group of fields
        assert re.search(rf"^\| (`\w+`(,| /) )*`{f.name}`( /|,| \|)", docs, flags=re.MULTILINE), \
            f"docs/plugins.md has no table row for {contract.__name__}.{f.name}"


def test_every_target_field_is_named() -> None:
    docs = PLUGINS_MD.read_text()
    for f in dataclasses.fields(Target):
        assert f"`{f.name}" in docs, f"docs/plugins.md does not mention Target.{f.name}"
