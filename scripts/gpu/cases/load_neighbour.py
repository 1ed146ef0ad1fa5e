"""A module load never holds more than the budget, even for the length of the load.

Three processes on GPU 0, on the driver API through ctypes (no framework):
- a filler takes the card's memory until FREE_LEFT (3.5 GiB) is left;
- a neighbour (no budget) allocates and frees 1 GiB in a loop: the card leaves it
  just enough, as long as the tenant keeps within its budget;
- a tenant under CUDABUDGET_LIMIT=2Gi first loads a module with 256 MiB of globals (it
  fits: must load), then loads, again and again, a module with 3 GiB of globals
  (`__device__ char big[3ull << 30]`, compiled with nvcc at run time as a cubin, PTX and
  a fatbinary).

Natively the tenant's load takes 3 GiB whenever the neighbour's 1 GiB is free, and the
neighbour is refused meanwhile (INFO lines: what the scenario is about). With the
library the 3 GiB load is refused before the driver's call, for what the image says:
PASS when the neighbour is never refused, every 3 GiB load returned
CUDA_ERROR_OUT_OF_MEMORY, and the 256 MiB one loaded.

A fatbinary whose cubin for the device is compressed (nvcc may compress) is judged like
the others: the library expands the entry before the load (INFO line says so).

Usage (from the repository root, target/release/libcudabudget.so built; nvcc on PATH):
    python3 scripts/gpu/cases/load_neighbour.py [--lib PATH] [--seconds 8] [--images cubin,ptx,fatbin]
      [--prebuilt DIR]   (DIR/big.cubin and DIR/small.cubin instead of nvcc)
Exit status 0 iff no check FAILed.
"""

import argparse
import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import end_workers, expect_line as expect, start_worker  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
FREE_LEFT = 3 * GiB + 512 * MiB
NEIGHBOUR = 1 * GiB
BUDGET = "2Gi"

BIG = r"""
__device__ char big[3ull << 30];
extern "C" __global__ void touch(unsigned long long i) { big[i % (3ull << 30)] = 1; }
"""
SMALL = r"""
__device__ char small[256ull << 20];
extern "C" __global__ void touch(unsigned long long i) { small[i % (256ull << 20)] = 1; }
"""


# ---------- the driver, through ctypes ----------

