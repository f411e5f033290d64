#!/usr/bin/env bash
# Issue 18's memory benchmark: what each sharding mode costs the process
# (peak RSS) beside libfsdp's tracker, and its step time, with each CPU memory
# policy, in one run with rounds interleaved. Builds nothing:
#
#   bench/memory_rss.sh [BUILD_DIR]        # default: build
#
# For each model (MODELS: bench_step flags per model, ';'-separated; default
# GPT-mini 8 x 512 and 12 x 512) and each round, runs bench_step at NPROC ranks
# for every mode in MODES and every policy in MEMS (BENCH_CPU_MEMORY: cache =
# libfsdp's block cache, kept = glibc keeps freed memory, the policy before the
# cache; default = glibc's defaults). Every JSON line is echoed with "model"
# added; the last line per model is a summary with the medians over rounds:
#   peak RSS and its growth since before the model was built, the tracker's
#   peak, rss_bound_ratio = growth / (1.15 x tracker peak + 32 MiB) (issue 18:
#   at most 1), FULL_SHARD's peak RSS over local's (target at most 0.8), the
#   floor under that ratio (FULL_SHARD's RSS before the model plus its tensor
#   bytes at the end of forward, shards and activations only, over local's
#   peak RSS) and FULL_SHARD's step time with the cache over with kept
#   (target at most 1).
# About 25 s per run on 2 cores.
#
# Environment overrides: ROUNDS (2), STEPS (4), WARMUP (1), NPROC (2),
#   MODES ("local full_shard shard_grad_op no_shard"), MEMS ("cache kept"),
#   MODELS ("--blocks 8;--blocks 12").
set -euo pipefail

BUILD=${1:-build}
BIN=$BUILD/bin
# shellcheck source=bench/json_lines.sh
. "$(dirname "$0")/json_lines.sh"
need_executables "$BUILD" fsdprun bench_step
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-4}
WARMUP=${WARMUP:-1}
NPROC=${NPROC:-2}
MODES=${MODES:-local full_shard shard_grad_op no_shard}
MEMS=${MEMS:-cache kept}
MODELS=${MODELS:---blocks 8;--blocks 12}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

results=$(mktemp)
trap 'rm -f "$results"' EXIT

IFS=';' read -r -a models <<<"$MODELS"
for ((round = 0; round < ROUNDS; ++round)); do
  for model in "${models[@]}"; do
    # shellcheck disable=SC2086  # MODES and MEMS are lists of words
    for mode in $MODES; do
      for mem in $MEMS; do
        # shellcheck disable=SC2086  # the model's flags are words
        BENCH_CPU_MEMORY=$mem json_lines "$results" "\"model\":\"$model\",\"round\":$round," \
          "$BIN/fsdprun" --nproc-per-node "$NPROC" "$BIN/bench_step" --steps "$STEPS" \
          --warmup "$WARMUP" --mode "$mode" $model
      done
    done
  done
done

python3 - "$results" <<'PY'
import json
import statistics
import sys

MiB = 2**20
runs = {}
for r in map(json.loads, open(sys.argv[1])):
    runs.setdefault((r["model"], r["mode"], r["malloc"]), []).append(r)
for model in sorted({k[0] for k in runs}):
    out = {"bench": "memory_rss_summary", "model": model}
    med = {}
    for (m, mode, mem), rs in sorted(runs.items()):
        if m != model:
            continue
        key = f"{mode}_{mem}"
        med[key] = {
            "step_ms": statistics.median(r["median_ms"] for r in rs),
            "peak_rss": statistics.median(r["peak_rss_bytes"] for r in rs),
            "growth": statistics.median(r["rss_growth_bytes"] for r in rs),
            # What the process holds as forward ends, with nothing gathered:
            # its RSS before the model plus the tracker's bytes then.
            "forward_end": statistics.median(
                r["rss_before_model_bytes"] + r["forward_end_bytes"] for r in rs),
        }
        out[f"{key}_step_ms"] = round(med[key]["step_ms"], 1)
        out[f"{key}_peak_rss_mib"] = round(med[key]["peak_rss"] / MiB)
        out[f"{key}_rss_growth_mib"] = round(med[key]["growth"] / MiB)
        out[f"{key}_tracker_peak_mib"] = round(
            statistics.median(r["run_peak_bytes"] for r in rs) / MiB)
        out[f"{key}_rss_bound_ratio"] = max(r["rss_bound_ratio"] for r in rs)
    for mem in ("cache", "kept", "default"):
        fs, loc = med.get(f"full_shard_{mem}"), med.get(f"local_{mem}")
        if fs and loc:
            out[f"full_shard_over_local_peak_rss_{mem}"] = round(fs["peak_rss"] / loc["peak_rss"], 3)
            out[f"full_shard_over_local_rss_growth_{mem}"] = round(fs["growth"] / loc["growth"], 3)
            # The floor under the first ratio: FULL_SHARD's shards and
            # activations at the end of forward, before any parameter is
            # gathered, against local's peak. No sharding schedule goes below.
            out[f"full_shard_forward_end_over_local_peak_rss_{mem}"] = round(
                fs["forward_end"] / loc["peak_rss"], 3)
    for mode in ("full_shard", "shard_grad_op", "no_shard", "local"):
        c, k = med.get(f"{mode}_cache"), med.get(f"{mode}_kept")
        if c and k:
            out[f"{mode}_step_cache_over_kept"] = round(c["step_ms"] / k["step_ms"], 3)
    print(json.dumps(out))
PY
