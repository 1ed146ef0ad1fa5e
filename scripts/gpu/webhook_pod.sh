#!/usr/bin/env bash
# A pod the admission webhook budgets, on a real GPU without Kubernetes: the node is laid
# out as the Helm chart's installer lays it out (/opt/cudabudget/<version>, `current`,
# /run/cudabudget/records), `cudabudget-node webhook` patches a pod annotated
# `cudabudget.io/limit: 20Gi`, and the PyTorch process runs with exactly the patched
# container's environment and mounts (a private mount namespace binds the node's
# directories where the pod would see them). Checks: the process sees 20 GiB, holds
# 16 GiB, is refused 8 GiB more with PyTorch's OutOfMemoryError, and the exporter reading
# the node-wide runtime directory shows it with the pod's namespace, pod and container.
#
#   bash scripts/gpu/webhook_pod.sh      (as root; carrying target/release/{libcudabudget.so,cudabudget,cudabudget-node})
#
# One PASS/FAIL line per check and "N passed, M failed"; exit status 1 when a check failed.
set -u
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
CLI="${CB_CLI:-$ROOT/target/release/cudabudget}"
# The node services (webhook, exporter): `cargo build --release -p cudabudget-node`.
NODE_BIN="${CB_NODE_BIN:-$ROOT/target/release/cudabudget-node}"
PY="${PYTHON:-python3}"
WORK=$(mktemp -d /tmp/cb-webhook-pod.XXXXXX)
NODE_LIB=/opt/cudabudget
RECORDS=/run/cudabudget/records
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
for v in $(env | sed -n 's/^\(CUDABUDGET_[A-Z0-9_]*\|CUDA_DEVICE_MEMORY_LIMIT[A-Z0-9_]*\)=.*/\1/p'); do
  unset "$v"
done

# The node, as the chart's installer leaves it.
"$CLI" install "$NODE_LIB/v-test" >"$WORK/install.txt" 2>&1 || { cat "$WORK/install.txt"; exit 1; }
ln -sfn v-test "$NODE_LIB/current"
install -d -m 1777 /run/cudabudget "$RECORDS" /run/cudabudget/jobs

# The webhook, over TLS, and a pod of one GPU container for it to patch.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=localhost \
  -addext subjectAltName=IP:127.0.0.1 -keyout "$WORK/key.pem" -out "$WORK/cert.pem" >/dev/null 2>&1
"$NODE_BIN" webhook --listen 127.0.0.1:18443 --tls-cert "$WORK/cert.pem" --tls-key "$WORK/key.pem" \
  >"$WORK/webhook.log" 2>&1 &
