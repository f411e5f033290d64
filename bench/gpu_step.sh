#!/usr/bin/env bash
# Issue 34, item 8: a GPT-2-small-like training step on one GPU, in one run
# with the rounds interleaved: plain LibTorch, libfsdp FULL_SHARD and NO_SHARD
# at world 1, libfsdp FULL_SHARD at 2 ranks sharing the GPU (staged through
# the host, and over CUDA IPC), and PyTorch (the same torch's Python) plain,
# FSDP2 and FSDP1 FULL_SHARD at world 1. One JSON line per configuration and
# round, then a summary line:
#
#   bench/gpu_step.sh [BUILD]      (BUILD: a build with bench_gpu_step and fsdprun)
#
# Environment: ROUNDS (3), STEPS (10), WARMUP (3), PRECISION (bf16 or fp32),
# MODEL_ARGS (default: 12 blocks x 768, 12 heads, seq 1024, batch 8, vocab
# 50304: 163 M parameters), DEVICE (cuda; cpu only to check the script on a
# machine without a GPU, with small MODEL_ARGS), PEAK_TFLOPS (989: an H100
# SXM's dense bf16, for MFU), PYTHON (a Python with torch), RUN_TIMEOUT (s),
# CONFIGS (the configurations to run, by name; default all).
# Summary ratios: libfsdp FULL_SHARD's step over plain LibTorch's (target
# <= 1.05), PyTorch FSDP2's and FSDP1's over PyTorch plain, and at 2 ranks on
# one GPU each rank's parameters + gradients + AdamW state (state_bytes) and
# GPU peak over world 1's (target <= 0.55 for the state); the 2-rank step
# with the ranks' collectives over CUDA IPC over the one staged through the
# host (Note [Ranks sharing a GPU]). With CPU offload
# (issue 35, item 3): FULL_SHARD at world 1 with the host's FusedAdamW after
# backward and beside it; the step beside backward over the largest of its
# parts alone (forward+backward, host optimizer, PCIe copies, measured in the
# offload-after run; target <= 1.15), also with GPT-mini's output head as a
# unit of its own (its gradient stepped on the host while backward goes on),
# and that again with each gradient stepped only once it has landed whole
# instead of part by part as it lands: the parts' step over that one's; and
# with each gradient's copy to the host queued by the optimizer's thread
# instead of at the hand-over: the hand-over's step over that one's; for
# each configuration stepping beside backward, where the optimizer's thread
# spent each step (listener_ms: see bench_gpu_step.cpp's header), and for
# two of them the last step's timeline (trace_ms, --trace); the offloaded
# step beside backward at 2 ranks sharing the GPU over CUDA IPC (issue 35,
# item 3's N ranks), and at 1 with the root unit (the token embedding) kept
# on the GPU, each over the largest of its own parts alone.
# FULL_SHARD and both offloads again with everything on the compute stream
# (FSDP_SIDE_STREAMS=0): the side streams' step over that one's.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-build}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
PRECISION=${PRECISION:-bf16}
DEVICE=${DEVICE:-cuda}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
MODEL_ARGS=${MODEL_ARGS:---blocks 12 --d-model 768 --heads 12 --seq 1024 --batch 8 --vocab 50304}
RUN_TIMEOUT=${RUN_TIMEOUT:-600}
PYTHON=${PYTHON:-}
if [[ -z $PYTHON ]]; then
  if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
source "$ROOT/bench/json_lines.sh"
need_executables "$BUILD" fsdprun bench_gpu_step

results=$(mktemp)
trap 'rm -f "$results"' EXIT
sizes=($MODEL_ARGS)
common=(--steps "$STEPS" --warmup "$WARMUP" --precision "$PRECISION" "${sizes[@]}")
ours=(timeout "$RUN_TIMEOUT" "$BUILD/bin/bench_gpu_step" --device "$DEVICE" --peak-tflops
      "$PEAK_TFLOPS" "${common[@]}")
two=(timeout "$RUN_TIMEOUT" "$BUILD/bin/fsdprun" --nproc-per-node 2 "$BUILD/bin/bench_gpu_step"
     --device "$DEVICE" --peak-tflops "$PEAK_TFLOPS" "${common[@]}")
