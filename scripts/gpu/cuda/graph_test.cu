// cudabudget real-GPU checks "no escape, no harm": CUDA graphs, impossible sizes,
// a primary-context reset beside a created context, a stream of another device.
//
// Build:  nvcc -O2 -cudart static -o /tmp/cb-gpu/graph_test scripts/gpu/cuda/graph_test.cu -lcuda
// Run:    /tmp/cb-gpu/graph_test MODE        (run_all.sh runs each mode natively and under a 4 GiB budget)
//
// Modes (sizes are fixed; see scripts/gpu/README.md for what must hold):
//   fit         capture on a non-blocking stream (cudaStreamCaptureModeGlobal): cudaMallocAsync 1 GiB,
//               a kernel writing it, a kernel summing it, a memcpy of the sum to pinned host memory,
//               cudaFreeAsync; instantiate, upload, launch 3 times. Every return code and checksum.
//   cross       the same capture with a 6 GiB allocation (no sum), then a graph built by hand with a
//               6 GiB cudaGraphAddMemAllocNode + memset node (first 64 MiB) + free node: instantiate,
//               upload, launch (each graph's memory trimmed after it); then a captured 1 GiB graph
//               (with the checksum, 2 launches) must still work.
//   impossible  cudaMallocAsync((size_t)-1) and (1 << 62), then four cudaMallocAsync of 3 GiB on one
//               stream without freeing (synchronised after each); then free and 3 GiB once more.
//   reset       driver API: cuCtxCreate on device 0, cuMemAlloc 2.5 GiB there, cuDevicePrimaryCtxReset(0)
//               (the primary was never activated), cuMemAlloc 2.5 GiB more in the created context; the
//               first block must still be usable (cuMemsetD8).
//   twodev      (needs 2 visible devices) device 0 current, a stream created on device 1: cudaMallocAsync
//               3 GiB twice on that stream; then cudaMalloc 3 GiB on device 0. nvidia-smi per device.
//
// Prints one JSON object on the last stdout line; the facts so far are also written to $CB_PARTIAL
// at each step, so a crash or a hang (killed by the runner's timeout) still leaves them.
#include <cuda.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

static const unsigned long long GiB = 1ull << 30;
static const unsigned int SEED = 12345u;

// ------------------------------------------------------------------ JSON writer
static char json[32768];
static size_t jlen = 0;

static void jraw(const char *key, const char *val) {
    size_t room = sizeof(json) - jlen;
    if (room < 1200) return;  // keep room for the closing brace; drop the rest
    int n = snprintf(json + jlen, room, "%s\"%s\":%s", jlen > 1 ? "," : "", key, val);
    if (n < 0) return;
    if ((size_t)n >= room) n = (int)(room - 1);
    jlen += (size_t)n;
}
static void jbool(const char *key, int v) { jraw(key, v ? "true" : "false"); }
static void jnull(const char *key) { jraw(key, "null"); }
static void jnum(const char *key, unsigned long long v) {
    char b[32];
    snprintf(b, sizeof b, "%llu", v);
    jraw(key, b);
}
static void jint(const char *key, long long v) {
    char b[32];
    snprintf(b, sizeof b, "%lld", v);
    jraw(key, b);
}
static void jstr(const char *key, const char *v) {
    char b[700];
    size_t o = 0;
    b[o++] = '"';
    for (const char *p = v ? v : ""; *p && o < sizeof(b) - 4; p++) {
        char c = *p;
        if (c == '"' || c == '\\') b[o++] = '\\';
        if ((unsigned char)c < 0x20) c = ' ';
        b[o++] = c;
    }
    b[o++] = '"';
    b[o] = 0;
    jraw(key, b);
}
static const char *rt_name(cudaError_t e) {
    const char *s = cudaGetErrorName(e);
    return s ? s : "cudaError?";
}
// "<key>": "cudaErrorName (n)"
static void jcuda(const char *key, cudaError_t e) {
    char b[160];
    snprintf(b, sizeof b, "%s (%d)", rt_name(e), (int)e);
    jstr(key, b);
}
static const char *drv_name(CUresult r) {
    const char *s = NULL;
    if (cuGetErrorName(r, &s) != CUDA_SUCCESS || s == NULL) return "CUDA_ERROR_?";
    return s;
}
static void jcu(const char *key, CUresult r) {
    char b[160];
    snprintf(b, sizeof b, "%s (%d)", drv_name(r), (int)r);
    jstr(key, b);
}
static void kcat(char *out, size_t n, const char *a, const char *b) { snprintf(out, n, "%s_%s", a, b); }

