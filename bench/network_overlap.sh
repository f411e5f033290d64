#!/usr/bin/env bash
# Overlap at the network's limit (issue 20): GPT-mini on simulated nodes
# (tests/cluster/cluster.sh: one network, IPC and UTS namespace per node)
# whose links are limited to RATE with DELAY, measured in one run with the
# rounds interleaved:
#   compute        bench_step full_shard at world 1 (one node, no network)
#   compute_pair   the same world-1 run on both nodes at once: the compute
#                  of one node while the other computes too, as in the
#                  2-node runs (the simulated nodes share this machine's
#                  cores, memory bandwidth and caches; real nodes do not)
#   comm           bench_step full_shard --comm-only 1 on 2 nodes x 1 rank:
#                  the step's collectives replayed with no compute
#   compute_beside_comm  the compute run on both nodes while a comm run
#                  goes on between them, with no dependency between the two:
#                  what this machine's shared cores leave of the compute
#                  when the same traffic flows (the simulated nodes' kernel
#                  network stacks run on the cores that compute; a real
#                  node has cores of its own for them), a floor for the
#                  FULL_SHARD step here (the summary's
#                  compute_with_step_traffic_ms scales its cost to the bytes
#                  FULL_SHARD's step sends)
#   fs_prefetch    FULL_SHARD on 2 x 1, forward prefetch + BACKWARD_PRE
#   fs_no_prefetch FULL_SHARD on 2 x 1, no prefetch at all
#   hybrid_2x2     HYBRID_SHARD on 2 nodes x 2 ranks
#   fs_2x2         FULL_SHARD on 2 nodes x 2 ranks
# and, only when named in CONFIGS, gradient accumulation over MICRO_BATCHES
# (4) backwards per step, HYBRID_SHARD on 2 nodes x 2 ranks (Note
# [Accumulating within the node]):
#   hybrid_accum_sync        every backward reduces across the nodes
#   hybrid_accum_within_node set_requires_all_reduce(last): within the node,
#                            one all-reduce across
#   hybrid_accum_no_sync     set_requires_gradient_sync(last): nothing until
#                            the last (full-size gradients meanwhile)
# One JSON line per run (bench_step's, plus "config" and "round"), then the
# summary line: the medians, fs_prefetch / max(compute, comm) (target
# <= 1.15; also against compute_pair and compute_beside_comm), hybrid_2x2 /
# fs_2x2 step time, and the bytes each node sent per step against
# HYBRID_SHARD's share (one all-reduce of every shard across the nodes:
# 2 (N-1)/N x the parameters' bytes per node for N nodes).
#   sudo bench/network_overlap.sh [BUILD_DIR] [ROUNDS]
# Environment: RATE (1gbit), DELAY (0.5ms), CLUSTER_MTU (1500), BLOCKS (8:
# bench_step's GPT-mini), D_MODEL (512), BATCH (4), SEQ (128), STEPS (5),
# WARMUP (2), STEP_ARGS (more bench_step flags for every configuration),
# CONFIGS (the configurations to run, space-separated; default all eight).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD="${1:-build}"
ROUNDS="${2:-3}"
RATE="${RATE:-1gbit}" DELAY="${DELAY:-0.5ms}"
shape=(--blocks "${BLOCKS:-8}" --d-model "${D_MODEL:-512}" --batch "${BATCH:-4}"
       --seq "${SEQ:-128}" --warmup "${WARMUP:-2}" ${STEP_ARGS:-})
model=("${shape[@]}" --steps "${STEPS:-5}")
. bench/json_lines.sh
need_executables "$BUILD" bench_step fsdprun
bench_step=$(cd "$BUILD/bin" && pwd)/bench_step
fsdprun=$(cd "$BUILD/bin" && pwd)/fsdprun
. tests/cluster/cluster.sh