theirs=(timeout "$RUN_TIMEOUT" "$PYTHON" "$ROOT/bench/pytorch_step.py" step --nproc 1
        --device "$DEVICE" "${common[@]}")

# One configuration's round, unless CONFIGS leaves it out.
run() {
  local config=$1 round=$2
  shift 2
  [[ -z ${CONFIGS:-} || " $CONFIGS " == *" $config "* ]] || return 0
  json_lines "$results" "\"config\":\"$config\",\"round\":$round," "$@"
}
for ((round = 0; round < ROUNDS; ++round)); do
  run libtorch_plain "$round" "${ours[@]}" --mode local
  run libfsdp_full_shard "$round" "${ours[@]}" --mode full_shard
  run libfsdp_no_shard "$round" "${ours[@]}" --mode no_shard
  run libfsdp_full_shard_2ranks "$round" env FSDP_CUDA_BACKEND=staged "${two[@]}" --mode full_shard
  run libfsdp_full_shard_2ranks_ipc "$round" env FSDP_CUDA_BACKEND=ipc "${two[@]}" \
    --mode full_shard
  run libfsdp_offload_after "$round" "${ours[@]}" --mode full_shard --offload after
  run libfsdp_offload_during "$round" "${ours[@]}" --mode full_shard --offload during
  run libfsdp_offload_during_head_unit "$round" "${ours[@]}" --mode full_shard --offload during \
    --head-unit 1 --trace 1
  # The same, each unit's gradient stepped only once it has landed whole
  # (Note [Stepping a gradient as it lands]).
  run libfsdp_offload_during_head_unit_whole "$round" env FSDP_GRAD_PART_ELEMENTS=0 "${ours[@]}" \
    --mode full_shard --offload during --head-unit 1
  # The same, each gradient's copy to host memory queued by the optimizer's
  # thread once it reaches it, not at the hand-over (Note [Copies queued at
  # the hand-over]).
  run libfsdp_offload_during_head_unit_listener_copies "$round" env FSDP_COPY_AT_HAND_OVER=0 \
    "${ours[@]}" --mode full_shard --offload during --head-unit 1 --trace 1
  # The same with the root unit (the token embedding) kept on the GPU and
  # stepped there: the host's step after backward gone.
  run libfsdp_offload_during_head_unit_root_on_gpu "$round" "${ours[@]}" --mode full_shard \
    --offload during --head-unit 1 --offload-root 0 --trace 1
  # The same as the head-unit one, the reduced gradients kept in bf16
  # (MixedPrecision::keep_low_precision_grads): half the bytes to host
  # memory, 2 bytes an element fewer for the host AdamW to read.
  run libfsdp_offload_during_head_unit_bf16_grads "$round" "${ours[@]}" --mode full_shard \
    --offload during --head-unit 1 --keep-low-precision-grads 1 --trace 1
  # The same as the head-unit one, the root's compute copy sent to the GPU
  # only by the next forward's unshard, not as its step writes it (Note
  # [Copy-in at the step]).
  run libfsdp_offload_during_head_unit_no_copy_in_at_step "$round" env FSDP_COPY_IN_AT_STEP=0 \
    "${ours[@]}" --mode full_shard --offload during --head-unit 1
  # The same as the head-unit one, the host AdamW's OpenMP threads sleeping
  # between its parallel loops instead of spinning (libgomp spins first by
  # default): the cores they would spin on are those the threads queueing
  # backward's kernels and copies need.
  run libfsdp_offload_during_head_unit_passive_omp "$round" env OMP_WAIT_POLICY=PASSIVE \
    "${ours[@]}" --mode full_shard --offload during --head-unit 1 --trace 1
  # Two ranks sharing the GPU over CUDA IPC, each offloaded with its host
  # AdamW beside backward on half the cores (fsdprun would give each 1).
  run libfsdp_offload_during_head_unit_2ranks_ipc "$round" env FSDP_CUDA_BACKEND=ipc \
    OMP_NUM_THREADS=$(($(nproc) / 2)) "${two[@]}" --mode full_shard --offload during --head-unit 1
  # Everything on the compute stream (FSDP_SIDE_STREAMS=0): what the copy-in
  # and copy-out streams bring (Note [Copy-in on a stream of its own]).
  run libfsdp_full_shard_one_stream "$round" env FSDP_SIDE_STREAMS=0 "${ours[@]}" --mode full_shard
  run libfsdp_offload_after_one_stream "$round" env FSDP_SIDE_STREAMS=0 "${ours[@]}" \
    --mode full_shard --offload after
  run libfsdp_offload_during_one_stream "$round" env FSDP_SIDE_STREAMS=0 "${ours[@]}" \
    --mode full_shard --offload during
  run pytorch_plain "$round" "${theirs[@]}" --mode local
  run pytorch_fsdp2 "$round" "${theirs[@]}" --mode fsdp2
  run pytorch_fsdp1 "$round" "${theirs[@]}" --mode fsdp1_full_shard
