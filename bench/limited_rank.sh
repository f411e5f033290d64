#!/usr/bin/env bash
# Runs one rank (fsdprun sets RANK) under a memory limit of its own, then
# execs the command: bench/largest_model.sh's per-rank limit.
#
#   limited_rank.sh LIMIT_BYTES NAME CMD...
#
# The limit is, where the machine allows it, a cgroup of this rank's own
# (cgroup v2 memory.max, else cgroup v1 memory.limit_in_bytes, swap off in
# both), named NAME-rank$RANK: exceeding it gets the rank OOM-killed. Else
# RLIMIT_DATA (ulimit -d: heap and private mappings; allocations beyond it
# fail). Prints nothing; bench/largest_model.sh removes the cgroups.
set -euo pipefail
limit=$1 name=$2
shift 2
v2=/sys/fs/cgroup
v1=/sys/fs/cgroup/memory
if [[ -f $v2/cgroup.controllers ]] && grep -qw memory "$v2/cgroup.controllers"; then
  dir=$v2/$name-rank$RANK
  mkdir -p "$dir"
  echo "$limit" >"$dir/memory.max"
  if [[ -f $dir/memory.swap.max ]]; then echo 0 >"$dir/memory.swap.max"; fi
  echo $$ >"$dir/cgroup.procs"
elif [[ -d $v1 && -w $v1 ]]; then
  dir=$v1/$name-rank$RANK
  mkdir -p "$dir"
  echo "$limit" >"$dir/memory.limit_in_bytes"
  if [[ -f $dir/memory.memsw.limit_in_bytes ]]; then echo "$limit" >"$dir/memory.memsw.limit_in_bytes"; fi
  echo $$ >"$dir/cgroup.procs"
else
  ulimit -d $((limit / 1024))
fi
exec "$@"
