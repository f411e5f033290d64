#!/usr/bin/env bash
# A sharded checkpoint written by 2 nodes x 2 ranks loads on 1 node x 4 ranks
# and on 1 node x 2 ranks (resharded from the files): the loaded parameters
# equal the saved ones bit for bit.
# Usage: test_reshard.sh FSDPRUN CLUSTER_TRAIN WORKDIR
set -u
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/cluster.sh
. "$here/cluster.sh"
fsdprun=$1 prog=$2 work=$3
cluster_init 2 "$work"

args=(--strategy full_shard --steps 4 --timeout 30)
cluster_fsdprun save "$fsdprun" 2 -- "$prog" "${args[@]}" --save "$work/ckpt" --out "$work/saved.pt"
cluster_wait 90 || cluster_fail "the 2 x 2 run that saves failed"
ls "$work/ckpt"/model-rank3* >/dev/null 2>&1 || cluster_fail "no rank 3 shards in $work/ckpt"
for n in 4 2; do
  # --load: step 3 was the last, so with --steps 4 no step runs after it.
  cluster_spawn 0 "load$n" "$fsdprun" --nproc-per-node "$n" "$prog" "${args[@]}" \
    --load "$work/ckpt" --out "$work/loaded$n.pt"
  cluster_wait 90 || cluster_fail "loading on 1 x $n failed"
  "$prog" --compare "$work/saved.pt" "$work/loaded$n.pt" --tol 0 ||
    cluster_fail "what 1 x $n loaded differs from what 2 x 2 saved"
done
echo "ok"
