"""Budgets changed while jobs run (`cudabudget limit`), on the GPU.

Run by run_all.sh (case live_limit) or alone:
    python3 scripts/gpu/cases/live_limit.py --lib target/release/libcudabudget.so \
        --cli target/release/cudabudget
Prints one PASS/FAIL line per check (and the facts behind it); exit status 0 iff no FAIL.

1. Job A: a PyTorch training loop under 40 GiB whose batch grows a little each step, so
   that its allocator's cache grows past 20 GiB until a cudaMalloc is refused (then
   PyTorch frees the cache and retries). Job B: a PyTorch process under 20 GiB holding 18 GiB,
   whose request for 17 GiB more is refused.
2. `cudabudget limit --job A 20Gi`, then `--job B 40Gi`. A keeps training: its reserve
   stays above 20 GiB until its next growth is refused, then PyTorch frees its cache and
   the reserve never again passes 20 GiB, and no out-of-memory error reaches it. B's next 17 GiB request is granted, nvidia-smi
   shows each process within the budget in force, neither restarts, and each process's
   own view (torch.cuda.mem_get_info's total) shows its job's new budget.
3. A process budget (`limit --pid`) changed ten times while the process polls its view:
   how long after the command starts the view shows the new budget (median, worst).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import clean_env, smi_apps  # noqa: E402

GiB = 1 << 30

TRAIN = r"""
import json, os, sys, time, torch
status = sys.argv[1]; stop = sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(8)]).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
step, ooms, peak, peak_after, total0, settled = 0, 0, 0, 0, None, False
while not os.path.exists(stop):
    # A growing batch (as under a sequence-length warm-up): each step's activations are a
    # little larger than any block the allocator cached, so its cache grows until a
    # cudaMalloc is refused, and PyTorch frees the cache and retries.
    batch = 2048 + 32 * (step % 400)
    try:
        x = torch.randn(batch, 8192, device="cuda")
        loss = model(x).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        torch.cuda.synchronize()
        step += 1
    except torch.OutOfMemoryError:
        ooms += 1
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    total0 = total if total0 is None else total0
    if total == total0:
        peak = max(peak, reserved)
    elif settled or reserved <= total:
        # Lowering frees nothing: the reserve stays until a growth is refused and PyTorch
        # frees its cache; from then on it must stay within the new budget.
        settled = True
        peak_after = max(peak_after, reserved)
    with open(status + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "step": step, "ooms": ooms, "total": total,
                   "reserved": reserved, "peak_reserved_before": peak,
                   "peak_reserved_after": peak_after, "settled": settled,
                   "t": time.time()}, f)
    os.replace(status + ".tmp", status)
"""

SERVE = r"""
import json, os, sys, time, torch
status = sys.argv[1]; go = sys.argv[2]; stop = sys.argv[3]
held = [torch.empty(18 * (1 << 30), dtype=torch.uint8, device="cuda")]
def report(**kw):
    free, total = torch.cuda.mem_get_info()
    kw.update({"pid": os.getpid(), "total": total, "held": sum(t.numel() for t in held),
               "t": time.time()})
    with open(status + ".tmp", "w") as f:
        json.dump(kw, f)
    os.replace(status + ".tmp", status)
