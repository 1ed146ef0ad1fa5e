"""Where start-up time goes: times each phase of a minimal driver program (load,
cuInit, primary context, first cuMemGetInfo) from inside the process, and with --nvml
the NVML calls the library makes (init, first handle, memory info, process list).
Prints one JSON line. Run it with and without the library, interleaved."""
import ctypes
import json
import sys
import time

clock = time.perf_counter
out = {}
t = clock()
cuda = ctypes.CDLL("libcuda.so.1")
out["load_ms"] = (clock() - t) * 1e3

t = clock()
assert cuda.cuInit(0) == 0
out["cuinit_ms"] = (clock() - t) * 1e3

dev = ctypes.c_int()
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
ctx = ctypes.c_void_p()
t = clock()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
out["ctx_ms"] = (clock() - t) * 1e3
assert cuda.cuCtxSetCurrent(ctx) == 0

free, total = ctypes.c_size_t(), ctypes.c_size_t()
t = clock()
assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
out["meminfo_ms"] = (clock() - t) * 1e3
out["total_gib"] = total.value / 2**30

if "--nvml" in sys.argv:
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    t = clock()
    assert nvml.nvmlInit_v2() == 0
    out["nvml_init_ms"] = (clock() - t) * 1e3
    h = ctypes.c_void_p()
    t = clock()
    assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) == 0
    out["nvml_handle_ms"] = (clock() - t) * 1e3

    class Mem(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    m = Mem()
    t = clock()
    assert nvml.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m)) == 0
    out["nvml_meminfo_ms"] = (clock() - t) * 1e3
    count = ctypes.c_uint(64)
    buf = (ctypes.c_ubyte * (24 * 64))()
    t = clock()
    rc = nvml.nvmlDeviceGetComputeRunningProcesses_v3(h, ctypes.byref(count), buf)
    out["nvml_procs_ms"] = (clock() - t) * 1e3
    out["nvml_procs_rc"] = rc

out["in_process_ms"] = sum(v for k, v in out.items() if k.endswith("_ms"))
print(json.dumps(out))
