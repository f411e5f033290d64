#!/usr/bin/env bash
# The simulated cluster itself (tests/cluster/cluster.sh): each node has its
# own hostname, IPC namespace and /dev/shm; nodes and a stranger reach each
# other over the bridge; cluster_shape limits rate and adds delay;
# cluster_wait's deadline kills what runs; cleanup and the sweep of stale
# namespaces leave nothing behind.
# Usage: test_harness.sh FSDPRUN CLUSTER_TRAIN WORKDIR
set -u
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/cluster.sh
. "$here/cluster.sh"
work=$3

# Cleanup: a cluster made and left in a subshell leaves no namespace.
(
  cluster_init 2 "$work/sub"
  echo "$CLUSTER_ID" >"$work/sub.id"
  cluster_spawn 0 sleeper sleep 300
  exit 0
)
rc=$?
((rc == 77)) && exit 77
((rc == 0)) || { echo "FAIL: a cluster in a subshell exited $rc"; exit 1; }
id=$(cat "$work/sub.id")
if ip netns list | grep -q "^$id-"; then echo "FAIL: $id's namespaces outlived it"; exit 1; fi

# The sweep: a namespace of a harness whose creator is gone is removed.
stale="$CLUSTER_PREFIX-999999999.1-n0"
ip netns add "$stale" || { echo "FAIL: ip netns add $stale"; exit 1; }
cluster_sweep 2>/dev/null
if ip netns list | grep -q "^$stale"; then echo "FAIL: the sweep left $stale"; exit 1; fi

cluster_init 2 "$work"
check() { [[ $1 == "$2" ]] || cluster_fail "$3: expected '$2', got '$1'"; }

check "$(cluster_exec 0 hostname)" node0 "node 0's hostname"
check "$(cluster_exec 1 hostname)" node1 "node 1's hostname"
# shellcheck disable=SC2016  # expanded in the node
check "$(cluster_exec 1 sh -c 'echo "$FSDP_JOB_TOKEN $CLUSTER_NODE_RANK"')" "$FSDP_JOB_TOKEN 1" \
  "node 1's environment"
((${#FSDP_JOB_TOKEN} == 32)) || cluster_fail "FSDP_JOB_TOKEN '$FSDP_JOB_TOKEN' is not 16 random bytes"
# IPC namespaces: of two processes alive at once (a freed one's number is reused).
cluster_spawn 0 sleeper0 sleep 300
cluster_spawn 1 sleeper1 sleep 300
sleep 0.5
ipc0=$(readlink "/proc/$(ip netns pids "$(_cluster_ns n0)" | head -n 1)/ns/ipc")
ipc1=$(readlink "/proc/$(ip netns pids "$(_cluster_ns n1)" | head -n 1)/ns/ipc")
[[ -n $ipc0 && $ipc0 != "$ipc1" && $ipc0 != $(readlink /proc/self/ns/ipc) ]] ||
  cluster_fail "IPC namespaces not distinct: '$ipc0' '$ipc1'"
check "$(cluster_exec 0 sh -c 'touch /dev/shm/fsdpc-probe && ls /dev/shm')" fsdpc-probe "node 0's /dev/shm"
check "$(cluster_exec 1 ls /dev/shm)" "" "node 1's /dev/shm"
[[ ! -e /dev/shm/fsdpc-probe ]] || cluster_fail "node 0's /dev/shm file is in the root's /dev/shm"

# The deadline kills what runs (the two sleepers), promptly.
start=$SECONDS
cluster_wait 1 2>/dev/null
rc=$?
check "$rc" 124 "cluster_wait past its deadline"
((SECONDS - start <= 5)) || cluster_fail "cluster_wait took $((SECONDS - start)) s to kill a sleeper"
check "$(ip netns pids "$(_cluster_ns n1)")" "" "processes left in node 1"

if ! command -v python3 >/dev/null; then
  echo "ok (no python3: connectivity and cluster_shape not measured)"
  exit 0
fi
# A sink on node 1 that prints how many bytes it got and how fast.
sink='
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5000)); s.listen(8)
for _ in range(int(sys.argv[1])):
    c, _ = s.accept(); n = 0; t0 = None
    while True:
        b = c.recv(1 << 20)
        if not b: break
        t0 = t0 or time.time(); n += len(b)
    print(n, round(n / max(time.time() - (t0 or time.time()), 1e-9) / 1e6, 1), flush=True)
'
# Sends $2 MB to node 1, timing connect() too.
send='
import socket, sys, time
t = time.time(); c = socket.create_connection((sys.argv[1], 5000)); rtt = time.time() - t
c.sendall(bytes(int(float(sys.argv[2]) * 1e6))); c.close(); print(round(rtt * 1e3, 2))
'
node1=$(cluster_addr 1)
cluster_spawn 1 sink python3 -c "$sink" 2
sleep 1
check "$(cluster_exec 0 python3 -c "$send" "$node1" 1 >/dev/null && echo sent)" sent "node 0 -> node 1"
cluster_stranger_spawn stranger python3 -c "$send" "$node1" 1
cluster_wait 10 2>/dev/null
check "${CLUSTER_RC[*]}" "0 0" "node 1's sink and the stranger -> node 1"
cluster_spawn 1 sink python3 -c "$sink" 1
sleep 1
if cluster_shape 200mbit ""; then
  cluster_exec 0 python3 -c "$send" "$node1" 20 >/dev/null
  cluster_wait 20 || cluster_fail "the sink failed"
  rate=$(tail -n 1 "$work/sink.log" | awk '{print $2}')
  echo "cluster_shape 200mbit: ${rate} MB/s"
  awk -v r="$rate" 'BEGIN { exit !(r >= 15 && r <= 27) }' || cluster_fail "$rate MB/s, expected ~25"
else
  echo "no tc tbf here: rate not measured"
fi
# Delay needs sch_netem, which some kernels lack (this one's CI machine did).
cluster_shape "" "" || cluster_fail "clearing the qdiscs failed"
if cluster_shape "" 10ms 2>/dev/null; then
  cluster_spawn 1 sink python3 -c "$sink" 1
  sleep 1
  rtt=$(cluster_exec 0 python3 -c "$send" "$node1" 0.001)
  cluster_wait 10 || cluster_fail "the sink failed"
  echo "cluster_shape '' 10ms: connect ${rtt} ms"
  awk -v r="$rtt" 'BEGIN { exit !(r >= 19 && r < 60) }' || cluster_fail "connect took $rtt ms, expected ~20"
else
  echo "no sch_netem in this kernel: delay not measured"
fi
echo "ok"
