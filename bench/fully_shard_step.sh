#!/usr/bin/env bash
# GPT-mini's step with units made in place by fsdp::fully_shard against the
# same model with FullyShardedDataParallel wrappers (issue 21: within 3%),
# rounds interleaved and the order alternated, 2 ranks:
#   bench/fully_shard_step.sh [BUILD] [ROUNDS] [MODE]      (defaults: build 5 full_shard)
# Prints bench_step's JSON lines and a summary with the per-round ratios
# in-place / wrapper and their median.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-5}
mode=${3:-full_shard}
. bench/json_lines.sh
need_executables "$build" fsdprun bench_step
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for ((r = 0; r < rounds; r++)); do
  order=(0 1)
  ((r % 2 == 1)) && order=(1 0)
  for v in "${order[@]}"; do
    json_lines "$out" "\"round\":$r," "$build/bin/fsdprun" --nproc-per-node 2 \
      "$build/bin/bench_step" --mode "$mode" --steps 6 --warmup 2 --in-place "$v"
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = {}
for r in rows:
    by.setdefault(r["round"], {})[r["in_place"]] = r["median_ms"]
ratios = [round(v[True] / v[False], 3) for _, v in sorted(by.items()) if len(v) == 2]
print(json.dumps({"bench": "fully_shard_step_summary", "mode": rows[0]["mode"],
                  "wrapper_ms": statistics.median(v[False] for v in by.values()),
                  "in_place_ms": statistics.median(v[True] for v in by.values()),
                  "in_place_over_wrapper_rounds": ratios,
                  "in_place_over_wrapper": statistics.median(ratios)}))
PY
