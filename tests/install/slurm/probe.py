"""Stands in for deploy/compose's trainer.py and jax_service.py inside the Slurm test's
jobs (tests/install/slurm.rs): the sbatch files run it where they run those programs,
under the name of the one it replaces, without PyTorch or JAX and against the fake
driver (libcuda.so.1 found through LD_LIBRARY_PATH).

Through ctypes, as a framework would: the device's memory as cuMemGetInfo reports it,
a working set of TRAIN_WORKING_SET_GIB GiB (default 1) held with cuMemAlloc, then one
allocation 2 MiB larger than what cuMemGetInfo says is left. Prints one line:

    <name>: total=<bytes> held=<rc> left=<bytes> past=<rc> met=<1|0|->

(rc 0: success, 2: CUDA_ERROR_OUT_OF_MEMORY). With CB_PROBE_MEET=<dir>:<n> it waits
(at most 60 s), still holding its working set, until n probes have arrived in <dir>,
so the test can show jobs running side by side; met says whether they all came.
"""

import ctypes
import os
import sys
import time

GIB = 1 << 30


def meet(spec):
    directory, count = spec.rsplit(":", 1)
    with open(os.path.join(directory, str(os.getpid())), "w"):
        pass
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if len(os.listdir(directory)) >= int(count):
            return "1"
        time.sleep(0.05)
    return "0"


def main():
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    ctx = ctypes.c_void_p()
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0

    working_set = int(float(os.environ.get("TRAIN_WORKING_SET_GIB", "1")) * GIB)
    held = cuda.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(working_set))
    assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
    past = cuda.cuMemAlloc_v2(
        ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(free.value + (2 << 20))
    )
    met = meet(os.environ["CB_PROBE_MEET"]) if os.environ.get("CB_PROBE_MEET") else "-"
    print(
        f"{name}: total={total.value} held={held} left={free.value} past={past} met={met}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
