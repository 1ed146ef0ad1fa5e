#!/usr/bin/env bash
# The operating commands on a real GPU: while a PyTorch process (8 GiB budget, a 4 GiB
# tensor) and a JAX process (6 GiB budget, default preallocation) run, `status --json`
# and the exporter show both, each within 2 % of nvidia-smi's per-process figure; the
# exporter's text parses; `doctor` passes and names the driver.
#
#   bash scripts/gpu/monitor_check.sh          (carrying target/release/{libcudabudget.so,cudabudget,cudabudget-node})
#
# Prints one PASS/FAIL line per check and "N passed, M failed"; files land in $OUT
# (./gpu-out without it): status.json, smi.csv, metrics.txt, doctor.txt, the processes'
# output. Exit status 1 when a check failed.
set -u
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
LIB="${CB_LIB:-$ROOT/target/release/libcudabudget.so}"
CLI="${CB_CLI:-$ROOT/target/release/cudabudget}"
# The node services (webhook, exporter): `cargo build --release -p cudabudget-node`.
NODE_BIN="${CB_NODE_BIN:-$ROOT/target/release/cudabudget-node}"
PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT"
for v in $(env | sed -n 's/^\(CUDABUDGET_[A-Z0-9_]*\|CUDA_DEVICE_MEMORY_LIMIT[A-Z0-9_]*\|XLA_PYTHON_CLIENT_[A-Z_]*\)=.*/\1/p'); do
  unset "$v"
done
export CUDABUDGET_LIB="$LIB" CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

"$CLI" run --limit 8Gi -- "$PY" -c '
import time, torch
x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(120)
' >"$OUT/torch.out" 2>&1 &
TORCH=$!
PIDS+=("$TORCH")
"$CLI" run --limit 6Gi -- "$PY" -c '
import time, jax, jax.numpy as jnp
x = jnp.ones((256, 1024, 1024), dtype=jnp.float32)
x.block_until_ready()
print("ready", jax.devices(), flush=True)
time.sleep(120)
' >"$OUT/jax.out" 2>&1 &
JAX=$!
PIDS+=("$JAX")

for _ in $(seq 1 180); do
  if grep -q '^ready' "$OUT/torch.out" && grep -q '^ready' "$OUT/jax.out"; then break; fi
  sleep 0.5
done
# The books follow NVML's per-process figure at most once a second.
sleep 3

"$CLI" status --json >"$OUT/status.json" 2>"$OUT/status.err"
"$CLI" status >"$OUT/status.txt" 2>&1
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits >"$OUT/smi.csv" 2>&1
"$NODE_BIN" exporter --per-process --listen 127.0.0.1:0 2>"$OUT/exporter.err" &
EXPORTER=$!
PIDS+=("$EXPORTER")
for _ in $(seq 1 50); do grep -q listening "$OUT/exporter.err" && break; sleep 0.1; done
ADDRESS=$(sed -n 's|.*listening on http://\([^/]*\)/metrics.*|\1|p' "$OUT/exporter.err")
"$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' \
  "http://$ADDRESS/metrics" >"$OUT/metrics.txt" 2>&1
"$CLI" doctor >"$OUT/doctor.txt" 2>&1
DOCTOR_RC=$?
nvidia-smi --query-gpu=driver_version --format=csv,noheader >"$OUT/driver.txt" 2>&1

"$PY" - "$OUT" "$TORCH" "$JAX" "$DOCTOR_RC" <<'EOF'
import json, re, sys
out, torch_pid, jax_pid, doctor_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
results = []
def check(name, ok, detail):
    results.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} monitor/{name} [{detail}]")

smi = {}
for line in open(f"{out}/smi.csv"):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
        smi[int(parts[0])] = int(parts[1]) << 20
try:
    status = json.load(open(f"{out}/status.json"))
except Exception as e:
    status = {"processes": []}
    check("status_json_parses", False, repr(e))
by_pid = {p["pid"]: p for p in status["processes"]}

metrics = open(f"{out}/metrics.txt").read()
used_metric = {}
for m in re.finditer(r'^cudabudget_memory_used_bytes\{([^}]*)\} (\S+)$', metrics, re.M):
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    used_metric[int(labels["pid"])] = float(m.group(2))
try:
    from prometheus_client.parser import text_string_to_metric_families
    families = [f.name for f in text_string_to_metric_families(metrics)]
    check("exporter_text_parses", "cudabudget_memory_used_bytes" in families, f"{len(families)} families")
except ImportError:
    print("INFO monitor/exporter_text_parses [prometheus_client is not installed here]")

for name, pid, budget in (("torch", torch_pid, 8 << 30), ("jax", jax_pid, 6 << 30)):
    p = by_pid.get(pid)
    check(f"{name}_in_status", p is not None and len(p["devices"]) == 1, f"pid {pid}")
    if p is None or not p["devices"]:
        continue
    d = p["devices"][0]
    check(f"{name}_budget_in_status", d["limit_bytes"] == budget, f"limit_bytes={d['limit_bytes']}")
    nv = smi.get(pid)
    used = d["used_bytes"]
    ok = nv is not None and abs(used - nv) <= 0.02 * nv
    check(f"{name}_status_within_2pct_of_smi", ok, f"status={used / 2**20:.0f} MiB smi={None if nv is None else nv >> 20} MiB")
    exported = used_metric.get(pid)
    ok = nv is not None and exported is not None and abs(exported - nv) <= 0.02 * nv
    check(f"{name}_exporter_within_2pct_of_smi", ok, f"exporter={None if exported is None else exported / 2**20:.0f} MiB")
    check(f"{name}_physical_total", (d.get("physical_total_bytes") or 0) > budget, f"physical_total_bytes={d.get('physical_total_bytes')}")

doctor = open(f"{out}/doctor.txt").read()
driver = open(f"{out}/driver.txt").read().strip()
check("doctor_passes", doctor_rc == 0, f"exit {doctor_rc}")
check("doctor_names_the_driver", bool(driver) and f"driver {driver}" in doctor, f"nvidia-smi driver {driver!r}")
check("doctor_proves_interposition", re.search(r"^ok +interposition", doctor, re.M) is not None, "interposition line")
passed = sum(results)
print(f"{passed} passed, {len(results) - passed} failed")
sys.exit(0 if all(results) else 1)
EOF
