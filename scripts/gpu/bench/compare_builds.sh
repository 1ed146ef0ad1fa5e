#!/usr/bin/env bash
# Runs driver_bench under several builds of the library, in rotating order, and prints
# the medians of its in-process A/B figures for each build: to tell which part of the
# hooks costs what on the real driver (see BENCHMARKS.md, "Method").
#
# Usage: bash scripts/gpu/bench/compare_builds.sh [--reps N] [--deadline S] NAME=PATH/libcudabudget.so ...
# --deadline S: start no new round of runs S seconds after the start (every build has run
# as often as every other when it stops).
# Output: $OUT/compare.jsonl (one line per run) and $OUT/compare.txt (the medians).
set -u
REPS=5
DEADLINE=0
while [[ ${1:-} == --* ]]; do
  case $1 in
    --reps) REPS=$2 ;;
    --deadline) DEADLINE=$2 ;;
    *) sed -n '2,10p' "$0"; exit 2 ;;
  esac
  shift 2
done
if [[ $# -lt 1 ]]; then sed -n '2,10p' "$0"; exit 2; fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT" /tmp/cb-gpu
gcc -O2 -o /tmp/cb-gpu/driver_bench "$HERE/driver_bench.c" -ldl -lpthread || exit 1
export CUDA_VISIBLE_DEVICES=0
BUILDS=("$@")
for b in "${BUILDS[@]}"; do
  [[ -f ${b#*=} ]] || { echo "compare_builds.sh: ${b#*=} not found" >&2; exit 2; }
done
: >"$OUT/compare.jsonl"
for ((r = 0; r < REPS; r++)); do
  if ((DEADLINE > 0 && SECONDS >= DEADLINE)); then
    echo "compare_builds.sh: deadline reached after $r rounds" >&2
    break
  fi
  for ((k = 0; k < ${#BUILDS[@]}; k++)); do
    b=${BUILDS[$(((r + k) % ${#BUILDS[@]}))]}
    line=$(timeout 120 env LD_PRELOAD="${b#*=}" CUDABUDGET_LIMIT=100Gi /tmp/cb-gpu/driver_bench 2>>"$OUT/compare.err" | grep '^{' | tail -n 1)
    [[ -n $line ]] && echo "{\"build\":\"${b%%=*}\",\"rep\":$r,${line#\{}" >>"$OUT/compare.jsonl"
  done
done
python3 - "$OUT/compare.jsonl" <<'PY' | tee "$OUT/compare.txt"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
keys = ["ab_async_delta_ns", "ab_async_native_ns", "ab_mt_ratio", "ab_mt_pause_ratio",
        "ab_mt_pause_ns_per_pair", "ab_sync_delta_ns", "ab_meminfo_delta_ns"]
for build in dict.fromkeys(r["build"] for r in rows):
    runs = [r for r in rows if r["build"] == build]
    for k in keys:
        xs = sorted(r[k] for r in runs)
        print(f"{build:10} {k:26} median {statistics.median(xs):10.3f}  ({' '.join(f'{x:.3f}' for x in xs)})")
PY
