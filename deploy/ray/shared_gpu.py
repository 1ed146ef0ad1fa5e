"""Ray actors sharing one GPU, each with its own cudabudget budget.

Ray's `num_gpus=0.5` puts two actors on one GPU but does not divide its memory: the
first framework to start may take most of the card. Here each actor's worker process is
started with cudabudget preloaded and its own budget, through `runtime_env`:

    runtime_env={"env_vars": {"LD_PRELOAD": "/opt/cudabudget/libcudabudget.so",
                              "CUDABUDGET_LIMIT": "40Gi"}}

Ray starts a dedicated worker process for an actor with its own `runtime_env`, so the
variables are in that process's environment when the loader starts it.

Each actor reports what it sees through the CUDA driver API (ctypes, no framework
needed): whether the library is mapped in it, the device total (= its budget), and the
answer to one allocation that fits its budget and one that does not.

    python3 shared_gpu.py                              # local Ray, two actors on GPU 0
    python3 shared_gpu.py --budgets 60Gi 40Gi
    python3 shared_gpu.py --address auto               # an existing cluster
    python3 shared_gpu.py --num-gpus 1                 # declare one GPU to a local Ray

With cudabudget_ray installed on the nodes (README: "Budgets from Ray's own count"),
the budgets come from what Ray gave each one instead, and the code names no budget:

    python3 shared_gpu.py --shares 0.5 0.5         # two actors, num_gpus=0.5: 50% each
    python3 shared_gpu.py --gib 20                 # a task, resources={"cudabudget_gib": 20}

cudabudget must be installed at --lib on every node the actors may land on (for KubeRay
clusters, the Helm chart in deploy/helm or the DaemonSet in deploy/kubernetes does that).
Exits 0 when every actor saw its own budget and was refused past it, 1 otherwise.
"""

import argparse
import ctypes
import json
import os
import sys

import ray

GIB = 1 << 30
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


def budget(quantity):
    """(quantity, bytes) for a whole binary quantity such as 40Gi, or a byte count: the
    subset of cudabudget's quantities this example can check against."""
    for unit, scale in UNITS.items():
        if quantity.endswith(unit) and quantity[: -len(unit)].isdigit():
            return quantity, int(quantity[: -len(unit)]) * scale
    if quantity.isdigit():
        return quantity, int(quantity)
    raise argparse.ArgumentTypeError(f"{quantity!r}: use a whole number of Ki, Mi, Gi or Ti, e.g. 40Gi")


def mapped_files():
    """The files mapped in this process, as /proc/self/maps names them."""
    files = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)  # address perms offset dev inode [path]
            if len(fields) == 6:
                files.add(fields[5].rstrip("\n"))
    return files


def library_mapped(library):
    """Whether `library` is loaded in this process."""
    return os.path.realpath(library) in mapped_files()


@ray.remote(num_gpus=0.5)
class BudgetedWorker:
    """One tenant of the shared GPU. A real actor would load its model here."""

    def __init__(self, library):
        # A worker the loader could not preload the library into would run unbudgeted
        # (ld.so only prints a line): refuse to start instead.
        if not library_mapped(library):
            raise RuntimeError(f"{library} is not loaded in this worker; refusing to run unbudgeted")
        self.library = library

    def report(self, probe_margin):
        return probe(self.library, probe_margin)


@ray.remote(num_gpus=0)
def probe_task(library, probe_margin):
    """A task's report, from a worker with the library loaded."""
    if not library_mapped(library):
        raise RuntimeError(f"{library} is not loaded in this worker; refusing to run unbudgeted")
    return probe(library, probe_margin)


