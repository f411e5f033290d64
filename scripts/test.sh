#!/usr/bin/env bash
# The whole test suite: set up, build, run every ctest test.
# Tests run one at a time: the multi-rank ones already use both cores, and
# their failure tests measure timeouts.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh
BUILD_DIR="${FSDP_BUILD_DIR:-build}"
ctest --test-dir "$BUILD_DIR" --output-on-failure "$@"
