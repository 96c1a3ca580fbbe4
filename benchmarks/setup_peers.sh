#!/usr/bin/env bash
# The peers of benchmarks/quant_speed.py in a Python of their own (.venv-peers): llm-compressor pins another
# transformers than topq's, so it cannot share topq's environment. torch is the CPU wheel topq's setup uses,
# installed first so that pip never resolves a CUDA build. Not needed by topq or its tests.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-peers
[ -x "$venv/bin/python" ] || python3.11 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q "llmcompressor==0.14.0.1" "gguf>=0.10,<1"  # brings auto-round 0.15 and transformers 5.17
"$venv/bin/python" -c "import llmcompressor, auto_round; print('peers:', llmcompressor.__version__, auto_round.__version__)"
