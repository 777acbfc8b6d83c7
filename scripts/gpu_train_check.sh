#!/usr/bin/env bash
# One expert trained briefly with vLLM generation on a GPU machine, in 8 minutes at most.
# Needs the `vllm` and `train` extras. Usage: scripts/gpu_train_check.sh [MODEL_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
timeout 480 env PYTHONPATH=. "$PY" scripts/gpu_train_check.py "$@"