def probe(library, probe_margin):
    """What this worker sees, through the CUDA driver API."""
    cuda = ctypes.CDLL("libcuda.so.1")
    report = {
        "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
        # The share of which GPU Ray gave this worker, and the driver it loaded.
        "gpu_ids": ray.get_gpu_ids(),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "driver": sorted(f for f in mapped_files() if os.path.basename(f).startswith("libcuda.so")),
        "CUDABUDGET_LIMIT": os.environ.get("CUDABUDGET_LIMIT"),
        "library_mapped": library_mapped(library),
    }
    context = ctypes.c_void_p()
    device = ctypes.c_int()
    for call, rc in (
        ("cuInit", cuda.cuInit(0)),
        ("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(device), 0)),
        ("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)),
        ("cuCtxSetCurrent", cuda.cuCtxSetCurrent(context)),
    ):
        if rc != CUDA_SUCCESS:
            report["error"] = f"{call} returned {rc}"
            return report
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    report["total"] = total.value
    report["free"] = free.value

    # One allocation that fits what is left of the budget, one that crosses it.
    fits = max(free.value - probe_margin, 0)
    pointer = ctypes.c_uint64()
    report["alloc_fitting_rc"] = cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(fits))
    over = ctypes.c_uint64()
    report["alloc_over_rc"] = cuda.cuMemAlloc_v2(ctypes.byref(over), ctypes.c_size_t(2 * probe_margin))
    for allocated, rc in ((pointer, report["alloc_fitting_rc"]), (over, report["alloc_over_rc"])):
        if rc == CUDA_SUCCESS:
            cuda.cuMemFree_v2(allocated)
    return report


def share(fraction):
    """A GPU share, 0 < F < 1, as num_gpus takes it."""
    value = float(fraction)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{fraction!r}: a share of one GPU is between 0 and 1")
    return value


def share_budget(fraction):
    """The budget cudabudget_ray gives a share: its percentage of the GPU (0.5 -> 50.00%)."""
    hundredths = max(round(fraction * 10000), 1)
    return f"{hundredths // 100}.{hundredths % 100:02d}%"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", nargs="+", type=budget, default=None, metavar="Q",
                        help="one budget per actor, through runtime_env (default: 6Gi 4Gi, "
                             "unless --shares or --gib is given)")
    parser.add_argument("--shares", nargs="+", type=share, default=[], metavar="F",
                        help="one actor per share, num_gpus=F and no budget of its own: "
                             "cudabudget_ray on the nodes gives it F of the GPU")
    parser.add_argument("--gib", nargs="+", type=int, default=[], metavar="N",
                        help='one task per N, resources={"cudabudget_gib": N} and no budget '
                             "of its own: cudabudget_ray on the nodes gives it N GiB")
    parser.add_argument("--lib", default="/opt/cudabudget/libcudabudget.so",
                        help="libcudabudget.so on the nodes (default: %(default)s)")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray)")
    parser.add_argument("--num-gpus", type=float, default=None,
                        help="GPUs a local Ray declares (default: Ray detects them)")
    parser.add_argument("--timeout", type=float, default=120, metavar="S",
                        help="seconds to wait for each actor's report (default: %(default)s); "
                             "an actor no node can place would be waited for forever")
    args = parser.parse_args()
    budgets = args.budgets or ([] if args.shares or args.gib else [budget("6Gi"), budget("4Gi")])
    if not os.path.isabs(args.lib):
        parser.error("--lib must be an absolute path (it is the same path on every node)")

    ray.init(address=args.address, num_gpus=args.num_gpus, log_to_driver=True)
    actors = [
        BudgetedWorker.options(
            runtime_env={"env_vars": {"LD_PRELOAD": args.lib, "CUDABUDGET_LIMIT": quantity}},
        ).remote(args.lib)
        for quantity, _ in budgets
    ]
    # (what it is, the budget it must see, its bytes where known here), and its report.
    expected = [(f"actor with budget {quantity}", quantity, limit) for quantity, limit in budgets]
    pending = [actor.report.remote(256 << 20) for actor in actors]
    for fraction in args.shares:
        actor = BudgetedWorker.options(num_gpus=fraction).remote(args.lib)
        actors.append(actor)
        pending.append(actor.report.remote(256 << 20))
        expected.append((f"actor with num_gpus={fraction:g}", share_budget(fraction), None))
    for gib in args.gib:
        pending.append(probe_task.options(resources={"cudabudget_gib": gib}).remote(args.lib, 256 << 20))
        expected.append((f'task with resources={{"cudabudget_gib": {gib}}}', f"{gib}Gi", gib * GIB))
    reports = []
    for report in pending:
        try:
            reports.append(ray.get(report, timeout=args.timeout))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
            reports.append({"error": str(error).strip().splitlines()[-1]})
        except ray.exceptions.GetTimeoutError:
            reports.append({"error": f"no report within {args.timeout:g} s: no node with a free "
                                     "share of a GPU (`ray status` shows the pending demand)?"})

    ok = True
    for (what, quantity, limit), report in zip(expected, reports):
        print(json.dumps(report, sort_keys=True))
        good = (
            report.get("library_mapped")
            and report.get("CUDABUDGET_LIMIT") == quantity
            and (limit is None or report.get("total") == limit)
            and report.get("alloc_fitting_rc") == CUDA_SUCCESS
            and report.get("alloc_over_rc") == CUDA_ERROR_OUT_OF_MEMORY
        )
        verdict = "ok" if good else "FAILED"
        if "error" in report:
            print(f"{what}: {report['error']}: {verdict}")
        else:
            print(f"{what.split(' with ')[0]} pid {report.get('pid')}: budget {quantity}, sees {report.get('total', 0) / GIB:g} GiB, "
                  f"fitting allocation rc {report.get('alloc_fitting_rc')}, past the budget rc "
                  f"{report.get('alloc_over_rc')}: {verdict}")
        ok = ok and good
    ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
