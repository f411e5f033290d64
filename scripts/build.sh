#!/usr/bin/env bash
# Configures and builds libfsdp (Release) into ${FSDP_BUILD_DIR:-build}.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${FSDP_BUILD_DIR:-build}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DFSDP_BUILD_TESTS=ON -DFSDP_BUILD_TOOLS=ON -DFSDP_BUILD_EXAMPLES=ON -DFSDP_BUILD_BENCH=ON
cmake --build "$BUILD_DIR" -j "$(nproc)"
