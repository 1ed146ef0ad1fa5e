"""The per-device cases that need two GPUs, each run natively and under the library.

Run by run_all.sh --two-gpu (cases two_gpu_reordered, two_gpu_peer, two_gpu_job,
two_gpu_nccl) or alone:
    python3 scripts/gpu/cases/two_gpu.py --lib target/release/libcudabudget.so --case peer
Prints one PASS/FAIL line per check (and the facts behind it), then "two_gpu_<case>: done";
exit status 0 iff no FAIL.

reordered  CUDA_VISIBLE_DEVICES=1,0 with CUDABUDGET_LIMIT_0=5Gi, CUDABUDGET_LIMIT_1=9Gi: the
           ordinals are the process's own (cuda:0 is physical GPU 1, by UUID); cuda:0 shows
           5 GiB and holds 4 with 2 more refused, cuda:1 shows 9 and holds 8 with 2 more
           refused; natively both show the card and nothing is refused.
peer       Both GPUs under 6 GiB each: 4 GiB on cuda:0 copied to cuda:1 (peer access where the
           GPUs allow it, the copy checked); cuda:1 then refuses 4 GiB more and grants 1; once
           the copy is freed cuda:1 grants 4; with CuPy, cudaMemcpyPeer between the two
           blocks. Natively nothing is refused.
job        One job (CUDABUDGET_SCOPE=job:...) of 6 GiB on every device, two members: A holds
           4 GiB on cuda:0; B holds 4 GiB on cuda:1 (another device: granted), is refused 4
           GiB on cuda:0 (the job's 4 of 6 there) and granted 1. Natively all are granted.
nccl       Two processes, one GPU each, 8 GiB each: an NCCL all-reduce of 1 GiB tensors gives
           the sum on both; each then sees 8 GiB as its device's total and is refused what
           its budget has left plus 1 GiB; nvidia-smi shows each at most 8 GiB + 2 %.
           Natively the all-reduce gives the same sum and each rank sees its card.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import clean_env, smi_apps  # noqa: E402

GiB = 1 << 30

# A worker: runs STEPS (a JSON list) on the GPUs and prints one JSON line of what happened.
# Steps: ["total", dev] mem_get_info's total; ["uuid", dev]; ["hold", name, dev, gib];
# ["free", name]; ["copy", name, src, dev] a peer copy of block src to dev, checked;
# ["peer", a, b] whether a can access b; ["cupy_peer", name, src] cudaMemcpyPeer;
# ["ready", path] writes the file; ["wait", path] waits for the file.
WORKER = r"""
import json, os, sys, time, torch
GiB = 1 << 30
steps = json.loads(sys.argv[1])
held, out = {}, []
for step in steps:
    op, args = step[0], step[1:]
    try:
        if op == "total":
            out.append(torch.cuda.mem_get_info(args[0])[1] / GiB)
        elif op == "uuid":
            out.append("GPU-" + str(torch.cuda.get_device_properties(args[0]).uuid))
        elif op == "hold":
            name, dev, gib = args
            held[name] = torch.full((int(gib * GiB),), 7, dtype=torch.uint8, device="cuda:%d" % dev)
            torch.cuda.synchronize(dev)
            out.append(True)
        elif op == "free":
            del held[args[0]]
            torch.cuda.empty_cache()
            out.append(True)
        elif op == "copy":
            name, src, dev = args
            held[name] = held[src].to("cuda:%d" % dev)
            torch.cuda.synchronize(dev)
            out.append(bool(held[name][:: 1 << 20].eq(7).all().item()))
        elif op == "peer":
            out.append(torch.cuda.can_device_access_peer(args[0], args[1]))
        elif op == "cupy_peer":
            import cupy
            name, src = args
            dst, s = held[name], held[src]
            dst.zero_()
            torch.cuda.synchronize()
            cupy.cuda.runtime.memcpyPeer(dst.data_ptr(), dst.device.index, s.data_ptr(),
                                         s.device.index, s.numel())
            torch.cuda.synchronize()
            out.append(bool(dst[:: 1 << 20].eq(7).all().item()))
        elif op == "ready":
            open(args[0], "w").write(str(os.getpid()))
            out.append(True)
        elif op == "wait":
            t = time.time()
            while not os.path.exists(args[0]) and time.time() - t < 120:
                time.sleep(0.02)
            out.append(os.path.exists(args[0]))
    except torch.OutOfMemoryError:
        out.append("OOM")
    except ImportError as e:
        out.append("SKIP " + str(e)[:80])
    except Exception as e:  # noqa: BLE001 - reported, judged by the caller
        out.append("ERROR %s: %s" % (type(e).__name__, str(e)[:200]))
