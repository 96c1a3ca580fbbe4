"""Compare two `pytest --bundle-digests FILE` maps: every bundle of the first run must be in the second, unchanged.

    python scripts/compare_bundle_digests.py BEFORE.json AFTER.json

A bundle is matched by its path under the session's temp dir (derived from the test's name); the file's sha256 must
be equal (the same --basetemp in both runs), or, when the temp root differs, its path-normalised content digest.
Exit 1 when a bundle changed or went missing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(before_file: str, after_file: str) -> int:
    before = json.loads(Path(before_file).read_text())
    after = json.loads(Path(after_file).read_text())
    changed = [p for p in before if p in after and before[p]["sha256"] != after[p]["sha256"]
               and before[p]["content"] != after[p]["content"]]
    missing = [p for p in before if p not in after]
    for p in changed:
        print(f"changed: {p}")
    for p in missing:
        print(f"missing: {p}")
    same = len(before) - len(changed) - len(missing)
    print(f"{same} of {len(before)} bundles identical; {len(changed)} changed, {len(missing)} missing, "
          f"{len(set(after) - set(before))} new")
    return 1 if changed or missing else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
