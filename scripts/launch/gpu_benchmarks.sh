#!/usr/bin/env bash
# The GPU run: megacp exactness checks (tests/programs/gpu_verify.py), prefill and decode benchmarks
# (scripts/bench/, with the peers), logs and JSON into $OUT. One command line on the GPU machine, from the repository root:
#
#   bash scripts/launch/gpu_benchmarks.sh [PART ...]
#
# PART: verify | prefill | decode | all (= verify prefill decode, the default)
#       breakdown — per-rank prefill time split, clock and power (scripts/diagnostics/prefill_breakdown.py; GPU only)
#       profile — GPU timeline of one pass-KV call per transport (scripts/diagnostics/profile_prefill.py; GPU only)
#       quick   — small sizes everywhere (a wiring test, ~1-2 min with TE's build, less without)
#       nocheck — the benchmarks without their --check comparisons
# Environment: NPROC (GPUs, default 2), OUT (default ./out/gpu), VERIFY_ARGS / PREFILL_ARGS /
#   DECODE_ARGS / BREAKDOWN_ARGS / PROFILE_ARGS (extra arguments appended to that program), T_VERIFY / T_PREFILL /
#   T_DECODE / T_BREAKDOWN / T_PROFILE (time limits in s, default 300 / 420 / 240 / 150 / 60 per
#   transport), BREAKDOWN_SEQLENS (16K,64K), PROFILE_SEQLEN (64K), PROFILE_TRANSPORTS ("nccl copy_engine"),
#   DEVICE=cpu (gloo smoke test of this script, small sizes).
# Carried, optional: .whl/*.whl (DeepSpeed and its pure-Python dependencies, installed into
#   /tmp/site), .tecarry/te (Transformer Engine packed for the GPU machine, docs/GPU_FACTS.md; its first use
#   on a fresh machine builds an extension for ~2 min and leaves the wheel in $OUT: put it in .tecarry/te/built/).
# Exit status: non-zero when any part failed (a failed check, a crash or a time-out).
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/gpu}
mkdir -p "$OUT"
NPROC=${NPROC:-2}
DEVICE=${DEVICE:-cuda}

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TORCH_NCCL_ASYNC_ERROR_HANDLING=1

parts=() ; quick=0 ; check=1
for a in "$@"; do
  case "$a" in
    all) parts+=(verify prefill decode) ;;
    verify|prefill|decode|breakdown|profile) parts+=("$a") ;;
    quick) quick=1 ;;
    nocheck) check=0 ;;
    *) echo "unknown part '$a' (verify|prefill|decode|breakdown|profile|all|quick|nocheck)" >&2; exit 2 ;;
  esac