PIDS+=($!)
"$PY" - "$WORK" <<'EOF' || { cat "$WORK/webhook.log"; exit 1; }
import base64, json, os, re, ssl, sys, time, urllib.request
work = sys.argv[1]
pod = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": "trainer-0", "namespace": "ml",
                    "annotations": {"cudabudget.io/limit": "20Gi"}},
       "spec": {"containers": [{"name": "trainer", "image": "pytorch",
                                "command": ["python", "train.py"],
                                "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
                                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
          "request": {"uid": "0d6a1c2e-1111-4c2b-9a3e-000000000001",
                      "kind": {"group": "", "version": "v1", "kind": "Pod"},
                      "resource": {"group": "", "version": "v1", "resource": "pods"},
                      "namespace": "ml", "operation": "CREATE",
                      "userInfo": {"username": "alice"}, "object": pod}}
context = ssl.create_default_context(cafile=f"{work}/cert.pem")
for _ in range(100):
    try:
        request = urllib.request.Request("https://127.0.0.1:18443/mutate", json.dumps(review).encode(),
                                         {"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(request, context=context, timeout=5))
        break
    except OSError:
        time.sleep(0.1)
response = answer["response"]
assert response["allowed"], response
patch = json.loads(base64.b64decode(response["patch"]))
def apply(doc, op):
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    for p in parts[:-1]:
        doc = doc[int(p)] if isinstance(doc, list) else doc.setdefault(p, {})
    last = parts[-1]
    if isinstance(doc, list):
        doc.append(op["value"]) if last == "-" else doc.__setitem__(int(last), op["value"])
    else:
        doc[last] = op["value"]
for op in patch:
    assert op["op"] in ("add", "replace"), op
    apply(pod, op)
container = pod["spec"]["containers"][0]
volumes = {v["name"]: v["hostPath"]["path"] for v in pod["spec"].get("volumes", [])}
# What the kubelet fills in: the downward API's fields (the pod's uid is the API server's,
# given after admission), and each mount's subPath or subPathExpr under its volume
# (made when missing, as the kubelet makes it).
fields = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
          "metadata.uid": "5f0c7a3e-2222-4d3b-8b4f-000000000002"}
env = {}
for e in container["env"]:
    env[e["name"]] = e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
def host_path(m):
    sub = m.get("subPath") or re.sub(r"\$\((\w+)\)", lambda v: env[v.group(1)], m.get("subPathExpr", ""))
    path = os.path.join(volumes[m["name"]], sub) if sub else volumes[m["name"]]
    if sub:
        os.makedirs(path, exist_ok=True)
    return path
mounts = [(host_path(m), m["mountPath"]) for m in container.get("volumeMounts", [])]
json.dump({"env": env, "mounts": mounts, "patch": patch}, open(f"{work}/container.json", "w"), indent=1)
with open(f"{work}/env.sh", "w") as out:
    for k, v in env.items():
        out.write(f"export {k}='{v}'\n")
with open(f"{work}/mounts.sh", "w") as out:
    for host, path in mounts:
        out.write(f"mkdir -p '{path}' && mount --bind '{host}' '{path}'\n")
print("INFO webhook patch:", json.dumps(patch)[:600])
EOF

# The container: its environment and mounts, nothing else of this shell's budget.
cat >"$WORK/trainer.py" <<'EOF'
import json, sys, time, torch
free, total = torch.cuda.mem_get_info()
held = torch.empty(16 << 30, dtype=torch.uint8, device="cuda")
try:
    more = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
    refused = None
except torch.OutOfMemoryError as e:
    refused = type(e).__name__
print(json.dumps({"total": total, "refused": refused}), flush=True)
time.sleep(20)
EOF
if unshare -m true 2>/dev/null; then
  unshare -m bash -c "mount --make-rprivate / && . '$WORK/mounts.sh' && . '$WORK/env.sh' && exec '$PY' '$WORK/trainer.py'" \
    >"$WORK/trainer.out" 2>"$WORK/trainer.err" &
else
  # No mount namespace here: the library's path in the pod made a link to the node's.
  echo "INFO webhook_pod: no mount namespace (unshare -m refused); the pod's paths are links"
  ln -sfn current/libcudabudget.so "$NODE_LIB/libcudabudget.so"
  bash -c ". '$WORK/env.sh' && exec '$PY' '$WORK/trainer.py'" >"$WORK/trainer.out" 2>"$WORK/trainer.err" &
fi
PIDS+=($!)
for _ in $(seq 1 600); do [ -s "$WORK/trainer.out" ] && break; sleep 0.1; done

CUDABUDGET_RUNTIME_DIR=$RECORDS "$NODE_BIN" exporter --listen 127.0.0.1:0 2>"$WORK/exporter.err" &
PIDS+=($!)
for _ in $(seq 1 50); do grep -q listening "$WORK/exporter.err" && break; sleep 0.1; done
ADDRESS=$(sed -n 's|.*listening on http://\([^/]*\)/metrics.*|\1|p' "$WORK/exporter.err")
"$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' \
  "http://$ADDRESS/metrics" >"$WORK/metrics.txt" 2>&1
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits >"$WORK/smi.csv" 2>&1
[ -n "${OUT:-}" ] && cp "$WORK"/{container.json,trainer.out,trainer.err,metrics.txt,smi.csv} "$OUT/" 2>/dev/null

"$PY" - "$WORK" <<'EOF'
import json, re, sys
work = sys.argv[1]
passed = failed = 0
def check(name, ok, detail):
    global passed, failed
    print(f"{'PASS' if ok else 'FAIL'} webhook_pod/{name} [{detail}]")
    passed += ok; failed += not ok
container = json.load(open(f"{work}/container.json"))
env = container["env"]
check("patched_preload_and_budget", env.get("LD_PRELOAD", "").endswith("libcudabudget.so") and env.get("CUDABUDGET_LIMIT") == "20Gi",
      f"LD_PRELOAD={env.get('LD_PRELOAD')} CUDABUDGET_LIMIT={env.get('CUDABUDGET_LIMIT')} mounts={container['mounts']}")
try:
    seen = json.loads(open(f"{work}/trainer.out").read().splitlines()[0])
except Exception as e:
    seen = {}
    print(open(f"{work}/trainer.err").read()[-2000:])
check("sees_20GiB", seen.get("total") == 20 << 30, f"total={seen.get('total')}")
check("8GiB_more_refused_OutOfMemoryError", seen.get("refused") == "OutOfMemoryError", f"refused={seen.get('refused')}")
series = [l for l in open(f"{work}/metrics.txt") if l.startswith("cudabudget_memory_used_bytes{")]
mine = [l for l in series if 'pod="trainer-0"' in l and 'namespace="ml"' in l and 'container="trainer"' in l]
used = float(mine[0].rsplit(" ", 1)[1]) if mine else 0
smi = sum(int(l.split(",")[1]) for l in open(f"{work}/smi.csv") if "," in l) << 20
check("exporter_shows_the_pod", len(mine) == 1, mine[0].strip() if mine else f"{len(series)} series: {series[:3]}")
check("exporter_used_within_2pct_of_smi", smi > 0 and abs(used - smi) <= 0.02 * smi, f"exporter={used / 2**20:.0f} MiB smi={smi >> 20} MiB")
limits = [l for l in open(f"{work}/metrics.txt") if l.startswith("cudabudget_memory_limit_bytes{") and 'pod="trainer-0"' in l]
check("exporter_limit_20GiB", bool(limits) and float(limits[0].rsplit(" ", 1)[1]) == 20 << 30, limits[0].strip() if limits else "none")
print(f"webhook_pod: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
EOF
