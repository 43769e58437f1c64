#!/usr/bin/env bash
# megacp generation with CP=2 on 2 GPUs (NCCL) through the DeepSpeed launcher.
# Extra arguments go to `python -m megacp.generate`. NUM_GPUS / CONFIG override the defaults.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
exec deepspeed --num_gpus "${NUM_GPUS:-2}" --module megacp.generate \
    --deepspeed_config "${CONFIG:-${ROOT}/configs/cp2.json}" "$@"
