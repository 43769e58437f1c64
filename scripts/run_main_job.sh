#!/usr/bin/env bash
# The main job: CP=2 generation with the default model (SmolLM2-135M-Instruct GGUF).
# NCCL on a machine with 2+ GPUs (deepspeed launcher, configs/cp2.json), else gloo on CPU (torchrun).
# Extra arguments go to megacp.generate, e.g. --prompt "..." --max-new-tokens 64.
# scripts/setup_env.sh runs only when the environment was not set up from this setup.py,
# setup_env.sh and requirements/constraints.txt yet (a stamp of their hash next to the installed packages), under a lock so that
# concurrent jobs do not install at once. Each job takes a free port unless MASTER_PORT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
STAMP="$SITE/megacp-setup.stamp"
WANT=$(cat setup.py scripts/setup_env.sh requirements/constraints.txt | sha256sum | cut -d' ' -f1)
ready() {  # the stamp matches and megacp imports from this checkout
  [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] &&
    $PY -c 'import os, sys, megacp; sys.exit(not os.path.realpath(megacp.__file__).startswith(sys.argv[1] + os.sep))' \
      "$(pwd -P)" 2>/dev/null
}
if ! ready; then
  exec 9>"${TMPDIR:-/tmp}/megacp-setup-$(id -u).lock"
  flock 9
  if ! ready; then  # another job may have finished the setup while this one waited
    bash scripts/setup_env.sh
    echo "$WANT" > "$STAMP"
  fi
  flock -u 9
fi
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--chat --prompt "What is context parallelism? Answer in two sentences." --max-new-tokens 48)
# shellcheck source=launch/port.sh
source scripts/launch/port.sh
PORT=$(PYTHON=$PY job_port)
if command -v nvidia-smi >/dev/null 2>&1 && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  exec deepspeed --num_gpus 2 --master_port "$PORT" --module megacp.generate --deepspeed_config configs/cp2.json "${ARGS[@]}"
fi
export CUDA_VISIBLE_DEVICES=  # gloo on CPU, also on a machine with one GPU
exec "$PY" -m torch.distributed.run --nproc_per_node 2 --master_port "$PORT" \
  -m megacp.generate --deepspeed_config configs/cpu_demo.json "${ARGS[@]}"
