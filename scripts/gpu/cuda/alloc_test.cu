// cudabudget real-GPU check: the CUDA runtime API, statically linked cudart.
//
// Build:  nvcc -O2 -cudart static -o /tmp/cb-gpu/alloc_test scripts/gpu/cuda/alloc_test.cu
// Run:    /tmp/cb-gpu/alloc_test [FIRST_GIB SECOND_GIB AFTER_GIB]   (default 5 4 4)
//
// Synchronous: cudaMalloc FIRST ok; SECOND more -> cudaErrorMemoryAllocation;
// cudaMemGetInfo; cudaFree; AFTER ok. Stream-ordered: the same with
// cudaMallocAsync/cudaFreeAsync + cudaStreamSynchronize. Then, with the default
// pool's release threshold at max (as PyTorch sets it), FIRST is allocated and
// freed asynchronously (it stays reserved in the pool) and a synchronous
// cudaMalloc of AFTER must still succeed (the pool is trimmed, as the driver
// itself would do). Prints one JSON object on the last stdout line.
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const unsigned long long GiB = 1ull << 30;

static char json[16384];
static size_t jlen = 0;

static void jadd(const char *fmt, const char *key, const char *val) {
    if (jlen >= sizeof(json) - 256) return;
    jlen += (size_t)snprintf(json + jlen, sizeof(json) - jlen, fmt, jlen > 1 ? "," : "", key, val);
}
static void jbool(const char *key, int v) { jadd("%s\"%s\":%s", key, v ? "true" : "false"); }
static void jnum(const char *key, unsigned long long v) {
    char b[32];
    snprintf(b, sizeof b, "%llu", v);
    jadd("%s\"%s\":%s", key, b);
}
static void jstr(const char *key, const char *v) {
    char b[512];
    size_t o = 0;
    for (const char *p = v; *p && o < sizeof(b) - 2; p++) {
        char c = *p;
        if (c == '"' || c == '\\') { b[o++] = '\\'; }
        if ((unsigned char)c < 0x20) c = ' ';
        b[o++] = c;
    }
    b[o] = 0;
    jadd("%s\"%s\":\"%s\"", key, b);
}
static void jerr(const char *key, cudaError_t e) {
    char b[256];
    snprintf(b, sizeof b, "%s (%d)", cudaGetErrorName(e), (int)e);
    jstr(key, b);
}

// nvidia-smi's per-process figure for this pid, without the preload, in MiB; -1 if not listed.
static long smi_mib(void) {
    FILE *f = popen("env -u LD_PRELOAD nvidia-smi --query-compute-apps=pid,used_memory "
                    "--format=csv,noheader,nounits 2>/dev/null", "r");
    if (!f) return -1;
    char line[256];
    long me = (long)getpid(), found = -1, only = -1;
    int rows = 0;
    while (fgets(line, sizeof line, f)) {
        long pid = 0, mib = 0;
        if (sscanf(line, "%ld , %ld", &pid, &mib) == 2) {
            rows++;
            only = mib;
            if (pid == me) found = (found < 0 ? 0 : found) + mib;
        }
    }
    pclose(f);
    if (found < 0 && rows == 1) found = only;  // PID namespace: we are the only process
    return found;
}

static long peak_smi = -1;
static void sample(void) {
    long v = smi_mib();
    if (v > peak_smi) peak_smi = v;
}

