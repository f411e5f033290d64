#!/usr/bin/env bash
# A simulated cluster on one machine (docs/cluster.md): K nodes, each a
# network, IPC, UTS and mount namespace of its own (hostname node<i>, a private
# tmpfs on /dev/shm), joined by veth pairs to a bridge that lives in a "switch"
# namespace of its own. Nothing is added to the root namespace; every
# namespace is removed on exit (trap), and stale ones of a harness whose
# creator died are swept at the next start.
#
# Sourced by the tests (tests/cluster/test_*.sh):
#   . tests/cluster/cluster.sh
#   cluster_init 2 "$workdir"                  # 2 nodes (or exit 77: cannot)
#   cluster_shape 1gbit 0.5ms                  # optional: every node's link
#   cluster_fsdprun job "$fsdprun" 2 -- prog args   # fsdprun on every node
#   cluster_wait 60 || cluster_fail "the job failed"
# or run as a command (see cluster_main below, and --help).
#
# Addresses: node i is 10.231.0.(i+1) on eth0; cluster_stranger_spawn's
# namespace is 10.231.0.200. The master is node 0, port CLUSTER_PORT (29500).
# Every command started in a node sees FSDP_JOB_TOKEN (random per
# cluster_init), CLUSTER_NODE_RANK, CLUSTER_NNODES and CLUSTER_MASTER_ADDR,
# and is SIGKILLed if the shell that started it dies.

CLUSTER_PREFIX=fsdpc
CLUSTER_SUBNET=10.231.0
CLUSTER_PORT=${CLUSTER_PORT:-29500}
CLUSTER_ID=""
CLUSTER_NNODES=0
CLUSTER_DIR=""
CLUSTER_LOGS_SHOWN=0
CLUSTER_PIDS=()    # background commands started by cluster_spawn, not yet waited for
CLUSTER_NAMES=()   # their names (logs: $CLUSTER_DIR/<name>.log)
CLUSTER_RC=()      # exit status of each, by position, after cluster_wait
CLUSTER_STRANGER=0

# Ends the test as skipped (ctest SKIP_RETURN_CODE 77) with a one-line reason.
cluster_skip() {
  echo "SKIP: $*"
  exit 77
}

# The start time of process $1 (clock ticks since boot), or nothing if gone.
_cluster_start_time() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
  stat=${stat##*) }       # fields after "(comm) ", from field 3 on
  local fields
  read -r -a fields <<<"$stat"
  echo "${fields[19]}"
}

# Kills every process in network namespace $1, then deletes it.
_cluster_remove_ns() {
  local ns=$1 pids i
  for i in 1 2 3 4 5 6 7 8 9 10; do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [[ -z $pids ]] && break
    # shellcheck disable=SC2086
    kill -9 $pids 2>/dev/null
    sleep 0.1
  done
  ip netns del "$ns" 2>/dev/null
  rm -rf "/etc/netns/$ns"  # cluster_hosts' file
}

# Removes the namespaces of harnesses whose creator is dead (a test killed by
# SIGKILL or a ctest timeout never ran its trap). Names carry the creator's
# pid and start time: "fsdpc-<pid>.<start>-<role>".
cluster_sweep() {
  local ns id pid start
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ $ns =~ ^${CLUSTER_PREFIX}-([0-9]+)\.([0-9]+)- ]] || continue
    pid=${BASH_REMATCH[1]} start=${BASH_REMATCH[2]}
    id=$(_cluster_start_time "$pid")
    [[ $id == "$start" ]] && continue  # its creator still runs
    echo "cluster: removing stale namespace $ns (creator $pid is gone)" >&2
    _cluster_remove_ns "$ns"
  done
}

# Why this machine cannot make the cluster, or nothing when it can.
cluster_unavailable() {
  if [[ $(id -u) != 0 ]]; then echo "needs root (network namespaces)"; return; fi
  local cmd
  for cmd in ip unshare setpriv mount; do
    command -v "$cmd" >/dev/null || { echo "no '$cmd' (apt-get install iproute2 util-linux)"; return; }
  done
}

# The namespace of role $1 (sw, x, n0, n1, ...).
_cluster_ns() { echo "$CLUSTER_ID-$1"; }

