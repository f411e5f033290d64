#!/bin/sh
# End to end: a job whose rank 1 dies once, restarted by fsdprun
# --max-restarts, resumes from its latest complete checkpoint and ends with
# the same model and optimizer state, bit for bit, as an uninterrupted job.
# Usage: restart_resume_test.sh FSDPRUN RESUME_EXAMPLE WORKDIR
set -u
fsdprun=$1 prog=$2 work=$3
rm -rf "$work" && mkdir -p "$work/ref" "$work/run"
"$fsdprun" --nproc-per-node 2 "$prog" "$work/ref" 10 2 0 >"$work/ref.log" 2>&1 ||
  { cat "$work/ref.log"; echo "FAIL: the uninterrupted run failed"; exit 1; }
"$fsdprun" --nproc-per-node 2 --max-restarts 2 "$prog" "$work/run" 10 2 5 >"$work/run.log" 2>&1 ||
  { cat "$work/run.log"; echo "FAIL: the restarted run failed"; exit 1; }
cat "$work/run.log"
test -f "$work/run/died" || { echo "FAIL: rank 1 never died"; exit 1; }
grep -q "restarting all ranks" "$work/run.log" || { echo "FAIL: fsdprun did not restart"; exit 1; }
for f in model.safetensors optim.safetensors; do
  cmp "$work/ref/final/$f" "$work/run/final/$f" || { echo "FAIL: $f differs"; exit 1; }
done
echo "ok: resumed after a restart, final state bit-identical"
