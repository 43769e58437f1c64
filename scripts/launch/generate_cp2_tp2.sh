#!/usr/bin/env bash
# megacp generation with CP=2 x TP=2 on 4 GPUs (NCCL) through the DeepSpeed launcher.
# Extra arguments go to `python -m megacp.generate` and must include --model (heads divisible by 2).
# NUM_GPUS / CONFIG override the defaults
# (NUM_GPUS must be a multiple of 4 for this config; the rest becomes data parallel).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
# shellcheck source=port.sh
source "${ROOT}/scripts/launch/port.sh"
# NVLink multicast (NVLS) stays off, as in scripts/run_main_job.sh.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
case " $* " in
  *" --model "*|*" --model="*) ;;
  *) echo "generate_cp2_tp2.sh needs --model: TP=2 splits the heads, and the default model" \
          "(SmolLM2-135M, 9 heads / 3 KV heads) cannot be split in two" >&2; exit 2 ;;
esac
exec deepspeed --num_gpus "${NUM_GPUS:-4}" --master_port "$(job_port)" --module megacp.generate \
    --deepspeed_config "${CONFIG:-${ROOT}/configs/cp2_tp2.json}" "$@"
