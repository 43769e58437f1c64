#!/usr/bin/env bash
# megacp generation with CP=2 on 2 GPUs (NCCL) through the DeepSpeed launcher.
# Extra arguments go to `python -m megacp.generate`. NUM_GPUS / CONFIG / MASTER_PORT override the defaults (default port: a free one).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
# shellcheck source=port.sh
source "${ROOT}/scripts/launch/port.sh"
# NVLink multicast (NVLS) stays off, as in scripts/run_main_job.sh.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
exec deepspeed --num_gpus "${NUM_GPUS:-2}" --master_port "$(job_port)" --module megacp.generate \
    --deepspeed_config "${CONFIG:-${ROOT}/configs/cp2.json}" "$@"
