#!/usr/bin/env bash
# Set up and run the test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# TPU-MLIR (its own CPython 3.10 venv) for the export integration tests, with what its llm_convert.py needs
# (torch, transformers, GNU parallel) for the comparisons with TPU-MLIR's own converter: about 5 minutes and
# 6.0 GB the first time, about 10 s once set up (it re-checks that the tools start).
TOPQ_TPU_MLIR="$(TOPQ_TPU_MLIR_LLM_CONVERT=1 bash scripts/setup-tpu-mlir.sh | tail -n 1)"
export TOPQ_TPU_MLIR
python -m pytest -q "$@"