print(json.dumps(out), flush=True)
"""

# One rank of an NCCL all-reduce; prints one JSON line.
NCCL_RANK = r"""
import json, os, sys, torch, torch.distributed as dist
GiB = 1 << 30
rank, budget_gib = int(os.environ["RANK"]), float(sys.argv[1])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", rank=rank, world_size=2)
x = torch.full((GiB // 4,), float(rank + 1), dtype=torch.float32, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
res = {"sum": x[:: 1 << 20].unique().tolist(), "total_gib": torch.cuda.mem_get_info()[1] / GiB}
free = torch.cuda.mem_get_info()[0]
try:
    y = torch.empty(int(free + GiB), dtype=torch.uint8, device="cuda")
    res["asked_free_plus_1gib"] = "granted"
    del y
except torch.OutOfMemoryError:
    res["asked_free_plus_1gib"] = "OOM"
res["pid"] = os.getpid()
open(sys.argv[2] + str(rank), "w").write(json.dumps(res))
dist.barrier()
import time; time.sleep(3)
dist.destroy_process_group()
print(json.dumps(res), flush=True)
"""

results = []


def check(case, name, ok, facts):
    results.append(ok)
    print("%s two_gpu_%s/%s %s" % ("PASS" if ok else "FAIL", case, name,
                                    json.dumps(facts, default=str)), flush=True)


def env_for(args, budgeted, extra):
    e = clean_env()
    e.update(extra)
    if budgeted:
        e.update({"LD_PRELOAD": args.lib, "CUDABUDGET_LOG": "info"})
    else:
        e = {k: v for k, v in e.items() if not k.startswith("CUDABUDGET_")}
    return e


def work(args, budgeted, steps, extra, wait=True):
    proc = subprocess.Popen([args.python, "-c", WORKER, json.dumps(steps)],
                            env=env_for(args, budgeted, extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    return finish(proc)


def finish(proc):
    out, err = proc.communicate(timeout=300)
    lines = [line for line in out.splitlines() if line.startswith("[")]
    return json.loads(lines[-1]) if lines else ["no answer: " + err[-400:]]


def near(value, gib):
    return isinstance(value, float) and abs(value - gib) < 1 / 16


def smi_uuids():
    r = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                       env=clean_env(), capture_output=True, text=True, timeout=30)
    return {int(i): u.strip() for i, u in (line.split(",") for line in r.stdout.splitlines())}


def case_reordered(args):
    extra = {"CUDA_VISIBLE_DEVICES": "1,0", "CUDABUDGET_LIMIT_0": "5Gi", "CUDABUDGET_LIMIT_1": "9Gi"}
    steps = [["uuid", 0], ["total", 0], ["total", 1], ["hold", "a", 0, 4], ["hold", "b", 0, 2],
             ["hold", "c", 1, 8], ["hold", "d", 1, 2]]
    physical = smi_uuids()
    for budgeted in (False, True):
        got = work(args, budgeted, steps, extra)
        tag = "budgeted" if budgeted else "native"
        check("reordered", tag + "/cuda0_is_physical_gpu1", got[0] == physical.get(1),
              {"cuda0": got[0], "physical": physical})
        if budgeted:
            ok = near(got[1], 5) and near(got[2], 9) and got[3:] == [True, "OOM", True, "OOM"]
        else:
            ok = got[1] > 20 and got[2] > 20 and got[3:] == [True] * 4
        check("reordered", tag + "/totals_and_refusals_per_ordinal", ok, {"got": got})


def case_peer(args):
    extra = {"CUDA_VISIBLE_DEVICES": "0,1", "CUDABUDGET_LIMIT": "6Gi"}
    steps = [["peer", 0, 1], ["hold", "a", 0, 4], ["copy", "b", "a", 1], ["hold", "c", 1, 4],
             ["hold", "d", 1, 1], ["free", "d"], ["free", "b"], ["hold", "e", 1, 4],
             ["cupy_peer", "e", "a"]]
    for budgeted in (False, True):
        got = work(args, budgeted, steps, extra)
        tag = "budgeted" if budgeted else "native"
        copied = got[2] is True
        check("peer", tag + "/copy_to_cuda1_checked", copied, {"got": got})
        refused = "OOM" if budgeted else True
        check("peer", tag + "/cuda1_after_the_copy", got[3:8] == [refused, True, True, True, True],
              {"peer_access": got[0], "got": got[3:8]})
        if isinstance(got[-1], str) and got[-1].startswith("SKIP"):
            print("SKIP two_gpu_peer/%s/cupy_memcpy_peer %s" % (tag, got[-1]), flush=True)
        else:
            check("peer", tag + "/cupy_memcpy_peer_checked", got[-1] is True, {"got": got[-1]})


def case_job(args):
    tmp = tempfile.mkdtemp(prefix="cb-two-job-")
    for budgeted in (False, True):
        tag = "budgeted" if budgeted else "native"
        extra = {"CUDA_VISIBLE_DEVICES": "0,1", "CUDABUDGET_LIMIT": "6Gi",
                 "CUDABUDGET_SCOPE": "job:two-%d-%s" % (os.getpid(), tag),
                 "CUDABUDGET_JOB_DIR": tmp}
        ready, done = os.path.join(tmp, tag + ".a"), os.path.join(tmp, tag + ".done")
        a = work(args, budgeted, [["hold", "a", 0, 4], ["ready", ready], ["wait", done]], extra,
                 wait=False)
        t = time.time()
        while not os.path.exists(ready) and a.poll() is None and time.time() - t < 120:
            time.sleep(0.05)
        b = work(args, budgeted, [["hold", "x", 1, 4], ["hold", "y", 0, 4], ["hold", "z", 0, 1]],
                 extra)
        open(done, "w").close()
        a_got = finish(a)
        refused = "OOM" if budgeted else True
        check("job", tag + "/a_holds_4gib_on_cuda0", a_got[0] is True, {"a": a_got})
        check("job", tag + "/b_on_cuda1_granted_on_cuda0_held_to_the_job",
              b == [True, refused, True], {"b": b})


def case_nccl(args):
    tmp = tempfile.mkdtemp(prefix="cb-two-nccl-")
    try:
        import torch.distributed  # noqa: F401
    except ImportError as e:
        print("SKIP two_gpu_nccl: %s" % e, flush=True)
        return
    for budgeted in (False, True):
        tag = "budgeted" if budgeted else "native"
        port = str(29500 + (os.getpid() % 1000) + (1 if budgeted else 0))
        ranks = []
        for rank in (0, 1):
            extra = {"CUDA_VISIBLE_DEVICES": "0,1", "CUDABUDGET_LIMIT": "8Gi", "RANK": str(rank),
                     "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            ranks.append(subprocess.Popen(
                [args.python, "-c", NCCL_RANK, "8", os.path.join(tmp, tag + ".")],
                env=env_for(args, budgeted, extra), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True))
        # While the ranks sleep after the barrier: nvidia-smi's figure of each.
        seen = {}
        t = time.time()
        while time.time() - t < 240 and len(seen) < 2:
            for rank in (0, 1):
                path = os.path.join(tmp, "%s.%d" % (tag, rank))
                if os.path.exists(path):
                    seen[rank] = json.loads(open(path).read())
            time.sleep(0.1)
        apps = {a["pid"]: a["mib"] for a in (smi_apps() or [])}
        outs = [r.communicate(timeout=120) for r in ranks]
        check("nccl", tag + "/all_reduce_sums", all(seen.get(r, {}).get("sum") == [3.0] for r in (0, 1)),
              {"seen": seen, "stderr": [o[1][-300:] for o in outs if not o[0].strip()]})
        if budgeted:
            ok = all(near(seen.get(r, {}).get("total_gib"), 8)
                     and seen[r].get("asked_free_plus_1gib") == "OOM" for r in (0, 1))
            mib = [apps.get(seen.get(r, {}).get("pid"), 0) for r in (0, 1)]
            check("nccl", "budgeted/each_rank_held_to_8gib", ok, {"seen": seen})
            check("nccl", "budgeted/smi_each<=8GiB+2%", all(0 < m <= 8 * 1024 * 1.02 for m in mib),
                  {"mib": mib})
        else:
            check("nccl", "native/each_rank_sees_its_card",
                  all((seen.get(r, {}).get("total_gib") or 0) > 20 for r in (0, 1)), {"seen": seen})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--case", required=True, choices=["reordered", "peer", "job", "nccl"])
    args = p.parse_args()
    {"reordered": case_reordered, "peer": case_peer, "job": case_job, "nccl": case_nccl}[args.case](args)
    print("two_gpu_%s: done" % args.case, flush=True)
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