# Runs `ip` inside the namespace of role $1; fails the test on error.
_cluster_ip() {
  local role=$1
  shift
  ip -n "$(_cluster_ns "$role")" "$@" || cluster_fail "ip -n $(_cluster_ns "$role") $* failed"
}

# Creates the namespace of role $1 and connects it to the bridge as $2, with
# MTU CLUSTER_MTU (default 1500; 9000 for a jumbo-frame cluster network).
_cluster_attach() {
  local role=$1 addr=$2 ns mtu=${CLUSTER_MTU:-1500}
  ns=$(_cluster_ns "$role")
  ip netns add "$ns" || cluster_fail "ip netns add $ns failed"
  _cluster_ip "$role" link set lo up
  _cluster_ip sw link add "v$role" mtu "$mtu" type veth peer name eth0 mtu "$mtu" netns "$ns"
  _cluster_ip sw link set "v$role" master br0 up
  _cluster_ip "$role" addr add "$addr/24" dev eth0
  _cluster_ip "$role" link set eth0 up
}

# cluster_init K [DIR]: K nodes; logs and work files under DIR (made empty;
# default a temporary folder removed on exit). Skips the test (exit 77) when
# namespaces cannot be made here.
cluster_init() {
  local k=$1 why
  why=$(cluster_unavailable)
  [[ -z $why ]] || cluster_skip "simulated cluster: $why"
  cluster_sweep
  CLUSTER_ID="$CLUSTER_PREFIX-$$.$(_cluster_start_time $$)"
  CLUSTER_NNODES=$k
  if [[ -n ${2:-} ]]; then
    CLUSTER_DIR=$2
    rm -rf "$CLUSTER_DIR" && mkdir -p "$CLUSTER_DIR"
  else
    CLUSTER_DIR=$(mktemp -d /tmp/fsdp-cluster.XXXXXX)
    CLUSTER_TMP=1
  fi
  trap _cluster_on_exit EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
  trap 'exit 129' HUP
  local sw
  sw=$(_cluster_ns sw)
  if ! ip netns add "$sw" 2>/dev/null; then
    CLUSTER_ID=""
    cluster_skip "simulated cluster: cannot create a network namespace here (ip netns add failed)"
  fi
  _cluster_ip sw link set lo up
  _cluster_ip sw link add br0 type bridge
  _cluster_ip sw link set br0 up
  local i
  for ((i = 0; i < k; ++i)); do _cluster_attach "n$i" "$CLUSTER_SUBNET.$((i + 1))"; done
  FSDP_JOB_TOKEN=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
  CLUSTER_MASTER_ADDR="$CLUSTER_SUBNET.1"
  export FSDP_JOB_TOKEN CLUSTER_MASTER_ADDR CLUSTER_NNODES
}

# The address of node $1.
cluster_addr() { echo "$CLUSTER_SUBNET.$(($1 + 1))"; }

# Sets (or clears, with "" "") one qdisc on $dev in namespace role $1.
_cluster_qdisc() {
  local role=$1 dev=$2 rate=$3 delay=$4 ns burst=${CLUSTER_TBF_BURST:-256kb}
  ns=$(_cluster_ns "$role")
  tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null
  if [[ -n $delay && -n $rate ]]; then
    tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$delay" limit 100000 &&
      tc -n "$ns" qdisc add dev "$dev" parent 1:1 handle 10: tbf rate "$rate" burst "$burst" latency 100ms
  elif [[ -n $delay ]]; then
    tc -n "$ns" qdisc add dev "$dev" root netem delay "$delay" limit 100000
  elif [[ -n $rate ]]; then
    tc -n "$ns" qdisc add dev "$dev" root tbf rate "$rate" burst "$burst" latency 100ms
  fi
}

