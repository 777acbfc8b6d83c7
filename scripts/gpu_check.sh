#!/usr/bin/env bash
# The vLLM path against a real vLLM on a GPU machine, in 8 minutes at most.
# Needs the `vllm` extra. Usage: scripts/gpu_check.sh [MODEL_DIR]  (default: SmolLM2-135M)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
timeout 480 env PYTHONPATH=. "$PY" scripts/gpu_check.py "$@"
