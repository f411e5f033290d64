#!/usr/bin/env bash
# libfsdp and PyTorch's own data parallelism side by side, in one run (issue 22):
# GPT-mini (8 blocks x 512, seq 128, batch 8 per rank, AdamW fp32, one
# intra-op thread per rank), 2 ranks on this machine. Builds nothing:
#
#   bench/vs_pytorch.sh [BUILD_DIR]        # default: build
#
# Every round runs, one after the other (rounds interleaved, so that a drifting
# shared host shifts every configuration alike):
#   libfsdp   bench_step local (1 process), local on 2 processes side by side
#             (no communication: the floor, each step paced by the slower
#             rank), NO_SHARD and FULL_SHARD at 2 ranks under fsdprun;
#   PyTorch   bench/pytorch_step.py on the mirror tests/interop/gpt_mini.py:
#             local (1 process and 2 side by side), DDP, FSDP1 FULL_SHARD and
#             NO_SHARD, FSDP2 fully_shard; each as it comes and again with
#             glibc told to keep freed memory as fsdp::keep_freed_cpu_memory()
#             does (MALLOC_MMAP_THRESHOLD_=32 MiB, MALLOC_TRIM_THRESHOLD_=1 GiB).
# Each configuration prints one JSON line (step time: the slowest rank's
# median; peak RSS per rank from getrusage, KiB); the last line is a summary
# with the median over rounds of each round's ratios, PyTorch taken at the
# faster of its two malloc settings. About 10 minutes per round on 2 cores.
#
# Environment:
#   ROUNDS (3)      rounds
#   STEPS (10), WARMUP (2)   timed and untimed steps of every run
#   MODEL_ARGS      size flags for both sides, e.g. "--blocks 2 --d-model 64"
#                   (bench_step's names: --blocks --d-model --heads --seq --batch --vocab)
#   PYTHON          a Python with torch (default: .venv/bin/python, else python3)
#   PYTORCH_MALLOC ("default kept")   PyTorch's malloc settings to run
#   RUN_TIMEOUT (900)   seconds one configuration may take
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-build}
BIN=$BUILD/bin
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
MODEL_ARGS=${MODEL_ARGS:-}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
PYTORCH_MALLOC=${PYTORCH_MALLOC:-default kept}
PYTHON=${PYTHON:-}
if [[ -z $PYTHON ]]; then
  if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
PY_STEP=$ROOT/bench/pytorch_step.py

for exe in fsdprun bench_step; do
  if [[ ! -x $BIN/$exe ]]; then
    echo "vs_pytorch.sh: $BIN/$exe not found; build it first:" >&2
    echo "  cmake --build $BUILD --target fsdprun bench_step" >&2
    exit 1
  fi
done
if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
  echo "vs_pytorch.sh: $PYTHON cannot import torch; set PYTHON to a Python with torch" >&2
  echo "  (./scripts/setup.sh makes .venv with it)" >&2
  exit 1
fi

# One thread per process everywhere (bench_step and pytorch_step.py also set
# it themselves); set here so fsdprun does not print its notice.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
unset MALLOC_MMAP_THRESHOLD_ MALLOC_TRIM_THRESHOLD_ BENCH_CPU_MEMORY  # libfsdp: its block cache
KEEP_MALLOC=(MALLOC_MMAP_THRESHOLD_=$((32 << 20)) MALLOC_TRIM_THRESHOLD_=$((1 << 30)))

results=$(mktemp)
one=$(mktemp)
trap 'rm -f "$results" "$one"' EXIT

# run NAME ROUND CMD...: runs one configuration, keeps its JSON lines (fsdprun's
# "[rankN]: " prefix removed) and prints them merged into one line. A
# PyTorch configuration that fails is run once more, saying so: PyTorch 2.15's
# own processes were seen to abort at random ("terminate called without an
# active exception" in FSDP1 NO_SHARD on a tiny model, 1 run in many), which
# is not what this benchmark measures. libfsdp's runs get no second chance.
run() {
  local name=$1 round=$2
  shift 2
  local attempts=1 attempt rc
  [[ $name == pytorch_* ]] && attempts=2
  for ((attempt = 1; attempt <= attempts; ++attempt)); do
    echo "# $name (round $round): $*" >&2
    : >"$one"
    rc=0
    timeout "$RUN_TIMEOUT" "$@" 2>&1 | sed -u 's/^\[rank[0-9]*\]: //' | while IFS= read -r line; do
      if [[ $line == \{* ]]; then echo "$line" >>"$one"; else echo "$line" >&2; fi
    done || rc=$?
    ((rc == 0)) && break
    if ((attempt < attempts)); then
      echo "vs_pytorch.sh: $name failed with status $rc (PyTorch's own processes); running it once more" >&2
    fi
  done
  if ((rc != 0)); then
    echo "vs_pytorch.sh: $name failed with status $rc" >&2
    exit "$rc"
  fi
  "$PYTHON" "$PY_STEP" combine "$one" "$name" "$round" | tee -a "$results"
}

# shellcheck disable=SC2206  # word splitting of the user's flags is intended
sizes=($MODEL_ARGS)
common=(--steps "$STEPS" --warmup "$WARMUP" "${sizes[@]}")
step=("$BIN/bench_step" "${common[@]}")
launch=("$BIN/fsdprun" --nproc-per-node 2)
rss=("$PYTHON" "$PY_STEP" rss --)
pystep=("$PYTHON" "$PY_STEP" step "${common[@]}")

for ((round = 0; round < ROUNDS; ++round)); do
  run libfsdp_local "$round" "${rss[@]}" "${step[@]}" --mode local
  run libfsdp_local_2proc "$round" "${launch[@]}" "${rss[@]}" "${step[@]}" --mode local
  run libfsdp_no_shard "$round" "${launch[@]}" "${rss[@]}" "${step[@]}" --mode no_shard
  run libfsdp_full_shard "$round" "${launch[@]}" "${rss[@]}" "${step[@]}" --mode full_shard
  for malloc in $PYTORCH_MALLOC; do
    env_=(env)
    suffix=
    if [[ $malloc == kept ]]; then
      env_+=("${KEEP_MALLOC[@]}")
      suffix=_kept_malloc
    fi
    run "pytorch_local_1proc$suffix" "$round" "${env_[@]}" "${pystep[@]}" --mode local --nproc 1
    run "pytorch_local_2proc$suffix" "$round" "${env_[@]}" "${pystep[@]}" --mode local
    for mode in ddp fsdp1_full_shard fsdp1_no_shard fsdp2; do
      run "pytorch_$mode$suffix" "$round" "${env_[@]}" "${pystep[@]}" --mode "$mode"
    done
  done
done

"$PYTHON" "$PY_STEP" summary "$results"
