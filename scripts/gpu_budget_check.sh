#!/usr/bin/env bash
# The rollout-budget ablation (issue #20) on a GPU machine, in 8 minutes at most: two GRPO runs
# of the same budget (the tool_call_format expert, GRPO on the retail target), snapshots at
# 32/128/all rollouts, each evaluated greedily on 48 retail test tasks and 32 held-out seeds.
# Needs the `train` extra. Usage: scripts/gpu_budget_check.sh [--model DIR] [--out DIR] [--budget N]
# A copy of the embedded GGUF carried to the machine in parts must hash to (sha256):
#   b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# On an offline machine with transformers >= 5.2x, set USE_HUB_KERNELS=NO (the script does).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
timeout 480 env PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 "$PY" scripts/gpu_budget_check.py "$@"
