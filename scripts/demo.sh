#!/usr/bin/env bash
# The main job: set up, build, and train a character-level GPT on 2 ranks
# with fsdprun (about a minute on 2 cores; the loss falls from ~3.9 to ~1).
# Extra arguments go to train_gpt, e.g. `scripts/demo.sh --steps 100` or
# `scripts/demo.sh --data my.txt`; `train_gpt --help` lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh fsdprun train_gpt   # only what the demo runs
BUILD_DIR="${FSDP_BUILD_DIR:-build}"
exec "$BUILD_DIR/bin/fsdprun" --nproc-per-node 2 "$BUILD_DIR/bin/train_gpt" \
  --metrics-dir "$BUILD_DIR/train_gpt_metrics" "$@"
