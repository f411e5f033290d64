#!/usr/bin/env bash
# Runs clang-tidy (the repository's .clang-tidy: bugprone-*, performance-*)
# over libfsdp's sources with a build's compile_commands.json, and fails
# listing the findings. Not part of scripts/test.sh (CI): each file parses
# LibTorch's headers, ~30 s of CPU, so the 42 files of src/ take ~11 minutes
# on 2 cores; run it before sending a change to src/.
#   scripts/clang_tidy.sh                 every .cpp under src/
#   scripts/clang_tidy.sh src/core ...    the .cpp files under those paths
#   scripts/clang_tidy.sh --fix PATH...   apply clang-tidy's fixes (then re-check)
# FSDP_BUILD_DIR names the build (default build-tidy/, configured here with
# every file compiled alone: FSDP_UNITY_BUILD=OFF, Note [Unity builds] in
# cmake/fsdpUnity.cmake); CLANG_TIDY the binary (default clang-tidy-14).
set -euo pipefail
cd "$(dirname "$0")/.."

fix=()
if [[ ${1:-} == --fix ]]; then
  fix=(--fix)
  shift
fi
BUILD_DIR="${FSDP_BUILD_DIR:-build-tidy}"
tidy="${CLANG_TIDY:-}"
if [[ -z $tidy ]]; then
  if command -v clang-tidy-14 >/dev/null; then tidy=clang-tidy-14; else tidy=clang-tidy; fi
fi
if ! command -v "$tidy" >/dev/null; then
  echo "clang_tidy: $tidy not found: apt-get install clang-tidy-14" >&2
  exit 2
fi
if [[ ! -f $BUILD_DIR/compile_commands.json ]]; then
  FSDP_BUILD_DIR=$BUILD_DIR ./scripts/build.sh --configure-only -DFSDP_UNITY_BUILD=OFF >/dev/null
fi
if grep -q '/Unity/unity_' "$BUILD_DIR/compile_commands.json"; then
  echo "clang_tidy: $BUILD_DIR compiles files in batches: configure it with -DFSDP_UNITY_BUILD=OFF" >&2
  exit 2
fi

paths=("$@")
((${#paths[@]} > 0)) || paths=(src)
mapfile -t files < <(git ls-files -- "${paths[@]}" | grep -E '\.(cpp|cc)$' | sort)
if ((${#files[@]} == 0)); then
  echo "clang_tidy: no .cpp files under ${paths[*]}" >&2
  exit 2
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "clang_tidy: $tidy on ${#files[@]} files with $BUILD_DIR/compile_commands.json ($(nproc) at a time)"
# One process per file, nproc at a time; each writes its own log. The build's
# flags are GCC's: clang must not stop at the GCC-only -Wno-stringop-* ones.
printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -I{} sh -c \
  '"$1" -p "$2" --quiet --extra-arg=-Wno-unknown-warning-option $3 "$4" > "$5/$(echo "$4" | tr / _).log" 2>&1 || true' \
  _ "$tidy" "$BUILD_DIR" "${fix[*]:-}" {} "$out"

# A finding is "FILE:LINE:COL: warning|error: ... [check]"; a header's finding
# repeats for each file that includes it.
findings=$(cat "$out"/*.log | grep -E '^[^ ]+:[0-9]+:[0-9]+: (warning|error):' | sort -u || true)
if [[ -z $findings ]]; then
  echo "clang_tidy: no findings"
  exit 0
fi
echo "$findings"
echo "clang_tidy: $(wc -l <<<"$findings") findings; by check:"
sed -n 's/.*\[\([^]]*\)\]$/\1/p' <<<"$findings" | sort | uniq -c | sort -rn
exit 1
