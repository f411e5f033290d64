#!/usr/bin/env bash
# The whole test suite, as CI runs it (bash .ci/run, a fresh 2-core machine,
# 90 minutes at most; the aim is 40). Stages (FSDP_TEST_STAGES, default
# "format 2.15 2.11 1.13 tsan"):
#   format  scripts/check_format.sh: clang-format would change no file.
#   2.15    pip's torch 2.15 (the primary target) into build/; every ctest test.
#   2.11    pip's torch 2.11 (.venv-2.11/, an older wheel users have, which
#           exports libstdc++'s std::filesystem: Note [libstdc++ before
#           LibTorch]) into build-2.11/, at -O1 (its tests check behaviour,
#           not speed; -O3 costs a fifth more of this stage's compiling): the
#           library and what the core, state and launch tests run
#           (std_bindings among them); those tests.
#   1.13    Debian's LibTorch 1.13 into build-1.13/ with AddressSanitizer and
#           UndefinedBehaviorSanitizer (FSDP_TEST_SANITIZE_113, default
#           "address,undefined"; empty for a plain build), only what its tests
#           run; every test but the fault-injection, interop, benchmark,
#           fuzzing and simulated-cluster ones (labels faults, interop, bench,
#           fuzz, cluster: the 2.15 stage runs the cluster tests, ~1.5 min;
#           under ASan they would add minutes CI has not got; without
#           sanitizers they pass on 1.13 too, see docs/cluster.md; the fuzz
#           target links no LibTorch, so one stage runs it), the full
#           test_collectives sweep (its paths run in the 2 MiB sweeps and
#           test_routes) and test_collectives_without_shm
#           (110 s under ASan: Gloo above the direct-link size, which
#           test_collectives_without_direct_links runs for every size).
#   tsan    pip's torch 2.15 into build-tsan/ with ThreadSanitizer: the comm
#           tests but the fault-injection ones and the two full sweeps
#           (test_collectives, test_collectives_over_links; the threads
#           they use run in test_direct_links, test_shm_links, test_routes
#           and the 2 MiB sweeps), and the core tests labelled tsan (the
#           optimizer's thread beside backward: test_step_during_backward,
#           test_cpu_offload), which build the whole library and a program
#           of their own (core_tsan_tests).
# Every target is compiled with -Werror (FSDP_TEST_WERROR, default ON), with
# LibTorch's headers precompiled (Note [Library build time] in
# src/CMakeLists.txt, Note [Test build time] in tests/CMakeLists.txt). Each
# stage prints its time (docs/building.md has the figures). Sanitizer run-time
# options and suppressions: scripts/sanitizers/ (Note [Sanitizer builds] in
# cmake/fsdpSanitizers.cmake). Not run here: clang-tidy (scripts/clang_tidy.sh,
# ~8 minutes on 2 cores).
# Arguments go to the 2.15, 2.11 and 1.13 ctest runs instead (`-L comm`,
# `-R name`) and skip the tsan stage. FSDP_TEST_TORCH=2.15 (or 2.11, 1.13) is
# the same as FSDP_TEST_STAGES=2.15.
# Tests run FSDP_TEST_JOBS at a time (default 3, more than CI's 2 cores: the
# suite must hold under oversubscription, and the fault tests spend most of
# their time waiting out timeouts); the simulated-cluster harness test, which
# times its links, runs alone (RUN_SERIAL).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

