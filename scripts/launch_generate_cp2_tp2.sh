#!/usr/bin/env bash
# megacp generation with CP=2 x TP=2 on 4 GPUs (NCCL) through the DeepSpeed launcher.
# Extra arguments go to `python -m megacp.generate`. NUM_GPUS / CONFIG override the defaults
# (NUM_GPUS must be a multiple of 4 for this config; the rest becomes data parallel).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NUM_GPUS="${NUM_GPUS:-4}" CONFIG="${CONFIG:-${ROOT}/configs/cp2_tp2.json}" exec "${ROOT}/scripts/launch_generate_gpu.sh" "$@"