class Cuda:
    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        L = self.lib
        L.cuInit.argtypes = [ctypes.c_uint]
        L.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        L.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        L.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        L.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        L.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        L.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        L.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        L.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        L.cuModuleUnload.argtypes = [ctypes.c_void_p]
        self.check(L.cuInit(0), "cuInit")

    @staticmethod
    def check(rc, what):
        if rc != 0:
            raise RuntimeError("%s returned %d" % (what, rc))

    def cc(self):
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(self.lib.cuDeviceGetAttribute(ctypes.byref(major), 75, 0), "cuDeviceGetAttribute")
        self.check(self.lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, 0), "cuDeviceGetAttribute")
        return major.value, minor.value

    def context(self):
        dev = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def free(self):
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.check(self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return free.value

    def alloc(self, size):
        p = ctypes.c_uint64()
        rc = self.lib.cuMemAlloc_v2(ctypes.byref(p), size)
        return rc, p.value

    def load(self, image):
        m = ctypes.c_void_p()
        rc = self.lib.cuModuleLoadData(ctypes.byref(m), image)
        if rc == 0:
            self.lib.cuModuleUnload(m)
        return rc


# ---------- workers: print "ready ...", wait for "go SECONDS", print "result {json}" ----------

def say(*words):
    print(*words, flush=True)


def wait_go():
    line = sys.stdin.readline().split()
    return float(line[1]) if len(line) == 2 and line[0] == "go" else 0.0


def filler(args):
    cuda = Cuda()
    cuda.context()
    held, want = [], args.free_left
    while True:
        free = cuda.free()
        if free <= want + 2 * MiB:
            break
        step = min(GiB, (free - want) // (2 * MiB) * (2 * MiB))
        rc, p = cuda.alloc(step)
        if rc != 0 or step == 0:
            break
        held.append(p)
    say("ready free=%d" % cuda.free())
    sys.stdin.readline()  # held until told


def neighbour(args):
    cuda = Cuda()
    cuda.context()
    say("ready")
    seconds = wait_go()
    tries = refused = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        rc, p = cuda.alloc(NEIGHBOUR)
        tries += 1
        if rc == 0:
            cuda.lib.cuMemFree_v2(p)
        else:
            refused += 1
    say("result " + json.dumps({"tries": tries, "refused": refused}))


def tenant(args):
    cuda = Cuda()
    cuda.context()
    small = open(args.small, "rb").read() + b"\0"
    big = open(args.big, "rb").read() + b"\0"
    small_rc = cuda.load(small)
    say("ready small_rc=%d" % small_rc)
    seconds = wait_go()
    rcs = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        rc = cuda.load(big)
        rcs[rc] = rcs.get(rc, 0) + 1
        time.sleep(0.002)
    say("result " + json.dumps({"small_rc": small_rc, "big_rcs": rcs}))


# ---------- the images ----------

def compile_images(work, cc):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    arch = "%d%d" % cc
    for name, code in (("big", BIG), ("small", SMALL)):
        with open(os.path.join(work, name + ".cu"), "w") as f:
            f.write(code)
    images = {}
    for kind, flags in (("cubin", ["-cubin", "-arch=sm_" + arch]),
                        ("ptx", ["-ptx", "-arch=compute_" + arch]),
                        ("fatbin", ["-fatbin", "-gencode", "arch=compute_%s,code=sm_%s" % (arch, arch),
                                    "-gencode", "arch=compute_%s,code=compute_%s" % (arch, arch)])):
        pair = {}
        for name in ("big", "small"):
            out = os.path.join(work, "%s.%s" % (name, kind))
            r = subprocess.run([nvcc] + flags + ["-o", out, os.path.join(work, name + ".cu")],
                               capture_output=True, text=True)
            if r.returncode != 0:
                pair = None
                say("INFO nvcc %s %s failed: %s" % (kind, name, r.stderr.strip()[:300]))
                break
            pair[name] = out
        if pair:
            images[kind] = pair
    return images


def fatbin_compressed(path, cc):
    """Whether the entry the driver would load from this fatbinary is compressed."""
    data = open(path, "rb").read()
    if len(data) < 16 or struct.unpack_from("<I", data, 0)[0] != 0xBA55ED50:
        return None
    hsize, size = struct.unpack_from("<HQ", data, 6)
    at, end, want, found = hsize, hsize + size, cc[0] * 10 + cc[1], None
    while at + 64 <= min(end, len(data)):
        kind, = struct.unpack_from("<H", data, at)
        head, length = struct.unpack_from("<IQ", data, at + 4)
        arch, = struct.unpack_from("<I", data, at + 28)
        flags, = struct.unpack_from("<Q", data, at + 40)
        if kind == 2 and arch == want:
            found = bool(flags & (0x2000 | 0x8000))
        at += head + length
    return found


# ---------- the scenario ----------

def start(role, args, env, log, extra=()):
    return start_worker(__file__, ["--role", role, "--free-left", str(args.free_left)] + list(extra), env, log)


def scenario(args, image, budgeted, work):
    base = {k: v for k, v in os.environ.items()
            if k != "LD_PRELOAD" and not k.startswith(("CUDABUDGET_", "CUDA_DEVICE_MEMORY_LIMIT"))}
    base["CUDA_VISIBLE_DEVICES"] = base.get("CUDA_VISIBLE_DEVICES", "0")
    tenant_env = dict(base)
    if budgeted:
        tenant_env.update(LD_PRELOAD=os.path.abspath(args.lib), CUDABUDGET_LIMIT=BUDGET)
    tag = "%s-%s" % (image["kind"], "budget" if budgeted else "native")
    logs = {r: open(os.path.join(work, "%s-%s.log" % (tag, r)), "w") for r in ("neighbour", "tenant", "filler")}
    procs = []
    try:
        nb = start("neighbour", args, base, logs["neighbour"])
        procs.append(nb)
        expect(nb, "ready")
        tn = start("tenant", args, tenant_env, logs["tenant"], ["--big", image["big"], "--small", image["small"]])
        procs.append(tn)
        small_ready = expect(tn, "ready")
        fl = start("filler", args, base, logs["filler"])
        procs.append(fl)
        free = expect(fl, "ready")
        for p in (nb, tn):
            p.stdin.write("go %s\n" % args.seconds)
            p.stdin.flush()
        n = json.loads(expect(nb, "result", args.seconds + 60))
        t = json.loads(expect(tn, "result", args.seconds + 60))
        fl.stdin.write("exit\n")
        fl.stdin.flush()
        return {"neighbour": n, "tenant": t, "filler": free, "small": small_ready}
    finally:
        end_workers(procs, logs.values())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["filler", "neighbour", "tenant"])
    p.add_argument("--lib", default="target/release/libcudabudget.so")
    p.add_argument("--seconds", type=float, default=8)
    p.add_argument("--images", default=None, help="default: cubin,ptx,fatbin (cubin with --prebuilt)")
    p.add_argument("--free-left", type=int, default=FREE_LEFT)
    p.add_argument("--prebuilt", help="a directory with big.cubin and small.cubin, instead of nvcc")
    p.add_argument("--big")
    p.add_argument("--small")
    args = p.parse_args()
    if args.role:
        {"filler": filler, "neighbour": neighbour, "tenant": tenant}[args.role](args)
        return 0
    if not os.path.exists(args.lib):
        say("FAIL load_neighbour: no library at %s" % args.lib)
        return 1
    cc = Cuda().cc()
    work = tempfile.mkdtemp(prefix="cb-load-neighbour-")
    say("INFO device compute capability %d.%d; work dir %s" % (cc + (work,)))
    if args.prebuilt:
        images = {"cubin": {n: os.path.join(args.prebuilt, n + ".cubin") for n in ("big", "small")}}
    else:
        images = compile_images(work, cc)
    failed = False
    kinds = args.images or ("cubin" if args.prebuilt else "cubin,ptx,fatbin")
    for kind in kinds.split(","):
        if kind not in images:
            say("FAIL load_neighbour[%s]: nvcc could not make the image" % kind)
            failed = True
            continue
        image = dict(images[kind], kind=kind)
        if kind == "fatbin" and fatbin_compressed(image["big"], cc):
            say("INFO load_neighbour[fatbin]: nvcc compressed the sm_%d%d cubin" % cc)
        native = scenario(args, image, False, work)
        n, t = native["neighbour"], native["tenant"]
        say("INFO load_neighbour[%s] native: neighbour refused %d of %d; tenant 3 GiB loads %s; "
            "card free after the filler %s" % (kind, n["refused"], n["tries"], t["big_rcs"], native["filler"]))
        budget = scenario(args, image, True, work)
        n, t = budget["neighbour"], budget["tenant"]
        loads = sum(t["big_rcs"].values())
        refused_all = loads > 0 and t["big_rcs"].get("2", 0) == loads
        for ok, what in (
            (n["refused"] == 0 and n["tries"] > 0,
             "neighbour never refused: %d of %d allocations of 1 GiB refused" % (n["refused"], n["tries"])),
            (refused_all, "every 3 GiB load refused with CUDA_ERROR_OUT_OF_MEMORY: %s" % t["big_rcs"]),
            (t["small_rc"] == 0, "the 256 MiB module loads under 2 GiB: rc=%d" % t["small_rc"]),
        ):
            say("%s load_neighbour[%s] budget: %s" % ("PASS" if ok else "FAIL", kind, what))
            failed |= not ok
    say("load_neighbour: %s (logs in %s)" % ("FAILED" if failed else "passed", work))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
