#!/usr/bin/env bash
# The main job: CP=2 generation with the default model (SmolLM2-135M-Instruct GGUF).
# NCCL on a machine with 2+ GPUs (deepspeed launcher, configs/cp2.json), else gloo on CPU (torchrun).
# Extra arguments go to megacp.generate, e.g. --prompt "..." --max-new-tokens 64.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--chat --prompt "What is context parallelism? Answer in two sentences." --max-new-tokens 48)
if command -v nvidia-smi >/dev/null 2>&1 && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  exec deepspeed --num_gpus 2 --module megacp.generate --deepspeed_config configs/cp2.json "${ARGS[@]}"
fi
export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=  # gloo on CPU, also on a machine with one GPU
exec "${PYTHON:-python3}" -m torch.distributed.run --nproc_per_node 2 --master_port "${MASTER_PORT:-29517}" \
  -m megacp.generate --deepspeed_config configs/cpu_demo.json "${ARGS[@]}"
