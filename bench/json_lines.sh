# Sourced by the benchmark scripts: checks their executables, runs benchmark
# commands and keeps their JSON lines.
#
# need_executables BUILD EXE...: exits with a message naming the build
# command unless every BUILD/bin/EXE exists.
need_executables() {
  local build=$1
  shift
  local exe
  for exe in "$@"; do
    if [[ ! -x $build/bin/$exe ]]; then
      echo "$(basename "$0"): $build/bin/$exe not found; build it first:" \
        "cmake --build $build --target $*" >&2
      exit 1
    fi
  done
}
#
# json_lines OUT TAG CMD...: runs CMD; each JSON line it prints (fsdprun's
# "[rankN]: " prefix removed) goes to stdout and is appended to file OUT, with
# TAG (e.g. '"build":"A",', or empty) inserted after its "{"; every other line
# goes to stderr. A failed command ends the calling script with its status, so
# a summary never leaves out a configuration silently; with BENCH_KEEP_GOING=1
# (a device call's few minutes) it is reported and the script goes on, and
# the summary shows the configuration as missing.
json_lines() {
  local out=$1 tag=$2
  shift 2
  echo "# $*" >&2
  local rc=0
  "$@" | sed -u 's/^\[rank[0-9]*\]: //' | while IFS= read -r line; do
    if [[ $line == \{* ]]; then
      line="{$tag${line#\{}"
      echo "$line"
      echo "$line" >>"$out"
    else
      echo "$line" >&2
    fi
  done || rc=$?
  if ((rc != 0)); then
    echo "$(basename "$0"): '$*' failed with status $rc" >&2
    [[ ${BENCH_KEEP_GOING:-0} == 1 ]] || exit "$rc"
  fi
}