// The JSON so far, closed, to $CB_PARTIAL (best effort).
static void checkpoint(void) {
    const char *path = getenv("CB_PARTIAL");
    if (!path || !*path) return;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fwrite(json, 1, jlen, f);
    fputs("}\n", f);
    fclose(f);
    rename(tmp, path);
}

// ------------------------------------------------------------------ nvidia-smi
// Lower-case "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" of a runtime device, "" if unknown.
static void device_uuid(int dev, char *out, size_t n) {
    out[0] = 0;
    cudaDeviceProp prop;
    memset(&prop, 0, sizeof prop);
    if (cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    const unsigned char *u = (const unsigned char *)prop.uuid.bytes;
    snprintf(out, n, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2],
             u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

// nvidia-smi's per-process figure (MiB) for this pid, without the preload; only rows of GPU `uuid`
// when it is non-empty. -1 if not listed. In a PID namespace (our pid not listed) and exactly one
// matching row, that row is used.
static long smi_mib(const char *uuid) {
    FILE *f = popen("env -u LD_PRELOAD timeout 20 nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid "
                    "--format=csv,noheader,nounits 2>/dev/null",
                    "r");
    if (!f) return -1;
    char line[512];
    long me = (long)getpid(), found = -1, only = -1;
    int rows = 0;
    while (fgets(line, sizeof line, f)) {
        long pid = 0, mib = 0;
        char u[160];
        u[0] = 0;
        int k = sscanf(line, "%ld , %ld , %159s", &pid, &mib, u);
        if (k < 2) continue;
        if (uuid && *uuid && k == 3 && strcasecmp(u, uuid) != 0) continue;
        rows++;
        only = mib;
        if (pid == me) found = (found < 0 ? 0 : found) + mib;
    }
    pclose(f);
    if (found < 0 && rows == 1) found = only;
    return found;
}

static long peak_smi = -1;
static void sample(void) {
    long v = smi_mib(NULL);
    if (v > peak_smi) peak_smi = v;
}

// ------------------------------------------------------------------ kernels
__global__ void fill_kernel(unsigned int *p, size_t n, unsigned int seed) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (; i < n; i += stride) p[i] = (unsigned int)i * 2654435761u + seed;
}

__global__ void sum_kernel(const unsigned int *p, size_t n, unsigned long long *out) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    unsigned long long acc = 0;
    for (; i < n; i += stride) acc += p[i];
    atomicAdd(out, acc);
}

static unsigned long long expected_sum(size_t n, unsigned int seed) {
    unsigned long long acc = 0;
    for (size_t i = 0; i < n; i++) acc += (unsigned int)((unsigned int)i * 2654435761u + seed);
    return acc;
}

static const int BLOCKS = 1024, THREADS = 256;

// Run both kernels once, eagerly, on a small buffer: the module is loaded before any capture.
static cudaError_t warm_up(cudaStream_t s, unsigned long long *dsum) {
    void *w = NULL;
    cudaError_t e = cudaMalloc(&w, 4096 * sizeof(unsigned int));
    if (e != cudaSuccess) return e;
    fill_kernel<<<4, THREADS, 0, s>>>((unsigned int *)w, 4096, SEED);
    e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaMemsetAsync(dsum, 0, sizeof(unsigned long long), s);
    if (e == cudaSuccess) {
        sum_kernel<<<4, THREADS, 0, s>>>((const unsigned int *)w, 4096, dsum);
        e = cudaGetLastError();
    }
    cudaError_t e2 = cudaStreamSynchronize(s);
    if (e == cudaSuccess) e = e2;
    cudaFree(w);
    return e;
}

