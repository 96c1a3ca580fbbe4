#!/usr/bin/env bash
# Set up TPU-MLIR 1.30.2 for `topq export tpu-mlir --tpu-mlir PYTHON` in a CPython 3.10 venv of its own
# (TPU-MLIR requires Python 3.10; topq runs on 3.11, so the two never share an interpreter).
#
#   bash scripts/setup-tpu-mlir.sh [VENV]     # default VENV: .venv-tpu-mlir in the repository
#   TOPQ_TPU_MLIR_LLM_CONVERT=1 bash scripts/setup-tpu-mlir.sh [VENV]   # + what llm_convert.py needs (torch ...)
#
# Prints the venv's python on the last line (pass it as --tpu-mlir or TOPQ_TPU_MLIR). Idempotent: a venv that
# already passes the final check is left alone, so a second run takes about a second.
#
# Only what the deploy path (model_deploy.py, model_runner.py, model_tool) imports is installed: the wheel's own
# requirements pull in transformers, torch-free but heavy packages (scikit-image, pandas, pycocotools ...) that
# this path never imports, so the wheel goes in with --no-deps and its needed pins are listed below.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:-.venv-tpu-mlir}"
TPU_MLIR_VERSION="1.30.2"
# Pins from the wheel's metadata (numpy, Pillow, plotly; opencv 4.8.0.74 is yanked for .76) and from the issue (flatbuffers); psutil and
# filelock are imported by mlir_shell.py / the cache tool but not declared by the wheel.
DEPS=(
  "numpy==1.24.3"
  "Pillow==10.0.0"
  "plotly==5.15.0"
  "opencv-python-headless==4.8.0.76"
  "flatbuffers==24.12.23"
  "psutil"
  "filelock"
  "tqdm==4.65.0"
)

find_python310() {
  # pyenv's shims answer `python3.10` even when no 3.10 is selected, so each candidate must really run as 3.10.
  local candidate
  for candidate in "${TOPQ_PYTHON310:-}" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10.*/bin/python3.10 \
                   "$(command -v python3.10 || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] \
       && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

# TPU-MLIR's own LLM converter (llm_convert.py: tests/targets/bm1684x/test_tpu_mlir_llm_convert.py,
# benchmarks/llm_convert_gptq.py, benchmarks/tpumlir_side_by_side.py) imports torch and transformers and runs its
# model_deploy.py jobs through GNU parallel. PyPI has no CPU-only torch wheel for CPython 3.10: the default one is
# a CUDA build whose nvidia-* libraries come along (the venv grows from 1.3 GB to 6.0 GB; measured here, the whole
# setup took 5.0 min with them and 4.9 min without: the downloads are mostly local). scripts/test.sh asks for it.
# torch pulls in a setuptools without pkg_resources, which tpu_mlir/__init__.py imports: hence the setuptools pin.
LLM_CONVERT="${TOPQ_TPU_MLIR_LLM_CONVERT:-0}"
LLM_CONVERT_DEPS=("torch==2.13.0" "transformers==5.6.2")

check() {
  # model_deploy.py and model_runner.py import the whole deploy path; model_tool is the C++ combiner.
  "$VENV/bin/model_deploy.py" --help >/dev/null 2>&1 \
    && "$VENV/bin/model_runner.py" --help >/dev/null 2>&1 \
    && { "$VENV/bin/model_tool" 2>&1 || true; } | grep -q -- "--combine" \
    && { [ "$LLM_CONVERT" != 1 ] || { command -v parallel >/dev/null && "$VENV/bin/llm_convert.py" --help >/dev/null 2>&1; }; }
}

if [ -x "$VENV/bin/python" ] && check; then
  echo "$(cd "$VENV" && pwd)/bin/python"
  exit 0
fi

PY310="$(find_python310)" || { echo "error: CPython 3.10 not found (install it or set TOPQ_PYTHON310)" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PY310" -m venv "$VENV"

# A wheel already downloaded (TOPQ_TPU_MLIR_WHEEL=path) saves fetching 312 MB again; pip's cache does too.
WHEEL="${TOPQ_TPU_MLIR_WHEEL:-}"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "${WHEEL:-tpu-mlir==$TPU_MLIR_VERSION}"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${DEPS[@]}"
if [ "$LLM_CONVERT" = 1 ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${LLM_CONVERT_DEPS[@]}"
  # a separate step: torch declares setuptools>=77, pip only warns about the downgrade this way
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "setuptools<70"
  if ! command -v parallel >/dev/null && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq parallel; } >/dev/null \
      || echo "warning: could not install GNU parallel with apt-get" >&2
  fi
  command -v parallel >/dev/null || { echo "error: GNU parallel not found; llm_convert.py needs it (Debian: apt-get install parallel)" >&2; exit 1; }
fi

# The wheel ships its own glibc pieces for old distributions; loaded next to Debian's newer glibc they crash
# every TPU-MLIR binary (tpuc-opt, model_tool, pymlir), so the system's copies must be used.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -f "$SITE/tpu_mlir/lib/third_party/libc.so.6" "$SITE/tpu_mlir/lib/third_party/libm.so.6" \
      "$SITE/tpu_mlir/lib/third_party/libpthread.so.0"

if ! check; then
  echo "error: TPU-MLIR in $VENV does not run; try: $VENV/bin/model_deploy.py --help" >&2
  exit 1
fi
echo "$(cd "$VENV" && pwd)/bin/python"
