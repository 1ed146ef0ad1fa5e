#!/usr/bin/env bash
# cudabudget benchmarks on the real GPU: driver micro-benchmarks, a PyTorch
# training step and start-up time, each run interleaved native / budget REPS
# times (budget = LD_PRELOAD=target/release/libcudabudget.so CUDABUDGET_LIMIT=100Gi).
#
# Usage: bash scripts/gpu/bench/run_bench.sh [--reps N] [--skip-driver] [--skip-train] [--skip-startup] [--scale F]
# Output: markdown table on stdout and appended to $OUT/bench.log (OUT defaults to ./gpu-out).
# Runtime on an H200: --reps 7 --skip-train about 7.5 minutes; --reps 5 training alone about 5.
set -u

REPS=5
SKIP_DRIVER=0
SKIP_TRAIN=0
SKIP_STARTUP=0
SCALE=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --reps) REPS="$2"; shift 2 ;;
    --reps=*) REPS="${1#*=}"; shift ;;
    --skip-driver) SKIP_DRIVER=1; shift ;;
    --skip-train) SKIP_TRAIN=1; shift ;;
    --skip-startup) SKIP_STARTUP=1; shift ;;
    --scale) SCALE="$2"; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "run_bench.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT"
BLOG="$OUT/bench.log"
LIB="${CB_LIB:-$ROOT/target/release/libcudabudget.so}"
BUILD=/tmp/cb-gpu
WORK="$BUILD/bench-$$"
mkdir -p "$BUILD" "$WORK"
PY="${PYTHON:-python3}"

# A clean environment: nothing of ours or of the frameworks' allocator settings leaks in.
unset LD_PRELOAD
for v in $(compgen -e); do
  case "$v" in CUDABUDGET_*|CUDA_DEVICE_MEMORY_LIMIT*|PYTORCH_CUDA_ALLOC_CONF|XLA_PYTHON_CLIENT_*) unset "$v" ;; esac
done
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1

say() { echo "$*" | tee -a "$BLOG"; }

say ""
say "## cudabudget benchmarks $(date -u +%Y-%m-%dT%H:%M:%SZ), reps=$REPS"
say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
if [[ ! -f "$LIB" ]]; then
  say "FAIL bench/setup: $LIB not found (carry target/release/libcudabudget.so)"
  exit 1
fi

if ! gcc -O2 -o "$BUILD/driver_bench" "$HERE/driver_bench.c" -ldl -lpthread >"$WORK/build.err" 2>&1; then
  say "FAIL bench/build driver_bench:"; tee -a "$BLOG" <"$WORK/build.err"
  exit 1
fi

# The order of the two variants within a rep alternates (ABBA...), so that neither
# always runs second, on caches the other warmed.
order() { if (( $1 % 2 )); then echo native budget; else echo budget native; fi; }

# run_rep NAME VARIANT REP TIMEOUT CMD... : budget variant gets the preload.
# Both variants go through one `env` exec, so that start-up times compare fairly.
run_rep() {
  local name=$1 variant=$2 rep=$3 to=$4; shift 4
  local base="$WORK/$name.$variant.$rep"
  if [[ $variant == budget ]]; then
    timeout -k 10 "$to" env LD_PRELOAD="$LIB" CUDABUDGET_LIMIT=100Gi "$@" >"$base.out" 2>"$base.err" </dev/null
  else
    timeout -k 10 "$to" env -u LD_PRELOAD "$@" >"$base.out" 2>"$base.err" </dev/null
  fi
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "  ($name $variant rep $rep: rc=$rc; stderr tail:)"
    tail -n 5 "$base.err" | sed 's/^/    /'
  fi
  return 0
}

