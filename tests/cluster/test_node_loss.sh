#!/usr/bin/env bash
# Losing a node. (1) Node 1 loses power mid-run (its link cut, then all its
# processes SIGKILLed, so no FIN or RST reaches node 0): node 0's ranks fail
# within the collective timeout (10 s) + 5 s and its fsdprun exits non-zero.
# (2) With --max-restarts 1, one rank SIGKILLed on node 1: the fsdprun of both
# nodes restarts its ranks, the job resumes from its last checkpoint and
# finishes on both nodes with the parameters of an uninterrupted 1 x 4 run.
# Usage: test_node_loss.sh FSDPRUN CLUSTER_TRAIN WORKDIR
set -u
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/cluster.sh
. "$here/cluster.sh"
fsdprun=$1 prog=$2 work=$3
cluster_init 2 "$work"

# (1) A node lost without a word.
timeout=10
cluster_fsdprun lost "$fsdprun" 2 -- "$prog" --steps 100000 --step-ms 20 --timeout "$timeout"
cluster_wait_for "$work/lost.node0.log" "step 5 " 90
cluster_kill_node 1
start=$SECONDS
cluster_wait $((timeout + 30))
rc=$?
elapsed=$((SECONDS - start))
((rc != 124)) || cluster_fail "node 0 still ran $((timeout + 30)) s after node 1 was lost"
((CLUSTER_RC[0] != 0)) || cluster_fail "node 0's fsdprun exited 0 after node 1 was lost"
((elapsed <= timeout + 5)) ||
  cluster_fail "node 0 took $elapsed s to fail, more than the timeout ($timeout s) + 5 s"
grep -q "cluster_train: " "$work/lost.node0.log" || cluster_fail "no rank of node 0 reported an error"
echo "(1) node 1 lost: node 0 failed after $elapsed s (timeout $timeout s)"
grep "cluster_train: " "$work/lost.node0.log" | head -n 2

# lose_a_rank NAME: once node 0's ranks of job NAME have passed step 9, a
# rank of node 1 is SIGKILLed; both nodes' fsdprun must restart and finish.
lose_a_rank() {
  local name=$1 victim i
  cluster_wait_for "$work/$name.node0.log" "step 9 " 90
  victim=$(cluster_node_pids 1 "$prog" | head -n 1)
  [[ -n $victim ]] || cluster_fail "$name: no rank process found on node 1"
  kill -9 "$victim"
  cluster_wait 150 || cluster_fail "$name: the restarted job did not finish on every node (${CLUSTER_RC[*]})"
  for i in 0 1; do
    grep -q "restarting all ranks (restart 1/1)" "$work/$name.node$i.log" ||
      cluster_fail "$name: node $i's fsdprun did not restart"
    grep -q "done" "$work/$name.node$i.log" || cluster_fail "$name: node $i's ranks did not finish"
  done
}

# (2) A rank killed, the job restarted on both nodes.
cluster_cut_link 1 2>/dev/null
ip -n "$(_cluster_ns sw)" link set vn1 up || cluster_fail "cannot reconnect node 1"
args=(--strategy full_shard --steps 16 --optimizer sgd --timeout 20)
cluster_fsdprun restart "$fsdprun" 2 --max-restarts 1 -- "$prog" "${args[@]}" --step-ms 150 \
  --ckpt-dir "$work/ckpt" --ckpt-every 4 --out "$work/restarted.pt"
lose_a_rank restart
# Killed after step 9: the last checkpoint was step 7 (or 11, if rank 3 was late).
grep -Eq "resumed from step (7|11)$" "$work/restart.node0.log" ||
  cluster_fail "the job did not resume from its checkpoint of step 7"
cluster_spawn 0 ref env FSDP_SHM=0 "$fsdprun" --nproc-per-node 4 "$prog" "${args[@]}" --out "$work/ref.pt"
cluster_wait 90 || cluster_fail "the uninterrupted 1 x 4 run failed"
"$prog" --compare "$work/ref.pt" "$work/restarted.pt" --tol 0 ||
  cluster_fail "the restarted job's parameters differ from an uninterrupted run's"

# (3) The same with the nodes meeting at fsdprun's c10d rendezvous (the same
# command on both): they meet again before the restart, node 1 trying until
# node 0's ranks of the first attempt, and their store, are gone.
rdzv=(--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --max-restarts 1
  --rdzv-endpoint "$CLUSTER_MASTER_ADDR:$CLUSTER_PORT" --rdzv-id node-loss)
for i in 0 1; do
  cluster_spawn "$i" "c10d.node$i" "$fsdprun" "${rdzv[@]}" "$prog" "${args[@]}" --step-ms 150 \
    --ckpt-dir "$work/ckpt-c10d" --ckpt-every 4 --out "$work/c10d.pt"
done
lose_a_rank c10d
for i in 0 1; do
  (($(grep -c "fsdprun: node rank $i of 2" "$work/c10d.node$i.log") == 2)) ||
    cluster_fail "c10d: node $i was not node $i at both meetings"
done
"$prog" --compare "$work/ref.pt" "$work/c10d.pt" --tol 0 ||
  cluster_fail "c10d: the restarted job's parameters differ from an uninterrupted run's"
echo "(3) c10d rendezvous: met again at the restart, bit for bit the uninterrupted run"
echo "ok"
