"""A module in a compressed fatbinary is refused before the card holds any of it.

A module with 1.5 GiB of `__device__` globals, compiled by nvcc into a fatbinary whose
cubin is compressed (scripts/gpu/compressed_fatbin.sh builds them: `-Xfatbin=-compress-all`,
`--compress-mode=size`, `--compress-mode=speed` with `-compress-all`), is loaded LOADS
times with `cuModuleLoadData` and LOADS times as a library (`cuLibraryLoadData`, then
`cuLibraryGetGlobal`, which brings a lazily loaded library's globals in), under
CUDABUDGET_LIMIT=1Gi. An outside sampler (another process, NVML through ctypes, no
library preloaded) reads the card's used memory as fast as it can meanwhile.

PASS (budget run) when every load and every look-up returned CUDA_ERROR_OUT_OF_MEMORY
and the sampler never saw the card's use rise by 1 GiB or more above what it was before
the first load (the process's context included in that). The native run (no library)
must load every time and the sampler must see the module (a rise of at least 1.4 GiB):
else the case proves nothing, and says so with a FAIL line.

Usage: python3 compressed_fatbin.py --lib LIB IMAGE.fatbin... [--loads 20]
Prints PASS/FAIL/SKIP/INFO lines and a last line "compressed_fatbin: passed|FAILED";
exit status 0 iff no check FAILed.
"""

import argparse
import ctypes
import json
import os
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GiB, MiB, clean_env, end_workers, expect_line as expect, start_worker  # noqa: E402

GLOBALS = 1536 * MiB
BUDGET = "1Gi"
OOM = 2
# Every attempt is followed by this long (a loaded module held before its unload), so
# that the sampler, which reads NVML every few tens of microseconds, reads the card many
# times around each (a dwell time, not a handshake).
HOLD_S = 0.05
# Reads of the card a window must have to count.
MIN_SAMPLES = 100


# ---------- the sampler: NVML, in a process of its own ----------

class NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def sampler(args):
    """Reads the card's used memory in a loop. Commands on stdin: "begin" (a window
    starts: replies "begun BASELINE"), "end" (replies "window {json}"), "exit"."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    if nvml.nvmlInit_v2() != 0:
        print("error nvmlInit_v2 failed", flush=True)
        return 1
    handle = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(args.index), ctypes.byref(handle)) != 0:
        print("error nvmlDeviceGetHandleByIndex_v2 failed", flush=True)
        return 1
    def used():
        mem = NvmlMemory()
        if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
            return None
        return mem.used

    state = {"window": False, "max": 0, "samples": 0, "failed": 0, "stop": False}
    lock = threading.Lock()

    def sample():
        while not state["stop"]:
            u = used()
            with lock:
                if not state["window"]:
                    continue
                if u is None:
                    state["failed"] += 1
                else:
                    state["samples"] += 1
                    state["max"] = max(state["max"], u)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "begin":
            base = used() or 0
            with lock:
                state.update(window=True, max=base, samples=0, failed=0)
            print("begun %d" % base, flush=True)
        elif cmd == "end":
            with lock:
                state["window"] = False
                window = {"max": state["max"], "samples": state["samples"], "failed": state["failed"]}
            print("window " + json.dumps(window), flush=True)
        else:
            break
    state["stop"] = True
    t.join(timeout=5)
    return 0


# ---------- the loader: the driver API through ctypes ----------

class Cuda:
    def __init__(self):
        L = self.lib = ctypes.CDLL("libcuda.so.1")
        P, I, U, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
        L.cuInit.argtypes = [U]
        L.cuDeviceGet.argtypes = [ctypes.POINTER(I), I]
        L.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(P), I]
        L.cuCtxSetCurrent.argtypes = [P]
        L.cuModuleLoadData.argtypes = [ctypes.POINTER(P), P]
        L.cuModuleUnload.argtypes = [P]
        L.cuLibraryLoadData.argtypes = [ctypes.POINTER(P), P, P, P, U, P, P, U]
        L.cuLibraryGetGlobal.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(S), P, ctypes.c_char_p]
        L.cuLibraryUnload.argtypes = [P]
        for what, rc in (("cuInit", L.cuInit(0)),):
            if rc != 0:
                raise RuntimeError("%s returned %d" % (what, rc))
        dev = I()
        ctx = P()
        for what, rc in (("cuDeviceGet", L.cuDeviceGet(ctypes.byref(dev), 0)),
                         ("cuDevicePrimaryCtxRetain", L.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value)),
                         ("cuCtxSetCurrent", L.cuCtxSetCurrent(ctx))):
            if rc != 0:
                raise RuntimeError("%s returned %d" % (what, rc))

    def module(self, image):
        m = ctypes.c_void_p()
        rc = self.lib.cuModuleLoadData(ctypes.byref(m), image)
        time.sleep(HOLD_S)
        if rc == 0:
            self.lib.cuModuleUnload(m)
        return rc

    def library(self, image):
        """A library's load and its first look-up: the look-up's code, or the load's."""
        lib = ctypes.c_void_p()
        rc = self.lib.cuLibraryLoadData(ctypes.byref(lib), image, None, None, 0, None, None, 0)
        if rc != 0:
            time.sleep(HOLD_S)
            return "load:%d" % rc
        ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = self.lib.cuLibraryGetGlobal(ctypes.byref(ptr), ctypes.byref(size), lib, b"big")
        time.sleep(HOLD_S)
        self.lib.cuLibraryUnload(lib)
        return str(rc)


