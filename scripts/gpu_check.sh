#!/usr/bin/env bash
# Everything issue 34 checks on a GPU, in one command for one device call
# (the device tool lends a machine for minutes, not hours):
#
#   here:            ../shared/device/stage.sh
#   device machine:  bash scripts/gpu_check.sh        (with .gpu carried)
#   or, built here:  scripts/gpu_carried.sh build, then on the machine
#                    scripts/gpu_carried.sh check     (build-gpu-slim carried)
#
# 1. builds what the checks need (bash .gpu/build.sh: /tmp/gpu-build), unless
#    GPU_BUILD_DIR names a build made elsewhere against the same torch (the
#    build then costs no device time: scripts/gpu_carried.sh);
# 2. ctest -L cuda: the GPU tests, each reported passed, failed or skipped by
#    name, unless GPU_CHECK_TESTS=0;
# 3. train_gpt --device cuda --bf16 at 1 rank and at 2 ranks sharing the GPU,
#    and at 1 rank offloaded, stepping during backward,
#    unless GPU_CHECK_TRAIN=0;
# 4. bench/gpu_step.sh (ROUNDS, default 1; CONFIGS picks configurations;
#    at most GPU_CHECK_BENCH_LIMIT seconds, 300) unless GPU_CHECK_BENCH=0;
# 5. with LARGEST_WAYS set, bench/largest_gpu_model.sh for those ways (their
#    rungs from LADDER_<way>; 1 + LARGEST_STEPS (2) AdamW steps; RUN_TIMEOUT
#    passes through), its lines appended to $OUT/largest.jsonl (seed it with
#    earlier calls' lines: LARGEST_SEED, a file) and each attempt's output
#    kept in $OUT/largest-logs.
# Each step's log goes to $OUT (the device tool brings it back) or
# /tmp/gpu-check; a step that fails is reported and the next one still runs.
# GPU_CHECK_DEADLINE (seconds) bounds all the steps together. The exit status
# is the number of failed steps.
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
build=${GPU_BUILD_DIR:-/tmp/gpu-build}
failed=0
deadline=${GPU_CHECK_DEADLINE:-100000} # seconds for all the steps (a device call's limit)
step() {
  local name=$1 limit=$2
  shift 2
  ((limit <= deadline - SECONDS)) || limit=$((deadline - SECONDS))
  if ((limit < 10)); then
    echo "gpu_check: $name: not run (GPU_CHECK_DEADLINE reached)"
    failed=$((failed + 1))
    return
  fi
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  echo "gpu_check: $name: status $rc in $((SECONDS - t0)) s; last lines:"
  tail -n 15 "$out/$name.log" | sed 's/^/  /'
  ((rc == 0)) || failed=$((failed + 1))
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/gpu.txt" 2>&1
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "nccl", ".".join(map(str, torch.cuda.nccl.version())))' >>"$out/gpu.txt" 2>&1
# The host the offloaded step's AdamW runs on: its cores and memory nodes,
# which bound that step (docs/benchmarks.md, the fourth run).
{ nproc; lscpu | grep -iE 'model name|socket|numa'; free -g | head -2; } >>"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
if [[ -z ${GPU_BUILD_DIR:-} ]]; then
  step build 300 bash .gpu/build.sh comm_tests core_tests state_tests train_gpt fsdprun bench_gpu_step
fi
if [[ ${GPU_CHECK_TESTS:-1} != 0 ]]; then
  step ctest_cuda 180 ctest --test-dir "$build" -L cuda -j "${GPU_CHECK_JOBS:-3}" --output-on-failure
  # torchrun's --nproc-per-node gpu: fsdprun asks the CUDA driver (libcuda.so.1).
  step fsdprun_nproc_gpu 60 "$build/bin/fsdprun" --nproc-per-node gpu "$build/bin/train_gpt" \
    --steps 2 --eval-interval 2 --device cuda
fi
data=(--steps 30 --eval-interval 10 --bf16 --device cuda)
if [[ ${GPU_CHECK_TRAIN:-1} != 0 ]]; then
  step train_gpt_1rank 60 "$build/bin/train_gpt" "${data[@]}"
  step train_gpt_2ranks 90 "$build/bin/fsdprun" --nproc-per-node 2 "$build/bin/train_gpt" "${data[@]}"
  step train_gpt_offload_during_backward 60 "$build/bin/train_gpt" "${data[@]}" --cpu-offload \
    --step-during-backward --grad-clip 0
fi
if [[ ${GPU_CHECK_BENCH:-1} != 0 ]]; then
  step gpu_step "${GPU_CHECK_BENCH_LIMIT:-300}" env ROUNDS="${ROUNDS:-1}" PYTHON=python3 BENCH_KEEP_GOING=1 \
    RUN_TIMEOUT="${RUN_TIMEOUT:-90}" bench/gpu_step.sh "$build"
fi
if [[ -n ${LARGEST_WAYS:-} ]]; then
  [[ -z ${LARGEST_SEED:-} ]] || grep '"way"' "$LARGEST_SEED" >>"$out/largest.jsonl"
  step largest 100000 env WAYS="$LARGEST_WAYS" RESULTS="$out/largest.jsonl" LOGS="$out/largest-logs" \
    STEPS="${LARGEST_STEPS:-2}" WARMUP=1 PYTHON=python3 bench/largest_gpu_model.sh "$build"
fi
echo "gpu_check: $failed step(s) failed"
exit "$failed"
