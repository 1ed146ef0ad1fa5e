"""A job's members on the GPU when one of them is stopped or killed at any moment
(CUDABUDGET_SCOPE=job:<name>, 8 GiB).

Run alone:
    python3 scripts/gpu/cases/job_tenants.py --lib target/release/libcudabudget.so
Prints one PASS/FAIL line per check (and the facts behind it); exit status 0 iff no FAIL.

A "busy" member allocates and frees 256 MiB through the driver in a loop (PyTorch with
torch.cuda.empty_cache() after each free, so every step is a cuMemAlloc and a cuMemFree).
An "other" member, told over a pipe, allocates and frees 1 GiB and says how long each took.

1. SIGSTOP: the busy member is stopped 150 times at whatever point of its calls (it may
   hold the job's admission lock); each time the other member allocates and frees 1 GiB:
   each call returns within 0.5 s, every allocation is granted, and nvidia-smi's sum over
   the two stays within the budget (+2 %).
2. SIGKILL: the busy member is killed 20 times at whatever point (and started again);
   after each kill the other member allocates and frees 1 GiB within 0.5 s; after the
   last kill it gets 7 GiB of the 8 within 1.5 s of that kill (the dead member's share
   came back).
A call that has not answered after 10 s counts as stuck (and the run is then judged on
that alone).
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import clean_env, smi_apps  # noqa: E402

BUSY = r"""
import os, sys, torch
torch.zeros(1, device="cuda")
open(sys.argv[1], "w").write(str(os.getpid()))
while True:
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del x
    torch.cuda.empty_cache()
"""

OTHER = r"""
import json, sys, time, torch
torch.zeros(1, device="cuda")
print("READY", flush=True)
for line in sys.stdin:
    gib = float(line)
    t = time.time()
    try:
        x = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    took_alloc = time.time() - t
    t = time.time()
    if ok:
        del x
    torch.cuda.empty_cache()
    took_free = time.time() - t
    print(json.dumps({"ok": ok, "alloc_s": round(took_alloc, 4),
                      "free_s": round(took_free, 4), "at": time.time()}), flush=True)
"""

results = []
STOPS = 150


def check(name, ok, facts):
    line = "%s job_tenants/%s %s" % ("PASS" if ok else "FAIL", name, json.dumps(facts, default=str))
    results.append(ok)
    print(line, flush=True)


def wait_file(path, proc, timeout=120):
    t = time.time()
    while time.time() - t < timeout:
        if os.path.exists(path):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


class Other:
    def __init__(self, py, env):
        self.proc = subprocess.Popen([py, "-c", OTHER], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.ready = self.proc.stdout.readline().strip() == "READY"

    def ask(self, gib, timeout=10.0):
        self.proc.stdin.write("%s\n" % gib)
        self.proc.stdin.flush()
        import select
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            return {"ok": None, "stuck": True}
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.kill()
        self.proc.wait()


def start_busy(py, env, tmp, n):
    ready = os.path.join(tmp, "busy%d" % n)
    proc = subprocess.Popen([py, "-c", BUSY, ready], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc, wait_file(ready, proc)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib", required=True)
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="cb-job-tenants-")
    py = args.python
    env = clean_env()
    env.update({"LD_PRELOAD": args.lib, "CUDABUDGET_SCOPE": "job:tenants-%d" % os.getpid(),
                "CUDABUDGET_LIMIT": "8Gi", "CUDABUDGET_LOG": "warn"})
    rng = random.Random(25)

    # 1. SIGSTOP at any point.
    busy, up = start_busy(py, env, tmp, 0)
    other = Other(py, env)
    check("members_up", up and other.ready, {"busy_up": up, "other_ready": other.ready})
    worst, refused, stuck, over = 0.0, 0, 0, []
    for _ in range(STOPS):
        time.sleep(rng.uniform(0.001, 0.02))
        busy.send_signal(signal.SIGSTOP)
        r = other.ask(1)
        apps = smi_apps() or []
        mib = sum(a["mib"] for a in apps if a["pid"] in (busy.pid, other.proc.pid))
        if mib > 8 * 1024 * 1.02:
            over.append(mib)
        busy.send_signal(signal.SIGCONT)
        if r.get("stuck"):
            stuck += 1
            continue
        refused += 0 if r["ok"] else 1
        worst = max(worst, r["alloc_s"], r["free_s"])
    check("stopped_member_never_holds_up_allocs_or_frees",
          stuck == 0 and worst < 0.5, {"worst_s": worst, "stuck": stuck})
    check("others_allocate_normally_beside_a_stopped_member", refused == 0 and stuck == 0,
          {"refused": refused})
    check("smi_sum_within_budget_while_stopped", not over, {"over_mib": over})

    # 2. SIGKILL at any point.
    worst, refused, stuck = 0.0, 0, 0
    for n in range(1, 21):
        time.sleep(rng.uniform(0.005, 0.05))
        busy.send_signal(signal.SIGKILL)
        busy.wait()
        killed_at = time.time()
        r = other.ask(1)
        if r.get("stuck"):
            stuck += 1
        else:
            refused += 0 if r["ok"] else 1
            worst = max(worst, r["alloc_s"], r["free_s"])
        if n < 20:
            busy, _ = start_busy(py, env, tmp, n)
    last = other.ask(7)
    check("killed_member_never_holds_up_allocs_or_frees", stuck == 0 and worst < 0.5,
          {"worst_s": worst, "stuck": stuck, "refused": refused})
    check("after_kills_7GiB_of_8_granted_within_1.5s",
          last.get("ok") is True and last.get("at", 1e18) - killed_at <= 1.5,
          {"attempt": last, "seconds_after_kill": round(last.get("at", 1e18) - killed_at, 3)})
    other.close()
    print("job_tenants: %d passed, %d failed" % (sum(results), len(results) - sum(results)))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
