# What the driver answers around a primary context reset (cuCtxGetDevice, cuMemGetInfo,
# cuCtxCreate after it), with or without the library: one JSON line. Run it natively and
# with LD_PRELOAD + CUDABUDGET_LIMIT=4Gi.
import ctypes, json, os
from common import preloaded
cuda = ctypes.CDLL("libcuda.so.1")
out = {"preloaded": preloaded()}
def rc(name, *a):
    return getattr(cuda, name)(*a)
def dev():
    d = ctypes.c_int(-1)
    r = cuda.cuCtxGetDevice(ctypes.byref(d))
    return [r, d.value]
def info():
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    r = cuda.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t))
    return [r, f.value >> 20, t.value >> 20]
out["init"] = rc("cuInit", 0)
p = ctypes.c_void_p()
out["retain"] = rc("cuDevicePrimaryCtxRetain", ctypes.byref(p), 0)
out["setcur"] = rc("cuCtxSetCurrent", p)
out["dev_active"] = dev()
out["info_active"] = info()
out["reset"] = rc("cuDevicePrimaryCtxReset_v2", 0)
cur = ctypes.c_void_p()
out["getcur_after_reset"] = [rc("cuCtxGetCurrent", ctypes.byref(cur)), cur.value == p.value]
out["dev_after_reset"] = dev()
out["info_after_reset"] = info()
c = ctypes.c_void_p()
# cuCtxCreate_v2 pushes the new context; pop it to look at what was current below it
out["ctxcreate"] = rc("cuCtxCreate_v2", ctypes.byref(c), 0, 0)
out["info_new_ctx"] = info()
out["dev_new_ctx"] = dev()
popped = ctypes.c_void_p()
out["pop"] = rc("cuCtxPopCurrent_v2", ctypes.byref(popped))
out["dev_below"] = dev()
out["release"] = rc("cuDevicePrimaryCtxRelease_v2", 0)
out["dev_after_release"] = dev()
out["destroy"] = rc("cuCtxDestroy_v2", c)
print(json.dumps(out))
