#!/usr/bin/env bash
# Installs the built libfsdp into a temporary prefix and builds the consumer
# project against it with find_package(fsdp), naming only that prefix: it must
# take the LibTorch libfsdp was built against (torch_dir) even where another
# LibTorch sits in /usr, and run on 2 ranks. Where another LibTorch is given
# (other_torch_dir), a consumer pointed at it must fail to configure with
# fsdpConfig.cmake's one-line error naming both (Note [The LibTorch the package
# was built against] in cmake/fsdpFindTorch.cmake).
set -euo pipefail
build_dir="$1"; source_dir="$2"; torch_dir="$3"; other_torch_dir="${4:-}"
# A folder of the same path every run, and ccache where there is one: CI's
# next run compiles the consumer from the cache (Note [One compiler cache] in
# scripts/ccache_env.sh) instead of parsing LibTorch again (~40 s of a core).
tmp="$build_dir/consumer_test"; rm -rf "$tmp"; mkdir -p "$tmp"; trap 'rm -rf "$tmp"' EXIT
launcher=()
if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
unset CMAKE_PREFIX_PATH Torch_DIR Torch_ROOT  # the prefix alone, as a user names it
cmake --install "$build_dir" --prefix "$tmp/prefix" > /dev/null
# No path of this machine in the exported targets (LibTorch's libraries, the
# OpenMP runtime): fsdpConfig.cmake links what it finds where the package is
# used, so a moved install links.
targets=("$tmp"/prefix/lib*/cmake/fsdp/fsdpTargets*.cmake)
[[ -f ${targets[0]} ]] || { echo "no fsdpTargets*.cmake installed under $tmp/prefix" >&2; exit 1; }
if grep -nE '"/|;/' "${targets[@]}" | grep -vF 'if(_IMPORT_PREFIX STREQUAL "/")'; then
  echo "absolute paths exported in fsdpTargets*.cmake (above)" >&2; exit 1
fi
configure() { cmake -S "$source_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" "$@"; }
# Each phase says how long it took: on a loaded machine this test is the one
# that compiles (CI's run of 2026-12-01 ran past ctest's limit with nothing
# said of where the time went).
t_phase=$SECONDS
phase() { echo "consumer test: $1 took $((SECONDS - t_phase)) s" >&2; t_phase=$SECONDS; }

if [[ -n $other_torch_dir ]]; then
  if configure -B "$tmp/build-other" -DTorch_DIR="$other_torch_dir" > "$tmp/other.log" 2>&1; then
    cat "$tmp/other.log"; echo "configured against $other_torch_dir, another LibTorch" >&2; exit 1
  fi
  # One line naming libfsdp's LibTorch, the other one, and the fix.
  grep -F "libfsdp: expected LibTorch" "$tmp/other.log" | grep -F "at $torch_dir (" |
    grep -F "got LibTorch" | grep -F "at $other_torch_dir." | grep -qF "Torch_DIR=$torch_dir " ||
    { cat "$tmp/other.log"; exit 1; }
  grep -F "libfsdp: expected" "$tmp/other.log"
  phase "configuring against the other LibTorch"
fi

configure -B "$tmp/build" > "$tmp/configure.log" || { cat "$tmp/configure.log"; exit 1; }
grep -qF "consumer: LibTorch at $torch_dir" "$tmp/configure.log" || { cat "$tmp/configure.log"; exit 1; }
phase configuring
cmake --build "$tmp/build" > "$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
phase building
# The run is bounded apart from the compiles: a stuck rank shows what the
# ranks printed, not ctest's timeout.
rc=0
out="$(timeout --kill-after=10 120 "$tmp/prefix/bin/fsdprun" --nproc-per-node 2 \
  "$tmp/build/consumer_app" 2>&1)" || rc=$?
echo "$out"
phase "running on 2 ranks"
((rc == 0)) || { echo "the consumer's run failed (exit $rc; 124 or 137: still running after 120 s)" >&2; exit 1; }
grep -q "\[rank0\]: consumer rank 0 counted 2" <<< "$out"
grep -q "\[rank1\]: consumer rank 1 counted 2" <<< "$out"
grep -q "\[rank0\]: fully_shard app rank 0 saved" <<< "$out"
grep -q "\[rank1\]: fully_shard app rank 1 saved" <<< "$out"
