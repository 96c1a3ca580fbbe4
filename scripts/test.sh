#!/usr/bin/env bash
# Set up and run the test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# TPU-MLIR (its own CPython 3.10 venv) for the export integration tests: about 3.5 minutes the first time
# (most of it fetching the 312 MB wheel), about 10 s once set up (it re-checks that the tools start).
TOPQ_TPU_MLIR="$(bash scripts/setup-tpu-mlir.sh | tail -n 1)"
export TOPQ_TPU_MLIR
python -m pytest -q "$@"
