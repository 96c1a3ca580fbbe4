#!/usr/bin/env bash
# Static checks (CI runs them before the tests): style (ruff), types of the layers below the plugins (mypy, on
# what [tool.mypy] lists) and the layering contracts (import-linter). Configuration: pyproject.toml.
# Needs the `lint` extra (scripts/setup.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check topq tests benchmarks examples
mypy
lint-imports
