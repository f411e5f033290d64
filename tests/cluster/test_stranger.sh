#!/usr/bin/env bash
# A stranger on the bridge (a namespace that is no node of the job) connects,
# while a 2 x 2 job runs, to the master port and to every port the nodes
# listen on: random bytes, a huge length, silence for 2 s, an immediate close;
# and while the job sets up, a scanner visits every port as soon as it opens
# (the ranks' direct-link ports too). The job finishes with the parameters of
# a 1 x 4 run over TCP that met no stranger, bit for bit.
# Usage: test_stranger.sh FSDPRUN CLUSTER_TRAIN WORKDIR
set -u
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/cluster.sh
. "$here/cluster.sh"
fsdprun=$1 prog=$2 work=$3
cluster_init 2 "$work"

# The stranger: rounds of hostile connections to each ADDR:PORT given.
# shellcheck disable=SC2016  # expanded by the stranger's bash
stranger='
for round in 1 2 3; do
  for target in "$@"; do
    host=${target%:*} port=${target#*:}
    if exec 3<>"/dev/tcp/$host/$port"; then head -c 512 /dev/urandom >&3; exec 3>&-; fi
    if exec 3<>"/dev/tcp/$host/$port"; then
      printf "\xff\xff\xff\xff\xff\xff\xff\x7f\xff\xff\xff\xff" >&3; sleep 0.2; exec 3>&-
    fi
    (exec 3<>"/dev/tcp/$host/$port" && sleep 2) &
    if exec 3<>"/dev/tcp/$host/$port"; then exec 3>&-; fi
    echo "round $round: $target"
  done 2>/dev/null
  sleep 0.5
done
wait
exit 0'

# One hostile visit to a port that just opened: a wrong hello (rank 7, as a
# direct link's first 4 bytes), 2 s of silence, random bytes.
# shellcheck disable=SC2016  # expanded by the stranger's bash
quick='
host=$1 port=$2
if exec 3<>"/dev/tcp/$host/$port"; then printf "\x07\x00\x00\x00" >&3; sleep 0.1; exec 3>&-; fi
(exec 3<>"/dev/tcp/$host/$port" && sleep 2) &
if exec 3<>"/dev/tcp/$host/$port"; then head -c 64 /dev/urandom >&3; exec 3>&-; fi
wait
exit 0'
# The scanner: while the job sets up, every port a node opens (the master
# port, then each rank's direct-link port until its neighbour connects) gets
# a visit at once.
scan() {
  local -A seen
  local end=$((SECONDS + 60)) i port
  # $$ is the test's shell: the scanner ends with it, even killed outright.
  while [[ ! -e $work/stop ]] && ((SECONDS < end)) && kill -0 $$ 2>/dev/null; do
    for i in 0 1; do
      for port in $(cluster_listening "$i"); do
        [[ -n ${seen[$i:$port]:-} ]] && continue
        seen[$i:$port]=1
        echo "visiting $(cluster_addr "$i"):$port"
        cluster_stranger_exec bash -c "$quick" quick "$(cluster_addr "$i")" "$port" 2>/dev/null &
      done
    done
    sleep 0.02
  done
  wait
}
_cluster_stranger_up
# KNOWN BUG (builds with Gloo, LibTorch 1.13): Gloo's listening port takes a
# stranger's connection that sends a plausible first bytes for one of its
# pairs; the job then hangs until the timeout. The scanner skips such builds.
if [[ $("$prog" --gloo) == 1 ]]; then
  echo "KNOWN BUG: this build connects ranks over Gloo, which a stranger during set-up can" \
    "derail; the scanner is off (the stranger still visits the master port once the job runs)"
  mkdir -p "$work" && : >"$work/scan.log"
  scanner=""
else
  scan >"$work/scan.log" 2>&1 &
  scanner=$!
fi

args=(--strategy full_shard --steps 40 --optimizer sgd --timeout 30)
cluster_fsdprun job "$fsdprun" 2 -- "$prog" "${args[@]}" --step-ms 100 --out "$work/job.pt"
cluster_wait_for "$work/job.node0.log" "step 2 " 90
targets=()
for i in 0 1; do
  for port in $(cluster_listening "$i"); do targets+=("$(cluster_addr "$i"):$port"); done
done
echo "listening once the job runs: ${targets[*]}"
cluster_stranger_spawn stranger bash -c "$stranger" stranger "${targets[@]}"
cluster_wait 120 || cluster_fail "the job (or the stranger) failed: ${CLUSTER_RC[*]}"
touch "$work/stop"
[[ -n $scanner ]] && wait "$scanner"
echo "the scanner's visits while the job set up: $(grep -c visiting "$work/scan.log")"
sed 's/^/  /' "$work/scan.log"
grep -q "round 3" "$work/stranger.log" || cluster_fail "the stranger did not finish its rounds"

cluster_spawn 0 ref env FSDP_SHM=0 "$fsdprun" --nproc-per-node 4 "$prog" "${args[@]}" --out "$work/ref.pt"
cluster_wait 90 || cluster_fail "the 1 x 4 reference run failed"
"$prog" --compare "$work/ref.pt" "$work/job.pt" --tol 0 ||
  cluster_fail "the job that met a stranger ended with other parameters"

# The job token (FSDP_JOB_TOKEN, which cluster_init exports to every node):
# the store (and the links) refuse each connection without it, and the rank
# says so once (Note [Job token]).
token_line="did not present this job's token"
grep -qF "$token_line" "$work"/job.node*.log ||
  cluster_fail "no rank reported the stranger's connections ('$token_line')"
echo "job token: the stranger's connections were reported"
echo "ok"
