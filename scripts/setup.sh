#!/usr/bin/env bash
# Installs what libfsdp needs to build, test and run. Safe to run any number
# of times: it installs just what is missing.
#   - Debian's packages (build tools, Gloo, LibTorch 1.13 for the small set-up,
#     googletest, json, CLI11, Open MPI's mpirun, iproute2 for the
#     simulated-cluster tests);
#   - a project-local virtual environment, .venv/ (FSDP_VENV overrides), with
#     pip's torch 2.15.0 (the primary LibTorch: its torch/lib, torch/include
#     and torch/share/cmake, and PyTorch itself for the interop tests and the
#     side-by-side benchmark), numpy and safetensors;
#   - a second one, .venv-2.11/ (FSDP_VENV_211 overrides), with pip's torch
#     2.11.0, the older wheel users still have: it exports libstdc++'s
#     std::filesystem (Note [libstdc++ before LibTorch]); scripts/test.sh's
#     2.11 stage builds against it.
#   scripts/setup.sh           what the build, the tests and the demo need
#   scripts/setup.sh --bench   also gnuplot (bench/report.sh draws its chart)
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.15.0
TORCH_211_VERSION=2.11.0

PACKAGES=(
  cmake ninja-build g++ pkg-config python3 ccache
  libtorch-dev          # LibTorch 1.13 (the small, quick set-up; scripts/build.sh --torch 1.13)
  libgloo-dev           # Gloo, called directly for collectives with LibTorch 1.13
  libopenblas0-pthread  # without it LibTorch 1.13's matmuls use the reference BLAS (~13x slower)
  googletest libgtest-dev
  nlohmann-json3-dev libcli11-dev
  clang-14 libclang-rt-14-dev  # libFuzzer + ASan for the checkpoint loader's fuzz target
  clang-format-14       # scripts/check_format.sh (CI checks the format first)
  openmpi-bin           # mpirun, for the launcher tests (libfsdp reads its OMPI_COMM_WORLD_*)
  iproute2 util-linux   # the simulated cluster's namespaces, veths, tc (tests/cluster, docs/cluster.md)
)
if [[ ${1:-} == --bench ]]; then
  PACKAGES+=(gnuplot-nox)  # bench/report.sh's PNG chart
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
if ((${#missing[@]} == 0)); then
  echo "setup: all ${#PACKAGES[@]} Debian packages are installed"
else
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The virtual environments with pip's torch (what C++ users of LibTorch 2.x
# have: its CMake package is found through torch.utils.cmake_prefix_path).
# venv_ready DIR VERSION: DIR has torch VERSION, numpy and safetensors.
venv_ready() {
  "$1/bin/python" - "$2" 2>/dev/null <<'PY'
import sys, torch, numpy, safetensors
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] else 1)
PY
}
# venv_with_torch DIR VERSION: makes DIR venv_ready.
venv_with_torch() {
  local venv="$1" version="$2"
  if venv_ready "$venv" "$version"; then
    echo "setup: $venv has torch $version"
    return
  fi
  echo "setup: installing torch $version, numpy and safetensors into $venv (a few GiB: the wheel is a CUDA build)"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$version" numpy safetensors
}
# Disk first: a full disk makes pip fail halfway, after minutes. A venv is
# about 5 GiB (the CUDA wheels), the four test builds about 8 GiB more.
need_gib=8
venv_ready "${FSDP_VENV:-.venv}" "$TORCH_VERSION" || need_gib=$((need_gib + 6))
venv_ready "${FSDP_VENV_211:-.venv-2.11}" "$TORCH_211_VERSION" || need_gib=$((need_gib + 6))
free_gib=$(($(df -Pk . | awk 'NR == 2 { print $4 }') / 1048576))
if ((free_gib < need_gib)); then
  echo "setup: $PWD's disk has ${free_gib} GiB free and the venvs and builds need about ${need_gib} GiB; free some (old clones, build-* folders) and rerun scripts/setup.sh" >&2
  exit 1
fi
# Debian's python3 makes venvs only with python3-venv (ensurepip).
if ! python3 -c "import ensurepip" 2> /dev/null; then
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-venv
fi
# Side by side: each install is a minute of one core unpacking wheels, and
# a fresh machine has two.
venv_with_torch "${FSDP_VENV:-.venv}" "$TORCH_VERSION" &
venv_215=$!
venv_with_torch "${FSDP_VENV_211:-.venv-2.11}" "$TORCH_211_VERSION" &
venv_211=$!
venvs_ok=1
wait "$venv_215" || venvs_ok=0
wait "$venv_211" || venvs_ok=0
if ((venvs_ok == 0)); then
  echo "setup: installing torch failed (pip's message is above); rerun scripts/setup.sh" >&2
  exit 1
fi

./scripts/check_blas.sh || true
