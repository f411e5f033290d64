#!/usr/bin/env bash
# The main job: set up, build, and run a short 2-rank program with fsdprun.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh
BUILD_DIR="${FSDP_BUILD_DIR:-build}"
exec "$BUILD_DIR/bin/fsdprun" --nproc-per-node 2 "$BUILD_DIR/bin/comm_demo"
