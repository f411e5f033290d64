#!/usr/bin/env bash
# Issue 35, item 4: the largest GPT-2-style model that trains 3 AdamW steps on
# one GPU, climbing a ladder of sizes for each way of training it:
#   plain LibTorch (bf16 autocast), libfsdp FULL_SHARD, libfsdp with
#   activation checkpointing, libfsdp with CPU offload and activation
#   checkpointing (the host's FusedAdamW stepping beside backward), and
#   PyTorch FSDP2 with CPUOffloadPolicy and activation checkpointing (the
#   same torch's Python, same machine, torch's default threads: its host
#   AdamW steps with all of them, as libfsdp's does).
#
#   bench/largest_gpu_model.sh [BUILD]   (BUILD: a build with bench_gpu_step)
#
# Each rung is a fresh process (one rank, world 1) that trains STEPS steps
# after WARMUP; a rung that fails (out of memory, libfsdp's check_memory
# refusing it before the first step, a timeout) ends that way's climb. One
# JSON line per attempt (its figures, or "failed" with the error's first
# line), then a summary: per way the largest size reached, its parameters,
# step time, tokens/s, peak GPU memory and peak host RSS; the ratios the issue
# asks for: offload's parameters over plain LibTorch's (target >= 1.6), over
# PyTorch's largest (target >= 1), and, at PyTorch's largest size, libfsdp's
# offloaded step over PyTorch's (target <= 0.5).
#
# Environment: LADDER (rungs "d_model:layers:heads", smallest first; the
# default climbs from GPT-2 medium to 13 B parameters), SEQ (1024), BATCH (1),
# VOCAB (50304), STEPS (3), WARMUP (1), DEVICE (cuda; cpu with a small LADDER
# only checks the script), WAYS (all five, by name; set empty, only the summary
# of RESULTS), LADDER_<way> (that way's own rungs, e.g. LADDER_libtorch_plain:
# a device call's minutes go to the rungs near each way's limit), RESULTS (a
# file the lines are appended to and the summary is made from, so that runs
# split over several device calls sum up; default a temporary one), LOGS (a
# folder that keeps each attempt's output), PYTHON, RUN_TIMEOUT (s per rung,
# 1800).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-build}
LADDER=${LADDER:-1024:24:16 1280:36:20 1600:48:25 2048:48:32 2560:48:32 3072:48:32 4096:40:32 4096:48:32 5120:40:40}
SEQ=${SEQ:-1024}
BATCH=${BATCH:-1}
VOCAB=${VOCAB:-50304}
STEPS=${STEPS:-3}
WARMUP=${WARMUP:-1}
DEVICE=${DEVICE:-cuda}
WAYS=${WAYS-libtorch_plain libfsdp_full_shard libfsdp_ac libfsdp_offload_ac pytorch_fsdp2_offload_ac}
RUN_TIMEOUT=${RUN_TIMEOUT:-1800}
PYTHON=${PYTHON:-}
if [[ -z $PYTHON ]]; then
  if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
[[ -x $BUILD/bin/bench_gpu_step ]] || {
  echo "largest_gpu_model.sh: $BUILD/bin/bench_gpu_step is missing; build it (scripts/build.sh bench_gpu_step)" >&2
  exit 2
}

log=$(mktemp)
if [[ -n ${RESULTS:-} ]]; then
  results=$RESULTS
  touch "$results"
  trap 'rm -f "$log"' EXIT
else
  results=$(mktemp)
  trap 'rm -f "$results" "$log"' EXIT
fi

# The command line of one way at one rung.
command_for() {
  local way=$1 d=$2 layers=$3 heads=$4
  local sizes=(--blocks "$layers" --d-model "$d" --heads "$heads" --seq "$SEQ" --batch "$BATCH"
               --vocab "$VOCAB" --steps "$STEPS" --warmup "$WARMUP" --precision bf16)
  local ours=(timeout "$RUN_TIMEOUT" "$BUILD/bin/bench_gpu_step" --device "$DEVICE" "${sizes[@]}")
  case $way in
    libtorch_plain) echo "${ours[@]}" --mode local ;;
    libfsdp_full_shard) echo "${ours[@]}" --mode full_shard ;;
    libfsdp_ac) echo "${ours[@]}" --mode full_shard --activation-checkpointing 1 ;;
    libfsdp_offload_ac)
      echo "${ours[@]}" --mode full_shard --activation-checkpointing 1 --offload during --parts 0 ;;
    pytorch_fsdp2_offload_ac)
      echo timeout "$RUN_TIMEOUT" "$PYTHON" "$ROOT/bench/pytorch_step.py" step --nproc 1 \
        --device "$DEVICE" --mode fsdp2 --cpu-offload --activation-checkpointing --threads 0 \
        "${sizes[@]}" ;;
    *) echo "largest_gpu_model.sh: unknown way '$way'" >&2; exit 2 ;;
  esac
}

