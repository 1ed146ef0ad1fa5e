"""Two Ray actors of num_gpus=0.5 on one GPU, each held to half the card by cudabudget,
with nothing of ours in the actors' code (deploy/ray's cudabudget_ray, issue 36).

Run alone (Ray and PyTorch in the interpreter; `pip install ray==2.60.0` where missing):
    python3 scripts/gpu/cases/ray_fractions.py --lib target/release/libcudabudget.so
Prints one PASS/FAIL line per check (and the facts behind it), or one SKIP line when Ray
or PyTorch is missing, then "ray_fractions: N passed, M failed"; exit status 0 iff no FAIL.

As deploy/ray/README.md installs it on a node: a virtual environment over this
interpreter's packages (so Ray and PyTorch are this Python's)
gets cudabudget_ray.py and cudabudget-ray.pth in its site-packages, and a local Ray is
started from it with the library in LD_PRELOAD (the driver makes no CUDA call: it
passes through). Each actor, in a worker of its own:

1. sees half of the card as its device's total (torch.cuda.mem_get_info, against
   the total CUDA reports natively; within 64 MiB) and CUDABUDGET_LIMIT=50.00%;
2. holds a tensor of its total less 4 GiB (both at once: the card has room for both);
3. is refused what its half has left plus 1 GiB with torch.cuda.OutOfMemoryError.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import venv

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
GIB = 1 << 30
MIB = 1 << 20
results = []


def check(name, ok, facts):
    results.append(ok)
    print("%s ray_fractions/%s %s" % ("PASS" if ok else "FAIL", name, json.dumps(facts, default=str)), flush=True)


def card_total():
    """The card's memory in bytes as CUDA reports it natively (cuDeviceTotalMem, which a
    percentage budget is taken of: on an H100 it is 480 MiB below nvidia-smi's
    memory.total), read in a process of its own without the library."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("CUDABUDGET_")}
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info()[1])"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    return int(out.stdout.split()[-1])


def inner(args):
    """In the virtual environment, under LD_PRELOAD: the actors and their reports."""
    import ray

    @ray.remote(num_gpus=0.5)
    class Tenant:
        def report(self):
            import torch

            free, total = torch.cuda.mem_get_info()
            report = {"pid": os.getpid(), "gpu_ids": ray.get_gpu_ids(), "total": total, "free": free,
                      "CUDABUDGET_LIMIT": os.environ.get("CUDABUDGET_LIMIT"),
                      "library_mapped": any("libcudabudget" in line for line in open("/proc/self/maps"))}
            try:
                self.held = torch.empty(total - 4 * GIB, dtype=torch.uint8, device="cuda")
                report["held"] = True
            except Exception as error:
                report["held"] = f"{type(error).__name__}: {error}"
            left = torch.cuda.mem_get_info()[0]
            report["left"] = left
            try:
                more = torch.empty(left + GIB, dtype=torch.uint8, device="cuda")
                report["past"] = "granted"
                del more
            except Exception as error:
                report["past"] = type(error).__name__
            return report

    ray.init(num_gpus=1, include_dashboard=False, _temp_dir=args.temp_dir)
    try:
        actors = [Tenant.remote(), Tenant.remote()]
        reports = ray.get([a.report.remote() for a in actors], timeout=240)
    finally:
        ray.shutdown()
    print("REPORTS " + json.dumps(reports), flush=True)


def outer(args):
    missing = []
    for module in ("ray", "torch"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        print("SKIP ray_fractions/installed %s not installed in %s (Ray: pip install ray==2.60.0)"
              % (" and ".join(missing), sys.executable), flush=True)
        return 0
    lib = os.path.abspath(args.lib)
    card = card_total()
    with tempfile.TemporaryDirectory(prefix="cb-ray-") as work:
        env_dir = os.path.join(work, "venv")
        venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(env_dir)
        python = os.path.join(env_dir, "bin", "python")
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        # This interpreter's packages (Ray, PyTorch), also where it is itself a venv.
        with open(os.path.join(site, "outer-packages.pth"), "w") as pth:
            pth.write("".join(p + "\n" for p in sys.path if p.endswith(("site-packages", "dist-packages"))))
        for name in ("cudabudget_ray.py", "cudabudget-ray.pth"):
            with open(os.path.join(ROOT, "deploy", "ray", name)) as src, open(os.path.join(site, name), "w") as dst:
                dst.write(src.read())
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDABUDGET_", "RAY_"))}
        env.update(LD_PRELOAD=lib, RAY_USAGE_STATS_ENABLED="0", TMPDIR=work)
        run = subprocess.run([python, os.path.abspath(__file__), "--inner", "--temp-dir", os.path.join(work, "ray")],
                             env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [l for l in run.stdout.splitlines() if l.startswith("REPORTS ")]
    if not lines:
        check("ran", False, {"rc": run.returncode, "stdout": run.stdout[-1500:], "stderr": run.stderr[-3000:]})
        return 1
    reports = json.loads(lines[-1][len("REPORTS "):])
    half = card // 2
    for i, report in enumerate(reports):
        facts = dict(report, card=card, half=half)
        check(f"actor{i}_sees_half_the_card",
              report.get("library_mapped") is True and report.get("CUDABUDGET_LIMIT") == "50.00%"
              and abs(report.get("total", 0) - half) <= 64 * MIB, facts)
        check(f"actor{i}_holds_its_total_less_4gib", report.get("held") is True, facts)
        check(f"actor{i}_refused_past_half", report.get("past") == "OutOfMemoryError", facts)
    check("two_actors_one_gpu",
          len(reports) == 2 and reports[0]["pid"] != reports[1]["pid"]
          # Ray gives accelerator ids as strings ("0") since 2.x, as numbers before.
          and [str(g) for g in reports[0]["gpu_ids"]] == [str(g) for g in reports[1]["gpu_ids"]] == ["0"],
          [{k: r.get(k) for k in ("pid", "gpu_ids")} for r in reports])
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", default=os.path.join(ROOT, "target", "release", "libcudabudget.so"))
    parser.add_argument("--timeout", type=float, default=300, help="seconds for the Ray run (default: %(default)s)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--temp-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args)
        return 0
    try:
        outer(args)
    except Exception as error:  # a crash is a FAIL line, not a missing summary
        check("ran", False, {"error": f"{type(error).__name__}: {error}"})
    print("ray_fractions: %d passed, %d failed" % (sum(results), len(results) - sum(results)))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
