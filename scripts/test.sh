#!/usr/bin/env bash
# The whole test suite: set up, build, run every ctest test against pip's
# torch 2.15 (build/, the primary target), then against Debian's LibTorch 1.13
# (build-1.13/) every test but the fault-injection, interop and benchmark
# ones (labels faults, interop, bench), which keeps CI under an hour on 2
# cores. Arguments go to both ctest runs instead (`-L comm`, `-R name`).
#   FSDP_TEST_TORCH=2.15 (or 1.13) runs one LibTorch only.
# Tests run one at a time: the multi-rank ones already use both cores, and
# their failure tests measure timeouts.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
which_torch="${FSDP_TEST_TORCH:-all}"
status=0
for torch in 2.15 1.13; do
  [[ $which_torch == all || $which_torch == "$torch" ]] || continue
  if [[ $torch == 2.15 ]]; then dir="${FSDP_BUILD_DIR:-build}"; else dir="build-1.13"; fi
  echo "=== LibTorch $torch: build into $dir/"
  FSDP_BUILD_DIR="$dir" ./scripts/build.sh --torch "$torch"
  echo "=== LibTorch $torch: tests"
  args=("$@")
  if [[ $torch == 1.13 && $# -eq 0 ]]; then args=(-LE 'faults|interop|bench'); fi
  ctest --test-dir "$dir" --output-on-failure "${args[@]}" || status=1
done
exit $status