// Return codes of one graph's life, as "step=cudaXxx,..." (compared with the native run verbatim).
struct Steps {
    char text[1024];
    size_t len;
    cudaError_t first_err;  // first failing step's error, cudaSuccess if none
    char first_step[32];
};
static void steps_init(Steps *st) {
    st->text[0] = 0;
    st->len = 0;
    st->first_err = cudaSuccess;
    st->first_step[0] = 0;
}
static cudaError_t step(Steps *st, const char *name, cudaError_t e) {
    if (st->len < sizeof(st->text) - 80) {
        int n = snprintf(st->text + st->len, sizeof(st->text) - st->len, "%s%s=%s", st->len ? "," : "", name,
                         rt_name(e));
        if (n > 0) st->len += (size_t)n;
        if (st->len >= sizeof(st->text)) st->len = sizeof(st->text) - 1;
    }
    if (e != cudaSuccess && st->first_err == cudaSuccess) {
        st->first_err = e;
        snprintf(st->first_step, sizeof st->first_step, "%s", name);
    }
    return e;
}

// Capture on s, in global mode: cudaMallocAsync(bytes), fill, [memset dsum, sum, memcpy dsum -> hsum],
// cudaFreeAsync. Returns the graph (NULL on failure); the capture is always ended once begun.
static cudaGraph_t capture(cudaStream_t s, size_t bytes, int with_sum, unsigned long long *dsum,
                           unsigned long long *hsum, Steps *st) {
    cudaError_t e = step(st, "begin_capture", cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    void *buf = NULL;
    e = step(st, "malloc_async", cudaMallocAsync(&buf, bytes, s));
    if (e == cudaSuccess) {
        size_t n = bytes / sizeof(unsigned int);
        fill_kernel<<<BLOCKS, THREADS, 0, s>>>((unsigned int *)buf, n, SEED);
        e = step(st, "fill_kernel", cudaGetLastError());
        if (e == cudaSuccess && with_sum) {
            e = step(st, "memset", cudaMemsetAsync(dsum, 0, sizeof(unsigned long long), s));
            if (e == cudaSuccess) {
                sum_kernel<<<BLOCKS, THREADS, 0, s>>>((const unsigned int *)buf, n, dsum);
                e = step(st, "sum_kernel", cudaGetLastError());
            }
            if (e == cudaSuccess)
                e = step(st, "memcpy_d2h",
                         cudaMemcpyAsync(hsum, dsum, sizeof(unsigned long long), cudaMemcpyDeviceToHost, s));
        }
        cudaError_t ef = step(st, "free_async", cudaFreeAsync(buf, s));
        if (e == cudaSuccess) e = ef;
    }
    cudaGraph_t g = NULL;
    cudaError_t ee = step(st, "end_capture", cudaStreamEndCapture(s, &g));
    (void)cudaGetLastError();
    if (e != cudaSuccess || ee != cudaSuccess) {
        if (g) cudaGraphDestroy(g);
        return NULL;
    }
    return g;
}

static void graph_mem(const char *prefix) {
    char k[96];
    unsigned long long v = 0;  // the attributes' value type
    unsigned long long used = 0, reserved = 0;
    if (cudaDeviceGetGraphMemAttribute(0, cudaGraphMemAttrUsedMemCurrent, &v) == cudaSuccess) used = v;
    v = 0;
    if (cudaDeviceGetGraphMemAttribute(0, cudaGraphMemAttrReservedMemCurrent, &v) == cudaSuccess) reserved = v;
    (void)cudaGetLastError();
    kcat(k, sizeof k, prefix, "graph_mem_used");
    jnum(k, used);
    kcat(k, sizeof k, prefix, "graph_mem_reserved");
    jnum(k, reserved);
}

// Common setup of the runtime modes: a non-blocking stream, 8 device bytes for the sum, 8 pinned
// host bytes for its copy, kernels warmed up.
struct Env {
    cudaStream_t s;
    unsigned long long *dsum;
    unsigned long long *hsum;
};
static int setup(Env *env) {
    env->s = NULL;
    env->dsum = NULL;
    env->hsum = NULL;
    cudaError_t e = cudaStreamCreateWithFlags(&env->s, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        jcuda("setup_err", e);
        jstr("error", "cudaStreamCreateWithFlags failed");
        return 0;
    }
    void *d = NULL, *h = NULL;
    e = cudaMalloc(&d, sizeof(unsigned long long));
    if (e == cudaSuccess) e = cudaMallocHost(&h, sizeof(unsigned long long));
    if (e != cudaSuccess) {
        jcuda("setup_err", e);
        jstr("error", "cudaMalloc/cudaMallocHost of 8 bytes failed");
        return 0;
    }
    env->dsum = (unsigned long long *)d;
    env->hsum = (unsigned long long *)h;
    e = warm_up(env->s, env->dsum);
    jbool("warm_up_ok", e == cudaSuccess);
    if (e != cudaSuccess) {
        jcuda("setup_err", e);
        jstr("error", "kernel warm-up failed");
        return 0;
    }
    return 1;
}
static void teardown(Env *env) {
    if (env->s) cudaStreamSynchronize(env->s);
    if (env->dsum) cudaFree(env->dsum);
    if (env->hsum) cudaFreeHost(env->hsum);
    if (env->s) cudaStreamDestroy(env->s);
    (void)cudaGetLastError();
}

// Instantiate, upload, then launch `launches` times (each synchronised). Records "<prefix>_rcs",
// "<prefix>_checksums" (with_sum), and the booleans the judge reads. Returns 1 if every step
// succeeded and every checksum matched.
static int run_graph(const char *prefix, cudaGraph_t g, Steps *st, Env *env, int launches, int with_sum,
                     unsigned long long expect) {
    char k[96];
    cudaGraphExec_t x = NULL;
    int ok = (g != NULL);
    cudaError_t inst = cudaErrorUnknown, up = cudaErrorUnknown, upsync = cudaErrorUnknown;
    cudaError_t first_launch = cudaErrorUnknown, first_sync = cudaErrorUnknown;
    char sums[512];
    size_t sl = 0;
    sums[sl++] = '[';
    sums[sl] = 0;
    int sums_ok = 1;
    if (g) {
        inst = step(st, "instantiate", cudaGraphInstantiateWithFlags(&x, g, 0));
        if (inst != cudaSuccess) {
            x = NULL;
            ok = 0;
            (void)cudaGetLastError();
        }
    }
    if (x) {
        up = step(st, "upload", cudaGraphUpload(x, env->s));
        upsync = step(st, "upload_sync", cudaStreamSynchronize(env->s));
        (void)cudaGetLastError();
        if (up != cudaSuccess || upsync != cudaSuccess) ok = 0;
        sample();
        for (int i = 0; i < launches; i++) {
            if (with_sum) *(volatile unsigned long long *)env->hsum = 0;
            cudaError_t el = step(st, "launch", cudaGraphLaunch(x, env->s));
            cudaError_t es = step(st, "sync", cudaStreamSynchronize(env->s));
            (void)cudaGetLastError();
            if (i == 0) {
                first_launch = el;
                first_sync = es;
            }
            if (el != cudaSuccess || es != cudaSuccess) ok = 0;
            if (with_sum) {
                unsigned long long v = *(volatile unsigned long long *)env->hsum;
                if (sl < sizeof(sums) - 40) {
                    int n = snprintf(sums + sl, sizeof(sums) - sl, "%s%llu", i ? "," : "", v);
                    if (n > 0) sl += (size_t)n;
                }
                if (el != cudaSuccess || es != cudaSuccess || v != expect) sums_ok = 0;
            }
        }
        sample();
        graph_mem(prefix);
        cudaGraphExecDestroy(x);
    }
    if (g) cudaGraphDestroy(g);
    cudaStreamSynchronize(env->s);
    cudaDeviceGraphMemTrim(0);
    (void)cudaGetLastError();
    if (sl < sizeof(sums) - 2) {
        sums[sl++] = ']';
        sums[sl] = 0;
    } else {
        snprintf(sums, sizeof sums, "[]");
    }

    kcat(k, sizeof k, prefix, "rcs");
    jstr(k, st->text);
    kcat(k, sizeof k, prefix, "first_failed_step");
    if (st->first_step[0]) jstr(k, st->first_step); else jnull(k);
    kcat(k, sizeof k, prefix, "first_err");
    jcuda(k, st->first_err);
    kcat(k, sizeof k, prefix, "built_ok");  // captured (or built) and instantiated
    jbool(k, g != NULL && inst == cudaSuccess);
    kcat(k, sizeof k, prefix, "upload_err");
    jcuda(k, up);
    kcat(k, sizeof k, prefix, "upload_oom");
    jbool(k, x != NULL && (up == cudaErrorMemoryAllocation || (up == cudaSuccess && upsync == cudaErrorMemoryAllocation)));
    kcat(k, sizeof k, prefix, "launch_err");
    jcuda(k, first_launch != cudaSuccess ? first_launch : first_sync);
    kcat(k, sizeof k, prefix, "launch_oom");
    jbool(k, x != NULL && (first_launch == cudaErrorMemoryAllocation ||
                           (first_launch == cudaSuccess && first_sync == cudaErrorMemoryAllocation)));
    if (with_sum) {
        kcat(k, sizeof k, prefix, "checksums");
        jraw(k, sums);
        kcat(k, sizeof k, prefix, "expected");
        jnum(k, expect);
    }
    int all = ok && (!with_sum || sums_ok);
    kcat(k, sizeof k, prefix, "ok");
    jbool(k, all);
    checkpoint();
    return all;
}

// ------------------------------------------------------------------ modes
static void mode_fit(void) {
    Env env;
    if (!setup(&env)) return;
    size_t bytes = (size_t)GiB;
    unsigned long long expect = expected_sum(bytes / sizeof(unsigned int), SEED);
    Steps st;
    steps_init(&st);
    cudaGraph_t g = capture(env.s, bytes, 1, env.dsum, env.hsum, &st);
    jbool("fit_captured", g != NULL);
    run_graph("fit", g, &st, &env, 3, 1, expect);
    teardown(&env);
}

// A graph built node by node: alloc node (bytes) -> memset node (its first 64 MiB) -> free node.
// The whole allocation is backed when the graph is uploaded or launched, used or not.
static cudaGraph_t build_node_graph(size_t bytes, Steps *st) {
    cudaGraph_t g = NULL;
    if (step(st, "graph_create", cudaGraphCreate(&g, 0)) != cudaSuccess) return NULL;
    cudaMemAllocNodeParams ap;
    memset(&ap, 0, sizeof ap);
    ap.poolProps.allocType = cudaMemAllocationTypePinned;
    ap.poolProps.handleTypes = cudaMemHandleTypeNone;
    ap.poolProps.location.type = cudaMemLocationTypeDevice;
    ap.poolProps.location.id = 0;
    ap.accessDescs = NULL;
    ap.accessDescCount = 0;
    ap.bytesize = bytes;
    cudaGraphNode_t na = NULL, nm = NULL, nf = NULL;
    cudaError_t e = step(st, "add_alloc_node", cudaGraphAddMemAllocNode(&na, g, NULL, 0, &ap));
    if (e == cudaSuccess) {
        cudaMemsetParams mp;
        memset(&mp, 0, sizeof mp);
        mp.dst = ap.dptr;
        mp.pitch = 0;
        mp.value = 0x01010101u;
        mp.elementSize = 4;
        mp.width = (bytes < (64ull << 20) ? bytes : (64ull << 20)) / 4;  // touch the first 64 MiB
        mp.height = 1;
        e = step(st, "add_memset_node", cudaGraphAddMemsetNode(&nm, g, &na, 1, &mp));
        if (e == cudaSuccess) e = step(st, "add_free_node", cudaGraphAddMemFreeNode(&nf, g, &nm, 1, ap.dptr));
    }
    (void)cudaGetLastError();
    if (e != cudaSuccess) {
        cudaGraphDestroy(g);
        return NULL;
    }
    return g;
}

static void mode_cross(void) {
    Env env;
    if (!setup(&env)) return;
    size_t big = 6 * (size_t)GiB, small = (size_t)GiB;

    Steps st;
    steps_init(&st);
    cudaGraph_t g = capture(env.s, big, 0, env.dsum, env.hsum, &st);
    jbool("cap6_captured", g != NULL);
    run_graph("cap6", g, &st, &env, 1, 0, 0);

    steps_init(&st);
    g = build_node_graph(big, &st);
    jbool("node6_built", g != NULL);
    run_graph("node6", g, &st, &env, 1, 0, 0);

    unsigned long long expect = expected_sum(small / sizeof(unsigned int), SEED);
    steps_init(&st);
    g = capture(env.s, small, 1, env.dsum, env.hsum, &st);
    run_graph("after1", g, &st, &env, 2, 1, expect);
    teardown(&env);
}

static const char *tok(cudaError_t e, char *buf, size_t n) {
    if (e == cudaSuccess) return "ok";
    if (e == cudaErrorMemoryAllocation) return "oom";
    snprintf(buf, n, "%s", rt_name(e));
    return buf;
}

// One stream-ordered allocation, synchronised; a success is freed again when free_it.
static cudaError_t async_try(cudaStream_t s, size_t bytes, void **out, int free_it) {
    void *p = NULL;
    cudaError_t e = cudaMallocAsync(&p, bytes, s);
    if (e == cudaSuccess) {
        e = cudaStreamSynchronize(s);
        if (e != cudaSuccess) p = NULL;
    } else {
        p = NULL;
    }
    (void)cudaGetLastError();
    if (p && free_it) {
        cudaFreeAsync(p, s);
        cudaStreamSynchronize(s);
        (void)cudaGetLastError();
        p = NULL;
    }
    if (out) *out = p;
    return e;
}

static void mode_impossible(void) {
    Env env;
    if (!setup(&env)) return;
    cudaError_t e = async_try(env.s, (size_t)-1, NULL, 1);
    jbool("huge_max_failed", e != cudaSuccess);
    jcuda("huge_max_err", e);
    e = async_try(env.s, (size_t)(1ull << 62), NULL, 1);
    jbool("huge_2p62_failed", e != cudaSuccess);
    jcuda("huge_2p62_err", e);
    checkpoint();

    void *p[4] = {NULL, NULL, NULL, NULL};
    char pattern[256], b[96];
    size_t pl = 0;
    pattern[0] = 0;
    for (int i = 0; i < 4; i++) {
        e = async_try(env.s, 3 * (size_t)GiB, &p[i], 0);
        int n = snprintf(pattern + pl, sizeof(pattern) - pl, "%s%s", i ? "," : "", tok(e, b, sizeof b));
        if (n > 0 && (size_t)n < sizeof(pattern) - pl) pl += (size_t)n;
        char k[32];
        snprintf(k, sizeof k, "async3_%d_err", i + 1);
        jcuda(k, e);
        checkpoint();
    }
    jstr("async3_pattern", pattern);
    sample();
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) {
        jnum("free_at_peak", fr);
        jnum("total", tot);
    }
    (void)cudaGetLastError();
    for (int i = 0; i < 4; i++)
        if (p[i]) cudaFreeAsync(p[i], env.s);
    cudaStreamSynchronize(env.s);
    (void)cudaGetLastError();
    e = async_try(env.s, 3 * (size_t)GiB, NULL, 1);
    jbool("after_free_3GiB_ok", e == cudaSuccess);
    jcuda("after_free_3GiB_err", e);
    teardown(&env);
}

