"""Start-up cost of the library on the first CUDA tensor in PyTorch, with the noise of
`import torch` taken out: two servers (one without the library, one with it preloaded)
import torch once each, then fork a child per rep; the child times its first CUDA tensor
(`torch.zeros(1, device="cuda")` + synchronize: the driver's initialisation, the primary
context, cudart's entry points, everything the library does on that path) and exits.
The two variants take turns (ABBA), and each rep's paired difference (budget minus
native) is kept. A forked child starts the driver as a new process does: neither server
touches CUDA before it forks (what loading the library costs a process is measured
apart, by run_bench.sh's `python3 -c pass`).

`--probe torch-phases` times the same first tensor in four steps: `torch.cuda.init()`
(cudart's start and `cuInit`), a synchronize (the primary context and cudart's loads of
every fatbinary), `torch.empty` (the caching allocator's first `cudaMalloc`) and a fill
kernel (the first look-up of a kernel, which loads its module on the device).

Usage: python3 startup_forks.py --lib LIB [--reps N] [--probe torch|torch-phases|ctypes] [--json FILE]
                                [--budget-env K=V ...]
Prints the medians, the paired median with its 95 % bootstrap interval, and one JSON
line per rep to --json.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def serve(probe):
    """One server: prepare, then per line `go` fork a child that times the probe."""
    if probe.startswith("torch"):
        import torch  # noqa: F401  (imported before the forks, so children skip it)
    else:
        import ctypes  # noqa: F401
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if line.strip() != "go":
            continue
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            # The child never returns into the server's loop, whatever happens.
            code = 0
            try:
                os.close(r)
                out = child(probe)
            except BaseException as e:  # noqa: BLE001
                out, code = {"error": repr(e)[:200]}, 1
            try:
                os.write(w, (json.dumps(out) + "\n").encode())
            finally:
                os._exit(code)
        os.close(w)
        data = b""
        while True:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            data += chunk
        os.close(r)
        _, status = os.waitpid(pid, 0)
        text = data.decode().strip() or json.dumps({"error": f"child status {status}"})
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def child(probe):
    """The timed part, in a fresh child: the first CUDA tensor, or the driver's own start."""
    out = {}
    if probe == "torch":
        import torch

        t = time.perf_counter()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        out["first_tensor_ms"] = (time.perf_counter() - t) * 1e3
    elif probe == "torch-phases":
        import torch

        marks = [time.perf_counter()]
        torch.cuda.init()
        marks.append(time.perf_counter())
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        x = torch.empty(1, device="cuda")
        marks.append(time.perf_counter())
        x.fill_(0)
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        for name, a, b in zip(["init_ms", "context_ms", "empty_ms", "fill_ms"], marks, marks[1:]):
            out[name] = (b - a) * 1e3
        out["first_tensor_ms"] = (marks[-1] - marks[0]) * 1e3
    else:
        import ctypes

        t = time.perf_counter()
        cuda = ctypes.CDLL("libcuda.so.1")
        assert cuda.cuInit(0) == 0
        out["cuinit_ms"] = (time.perf_counter() - t) * 1e3
        ctx = ctypes.c_void_p()
        t2 = time.perf_counter()
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert cuda.cuCtxSetCurrent(ctx) == 0
        t3 = time.perf_counter()
        p = ctypes.c_uint64()
        assert cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1 << 20)) == 0
        t4 = time.perf_counter()
        # Apart: the context's creation (which NVML's start on the library's thread may
        # slow down in the kernel driver) and the first allocation (which waits for the
        # context's charge while NVML starts).
        out["ctx_ms"] = (t3 - t2) * 1e3
        out["first_alloc_only_ms"] = (t4 - t3) * 1e3
        out["ctx_alloc_ms"] = (t4 - t2) * 1e3
        out["first_alloc_ms"] = (time.perf_counter() - t) * 1e3
    return out


def start(probe, env):
    p = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", "--probe", probe],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def ask(server):
    server.stdin.write("go\n")
    server.stdin.flush()
    return json.loads(server.stdout.readline())


def median_ci(values, resamples=4000, seed=1):
    rng = random.Random(seed)
    meds = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return statistics.median(values), meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--probe", choices=["torch", "torch-phases", "ctypes"], default="torch")
    ap.add_argument("--lib")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--json")
    ap.add_argument("--budget-env", action="append", default=[], metavar="K=V",
                    help="more environment for the budget variant (e.g. CUDABUDGET_LOG=debug)")
    a = ap.parse_args()
    if a.serve:
        serve(a.probe)
        return
    base = {k: v for k, v in os.environ.items() if not k.startswith("CUDABUDGET_")}
    base.pop("LD_PRELOAD", None)
    native = start(a.probe, dict(base))
    extra = dict(kv.split("=", 1) for kv in a.budget_env)
    budget = start(a.probe, dict(base, LD_PRELOAD=a.lib, CUDABUDGET_LIMIT="100Gi", **extra))
    ask(native), ask(budget)  # one each, untimed: caches warm for both
    rows = []
    for i in range(a.reps):
        order = [("native", native), ("budget", budget)]
        if i % 2:
            order.reverse()
        row = {"rep": i + 1}
        for name, server in order:
            row[name] = ask(server)
        rows.append(row)
    for s in (native, budget):
        s.stdin.close()
        s.wait()
    keys = [k for k in rows[0]["native"] if k.endswith("_ms")]
    print(f"startup_forks: probe {a.probe}, {a.reps} reps (ABBA), lib {a.lib}")
    print("| phase | native median (min..max) | budget median (min..max) | paired median (budget − native) | 95 % interval of the paired median |")
    print("|---|---|---|---|---|")
    for k in keys:
        n = [r["native"][k] for r in rows if k in r["native"]]
        b = [r["budget"][k] for r in rows if k in r["budget"]]
        d = [r["budget"][k] - r["native"][k] for r in rows if k in r["native"] and k in r["budget"]]
        med, lo, hi = median_ci(d)
        print(
            f"| {k} | {statistics.median(n):.2f} ({min(n):.2f}..{max(n):.2f}) "
            f"| {statistics.median(b):.2f} ({min(b):.2f}..{max(b):.2f}) "
            f"| {med:+.2f} ms ({min(d):+.2f}..{max(d):+.2f}, n={len(d)}) | {lo:+.2f}..{hi:+.2f} (width {hi - lo:.2f}) |"
        )
    errors = [r for r in rows if "error" in r["native"] or "error" in r["budget"]]
    if errors:
        print(f"{len(errors)} reps with errors, e.g. {errors[0]}")
    if a.json:
        with open(a.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
