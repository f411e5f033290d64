#!/usr/bin/env bash
# Two or more builds of libfsdp (say, main before and after a refactor) on the
# step and overhead benchmarks, in one run with rounds interleaved, so a
# regression shows as a ratio measured on the same machine at the same time:
#
#   bench/ab_builds.sh BUILD_A BUILD_B [BUILD_C ...]   # e.g. build-before build
#
# Give a copy of BUILD_A as BUILD_C to measure the host's own noise: C/A is
# then what two identical binaries differ by in the same run.
#
# Each round runs, for every build in turn (the order rotates by one each
# round, so none always goes first): bench_step NO_SHARD and FULL_SHARD at 2
# ranks, then bench_overhead at 2 ranks (FULL_SHARD, SHARD_GRAD_OP and
# NO_SHARD against the local network). Every JSON line is echoed with
# "build":"A"|"B"|... added; the last line is a summary with X/A per round and
# their median for every other build X (below 1: X is faster).
# Builds nothing: each folder needs bin/fsdprun, bin/bench_step and
# bin/bench_overhead. About 1.5 minutes per build and round on 2 cores.
#
# Environment overrides: ROUNDS (3), STEPS (6), WARMUP (2), NPROC (2),
#   MODES ("no_shard full_shard": the bench_step modes), OVERHEAD (1; 0 skips
#   bench_overhead), STEP_ARGS (more bench_step flags), OVERHEAD_ARGS
#   (bench_overhead flags).
set -euo pipefail

if (($# < 2 || $# > 26)); then
  echo "usage: bench/ab_builds.sh BUILD_A BUILD_B [BUILD_C ...]" >&2
  exit 2
fi
declare -A dir=()
letters=ABCDEFGHIJKLMNOPQRSTUVWXYZ
names=()
for build in "$@"; do
  name=${letters:${#names[@]}:1}
  names+=("$name")
  dir[$name]=$build
done
# shellcheck source=bench/json_lines.sh
. "$(dirname "$0")/json_lines.sh"
for b in "${names[@]}"; do need_executables "${dir[$b]}" fsdprun bench_step bench_overhead; done
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-6}
WARMUP=${WARMUP:-2}
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

results=$(mktemp)
trap 'rm -f "$results"' EXIT

# run BUILD CMD...: one benchmark of BUILD, its JSON lines tagged with it.
run() {
  local build=$1
  shift
  json_lines "$results" "\"build\":\"$build\"," "$@"
}

for ((round = 0; round < ROUNDS; ++round)); do
  shift_by=$((round % ${#names[@]}))
  order=("${names[@]:shift_by}" "${names[@]:0:shift_by}")
  for b in "${order[@]}"; do
    bin=${dir[$b]}/bin
    # shellcheck disable=SC2086  # MODES is a list of words
    for mode in ${MODES:-no_shard full_shard}; do
      # shellcheck disable=SC2086  # word splitting of the user's flags is intended
      run "$b" "$bin/fsdprun" --nproc-per-node "$NPROC" "$bin/bench_step" --steps "$STEPS" \
        --warmup "$WARMUP" --mode "$mode" ${STEP_ARGS:-}
    done
    if [[ ${OVERHEAD:-1} != 0 ]]; then
      # shellcheck disable=SC2086
      run "$b" "$bin/fsdprun" --nproc-per-node "$NPROC" "$bin/bench_overhead" ${OVERHEAD_ARGS:-}
    fi
  done
done

python3 - "$results" "$@" <<'EOF'
import json
import statistics
import sys

path, dirs = sys.argv[1], sys.argv[2:]
names = [chr(ord("A") + i) for i in range(len(dirs))]
runs = {}  # (build, metric) -> value per round, in order
for r in map(json.loads, open(path)):
    if r["bench"] == "step":
        key, value = f"step_{r['mode']}_ms", r["median_ms"]
    elif r["bench"] == "overhead" and r["mode"] != "local":
        key, value = f"overhead_{r['mode']}_us_per_unit", r["overhead_us_per_unit"]
    else:
        continue
    runs.setdefault((r["build"], key), []).append(value)
out = {"bench": "ab_builds_summary", **dict(zip(names, dirs))}
for (build, key), a in sorted(runs.items()):
    if build != "A":
        continue
    out[f"{key}_A"] = round(statistics.median(a), 2)
    for x in names[1:]:
        b = runs[(x, key)]
        out[f"{key}_{x}"] = round(statistics.median(b), 2)
        if key.startswith("step_"):
            per_round = [y / v for v, y in zip(a, b)]
            out[f"{key}_{x}_over_A_rounds"] = [round(v, 3) for v in per_round]
            out[f"{key}_{x}_over_A"] = round(statistics.median(per_round), 3)
        else:
            # Overheads are differences of two times, near zero at times: X - A.
            out[f"{key}_{x}_minus_A"] = round(statistics.median(b) - statistics.median(a), 2)
print(json.dumps(out))
EOF
