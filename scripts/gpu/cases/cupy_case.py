"""CuPy cases.

--mode default : CuPy's default memory pool (cudaMalloc underneath).
--mode async   : cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc).
FIRST GiB ok; SECOND GiB more -> cupy.cuda.memory.OutOfMemoryError;
runtime.memGetInfo() total; nvidia-smi peak; after free_all_blocks AFTER GiB fits.
"""

import argparse
import gc
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GiB, Sampler, checkpoint, exc_text, record_error, run_case  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="default", choices=["default", "async"])
    p.add_argument("--budget-gib", type=float, default=None, help="for the log only")
    p.add_argument("--first-gib", type=float, default=5)
    p.add_argument("--second-gib", type=float, default=4)
    p.add_argument("--after-gib", type=float, default=4)
    return p.parse_args()


def body(res, args):
    import cupy
    res["cupy"] = cupy.__version__
    res["budget_gib"] = args.budget_gib
    OOM = cupy.cuda.memory.OutOfMemoryError
    cupy.cuda.Device(0).use()
    if args.mode == "async":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "experimental" warning
            pool = cupy.cuda.MemoryAsyncPool()
        cupy.cuda.set_allocator(pool.malloc)
    else:
        pool = cupy.get_default_memory_pool()
    smi = Sampler(res)
    free0, total0 = cupy.cuda.runtime.memGetInfo()
    res["free_at_start"], res["total_at_start"] = free0, total0

    def alloc(gib, key):
        try:
            a = cupy.empty((int(gib * GiB),), dtype=cupy.uint8)
            cupy.cuda.Device(0).synchronize()
            res[key + "_ok"] = True
            res[key + "_oom"] = False
            return a
        except OOM as e:
            res[key + "_ok"] = False
            res[key + "_oom"] = True
            res[key + "_exc"] = exc_text(e, 600)
            res[key + "_exc_class"] = type(e).__module__ + "." + type(e).__name__
        except Exception as e:  # noqa: BLE001 - e.g. CUDARuntimeError
            res[key + "_ok"] = False
            res[key + "_oom"] = False
            res[key + "_exc"] = exc_text(e, 600)
            res[key + "_exc_class"] = type(e).__module__ + "." + type(e).__name__
        checkpoint(res)
        return None

    x = alloc(args.first_gib, "first")
    try:
        free, total = cupy.cuda.runtime.memGetInfo()
        res["free"], res["total"] = free, total
    except Exception as e:  # noqa: BLE001
        record_error(res, "memGetInfo", e)
    smi.sample("after_first")
    y = alloc(args.second_gib, "second")
    smi.sample("after_second")
    try:
        res["pool_total_bytes"] = pool.total_bytes()
    except Exception:  # noqa: BLE001
        pass
    del x, y
    gc.collect()
    cupy.cuda.Device(0).synchronize()
    pool.free_all_blocks()
    cupy.cuda.Device(0).synchronize()
    z = alloc(args.after_gib, "after")
    res["after_free_ok"] = res.pop("after_ok")
    res.pop("after_oom", None)
    smi.sample("after_free")
    del z


def main():
    args = parse()
    run_case("cupy", args, lambda res: body(res, args))


if __name__ == "__main__":
    main()
