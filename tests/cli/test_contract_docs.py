"""docs/plugins.md documents every field of the contracts a plugin fills or reads (the hooks have their own test in
tests/core/test_plugins.py): a field added to a contract without a line in the docs fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from topq.core.calibration_result import CalibrationResult
from topq.core.checkpoint import WEIGHT_STORE_METHODS, Checkpoint, CheckpointFormat
from topq.core.family import ModelFamily
from topq.core.quant import QuantScheme
from topq.core.target import CompiledModel, CompileJob, Target

PLUGINS_MD = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"

CONTRACTS: dict[str, list[str]] = {
    "ModelFamily": [f.name for f in dataclasses.fields(ModelFamily)],
    "CheckpointFormat": [f.name for f in dataclasses.fields(CheckpointFormat)],
    "Checkpoint": [f.name for f in dataclasses.fields(Checkpoint)],
    "WeightStore": [m for m in WEIGHT_STORE_METHODS if m != "__contains__"],
    "QuantScheme": [f.name for f in dataclasses.fields(QuantScheme)],
    "CalibrationResult": sorted(vars(CalibrationResult()).keys()),
    "Target": [f.name for f in dataclasses.fields(Target)],
    "CompileJob": [f.name for f in dataclasses.fields(CompileJob)],
    "CompiledModel": [f.name for f in dataclasses.fields(CompiledModel)],
}


def _section(docs: str, contract: str) -> str:
    """The text of the `#### <contract>` section (up to the next heading of any level)."""
    match = re.search(rf"^#### `?{contract}`?\s*$(.*?)(?=^#)", docs + "\n#", flags=re.M | re.S)
    assert match, f"docs/plugins.md has no `#### {contract}` section"
    return match.group(1)


@pytest.mark.parametrize("contract", sorted(CONTRACTS))
def test_every_contract_field_is_documented(contract: str) -> None:
    section = _section(PLUGINS_MD.read_text(encoding="utf-8"), contract)
    # A field counts as documented when its name opens a row of the section's table: | `name` | or | `name(...)` |
    documented = set(re.findall(r"^\| `(\w+)[`(]", section, flags=re.M))
    missing = [name for name in CONTRACTS[contract] if name not in documented]
    assert not missing, f"docs/plugins.md `#### {contract}` has no table row for {missing}"


def test_calibration_result_extras_are_all_found() -> None:
    # The test above reads the extras from an instance; make sure it sees them all (a rename shows here).
    assert CONTRACTS["CalibrationResult"] == ["float_weights", "report", "state"]
