#!/usr/bin/env bash
# The benchmark report: GPT-mini training step (bench/bench_step.cpp) for
# local, NO_SHARD, SHARD_GRAD_OP and FULL_SHARD at 1 and 2 ranks, as a
# Markdown table and a PNG chart (gnuplot) of step time and peak memory per
# rank. Builds nothing; a few minutes on 2 cores.
#
#   bench/report.sh [--build DIR] [--out DIR] [--worlds "1 2 4"]
#
#   --build DIR     where bench_step and fsdprun are (default: build)
#   --out DIR       where the report goes (default: bench/results):
#                   step_report.jsonl (bench_step's lines), step_report.md,
#                   step_report.png
#   --worlds LIST   rank counts (default "1 2"; "1 2 4" adds 4 ranks)
#
# Environment: STEPS (10), WARMUP (2), STEP_ARGS (more bench_step flags, e.g.
# "--blocks 4 --seq 64"). gnuplot (Debian: gnuplot-nox) is installed through
# scripts/setup.sh --bench when missing.
#
# `local` at N ranks runs N independent unsharded models side by side (no
# communication): what N busy processes cost the machine by itself.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=build
OUT=bench/results
WORLDS="1 2"
while (($#)); do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --worlds) WORLDS=$2; shift 2 ;;
    -h | --help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "report.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
STEP_ARGS=${STEP_ARGS:-}
BIN=$BUILD/bin

for exe in fsdprun bench_step; do
  if [[ ! -x $BIN/$exe ]]; then
    echo "report.sh: $BIN/$exe not found; build it first:" >&2
    echo "  cmake --build $BUILD --target fsdprun bench_step" >&2
    exit 1
  fi
done
if ! command -v gnuplot >/dev/null; then
  ./scripts/setup.sh --bench
fi

mkdir -p "$OUT"
jsonl=$OUT/step_report.jsonl
: >"$jsonl"
# One thread per process everywhere (bench_step pins OpenBLAS itself).
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

step=("$BIN/bench_step" --steps "$STEPS" --warmup "$WARMUP")
# shellcheck disable=SC2206  # word splitting of the user's flags is intended
step+=($STEP_ARGS)
for world in $WORLDS; do
  for mode in local no_shard shard_grad_op full_shard; do
    cmd=("${step[@]}" --mode "$mode")
    if ((world > 1)); then cmd=("$BIN/fsdprun" --nproc-per-node "$world" "${cmd[@]}"); fi
    echo "# ${cmd[*]}" >&2
    # Keep the JSON line (without fsdprun's "[rank0]: "), pass the rest to stderr.
    "${cmd[@]}" 2> >(cat >&2) | sed -u 's/^\[rank[0-9]*\]: //' | while IFS= read -r line; do
      if [[ $line == \{* ]]; then echo "$line" | tee -a "$jsonl"; else echo "$line" >&2; fi
    done
  done
done

python3 bench/report_table.py "$jsonl" "$OUT"
gnuplot -e "datafile='$OUT/step_report.dat'; outfile='$OUT/step_report.png'; worlds='$(cat "$OUT/step_report.worlds")'" bench/report_chart.gp
echo "report.sh: wrote $OUT/step_report.md and $OUT/step_report.png" >&2