static void mode_reset(void) {
    // Driver API only: the runtime is never initialised in this mode.
    CUresult r = cuInit(0);
    jcu("cuInit", r);
    CUdevice dev = 0;
    if (r == CUDA_SUCCESS) r = cuDeviceGet(&dev, 0);
    CUcontext ctx = NULL;
    if (r == CUDA_SUCCESS) {
#if CUDA_VERSION >= 13000
        r = cuCtxCreate(&ctx, NULL, 0, dev);  // CUDA 13: (pctx, CUctxCreateParams*, flags, dev)
#else
        r = cuCtxCreate(&ctx, 0, dev);
#endif
    }
    jcu("ctx_create", r);
    jbool("ctx_ok", r == CUDA_SUCCESS);
    if (r != CUDA_SUCCESS) {
        jstr("error", "cuInit/cuDeviceGet/cuCtxCreate failed");
        return;
    }
    size_t sz = (size_t)5 << 29;  // 2.5 GiB
    CUdeviceptr p1 = 0, p2 = 0;
    r = cuMemAlloc(&p1, sz);
    jbool("first_ok", r == CUDA_SUCCESS);
    jcu("first_err", r);
    if (r != CUDA_SUCCESS) p1 = 0;
    sample();
    unsigned int pflags = 0;
    int active = -1;
    r = cuDevicePrimaryCtxGetState(dev, &pflags, &active);
    jint("primary_active_before_reset", r == CUDA_SUCCESS ? active : -1);
    r = cuDevicePrimaryCtxReset(dev);
    jcu("primary_reset", r);
    r = cuCtxSetCurrent(ctx);
    jcu("set_current", r);
    size_t fr = 0, tot = 0;
    r = cuMemGetInfo(&fr, &tot);
    if (r == CUDA_SUCCESS) {
        jnum("free_after_reset", fr);
        jnum("total_after_reset", tot);
    }
    checkpoint();
    r = cuMemAlloc(&p2, sz);
    jbool("second_oom", r == CUDA_ERROR_OUT_OF_MEMORY);
    jcu("second_err", r);
    if (r != CUDA_SUCCESS) p2 = 0;
    sample();
    checkpoint();
    if (p1) {
        r = cuMemsetD8(p1, 0x5a, sz);
        CUresult r2 = cuCtxSynchronize();
        jbool("first_still_usable", r == CUDA_SUCCESS && r2 == CUDA_SUCCESS);
        jcu("first_memset", r != CUDA_SUCCESS ? r : r2);
    } else {
        jbool("first_still_usable", 0);
    }
    if (p2) cuMemFree(p2);
    if (p1) cuMemFree(p1);
    r = cuCtxDestroy(ctx);
    jcu("ctx_destroy", r);
}

