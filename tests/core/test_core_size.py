"""The core stays small (issue 11's aim, DESIGN §3): machinery that is not a contract, the stage template, the
pipeline, the bundle or the runtime belongs in topq/ir, topq/io, topq/quant or topq/models."""

from __future__ import annotations

from pathlib import Path

import topq.core

CORE_LINE_LIMIT = 3500


def test_core_is_at_most_3500_lines() -> None:
    files = sorted(Path(topq.core.__file__).parent.glob("*.py"))
    lines = {f.name: len(f.read_text(encoding="utf-8").splitlines()) for f in files}
    total = sum(lines.values())
    largest = ", ".join(f"{name} {n}" for name, n in sorted(lines.items(), key=lambda kv: -kv[1])[:5])
    assert total <= CORE_LINE_LIMIT, f"topq/core is {total} lines (limit {CORE_LINE_LIMIT}); largest: {largest}"