out=$(mktemp /tmp/network_overlap.XXXXXX.jsonl)
logs=$(mktemp -d /tmp/network_overlap.XXXXXX)
# A kernel without sch_netem (seen here) cannot delay: the rate still holds.
cluster_init 2 "$logs/probe"
if [[ -n $DELAY ]] && ! cluster_shape "$RATE" "$DELAY" 2>/dev/null; then
  echo "network_overlap: this kernel cannot delay packets (no sch_netem); links limited to $RATE only" >&2
  DELAY=""
fi
cluster_cleanup
run_config() {  # NAME NODES NPROC ROUND BENCH_STEP ARGS...
  local name=$1 nodes=$2 nproc=$3 round=$4 line
  shift 4
  cluster_init "$nodes" "$logs/$name.$round"
  cluster_shape "$RATE" "$DELAY" || exit 1
  CLUSTER_PORT=$((29600 + RANDOM % 1000))
  if [[ $name == compute_pair ]]; then  # a world-1 job on every node at once
    cluster_spawn_all "$name" "$fsdprun" --nproc-per-node 1 "$bench_step" "${model[@]}" "$@"
  elif [[ $name == compute_beside_comm ]]; then
    # Traffic first (a comm run longer than any compute run), then the
    # world-1 jobs; once both have reported, the traffic is stopped.
    cluster_fsdprun comm_beside "$fsdprun" 1 -- "$bench_step" "${shape[@]}" --steps 100000 \
      --mode full_shard --comm-only 1
    sleep 1
    cluster_spawn_all "$name" "$fsdprun" --nproc-per-node 1 "$bench_step" "${model[@]}" "$@"
    local k finished
    until
      finished=1
      for k in 0 1; do grep -q '{"bench":"step"' "$CLUSTER_DIR/$name.node$k.log" || finished=0; done
      ((finished))
    do
      # Traffic that stopped before the compute did, or a compute job that
      # died without its line, measures nothing.
      for k in "${!CLUSTER_PIDS[@]}"; do
        local log="$CLUSTER_DIR/${CLUSTER_NAMES[$k]}.log"
        if ! kill -0 "${CLUSTER_PIDS[$k]}" 2>/dev/null &&
          { [[ ${CLUSTER_NAMES[$k]} == comm_beside.* ]] || ! grep -q '{"bench":"step"' "$log"; }; then
          echo "network_overlap: ${CLUSTER_NAMES[$k]} stopped early; its log:" >&2
          cat "$log" >&2
          cluster_kill_all
          exit 1
        fi
      done
      sleep 0.2
    done
    cluster_kill_all
    cluster_wait 60 >/dev/null 2>&1
  else
    cluster_fsdprun "$name" "$fsdprun" "$nproc" -- "$bench_step" "${model[@]}" "$@"
  fi
  if ! cluster_wait 900; then
    echo "network_overlap: $name failed; its logs:" >&2
    cat "$CLUSTER_DIR"/"$name".node*.log >&2
    exit 1
  fi
  line=$(grep -ho '{"bench":"step".*}' "$CLUSTER_DIR"/"$name".node0.log | tail -n 1)
  echo "${line%\}},\"config\":\"$name\",\"round\":$round,\"rate\":\"$RATE\",\"delay\":\"${DELAY:-none}\",\"mtu\":${CLUSTER_MTU:-1500}}" |
    tee -a "$out"
  cluster_cleanup
}

