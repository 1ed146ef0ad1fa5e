"""Shared helpers for the GPU cases.

Every case prints exactly one JSON object as its LAST stdout line, whatever
happens (exceptions are caught and reported in the "error" field). The runner
(run_all.sh + judge.py) decides PASS/FAIL from that object.
"""

import json
import os
import subprocess
import sys
import time
import traceback

GiB = 1 << 30
MiB = 1 << 20

# Variables that must not leak into helper processes such as nvidia-smi: we
# want nvidia-smi's own (real) numbers, never the library's view.
_STRIP_PREFIXES = ("CUDABUDGET_", "CUDA_DEVICE_MEMORY_LIMIT")


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if k != "LD_PRELOAD" and not k.startswith(_STRIP_PREFIXES)}
    # The case hid NVML from its own mount namespace: nvidia-smi gets a copy of it.
    real_nvml = os.environ.get("CB_SMI_LD_LIBRARY_PATH")
    if real_nvml:
        env["LD_LIBRARY_PATH"] = real_nvml + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def smi_apps():
    """All compute apps as nvidia-smi (without the preload) reports them.

    Returns a list of dicts {pid, mib, uuid}, or None if nvidia-smi failed.
    """
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory,gpu_uuid",
             "--format=csv,noheader,nounits"],
            env=clean_env(), capture_output=True, text=True, timeout=30)
    except Exception:  # noqa: BLE001 - report, never crash the case
        return None
    if r.returncode != 0:
        return None
    apps = []
    for line in r.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2:
            continue
        try:
            pid = int(parts[0])
            mib = int(float(parts[1]))
        except ValueError:
            continue  # "[N/A]" etc.
        apps.append({"pid": pid, "mib": mib,
                     "uuid": parts[2] if len(parts) > 2 else None})
    return apps


def smi_used_mib(pid=None, uuid=None, apps=None):
    """nvidia-smi's per-process figure (MiB) for pid (default: this process).

    Summed over GPUs unless uuid is given. None if the pid is not listed.
    """
    if pid is None:
        pid = os.getpid()
    if apps is None:
        apps = smi_apps()
    if apps is None:
        return None
    rows = [a for a in apps if a["pid"] == pid
            and (uuid is None or norm_uuid(a["uuid"]) == norm_uuid(uuid))]
    if not rows:
        return None
    return sum(a["mib"] for a in rows)


class Sampler:
    """Keeps the peak of nvidia-smi's per-process figure over several samples.

    Falls back to the only listed process when our pid is not listed (PID
    namespaces): recorded in smi_source so the log says so.
    """

    def __init__(self, res, key="smi_mib", pid=None):
        self.res = res
        self.key = key
        self.pid = pid
        self.samples = []
        res.setdefault(key, None)
        res.setdefault(key + "_samples", self.samples)

    def sample(self, label):
        apps = smi_apps()
        pid = self.pid if self.pid is not None else os.getpid()
        v = smi_used_mib(pid, apps=apps)
        src = "pid"
        if v is None and apps is not None and len({a["pid"] for a in apps}) == 1:
            v = sum(a["mib"] for a in apps)
            src = "only-process"
        self.samples.append([label, v])
        if v is not None:
            self.res[self.key + "_source"] = src
            if self.res.get(self.key) is None or v > self.res[self.key]:
                self.res[self.key] = v
        if apps is None:
            self.res[self.key + "_error"] = "nvidia-smi failed"
        checkpoint(self.res)
        return v


def norm_uuid(u):
    if u is None:
        return None
    if isinstance(u, bytes):
        u = u.decode(errors="replace")
    u = str(u).strip().lower()
    if u.startswith("gpu-"):
        u = u[4:]
    return u


def exc_text(e, limit=400):
    s = "%s: %s" % (type(e).__name__, e)
    s = " ".join(s.split())
    return s[:limit]


def new_result(case, args):
    res = {"case": case, "mode": getattr(args, "mode", None), "pid": os.getpid(),
           "error": None}
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "XLA_PYTHON_CLIENT_ALLOCATOR",
              "XLA_PYTHON_CLIENT_PREALLOCATE", "CUDA_VISIBLE_DEVICES",
              "CUDABUDGET_LIMIT"):
        if os.environ.get(k) is not None:
            res.setdefault("env", {})[k] = os.environ[k]
    res["preloaded"] = preloaded()
    return res


def preloaded():
    """Whether a library LD_PRELOAD names is mapped into this process (the benchmarks
    preload builds of the library under other file names than libcudabudget.so)."""
    names = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    # A path is mapped under its real path; a bare name, as the loader found it.
    paths = [os.path.realpath(n) if "/" in n else "/" + n for n in names]
    with open("/proc/self/maps") as maps:
        mapped = maps.read()
    return any(p in mapped for p in paths)


def record_error(res, where, e):
    msg = "%s: %s" % (where, exc_text(e))
    res["error"] = msg if not res.get("error") else res["error"] + " | " + msg
    tb = traceback.format_exc().strip().splitlines()[-6:]
    res.setdefault("tracebacks", []).append(tb)


def checkpoint(res):
    """Write the result so far to $CB_PARTIAL (if set), so that a crash
    (abort in a framework, segfault) still leaves the facts measured."""
    path = os.environ.get("CB_PARTIAL")
    if not path:
        return
    try:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, default=str, sort_keys=True)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001
        pass


def emit(res):
    """Print the result as the last stdout line (and flush)."""
    sys.stdout.flush()
    try:
        line = json.dumps(res, default=str, sort_keys=True)
    except Exception as e:  # noqa: BLE001
        line = json.dumps({"case": res.get("case"), "error": "json: %s" % e})
    sys.stdout.write("\n" + line + "\n")
    sys.stdout.flush()


def run_case(case, args, body):
    """Run body(res) with every exception caught; always emit the JSON."""
    res = new_result(case, args)
    t0 = time.time()
    try:
        body(res)
    except BaseException as e:  # noqa: BLE001 - includes KeyboardInterrupt/SystemExit
        record_error(res, "unhandled", e)
    res["elapsed_s"] = round(time.time() - t0, 2)
    checkpoint(res)
    emit(res)
    # os._exit skips C exit handlers (the library's exit summary), so it is
    # opt-in, for a framework whose teardown hangs.
    if os.environ.get("CB_CASE_HARD_EXIT") == "1":
        sys.stderr.flush()
        os._exit(0)


# ---------- workers: processes of a case that answer commands on stdin with lines ----------

def start_worker(script, argv, env, log):
    """`script` run again (by this interpreter) with `argv`, as a worker: its stdin and
    stdout are line pipes, its stderr goes to `log`."""
    cmd = [sys.executable, os.path.abspath(script)] + list(argv)
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                            env=env, text=True, bufsize=1)


def expect_line(p, word, timeout=120):
    """The rest of the worker's first line starting with `word`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("worker ended before '%s' (see its log)" % word)
        if line.startswith(word):
            return line[len(word):].strip()
    raise RuntimeError("no '%s' in time" % word)


def end_workers(procs, logs=()):
    """Closes the workers' stdin (their signal to end), waits for them (30 s each, then
    kills), and closes their logs."""
    for p in procs:
        try:
            p.stdin.close()
        except Exception:  # noqa: BLE001
            pass
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    for f in logs:
        f.close()
