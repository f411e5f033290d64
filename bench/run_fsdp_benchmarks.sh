#!/usr/bin/env bash
# The FSDP-core benchmarks (issue: FSDP core) in one run, so every ratio is
# measured on the same machine at the same time. Builds nothing:
#
#   bench/run_fsdp_benchmarks.sh [BUILD_DIR]        # default: build
#
# Runs bench_step for local (one process), then NO_SHARD, SHARD_GRAD_OP and
# FULL_SHARD at 2 ranks with fsdprun (and FULL_SHARD in bf16), then
# bench_overhead at world size 1 and 2. Every JSON line is echoed as it comes;
# the last line is a summary with the ratios to local and the issue's targets.
# Roughly 4 minutes per round on 2 cores. Every process, local ones too, gets
# its large CPU blocks from libfsdp's block cache (BENCH_CPU_MEMORY, below;
# the lines say "malloc").
#
# Environment overrides:
#   STEPS (10), WARMUP (2)       timed and untimed steps of bench_step
#   ROUNDS (3)                   the fp32 step runs, interleaved this many times;
#                                ratios are taken within a round and the summary
#                                gives their median (a shared host drifts by
#                                tens of percent between minutes)
#   STEP_ARGS                    more bench_step flags, e.g. "--blocks 4 --seq 64"
#   NPROC (2)                    ranks of the sharded runs
#   BF16 (1)                     also FULL_SHARD with bf16 mixed precision
#                                (step time and all-gathered bytes vs fp32); 0 skips it
#   OVERHEAD_ARGS                bench_overhead flags, e.g. "--rounds 10"
#   BENCH_CPU_MEMORY (cache)     kept: glibc keeps freed memory instead (the
#                                policy before the block cache); default: glibc's
#                                defaults
#   LOCAL_CONCURRENT (1)         also run `local` on NPROC ranks side by side
#                                (no communication): what NPROC busy processes
#                                cost the machine by itself, to tell it apart
#                                from FSDP's own cost, and at the pace of each
#                                step's slowest rank (local_concurrent_slowest):
#                                what the ranks' drift costs a synchronous step.
#                                0 skips it (~35 s).
set -euo pipefail

BUILD=${1:-build}
BIN=$BUILD/bin
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
STEP_ARGS=${STEP_ARGS:-}
NPROC=${NPROC:-2}
OVERHEAD_ARGS=${OVERHEAD_ARGS:-}
LOCAL_CONCURRENT=${LOCAL_CONCURRENT:-1}
ROUNDS=${ROUNDS:-3}

for exe in fsdprun bench_step bench_overhead; do
  if [[ ! -x $BIN/$exe ]]; then
    echo "run_fsdp_benchmarks.sh: $BIN/$exe not found; build it first:" >&2
    echo "  cmake --build $BUILD --target fsdprun bench_step bench_overhead" >&2
    exit 1
  fi
done

# One thread per process everywhere (the benchmarks also pin OpenBLAS to one
# thread themselves); set here so fsdprun does not print its notice.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

results=$(mktemp)
trap 'rm -f "$results"' EXIT

# shellcheck source=bench/json_lines.sh
. "$(dirname "$0")/json_lines.sh"
run() { json_lines "$results" "" "$@"; }

step=("$BIN/bench_step" --steps "$STEPS" --warmup "$WARMUP")
# shellcheck disable=SC2206  # word splitting of the user's flags is intended
step+=($STEP_ARGS)
launch=("$BIN/fsdprun" --nproc-per-node "$NPROC")

for ((round = 0; round < ROUNDS; ++round)); do
  run "${step[@]}" --mode local
  if [[ $LOCAL_CONCURRENT != 0 ]]; then
    run "${launch[@]}" "${step[@]}" --mode local
  fi
  for mode in no_shard shard_grad_op full_shard; do
    run "${launch[@]}" "${step[@]}" --mode "$mode"
  done
done
# Mixed precision (issue: deferred init, auto-wrap and mixed precision):
# FULL_SHARD in bf16 against the fp32 run above.
if [[ ${BF16:-1} != 0 ]]; then
  run "${launch[@]}" "${step[@]}" --mode full_shard --mixed-precision bf16
fi
# shellcheck disable=SC2086
run "$BIN/bench_overhead" $OVERHEAD_ARGS
# shellcheck disable=SC2086
run "${launch[@]}" "$BIN/bench_overhead" $OVERHEAD_ARGS

python3 - "$results" "$NPROC" <<'EOF'
import json
import statistics
import sys

