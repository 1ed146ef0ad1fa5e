"""JAX cases. The allocator variables are set here, BEFORE jax is imported.

--mode default    : default BFC allocator with preallocation; report
                    memory_stats()["bytes_limit"], run a small computation.
--mode platform   : XLA_PYTHON_CLIENT_ALLOCATOR=platform; FIRST GiB array ok,
                    SECOND GiB more must fail with RESOURCE_EXHAUSTED.
--mode cuda_async : XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async; same checks.
--mode hold       : like default, then writes --ready (JSON with our pid) and
                    holds its pool until --stop exists (at most --hold-max s).
"""

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GiB, Sampler, checkpoint, exc_text, record_error, run_case  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="default",
                   choices=["default", "platform", "cuda_async", "hold"])
    p.add_argument("--budget-gib", type=float, default=None, help="for the log only")
    p.add_argument("--first-gib", type=float, default=5)
    p.add_argument("--second-gib", type=float, default=6)
    p.add_argument("--after-gib", type=float, default=4)
    p.add_argument("--ready", default=None)
    p.add_argument("--stop", default=None)
    p.add_argument("--hold-max", type=float, default=90)
    return p.parse_args()


def set_env(mode):
    os.environ.setdefault("JAX_PLATFORMS", "cuda")
    if mode in ("platform", "cuda_async"):
        os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = mode
    else:
        # default settings: BFC, preallocate 75 % of what the device reports
        os.environ.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)
        os.environ.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
        os.environ.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)


def stats(dev):
    try:
        s = dev.memory_stats() or {}
    except Exception as e:  # noqa: BLE001
        return {"error": exc_text(e)}
    keep = ("bytes_limit", "bytes_in_use", "peak_bytes_in_use", "bytes_reserved",
            "pool_bytes", "largest_free_block_bytes")
    return {k: s[k] for k in keep if k in s}


def small_compute(jnp):
    a = jnp.arange(1024, dtype=jnp.float32)
    got = float((a * a).sum())
    want = float(sum(i * i for i in range(1024)))
    return abs(got - want) <= 1e-4 * want, got


def mode_default(res, args, hold=False):
    import jax
    import jax.numpy as jnp
    res["jax"] = jax.__version__
    dev = jax.devices()[0]
    res["device"] = str(dev)
    res["platform"] = dev.platform
    smi = Sampler(res)
    st = stats(dev)
    res["stats_start"] = st
    res["bytes_limit"] = st.get("bytes_limit")
    checkpoint(res)
    try:
        res["compute_ok"], res["compute_value"] = small_compute(jnp)
    except Exception as e:  # noqa: BLE001
        res["compute_ok"] = False
        res["compute_exc"] = exc_text(e, 600)
    st = stats(dev)
    res["stats_end"] = st
    if res["bytes_limit"] is None:
        res["bytes_limit"] = st.get("bytes_limit")
    smi.sample("after_compute")
    if hold:
        res["stop_seen"] = False
        if args.ready:
            tmp = args.ready + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"pid": os.getpid(), "bytes_limit": res["bytes_limit"],
                           "compute_ok": res["compute_ok"]}, f)
            os.replace(tmp, args.ready)
        t0 = time.time()
        keep = jnp.ones((1 << 20,), jnp.float32).block_until_ready()  # a small live array
        while time.time() - t0 < args.hold_max:
            if args.stop and os.path.exists(args.stop):
                res["stop_seen"] = True
                break
            time.sleep(0.2)
        res["held_s"] = round(time.time() - t0, 1)
        smi.sample("end_of_hold")
        del keep


def mode_alloc(res, args):
    import jax
    import jax.numpy as jnp
    res["jax"] = jax.__version__
    dev = jax.devices()[0]
    res["device"] = str(dev)
    smi = Sampler(res)
    res["stats_start"] = stats(dev)
    res["bytes_limit"] = res["stats_start"].get("bytes_limit")
    checkpoint(res)

    def ones(gib):
        return jnp.ones((int(gib * GiB) // 4,), jnp.float32).block_until_ready()

    a = b = None
    try:
        a = ones(args.first_gib)
        res["first_ok"] = True
    except Exception as e:  # noqa: BLE001
        res["first_ok"] = False
        res["first_exc"] = exc_text(e, 600)
    checkpoint(res)
    smi.sample("after_first")
    try:
        b = ones(args.second_gib)
        res["second_fail"] = False
    except Exception as e:  # noqa: BLE001
        res["second_fail"] = True
        res["second_exc"] = exc_text(e, 600)
        res["second_exc_class"] = type(e).__name__
        res["second_resource_exhausted"] = "RESOURCE_EXHAUSTED" in str(e)
    checkpoint(res)
    smi.sample("after_second")
    res["stats_peak"] = stats(dev)
    for arr in (a, b):
        if arr is not None:
            try:
                arr.delete()
            except Exception:  # noqa: BLE001
                pass
    del a, b
    gc.collect()
    try:
        c = ones(args.after_gib)
        res["after_free_ok"] = True
        c.delete()
        del c
    except Exception as e:  # noqa: BLE001
        res["after_free_ok"] = False
        res["after_exc"] = exc_text(e, 600)
    try:
        res["compute_ok"], _ = small_compute(jnp)
    except Exception as e:  # noqa: BLE001
        res["compute_ok"] = False
        record_error(res, "small_compute", e)


def main():
    args = parse()
    set_env(args.mode)

    def body(res):
        res["budget_gib"] = args.budget_gib
        res["xla_allocator"] = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default")
        if args.mode == "default":
            mode_default(res, args)
        elif args.mode == "hold":
            mode_default(res, args, hold=True)
        else:
            mode_alloc(res, args)

    run_case("jax", args, body)


if __name__ == "__main__":
    main()
