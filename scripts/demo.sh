#!/usr/bin/env bash
# The main job: convert the embedded SmolLM2-135M GGUF with a recipe and answer a prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
topq plugins
topq convert recipes/smollm2-host.yaml
topq run out/smollm2-host.topq --chat --prompt "What is the capital of France?" --max-new-tokens 40
