"""docs/plugins.md documents every field of every contract a plugin fills or reads.

One table drives it: each contract names the docs section that documents it and the fields it has (read from the
code, so a field added without a line in the docs fails here). A field counts as documented when it opens a row
of a table in that section: "| `name` |", "| `name(...)` |", or one of a group "| `ge` / `gt` / `le` |". The hooks
themselves are checked in tests/core/test_plugins.py.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from topq.core.calibration_result import CalibrationResult
from topq.core.checkpoint import WEIGHT_STORE_METHODS, Checkpoint, CheckpointFormat
from topq.core.exporter import Exporter, ExportRequest
from topq.core.family import ModelFamily
from topq.core.quant import QuantScheme, SchemeProduct
from topq.core.target import CompiledModel, CompileJob, Target
from topq.io.schema import Field
from topq.ir.extension import IRExtension
from topq.models.weightmap import AddScalar, GroupedRows, Rows, Stack

PLUGINS_MD = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
WEIGHT_MAPPING = "Weight mapping (fused projections, `1 + w` norms, stacked experts)"


def fields_of(contract: type) -> list[str]:
    return [f.name for f in dataclasses.fields(contract)]


#: contract → (the heading of its docs section, its field names)
CONTRACTS: dict[str, tuple[str, list[str]]] = {
    "ModelFamily": ("ModelFamily", fields_of(ModelFamily)),
    "CheckpointFormat": ("CheckpointFormat", fields_of(CheckpointFormat)),
    "Checkpoint": ("Checkpoint", fields_of(Checkpoint)),
    "WeightStore": ("WeightStore", [m for m in WEIGHT_STORE_METHODS if m != "__contains__"]),
    "QuantScheme": ("QuantScheme", fields_of(QuantScheme)),
    "SchemeProduct": ("QuantScheme", fields_of(SchemeProduct)),
    "Field": ("QuantScheme", fields_of(Field)),
    "CalibrationResult": ("CalibrationResult", sorted(vars(CalibrationResult()))),
    "Target": ("Target", fields_of(Target)),
    "CompileJob": ("CompileJob", fields_of(CompileJob)),
    "CompiledModel": ("CompiledModel", fields_of(CompiledModel)),
    "IRExtension": ("IRExtension", fields_of(IRExtension)),
    "Exporter": ("Exporter", fields_of(Exporter)),
    "ExportRequest": ("ExportRequest", fields_of(ExportRequest)),
}


def section(title: str) -> str:
    """The text under the heading `title`, up to the next heading of the same level or higher (headings inside
    fenced code blocks do not count)."""
    lines = PLUGINS_MD.read_text(encoding="utf-8").splitlines()
    in_code, start, level, body = False, None, 0, []
    for line in lines:
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"^(#+) (.*)$", line)
        if start is not None:
            if heading and len(heading.group(1)) <= level:
                break
            body.append(line)
        elif heading and heading.group(2).strip("`") == title:
            start, level = line, len(heading.group(1))
    assert start is not None, f"docs/plugins.md has no section {title!r}"
    return "\n".join(body)


def documented(text: str, name: str) -> bool:
    return re.search(rf"^\| (`\w+`(,| /) )*`{name}[`(]", text, flags=re.M) is not None


@pytest.mark.parametrize("contract", sorted(CONTRACTS))
def test_every_contract_field_has_a_table_row(contract: str) -> None:
    title, names = CONTRACTS[contract]
    text = section(title)
    missing = [name for name in names if not documented(text, name)]
    assert not missing, f"docs/plugins.md section {title!r} has no table row for {contract}.{missing}"


def test_every_weight_rule_shows_its_fields_with_types() -> None:
    text = section(WEIGHT_MAPPING)
    for rule in (Rows, AddScalar, Stack, GroupedRows):
        names = fields_of(rule)
        row = next((line for line in text.splitlines() if line.startswith(f"| `{rule.__name__}(")), None)
        assert row is not None, f"docs/plugins.md: weight rule {rule.__name__} has no row"
        assert row.startswith(f"| `{rule.__name__}({', '.join(names)})`"), row
        for name in names:
            assert f"`{name}:" in row, f"docs/plugins.md: {rule.__name__}.{name} has no type"


def test_the_checker_sees_what_it_checks() -> None:
    # The table reads CalibrationResult's extras from an instance and Field from the schema module: a rename or a
    # moved class shows here rather than as a silently shorter list.
    assert CONTRACTS["CalibrationResult"][1] == ["float_weights", "report", "state", "warnings"]
    assert {"type", "default", "help", "choices"} <= set(CONTRACTS["Field"][1])
    assert not documented("| `name` |", "nam") and documented("| `ge` / `gt` / `le` |", "gt")
