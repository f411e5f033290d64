#!/usr/bin/env bash
# A lent GPU machine's minutes go to the GPU checks, not to compiling: build
# here against the torch that machine has (pip's 2.11.0+cu130, which
# scripts/setup.sh installs into .venv-2.11), carry the programs there, and
# run scripts/gpu_check.sh with them.
#
#   here:        scripts/gpu_carried.sh build    build-gpu/ (Release), then
#                                                build-gpu-slim/ (its programs
#                                                and ctest files, ~20 MB)
#   GPU machine: scripts/gpu_carried.sh check    with build-gpu-slim (and .gpu,
#                                                from ../shared/device/stage.sh,
#                                                for the fallback) carried
#                scripts/gpu_carried.sh run CMD...  CMD with the carried build's
#                                                paths set up (a benchmark)
#
# check makes the carried build's absolute paths hold there (/work/main, the
# build's folder name), puts that machine's torch and CUDA libraries first on
# LD_LIBRARY_PATH, and builds there instead (.gpu/build.sh) if the carried
# programs cannot start. DEADLINE (seconds, default 380) bounds gpu_check's
# steps; its other variables (ROUNDS, GPU_CHECK_JOBS, ...) pass through.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  build)
    programs=(comm_tests core_tests state_tests train_gpt fsdprun bench_gpu_step)
    FSDP_BUILD_DIR=build-gpu ./scripts/build.sh --torch 2.11 "${programs[@]}" || exit
    rm -rf build-gpu-slim && mkdir build-gpu-slim
    # Only these programs of bin/ (a build-gpu/ that built everything holds
    # ~80 MB of them; a device call carries 64 MiB in all).
    (cd build-gpu && find . -type f ! -name '*.o' ! -name '*.gch' ! -name '*.pch' ! -name '*.a' \
      ! -name '.ninja_*' ! -name build.ninja ! -path '*/Unity/*' ! -path './CMakeFiles/3.*' \
      ! -path './bin/*' -print0 | tar --null -T - -cf -) | tar -C build-gpu-slim -xf -
    mkdir -p build-gpu-slim/bin
    for p in "${programs[@]}"; do cp build-gpu/bin/"$p" build-gpu-slim/bin/; done
    du -sh build-gpu-slim
    ;;
  check | run)
    root=$PWD
    if [[ $root != /work/main ]]; then
      mkdir -p /work
      [[ -e /work/main ]] || ln -s "$root" /work/main
    fi
    [[ -e build-gpu ]] || ln -s build-gpu-slim build-gpu
    tp=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
    sp=$(dirname "$tp")
    LD_LIBRARY_PATH="$tp/lib:$(ls -d "$sp"/nvidia/*/lib | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_LIBRARY_PATH
    if [[ $1 == run ]]; then
      shift
      exec "$@"
    fi
    out=${OUT:-/tmp/gpu-check}
    mkdir -p "$out"
    if /work/main/build-gpu/bin/train_gpt --help >/dev/null 2>"$out/carried.txt"; then
      export GPU_BUILD_DIR=/work/main/build-gpu
      echo "gpu_carried: the carried build runs"
    else
      ldd /work/main/build-gpu/bin/train_gpt >>"$out/carried.txt" 2>&1
      echo "gpu_carried: the carried build does not run (carried.txt); building here"
      unset GPU_BUILD_DIR
    fi
    GPU_CHECK_DEADLINE=${DEADLINE:-380} exec bash scripts/gpu_check.sh
    ;;
  *)
    echo "usage: scripts/gpu_carried.sh build (here) | check | run CMD... (on the GPU machine)" >&2
    exit 2
    ;;
esac