read -r -a configs <<<"${CONFIGS:-compute compute_pair compute_beside_comm comm fs_prefetch fs_no_prefetch hybrid_2x2 fs_2x2}"
for ((r = 0; r < ROUNDS; ++r)); do
  # Rotate the order every round, so drift in the machine's speed spreads evenly.
  for ((k = 0; k < ${#configs[@]}; ++k)); do
    c=${configs[$(((k + r) % ${#configs[@]}))]}
    case $c in
      compute) run_config compute 1 1 "$r" --mode full_shard ;;
      compute_pair) run_config compute_pair 2 1 "$r" --mode full_shard ;;
      comm) run_config comm 2 1 "$r" --mode full_shard --comm-only 1 ;;
      compute_beside_comm) run_config compute_beside_comm 2 1 "$r" --mode full_shard ;;
      fs_prefetch) run_config fs_prefetch 2 1 "$r" --mode full_shard --forward-prefetch 1 \
        --backward-prefetch backward_pre ;;
      fs_no_prefetch) run_config fs_no_prefetch 2 1 "$r" --mode full_shard --forward-prefetch 0 \
        --backward-prefetch none ;;
      hybrid_2x2) run_config hybrid_2x2 2 2 "$r" --mode hybrid_shard ;;
      fs_2x2) run_config fs_2x2 2 2 "$r" --mode full_shard ;;
      hybrid_accum_*) run_config "$c" 2 2 "$r" --mode hybrid_shard \
        --micro-batches "${MICRO_BATCHES:-4}" --accumulate "${c#hybrid_accum_}" ;;
    esac
  done
done

python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
med = lambda c, k: statistics.median(r[k] for r in rows if r["config"] == c)
m = {c: med(c, "median_ms") for c in {r["config"] for r in rows}}
tx = {c: med(c, "net_tx_bytes_per_step") for c in m}
cpu = {c: med(c, "cpu_ms_per_step") for c in m}
params = rows[0]["params"]
nodes = 2
share = 2 * (nodes - 1) / nodes * params * 4  # per node and step
summary = {
    "bench": "network_overlap_summary", "rounds": max(r["round"] for r in rows) + 1,
    "rate": rows[0]["rate"], "delay": rows[0]["delay"], "mtu": rows[0]["mtu"], "params": params,
    "median_ms": {c: round(v, 1) for c, v in sorted(m.items())},
    "cpu_ms_per_step": {c: round(v, 1) for c, v in sorted(cpu.items())},
    "node_tx_bytes_per_step": {c: int(v) for c, v in sorted(tx.items())},
}
if "compute" in m and "comm" in m:  # the ratios of the configurations that ran
    bound = max(m["compute"], m["comm"])
    for c in ("fs_prefetch", "fs_no_prefetch"):
        if c in m:
            summary[c + "_over_max_compute_comm"] = round(m[c] / bound, 3)
    for c in ("compute_pair", "compute_beside_comm"):
        if c in m and "fs_prefetch" in m:
            summary["fs_prefetch_over_max_%s_comm" % c] = round(
                m["fs_prefetch"] / max(m[c], m["comm"]), 3)
    if "compute_beside_comm" in m and "fs_prefetch" in m and tx["compute_beside_comm"] > 0:
        # The traffic beside the compute runs flat out, more bytes per compute
        # step than FULL_SHARD's step sends: scale its cost to the step's bytes.
        cost = (m["compute_beside_comm"] - m["compute"]) * tx["fs_prefetch"] / tx["compute_beside_comm"]
        summary["compute_with_step_traffic_ms"] = round(m["compute"] + cost, 1)
        summary["fs_prefetch_over_max_compute_with_traffic_comm"] = round(
            m["fs_prefetch"] / max(m["compute"] + cost, m["comm"]), 3)
if "hybrid_2x2" in m and "fs_2x2" in m:
    summary["hybrid_over_full_shard_2x2"] = round(m["hybrid_2x2"] / m["fs_2x2"], 3)
    summary["hybrid_share_bytes_per_step"] = int(share)
    summary["hybrid_tx_over_share"] = round(tx["hybrid_2x2"] / share, 3)
if "hybrid_accum_sync" in m:  # accumulation: step time and bytes against syncing every backward
    for c in ("hybrid_accum_within_node", "hybrid_accum_no_sync"):
        if c in m:
            summary[c + "_over_sync"] = round(m[c] / m["hybrid_accum_sync"], 3)
            summary[c + "_tx_over_sync"] = round(tx[c] / max(tx["hybrid_accum_sync"], 1), 3)
print(json.dumps(summary))
EOF
echo "raw lines: $out" >&2
