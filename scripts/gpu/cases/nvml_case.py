"""NVML view (pynvml from nvidia-ml-py) in a PyTorch process.

--mode view     : allocate --hold-gib with torch on cuda:0, then compare
                  nvmlDeviceGetMemoryInfo (v1 and v2) for the NVML device whose
                  UUID is cuda:0's with torch.cuda.mem_get_info.
--mode visible1 : run with CUDA_VISIBLE_DEVICES=1 (set by the runner): cuda:0
                  total, FIRST GiB ok, SECOND GiB more OOM; NVML: the matching
                  physical GPU reports the budget, the other its real total.
"""

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GiB, Sampler, checkpoint, exc_text, norm_uuid, record_error, run_case  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="view", choices=["view", "visible1"])
    p.add_argument("--budget-gib", type=float, default=None, help="for the log only")
    p.add_argument("--hold-gib", type=float, default=1)
    p.add_argument("--first-gib", type=float, default=4)
    p.add_argument("--second-gib", type=float, default=2)
    return p.parse_args()


def s(v):
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    return str(v)


def nvml_devices(res):
    """List every NVML device: index, uuid, v1 and v2 memory info."""
    import pynvml
    pynvml.nvmlInit()
    out = []
    try:
        n = pynvml.nvmlDeviceGetCount()
        for i in range(n):
            d = {"index": i}
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                d["uuid"] = s(pynvml.nvmlDeviceGetUUID(h))
                m = pynvml.nvmlDeviceGetMemoryInfo(h)
                d["total"], d["used"], d["free"] = int(m.total), int(m.used), int(m.free)
                try:
                    m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
                    d["v2_total"], d["v2_used"], d["v2_free"] = int(m2.total), int(m2.used), int(m2.free)
                    d["v2_reserved"] = int(getattr(m2, "reserved", 0))
                except Exception as e:  # noqa: BLE001 - old nvidia-ml-py or driver
                    d["v2_error"] = exc_text(e)
            except Exception as e:  # noqa: BLE001
                d["error"] = exc_text(e)
            out.append(d)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return out


def split_devices(res, torch_uuid, devs):
    want = norm_uuid(torch_uuid)
    match = [d for d in devs if norm_uuid(d.get("uuid")) == want]
    others = [d for d in devs if norm_uuid(d.get("uuid")) != want]
    res["nvml_devices"] = devs
    res["nvml_match_found"] = len(match) == 1
    if match:
        m = match[0]
        res["nvml_index"] = m["index"]
        for k in ("total", "used", "free", "v2_total", "v2_used", "v2_free", "v2_reserved", "v2_error"):
            if k in m:
                res["nvml_" + k] = m[k]
    res["nvml_other_totals"] = [d.get("total") for d in others]


def mode_view(res, args):
    import torch
    res["torch"] = torch.__version__
    smi = Sampler(res)
    x = torch.empty(int(args.hold_gib * GiB), dtype=torch.uint8, device="cuda:0")
    x.fill_(1)
    torch.cuda.synchronize()
    res["hold_ok"] = True
    tfree, ttotal = torch.cuda.mem_get_info(0)
    res["torch_free"], res["torch_total"] = tfree, ttotal
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    res["torch_uuid"] = uuid
    checkpoint(res)
    split_devices(res, uuid, nvml_devices(res))
    # second reading of torch's view right after NVML's, for the consistency check
    tfree2, _ = torch.cuda.mem_get_info(0)
    res["torch_free_after_nvml"] = tfree2
    smi.sample("holding")
    del x


def mode_visible1(res, args):
    import torch
    res["torch"] = torch.__version__
    OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    smi = Sampler(res)
    res["device_count"] = torch.cuda.device_count()
    free, total = torch.cuda.mem_get_info(0)
    res["free_at_start"], res["total"] = free, total
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    res["torch_uuid"] = uuid

    def alloc(gib, key):
        try:
            t = torch.empty(int(gib * GiB), dtype=torch.uint8, device="cuda:0")
            t.fill_(1)
            torch.cuda.synchronize()
            res[key + "_ok"], res[key + "_oom"] = True, False
            return t
        except OOM as e:
            res[key + "_ok"], res[key + "_oom"] = False, True
            res[key + "_exc"] = exc_text(e, 600)
        except Exception as e:  # noqa: BLE001
            res[key + "_ok"], res[key + "_oom"] = False, False
            res[key + "_exc"] = exc_text(e, 600)
        checkpoint(res)
        return None

    x = alloc(args.first_gib, "first")
    y = alloc(args.second_gib, "second")
    smi.sample("after_second")
    try:
        split_devices(res, uuid, nvml_devices(res))
    except Exception as e:  # noqa: BLE001
        record_error(res, "nvml", e)
    del x, y
    gc.collect()


def main():
    args = parse()

    def body(res):
        res["budget_gib"] = args.budget_gib
        (mode_view if args.mode == "view" else mode_visible1)(res, args)

    run_case("nvml", args, body)


if __name__ == "__main__":
    main()
