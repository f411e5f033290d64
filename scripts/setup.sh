#!/usr/bin/env bash
# Installs what libfsdp needs to build, test and run, from Debian's archive
# only. Safe to run any number of times: it installs just what is missing.
#   scripts/setup.sh           what the build, the tests and the demo need
#   scripts/setup.sh --bench   also gnuplot (bench/report.sh draws its chart)
set -euo pipefail

PACKAGES=(
  cmake ninja-build g++ pkg-config python3
  libtorch-dev          # LibTorch 1.13 (tensors, autograd, c10d)
  libgloo-dev           # Gloo, called directly for collectives
  libopenblas0-pthread  # without it LibTorch's matmuls use the reference BLAS (~13x slower)
  googletest libgtest-dev
  nlohmann-json3-dev libcli11-dev
  clang-14 libclang-rt-14-dev  # libFuzzer + ASan for the checkpoint loader's fuzz target
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

if ((${#missing[@]} == 0)); then
  echo "setup: all ${#PACKAGES[@]} packages are installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
