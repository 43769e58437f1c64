#!/usr/bin/env bash
# megacp generation with CP=2 on 2 CPU processes (gloo): the DeepSpeed launcher with its CPU
# accelerator when deepspeed is installed, torchrun otherwise.
# Extra arguments go to `python -m megacp.generate`. NPROC / CONFIG / MASTER_PORT override the defaults
# (default port: a free one).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
# shellcheck source=port.sh
source "${ROOT}/scripts/launch/port.sh"
CONFIG="${CONFIG:-${ROOT}/configs/cpu_demo.json}"
NPROC="${NPROC:-2}"
PORT="$(job_port)"
export CUDA_VISIBLE_DEVICES=  # CPU processes even on a GPU host (megacp picks NCCL when it sees a GPU)
if command -v deepspeed >/dev/null 2>&1; then
    DS_ACCELERATOR=cpu exec deepspeed --num_gpus "${NPROC}" --master_port "${PORT}" \
        --module megacp.generate --deepspeed_config "${CONFIG}" "$@"
else
    exec torchrun --nproc_per_node "${NPROC}" --master_port "${PORT}" \
        -m megacp.generate --deepspeed_config "${CONFIG}" "$@"
fi