def loader(args):
    image = open(args.image, "rb").read()
    cuda = Cuda()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    modules, libraries = {}, {}
    for _ in range(args.loads):
        rc = str(cuda.module(image))
        modules[rc] = modules.get(rc, 0) + 1
    for _ in range(args.loads):
        rc = cuda.library(image)
        libraries[rc] = libraries.get(rc, 0) + 1
    print("result " + json.dumps({"module_rcs": modules, "library_rcs": libraries}), flush=True)
    sys.stdin.readline()  # held (context and all) until told, so the window ends first
    return 0


# ---------- the image ----------

def chosen_entry(path, cc):
    """The codec of the entry the driver loads for compute capability `cc` from this
    fatbinary ("lz4", "zstd", "none"), its stored and expanded sizes; None if no cubin."""
    data = open(path, "rb").read()
    if len(data) < 16 or struct.unpack_from("<I", data, 0)[0] != 0xBA55ED50:
        return None
    hsize, size = struct.unpack_from("<HQ", data, 6)
    at, end, want, found = hsize, hsize + size, cc[0] * 10 + cc[1], None
    while at + 64 <= min(end, len(data)):
        kind, = struct.unpack_from("<H", data, at)
        head, padded = struct.unpack_from("<IQ", data, at + 4)
        packed, = struct.unpack_from("<I", data, at + 16)
        arch, = struct.unpack_from("<I", data, at + 28)
        flags, = struct.unpack_from("<Q", data, at + 40)
        unpacked, = struct.unpack_from("<Q", data, at + 56)
        if kind == 2 and arch == want:
            codec = {0: "none", 0x2000: "lz4", 0x8000: "zstd"}.get(flags & 0xA000, "both")
            found = (codec, packed or padded, unpacked)
        at += head + padded
    return found


def device_cc():
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    major, minor = ctypes.c_int(), ctypes.c_int()
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, 0)
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, 0)
    return major.value, minor.value


# ---------- the scenario ----------

def start(role, extra, env, log):
    return start_worker(__file__, ["--role", role] + extra, env, log)


def tell(p, line):
    p.stdin.write(line + "\n")
    p.stdin.flush()