# cluster_shape RATE DELAY [NODE...]: limits every node's link (or those
# given) to RATE in each direction (tc tbf: "1gbit", "100mbit"; "" for no
# limit) and delays what each node sends by DELAY (netem: "0.5ms"; "" for
# none): between two nodes, one-way latency DELAY, round trip 2 x DELAY.
# Returns non-zero (with a message) when tc or its qdiscs are missing.
cluster_shape() {
  local rate=$1 delay=$2 i
  shift 2
  command -v tc >/dev/null || { echo "cluster_shape: no 'tc' (apt-get install iproute2)" >&2; return 1; }
  local targets=("$@")
  if ((${#targets[@]} == 0)); then
    for ((i = 0; i < CLUSTER_NNODES; ++i)); do targets+=("$i"); done
  fi
  for i in "${targets[@]}"; do
    # Out of the node: rate and delay; into it (the switch's port): rate.
    if ! _cluster_qdisc "n$i" eth0 "$rate" "$delay" || ! _cluster_qdisc sw "vn$i" "$rate" ""; then
      echo "cluster_shape: tc failed on node $i (is sch_tbf, or for a delay sch_netem, in this kernel?)" >&2
      return 1
    fi
  done
}

# Sets CLUSTER_ARGV to the command line that runs $2... in node $1: its own
# hostname, IPC namespace and /dev/shm; every step execs the next, so the
# command is a child of this shell and dies with it (--pdeathsig).
_cluster_argv() {
  local node=$1
  shift
  # shellcheck disable=SC2016  # $1 is sh's, not ours
  CLUSTER_ARGV=(env "CLUSTER_NODE_RANK=$node" ip netns exec "$(_cluster_ns "n$node")"
    unshare --ipc --uts --mount --propagation private --
    sh -c 'hostname "$1" && mount -t tmpfs -o size=512m tmpfs /dev/shm || exit 125
           shift; exec setpriv --pdeathsig KILL -- "$@"' sh "node$node" "$@")
}

# cluster_hosts NODE LINE...: node NODE's /etc/hosts is localhost's lines
# and LINEs ("10.231.0.1 node0"): `ip netns exec` mounts /etc/netns/<ns>/hosts
# over /etc/hosts for what runs in the node.
cluster_hosts() {
  local node=$1 dir
  shift
  dir="/etc/netns/$(_cluster_ns "n$node")"
  mkdir -p "$dir" || cluster_fail "cannot make $dir"
  printf '%s\n' "127.0.0.1 localhost" "::1 localhost" "$@" >"$dir/hosts"
}

# cluster_exec NODE CMD...: runs CMD in node NODE in the foreground.
cluster_exec() {
  _cluster_argv "$@"
  "${CLUSTER_ARGV[@]}"
}

# cluster_spawn NODE NAME CMD...: CMD in node NODE in the background, output
# to $CLUSTER_DIR/NAME.log; cluster_wait collects it.
cluster_spawn() {
  local node=$1 name=$2
  shift 2
  _cluster_argv "$node" "$@"
  "${CLUSTER_ARGV[@]}" >"$CLUSTER_DIR/$name.log" 2>&1 &
  CLUSTER_PIDS+=($!)
  CLUSTER_NAMES+=("$name")
}

# cluster_spawn_all NAME CMD...: CMD on every node (NAME.node<i>.log);
# CLUSTER_NODE_RANK tells each which it is.
cluster_spawn_all() {
  local name=$1 i
  shift
  for ((i = 0; i < CLUSTER_NNODES; ++i)); do cluster_spawn "$i" "$name.node$i" "$@"; done
}

# cluster_fsdprun NAME FSDPRUN NPROC [FSDPRUN FLAGS...] -- PROGRAM ARGS...:
# on every node i, fsdprun --nnodes K --node-rank i --nproc-per-node NPROC
# --master-addr <node 0> --master-port CLUSTER_PORT [flags] PROGRAM ARGS, in
# the background (NAME.node<i>.log).
cluster_fsdprun() {
  local name=$1 fsdprun=$2 nproc=$3 i
  shift 3
  local flags=()
  while (($# > 0)) && [[ $1 != -- ]]; do flags+=("$1"); shift; done
  [[ ${1:-} == -- ]] && shift
  for ((i = 0; i < CLUSTER_NNODES; ++i)); do
    cluster_spawn "$i" "$name.node$i" "$fsdprun" --nnodes "$CLUSTER_NNODES" --node-rank "$i" \
      --nproc-per-node "$nproc" --master-addr "$CLUSTER_MASTER_ADDR" \
      --master-port "$CLUSTER_PORT" "${flags[@]}" "$@"
  done
}

# Kills every process in every node's (and the stranger's) namespace.
cluster_kill_all() {
  local i pids
  for ((i = 0; i < CLUSTER_NNODES; ++i)); do
    pids=$(ip netns pids "$(_cluster_ns "n$i")" 2>/dev/null)
    # shellcheck disable=SC2086
    [[ -n $pids ]] && kill -9 $pids 2>/dev/null
  done
  if ((CLUSTER_STRANGER)); then
    pids=$(ip netns pids "$(_cluster_ns x)" 2>/dev/null)
    # shellcheck disable=SC2086
    [[ -n $pids ]] && kill -9 $pids 2>/dev/null
  fi
  return 0
}

# cluster_wait SECONDS: waits for everything spawned since the last wait;
# CLUSTER_RC[k] is the status of the k-th. At the deadline kills every
# process of the cluster and returns 124; else returns 0 when all exited 0,
# 1 otherwise.
cluster_wait() {
  local deadline=$((SECONDS + $1)) k alive timed_out=0
  CLUSTER_RC=()
  while true; do
    alive=0
    for k in "${!CLUSTER_PIDS[@]}"; do kill -0 "${CLUSTER_PIDS[$k]}" 2>/dev/null && alive=1; done
    ((alive)) || break
    if ((SECONDS >= deadline)); then
      echo "cluster_wait: still running after $1 s; killing the cluster's processes" >&2
      timed_out=1
      cluster_kill_all
    fi
    sleep 0.1
  done
  local status=0
  for k in "${!CLUSTER_PIDS[@]}"; do
    wait "${CLUSTER_PIDS[$k]}"
    CLUSTER_RC[k]=$?
    ((CLUSTER_RC[k] == 0)) || status=1
  done
  CLUSTER_PIDS=()
  CLUSTER_NAMES=()
  ((timed_out)) && return 124
  return $status
}

# cluster_wait_for FILE PATTERN SECONDS: until FILE (a log) has a line
# matching PATTERN; fails the test after SECONDS.
cluster_wait_for() {
  local deadline=$((SECONDS + $3))
  until grep -q -- "$2" "$1" 2>/dev/null; do
    ((SECONDS < deadline)) || cluster_fail "no '$2' in $(basename "$1") after $3 s"
    sleep 0.1
  done
}

# cluster_cut_link NODE: the node's port on the switch goes down; nothing it
# sends (a FIN, a RST) reaches anyone any more.
cluster_cut_link() { _cluster_ip sw link set "vn$1" down; }

# cluster_kill_node NODE: cuts the node's link, then SIGKILLs every process
# in it, as when a machine loses power.
cluster_kill_node() {
  local pids
  cluster_cut_link "$1"
  pids=$(ip netns pids "$(_cluster_ns "n$1")" 2>/dev/null)
  # shellcheck disable=SC2086
  [[ -n $pids ]] && kill -9 $pids 2>/dev/null
  return 0
}

# cluster_node_pids NODE PROGRAM: pids of the node's processes whose argv[0]
# is PROGRAM (the ranks, not the fsdprun that names PROGRAM among its args).
cluster_node_pids() {
  local pid argv0
  for pid in $(ip netns pids "$(_cluster_ns "n$1")" 2>/dev/null); do
    argv0=$(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | head -n 1)
    [[ $argv0 == "$2" ]] && echo "$pid"
  done
  return 0
}

# Makes the stranger's namespace (10.231.0.200 on the bridge) if not yet.
_cluster_stranger_up() {
  if ((!CLUSTER_STRANGER)); then
    _cluster_attach x "$CLUSTER_SUBNET.200"
    CLUSTER_STRANGER=1
  fi
}

# cluster_stranger_exec CMD...: CMD in the foreground in a namespace on the
# bridge that is no node of the job (10.231.0.200).
cluster_stranger_exec() {
  _cluster_stranger_up
  ip netns exec "$(_cluster_ns x)" setpriv --pdeathsig KILL -- "$@"
}

# cluster_stranger_spawn NAME CMD...: the same in the background, as
# cluster_spawn (NAME.log, collected by cluster_wait).
cluster_stranger_spawn() {
  local name=$1
  shift
  _cluster_stranger_up
  ip netns exec "$(_cluster_ns x)" setpriv --pdeathsig KILL -- "$@" >"$CLUSTER_DIR/$name.log" 2>&1 &
  CLUSTER_PIDS+=($!)
  CLUSTER_NAMES+=("$name")
}

# cluster_listening NODE: the TCP ports something listens on in the node.
cluster_listening() {
  ip netns exec "$(_cluster_ns "n$1")" ss -Hltn 2>/dev/null |
    awk '{n = split($4, a, ":"); print a[n]}' | sort -un
}

# Prints every log of this cluster (once).
cluster_show_logs() {
  ((CLUSTER_LOGS_SHOWN)) && return 0
  CLUSTER_LOGS_SHOWN=1
  local f
  for f in "$CLUSTER_DIR"/*.log; do
    [[ -e $f ]] || continue
    echo "----- $(basename "$f") (last 200 lines)"
    tail -n 200 "$f"
  done
  echo "----- end of logs"
}

# cluster_fail MESSAGE: prints the logs and MESSAGE, exits 1.
cluster_fail() {
  cluster_show_logs
  echo "FAIL: $*"
  exit 1
}

# Removes everything the cluster made. Safe to call twice.
cluster_cleanup() {
  [[ -n $CLUSTER_ID ]] || return 0
  cluster_kill_all
  local i
  for ((i = 0; i < CLUSTER_NNODES; ++i)); do _cluster_remove_ns "$(_cluster_ns "n$i")"; done
  ((CLUSTER_STRANGER)) && _cluster_remove_ns "$(_cluster_ns x)"
  _cluster_remove_ns "$(_cluster_ns sw)"
  for pid in "${CLUSTER_PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  CLUSTER_PIDS=()
  CLUSTER_ID=""
}

_cluster_on_exit() {
  local status=$?
  if ((status != 0 && status != 77)) && [[ -n $CLUSTER_DIR ]]; then cluster_show_logs; fi
  cluster_cleanup
  [[ ${CLUSTER_TMP:-0} == 1 ]] && rm -rf "$CLUSTER_DIR"
  exit $status
}

cluster_usage() {
  cat <<'EOF'
Usage: tests/cluster/cluster.sh [options] -- PROGRAM [ARGS...]
Runs a job on a simulated cluster of network namespaces (as root) and prints
each node's output; exits non-zero if any node failed.
  --nodes K            nodes (default 2)
  --nproc-per-node P   ranks per node (default 1)
  --rate R             limit every node's link to R each way (tc: 1gbit)
  --delay D            one-way delay between nodes (netem: 0.5ms)
  --fsdprun PATH       run PROGRAM under PATH --nnodes K --node-rank i ...
                       (default: build/bin/fsdprun next to this script's tree)
  --each               run PROGRAM as is on every node instead (it sees
                       CLUSTER_NODE_RANK, CLUSTER_NNODES, CLUSTER_MASTER_ADDR)
  --timeout S          kill everything after S seconds (default 600)
  --dir DIR            keep the logs in DIR (default: a temporary folder)
EOF
}

# The command-line entry: cluster.sh [options] -- PROGRAM ARGS.
cluster_main() {
  local nnodes=2 nproc=1 rate="" delay="" each=0 timeout=600 dir=""
  local fsdprun
  fsdprun="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/build/bin/fsdprun"
  while (($# > 0)); do
    case $1 in
      --nodes) nnodes=$2; shift 2 ;;
      --nproc-per-node) nproc=$2; shift 2 ;;
      --rate) rate=$2; shift 2 ;;
      --delay) delay=$2; shift 2 ;;
      --fsdprun) fsdprun=$2; shift 2 ;;
      --each) each=1; shift ;;
      --timeout) timeout=$2; shift 2 ;;
      --dir) dir=$2; shift 2 ;;
      -h | --help) cluster_usage; return 0 ;;
      --) shift; break ;;
      *) echo "cluster.sh: unknown option '$1'" >&2; cluster_usage >&2; return 2 ;;
    esac
  done
  (($# > 0)) || { cluster_usage >&2; return 2; }
  cluster_init "$nnodes" "$dir"
  if [[ -n $rate || -n $delay ]]; then cluster_shape "$rate" "$delay" || return 1; fi
  if ((each)); then
    cluster_spawn_all run "$@"
  else
    cluster_fsdprun run "$fsdprun" "$nproc" -- "$@"
  fi
  local status=0 i
  cluster_wait "$timeout" || status=$?
  for ((i = 0; i < nnodes; ++i)); do
    sed "s/^/[node$i] /" "$CLUSTER_DIR/run.node$i.log"
  done
  CLUSTER_LOGS_SHOWN=1
  return $status
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  cluster_main "$@"
  exit $?
fi
