#!/usr/bin/env bash
# Installs the built libfsdp into a temporary prefix, builds the consumer
# project against it with find_package(fsdp), and runs it on 2 ranks.
set -euo pipefail
build_dir="$1"; source_dir="$2"; torch_prefix="$3"  # LibTorch's root (TORCH_INSTALL_PREFIX)
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
cmake --install "$build_dir" --prefix "$tmp/prefix" > /dev/null
cmake -S "$source_dir" -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$tmp/prefix;$torch_prefix;$torch_prefix/share/cmake" > "$tmp/configure.log" || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" > "$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
out="$("$tmp/prefix/bin/fsdprun" --nproc-per-node 2 "$tmp/build/consumer_app" 2>&1)"
echo "$out"
grep -q "\[rank0\]: consumer rank 0 counted 2" <<< "$out"
grep -q "\[rank1\]: consumer rank 1 counted 2" <<< "$out"
out="$("$tmp/prefix/bin/fsdprun" --nproc-per-node 2 "$tmp/build/consumer_fully_shard" 2>&1)"
echo "$out"
grep -q "\[rank0\]: fully_shard app rank 0 saved" <<< "$out"
grep -q "\[rank1\]: fully_shard app rank 1 saved" <<< "$out"
