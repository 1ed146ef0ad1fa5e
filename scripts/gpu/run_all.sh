#!/usr/bin/env bash
# cudabudget on a real GPU: every case of the matrix run twice, without the
# library ("native") and with it ("budget"); one PASS/FAIL line per check,
# decided on the budget run, with the native run's values beside it.
#
# Usage (from the repository root, with target/release/{libcudabudget.so,cudabudget} built):
#   bash scripts/gpu/run_all.sh [--only NAMES] [--skip-bench] [--two-gpu] [--via cli|env|mixed] [--reps N]
#     --only NAMES   comma-separated case names or prefixes (torch,jax_default,seed,...); --list shows them
#     --skip-bench   do not run scripts/gpu/bench/run_bench.sh afterwards
#     --two-gpu      also run the per-device cases (needs 2 visible GPUs; skipped otherwise)
#     --via          how budget runs are launched: cli = `cudabudget run --limit ...`, env = LD_PRELOAD +
#                    CUDABUDGET_LIMIT*, mixed (default) = cli for torch_native and nvsmi, env elsewhere
# Output: console, and appended to $OUT/gpu.log; $OUT/summary.txt (OUT defaults to ./gpu-out).
# Exit status 0 iff no check FAILed. About 5 minutes without the benchmarks (one H200).
# CB_DEADLINE_S (default 570; 0 = none): no process starts later than that many seconds after
# the start, and none runs past it, so a hang never outlives the device tool's 10 minutes.
set -u

ONLY=""
SKIP_BENCH=0
TWO_GPU=0
VIA=mixed
REPS=5
ALL_CASES="torch_native torch_expandable torch_async jax_default jax_platform jax_async cupy_default cupy_async numba cuda_c nvsmi seed"
ALL_CASES+=" torch_graph torch_graph_async cuda_graph_fit cuda_graph_cross cuda_async_impossible cuda_primary_reset"
ALL_CASES+=" dataloader_fork two_gpu_perdev two_gpu_visible1 two_gpu_stream two_gpu_reordered two_gpu_peer"
ALL_CASES+=" two_gpu_job two_gpu_nccl"
ALL_CASES+=" footprint_rawmodule footprint_heap footprint_spill footprint_pidns torch_no_nvml job_gpu"
ALL_CASES+=" load_neighbour compressed_fatbin job_tenants live_limit ray_fractions"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) ONLY="$2"; shift 2 ;;
    --only=*) ONLY="${1#*=}"; shift ;;
    --skip-bench) SKIP_BENCH=1; shift ;;
    --two-gpu) TWO_GPU=1; shift ;;
    --via) VIA="$2"; shift 2 ;;
    --via=*) VIA="${1#*=}"; shift ;;
    --reps) REPS="$2"; shift 2 ;;
    --list) echo "$ALL_CASES" | tr ' ' '\n'; exit 0 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "run_all.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ $ONLY == *two_gpu* ]] && TWO_GPU=1
case "$VIA" in cli|env|mixed) ;; *) echo "run_all.sh: --via must be cli, env or mixed" >&2; exit 2 ;; esac

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT"
LOG="$OUT/gpu.log"
SUMMARY="$OUT/summary.txt"
LIB="${CB_LIB:-$ROOT/target/release/libcudabudget.so}"
CLI="${CB_CLI:-$ROOT/target/release/cudabudget}"
BUILD=/tmp/cb-gpu
WORK="$BUILD/work-$(date +%s)-$$"
mkdir -p "$BUILD" "$WORK"
RESULTS="$WORK/results.txt"
: >"$RESULTS"
PY="${PYTHON:-python3}"
C="$HERE/cases"
T_START=$(date +%s)
DEADLINE_S="${CB_DEADLINE_S:-570}"
[[ $DEADLINE_S =~ ^[0-9]+$ ]] || DEADLINE_S=570

# A clean environment: nothing of ours or of the frameworks' allocator settings leaks in.
unset LD_PRELOAD
for v in $(compgen -e); do
  case "$v" in CUDABUDGET_*|CUDA_DEVICE_MEMORY_LIMIT*|PYTORCH_CUDA_ALLOC_CONF|XLA_PYTHON_CLIENT_*|JAX_PLATFORMS) unset "$v" ;; esac
