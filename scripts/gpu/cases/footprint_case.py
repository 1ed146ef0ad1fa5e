"""Device memory that no allocation call names (CuPy kernels and modules).

--mode rawmodule : a RawModule with 3 x 1 GiB of __device__ arrays, loaded and its kernel
                   launched. Natively it runs (nvidia-smi about 4.8 GiB); under a 2 GiB
                   budget the load must fail with CUDA_ERROR_OUT_OF_MEMORY.
--mode heap      : cudaDeviceSetLimit(cudaLimitMallocHeapSize, 6 GiB), then a kernel that
                   mallocs 3 GiB. Natively both work; under a 2 GiB budget the limit must be
                   refused (and the kernel's malloc then fails inside the 8 MiB default heap).
--mode spill     : a kernel with 64 KiB of local memory a thread (the driver grows the
                   context's local memory by about 16 GiB at its launch: no call names it),
                   then, 1.2 s later, --after-gib more. Under a 24 GiB budget the footprint
                   re-read must have charged the local memory: the allocation is refused.
                   run_all.sh runs it in a new PID namespace as well (unshare --pid).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GiB, Sampler, checkpoint, exc_text, run_case  # noqa: E402

RAWMODULE = r"""
__device__ char a[1u << 30];
__device__ char b[1u << 30];
__device__ char c[1u << 30];
extern "C" __global__ void touch(unsigned long long step) {
    for (unsigned long long i = threadIdx.x * step; i < (1ull << 30); i += blockDim.x * step) {
        a[i] = 1; b[i] = 2; c[i] = 3;
    }
}
"""

HEAP = r"""
extern "C" __global__ void take(unsigned long long bytes, int *ok) {
    char *p = (char *)malloc(bytes);
    if (p) { for (unsigned long long i = 0; i < bytes; i += 1 << 20) p[i] = 1; }
    *ok = p != 0;
    free(p);
}
"""

SPILL = r"""
extern "C" __global__ void spill(char *out) {
    volatile char local[64 << 10];
    for (int i = 0; i < (64 << 10); i += 512) local[i] = (char)(i + threadIdx.x);
    out[blockIdx.x * blockDim.x + threadIdx.x] = local[(threadIdx.x * 64) % (64 << 10)];
}
"""


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True, choices=["rawmodule", "heap", "spill"])
    p.add_argument("--budget-gib", type=float, default=None, help="for the log only")
    p.add_argument("--after-gib", type=float, default=10)
    return p.parse_args()


def outcome(res, key, f):
    try:
        f()
        res[key + "_ok"] = True
    except Exception as e:  # noqa: BLE001 - the class and text are the result
        res[key + "_ok"] = False
        res[key + "_exc"] = exc_text(e, 600)
        res[key + "_oom"] = "OUT_OF_MEMORY" in str(e) or "cudaErrorMemoryAllocation" in str(e) \
            or "out of memory" in str(e).lower()
    checkpoint(res)


def body(res, args):
    import cupy
    res["cupy"] = cupy.__version__
    res["budget_gib"] = args.budget_gib
    res["in_pid_namespace"] = os.stat("/proc/self/ns/pid").st_ino != 0xEFFFFFFC
    cupy.cuda.Device(0).use()
    smi = Sampler(res)
    free0, total0 = cupy.cuda.runtime.memGetInfo()
    res["free_at_start"], res["total_at_start"] = free0, total0
    smi.sample("start")
    if args.mode == "rawmodule":
        def load():
            mod = cupy.RawModule(code=RAWMODULE)
            f = mod.get_function("touch")
            f((1,), (256,), (cupy.uint64(1 << 20),))
            cupy.cuda.Device(0).synchronize()
            res["module"] = mod  # keep it loaded while nvidia-smi looks
        outcome(res, "load", load)
        smi.sample("after_load")
        res.pop("module", None)
    elif args.mode == "heap":
        outcome(res, "set_heap_6GiB",
                lambda: cupy.cuda.runtime.deviceSetLimit(cupy.cuda.runtime.cudaLimitMallocHeapSize, 6 * GiB))
        res["heap_limit"] = cupy.cuda.runtime.deviceGetLimit(cupy.cuda.runtime.cudaLimitMallocHeapSize)
        ok = cupy.zeros((1,), dtype=cupy.int32)
        k = cupy.RawKernel(HEAP, "take")
        outcome(res, "kernel", lambda: (k((1,), (1,), (cupy.uint64(3 * GiB), ok)),
                                        cupy.cuda.Device(0).synchronize()))
        res["kernel_malloc_3GiB_ok"] = bool(ok.get()[0])
        smi.sample("after_kernel")
    else:
        out = cupy.zeros((1024 * 256,), dtype=cupy.uint8)
        k = cupy.RawKernel(SPILL, "spill")
        outcome(res, "spill", lambda: (k((1024,), (256,), (out,)), cupy.cuda.Device(0).synchronize()))
        smi.sample("after_spill")
        time.sleep(1.2)
        free1, total1 = cupy.cuda.runtime.memGetInfo()
        res["free_after_spill"], res["total_after_spill"] = free1, total1
        holder = []
        outcome(res, "after", lambda: holder.append(cupy.empty((int(args.after_gib * GiB),), dtype=cupy.uint8)))
        smi.sample("after_more")
        holder.clear()


def main():
    args = parse()
    run_case("footprint", args, lambda res: body(res, args))


if __name__ == "__main__":
    main()