done

"$PYTHON" - "$results" "$PEAK_TFLOPS" <<'PY'
import json, statistics, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
peak = float(sys.argv[2]) * 1e12
by = {}
for r in rows:
    by.setdefault(r["config"], []).append(r)

def med(config, key):
    values = [r.get(key, 0) for r in by.get(config, [])]
    return statistics.median(values) if values else None

summary = {"bench": "gpu_step_summary", "rounds": max((len(v) for v in by.values()), default=0)}
for config, rs in by.items():
    r = rs[0]
    ms = med(config, "median_ms")
    tokens = r["world"] * r["batch"] * r["seq"] / (ms / 1e3)
    flops = 6 * r["params"] + 12 * r["blocks"] * r["d_model"] * r["seq"]
    summary[config] = {"median_ms": round(ms, 2), "tokens_per_s": round(tokens),
                       "mfu": round(flops * tokens / (r["world"] * peak), 4),
                       "peak_device_bytes_per_rank": med(config, "peak_device_bytes"),
                       "peak_reserved_bytes_per_rank": med(config, "peak_reserved_bytes"),
                       "state_bytes_per_rank": med(config, "state_bytes")}
    if med(config, "listener_span_ms"):  # the optimizer's thread beside backward, per step
        summary[config]["listener_ms"] = {
            k: med(config, k) for k in ("listener_span_ms", "listener_complete_ms",
                                        "listener_arrive_ms", "listener_step_ms", "step_wait_ms")}
    trace = rs[-1].get("trace_ms")  # the last round's last step: when each phase returned
    if trace:
        summary[config]["trace_ms"] = {k: v for k, v in trace.items() if k != "units"}

def ratio(a, b, key="median_ms"):
    x, y = med(a, key), med(b, key)
    return round(x / y, 3) if x and y else None

summary["full_shard_over_plain"] = ratio("libfsdp_full_shard", "libtorch_plain")
summary["no_shard_over_plain"] = ratio("libfsdp_no_shard", "libtorch_plain")
summary["pytorch_fsdp2_over_plain"] = ratio("pytorch_fsdp2", "pytorch_plain")
summary["pytorch_fsdp1_over_plain"] = ratio("pytorch_fsdp1", "pytorch_plain")
summary["libfsdp_full_shard_over_pytorch_fsdp2"] = ratio("libfsdp_full_shard", "pytorch_fsdp2")
summary["two_ranks_state_over_world1"] = ratio("libfsdp_full_shard_2ranks", "libfsdp_full_shard",
                                               "state_bytes")
summary["two_ranks_peak_over_world1"] = ratio("libfsdp_full_shard_2ranks", "libfsdp_full_shard",
                                              "peak_device_bytes")
summary["two_ranks_cuda_ipc_over_staged"] = ratio("libfsdp_full_shard_2ranks_ipc",
                                                  "libfsdp_full_shard_2ranks")