int main(int argc, char **argv) {
    unsigned long long first = 5 * GiB, second = 4 * GiB, after = 4 * GiB;
    if (argc == 4) {
        first = (unsigned long long)(atof(argv[1]) * (double)GiB);
        second = (unsigned long long)(atof(argv[2]) * (double)GiB);
        after = (unsigned long long)(atof(argv[3]) * (double)GiB);
    }
    json[jlen++] = '{';
    json[jlen] = 0;
    jstr("case", "cuda_c");
    jnum("pid", (unsigned long long)getpid());
    const char *pre = getenv("LD_PRELOAD");
    jbool("preloaded", pre && strstr(pre, "libcudabudget") != NULL);
    int ok_all = 1;

    cudaError_t e = cudaFree(0);
    jbool("init_ok", e == cudaSuccess);
    if (e != cudaSuccess) {
        jerr("error", e);
        ok_all = 0;
    } else {
        int drv = 0, rt = 0;
        cudaDriverGetVersion(&drv);
        cudaRuntimeGetVersion(&rt);
        jnum("driver_version", (unsigned long long)drv);
        jnum("runtime_version", (unsigned long long)rt);
        size_t fr = 0, tot = 0;
        e = cudaMemGetInfo(&fr, &tot);
        jnum("free_at_start", fr);
        jnum("total_at_start", tot);

        // ---- synchronous ----
        void *a = NULL, *b = NULL, *c = NULL;
        e = cudaMalloc(&a, first);
        jbool("first_ok", e == cudaSuccess);
        if (e != cudaSuccess) { jerr("first_err", e); a = NULL; }
        (void)cudaGetLastError();
        e = cudaMemGetInfo(&fr, &tot);
        if (e == cudaSuccess) { jnum("free", fr); jnum("total", tot); }
        else jerr("meminfo_err", e);
        e = cudaMalloc(&b, second);
        jbool("second_oom", e == cudaErrorMemoryAllocation);
        jerr("second_err", e);
        if (e != cudaSuccess) b = NULL;
        (void)cudaGetLastError();
        sample();
        if (a) cudaFree(a);
        if (b) cudaFree(b);
        e = cudaMalloc(&c, after);
        jbool("after_free_ok", e == cudaSuccess);
        if (e != cudaSuccess) { jerr("after_err", e); c = NULL; }
        (void)cudaGetLastError();
        if (c) cudaFree(c);
        cudaDeviceSynchronize();

        // ---- stream-ordered ----
        cudaStream_t s;
        e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        if (e != cudaSuccess) { jerr("stream_err", e); s = 0; }
        a = b = c = NULL;
        e = cudaMallocAsync(&a, first, s);
        if (e == cudaSuccess) e = cudaStreamSynchronize(s);
        jbool("async_first_ok", e == cudaSuccess);
        if (e != cudaSuccess) { jerr("async_first_err", e); a = NULL; }
        (void)cudaGetLastError();
        e = cudaMallocAsync(&b, second, s);
        if (e == cudaSuccess) {
            cudaError_t e2 = cudaStreamSynchronize(s);
            if (e2 != cudaSuccess) jerr("async_second_sync_err", e2);
        }
        jbool("async_second_oom", e == cudaErrorMemoryAllocation);
        jerr("async_second_err", e);
        if (e != cudaSuccess) b = NULL;
        (void)cudaGetLastError();
        sample();
        if (a) cudaFreeAsync(a, s);
        if (b) cudaFreeAsync(b, s);
        cudaStreamSynchronize(s);
        (void)cudaGetLastError();
        e = cudaMallocAsync(&c, after, s);
        if (e == cudaSuccess) e = cudaStreamSynchronize(s);
        jbool("async_after_free_ok", e == cudaSuccess);
        if (e != cudaSuccess) { jerr("async_after_err", e); c = NULL; }
        (void)cudaGetLastError();
        if (c) cudaFreeAsync(c, s);
        cudaStreamSynchronize(s);

        // ---- synchronous allocation after an async free kept in the pool ----
        cudaMemPool_t pool;
        e = cudaDeviceGetDefaultMemPool(&pool, 0);
        if (e == cudaSuccess) {
            uint64_t thr = UINT64_MAX;
            cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr);
            a = NULL;
            e = cudaMallocAsync(&a, first, s);
            if (e == cudaSuccess) {
                cudaFreeAsync(a, s);
                cudaStreamSynchronize(s);
                uint64_t reserved = 0;
                cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved);
                jnum("pool_reserved_after_free", reserved);
                c = NULL;
                e = cudaMalloc(&c, after);
                jbool("sync_after_async_ok", e == cudaSuccess);
                if (e != cudaSuccess) { jerr("sync_after_async_err", e); c = NULL; }
                (void)cudaGetLastError();
                sample();
                if (c) cudaFree(c);
                cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved);
                jnum("pool_reserved_end", reserved);
            } else {
                jerr("pool_first_err", e);
                (void)cudaGetLastError();
            }
            thr = 0;
            cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr);
            cudaMemPoolTrimTo(pool, 0);
        } else {
            jerr("pool_err", e);
            (void)cudaGetLastError();
        }
        if (s) cudaStreamDestroy(s);
    }
    if (peak_smi >= 0) jnum("smi_mib", (unsigned long long)peak_smi);
    else jadd("%s\"%s\":%s", "smi_mib", "null");
    jbool("ran_to_end", ok_all);
    if (jlen < sizeof(json) - 2) { json[jlen++] = '}'; json[jlen] = 0; }
    printf("\n%s\n", json);
    fflush(stdout);
    return 0;
}