path, nproc = sys.argv[1], int(sys.argv[2])
lines = [json.loads(l) for l in open(path)]
step, rounds = {}, {}  # the first run of each configuration; every run's time
for r in lines:
    if r["bench"] == "step":
        key = r["mode"] if r["mode"] != "local" or r["world"] == 1 else "local_concurrent"
        if r.get("precision") == "bf16":
            key += "_bf16"
        step.setdefault(key, r)
        rounds.setdefault(key, []).append(r["median_ms"])
        if key == "local_concurrent":
            rounds.setdefault("local_concurrent_slowest", []).append(r["slowest_rank_median_ms"])
over = {r["world"]: r for r in lines if r["bench"] == "overhead_summary"}


def ratio(mode, base):
    # Median over rounds of the ratio within each round.
    per_round = [a / b for a, b in zip(rounds[mode], rounds[base])]
    out[f"{mode}_over_{base}_rounds"] = [round(x, 3) for x in per_round]
    return statistics.median(per_round)


local, fs = step["local"], step["full_shard"]
out = {"bench": "fsdp_core_summary", "world": nproc, "rounds": len(rounds["local"]),
       "local_ms": statistics.median(rounds["local"])}
for mode, target in (("full_shard", 1.15), ("no_shard", 1.10), ("shard_grad_op", None)):
    value = ratio(mode, "local")
    out[f"{mode}_over_local"] = round(value, 3)
    if target is not None:
        out[f"{mode}_target"] = target
        out[f"{mode}_ok"] = value <= target
if "local_concurrent" in step:
    out["local_concurrent_over_local"] = round(ratio("local_concurrent", "local"), 3)
    out["full_shard_over_local_concurrent"] = round(ratio("full_shard", "local_concurrent"), 3)
    out["no_shard_over_local_concurrent"] = round(ratio("no_shard", "local_concurrent"), 3)
    # Each step at the pace of its slowest rank, as synchronous training runs.
    base = "local_concurrent_slowest"
    out[f"{base}_over_local"] = round(ratio(base, "local"), 3)
    out[f"full_shard_over_{base}"] = round(ratio("full_shard", base), 3)
    out[f"no_shard_over_{base}"] = round(ratio("no_shard", base), 3)

# Memory: half of local's parameters + gradients + AdamW state, plus two
# blocks' full parameters (the gathered block and the prefetched one), +10%.
bound = 1.10 * (local["state_bytes"] / 2 + 2 * fs["block_param_bytes"])
# Activations (and their backward temporaries) are the same per rank in every
# mode: local's peak minus its resident state. FULL_SHARD's peak minus that is
# its peak of parameters + gradients + optimizer state, transients included.
activations = local["peak_bytes"] - local["state_bytes"]
param_peak = fs["peak_bytes"] - activations
out.update({
    "local_peak_bytes": local["peak_bytes"],
    "full_shard_peak_bytes": fs["peak_bytes"],
    "full_shard_peak_over_local": round(fs["peak_bytes"] / local["peak_bytes"], 3),
    "local_state_bytes": local["state_bytes"],
    "full_shard_state_bytes": fs["state_bytes"],
    "full_shard_param_peak_bytes": param_peak,
    "full_shard_param_peak_1token_bytes": fs["param_peak_bytes"],
    "memory_bound_bytes": int(bound),
    "memory_ok": param_peak <= bound,
    "memory_ok_1token": fs["param_peak_bytes"] <= bound,
})
for world, target in ((1, 25.0), (2, 400.0)):
    if world in over:
        us = over[world]["full_shard_us_per_unit"]
        out[f"overhead_us_per_unit_world{world}"] = us
        out[f"overhead_target_world{world}"] = target
        out[f"overhead_ok_world{world}"] = us <= target
        for mode in ("shard_grad_op", "no_shard"):
            if f"{mode}_us_per_unit" in over[world]:
                out[f"overhead_{mode}_us_per_unit_world{world}"] = over[world][f"{mode}_us_per_unit"]
if "full_shard_bf16" in step:
    bf = step["full_shard_bf16"]
    out["bf16_full_shard_ms"] = bf["median_ms"]
    # The bf16 run follows the last round's fp32 runs.
    out["bf16_over_fp32_full_shard"] = round(bf["median_ms"] / rounds["full_shard"][-1], 3)
    out["bf16_over_local"] = round(bf["median_ms"] / rounds["local"][-1], 3)
    out["bf16_all_gather_bytes_per_step"] = bf["all_gather_bytes_per_step"]
    out["fp32_all_gather_bytes_per_step"] = fs["all_gather_bytes_per_step"]
    out["bf16_gather_bytes_ratio"] = round(
        bf["all_gather_bytes_per_step"] / fs["all_gather_bytes_per_step"], 3)
    out["bf16_gathers_half"] = out["bf16_gather_bytes_ratio"] <= 0.5
fp32 = [r for k, r in step.items() if not k.endswith("_bf16")]
out["loss0_agrees"] = len({round(r["loss0"], 4) for r in fp32}) == 1
print(json.dumps(out))
EOF
