#!/usr/bin/env bash
# The main job: convert the embedded SmolLM2-135M GGUF with a recipe and answer a prompt — on the host
# reference interpreter, then as a W4BF16 BM1684X bundle on the chip's emulator with its predicted speed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
topq plugins
topq convert recipes/smollm2-host.yaml
topq run out/smollm2-host.topq --chat --prompt "What is the capital of France?" --max-new-tokens 40
topq convert recipes/smollm2-bm1684x-w4bf16.yaml
topq run out/smollm2-bm1684x-w4bf16.topq --chat --prompt "What is the capital of France?" --max-new-tokens 40
topq inspect out/smollm2-bm1684x-w4bf16.topq > out/smollm2-bm1684x-w4bf16.inspect.txt
sed -n '1,6p' out/smollm2-bm1684x-w4bf16.inspect.txt
grep -A 3 "DDR plan" out/smollm2-bm1684x-w4bf16.inspect.txt
grep "^predicted" out/smollm2-bm1684x-w4bf16.inspect.txt
echo "(full report with per-op predicted times: out/smollm2-bm1684x-w4bf16.inspect.txt)"
