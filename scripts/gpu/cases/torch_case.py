"""PyTorch cases.

--mode alloc   : FIRST GiB ok; SECOND GiB more -> torch.OutOfMemoryError;
                 mem_get_info total/free; nvidia-smi peak; after del +
                 empty_cache, AFTER GiB fits. The allocator backend comes from
                 PYTORCH_CUDA_ALLOC_CONF, set by the runner.
--mode big     : one FIRST GiB tensor (seed scenario); also samples nvidia-smi
                 for a peer process whose pid is in --peer-ready (JSON file).
--mode twogpu  : per-device budgets on cuda:0 and cuda:1 (--dev0 / --dev1 as
                 FIRST,SECOND in GiB).
"""

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GiB, Sampler, checkpoint, exc_text, record_error, run_case, smi_apps, smi_used_mib  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="alloc", choices=["alloc", "big", "twogpu"])
    p.add_argument("--budget-gib", type=float, default=None, help="for the log only")
    p.add_argument("--first-gib", type=float, default=5)
    p.add_argument("--second-gib", type=float, default=4)
    p.add_argument("--after-gib", type=float, default=4)
    p.add_argument("--peer-ready", default=None)
    p.add_argument("--dev0", default="4,4")
    p.add_argument("--dev1", default="8,4")
    return p.parse_args()


def oom_class(torch):
    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def try_alloc(torch, nbytes, device, res, key):
    """Allocate and touch nbytes on device. Returns the tensor or None and
    records key_ok / key_oom / key_exc."""
    OOM = oom_class(torch)
    try:
        t = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
        t.fill_(1)
        torch.cuda.synchronize(device)
        res[key + "_ok"] = True
        res[key + "_oom"] = False
        return t
    except OOM as e:
        res[key + "_ok"] = False
        res[key + "_oom"] = True
        res[key + "_exc"] = exc_text(e, 600)
        res[key + "_exc_class"] = type(e).__name__
    except Exception as e:  # noqa: BLE001 - e.g. RuntimeError "CUDA error: ..."
        res[key + "_ok"] = False
        res[key + "_oom"] = False
        res[key + "_exc"] = exc_text(e, 600)
        res[key + "_exc_class"] = type(e).__name__
    checkpoint(res)
    return None


def mode_alloc(res, args):
    import torch
    res["torch"] = torch.__version__
    dev = torch.device("cuda", 0)
    smi = Sampler(res)
    free0, total0 = torch.cuda.mem_get_info(0)
    res["free_at_start"], res["total_at_start"] = free0, total0
    try:
        res["backend"] = torch.cuda.get_allocator_backend()
    except Exception as e:  # noqa: BLE001
        res["backend"] = "unknown: " + exc_text(e)

    x = try_alloc(torch, args.first_gib * GiB, dev, res, "first")
    try:
        free, total = torch.cuda.mem_get_info(0)
        res["free"], res["total"] = free, total
    except Exception as e:  # noqa: BLE001
        record_error(res, "mem_get_info", e)
    smi.sample("after_first")

    y = try_alloc(torch, args.second_gib * GiB, dev, res, "second")
    smi.sample("after_second")
    try:
        res["max_reserved"] = torch.cuda.max_memory_reserved(0)
    except Exception:  # noqa: BLE001
        pass

    del x, y
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    z = try_alloc(torch, args.after_gib * GiB, dev, res, "after")
    res["after_free_ok"] = res.pop("after_ok")
    res.pop("after_oom", None)
    smi.sample("after_free")
    del z
    try:
        free2, total2 = torch.cuda.mem_get_info(0)
        res["free_end"], res["total_end"] = free2, total2
    except Exception as e:  # noqa: BLE001
        record_error(res, "mem_get_info(end)", e)


def mode_big(res, args):
    import torch
    res["torch"] = torch.__version__
    dev = torch.device("cuda", 0)
    smi = Sampler(res)
    peer_pid = None
    if args.peer_ready:
        try:
            with open(args.peer_ready) as f:
                peer_pid = int(json.load(f)["pid"])
        except Exception as e:  # noqa: BLE001
            record_error(res, "peer-ready", e)
    res["peer_pid"] = peer_pid
    free0, total0 = torch.cuda.mem_get_info(0)
    res["free_at_start"], res["total_at_start"] = free0, total0
    x = try_alloc(torch, args.first_gib * GiB, dev, res, "first")
    free, total = torch.cuda.mem_get_info(0)
    res["free"], res["total"] = free, total
    smi.sample("holding")
    apps = smi_apps()
    res["smi_all"] = apps
    if peer_pid is not None:
        res["peer_smi_mib"] = smi_used_mib(peer_pid, apps=apps)
    del x


def mode_twogpu(res, args):
    import torch
    res["torch"] = torch.__version__
    n = torch.cuda.device_count()
    res["device_count"] = n
    if n < 2:
        raise RuntimeError("twogpu mode needs 2 visible devices, found %d" % n)
    keep = []
    for d, spec in ((0, args.dev0), (1, args.dev1)):
        first, second = (float(v) for v in spec.split(","))
        r = {}
        res["dev%d" % d] = r
        try:
            r["uuid"] = str(torch.cuda.get_device_properties(d).uuid)
        except Exception as e:  # noqa: BLE001
            r["uuid_error"] = exc_text(e)
        free, total = torch.cuda.mem_get_info(d)
        r["free_at_start"], r["total"] = free, total
        dev = torch.device("cuda", d)
        x = try_alloc(torch, first * GiB, dev, r, "first")
        y = try_alloc(torch, second * GiB, dev, r, "second")
        keep.append(x)
        del y
        apps = smi_apps()
        r["smi_mib"] = smi_used_mib(uuid=r.get("uuid"), apps=apps) if r.get("uuid") else None
        checkpoint(res)
    res["smi_all"] = smi_apps()
    del keep


def main():
    args = parse()
    body = {"alloc": mode_alloc, "big": mode_big, "twogpu": mode_twogpu}[args.mode]
    run_case("torch", args, lambda res: (res.update(budget_gib=args.budget_gib), body(res, args)))


if __name__ == "__main__":
    main()
