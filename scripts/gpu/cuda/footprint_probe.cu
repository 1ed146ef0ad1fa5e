// Diagnostic (issue "the whole footprint"): where device memory that no allocation call
// names appears, measured natively. Prints one line per step: the device's free memory
// (cuMemGetInfo) and the change since the previous step, plus return codes.
//
// Build (scripts/gpu/footprint_probe.sh does this):
//   nvcc -O2 -cubin -arch=sm_90 -o /tmp/cb-gpu/big_module.cubin scripts/gpu/cuda/big_module.cu
//   nvcc -O2 -o /tmp/cb-gpu/footprint_probe scripts/gpu/cuda/footprint_probe.cu -lcuda
// Run:   /tmp/cb-gpu/footprint_probe /tmp/cb-gpu/big_module.cubin
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static size_t last_free = 0;
static void step(const char *what, int rc) {
    size_t fr = 0, tot = 0;
    CUresult g = cuMemGetInfo(&fr, &tot);
    long long delta = last_free ? (long long)last_free - (long long)fr : 0;
    printf("%-48s rc=%-4d free=%zu used_delta=%+lld B (%+.1f MiB)%s\n", what, (int)rc, fr, delta,
           delta / 1048576.0, g ? " (getinfo failed)" : "");
    fflush(stdout);
    last_free = fr;
}
static void smi(const char *what) {
    char cmd[256];
    snprintf(cmd, sizeof cmd,
             "echo -n '  nvidia-smi %s: '; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | grep -w %d || echo none",
             what, (int)getpid());
    if (system(cmd)) {}
}

