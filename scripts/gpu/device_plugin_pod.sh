#!/usr/bin/env bash
# A pod the device plugin budgets, on a real GPU without Kubernetes: `cudabudget-node
# device-plugin` advertises the GPUs' memory to a kubelet stand-in (the kubelet's side of
# the device plugin API over Unix sockets: crates/node/examples/kubelet_standin.rs), which
# admits one container asking `cudabudget.io/memory: 20`; the PyTorch process then runs
# with exactly the Allocate answer's environment and mounts (a private mount namespace
# binds the node's directories where the container would see them). Checks: the units
# advertised are each GPU's memory less 2 GiB, in GiB; the container gets one GPU by UUID;
# PyTorch sees 20 GiB, holds 16 GiB and is refused 8 GiB more with OutOfMemoryError; on two
# GPUs, a container asking one unit more than a GPU has is refused.
#
#   bash scripts/gpu/device_plugin_pod.sh   (as root; carrying target/release/cudabudget-node,
#                                            target/release/examples/kubelet_standin and
#                                            target/release/libcudabudget.so)
#
# One PASS/FAIL line per check and "N passed, M failed"; exit status 1 when a check failed.
set -u
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
NODE_BIN="${CB_NODE_BIN:-$ROOT/target/release/cudabudget-node}"
STANDIN="${CB_STANDIN:-$ROOT/target/release/examples/kubelet_standin}"
LIB="${CB_LIB:-$ROOT/target/release/libcudabudget.so}"
PY="${PYTHON:-python3}"
WORK=$(mktemp -d /tmp/cb-device-plugin.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
for v in $(env | sed -n 's/^\(CUDABUDGET_[A-Z0-9_]*\|CUDA_DEVICE_MEMORY_LIMIT[A-Z0-9_]*\|CUDA_VISIBLE_DEVICES\)=.*/\1/p'); do
  unset "$v"
done

PASSED=0 FAILED=0
check() { # check NAME CONDITION-STATUS DETAIL
  if [ "$2" = 0 ]; then echo "PASS $1 [$3]"; PASSED=$((PASSED + 1)); else echo "FAIL $1 [$3]"; FAILED=$((FAILED + 1)); fi
}

# The node, as the chart lays it out: the installer's <libraryDir>/current, the kubelet's
# device plugin directory, the plugin's runtime root.
install -d "$WORK/opt/v-test" "$WORK/device-plugins"
install -m 0755 "$LIB" "$WORK/opt/v-test/libcudabudget.so"
ln -sfn v-test "$WORK/opt/current"
"$NODE_BIN" device-plugin --kubelet-dir "$WORK/device-plugins" --library-dir "$WORK/opt/current" \
  --runtime-dir "$WORK/runtime" --reserve 2Gi >"$WORK/plugin.log" 2>&1 &
PIDS+=($!)
timeout 60 "$STANDIN" "$WORK/device-plugins" 20 >"$WORK/answer.txt" 2>"$WORK/standin.err"
rc=$?
check admitted "$rc" "$(tr '\n' ' ' <"$WORK/answer.txt") $(cat "$WORK/standin.err")"
[ "$rc" = 0 ] || { cat "$WORK/plugin.log"; echo "$PASSED passed, $FAILED failed"; exit 1; }

# Units: each GPU's memory (nvidia-smi, MiB) less the reserve, in whole GiB.
expected=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits \
  | awk '{ n += int(($1 * 1048576 - 2 * 1073741824) / 1073741824) } END { print n }')
units=$(sed -n 's/^units //p' "$WORK/answer.txt")
[ "$units" = "$expected" ]; check units_are_memory_less_reserve_in_gib $? "advertised=$units expected=$expected"
uuid=$(sed -n 's/^env CUDA_VISIBLE_DEVICES=//p' "$WORK/answer.txt")
nvidia-smi --query-gpu=uuid --format=csv,noheader | grep -qx "$uuid"
check one_gpu_by_uuid $? "CUDA_VISIBLE_DEVICES=$uuid"

# The container: its mounts at their paths in a private mount namespace, its environment.
{
  echo 'set -e; mount --make-rprivate /'
  while read -r kind container host mode; do
    [ "$kind" = mount ] || continue
    echo "mkdir -p '$container'; mount --bind '$host' '$container'"
    [ "$mode" = ro ] && echo "mount -o remount,bind,ro '$container'"
  done <"$WORK/answer.txt"
  printf 'exec env'
  sed -n "s/^env \(.*\)$/ '\1'/p" "$WORK/answer.txt" | tr -d '\n'
  echo " \"$PY\" \"$WORK/probe.py\""
} >"$WORK/container.sh"
cat >"$WORK/probe.py" <<'PYEOF'
import json, torch
GI = 2**30
facts = {"device_count": torch.cuda.device_count()}
free, total = torch.cuda.mem_get_info()
facts["total_gib"] = total / GI
held = torch.empty(16 * GI, dtype=torch.uint8, device="cuda")
facts["held_16_gib"] = True
try:
    more = torch.empty(8 * GI, dtype=torch.uint8, device="cuda")
    facts["refused"] = None
except torch.OutOfMemoryError as e:
    facts["refused"] = type(e).__name__
print(json.dumps(facts))
PYEOF
timeout 120 unshare -m bash "$WORK/container.sh" >"$WORK/probe.out" 2>"$WORK/probe.err"
facts=$(tail -n 1 "$WORK/probe.out")
echo "probe: $facts"
get() { "$PY" -c 'import json,sys; print(json.loads(sys.argv[1]).get(sys.argv[2]))' "$facts" "$1" 2>/dev/null; }
[ "$(get device_count)" = 1 ]; check the_container_sees_one_gpu $? "device_count=$(get device_count)"
[ "$(get total_gib)" = 20.0 ]; check the_budget_is_the_device $? "total_gib=$(get total_gib)"
[ "$(get held_16_gib)" = True ]; check sixteen_gib_fit $? "held_16_gib=$(get held_16_gib)"
[ "$(get refused)" = OutOfMemoryError ]; check eight_more_are_refused_by_pytorch $? "refused=$(get refused); $(grep -m1 'cudabudget' "$WORK/probe.err")"
# A container asking more than one GPU has: refused with the plugin's message (its units
# would span two GPUs). Needs two GPUs: one GPU's units are all the kubelet could ask.
ngpu=$(nvidia-smi -L | grep -c '^GPU ')
if [ "$ngpu" -ge 2 ]; then
  one=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1 \
    | awk '{ print int(($1 * 1048576 - 2 * 1073741824) / 1073741824) }')
  timeout 60 "$STANDIN" "$WORK/device-plugins" $((one + 1)) >"$WORK/answer2.txt" 2>"$WORK/standin2.err"
  rc=$?
  [ "$rc" = 1 ] && grep -q '^refused: ' "$WORK/standin2.err"
  check more_than_one_gpu_has_is_refused $? "asked $((one + 1)) of $one a GPU: rc=$rc $(head -c 300 "$WORK/standin2.err")"
else
  echo "SKIP more_than_one_gpu_has_is_refused [$ngpu GPU: run on two]"
fi

[ "$FAILED" = 0 ] || { echo "--- container.sh"; cat "$WORK/container.sh"; echo "--- probe.err"; tail -n 20 "$WORK/probe.err"; echo "--- plugin.log"; cat "$WORK/plugin.log"; }
echo "$PASSED passed, $FAILED failed"
[ "$FAILED" = 0 ]
