"""Where the tests find the repository, their data files and the shared text corpus."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
#: Hugging Face config.json files of published models (perf-model fixtures).
CONFIGS = TESTS / "data" / "configs"
# shared/ sits beside the repository (here /work/shared; in CI beside the fresh clone).
AUSTEN = REPO.parent / "shared" / "data" / "austen"