parts = {k: med("libfsdp_offload_after", k) for k in ("fwd_bwd_ms", "host_optim_ms", "copy_ms")}
summary["offload_parts_ms"] = parts
bound = max(v or 0 for v in parts.values())
during = med("libfsdp_offload_during", "median_ms")
summary["offload_during_over_bound"] = round(during / bound, 3) if during and bound else None
summary["offload_during_over_after"] = ratio("libfsdp_offload_during", "libfsdp_offload_after")
head = med("libfsdp_offload_during_head_unit", "median_ms")
summary["offload_during_head_unit_over_bound"] = round(head / bound, 3) if head and bound else None
whole = med("libfsdp_offload_during_head_unit_whole", "median_ms")
summary["offload_during_head_unit_whole_over_bound"] = (round(whole / bound, 3)
                                                        if whole and bound else None)
summary["offload_in_parts_over_whole"] = ratio("libfsdp_offload_during_head_unit",
                                               "libfsdp_offload_during_head_unit_whole")
two_parts = {k: med("libfsdp_offload_during_head_unit_2ranks_ipc", k)
             for k in ("fwd_bwd_ms", "host_optim_ms", "copy_ms")}
two_bound = max(v or 0 for v in two_parts.values())
two = med("libfsdp_offload_during_head_unit_2ranks_ipc", "median_ms")
root_parts = {k: med("libfsdp_offload_during_head_unit_root_on_gpu", k)
              for k in ("fwd_bwd_ms", "host_optim_ms", "copy_ms")}
root_bound = max(v or 0 for v in root_parts.values())
root = med("libfsdp_offload_during_head_unit_root_on_gpu", "median_ms")
summary["offload_root_on_gpu_parts_ms"] = root_parts
summary["offload_root_on_gpu_over_bound"] = (round(root / root_bound, 3)
                                             if root and root_bound else None)
summary["offload_2ranks_parts_ms"] = two_parts
summary["offload_2ranks_over_bound"] = round(two / two_bound, 3) if two and two_bound else None
bf16_grads = med("libfsdp_offload_during_head_unit_bf16_grads", "median_ms")
summary["offload_bf16_grads_over_bound"] = (round(bf16_grads / bound, 3)
                                            if bf16_grads and bound else None)
summary["bf16_grads_over_fp32_grads"] = ratio("libfsdp_offload_during_head_unit_bf16_grads",
                                              "libfsdp_offload_during_head_unit")
summary["copy_in_at_step_over_without"] = ratio(
    "libfsdp_offload_during_head_unit", "libfsdp_offload_during_head_unit_no_copy_in_at_step")
summary["passive_omp_over_spinning"] = ratio("libfsdp_offload_during_head_unit_passive_omp",
                                             "libfsdp_offload_during_head_unit")
summary["copies_at_hand_over_over_listener_copies"] = ratio(
    "libfsdp_offload_during_head_unit", "libfsdp_offload_during_head_unit_listener_copies")
for way in ("full_shard", "offload_after", "offload_during"):
    summary[way + "_side_streams_over_one_stream"] = ratio("libfsdp_" + way,
                                                           "libfsdp_" + way + "_one_stream")
summary["full_shard_side_streams_peak_over_one_stream"] = ratio(
    "libfsdp_full_shard", "libfsdp_full_shard_one_stream", "peak_device_bytes")
summary["full_shard_side_streams_reserved_over_one_stream"] = ratio(
    "libfsdp_full_shard", "libfsdp_full_shard_one_stream", "peak_reserved_bytes")
summary["targets_met"] = {
    "offload_step_le_1.15x_bound": min(summary["offload_during_over_bound"] or 99,
                                       summary["offload_during_head_unit_over_bound"] or 99,
                                       summary["offload_bf16_grads_over_bound"] or 99) <= 1.15,
    "offload_root_on_gpu_le_1.15x_bound": (summary["offload_root_on_gpu_over_bound"] or 99) <= 1.15,
    "full_shard_step_le_1.05x_plain": (summary["full_shard_over_plain"] or 99) <= 1.05,
    "two_ranks_state_le_0.55x": (summary["two_ranks_state_over_world1"] or 99) <= 0.55}
summary["device"] = rows[0].get("device") if rows else None
summary["torch"] = rows[0].get("torch") if rows else None
print(json.dumps(summary))
PY