for way in $WAYS; do command_for "$way" 64 1 1 >/dev/null; done  # an unknown way stops here
for way in $WAYS; do
  own=LADDER_$way
  for rung in ${!own:-$LADDER}; do
    IFS=: read -r d layers heads <<<"$rung"
    rc=0
    # shellcheck disable=SC2046
    $(command_for "$way" "$d" "$layers" "$heads") >"$log" 2>&1 || rc=$?
    [[ -z ${LOGS:-} ]] || { mkdir -p "$LOGS" && cp "$log" "$LOGS/$way-${rung//:/x}.log"; }
    if ((rc == 0)) && line=$(grep -m1 '^{' "$log") && [[ $line != *'"skipped"'* ]]; then
      echo "{\"way\":\"$way\",\"rung\":\"$rung\",${line#\{}" | tee -a "$results"
    else
      why=$(grep -m1 -E 'fsdp\(check_memory\)|out of memory|OutOfMemory|Error|error|skipped' "$log" |
            head -c 300 | tr -d '"\\')
      echo "{\"way\":\"$way\",\"rung\":\"$rung\",\"failed\":\"${why:-exit status, see the log}\"}" |
        tee -a "$results"
      break
    fi
  done
done

"$PYTHON" - "$results" <<'PY'
import json, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
rows = [r for r in rows if "way" in r]  # a note line of RESULTS is no attempt
summary = {"bench": "largest_gpu_model_summary"}
largest = {}
for r in rows:
    if "failed" in r:
        continue
    best = largest.get(r["way"])
    if best is None or r["params"] > best["params"]:
        largest[r["way"]] = r
for way, r in largest.items():
    tokens = r.get("tokens_per_s") or r["batch"] * r["seq"] / (r["median_ms"] / 1e3)
    host = r.get("peak_host_rss_bytes") or max(r.get("peak_rss_kib", [0])) * 1024
    summary[way] = {"rung": r["rung"], "params": r["params"], "median_ms": r["median_ms"],
                    "tokens_per_s": round(tokens), "peak_device_bytes": r.get("peak_device_bytes"),
                    "peak_host_rss_bytes": host}

def params(way):
    return largest[way]["params"] if way in largest else None

def at_rung(way, rung):
    for r in rows:
        if r["way"] == way and r["rung"] == rung and "failed" not in r:
            return r["median_ms"]
    return None

ours, plain, theirs = (params("libfsdp_offload_ac"), params("libtorch_plain"),
                       params("pytorch_fsdp2_offload_ac"))
summary["offload_params_over_plain"] = round(ours / plain, 2) if ours and plain else None
summary["offload_params_over_pytorch"] = round(ours / theirs, 2) if ours and theirs else None
rung = largest["pytorch_fsdp2_offload_ac"]["rung"] if theirs else None
mine, pt = at_rung("libfsdp_offload_ac", rung), at_rung("pytorch_fsdp2_offload_ac", rung)
summary["step_at_pytorch_largest_over_pytorch"] = round(mine / pt, 3) if mine and pt else None
summary["targets_met"] = {
    "offload_params_ge_1.6x_plain": (summary["offload_params_over_plain"] or 0) >= 1.6,
    "offload_params_ge_pytorch": (summary["offload_params_over_pytorch"] or 0) >= 1.0,
    "step_le_0.5x_pytorch_at_its_largest":
        (summary["step_at_pytorch_largest_over_pytorch"] or 99) <= 0.5}
summary["device"] = rows[0].get("device") if rows else None
print(json.dumps(summary))
PY
