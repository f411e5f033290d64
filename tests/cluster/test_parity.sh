#!/usr/bin/env bash
# 2 nodes x 2 ranks train as 1 node x 4 ranks do, for FULL_SHARD,
# SHARD_GRAD_OP and NO_SHARD: different data per rank, 5 SGD steps, final
# full parameters compared. Bit for bit with 1 x 4 over TCP (FSDP_SHM=0: the
# same ring, so the same order of additions); within 1e-6 (relative) with
# 1 x 4 through shared memory, which adds in another order. Then
# HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on 2 x 2 against FULL_SHARD on 1 x 4.
# FULL_SHARD once more with the nodes meeting at fsdprun's c10d rendezvous.
# Usage: test_parity.sh FSDPRUN CLUSTER_TRAIN WORKDIR
set -u
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/cluster.sh
. "$here/cluster.sh"
fsdprun=$1 prog=$2 work=$3
cluster_init 2 "$work"

for s in full_shard shard_grad_op no_shard; do
  args=(--strategy "$s" --steps 5 --optimizer sgd --timeout 30)
  start=$SECONDS
  cluster_fsdprun "$s" "$fsdprun" 2 -- "$prog" "${args[@]}" --out "$work/$s.pt"
  cluster_wait 90 || cluster_fail "$s: the 2 x 2 run failed"
  grep -q "rank 3/4 on node1" "$work/$s.node1.log" || cluster_fail "$s: rank 3 did not run on node1"
  grep -q "rank 0/4 on node0" "$work/$s.node0.log" || cluster_fail "$s: rank 0 did not run on node0"
  mid=$SECONDS
  cluster_spawn 0 "shm-$s" "$fsdprun" --nproc-per-node 4 "$prog" "${args[@]}" --out "$work/shm-$s.pt"
  cluster_wait 90 || cluster_fail "$s: the 1 x 4 run failed"
  cluster_spawn 0 "tcp-$s" env FSDP_SHM=0 "$fsdprun" --nproc-per-node 4 "$prog" "${args[@]}" \
    --out "$work/tcp-$s.pt"
  cluster_wait 90 || cluster_fail "$s: the 1 x 4 run over TCP failed"
  "$prog" --compare "$work/tcp-$s.pt" "$work/$s.pt" --tol 0 ||
    cluster_fail "$s: 2 x 2 and 1 x 4 over TCP differ"
  "$prog" --compare "$work/shm-$s.pt" "$work/$s.pt" --tol 1e-6 ||
    cluster_fail "$s: 2 x 2 and 1 x 4 differ"
  echo "$s: 2 x 2 in $((mid - start)) s, two 1 x 4 runs in $((SECONDS - mid)) s"
done

# torchrun's multi-node line, the same on both nodes (Note [fsdprun's
# rendezvous]): node 1 starts first and waits; node 0, whose name the
# endpoint gives, serves the rendezvous, is node 0, and its rank 0's store
# then takes the port. Node 0's /etc/hosts maps its own name to 127.0.1.1,
# as Debian's does, so the ranks must meet at the address node 1 reached.
# Bit for bit the 1 x 4 run over TCP.
cluster_hosts 0 "127.0.1.1 node0"
cluster_hosts 1 "$CLUSTER_MASTER_ADDR node0"
rdzv=(--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d
  --rdzv-endpoint "node0:$CLUSTER_PORT" --rdzv-id parity)
args=(--strategy full_shard --steps 5 --optimizer sgd --timeout 30 --out "$work/c10d.pt")
cluster_spawn 1 c10d.node1 "$fsdprun" "${rdzv[@]}" "$prog" "${args[@]}"
sleep 2
cluster_spawn 0 c10d.node0 "$fsdprun" "${rdzv[@]}" "$prog" "${args[@]}"
cluster_wait 90 || cluster_fail "c10d: the 2 x 2 run failed"
grep -q "node rank 1 of 2" "$work/c10d.node1.log" || cluster_fail "c10d: node 1 is not node 1"
grep -q "the ranks meet at $CLUSTER_MASTER_ADDR" "$work/c10d.node0.log" ||
  cluster_fail "c10d: node 0 did not move MASTER_ADDR off its loopback name"
grep -q "rank 3/4 on node1" "$work/c10d.node1.log" || cluster_fail "c10d: rank 3 did not run on node1"
"$prog" --compare "$work/tcp-full_shard.pt" "$work/c10d.pt" --tol 0 ||
  cluster_fail "c10d: 2 x 2 met at the c10d rendezvous and 1 x 4 over TCP differ"
echo "c10d rendezvous: 2 x 2 equals 1 x 4"

# HYBRID_SHARD across the two nodes (groups from fsdprun's topology: each
# node shards, the shards are all-reduced across nodes) trains as FULL_SHARD
# on one node does; it adds in another order (the node's sum, then the
# nodes'), so within 1e-6.
for s in hybrid_shard hybrid_shard_zero2; do
  cluster_fsdprun "$s" "$fsdprun" 2 -- "$prog" --strategy "$s" --steps 5 --optimizer sgd \
    --timeout 30 --out "$work/$s.pt"
  cluster_wait 90 || cluster_fail "$s: the 2 x 2 run failed"
  "$prog" --compare "$work/shm-full_shard.pt" "$work/$s.pt" --tol 1e-6 ||
    cluster_fail "$s: 2 x 2 HYBRID and 1 x 4 FULL_SHARD differ"
  echo "$s: 2 x 2 equals 1 x 4"
done
echo "ok"