done
[ ${#parts[@]} -eq 0 ] && parts=(verify prefill decode)

{
  echo "== $(date -u +%FT%TZ) parts: ${parts[*]} quick=$quick check=$check nproc=$NPROC device=$DEVICE"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch,sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
} 2>&1 | tee "$OUT/env.log"

if [ "$DEVICE" = cuda ]; then
  # DeepSpeed (and hjson, pydantic, ... ) as carried wheels
  if compgen -G ".whl/*.whl" >/dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1; then
      export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"; echo "wheels installed into /tmp/site: $(ls .whl | tr '\n' ' ')"
    else
      echo "wheel install failed (see pip.log): DeepSpeed will be skipped"; tail -5 "$OUT/pip.log"
    fi
  else
    echo "no .whl/: DeepSpeed will be skipped unless the image has it"
  fi
  # Transformer Engine
  if [ -f .tecarry/te/device_setup.sh ] && [[ " ${parts[*]} " == *" prefill "* ]]; then
    t0=$SECONDS
    # shellcheck disable=SC1091
    source .tecarry/te/device_setup.sh > >(tee "$OUT/te_setup.log") 2>&1 || echo "TE setup failed (te_setup.log): TE will be skipped"
    echo "TE setup took $((SECONDS - t0)) s"
  fi
fi

sizes_verify=() ; sizes_prefill=() ; sizes_decode=() ; devargs=()
if [ "$DEVICE" = cpu ]; then
  devargs=(--device cpu --dtype float32 --heads 8 --kv-heads 2 --head-dim 32)
  quick=1
fi
if [ $quick = 1 ]; then
  sizes_verify=(--seqlens 1K,4K --ragged 2K:1K,0:3K,500:1,700:333 --decode 8K:3,1:0,3001:7 --decode-batched 2:8K --rows 32)
  sizes_prefill=(--seqlens 4K,8K --max-iters 5 --target-s 0.3)
  sizes_decode=(--batches 1,2 --lengths 8K,16K --max-iters 20 --target-s 0.1)
  [ "$DEVICE" = cpu ] && sizes_verify=(--seqlens 256,512 --ragged 64:32,0:48,40:1,50:17 --decode 300:5,1:0 --decode-batched 2:256 --rows 16) \
    && sizes_prefill=(--seqlens 256,512 --max-iters 3 --target-s 0.1) && sizes_decode=(--batches 1,2 --lengths 1K,2K --max-iters 5 --target-s 0.05)
fi
checkarg=() ; [ $check = 1 ] && checkarg=(--check)

status=0
run_part() {  # name, time limit, module, args...  (run from the repository root: python -m <module>)
  local name=$1 limit=$2 module=$3; shift 3
  echo; echo "== $name: torchrun --nproc_per_node $NPROC -m $module $* (limit ${limit}s)"
  local t0=$SECONDS
  timeout -k 15 "$limit" torchrun --standalone --nproc_per_node "$NPROC" -m "$module" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 124 ] && echo "== $name: TIMED OUT (partial JSON kept)"
  [ "$rc" -ne 0 ] && status=1
  echo "$name $rc $((SECONDS - t0))" >> "$OUT/parts.txt"
}

for p in "${parts[@]}"; do
  case $p in
    # shellcheck disable=SC2086
    verify)  run_part verify "${T_VERIFY:-300}" tests.programs.gpu_verify ${devargs[@]+"${devargs[@]}"} ${sizes_verify[@]+"${sizes_verify[@]}"} --json "$OUT/verify.json" ${VERIFY_ARGS:-} ;;
    # shellcheck disable=SC2086
    prefill) run_part prefill "${T_PREFILL:-420}" scripts.bench.prefill ${devargs[@]+"${devargs[@]}"} ${sizes_prefill[@]+"${sizes_prefill[@]}"} ${checkarg[@]+"${checkarg[@]}"} --json "$OUT/prefill.json" ${PREFILL_ARGS:-} ;;
    # shellcheck disable=SC2086
    breakdown) [ "$DEVICE" = cpu ] && { echo "breakdown: GPU only, skipped"; continue; }
             # shellcheck disable=SC2086
             run_part breakdown "${T_BREAKDOWN:-150}" scripts.diagnostics.prefill_breakdown --seqlens "${BREAKDOWN_SEQLENS:-16K,64K}" ${BREAKDOWN_ARGS:-} ;;
    profile) [ "$DEVICE" = cpu ] && { echo "profile: GPU only, skipped"; continue; }
             for tr in ${PROFILE_TRANSPORTS:-nccl copy_engine}; do
               # shellcheck disable=SC2086
               run_part "profile_$tr" "${T_PROFILE:-60}" scripts.diagnostics.profile_prefill --seqlen "${PROFILE_SEQLEN:-64K}" --transport "$tr" ${PROFILE_ARGS:-}
             done ;;
    # shellcheck disable=SC2086
    decode)  run_part decode "${T_DECODE:-240}" scripts.bench.decode ${devargs[@]+"${devargs[@]}"} ${sizes_decode[@]+"${sizes_decode[@]}"} ${checkarg[@]+"${checkarg[@]}"} --json "$OUT/decode.json" ${DECODE_ARGS:-} ;;
  esac
done

echo; echo "== done (status $status); files in $OUT:"; ls -la "$OUT"
exit $status
