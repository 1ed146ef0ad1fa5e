// N allocation/free pairs and nothing else, for counting instructions (cargo bench runs
// it under callgrind when valgrind is there). Resolves like cudarc's users and cudart do:
// dlsym on libcuda.so.1 for the hooks; glibc's real dlsym for the driver's own functions.
//
// Usage: pair_loop hook|driver async|sync N [evict]
// evict: read 4 MiB before each call, so that the hooks find none of their data in cache
// (BENCHMARKS.md, "Cache lines": a model of the real driver's work between two calls).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*alloc_async_fn)(unsigned long long *, size_t, void *);
typedef int (*free_async_fn)(unsigned long long, void *);
typedef int (*alloc_fn)(unsigned long long *, size_t);
typedef int (*free_fn)(unsigned long long);
typedef void *(*dlsym_fn)(void *, const char *);

enum { SWEEP = 4 << 20 };
static volatile unsigned char *sweep;

// Reads a byte of every 64 of `sweep`.
static void evict(void) {
    for (long j = 0; j < SWEEP; j += 64) (void)sweep[j];
}

int main(int argc, char **argv) {
    if (argc != 4 && !(argc == 5 && !strcmp(argv[4], "evict"))) {
        fprintf(stderr, "usage: pair_loop hook|driver async|sync N [evict]\n");
        return 2;
    }
    if (argc == 5) {
        unsigned char *s = malloc(SWEEP);
        if (!s) return 2;
        memset(s, 1, SWEEP);
        sweep = s;
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) return 3;
    dlsym_fn look = (dlsym_fn)dlsym;
    if (!strcmp(argv[1], "driver")) {
        look = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!look) look = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
        if (!look) return 3;
    }
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(lib, "cuInit");
    int (*dev_get)(int *, int) = (int (*)(int *, int))dlsym(lib, "cuDeviceGet");
    int (*retain)(void **, int) = (int (*)(void **, int))dlsym(lib, "cuDevicePrimaryCtxRetain");
    int (*set_current)(void *) = (int (*)(void *))dlsym(lib, "cuCtxSetCurrent");
    int dev;
    void *ctx;
    if (!init || !dev_get || !retain || !set_current || init(0) || dev_get(&dev, 0) || retain(&ctx, dev) ||
        set_current(ctx))
        return 4;
    long n = atol(argv[3]);
    unsigned long long p;
    if (!strcmp(argv[2], "async")) {
        alloc_async_fn a = (alloc_async_fn)look(lib, "cuMemAllocAsync");
        free_async_fn f = (free_async_fn)look(lib, "cuMemFreeAsync");
        if (!a || !f) return 5;
        if (sweep) {
            for (long i = 0; i < n; i++)
                if ((evict(), a(&p, 4096, NULL)) || (evict(), f(p, NULL))) return 6;
        } else {
            for (long i = 0; i < n; i++)
                if (a(&p, 4096, NULL) || f(p, NULL)) return 6;
        }
    } else {
        alloc_fn a = (alloc_fn)look(lib, "cuMemAlloc_v2");
        free_fn f = (free_fn)look(lib, "cuMemFree_v2");
        if (!a || !f) return 5;
        if (sweep) {
            for (long i = 0; i < n; i++)
                if ((evict(), a(&p, 4096)) || (evict(), f(p))) return 6;
        } else {
            for (long i = 0; i < n; i++)
                if (a(&p, 4096) || f(p)) return 6;
        }
    }
    return 0;
}