done
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"

log() { echo "$*" | tee -a "$LOG"; }
logcmd() {  # logcmd TITLE CMD... : run a command for the preamble, output to console and log
  local title=$1; shift
  echo "\$ $title" | tee -a "$LOG"
  timeout 60 "$@" 2>&1 | head -n 60 | tee -a "$LOG"
}

# Every process a case starts runs under `timeout`, whose pid goes into WORK/*.pid
# while it runs; on exit we end those (timeout passes the signal to its group).
cleanup() {
  local f pid
  for f in "$WORK"/*.pid; do
    [[ -f $f ]] || continue
    pid=$(cat "$f" 2>/dev/null)
    if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
      echo "cleanup: ending leftover process $pid ($(basename "$f" .pid))" >&2
      kill -TERM "$pid" 2>/dev/null
      sleep 2
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    fi
    rm -f "$f"
  done
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM

selected() {
  local name=$1 w
  [[ -z $ONLY ]] && return 0
  for w in ${ONLY//,/ }; do
    [[ $name == "$w" || $name == "$w"* ]] && return 0
  done
  return 1
}

via_for() {
  case "$VIA" in
    cli) echo cli ;;
    env) echo env ;;
    *) case "$1" in torch_native|nvsmi) echo cli ;; *) echo env ;; esac ;;
  esac
}

# run_one CASE VARIANT PART TIMEOUT VIA SPEC -- CMD...
# SPEC: space-separated VAR=VALUE for both variants; a "B:" prefix marks a
# budget-only variable (with VIA=cli, B:CUDABUDGET_LIMIT[_N] become --limit /
# --limit-device options of `cudabudget run`).
run_one() {
  local case=$1 variant=$2 part=$3 to=$4 via=$5 spec=$6
  shift 6
  [[ ${1:-} == -- ]] && shift
  local base="$WORK/$case.$variant.$part"
  local envs=() cliopts=() launcher=() item key
  for item in $spec; do
    if [[ $item == B:* ]]; then
      [[ $variant == budget ]] || continue
      item=${item#B:}
      if [[ $via == cli ]]; then
        key=${item%%=*}
        case "$key" in
          CUDABUDGET_LIMIT) cliopts+=(--limit "${item#*=}"); continue ;;
          CUDABUDGET_LIMIT_*) cliopts+=(--limit-device "${key#CUDABUDGET_LIMIT_}=${item#*=}"); continue ;;
        esac
      fi
    fi
    envs+=("$item")
  done
  if [[ $variant == budget ]]; then
    envs+=("CUDABUDGET_LOG=${CB_LOG:-info}")
    if [[ $via == cli ]]; then
      launcher=("$CLI" run ${cliopts[@]+"${cliopts[@]}"} --)
    else
      envs+=("LD_PRELOAD=$LIB")
    fi
  fi
  envs+=("CB_PARTIAL=$base.partial")
  rm -f "$base".out "$base".err "$base".rc "$base".time "$base".partial "$base".cmd
  if [[ $DEADLINE_S -gt 0 ]]; then  # never start or run past the matrix deadline
    local left=$((T_START + DEADLINE_S - $(date +%s)))
    if [[ $left -lt 15 ]]; then
      echo "   ($case $variant/$part: NOT RUN, matrix deadline CB_DEADLINE_S=$DEADLINE_S reached)" | tee -a "$LOG"
      return 0
    fi
    [[ $to -gt $left ]] && to=$left
  fi
  printf '%q ' env "${envs[@]}" ${launcher[@]+"${launcher[@]}"} "$@" >"$base.cmd"
  local t0 t1 rc tp
  t0=$(date +%s%N)
  timeout -k 10 "$to" env "${envs[@]}" ${launcher[@]+"${launcher[@]}"} "$@" >"$base.out" 2>"$base.err" </dev/null &
  tp=$!
  echo "$tp" >"$base.pid"
  wait "$tp"
  rc=$?
  rm -f "$base.pid"
  t1=$(date +%s%N)
  echo "$rc" >"$base.rc"
  awk -v ns="$((t1 - t0))" 'BEGIN { printf "%.1f", ns / 1e9 }' >"$base.time"
  [[ $rc -eq 124 || $rc -eq 137 ]] && echo "   ($case $variant/$part: TIMED OUT after ${to}s)" | tee -a "$LOG"
  return 0
}

judge() {
  local case=$1
  if ! "$PY" "$HERE/judge.py" --case "$case" --work "$WORK" --log "$LOG" --results "$RESULTS"; then
    echo "FAIL $case/judge crashed (raw outputs in $WORK)" | tee -a "$LOG" "$RESULTS"
  fi
  wait_gpu_idle
}

# Wait (at most 20 s) until no compute process is left on the GPUs, so that one
# case's teardown never eats into the next case's memory.
wait_gpu_idle() {
  local k apps
  for ((k = 0; k < 40; k++)); do
    apps=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null)
    [[ -z $apps ]] && return 0
    sleep 0.5
  done
  log "WARN: GPU processes still present after 20 s: $(echo "$apps" | tr '\n' ';')"
}

pair() {  # pair CASE SPEC TIMEOUT -- CMD...
  local case=$1 spec=$2 to=$3
  shift 3
  [[ ${1:-} == -- ]] && shift
  local via
  via=$(via_for "$case")
  echo "-- $case (budget via $via) ..."
  run_one "$case" native main "$to" "$via" "$spec" -- "$@"
  run_one "$case" budget main "$to" "$via" "$spec" -- "$@"
  judge "$case"
}

# ------------------------------------------------------------------ preamble
log ""
log "################################################################################"
log "# cudabudget GPU matrix  $(date -u +%Y-%m-%dT%H:%M:%SZ)  (work dir $WORK)"
log "# args: only='${ONLY}' skip_bench=$SKIP_BENCH two_gpu=$TWO_GPU via=$VIA"
logcmd "date -u" date -u
logcmd "nvidia-smi -L" nvidia-smi -L
logcmd "nvidia-smi --query-gpu=index,name,driver_version,memory.total,uuid" \
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,uuid --format=csv,noheader
logcmd "uname -r; python" bash -c 'uname -r; command -v '"$PY"'; '"$PY"' --version'
logcmd "python packages" "$PY" -c '
import importlib.metadata as md
for n in ("torch", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "cupy-cuda13x", "numba", "numba-cuda",
          "nvidia-ml-py", "numpy", "cuda-bindings"):
    try:
        print("  %-20s %s" % (n, md.version(n)))
    except Exception as e:
        print("  %-20s (not installed: %s)" % (n, type(e).__name__))'
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
logcmd "nvcc --version" bash -c "$NVCC --version | tail -n 2"
logcmd "ls -l target/release" ls -l "$LIB" "$CLI"
logcmd "sha256sum" sha256sum "$LIB" "$CLI"
logcmd "ldd libcudabudget.so" ldd "$LIB"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
log "# GPUs visible to nvidia-smi: $NGPU"

if [[ ! -f $LIB ]]; then
  log "FAIL setup/library: $LIB not found (carry target/release/libcudabudget.so)"
  echo "FAIL setup/library" >>"$RESULTS"
  exit 1
fi
if [[ -f $CLI && ! -x $CLI ]]; then chmod +x "$CLI" 2>/dev/null; fi
if [[ ! -x $CLI ]]; then
  log "WARN: $CLI missing or not executable: cases launched through the CLI use --via env instead"
  VIA=env
fi
wait_gpu_idle

# graph_test.cu is built once, on first use; a failed build gives each of its cases a FAIL line.
GT_BIN="$BUILD/graph_test"
GT_STATE=""
build_graph_test() {
  local bto=180
  if [[ -z $GT_STATE && $DEADLINE_S -gt 0 ]]; then
    bto=$((T_START + DEADLINE_S - $(date +%s) - 30))
    [[ $bto -gt 180 ]] && bto=180
    if [[ $bto -lt 20 ]]; then
      GT_STATE=fail
      log "   (graph_test not built: matrix deadline CB_DEADLINE_S=$DEADLINE_S reached)"
    fi
  fi
  if [[ -z $GT_STATE ]]; then
    echo "-- building graph_test with nvcc ..."
    rm -f "$GT_BIN"
    if timeout "$bto" "$NVCC" -O2 -cudart static -o "$GT_BIN" "$HERE/cuda/graph_test.cu" -lcuda \
      >"$WORK/nvcc-graph_test.log" 2>&1; then
      GT_STATE=ok
    else
      # No libcuda.so (the toolkit's stubs) on the link path: link the driver's libcuda.so.1 itself.
      local libcuda
      libcuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
      if [[ -n $libcuda ]] && {
        echo "# retry, linking $libcuda"
        timeout "$bto" "$NVCC" -O2 -cudart static -o "$GT_BIN" "$HERE/cuda/graph_test.cu" -Xlinker "$libcuda"
      } >>"$WORK/nvcc-graph_test.log" 2>&1; then
        GT_STATE=ok
        log "   (graph_test linked against $libcuda: -lcuda was not found)"
      else
        GT_STATE=fail
        log "nvcc failed for cuda/graph_test.cu:"
        tail -n 25 "$WORK/nvcc-graph_test.log" | tee -a "$LOG"
      fi
    fi
  fi
  [[ $GT_STATE == ok ]]
}
graph_case() {  # graph_case CASE SPEC MODE
  local case=$1 spec=$2 mode=$3
  if build_graph_test; then
    pair "$case" "$spec" 60 -- "$GT_BIN" "$mode"
  else
    log "FAIL $case/build cuda/graph_test.cu not built (nvcc failed, or the deadline: see the log, $WORK/nvcc-graph_test.log)"
    echo "FAIL $case/build" >>"$RESULTS"
  fi
}

# ------------------------------------------------------------------ cases
if selected torch_native; then
  pair torch_native "B:CUDABUDGET_LIMIT=8Gi" 180 -- "$PY" "$C/torch_case.py" --mode alloc --budget-gib 8
fi
if selected torch_expandable; then
  pair torch_expandable "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True B:CUDABUDGET_LIMIT=8Gi" 180 -- \
    "$PY" "$C/torch_case.py" --mode alloc --budget-gib 8
fi
if selected torch_async; then
  pair torch_async "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync B:CUDABUDGET_LIMIT=8Gi" 180 -- \
    "$PY" "$C/torch_case.py" --mode alloc --budget-gib 8
fi
if selected jax_default; then
  pair jax_default "B:CUDABUDGET_LIMIT=16Gi" 180 -- "$PY" "$C/jax_case.py" --mode default --budget-gib 16
fi
if selected jax_platform; then
  pair jax_platform "B:CUDABUDGET_LIMIT=8Gi" 180 -- "$PY" "$C/jax_case.py" --mode platform --budget-gib 8
fi
if selected jax_async; then
  pair jax_async "B:CUDABUDGET_LIMIT=8Gi" 180 -- "$PY" "$C/jax_case.py" --mode cuda_async --budget-gib 8
fi
if selected cupy_default; then
  pair cupy_default "B:CUDABUDGET_LIMIT=8Gi" 180 -- "$PY" "$C/cupy_case.py" --mode default --budget-gib 8
fi
if selected cupy_async; then
  pair cupy_async "B:CUDABUDGET_LIMIT=8Gi" 180 -- "$PY" "$C/cupy_case.py" --mode async --budget-gib 8
fi
if selected numba; then
  pair numba "B:CUDABUDGET_LIMIT=2Gi" 180 -- "$PY" "$C/numba_case.py" --budget-gib 2
fi
if selected cuda_c; then
  echo "-- building alloc_test with nvcc ..."
  if timeout 180 "$NVCC" -O2 -cudart static -o "$BUILD/alloc_test" "$HERE/cuda/alloc_test.cu" >"$WORK/nvcc.log" 2>&1; then
    pair cuda_c "B:CUDABUDGET_LIMIT=8Gi" 120 -- "$BUILD/alloc_test" 5 4 4
  else
    log "FAIL cuda_c/build nvcc failed:"
    tail -n 20 "$WORK/nvcc.log" | tee -a "$LOG"
    echo "FAIL cuda_c/build" >>"$RESULTS"
  fi
fi
if selected nvsmi; then
  echo "-- nvsmi (nvidia-smi via $(via_for nvsmi); pynvml in a torch process via env) ..."
  for variant in native budget; do
    run_one nvsmi "$variant" smi 60 "$(via_for nvsmi)" "B:CUDABUDGET_LIMIT=8Gi" -- \
      nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits
    run_one nvsmi "$variant" nvml 180 env "B:CUDABUDGET_LIMIT=8Gi" -- \
      "$PY" "$C/nvml_case.py" --mode view --hold-gib 1 --budget-gib 8
  done
  judge nvsmi
fi

# Seed scenario: JAX (default settings, 40 GiB budget) holds its pool in the
# background; meanwhile PyTorch (60 GiB budget) allocates 55 GiB. Sized for the H200's
# 141 GiB; on a smaller card the three figures scale with its memory (an H100's 80 GiB:
# 22, 34 and 31 GiB), so that the two budgets fit the card as they do on the H200.
# judge.py reads the same figures from the environment.
card_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null | head -1)
card_gib=$(( ${card_gib:-144384} / 1024 ))
if (( card_gib >= 140 )); then
  export SEED_JAX_GIB=40 SEED_TORCH_GIB=60 SEED_FIRST_GIB=55
else
  export SEED_JAX_GIB=$(( card_gib * 40 / 141 )) SEED_TORCH_GIB=$(( card_gib * 60 / 141 ))
  export SEED_FIRST_GIB=$(( card_gib * 55 / 141 ))
fi
seed_variant() {
  local variant=$1 ready="$WORK/seed.$variant.ready" stop="$WORK/seed.$variant.stop" bg k
  rm -f "$ready" "$stop"
  run_one seed "$variant" jax 180 env "B:CUDABUDGET_LIMIT=${SEED_JAX_GIB}Gi" -- \
    "$PY" "$C/jax_case.py" --mode hold --budget-gib "$SEED_JAX_GIB" --ready "$ready" --stop "$stop" --hold-max 150 &
  bg=$!
  for ((k = 0; k < 600; k++)); do  # at most 120 s for JAX to start and preallocate
    [[ -f $ready ]] && break
    kill -0 "$bg" 2>/dev/null || break
    sleep 0.2
  done
  if [[ -f $ready ]]; then
    run_one seed "$variant" torch 180 env "B:CUDABUDGET_LIMIT=${SEED_TORCH_GIB}Gi" -- \
      "$PY" "$C/torch_case.py" --mode big --first-gib "$SEED_FIRST_GIB" --budget-gib "$SEED_TORCH_GIB" --peer-ready "$ready"
  else
    log "   (seed $variant: JAX never signalled ready; torch part not run)"
  fi
  touch "$stop"
  for ((k = 0; k < 150; k++)); do  # at most 30 s for JAX to see the stop file and exit
    kill -0 "$bg" 2>/dev/null || break
    sleep 0.2
  done
  if kill -0 "$bg" 2>/dev/null; then
    log "   (seed $variant: JAX did not exit; ending it)"
    cleanup
  fi
  wait "$bg" 2>/dev/null
}
if selected seed; then
  echo "-- seed (JAX $SEED_JAX_GIB GiB holding its pool beside PyTorch $SEED_TORCH_GIB GiB allocating $SEED_FIRST_GIB GiB) ..."
  seed_variant native
  wait_gpu_idle
  seed_variant budget
  judge seed
fi

# "No escape, no harm": CUDA graphs (PyTorch, then CUDA C), impossible sizes, a primary-context
# reset beside a created context, DataLoader workers forked during denials.
torch_graph_case() {  # torch_graph_case CASE ALLOC_CONF_SPEC
  local case=$1 spec="$2 B:CUDABUDGET_LIMIT=8Gi"
  local cspec="$spec TORCHINDUCTOR_COMPILE_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$WORK/inductor-cache TRITON_CACHE_DIR=$WORK/triton-cache"
  echo "-- $case (budget via $(via_for "$case")) ..."
  run_one "$case" native capture 90 "$(via_for "$case")" "$spec" -- \
    "$PY" "$C/torch_graph_case.py" --mode capture --budget-gib 8 --watchdog-s 75
  run_one "$case" budget capture 90 "$(via_for "$case")" "$spec" -- \
    "$PY" "$C/torch_graph_case.py" --mode capture --budget-gib 8 --watchdog-s 75
  # The compile caches are shared by the whole matrix run: the first compile is cold. The budget
  # run goes first, so the cold compile (triton's own build included) happens under the library.
  run_one "$case" budget compile 150 "$(via_for "$case")" "$cspec" -- \
    "$PY" "$C/torch_graph_case.py" --mode compile --budget-gib 8 --watchdog-s 120
  run_one "$case" native compile 150 "$(via_for "$case")" "$cspec" -- \
    "$PY" "$C/torch_graph_case.py" --mode compile --budget-gib 8 --watchdog-s 120
  judge "$case"
}
if selected torch_graph; then
  torch_graph_case torch_graph ""
fi
if selected torch_graph_async; then
  torch_graph_case torch_graph_async "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"
fi
if selected cuda_graph_fit; then
  graph_case cuda_graph_fit "B:CUDABUDGET_LIMIT=4Gi" fit
fi
if selected cuda_graph_cross; then
  graph_case cuda_graph_cross "B:CUDABUDGET_LIMIT=4Gi" cross
fi
if selected cuda_async_impossible; then
  graph_case cuda_async_impossible "B:CUDABUDGET_LIMIT=4Gi" impossible
fi
if selected cuda_primary_reset; then
  graph_case cuda_primary_reset "B:CUDABUDGET_LIMIT=4Gi" reset
fi
# "The whole footprint": memory no allocation call names (module globals, the device heap,
# local memory a launch grows), in a PID namespace, and with NVML hidden from the process.
if selected footprint_rawmodule; then
  pair footprint_rawmodule "B:CUDABUDGET_LIMIT=2Gi" 120 -- "$PY" "$C/footprint_case.py" --mode rawmodule --budget-gib 2
fi
if selected footprint_heap; then
  pair footprint_heap "B:CUDABUDGET_LIMIT=2Gi" 120 -- "$PY" "$C/footprint_case.py" --mode heap --budget-gib 2
fi
if selected footprint_spill; then
  pair footprint_spill "B:CUDABUDGET_LIMIT=24Gi" 120 -- "$PY" "$C/footprint_case.py" --mode spill --budget-gib 24
fi
if selected footprint_pidns; then
  if unshare --pid --fork --mount-proc true 2>/dev/null; then
    pair footprint_pidns "B:CUDABUDGET_LIMIT=24Gi" 120 -- unshare --pid --fork --mount-proc \
      "$PY" "$C/footprint_case.py" --mode spill --budget-gib 24
  else
    log "FAIL footprint_pidns/setup unshare --pid --fork --mount-proc does not work here (needs root)"
    echo "FAIL footprint_pidns/setup" >>"$RESULTS"
  fi
fi
if selected torch_no_nvml; then
  # NVML hidden from the process (as in a container started with
  # NVIDIA_DRIVER_CAPABILITIES=compute): every libnvidia-ml.so* bind-mounted over by
  # /dev/null in a mount namespace of its own. nvidia-smi, run by the case for its figures,
  # gets a copy of the real one (common.clean_env, CB_SMI_LD_LIBRARY_PATH).
  HIDE="$BUILD/hide_nvml.sh"
  REAL_NVML="$BUILD/nvml-real"
  mkdir -p "$REAL_NVML"
  cp -L "$(ldconfig -p | awk '/libnvidia-ml[.]so[.]1 /{print $NF; exit}')" "$REAL_NVML/libnvidia-ml.so.1" 2>"$WORK/hide-nvml.log"
  cat >"$HIDE" <<'EOS'
#!/usr/bin/env bash
set -e
for f in $(ldconfig -p | awk '/libnvidia-ml[.]so/{print $NF}'); do mount --bind /dev/null "$(readlink -f "$f")"; done
exec "$@"
EOS
  if [[ -s $REAL_NVML/libnvidia-ml.so.1 ]] && unshare --mount bash "$HIDE" true 2>>"$WORK/hide-nvml.log"; then
    pair torch_no_nvml "CB_SMI_LD_LIBRARY_PATH=$REAL_NVML B:CUDABUDGET_LIMIT=8Gi" 180 -- unshare --mount bash "$HIDE" \
      "$PY" "$C/torch_case.py" --mode alloc --budget-gib 8
  else
    log "FAIL torch_no_nvml/setup cannot hide NVML here (unshare --mount, mount --bind: root): $(head -c 300 "$WORK/hide-nvml.log")"
    echo "FAIL torch_no_nvml/setup" >>"$RESULTS"
  fi
fi
# A case of its own that prints PASS/FAIL/SKIP lines and a "NAME: ..." summary line:
# own_case NAME WHAT TIMEOUT_S CMD ARGS...; py_case NAME WHAT TIMEOUT_S SCRIPT ARGS...
py_case() {
  local name=$1 what=$2 limit=$3
  shift 3
  own_case "$name" "$what" "$limit" "$PY" "$@"
}
own_case() {
  local name=$1 what=$2 limit=$3
  shift 3
  echo "-- $name $what ..."
  timeout -k 10 "$limit" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err"
  local rc=$?
  tee -a "$LOG" <"$WORK/$name.out"
  grep -E '^(PASS|FAIL|SKIP) ' "$WORK/$name.out" >>"$RESULTS"
  if ! grep -q "^$name: " "$WORK/$name.out"; then
    log "FAIL $name/ran rc=$rc: $(tail -c 600 "$WORK/$name.err")"
    echo "FAIL $name/ran" >>"$RESULTS"
  fi
  wait_gpu_idle
}
# Job budgets: three PyTorch processes of one job, kill -9 of one, a waiting PyTorch process
# beside a JAX one of the same job (scripts/gpu/cases/job_gpu.py prints PASS/FAIL lines).
if selected job_gpu; then
  py_case job_gpu "(CUDABUDGET_SCOPE=job:..., several processes)" 180 "$C/job_gpu.py" --lib "$LIB" --python "$PY"
fi
# Budgets changed while jobs run: a PyTorch training job lowered from 40 to 20 GiB and a
# second job raised from 20 to 40 GiB, and how soon a process's view follows a change
# (scripts/gpu/cases/live_limit.py prints PASS/FAIL lines).
if selected live_limit; then
  py_case live_limit "(cudabudget limit while two jobs run)" 240 "$C/live_limit.py" --lib "$LIB" --cli "$CLI" --python "$PY"
fi
# A tenant under 2 GiB loading modules with 3 GiB of globals beside a neighbour that
# allocates and frees 1 GiB (scripts/gpu/cases/load_neighbour.py prints PASS/FAIL lines).
if selected load_neighbour; then
  py_case load_neighbour "(tenant under 2 GiB loading 3 GiB of globals beside a 1 GiB neighbour)" 300 "$C/load_neighbour.py" --lib "$LIB" --seconds 5
fi
# A module with 1.5 GiB of globals in a compressed fatbinary (nvcc -Xfatbin=-compress-all, and
# --compress-mode=size/speed), 20 loads under 1 GiB, an outside NVML sampler watching the card
# (scripts/gpu/compressed_fatbin.sh prints PASS/FAIL lines).
if selected compressed_fatbin; then
  own_case compressed_fatbin "(1.5 GiB of globals in compressed fatbinaries, 20 loads under 1 GiB, NVML watching)" 300 \
    bash "$HERE/compressed_fatbin.sh" --lib "$LIB" --python "$PY"
fi
# A job's members beside one SIGSTOPped and one SIGKILLed at any point of its calls
# (scripts/gpu/cases/job_tenants.py prints PASS/FAIL lines and a summary line).
if selected job_tenants; then
  py_case job_tenants "(a stopped member, a member killed holding the lock)" 240 "$C/job_tenants.py" --lib "$LIB"
fi
# Two Ray actors of num_gpus=0.5 each held to half the card by deploy/ray's cudabudget_ray,
# their code naming no budget (scripts/gpu/cases/ray_fractions.py prints PASS/FAIL lines, or
# a SKIP line where Ray or PyTorch is not installed).
if selected ray_fractions; then
  py_case ray_fractions "(two Ray actors of num_gpus=0.5 on one GPU)" 330 "$C/ray_fractions.py" --lib "$LIB" --timeout 300
fi
if selected dataloader_fork; then
  pair dataloader_fork "B:CUDABUDGET_LIMIT=8Gi" 150 -- \
    "$PY" "$C/dataloader_case.py" --budget-gib 8 --hold-gib 2 --after-gib 4 --workers 4 --epochs 6 \
    --loader-timeout 60 --watchdog-s 100
fi

if [[ $TWO_GPU -eq 1 ]] && { selected two_gpu_perdev || selected two_gpu_visible1 || selected two_gpu_stream \
  || selected two_gpu_reordered || selected two_gpu_peer || selected two_gpu_job || selected two_gpu_nccl; }; then
  if [[ $NGPU -ge 2 ]]; then
    if selected two_gpu_perdev; then
      pair two_gpu_perdev "CUDA_VISIBLE_DEVICES=0,1 B:CUDABUDGET_LIMIT_0=6Gi B:CUDABUDGET_LIMIT_1=10Gi" 180 -- \
        "$PY" "$C/torch_case.py" --mode twogpu --dev0 4,4 --dev1 8,4
    fi
    if selected two_gpu_visible1; then
      pair two_gpu_visible1 "CUDA_VISIBLE_DEVICES=1 B:CUDABUDGET_LIMIT_0=5Gi" 180 -- \
        "$PY" "$C/nvml_case.py" --mode visible1 --first-gib 4 --second-gib 2 --budget-gib 5
    fi
    if selected two_gpu_stream; then
      graph_case two_gpu_stream "CUDA_VISIBLE_DEVICES=0,1 B:CUDABUDGET_LIMIT=4Gi" twodev
    fi
    # Reordered ordinals, peer copies, a job over two devices, NCCL between two budgeted
    # processes: scripts/gpu/cases/two_gpu.py runs each natively and budgeted.
    for c in reordered peer job nccl; do
      if selected "two_gpu_$c"; then
        py_case "two_gpu_$c" "(two GPUs: $c)" 420 "$C/two_gpu.py" --lib "$LIB" --python "$PY" --case "$c"
      fi
    done
  else
    log "SKIP two_gpu: only $NGPU GPU(s) visible (run on the nvidia-h200-x2 kind)"
    echo "SKIP two_gpu: only $NGPU GPU(s) visible" >>"$RESULTS"
  fi
fi

# ------------------------------------------------------------------ summary
NPASS=$(grep -c '^PASS ' "$RESULTS")
NFAIL=$(grep -c '^FAIL ' "$RESULTS")
NSKIP=$(grep -c '^SKIP ' "$RESULTS")
ELAPSED=$(($(date +%s) - T_START))
{
  echo "cudabudget GPU matrix $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1) x$NGPU"
  cat "$RESULTS"
  [[ $NSKIP -gt 0 ]] && echo "($NSKIP SKIP lines: checks the installed software cannot make; not counted)"
  echo "$NPASS passed, $NFAIL failed (${ELAPSED}s)"
} >"$SUMMARY"
log ""
log "================ summary (${ELAPSED}s; full log: $LOG) ================"
if [[ $NFAIL -gt 0 ]]; then
  grep '^FAIL ' "$RESULTS" | tee -a "$LOG"
fi
if [[ $NSKIP -gt 0 ]]; then
  grep '^SKIP ' "$RESULTS" | tee -a "$LOG"
fi
log "$NPASS passed, $NFAIL failed"

if [[ $SKIP_BENCH -eq 0 ]]; then
  log ""
  log "-- benchmarks (scripts/gpu/bench/run_bench.sh --reps $REPS) ..."
  bash "$HERE/bench/run_bench.sh" --reps "$REPS"
  log "matrix: $NPASS passed, $NFAIL failed"
fi
[[ $NFAIL -eq 0 ]]