static void mode_twodev(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    jnum("device_count", e == cudaSuccess ? (unsigned long long)n : 0ull);
    if (e != cudaSuccess || n < 2) {
        jstr("skip", "fewer than 2 visible devices");
        return;
    }
    char u0[64], u1[64];
    device_uuid(0, u0, sizeof u0);
    device_uuid(1, u1, sizeof u1);
    jstr("uuid0", u0);
    jstr("uuid1", u1);
    cudaStream_t s1 = NULL;
    e = cudaSetDevice(1);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
    cudaError_t e0 = cudaSetDevice(0);
    if (e == cudaSuccess) e = e0;
    jcuda("stream1_err", e);
    if (e != cudaSuccess) {
        jstr("error", "could not create a stream on device 1");
        return;
    }
    int cur = -1;
    cudaGetDevice(&cur);
    jint("current_device", cur);

    void *a = NULL, *b = NULL, *c = NULL;
    e = async_try(s1, 3 * (size_t)GiB, &a, 0);
    jbool("first_ok", e == cudaSuccess);
    jcuda("first_err", e);
    if (a) {
        cudaPointerAttributes attr;
        memset(&attr, 0, sizeof attr);
        if (cudaPointerGetAttributes(&attr, a) == cudaSuccess) jint("first_ptr_device", attr.device);
        (void)cudaGetLastError();
    }
    checkpoint();
    e = async_try(s1, 3 * (size_t)GiB, &b, 0);
    jbool("second_oom", e == cudaErrorMemoryAllocation);
    jcuda("second_err", e);
    checkpoint();
    long m1 = smi_mib(u1), m0 = smi_mib(u0);
    e = cudaMalloc(&c, 3 * (size_t)GiB);  // device 0 is current
    jbool("dev0_3GiB_ok", e == cudaSuccess);
    jcuda("dev0_3GiB_err", e);
    if (e != cudaSuccess) c = NULL;
    (void)cudaGetLastError();
    long m1b = smi_mib(u1), m0b = smi_mib(u0);
    if (m1b > m1) m1 = m1b;
    if (m0b > m0) m0 = m0b;
    if (m0 >= 0) jnum("smi0_mib", (unsigned long long)m0); else jnull("smi0_mib");
    if (m1 >= 0) jnum("smi1_mib", (unsigned long long)m1); else jnull("smi1_mib");
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) jnum("dev0_total", tot);
    if (cudaSetDevice(1) == cudaSuccess && cudaMemGetInfo(&fr, &tot) == cudaSuccess) jnum("dev1_total", tot);
    cudaSetDevice(0);
    (void)cudaGetLastError();
    if (a) cudaFreeAsync(a, s1);
    if (b) cudaFreeAsync(b, s1);
    cudaStreamSynchronize(s1);
    if (c) cudaFree(c);
    cudaStreamDestroy(s1);
    (void)cudaGetLastError();
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    json[jlen++] = '{';
    json[jlen] = 0;
    jstr("case", "graph_test");
    jstr("mode", mode);
    jnum("pid", (unsigned long long)getpid());
    const char *pre = getenv("LD_PRELOAD");
    jbool("preloaded", pre && strstr(pre, "libcudabudget") != NULL);
    jnum("cuda_version_header", (unsigned long long)CUDA_VERSION);
    checkpoint();

    int known = !strcmp(mode, "fit") || !strcmp(mode, "cross") || !strcmp(mode, "impossible") ||
                !strcmp(mode, "reset") || !strcmp(mode, "twodev");
    if (!known) {
        jstr("error", "usage: graph_test fit|cross|impossible|reset|twodev");
    } else if (!strcmp(mode, "reset")) {
        mode_reset();
    } else {
        cudaError_t e = cudaSetDevice(0);
        if (e == cudaSuccess) e = cudaFree(0);
        jbool("init_ok", e == cudaSuccess);
        if (e != cudaSuccess) {
            jcuda("init_err", e);
            jstr("error", "CUDA runtime initialisation failed");
        } else {
            int drv = 0, rt = 0;
            cudaDriverGetVersion(&drv);
            cudaRuntimeGetVersion(&rt);
            jnum("driver_version", (unsigned long long)drv);
            jnum("runtime_version", (unsigned long long)rt);
            checkpoint();
            if (!strcmp(mode, "fit")) mode_fit();
            else if (!strcmp(mode, "cross")) mode_cross();
            else if (!strcmp(mode, "impossible")) mode_impossible();
            else mode_twodev();
        }
    }
    if (strcmp(mode, "twodev") != 0) {
        if (peak_smi >= 0) jnum("smi_mib", (unsigned long long)peak_smi);
        else jnull("smi_mib");
    }
    jbool("ran_to_end", 1);
    checkpoint();
    if (jlen < sizeof(json) - 2) {
        json[jlen++] = '}';
        json[jlen] = 0;
    }
    printf("\n%s\n", json);
    fflush(stdout);
    return 0;
}
