"""Job budgets on the GPU (CUDABUDGET_SCOPE=job:<name>): several processes, one budget.

Run by run_all.sh (case job_gpu) or alone:
    python3 scripts/gpu/cases/job_gpu.py --lib target/release/libcudabudget.so
Prints one PASS/FAIL line per check (and the facts behind it); exit status 0 iff no FAIL.

1. Three PyTorch processes of one job under 12 GiB each hold a 3 GiB tensor; a fourth
   process of the job asks for 3 GiB more and is refused (torch.OutOfMemoryError);
   nvidia-smi summed over the job's processes stays <= 12 GiB + 2 %.
2. kill -9 of one holder: the fourth process asks again and gets its 3 GiB within a
   second of the kill.
3. A JAX process of the job holds 6 GiB; a PyTorch process of the job with
   CUDABUDGET_ON_EXCEED=wait:30s asks for 8 GiB: it waits, and proceeds when the JAX
   process exits (told to 2 s after the request).
4. Two PyTorch processes of a job, each holding 1 GiB, exit normally one after the
   other: the job's ledger stays while one remains and is gone after the last.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import clean_env, smi_apps  # noqa: E402

GiB = 1 << 30

HOLD = r"""
import os, sys, time, torch
gib = float(sys.argv[1]); ready = sys.argv[2]
x = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
open(ready, "w").write(str(os.getpid()))
time.sleep(float(sys.argv[3]))
"""

ASK = r"""
import json, sys, time, torch
gib = float(sys.argv[1]); tries = int(sys.argv[2]); go = sys.argv[3]
torch.zeros(1, device="cuda")
res = {"attempts": []}
print("READY", flush=True)
held = []
for i in range(tries):
    while not __import__("os").path.exists(go + str(i)):
        time.sleep(0.01)
    t = time.time()
    try:
        held.append(torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        res["attempts"].append({"ok": True, "s": round(time.time() - t, 3), "at": time.time()})
    except torch.OutOfMemoryError as e:
        res["attempts"].append({"ok": False, "s": round(time.time() - t, 3), "at": time.time(),
                                "exc": str(e)[:200]})
    print(json.dumps(res), flush=True)
print("DONE " + json.dumps(res), flush=True)
"""

JAX_HOLD = r"""
import os, sys, time
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, jax.numpy as jnp
x = jnp.ones((int(float(sys.argv[1]) * (1 << 30)) // 4,), dtype=jnp.float32)
x.block_until_ready()
open(sys.argv[2], "w").write(str(os.getpid()))
t = time.time()
while not os.path.exists(sys.argv[2] + ".stop") and time.time() - t < float(sys.argv[3]):
    time.sleep(0.02)
"""

results = []


def check(name, ok, facts):
    line = "%s job_gpu/%s %s" % ("PASS" if ok else "FAIL", name, json.dumps(facts, default=str))
    results.append(ok)
    print(line, flush=True)


def env_for(args, extra=None):
    e = clean_env()
    e.update({"LD_PRELOAD": args.lib, "CUDABUDGET_SCOPE": "job:gpujob-%d" % os.getpid(),
              "CUDABUDGET_LIMIT": "12Gi", "CUDABUDGET_LOG": "info"})
    e.update(extra or {})
    return e


def wait_file(path, proc, timeout=120):
    t = time.time()
    while time.time() - t < timeout:
        if os.path.exists(path):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def smi_sum(pids):
    apps = smi_apps() or []
    return sum(a["mib"] for a in apps if a["pid"] in pids), {a["pid"]: a["mib"] for a in apps}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib", required=True)
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="cb-job-")
    py = args.python
    env = env_for(args)

    # 1. three holders, a fourth asks
    holders = []
    for i in range(3):
        ready = os.path.join(tmp, "h%d" % i)
        proc = subprocess.Popen([py, "-c", HOLD, "3", ready, "60"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        holders.append((proc, ready))
    up = [wait_file(r, pr) for pr, r in holders]
    go = os.path.join(tmp, "go")
    asker = subprocess.Popen([py, "-c", ASK, "3", "2", go], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    asker.stdout.readline()  # READY
    open(go + "0", "w").close()
    first = json.loads(asker.stdout.readline())
    pids = {pr.pid for pr, _ in holders} | {asker.pid}
    total_mib, per_pid = smi_sum(pids)
    check("three_holders_up", all(up), {"up": up})
    check("fourth_3GiB_refused", first["attempts"][0]["ok"] is False, first["attempts"][0])
    check("smi_sum<=12GiB+2%", total_mib <= 12 * 1024 * 1.02, {"sum_mib": total_mib, "per_pid": per_pid})

    # 2. kill -9 one holder; the asker tries again
    victim = holders[0][0]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = time.time()
    open(go + "1", "w").close()
    line = asker.stdout.readline()
    while line and not line.startswith("{") and not line.startswith("DONE"):
        line = asker.stdout.readline()
    second = json.loads(line.replace("DONE ", "")) if line else {"attempts": [{}, {"ok": None}]}
    att = second["attempts"][1] if len(second["attempts"]) > 1 else {}
    within = att.get("at", 1e18) - killed_at
    check("after_kill9_3GiB_granted_within_1s", att.get("ok") is True and within <= 1.0,
          {"attempt": att, "seconds_after_kill": round(within, 3)})
    total_mib, per_pid = smi_sum(pids)
    check("smi_sum_after_kill<=12GiB+2%", total_mib <= 12 * 1024 * 1.02,
          {"sum_mib": total_mib, "per_pid": per_pid})
    for pr, _ in holders[1:]:
        pr.kill()
        pr.wait()
    asker.kill()
    asker.wait()
    time.sleep(1.0)

    # 3. JAX holds 6 GiB for 3 s; PyTorch with wait:30s asks for 8 GiB
    env2 = env_for(args, {"CUDABUDGET_SCOPE": "job:gpuwait-%d" % os.getpid()})
    jready = os.path.join(tmp, "jax")
    jax = subprocess.Popen([py, "-c", JAX_HOLD, "6", jready, "60"], env=env2,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    jax_up = wait_file(jready, jax)
    wenv = dict(env2, CUDABUDGET_ON_EXCEED="wait:30s")
    go2 = os.path.join(tmp, "go2-")
    waiter = subprocess.Popen([py, "-c", ASK, "8", "1", go2], env=wenv, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    waiter.stdout.readline()
    t0 = time.time()
    open(go2 + "0", "w").close()
    time.sleep(2.0)  # the waiter is blocked by now
    open(jready + ".stop", "w").close()
    jax.wait()
    jax_exit = time.time()
    out = waiter.stdout.readline()
    res = json.loads(out) if out.startswith("{") else {"attempts": [{"ok": None}]}
    a = res["attempts"][0]
    check("jax_holds_6GiB", jax_up, {"jax_rc": jax.returncode})
    check("torch_8GiB_waits_then_proceeds_after_jax_exits",
          a.get("ok") is True and a.get("s", 0) >= 1.5 and a.get("at", 0) >= jax_exit - 0.5,
          {"attempt": a, "jax_exit_after_s": round(jax_exit - t0, 2)})
    waiter.kill()
    waiter.wait()

    # 4. the last member to exit removes the job's ledger
    env3 = env_for(args, {"CUDABUDGET_SCOPE": "job:gpugone", "CUDABUDGET_JOB_DIR": tmp})
    ledger = os.path.join(tmp, "cudabudget-%d" % os.geteuid(), "job-gpugone")
    members = []
    for i, seconds in enumerate(("3", "8")):
        ready = os.path.join(tmp, "gone%d" % i)
        proc = subprocess.Popen([py, "-c", HOLD, "1", ready, seconds], env=env3,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        members.append((proc, ready))
    up = [wait_file(r, pr) for pr, r in members]
    during = os.path.exists(ledger)
    members[0][0].wait()
    after_first = os.path.exists(ledger)
    members[1][0].wait()
    after_last = os.path.exists(ledger)
    check("ledger_kept_while_a_member_remains_and_removed_by_the_last",
          all(up) and during and after_first and not after_last,
          {"up": up, "during": during, "after_first": after_first, "after_last": after_last,
           "rcs": [pr.returncode for pr, _ in members]})
    print("job_gpu: %d passed, %d failed" % (sum(results), len(results) - sum(results)))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
