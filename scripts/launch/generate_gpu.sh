#!/usr/bin/env bash
# megacp generation with CP=2 on 2 GPUs (NCCL) through the DeepSpeed launcher.
# Extra arguments go to `python -m megacp.generate`. NUM_GPUS / CONFIG override the defaults.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
# NVLink multicast (NVLS) stays off, as in scripts/run_main_job.sh.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
exec deepspeed --num_gpus "${NUM_GPUS:-2}" --module megacp.generate \
    --deepspeed_config "${CONFIG:-${ROOT}/configs/cp2.json}" "$@"
