#!/usr/bin/env bash
# The Rust client on cudarc (tests/cudarc_client.rs) on a real GPU, without the library
# ("native") and with it under a 4 GiB budget ("budget"); one PASS/FAIL line per check,
# then `N passed, M failed`. Exit status 0 iff no check failed.
#
# The GPU machine has no Rust, so the client is built on the build machine and carried:
#
#   bash scripts/gpu/rust_client.sh --build
#       (build machine) builds the client (cargo test --release --no-run --test
#       cudarc_client) and copies it to target/release/cudarc_client
#
#   bash scripts/gpu/rust_client.sh BIN [LIB]
#       (GPU machine, from the repository root) runs BIN, e.g.
#       target/release/cudarc_client; LIB defaults to $CB_LIB, else
#       target/release/libcudabudget.so (dist/libcudabudget.so works the same)
#
# With the device tool: carry target/release/cudarc_client and
# target/release/libcudabudget.so, run
#   bash scripts/gpu/rust_client.sh target/release/cudarc_client
# The log (both runs' output and the library's stderr) goes to $OUT/rust_client.log
# ($OUT unset: ./gpu-out/).
#
# What the client does (sizes 3 GiB and 6 GiB): a primary context (CudaContext::new),
# mem_get_info, cuMemAlloc_v2 of each size then cuMemFree_v2, stream-ordered allocations of
# each size through cudarc's safe API (cuMemAllocAsync) dropped again (cuMemFreeAsync),
# then cuMemAlloc_v2 of each size again (the pool must be trimmed for the 3 GiB to fit).
set -uo pipefail

if [[ ${1:-} == --build ]]; then
  set -e
  cd "$(dirname "$0")/../.."
  exe=$(cargo test --release --no-run --test cudarc_client --message-format=json 2>/dev/null \
    | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cudarc_client":
        print(m["executable"])')
  dir=${CARGO_TARGET_DIR:-target}/release
  cp "$exe" "$dir/cudarc_client"
  echo "$dir/cudarc_client"
  exit 0
fi

if [[ $# -lt 1 || $# -gt 2 || ${1:-} == -* ]]; then
  sed -n '2,24p' "$0" >&2
  exit 2
fi
BIN=$1
LIB=${2:-${CB_LIB:-target/release/libcudabudget.so}}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
LOG=$OUT/rust_client.log
: >"$LOG"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

GIB=$((1 << 30))
BUDGET=4Gi
BUDGET_BYTES=$((4 * GIB))
SIZES=("$((3 * GIB))" "$((6 * GIB))")
OOM=2

NPASS=0
NFAIL=0
verdict() {  # verdict NAME DETAIL COMMAND...
  local name=$1 detail=$2
  shift 2
  if "$@"; then
    echo "PASS rust_client/$name $detail" | tee -a "$LOG"
    NPASS=$((NPASS + 1))
  else
    echo "FAIL rust_client/$name $detail" | tee -a "$LOG"
    NFAIL=$((NFAIL + 1))
  fi
}

# rcs OP FILE: the rc= values of OP's lines, space-separated.
rcs() { awk -v op="$1" '$1 == op { for (i = 2; i <= NF; i++) if ($i ~ /^rc=/) { sub(/^rc=/, "", $i); printf "%s%s", sep, $i; sep = " " } }' "$2"; }
# info STEP KEY FILE: KEY's value on the info line of STEP.
info() { awk -v step="step=$1" -v key="$2=" '$1 == "info" { hit = 0; for (i = 2; i <= NF; i++) if ($i == step) hit = 1; if (hit) for (i = 2; i <= NF; i++) if (index($i, key) == 1) print substr($i, length(key) + 1) }' "$3"; }
last() { tail -1 "$1"; }

{
  echo "# $(date -u +%FT%TZ) rust_client.sh $BIN $LIB"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  ls -la "$BIN" "$LIB" 2>&1
} >>"$LOG"

if [[ ! -x $BIN ]]; then
  verdict setup/client false "[$BIN is not an executable: build it with --build and carry it]"
  echo "$NPASS passed, $NFAIL failed"
  exit 1
fi
if [[ ! -f $LIB ]]; then
  verdict setup/library false "[$LIB not found: carry target/release/libcudabudget.so]"
  echo "$NPASS passed, $NFAIL failed"
  exit 1
fi
LIB=$(cd "$(dirname "$LIB")" && pwd)/$(basename "$LIB")

run() {  # run NAME [VAR=VALUE...]: the client's stdout in $WORK/NAME.out
  local name=$1
  shift
  echo "## $name: $* $BIN --client ${SIZES[*]}" >>"$LOG"
  env -u LD_PRELOAD -u CUDABUDGET_LIMIT "$@" timeout 120 "$BIN" --client "${SIZES[@]}" \
    >"$WORK/$name.out" 2>"$WORK/$name.err"
  echo "exit status $?" >>"$LOG"
  cat "$WORK/$name.out" >>"$LOG"
  sed 's/^/stderr: /' "$WORK/$name.err" >>"$LOG"
}

run native
run budget LD_PRELOAD="$LIB" CUDABUDGET_LIMIT="$BUDGET" CUDABUDGET_LOG=info

N=$WORK/native.out
B=$WORK/budget.out
ntotal=$(info start total "$N")
btotal=$(info start total "$B")
bfree=$(info start free "$B")

verdict native/runs "[$(rcs context "$N") $(last "$N")]" \
  test "$(rcs context "$N") $(last "$N")" = "0 done"
verdict native/sees_the_card "[total=$ntotal]" test "${ntotal:-0}" -gt "$BUDGET_BYTES"
verdict native/every_allocation_fits \
  "[alloc=$(rcs alloc "$N") alloc_async=$(rcs alloc_async "$N") alloc_again=$(rcs alloc_again "$N")]" \
  test "$(rcs alloc "$N")/$(rcs alloc_async "$N")/$(rcs alloc_again "$N")" = "0 0/0 0/0 0"

verdict budget/runs "[$(rcs context "$B") $(last "$B")]" \
  test "$(rcs context "$B") $(last "$B")" = "0 done"
verdict budget/mem_get_info_total_is_the_budget "[total=$btotal free=$bfree native: total=$ntotal]" \
  test "${btotal:-0}" = "$BUDGET_BYTES" -a "${bfree:-1}" -le "${btotal:-0}"
verdict budget/cuMemAlloc_3GiB_ok_6GiB_oom "[alloc=$(rcs alloc "$B") free=$(rcs free "$B")]" \
  test "$(rcs alloc "$B")/$(rcs free "$B")" = "0 $OOM/0"
verdict budget/stream_alloc_3GiB_ok_6GiB_oom \
  "[alloc_async=$(rcs alloc_async "$B") free_async=$(rcs free_async "$B")]" \
  test "$(rcs alloc_async "$B")/$(rcs free_async "$B")" = "0 $OOM/0"
verdict budget/cuMemAlloc_after_the_pool_3GiB_ok_6GiB_oom \
  "[alloc_again=$(rcs alloc_again "$B") free_again=$(rcs free_again "$B")]" \
  test "$(rcs alloc_again "$B")/$(rcs free_again "$B")" = "0 $OOM/0"
verdict budget/library_loaded "[$(grep -c '^cudabudget:' "$WORK/budget.err") cudabudget: lines]" \
  grep -q '^cudabudget:' "$WORK/budget.err"

echo "$NPASS passed, $NFAIL failed" | tee -a "$LOG"
[[ $NFAIL -eq 0 ]]