stages="${FSDP_TEST_STAGES:-format 2.15 2.11 1.13 tsan}"
werror="${FSDP_TEST_WERROR:-ON}"
jobs="${FSDP_TEST_JOBS:-3}"
sanitize_113="${FSDP_TEST_SANITIZE_113-address,undefined}"
if [[ -n ${FSDP_TEST_TORCH:-} ]]; then stages="$FSDP_TEST_TORCH"; fi
if (($# > 0)); then stages="${stages//tsan/}"; fi
# For the builds and the tests that compile (install_and_find_package).
. scripts/ccache_env.sh
status=0
failed=()
t_start=$SECONDS
t_last=$SECONDS
# ccache's hits and misses so far ("hits misses"; "0 0" without ccache).
ccache_counts() {
  command -v ccache > /dev/null || { echo "0 0"; return; }
  ccache --print-stats 2> /dev/null | awk '$1 ~ /^(direct|preprocessed)_cache_hit$/ { h += $2 }
    $1 == "cache_miss" { m += $2 } END { print h + 0, m + 0 }'
}
read -r cc_hits cc_misses < <(ccache_counts) || true
# Records how long the stage that just ended took, and what the compiler cache
# gave it: a slow CI run then says whether it compiled anew or ran slowly.
lap() {
  local hits misses cache=""
  read -r hits misses < <(ccache_counts) || true
  if ((hits + misses > cc_hits + cc_misses)); then
    cache=", ccache $((hits - cc_hits)) hits, $((misses - cc_misses)) misses"
  fi
  cc_hits=$hits cc_misses=$misses
  echo "=== $1: $((SECONDS - t_last)) s (total $(((SECONDS - t_start) / 60)) min$cache)"
  t_last=$SECONDS
}
fail() {
  status=1
  failed+=("$1")
}
has_stage() { [[ " $stages " == *" $1 "* ]]; }
# build_for_tests TORCH DIR SANITIZERS OPTIMISATION CTEST_ARGS...: configures
# DIR (Release at OPTIMISATION, e.g. -O3), then builds only the executables
# that the selected tests run, and what they link (all of libfsdp, or for the
# comm tests its comm layer: Note [The comm layer builds alone] in
# src/CMakeLists.txt).
build_for_tests() {
  local torch="$1" dir="$2" sanitize="$3" opt="$4" targets
  shift 4
  export FSDP_WERROR=$werror FSDP_SANITIZE=$sanitize FSDP_BUILD_DIR=$dir
  ./scripts/build.sh --torch "$torch" --configure-only "-DCMAKE_CXX_FLAGS_RELEASE=$opt -DNDEBUG" &&
    mapfile -t targets < <(./scripts/ctest_targets.sh "$dir" "$@") &&
    ./scripts/build.sh --torch "$torch" --build-only "${targets[@]}"
}

if has_stage format; then
  echo "=== format: scripts/check_format.sh"
  ./scripts/check_format.sh || fail format
  lap format
fi

if has_stage 2.15; then
  echo "=== LibTorch 2.15: build into ${FSDP_BUILD_DIR:-build}/ (-Werror: $werror)"
  FSDP_WERROR=$werror FSDP_SANITIZE= ./scripts/build.sh --torch 2.15 || fail "2.15 build"
  lap "2.15 build"
  echo "=== LibTorch 2.15: tests"
  ctest -j "$jobs" --test-dir "${FSDP_BUILD_DIR:-build}" --output-on-failure "$@" || fail "2.15 tests"
  lap "2.15 tests"
fi

if has_stage 2.11; then
  # The older wheel users still have (it exports libstdc++'s std::filesystem,
  # Note [libstdc++ before LibTorch]): the library and what the core, state
  # and launch tests run, std_bindings among them.
  args=("$@")
  if (($# == 0)); then args=(-L 'core|state|launch'); fi
  echo "=== LibTorch 2.11: build into build-2.11/ (-Werror: $werror)"
  (build_for_tests 2.11 build-2.11 "" -O1 "${args[@]}") || fail "2.11 build"
  lap "2.11 build"
  echo "=== LibTorch 2.11: tests"
  ctest -j "$jobs" --test-dir build-2.11 --output-on-failure "${args[@]}" || fail "2.11 tests"
  lap "2.11 tests"
fi

if has_stage 1.13; then
  # Only what these tests run is built (the benchmarks are not).
  args=("$@")
  if (($# == 0)); then args=(-LE 'faults|interop|bench|cluster|fuzz' -E '^test_collectives(_without_shm)?$'); fi
  echo "=== LibTorch 1.13 (sanitizers: ${sanitize_113:-none}): build into build-1.13/ (-Werror: $werror)"
  (build_for_tests 1.13 build-1.13 "$sanitize_113" -O3 "${args[@]}") || fail "1.13 build"
  lap "1.13 build"
  echo "=== LibTorch 1.13: tests"
  (
    . scripts/sanitizers/env.sh
    ctest -j "$jobs" --test-dir build-1.13 --output-on-failure "${args[@]}"
  ) || fail "1.13 tests"
  lap "1.13 tests"
fi

if has_stage tsan; then
  # Not the full sweeps (see the header).
  tsan_args=(-L 'comm|tsan' -LE faults -E '^test_collectives(_over_links)?$')
  echo "=== ThreadSanitizer (LibTorch 2.15): build the comm and tsan-labelled tests into build-tsan/"
  (build_for_tests 2.15 build-tsan thread -O3 "${tsan_args[@]}") || fail "tsan build"
  lap "tsan build"
  echo "=== ThreadSanitizer: tests"
  (
    . scripts/sanitizers/env.sh
    ctest -j "$jobs" --test-dir build-tsan --output-on-failure "${tsan_args[@]}"
  ) || fail "tsan tests"
  lap "tsan tests"
fi

if ((status != 0)); then echo "=== FAILED: ${failed[*]}"; fi
exit $status