int main(int argc, char **argv) {
    const char *cubin = argc > 1 ? argv[1] : "/tmp/cb-gpu/big_module.cubin";
    CUresult rc = cuInit(0);
    size_t fr = 0, tot = 0;
    CUresult noctx = cuMemGetInfo(&fr, &tot);
    printf("cuInit rc=%d; cuMemGetInfo without a context rc=%d\n", rc, noctx);
    const char *lm = getenv("CUDA_MODULE_LOADING");
    printf("CUDA_MODULE_LOADING=%s\n", lm ? lm : "(unset)");
    CUdevice dev;
    cuDeviceGet(&dev, 0);
    char name[128];
    cuDeviceGetName(name, sizeof name, dev);
    printf("device 0: %s\n", name);
    smi("before the context");
    CUcontext ctx;
    rc = cuDevicePrimaryCtxRetain(&ctx, dev);
    cuCtxSetCurrent(ctx);
    step("primary context retained and current", rc);
    smi("after the context");
    CUmodule mod;
    rc = cuModuleLoad(&mod, cubin);
    step("cuModuleLoad(1 GiB of __device__ globals)", rc);
    smi("after cuModuleLoad");
    CUdeviceptr g;
    size_t gsize;
    rc = cuModuleGetGlobal(&g, &gsize, mod, "big");
    step("cuModuleGetGlobal(big)", rc);
    CUfunction f;
    rc = cuModuleGetFunction(&f, mod, "touch");
    step("cuModuleGetFunction(touch)", rc);
    void **args = NULL;
    rc = cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, 0, args, 0);
    cuCtxSynchronize();
    step("cuLaunchKernel(touch) + sync", rc);
    smi("after the launch");
    rc = cuModuleUnload(mod);
    step("cuModuleUnload", rc);

    CUlibrary lib;
    rc = cuLibraryLoadFromFile(&lib, cubin, 0, 0, 0, 0, 0, 0);
    step("cuLibraryLoadFromFile(same cubin)", rc);
    rc = cuLibraryGetGlobal(&g, &gsize, lib, "big");
    step("cuLibraryGetGlobal(big)", rc);
    CUkernel k;
    rc = cuLibraryGetKernel(&k, lib, "touch");
    step("cuLibraryGetKernel(touch)", rc);
    rc = cuLaunchKernel((CUfunction)k, 1, 1, 1, 32, 1, 1, 0, 0, args, 0);
    cuCtxSynchronize();
    step("cuLaunchKernel(kernel) + sync", rc);
    rc = cuLibraryUnload(lib);
    step("cuLibraryUnload", rc);

    size_t v = 0;
    cuCtxGetLimit(&v, CU_LIMIT_MALLOC_HEAP_SIZE);
    printf("default MALLOC_HEAP_SIZE %zu\n", v);
    rc = cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 2ull << 30);
    step("cuCtxSetLimit(MALLOC_HEAP_SIZE, 2 GiB)", rc);
    rc = cuModuleLoad(&mod, cubin);
    step("cuModuleLoad again", rc);
    rc = cuModuleGetFunction(&f, mod, "heap");
    void **hargs = NULL;
    rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, 0, hargs, 0);
    CUresult s = cuCtxSynchronize();
    step("launch kernel that mallocs 1 GiB + sync", rc ? rc : s);
    smi("after the heap kernel");
    rc = cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 8ull << 20);
    step("cuCtxSetLimit(MALLOC_HEAP_SIZE, 8 MiB) after use", rc);
    cuCtxGetLimit(&v, CU_LIMIT_STACK_SIZE);
    printf("default STACK_SIZE %zu\n", v);
    rc = cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 64 << 10);
    step("cuCtxSetLimit(STACK_SIZE, 64 KiB)", rc);
    rc = cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 1024);
    step("cuCtxSetLimit(STACK_SIZE, 1 KiB)", rc);
    cuCtxGetLimit(&v, CU_LIMIT_PRINTF_FIFO_SIZE);
    printf("default PRINTF_FIFO_SIZE %zu\n", v);
    rc = cuCtxSetLimit(CU_LIMIT_PRINTF_FIFO_SIZE, 256 << 20);
    step("cuCtxSetLimit(PRINTF_FIFO_SIZE, 256 MiB)", rc);
    rc = cuModuleGetFunction(&f, mod, "spill");
    rc = cuLaunchKernel(f, 1024, 1, 1, 256, 1, 1, 0, 0, hargs, 0);
    s = cuCtxSynchronize();
    step("launch a kernel with 64 KiB of local memory", rc ? rc : s);
    cuModuleUnload(mod);
    step("cuModuleUnload", 0);

    CUdevResource sm;
    rc = cuDeviceGetDevResource(dev, &sm, CU_DEV_RESOURCE_TYPE_SM);
    CUdevResourceDesc desc;
    if (!rc) rc = cuDevResourceGenerateDesc(&desc, &sm, 1);
    CUgreenCtx green;
    if (!rc) rc = cuGreenCtxCreate(&green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM);
    step("cuGreenCtxCreate (all SMs)", rc);
    if (!rc) { cuGreenCtxDestroy(green); step("cuGreenCtxDestroy", 0); }

    CUmulticastObjectProp mp;
    memset(&mp, 0, sizeof mp);
    mp.numDevices = 1;
    mp.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t gran = 0;
    rc = cuMulticastGetGranularity(&gran, &mp, CU_MULTICAST_GRANULARITY_RECOMMENDED);
    mp.size = gran ? gran * 64 : (128 << 20);
    CUmemGenericAllocationHandle mh;
    if (!rc) rc = cuMulticastCreate(&mh, &mp);
    step("cuMulticastCreate (64 x granularity)", rc);
    if (!rc) { cuMemRelease(mh); step("cuMemRelease(multicast)", 0); }

#if CUDA_VERSION >= 13000
    CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
    CUmemoryPool p, dp;
    rc = cuMemGetMemPool(&p, &loc, CU_MEM_ALLOCATION_TYPE_PINNED);
    cuDeviceGetDefaultMemPool(&dp, dev);
    printf("cuMemGetMemPool(device 0) rc=%d pool=%p default=%p\n", rc, (void *)p, (void *)dp);
    CUmemLocation hloc = {CU_MEM_LOCATION_TYPE_HOST, 0};
    rc = cuMemGetMemPool(&p, &hloc, CU_MEM_ALLOCATION_TYPE_PINNED);
    printf("cuMemGetMemPool(host) rc=%d pool=%p\n", rc, (void *)p);
#endif
    cuDevicePrimaryCtxRelease(dev);
    return 0;
}
