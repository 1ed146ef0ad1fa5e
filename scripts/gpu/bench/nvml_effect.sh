#!/usr/bin/env bash
# Does NVML's presence alone change what the driver's allocation calls cost? Runs
# driver_bench REPS times each way, interleaved: native, native with NVML initialised
# (--nvml), and under the library (which initialises NVML for the footprint). Prints
# medians (min..max). Usage: bash scripts/gpu/bench/nvml_effect.sh [REPS]
set -u
REPS=${1:-5}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
LIB="$ROOT/target/release/libcudabudget.so"
BIN=/tmp/cb-gpu/driver_bench
mkdir -p /tmp/cb-gpu
gcc -O2 -o "$BIN" "$HERE/driver_bench.c" -ldl -lpthread || exit 1
RES=/tmp/cb-gpu/nvml_effect.jsonl
: >"$RES"
for ((i = 1; i <= REPS; i++)); do
  env -u LD_PRELOAD "$BIN" 2>/dev/null | sed 's/^/native /' >>"$RES"
  env -u LD_PRELOAD "$BIN" --nvml 2>/dev/null | sed 's/^/native+nvml /' >>"$RES"
  env LD_PRELOAD="$LIB" CUDABUDGET_LIMIT=100Gi "$BIN" 2>/dev/null | sed 's/^/budget /' >>"$RES"
done
python3 - "$RES" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    arm, _, js = line.partition(" ")
    try:
        runs.setdefault(arm, []).append(json.loads(js))
    except ValueError:
        pass
keys = ["sync_4k_ns", "sync_2m_ns", "sync_64m_ns", "async_1t_ns", "async_16t_pairs_per_s", "meminfo_ns", "untouched_ns"]
print("| metric | " + " | ".join(runs) + " |")
print("|---" * (len(runs) + 1) + "|")
for k in keys:
    cells = []
    for arm, rs in runs.items():
        v = sorted(r[k] for r in rs if k in r)
        cells.append(f"{statistics.median(v):.1f} ({v[0]:.1f}..{v[-1]:.1f}, n={len(v)})" if v else "n/a")
    print(f"| {k} | " + " | ".join(cells) + " |")
PY