def ask():
    try:
        held.append(torch.empty(17 * (1 << 30), dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return False
first = ask()
report(first=first)
while not os.path.exists(go):
    time.sleep(0.01)
second = ask()
report(first=first, second=second)
while not os.path.exists(stop):
    time.sleep(0.05)
    report(first=first, second=second)
"""

POLL = r"""
import json, os, sys, time, torch
out = sys.argv[1]; stop = sys.argv[2]
torch.zeros(1, device="cuda")
seen = torch.cuda.mem_get_info()[1]
changes = []
print("READY", flush=True)
while not os.path.exists(stop):
    total = torch.cuda.mem_get_info()[1]
    if total != seen:
        changes.append({"total": total, "t": time.time()})
        seen = total
        print(json.dumps(changes[-1]), flush=True)
    time.sleep(0.001)
"""

results = []


def check(name, ok, facts):
    line = "%s live_limit/%s %s" % ("PASS" if ok else "FAIL", name, json.dumps(facts, default=str))
    results.append(ok)
    print(line, flush=True)


def read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def wait_for(predicate, timeout):
    t = time.time()
    while time.time() - t < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return None


def limit(args, cli, env):
    t = time.time()
    out = subprocess.run([cli, "limit"] + args, env=env, capture_output=True, text=True,
                         timeout=30)
    return out, t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib", required=True)
    p.add_argument("--cli", required=True)
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="cb-live-")
    py = args.python
    base = clean_env()
    base.update({"CUDABUDGET_JOB_DIR": tmp, "CUDABUDGET_RUNTIME_DIR": tmp,
                 "CUDABUDGET_EVENTS": os.path.join(tmp, "events.jsonl")})
    tag = os.getpid()
    job_a, job_b = "live-a-%d" % tag, "live-b-%d" % tag

    def env(job, limit_):
        e = dict(base)
        e.update({"LD_PRELOAD": args.lib, "CUDABUDGET_SCOPE": "job:" + job,
                  "CUDABUDGET_LIMIT": limit_})
        return e

    a_status, b_status = os.path.join(tmp, "a.json"), os.path.join(tmp, "b.json")
    stop, go = os.path.join(tmp, "stop"), os.path.join(tmp, "go")
    a = subprocess.Popen([py, "-c", TRAIN, a_status, stop], env=env(job_a, "40Gi"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    b = subprocess.Popen([py, "-c", SERVE, b_status, go, stop], env=env(job_b, "20Gi"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        a0 = wait_for(lambda: (s := read(a_status)) and s["step"] >= 60
                      and s["peak_reserved_before"] > 20 * GiB and s, 120)
        b0 = wait_for(lambda: read(b_status), 120)
        check("both_running", bool(a0 and b0), {"a": a0, "b": b0})
        if not (a0 and b0):
            return 1
        check("B_17GiB_refused_under_20GiB", b0.get("first") is False, b0)
        check("A_over_20GiB_before", a0["peak_reserved_before"] > 20 * GiB, a0)

        out_a, t_a = limit(["--job", job_a, "20Gi"], args.cli, base)
        out_b, t_b = limit(["--job", job_b, "40Gi"], args.cli, base)
        check("limit_commands_succeed", out_a.returncode == 0 and out_b.returncode == 0,
              {"a": out_a.stdout.strip() + out_a.stderr.strip(),
               "b": out_b.stdout.strip() + out_b.stderr.strip()})
        open(go, "w").close()
        step_at_change = (read(a_status) or a0)["step"]
        a1 = wait_for(lambda: (s := read(a_status)) and s["total"] == 20 * GiB
                      and s["step"] >= step_at_change + 100 and s, 120)
        b1 = wait_for(lambda: (s := read(b_status)) and "second" in s and s, 60)
        smi = {x["pid"]: x["mib"] for x in (smi_apps() or [])}
        check("A_keeps_training_under_20GiB",
              bool(a1) and a.poll() is None and a1["ooms"] == 0 and a1["settled"]
              and 0 < a1["peak_reserved_after"] <= 20 * GiB,
              {"a": a1 or read(a_status), "step_at_change": step_at_change})
        check("A_view_total_20GiB", bool(a1) and a1["total"] == 20 * GiB, a1 or read(a_status))
        check("B_17GiB_granted_after_raise", bool(b1) and b1.get("second") is True,
              b1 or read(b_status))
        check("B_view_total_40GiB", bool(b1) and b1["total"] == 40 * GiB, b1)
        check("smi_each_within_budget_in_force",
              smi.get(a.pid, 1 << 40) <= 20 * 1024 * 1.02
              and smi.get(b.pid, 1 << 40) <= 40 * 1024 * 1.02,
              {"a_mib": smi.get(a.pid), "b_mib": smi.get(b.pid)})
        check("neither_restarted",
              a.poll() is None and b.poll() is None
              and (a1 or {}).get("pid") == a.pid and (b1 or {}).get("pid") == b.pid,
              {"a": a.poll(), "b": b.poll()})
        events = []
        try:
            with open(base["CUDABUDGET_EVENTS"]) as f:
                events = [json.loads(x) for x in f if '"budget_changed"' in x]
        except OSError:
            pass
        check("changes_are_events",
              any(e.get("job") == job_a and e.get("limit_bytes") == 20 * GiB for e in events)
              and any(e.get("job") == job_b and e.get("limit_bytes") == 40 * GiB for e in events),
              {"events": len(events), "first": events[:1]})
    finally:
        open(stop, "w").close()
        for proc in (a, b):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # 3. how soon a process's own budget change shows in its view
    pstop = os.path.join(tmp, "pstop")
    penv = dict(base)
    penv.update({"LD_PRELOAD": args.lib, "CUDABUDGET_LIMIT": "8Gi"})
    poll = subprocess.Popen([py, "-c", POLL, tmp, pstop], env=penv, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    latencies = []
    try:
        poll.stdout.readline()  # READY
        time.sleep(0.5)  # its record is published
        for i in range(10):
            size = "%dGi" % (4 + (i % 2) * 4)
            out, t0 = limit(["--pid", str(poll.pid), size], args.cli, base)
            line = poll.stdout.readline()
            if out.returncode != 0 or not line.startswith("{"):
                break
            latencies.append((json.loads(line)["t"] - t0) * 1000)
    finally:
        open(pstop, "w").close()
        poll.wait(timeout=30)
    check("process_view_follows_within_100ms",
          len(latencies) == 10 and max(latencies) < 100,
          {"ms_median": round(statistics.median(latencies), 1) if latencies else None,
           "ms_max": round(max(latencies), 1) if latencies else None, "n": len(latencies)})
    print("live_limit: %d passed, %d failed" % (sum(results), len(results) - sum(results)))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
