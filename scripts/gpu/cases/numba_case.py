"""Numba (numba-cuda) case.

FIRST GiB device_array ok; SECOND GiB more raises CudaAPIError
(CUDA_ERROR_OUT_OF_MEMORY, code 2); current_context().get_memory_info() total.
"""

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GiB, Sampler, checkpoint, exc_text, record_error, run_case  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="default", choices=["default"])
    p.add_argument("--budget-gib", type=float, default=None, help="for the log only")
    p.add_argument("--first-gib", type=float, default=1)
    p.add_argument("--second-gib", type=float, default=1.5)
    return p.parse_args()


def code_of(e):
    c = getattr(e, "code", None)
    if c is None:
        return None
    c = getattr(c, "value", c)
    try:
        return int(c)
    except Exception:  # noqa: BLE001
        return str(c)


def body(res, args):
    import numpy as np
    from numba import cuda
    try:
        import importlib.metadata as md
        res["numba_cuda"] = md.version("numba-cuda")
    except Exception:  # noqa: BLE001
        pass
    res["budget_gib"] = args.budget_gib
    ctx = cuda.current_context()
    smi = Sampler(res)
    mi = ctx.get_memory_info()
    res["free_at_start"], res["total_at_start"] = int(mi[0]), int(mi[1])

    def alloc(gib, key):
        try:
            a = cuda.device_array(int(gib * GiB), dtype=np.uint8)
            cuda.synchronize()
            res[key + "_ok"] = True
            res[key + "_oom"] = False
            return a
        except Exception as e:  # noqa: BLE001
            res[key + "_ok"] = False
            s = str(e)
            code = code_of(e)
            res[key + "_exc"] = exc_text(e, 600)
            res[key + "_exc_class"] = type(e).__module__ + "." + type(e).__name__
            res[key + "_code"] = code
            res[key + "_oom"] = ("OUT_OF_MEMORY" in s) or code == 2
        checkpoint(res)
        return None

    a = alloc(args.first_gib, "first")
    try:
        mi = ctx.get_memory_info()
        res["free"], res["total"] = int(mi[0]), int(mi[1])
    except Exception as e:  # noqa: BLE001
        record_error(res, "get_memory_info", e)
    smi.sample("after_first")
    b = alloc(args.second_gib, "second")
    smi.sample("after_second")
    del a, b
    gc.collect()
    try:
        ctx.deallocations.clear()
    except Exception:  # noqa: BLE001
        pass
    c = alloc(args.first_gib, "after")
    res["after_free_ok"] = res.pop("after_ok")
    res.pop("after_oom", None)
    del c


def main():
    args = parse()
    run_case("numba", args, lambda res: body(res, args))


if __name__ == "__main__":
    main()