def scenario(args, image, budgeted, work, tag):
    env = clean_env()
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    loader_env = dict(env)
    if budgeted:
        loader_env.update(LD_PRELOAD=os.path.abspath(args.lib), CUDABUDGET_LIMIT=BUDGET,
                          CUDABUDGET_LOG=os.environ.get("CB_LOG", "info"))
    logs = {r: open(os.path.join(work, "%s-%s.log" % (tag, r)), "w") for r in ("sampler", "loader")}
    procs = []
    try:
        sm = start("sampler", ["--index", str(args.index)], env, logs["sampler"])
        procs.append(sm)
        expect(sm, "ready", 60)
        ld = start("loader", ["--image", image, "--loads", str(args.loads)], loader_env, logs["loader"])
        procs.append(ld)
        expect(ld, "ready")
        tell(sm, "begin")
        baseline = int(expect(sm, "begun"))
        tell(ld, "go")
        result = json.loads(expect(ld, "result", 300))
        tell(sm, "end")
        window = json.loads(expect(sm, "window"))
        tell(ld, "exit")
        tell(sm, "exit")
        return dict(result, baseline=baseline, **window)
    finally:
        end_workers(procs, logs.values())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["sampler", "loader"])
    p.add_argument("--lib", default="target/release/libcudabudget.so")
    p.add_argument("--loads", type=int, default=20)
    p.add_argument("--index", type=int, default=0, help="the card's NVML index (CUDA device 0)")
    p.add_argument("--image")
    p.add_argument("--work", default=None)
    p.add_argument("--build-failed", action="store_true", help="an image could not be built (FAIL said)")
    p.add_argument("images", nargs="*", help="NAME=PATH of each fatbinary")
    args = p.parse_args()
    if args.role == "sampler":
        return sampler(args)
    if args.role == "loader":
        return loader(args)
    failed = args.build_failed

    def check(ok, what):
        nonlocal failed
        print("%s %s" % ("PASS" if ok else "FAIL", what), flush=True)
        failed |= not ok

    if not os.path.exists(args.lib):
        check(False, "compressed_fatbin/setup: no library at %s" % args.lib)
        print("compressed_fatbin: FAILED")
        return 1
    if not args.images:
        check(False, "compressed_fatbin/setup: no image to load")
    cc = device_cc()
    work = args.work or os.getcwd()
    mib = lambda b: b / MiB  # noqa: E731
    for spec in args.images:
        name, path = spec.split("=", 1)
        case = "compressed_fatbin[%s]" % name
        entry = chosen_entry(path, cc)
        if entry is None:
            check(False, "%s/image: no sm_%d%d cubin in %s" % ((case,) + cc + (path,)))
            continue
        codec, stored, expanded = entry
        print("INFO %s: the sm_%d%d cubin is stored %s, %d bytes (%d expanded)"
              % ((case,) + cc + (codec, stored, expanded)), flush=True)
        if codec == "none":
            # The `size` mode may leave cubins alone; the -compress-all images must not.
            line = "%s: nvcc stored the cubin uncompressed: nothing to test" % case
            if name.startswith("all"):
                check(False, line)
            else:
                print("SKIP " + line, flush=True)
            continue
        native = scenario(args, path, False, work, name + "-native")
        rise = native["max"] - native["baseline"]
        print("INFO %s native: modules %s, libraries %s, card +%.0f MiB at most (%d samples)"
              % (case, native["module_rcs"], native["library_rcs"], mib(rise), native["samples"]), flush=True)
        check(native["module_rcs"] == {"0": args.loads} and native["library_rcs"] == {"0": args.loads},
              "%s native: every load succeeds without the library: modules %s, libraries %s"
              % (case, native["module_rcs"], native["library_rcs"]))
        check(native["samples"] >= MIN_SAMPLES and rise >= GLOBALS - 128 * MiB,
              "%s native: the sampler sees the module on the card: +%.0f MiB (%d samples)"
              % (case, mib(rise), native["samples"]))
        budget = scenario(args, path, True, work, name + "-budget")
        rise = budget["max"] - budget["baseline"]
        check(budget["module_rcs"] == {str(OOM): args.loads},
              "%s budget: every module load is refused with CUDA_ERROR_OUT_OF_MEMORY: %s"
              % (case, budget["module_rcs"]))
        check(budget["library_rcs"] == {str(OOM): args.loads},
              "%s budget: every library's first look-up is refused with CUDA_ERROR_OUT_OF_MEMORY: %s"
              % (case, budget["library_rcs"]))
        check(budget["samples"] >= MIN_SAMPLES and rise < GiB,
              "%s budget: the card never held it: +%.0f MiB at most over %d samples (under 1 GiB)"
              % (case, mib(rise), budget["samples"]))
    print("compressed_fatbin: %s (logs in %s)" % ("FAILED" if failed else "passed", work), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
