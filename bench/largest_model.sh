#!/usr/bin/env bash
# Issue 18's "largest model that fits": under a fixed memory limit per rank,
# the deepest GPT-mini (d_model 512) that trains STEPS AdamW steps, for local
# (one process, no FSDP) and FULL_SHARD at 2 and 4 ranks, each with and
# without activation checkpointing. Builds nothing:
#
#   bench/largest_model.sh [BUILD_DIR]        # default: build
#
# Each rank runs under bench/limited_rank.sh: a cgroup of its own where the
# machine allows it (v2 memory.max, else v1 memory.limit_in_bytes; needs
# root), else RLIMIT_DATA; the JSON lines say which ("limit"). The search
# doubles the depth until a run fails (killed, or out of memory), then
# bisects. One JSON line per attempt; the last line is the summary: the
# deepest depth and its parameters per configuration, each configuration's
# parameters over local's (issue 18: FULL_SHARD at 2 ranks at least 1.7x
# local's; with activation checkpointing more), and the bound it is compared
# with, 16 bytes x parameters / ranks + activations (the activations measured
# by the tracker at the deepest depth: its peak minus that state).
#
# Environment overrides: LIMIT_MIB (1536), STEPS (3), MAX_BLOCKS (96),
#   CONFIGS ("local:1:0 local:1:1 full_shard:2:0 full_shard:2:1
#   full_shard:4:0 full_shard:4:1": mode:ranks:checkpointing),
#   STEP_ARGS ("--batch 4 --seq 128": more bench_step flags).
set -euo pipefail

BUILD=${1:-build}
BIN=$BUILD/bin
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=bench/json_lines.sh
. "$(dirname "$0")/json_lines.sh"
need_executables "$BUILD" fsdprun bench_step
LIMIT_MIB=${LIMIT_MIB:-1536}
STEPS=${STEPS:-3}
MAX_BLOCKS=${MAX_BLOCKS:-96}
CONFIGS=${CONFIGS:-local:1:0 local:1:1 full_shard:2:0 full_shard:2:1 full_shard:4:0 full_shard:4:1}
STEP_ARGS=${STEP_ARGS:---batch 4 --seq 128}
limit=$((LIMIT_MIB << 20))
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
name=fsdp-largest-$$

if [[ -f /sys/fs/cgroup/cgroup.controllers ]] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
  how="cgroup v2 memory.max"
elif [[ -d /sys/fs/cgroup/memory && -w /sys/fs/cgroup/memory ]]; then
  how="cgroup v1 memory.limit_in_bytes"
else
  how="RLIMIT_DATA"
fi
cleanup() {
  for d in /sys/fs/cgroup/"$name"-rank* /sys/fs/cgroup/memory/"$name"-rank*; do
    if [[ -d $d ]]; then rmdir "$d" 2>/dev/null || true; fi
  done
}
trap cleanup EXIT

results=$(mktemp)
trap 'cleanup; rm -f "$results"' EXIT

# attempt MODE RANKS CKPT BLOCKS: 0 when it trained within the limit.
attempt() {
  local mode=$1 ranks=$2 ckpt=$3 blocks=$4 out rc=0
  # shellcheck disable=SC2086  # STEP_ARGS are words
  out=$("$BIN/fsdprun" --nproc-per-node "$ranks" "$HERE/limited_rank.sh" "$limit" "$name" \
    "$BIN/bench_step" --mode "$mode" --blocks "$blocks" --steps "$STEPS" --warmup 0 \
    --activation-checkpointing "$ckpt" $STEP_ARGS 2>&1) || rc=$?
  cleanup
  local line
  line=$(grep -o '{"bench":"step".*' <<<"$out" | tail -1 || true)
  if ((rc == 0)) && [[ -n $line ]]; then
    echo "{\"bench\":\"largest_model_attempt\",\"limit\":\"$how\",\"limit_mib\":$LIMIT_MIB,\"ok\":true,\"ranks\":$ranks,${line#\{}" | tee -a "$results"
    return 0
  fi
  echo "{\"bench\":\"largest_model_attempt\",\"limit\":\"$how\",\"limit_mib\":$LIMIT_MIB,\"ok\":false,\"mode\":\"$mode\",\"ranks\":$ranks,\"activation_checkpointing\":$([[ $ckpt == 1 ]] && echo true || echo false),\"blocks\":$blocks,\"status\":$rc}" | tee -a "$results"
  return 1
}

for config in $CONFIGS; do
  IFS=: read -r mode ranks ckpt <<<"$config"
  ok=0 bad=0 blocks=1
  # Double until a failure, then bisect between the last success and it.
  while ((blocks <= MAX_BLOCKS)); do
    if attempt "$mode" "$ranks" "$ckpt" "$blocks"; then ok=$blocks; blocks=$((blocks * 2)); else bad=$blocks; break; fi
  done
  if ((bad == 0)); then continue; fi
  while ((bad - ok > 1)); do
    mid=$(((ok + bad) / 2))
    if attempt "$mode" "$ranks" "$ckpt" "$mid"; then ok=$mid; else bad=$mid; fi
  done
done

python3 - "$results" <<'PY'
import json
import sys

best = {}
for r in map(json.loads, open(sys.argv[1])):
    if not r["ok"]:
        continue
    key = f'{r["mode"]}_{r["ranks"]}_{"ckpt" if r["activation_checkpointing"] else "plain"}'
    if key not in best or r["blocks"] > best[key]["blocks"]:
        best[key] = r
out = {"bench": "largest_model_summary"}
MiB = 2**20
for key, r in sorted(best.items()):
    n = r["ranks"] if r["mode"] != "local" else 1
    state = 16 * r["params"] / n
    out[f"{key}_blocks"] = r["blocks"]
    out[f"{key}_params"] = r["params"]
    out[f"{key}_state_bound_mib"] = round(state / MiB)
    out[f"{key}_activations_mib"] = round(max(0, r["run_peak_bytes"] - state) / MiB)
    out[f"{key}_peak_rss_mib"] = round(r["peak_rss_bytes"] / MiB)
for ck in ("plain", "ckpt"):
    local = best.get(f"local_1_{ck}")
    for key, r in best.items():
        if local and key.endswith(ck) and not key.startswith("local"):
            out[f"{key}_params_over_local_{ck}"] = round(r["params"] / local["params"], 2)
    if local and best.get(f"full_shard_2_{ck}"):
        pass
plain = best.get("local_1_plain")
for key, r in best.items():
    if plain and key.endswith("ckpt"):
        out[f"{key}_params_over_local_plain"] = round(r["params"] / plain["params"], 2)
print(json.dumps(out))
PY