# time_rep NAME VARIANT REP CMD... : wall time in ms -> JSON line
time_rep() {
  local name=$1 variant=$2 rep=$3; shift 3
  local base="$WORK/$name.$variant.$rep" t0 t1 rc
  t0=$(date +%s%N)
  if [[ $variant == budget ]]; then
    timeout -k 10 120 env LD_PRELOAD="$LIB" CUDABUDGET_LIMIT=100Gi "$@" >"$base.raw" 2>"$base.err" </dev/null
  else
    timeout -k 10 120 env -u LD_PRELOAD "$@" >"$base.raw" 2>"$base.err" </dev/null
  fi
  rc=$?
  t1=$(date +%s%N)
  # The program's own JSON line (phases timed inside it), if it prints one, gets the
  # wall time and exit status added.
  local inner
  inner=$(grep '^{' "$base.raw" 2>/dev/null | tail -n 1)
  if [[ -n $inner ]]; then
    echo "{\"bench\":\"$name\",\"ms\":$(( (t1 - t0) / 1000 ))e-3,\"rc\":$rc,${inner#\{}" >"$base.out"
  else
    echo "{\"bench\":\"$name\",\"ms\":$(( (t1 - t0) / 1000 ))e-3,\"rc\":$rc}" >"$base.out"
  fi
}

if [[ $SKIP_DRIVER -eq 0 ]]; then
  echo "driver_bench: $REPS x (native, budget) ..."
  for ((i = 1; i <= REPS; i++)); do
    for v in $(order "$i"); do run_rep driver "$v" "$i" 120 "$BUILD/driver_bench" --scale "$SCALE"; done
  done
fi

if [[ $SKIP_TRAIN -eq 0 ]]; then
  for conf in native async; do
    echo "train_step ($conf allocator): $REPS x (native, budget) ..."
    for ((i = 1; i <= REPS; i++)); do
      if [[ $conf == async ]]; then
        for v in $(order "$i"); do run_rep "train_$conf" "$v" "$i" 240 env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync "$PY" "$HERE/train_step.py"; done
      else
        for v in $(order "$i"); do run_rep "train_$conf" "$v" "$i" 240 "$PY" "$HERE/train_step.py"; done
      fi
    done
  done
fi

if [[ $SKIP_STARTUP -eq 0 ]]; then
  echo "start-up: $REPS x (native, budget) ..."
  # one untimed run first so that file-system caches are warm for both variants
  timeout 120 "$PY" -c 'import torch; torch.zeros(1, device="cuda")' >/dev/null 2>&1
  timeout 120 env LD_PRELOAD="$LIB" CUDABUDGET_LIMIT=100Gi "$PY" -c 'import torch; torch.zeros(1, device="cuda")' >/dev/null 2>&1
  for ((i = 1; i <= REPS; i++)); do
    # the issue's command, as it is (wall time only)
    for v in $(order "$i"); do time_rep startup "$v" "$i" "$PY" -c 'import torch; torch.zeros(1, device="cuda")'; done
    # the same work, timed inside: import torch, then the first CUDA tensor
    for v in $(order "$i"); do time_rep torch_phases "$v" "$i" "$PY" "$HERE/torch_startup.py"; done
  done
  for ((i = 1; i <= 2 * REPS; i++)); do
    # the interpreter alone: what loading the library costs a process
    for v in $(order "$i"); do time_rep pystart "$v" "$i" "$PY" -c pass; done
    # the driver alone (ctypes): cuInit, the primary context, one cuMemGetInfo
    for v in $(order "$i"); do time_rep cuinit "$v" "$i" "$PY" "$HERE/startup_probe.py"; done
  done
fi

"$PY" "$HERE/summarize.py" --work "$WORK" --out "$BLOG" || say "FAIL bench/summarize (raw outputs in $WORK)"
# keep the raw JSON lines in the log for later analysis
{
  echo ""
  echo "<details><summary>raw JSON lines</summary>"
  echo ""
  for f in "$WORK"/*.out; do
    printf '%s: %s\n' "$(basename "$f")" "$(grep '^{' "$f" | tail -n 1)"
  done
  echo "</details>"
} >>"$BLOG"
exit 0
