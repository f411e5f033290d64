#!/usr/bin/env bash
# Configures and builds libfsdp (Release) with its tests, tools, examples and
# benchmarks.
#   scripts/build.sh                 against pip's torch 2.15 in .venv/, into build/
#   scripts/build.sh --torch 1.13    against Debian's LibTorch 1.13, into build-1.13/
#   scripts/build.sh --torch 2.11    against pip's torch 2.11 in .venv-2.11/, into build-2.11/
#   scripts/build.sh [--torch V] TARGET...   only those targets (and what they need)
#   scripts/build.sh [--torch V] --configure-only   configures, builds nothing
#   scripts/build.sh [--torch V] --build-only TARGET...   builds a configured folder
#                                    without configuring it again (6-15 s saved)
#   scripts/build.sh ... -DNAME=VALUE ...   that CMake setting too (FSDP_UNITY_BUILD=OFF)
# FSDP_TORCH (2.15, 2.11 or 1.13) may stand for --torch, FSDP_BUILD_DIR for the
# folder, FSDP_VENV (FSDP_VENV_211) for the virtual environment. ccache is used
# when installed.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH="${FSDP_TORCH:-2.15}"
if [[ ${1:-} == --torch ]]; then
  TORCH="$2"
  shift 2
fi
configure_only=0 build_only=0
if [[ ${1:-} == --configure-only ]]; then
  configure_only=1
  shift
elif [[ ${1:-} == --build-only ]]; then
  build_only=1
  shift
fi
targets=()
settings=()
for arg in "$@"; do
  if [[ $arg == -D* ]]; then settings+=("$arg"); else targets+=(--target "$arg"); fi
done

args=(-DCMAKE_BUILD_TYPE=Release -DFSDP_BUILD_TESTS=ON -DFSDP_BUILD_TOOLS=ON
      -DFSDP_BUILD_EXAMPLES=ON -DFSDP_BUILD_BENCH=ON)
case "$TORCH" in
  2.15 | 2.11)
    if [[ $TORCH == 2.15 ]]; then
      VENV="${FSDP_VENV:-.venv}" BUILD_DIR="${FSDP_BUILD_DIR:-build}"
    else
      VENV="${FSDP_VENV_211:-.venv-2.11}" BUILD_DIR="${FSDP_BUILD_DIR:-build-2.11}"
    fi
    torch_dir=$("$VENV/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
    # torch/ first: its lib/ must win over Debian's libtorch in /usr/lib when
    # TorchConfig.cmake looks for libtorch.so and libc10.so.
    args+=("-DCMAKE_PREFIX_PATH=$torch_dir;$torch_dir/share/cmake"
           "-DFSDP_PYTHON=$(cd "$VENV" && pwd)/bin/python")
    ;;
  1.13)
    VENV="${FSDP_VENV:-.venv}" BUILD_DIR="${FSDP_BUILD_DIR:-build-1.13}"
    # The interop tests need PyTorch: the venv's, where set up.
    if [ -x "$VENV/bin/python" ]; then args+=("-DFSDP_PYTHON=$(cd "$VENV" && pwd)/bin/python"); fi
    ;;
  *)
    echo "build.sh: unknown LibTorch '$TORCH': use --torch 2.15 or 2.11 (pip's wheels in .venv, .venv-2.11) or --torch 1.13 (Debian's)" >&2
    exit 2
    ;;
esac
if command -v ccache >/dev/null; then args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
. scripts/ccache_env.sh

if ((build_only == 0)); then cmake -S . -B "$BUILD_DIR" -G Ninja "${args[@]}" "${settings[@]}"; fi
if ((configure_only)); then exit 0; fi
cmake --build "$BUILD_DIR" -j "$(nproc)" "${targets[@]}"
