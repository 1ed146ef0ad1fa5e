/* Executor of the property test (tests/property.rs): reads cases (programs of driver calls
 * for 1-4 threads) from stdin, runs each case's threads concurrently, samples the fake
 * driver's device memory after every op, then frees everything and reports what the
 * process holds and what cuMemGetInfo says. Usage: prop_client MODE  (gpa | gpa-ptsz |
 * dlsym). The input and output formats are in README.md ("Property executor"). */
#define _GNU_SOURCE
#include "fake_cuda_api.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef unsigned long long u64;

#define PROP_FUNCS(X)                                                            \
    X(cuInit, "cuInit", 0)                                                       \
    X(cuDeviceGet, "cuDeviceGet", 0)                                             \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 0)                   \
    X(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 0)              \
    X(cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", 0)                  \
    X(cuCtxSetCurrent, "cuCtxSetCurrent", 0)                                     \
    X(cuCtxGetDevice, "cuCtxGetDevice", 0)                                       \
    X(cuCtxGetCurrent, "cuCtxGetCurrent", 0)                                     \
    X(cuCtxCreate_v4, "cuCtxCreate", 12050)                                      \
    X(cuCtxDestroy_v2, "cuCtxDestroy", 0)                                        \
    X(cuCtxPopCurrent_v2, "cuCtxPopCurrent", 0)                                  \
    X(cuCtxSynchronize, "cuCtxSynchronize", 0)                                   \
    X(cuCtxGetLimit, "cuCtxGetLimit", 0)                                         \
    X(cuCtxSetLimit, "cuCtxSetLimit", 0)                                         \
    X(cuMemAlloc_v2, "cuMemAlloc", 0)                                            \
    X(cuMemAllocPitch_v2, "cuMemAllocPitch", 0)                                  \
    X(cuMemAllocManaged, "cuMemAllocManaged", 0)                                 \
    X(cuMemFree_v2, "cuMemFree", 0)                                              \
    X(cuMemGetInfo_v2, "cuMemGetInfo", 0)                                        \
    X(cuMemAllocAsync, "cuMemAllocAsync", 0)                                     \
    X(cuMemFreeAsync, "cuMemFreeAsync", 0)                                       \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 0)                     \
    X(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", 0)                 \
    X(cuDeviceSetMemPool, "cuDeviceSetMemPool", 0)                               \
    X(cuMemPoolCreate, "cuMemPoolCreate", 0)                                     \
    X(cuMemPoolDestroy, "cuMemPoolDestroy", 0)                                   \
    X(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", 0)                         \
    X(cuMemPoolGetAttribute, "cuMemPoolGetAttribute", 0)                         \
    X(cuMemPoolTrimTo, "cuMemPoolTrimTo", 0)                                     \
    X(cuStreamCreate, "cuStreamCreate", 0)                                       \
    X(cuStreamDestroy_v2, "cuStreamDestroy", 0)                                  \
    X(cuStreamSynchronize, "cuStreamSynchronize", 0)                             \
    X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 0)                        \
    X(cuStreamEndCapture, "cuStreamEndCapture", 0)                               \
    X(cuStreamIsCapturing, "cuStreamIsCapturing", 0)                             \
    X(cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode", 0) \
    X(cuGraphCreate, "cuGraphCreate", 0)                                         \
    X(cuGraphDestroy, "cuGraphDestroy", 0)                                       \
    X(cuGraphAddMemAllocNode, "cuGraphAddMemAllocNode", 0)                       \
    X(cuGraphAddMemFreeNode, "cuGraphAddMemFreeNode", 0)                         \
    X(cuGraphInstantiateWithFlags, "cuGraphInstantiate", 0)                      \
    X(cuGraphUpload, "cuGraphUpload", 0)                                         \
    X(cuGraphLaunch, "cuGraphLaunch", 0)                                         \
    X(cuGraphExecDestroy, "cuGraphExecDestroy", 0)                               \
    X(cuDeviceGetGraphMemAttribute, "cuDeviceGetGraphMemAttribute", 0)           \
    X(cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim", 0)                           \
    X(cuMemCreate, "cuMemCreate", 0)                                             \
    X(cuMemAddressReserve, "cuMemAddressReserve", 0)                             \
    X(cuMemAddressFree, "cuMemAddressFree", 0)                                   \
    X(cuMemMap, "cuMemMap", 0)                                                   \
    X(cuMemUnmap, "cuMemUnmap", 0)                                               \
    X(cuMemRelease, "cuMemRelease", 0)                                           \
    X(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle", 0)             \
    X(cuArrayCreate_v2, "cuArrayCreate", 0)                                      \
    X(cuArray3DCreate_v2, "cuArray3DCreate", 0)                                  \
    X(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 0)                       \
    X(cuArrayDestroy, "cuArrayDestroy", 0)                                       \
    X(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 0)

#define FIELD(c, b, v) __typeof__(&c) c;
static struct {
    PROP_FUNCS(FIELD)
} api;
#undef FIELD

static u64 (*fake_used)(int);
static u64 (*fake_peak)(int);
static void (*fake_reset_peak)(int);
static void (*fake_note)(const char *, int, unsigned long long, unsigned long long);
static void (*fake_journal_dump)(int, const char *, unsigned long long);
static u64 (*fake_pools_destroyed_live)(int);
static u64 (*fake_teardowns_shared)(int);

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "prop_client: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(2);
}

static void resolve_all(const char *mode) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) die("dlopen libcuda.so.1: %s", dlerror());
    int gpa = !strcmp(mode, "gpa"), ptsz = !strcmp(mode, "gpa-ptsz");
    if (!gpa && !ptsz && strcmp(mode, "dlsym")) die("unknown mode %s", mode);
    __typeof__(&cuGetProcAddress_v2) gpa2 = (__typeof__(gpa2))dlsym(h, "cuGetProcAddress_v2");
    if ((gpa || ptsz) && !gpa2) die("no cuGetProcAddress_v2");
#define RESOLVE(c, b, v)                                                                                     \
    do {                                                                                                     \
        void *p = NULL;                                                                                      \
        int st = 0;                                                                                          \
        if (gpa || ptsz) {                                                                                   \
            if (gpa2(b, &p, 13000, ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0, &st) != 0) p = NULL; \
        } else {                                                                                             \
            p = dlsym(h, #c);                                                                                \
        }                                                                                                    \
        if (!p) die("cannot resolve %s", #c);                                                                \
        api.c = (__typeof__(api.c))p;                                                                        \
    } while (0);
    PROP_FUNCS(RESOLVE)
#undef RESOLVE
    fake_used = (u64(*)(int))dlsym(h, "fake_cuda_used");
    fake_peak = (u64(*)(int))dlsym(h, "fake_cuda_peak");
    fake_reset_peak = (void (*)(int))dlsym(h, "fake_cuda_reset_peak");
    fake_pools_destroyed_live = (u64(*)(int))dlsym(h, "fake_cuda_pools_destroyed_live");
    fake_teardowns_shared = (u64(*)(int))dlsym(h, "fake_cuda_teardowns_shared");
    if (getenv("FAKE_CUDA_JOURNAL")) {
        fake_note = (__typeof__(fake_note))dlsym(h, "fake_cuda_journal_note");
        fake_journal_dump = (__typeof__(fake_journal_dump))dlsym(h, "fake_cuda_journal_dump");
    }
    if (!fake_used || !fake_peak || !fake_reset_peak || !fake_pools_destroyed_live || !fake_teardowns_shared) die("fake helpers missing");
}

/* ---------- the program ---------- */

enum opcode {
    O_ALLOC, O_PITCH, O_MANAGED, O_ASYNC, O_POOLASYNC, O_FREE, O_FREEASYNC, O_FREESTALE, O_FREEINTERIOR,
    O_FREEFOREIGN, O_VCREATE, O_VMAP, O_VUNMAP, O_VRELEASE, O_VRETAIN, O_ARRAY, O_ARRAY3D, O_MIPMAP, O_ADESTROY,
    O_POOL, O_THRESHOLD, O_TRIM, O_POOLATTR, O_POOLDESTROY, O_SETPOOL, O_SYNC, O_CTXSYNC, O_INFO, O_RETAINPRIMARY,
    O_RELEASE, O_RESET, O_SETPRIMARY, O_CTXCREATE, O_CTXDESTROY, O_SETCTX, O_CTXPOP, O_STREAM, O_STREAMDESTROY,
    O_CAPTURE, O_ENDCAPTURE, O_CAPTURING, O_CAPMODE, O_GRAPH, O_MEMNODE, O_FREENODE, O_INSTANTIATE, O_UPLOAD,
    O_LAUNCH, O_EXECDESTROY, O_GRAPHDESTROY, O_GRAPHTRIM, O_GRAPHATTR, O_FORK, O_YIELD, O_SETLIMIT, O_COUNT
};

static const struct {
    const char *name;
    int nargs;
} k_ops[O_COUNT] = {
    [O_ALLOC] = {"alloc", 2},           /* P SIZE */
    [O_PITCH] = {"pitch", 3},           /* P W H */
    [O_MANAGED] = {"managed", 2},       /* P SIZE */
    [O_ASYNC] = {"async", 3},           /* P STREAM SIZE */
    [O_POOLASYNC] = {"poolasync", 4},   /* P STREAM L SIZE */
    [O_FREE] = {"free", 1},             /* P */
    [O_FREEASYNC] = {"freeasync", 2},   /* P STREAM */
    [O_FREESTALE] = {"freestale", 1},   /* P */
    [O_FREEINTERIOR] = {"freeinterior", 1}, /* P */
    [O_FREEFOREIGN] = {"freeforeign", 1},   /* PTR */
    [O_VCREATE] = {"vcreate", 3},       /* V DEV SIZE */
    [O_VMAP] = {"vmap", 1},             /* V */
    [O_VUNMAP] = {"vunmap", 1},         /* V */
    [O_VRELEASE] = {"vrelease", 1},     /* V */
    [O_VRETAIN] = {"vretain", 1},       /* V */
    [O_ARRAY] = {"array", 5},           /* A W H FMT CH */
    [O_ARRAY3D] = {"array3d", 6},       /* A W H D FMT CH */
    [O_MIPMAP] = {"mipmap", 7},         /* A W H D FMT CH LEVELS */
    [O_ADESTROY] = {"adestroy", 1},     /* A */
    [O_POOL] = {"pool", 2},             /* L DEV */
    [O_THRESHOLD] = {"threshold", 2},   /* L BYTES */
    [O_TRIM] = {"trim", 2},             /* L KEEP */
    [O_POOLATTR] = {"poolattr", 2},     /* L ATTR */
    [O_POOLDESTROY] = {"pooldestroy", 1}, /* L */
    [O_SETPOOL] = {"setpool", 2},       /* DEV L */
    [O_SYNC] = {"sync", 1},             /* STREAM */
    [O_CTXSYNC] = {"ctxsync", 0},
    [O_INFO] = {"info", 0},
    [O_RETAINPRIMARY] = {"retainprimary", 1}, /* DEV */
    [O_RELEASE] = {"release", 1},       /* DEV */
    [O_RESET] = {"reset", 1},           /* DEV */
    [O_SETPRIMARY] = {"setprimary", 1}, /* DEV */
    [O_CTXCREATE] = {"ctxcreate", 2},   /* C DEV */
    [O_CTXDESTROY] = {"ctxdestroy", 1}, /* C */
    [O_SETCTX] = {"setctx", 1},         /* C */
    [O_CTXPOP] = {"ctxpop", 0},
    [O_STREAM] = {"stream", 2},         /* S FLAGS */
    [O_STREAMDESTROY] = {"streamdestroy", 1}, /* S */
    [O_CAPTURE] = {"capture", 2},       /* S MODE */
    [O_ENDCAPTURE] = {"endcapture", 2}, /* S G */
    [O_CAPTURING] = {"capturing", 1},   /* STREAM */
    [O_CAPMODE] = {"capmode", 1},       /* MODE */
    [O_GRAPH] = {"graph", 1},           /* G */
    [O_MEMNODE] = {"memnode", 4},       /* G P DEV SIZE */
    [O_FREENODE] = {"freenode", 2},     /* G P */
    [O_INSTANTIATE] = {"instantiate", 3}, /* E G FLAGS */
    [O_UPLOAD] = {"upload", 2},         /* E STREAM */
    [O_LAUNCH] = {"launch", 2},         /* E STREAM */
    [O_EXECDESTROY] = {"execdestroy", 1}, /* E */
    [O_GRAPHDESTROY] = {"graphdestroy", 1}, /* G */
    [O_GRAPHTRIM] = {"graphtrim", 1},   /* DEV */
    [O_GRAPHATTR] = {"graphattr", 2},   /* DEV ATTR */
    [O_FORK] = {"fork", 0},
    [O_YIELD] = {"yield", 0},
    [O_SETLIMIT] = {"setlimit", 2},     /* LIMIT VALUE */
};

#define MAX_ARGS 7
struct op {
    int code;
    u64 a[MAX_ARGS];
};

#define MAX_THREADS 4
#define MAX_DEVS 8
#define NP 16 /* pointer slots */
#define NV 4  /* VMM slots */
#define NA 4  /* array slots */
#define NL 3  /* pool slots */
#define NS 4  /* stream slots */
#define NG 4  /* graph slots */
#define NE 4  /* exec slots */
#define NC 3  /* created-context slots */
/* Stream arguments: 0..NS-1 a stream slot; these name the special streams. */
#define STREAM_NULL 100
#define STREAM_LEGACY 101
#define STREAM_PTDS 102

struct thread_prog {
    struct op *ops;
    size_t n, cap;
    int *rcs;
};

static struct {
    char id[64];
    int ndev;
    int has_budget;
    u64 budget[MAX_DEVS];
    int nthreads;
    struct thread_prog t[MAX_THREADS];
} g_case;

/* ---------- shared state of a case ---------- */

/* A slot: the current value, and the last value taken out of it (for stale frees). */
struct slot {
    u64 cur, stale;
};

static struct slot g_p[NP], g_l[NL], g_s[NS], g_g[NG], g_e[NE], g_c[NC];

struct lslot { /* VMM and array slots: several fields, one mutex */
    pthread_mutex_t mu;
    u64 handle, size, va, kind;
};
static struct lslot g_v[NV], g_a[NA];

/* Set when a free took a slot's stale value (the slot was empty: never filled, its
 * allocation failed, or another free took it first): a double free of that address,
 * which another thread's allocation may have been given again. */
static int g_stale_taken;

/* The slot's value, or its stale one when it is empty (then *stale, if given, is set). */
static u64 slot_take_noting(struct slot *s, int *stale) {
    u64 v = __atomic_exchange_n(&s->cur, 0, __ATOMIC_SEQ_CST);
    if (v) {
        __atomic_store_n(&s->stale, v, __ATOMIC_SEQ_CST);
        return v;
    }
    v = __atomic_load_n(&s->stale, __ATOMIC_SEQ_CST);
    if (v && stale) __atomic_store_n(stale, 1, __ATOMIC_SEQ_CST);
    return v;
}

static u64 slot_take(struct slot *s) { return slot_take_noting(s, NULL); }

/* A pointer slot's value for a free; notes a double free (the slot's stale value). */
static u64 ptr_take(struct slot *s) { return slot_take_noting(s, &g_stale_taken); }

static u64 slot_peek(struct slot *s) {
    u64 v = __atomic_load_n(&s->cur, __ATOMIC_SEQ_CST);
    return v ? v : __atomic_load_n(&s->stale, __ATOMIC_SEQ_CST);
}

static void slot_put(struct slot *s, u64 v) {
    u64 old = __atomic_exchange_n(&s->cur, v, __ATOMIC_SEQ_CST);
    if (old) __atomic_store_n(&s->stale, old, __ATOMIC_SEQ_CST);
}

/* Registries: everything a case ever obtained, for the cleanup. */
struct reg {
    u64 *v;
    size_t n, cap;
};
enum { R_PTR, R_VMM, R_MAP_VA, R_MAP_SIZE, R_ARRAY, R_MIPMAP, R_POOL, R_STREAM, R_GRAPH, R_EXEC, R_CTX, R_COUNT };
static struct reg g_reg[R_COUNT];
static pthread_mutex_t g_reg_mu = PTHREAD_MUTEX_INITIALIZER;

static void reg_add2(int r, u64 v, int r2, u64 v2) {
    pthread_mutex_lock(&g_reg_mu);
    for (int k = 0; k < 2; k++) {
        struct reg *g = &g_reg[k ? r2 : r];
        if (k && r2 < 0) break;
        if (g->n == g->cap) {
            size_t n = g->cap ? g->cap * 2 : 64;
            u64 *nv = realloc(g->v, n * sizeof *nv);
            if (!nv) die("out of memory");
            g->v = nv;
            g->cap = n;
        }
        g->v[g->n++] = k ? v2 : v;
    }
    pthread_mutex_unlock(&g_reg_mu);
}

static void reg_add(int r, u64 v) { reg_add2(r, v, -1, 0); }

static CUcontext g_prim[MAX_DEVS]; /* primary contexts, retained at start */
/* The limits (stack, printf FIFO, heap) of each primary context at start: the cleanup
 * sets them back. */
static size_t g_limit0[MAX_DEVS][3];
static int g_cleanup_retained[MAX_DEVS];

/* First sample over budget, fork problems. */
static int g_viol;
static int g_viol_t, g_viol_dev;
static size_t g_viol_idx;
static u64 g_viol_used;
static char g_forkmsg[4][128];
static int g_nforkmsg;
static pthread_mutex_t g_msg_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_barrier_t g_start;

static CUstream stream_arg(u64 s) {
    if (s == STREAM_NULL) return NULL;
    if (s == STREAM_LEGACY) return CU_STREAM_LEGACY;
    if (s == STREAM_PTDS) return CU_STREAM_PER_THREAD;
    return (CUstream)(uintptr_t)slot_peek(&g_s[s % NS]);
}

static CUmemoryPool pool_arg(u64 l, int *rc) {
    u64 p = slot_peek(&g_l[l % NL]);
    *rc = CUDA_SUCCESS;
    if (p) return (CUmemoryPool)(uintptr_t)p;
    CUdevice dev = 0;
    CUmemoryPool pool = NULL;
    *rc = api.cuCtxGetDevice(&dev);
    if (*rc == CUDA_SUCCESS) *rc = api.cuDeviceGetDefaultMemPool(&pool, dev);
    return pool;
}

static void put_ptr(u64 p, u64 v) {
    if (getenv("PROP_TRACE")) fprintf(stderr, "trace put slot %llu = %#llx\n", p, v);
    slot_put(&g_p[p % NP], v);
    reg_add(R_PTR, v);
}

/* The child of a fork makes a few calls and leaves; it must never hang. */
static void do_fork(int t, size_t idx) {
    pid_t pid = fork();
    if (pid < 0) return;
    if (pid == 0) {
        alarm(3);
        CUdeviceptr p = 0;
        size_t f = 0, tot = 0;
        if (api.cuMemAlloc_v2(&p, 1 << 20) == CUDA_SUCCESS) api.cuMemFree_v2(p);
        if (api.cuMemAllocAsync(&p, 1 << 20, NULL) == CUDA_SUCCESS) api.cuMemFreeAsync(p, NULL);
        api.cuMemGetInfo_v2(&f, &tot);
        _exit(0);
    }
    int status = 0;
    struct timespec ts = {0, 1000000};
    pid_t w = 0;
    for (int i = 0; i < 6000 && (w = waitpid(pid, &status, WNOHANG)) == 0; i++) nanosleep(&ts, NULL);
    const char *what = NULL;
    char buf[64];
    if (w == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        what = "hang(killed)";
    } else if (w < 0) {
        what = NULL;
    } else if (WIFSIGNALED(status)) {
        if (WTERMSIG(status) == SIGALRM) what = "hang(alarm)";
        else {
            snprintf(buf, sizeof buf, "crash(signal=%d)", WTERMSIG(status));
            what = buf;
        }
    } else if (WEXITSTATUS(status) != 0) {
        snprintf(buf, sizeof buf, "exit(%d)", WEXITSTATUS(status));
        what = buf;
    }
    if (what) {
        pthread_mutex_lock(&g_msg_mu);
        if (g_nforkmsg < 4) snprintf(g_forkmsg[g_nforkmsg++], sizeof g_forkmsg[0], "fork %d %zu %s", t, idx, what);
        pthread_mutex_unlock(&g_msg_mu);
    }
}

static int vmm_prop(CUmemAllocationProp *prop, int dev) {
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = dev;
    return 0;
}

static const int k_modes[3] = {CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                               CU_STREAM_CAPTURE_MODE_RELAXED};

/* Streams this thread began a capture on (it ends them when its program is done). */
static __thread u64 t_captured[64];
static __thread int t_ncaptured;

static int run_op(int t, size_t idx, const struct op *o) {
    const u64 *a = o->a;
    int rc = 0;
    CUdeviceptr p = 0;
    switch (o->code) {
    case O_ALLOC:
        rc = api.cuMemAlloc_v2(&p, a[1]);
        if (rc == CUDA_SUCCESS) put_ptr(a[0], p);
        break;
    case O_PITCH: {
        size_t pitch = 0;
        rc = api.cuMemAllocPitch_v2(&p, &pitch, a[1], a[2], 4);
        if (rc == CUDA_SUCCESS) put_ptr(a[0], p);
        break;
    }
    case O_MANAGED:
        rc = api.cuMemAllocManaged(&p, a[1], 1);
        if (rc == CUDA_SUCCESS) put_ptr(a[0], p);
        break;
    case O_ASYNC:
        rc = api.cuMemAllocAsync(&p, a[2], stream_arg(a[1]));
        if (rc == CUDA_SUCCESS) put_ptr(a[0], p);
        break;
    case O_POOLASYNC: {
        CUmemoryPool pool = pool_arg(a[2], &rc);
        if (rc == CUDA_SUCCESS) rc = api.cuMemAllocFromPoolAsync(&p, a[3], pool, stream_arg(a[1]));
        if (rc == CUDA_SUCCESS) put_ptr(a[0], p);
        break;
    }
    case O_FREE: rc = api.cuMemFree_v2(ptr_take(&g_p[a[0] % NP])); break;
    case O_FREEASYNC: rc = api.cuMemFreeAsync(ptr_take(&g_p[a[0] % NP]), stream_arg(a[1])); break;
    case O_FREESTALE: rc = api.cuMemFree_v2(__atomic_load_n(&g_p[a[0] % NP].stale, __ATOMIC_SEQ_CST)); break;
    case O_FREEINTERIOR: {
        u64 v = __atomic_load_n(&g_p[a[0] % NP].cur, __ATOMIC_SEQ_CST);
        rc = api.cuMemFree_v2(v ? v + 256 : 0x1000);
        break;
    }
    case O_FREEFOREIGN: rc = api.cuMemFree_v2(a[0]); break;
    case O_VCREATE: {
        CUmemAllocationProp prop;
        CUmemGenericAllocationHandle h = 0;
        vmm_prop(&prop, (int)a[1]);
        rc = api.cuMemCreate(&h, a[2], &prop, 0);
        if (rc == CUDA_SUCCESS) {
            struct lslot *s = &g_v[a[0] % NV];
            reg_add(R_VMM, h);
            pthread_mutex_lock(&s->mu);
            s->handle = h;
            s->size = a[2];
            s->va = 0;
            pthread_mutex_unlock(&s->mu);
        }
        break;
    }
    case O_VMAP: {
        struct lslot *s = &g_v[a[0] % NV];
        pthread_mutex_lock(&s->mu);
        u64 h = s->handle, size = s->size;
        pthread_mutex_unlock(&s->mu);
        CUdeviceptr va = 0;
        rc = api.cuMemAddressReserve(&va, size, 0, 0, 0);
        if (rc == CUDA_SUCCESS) {
            rc = api.cuMemMap(va, size, 0, h, 0);
            if (rc == CUDA_SUCCESS) {
                reg_add2(R_MAP_VA, va, R_MAP_SIZE, size);
                pthread_mutex_lock(&s->mu);
                if (s->handle == h) s->va = va;
                pthread_mutex_unlock(&s->mu);
            } else {
                api.cuMemAddressFree(va, size);
            }
        }
        break;
    }
    case O_VUNMAP: {
        struct lslot *s = &g_v[a[0] % NV];
        pthread_mutex_lock(&s->mu);
        u64 va = s->va, size = s->size;
        s->va = 0;
        pthread_mutex_unlock(&s->mu);
        rc = api.cuMemUnmap(va, size ? size : 1);
        break;
    }
    case O_VRELEASE: {
        struct lslot *s = &g_v[a[0] % NV];
        pthread_mutex_lock(&s->mu);
        u64 h = s->handle;
        pthread_mutex_unlock(&s->mu);
        rc = api.cuMemRelease(h);
        break;
    }
    case O_VRETAIN: {
        struct lslot *s = &g_v[a[0] % NV];
        pthread_mutex_lock(&s->mu);
        u64 addr = s->va + s->size / 2;
        pthread_mutex_unlock(&s->mu);
        CUmemGenericAllocationHandle h = 0;
        rc = api.cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)addr);
        if (rc == CUDA_SUCCESS) reg_add(R_VMM, h);
        break;
    }
    case O_ARRAY:
    case O_ARRAY3D:
    case O_MIPMAP: {
        u64 h = 0;
        int mip = o->code == O_MIPMAP;
        if (o->code == O_ARRAY) {
            CUDA_ARRAY_DESCRIPTOR d = {a[1], a[2], (int)a[3], (unsigned)a[4]};
            CUarray arr = NULL;
            rc = api.cuArrayCreate_v2(&arr, &d);
            h = (u64)(uintptr_t)arr;
        } else {
            CUDA_ARRAY3D_DESCRIPTOR d = {a[1], a[2], a[3], (int)a[4], (unsigned)a[5], 0};
            if (mip) {
                CUmipmappedArray arr = NULL;
                rc = api.cuMipmappedArrayCreate(&arr, &d, (unsigned)a[6]);
                h = (u64)(uintptr_t)arr;
            } else {
                CUarray arr = NULL;
                rc = api.cuArray3DCreate_v2(&arr, &d);
                h = (u64)(uintptr_t)arr;
            }
        }
        if (rc == CUDA_SUCCESS) {
            struct lslot *s = &g_a[a[0] % NA];
            reg_add(mip ? R_MIPMAP : R_ARRAY, h);
            pthread_mutex_lock(&s->mu);
            s->handle = h;
            s->kind = (u64)mip;
            pthread_mutex_unlock(&s->mu);
        }
        break;
    }
    case O_ADESTROY: {
        struct lslot *s = &g_a[a[0] % NA];
        pthread_mutex_lock(&s->mu);
        u64 h = s->handle, mip = s->kind;
        s->handle = 0;
        pthread_mutex_unlock(&s->mu);
        rc = mip ? api.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)h) : api.cuArrayDestroy((CUarray)(uintptr_t)h);
        break;
    }
    case O_POOL: {
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = (int)a[1];
        CUmemoryPool pool = NULL;
        rc = api.cuMemPoolCreate(&pool, &props);
        if (rc == CUDA_SUCCESS) {
            reg_add(R_POOL, (u64)(uintptr_t)pool);
            slot_put(&g_l[a[0] % NL], (u64)(uintptr_t)pool);
        }
        break;
    }
    case O_THRESHOLD: {
        CUmemoryPool pool = pool_arg(a[0], &rc);
        u64 v = a[1];
        if (rc == CUDA_SUCCESS) rc = api.cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &v);
        break;
    }
    case O_TRIM: {
        CUmemoryPool pool = pool_arg(a[0], &rc);
        if (rc == CUDA_SUCCESS) rc = api.cuMemPoolTrimTo(pool, a[1]);
        break;
    }
    case O_POOLATTR: {
        CUmemoryPool pool = pool_arg(a[0], &rc);
        u64 v = 0;
        if (rc == CUDA_SUCCESS) rc = api.cuMemPoolGetAttribute(pool, (int)a[1], &v);
        break;
    }
    case O_POOLDESTROY: {
        u64 pool = slot_take(&g_l[a[0] % NL]);
        rc = pool ? api.cuMemPoolDestroy((CUmemoryPool)(uintptr_t)pool) : CUDA_ERROR_INVALID_VALUE;
        break;
    }
    case O_SETPOOL: {
        CUmemoryPool pool = pool_arg(a[1], &rc);
        if (rc == CUDA_SUCCESS) rc = api.cuDeviceSetMemPool((int)a[0], pool);
        break;
    }
    case O_SYNC: rc = api.cuStreamSynchronize(stream_arg(a[0])); break;
    case O_CTXSYNC: rc = api.cuCtxSynchronize(); break;
    case O_INFO: {
        size_t f = 0, tot = 0;
        rc = api.cuMemGetInfo_v2(&f, &tot);
        if (rc == CUDA_SUCCESS && f > tot) rc = -2; /* never: free beyond total */
        break;
    }
    case O_RETAINPRIMARY: {
        CUcontext c = NULL;
        rc = api.cuDevicePrimaryCtxRetain(&c, (int)a[0]);
        if (rc == CUDA_SUCCESS) rc = api.cuCtxSetCurrent(c);
        break;
    }
    case O_RELEASE: rc = api.cuDevicePrimaryCtxRelease_v2((int)a[0]); break;
    case O_RESET: rc = api.cuDevicePrimaryCtxReset_v2((int)a[0]); break;
    case O_SETPRIMARY: rc = api.cuCtxSetCurrent(g_prim[a[0] % MAX_DEVS]); break;
    case O_CTXCREATE: {
        CUcontext c = NULL;
        rc = api.cuCtxCreate_v4(&c, NULL, 0, (int)a[1]);
        if (rc == CUDA_SUCCESS) {
            reg_add(R_CTX, (u64)(uintptr_t)c);
            slot_put(&g_c[a[0] % NC], (u64)(uintptr_t)c);
        }
        break;
    }
    case O_CTXDESTROY: {
        u64 c = __atomic_exchange_n(&g_c[a[0] % NC].cur, 0, __ATOMIC_SEQ_CST);
        rc = c ? api.cuCtxDestroy_v2((CUcontext)(uintptr_t)c) : CUDA_ERROR_INVALID_CONTEXT;
        break;
    }
    case O_SETCTX: {
        u64 c = __atomic_load_n(&g_c[a[0] % NC].cur, __ATOMIC_SEQ_CST);
        rc = c ? api.cuCtxSetCurrent((CUcontext)(uintptr_t)c) : CUDA_ERROR_INVALID_CONTEXT;
        break;
    }
    case O_CTXPOP: {
        CUcontext c = NULL;
        rc = api.cuCtxPopCurrent_v2(&c);
        break;
    }
    case O_STREAM: {
        CUstream s = NULL;
        rc = api.cuStreamCreate(&s, (unsigned)a[1]);
        if (rc == CUDA_SUCCESS) {
            reg_add(R_STREAM, (u64)(uintptr_t)s);
            slot_put(&g_s[a[0] % NS], (u64)(uintptr_t)s);
        }
        break;
    }
    case O_STREAMDESTROY: {
        u64 s = __atomic_exchange_n(&g_s[a[0] % NS].cur, 0, __ATOMIC_SEQ_CST);
        rc = s ? api.cuStreamDestroy_v2((CUstream)(uintptr_t)s) : CUDA_ERROR_INVALID_HANDLE;
        if (s) __atomic_store_n(&g_s[a[0] % NS].stale, s, __ATOMIC_SEQ_CST);
        break;
    }
    case O_CAPTURE: {
        CUstream s = stream_arg(a[0]);
        rc = api.cuStreamBeginCapture_v2(s, k_modes[a[1] % 3]);
        if (rc == CUDA_SUCCESS && t_ncaptured < 64) t_captured[t_ncaptured++] = (u64)(uintptr_t)s;
        break;
    }
    case O_ENDCAPTURE: {
        CUgraph g = NULL;
        rc = api.cuStreamEndCapture(stream_arg(a[0]), &g);
        if (g) {
            reg_add(R_GRAPH, (u64)(uintptr_t)g);
            slot_put(&g_g[a[1] % NG], (u64)(uintptr_t)g);
        }
        break;
    }
    case O_CAPTURING: {
        int st = 0;
        rc = api.cuStreamIsCapturing(stream_arg(a[0]), &st);
        break;
    }
    case O_CAPMODE: {
        int m = k_modes[a[0] % 3];
        rc = api.cuThreadExchangeStreamCaptureMode(&m);
        break;
    }
    case O_GRAPH: {
        CUgraph g = NULL;
        rc = api.cuGraphCreate(&g, 0);
        if (rc == CUDA_SUCCESS) {
            reg_add(R_GRAPH, (u64)(uintptr_t)g);
            slot_put(&g_g[a[0] % NG], (u64)(uintptr_t)g);
        }
        break;
    }
    case O_MEMNODE: {
        CUDA_MEM_ALLOC_NODE_PARAMS prm;
        memset(&prm, 0, sizeof prm);
        prm.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        prm.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prm.poolProps.location.id = (int)a[2];
        prm.bytesize = a[3];
        CUgraphNode node = NULL;
        rc = api.cuGraphAddMemAllocNode(&node, (CUgraph)(uintptr_t)slot_peek(&g_g[a[0] % NG]), NULL, 0, &prm);
        if (rc == CUDA_SUCCESS) put_ptr(a[1], prm.dptr);
        break;
    }
    case O_FREENODE: {
        CUgraphNode node = NULL;
        rc = api.cuGraphAddMemFreeNode(&node, (CUgraph)(uintptr_t)slot_peek(&g_g[a[0] % NG]), NULL, 0,
                                       slot_peek(&g_p[a[1] % NP]));
        break;
    }
    case O_INSTANTIATE: {
        CUgraphExec x = NULL;
        rc = api.cuGraphInstantiateWithFlags(&x, (CUgraph)(uintptr_t)slot_peek(&g_g[a[1] % NG]), a[2]);
        if (rc == CUDA_SUCCESS) {
            reg_add(R_EXEC, (u64)(uintptr_t)x);
            slot_put(&g_e[a[0] % NE], (u64)(uintptr_t)x);
        }
        break;
    }
    case O_UPLOAD:
        rc = api.cuGraphUpload((CUgraphExec)(uintptr_t)slot_peek(&g_e[a[0] % NE]), stream_arg(a[1]));
        break;
    case O_LAUNCH:
        rc = api.cuGraphLaunch((CUgraphExec)(uintptr_t)slot_peek(&g_e[a[0] % NE]), stream_arg(a[1]));
        break;
    case O_EXECDESTROY: {
        u64 x = __atomic_exchange_n(&g_e[a[0] % NE].cur, 0, __ATOMIC_SEQ_CST);
        rc = x ? api.cuGraphExecDestroy((CUgraphExec)(uintptr_t)x) : CUDA_ERROR_INVALID_VALUE;
        break;
    }
    case O_GRAPHDESTROY: {
        u64 g = __atomic_exchange_n(&g_g[a[0] % NG].cur, 0, __ATOMIC_SEQ_CST);
        rc = g ? api.cuGraphDestroy((CUgraph)(uintptr_t)g) : CUDA_ERROR_INVALID_VALUE;
        if (g) __atomic_store_n(&g_g[a[0] % NG].stale, g, __ATOMIC_SEQ_CST);
        break;
    }
    case O_GRAPHTRIM: rc = api.cuDeviceGraphMemTrim((int)a[0]); break;
    case O_GRAPHATTR: {
        u64 v = 0;
        rc = api.cuDeviceGetGraphMemAttribute((int)a[0], (int)a[1], &v);
        break;
    }
    case O_FORK: do_fork(t, idx); break;
    case O_SETLIMIT: rc = api.cuCtxSetLimit((int)a[0], (size_t)a[1]); break;
    case O_YIELD: {
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
        break;
    }
    default: break;
    }
    return rc;
}

/* PROP_TRACE=1: after every op, one stderr line per device with what the fake holds and
 * what cuMemGetInfo says is free (a debugging aid; it makes calls of its own). */
static int g_trace = -1;

static void trace(int t, size_t idx) {
    if (g_trace < 0) g_trace = getenv("PROP_TRACE") != NULL;
    if (!g_trace) return;
    for (int d = 0; d < g_case.ndev; d++) {
        size_t f = 0, tot = 0;
        CUcontext cur = NULL;
        api.cuCtxGetCurrent(&cur);
        api.cuCtxSetCurrent(g_prim[d]);
        int rc = api.cuMemGetInfo_v2(&f, &tot);
        api.cuCtxSetCurrent(cur);
        fprintf(stderr, "trace t%d op%zu dev%d fake=%llu free=%zu rc=%d\n", t, idx, d, fake_used(d), f, rc);
    }
}

static void sample(int t, size_t idx) {
    trace(t, idx);
    if (!g_case.has_budget) return;
    for (int d = 0; d < g_case.ndev; d++) {
        u64 u = fake_used(d);
        if (u > g_case.budget[d] && !__atomic_exchange_n(&g_viol, 1, __ATOMIC_SEQ_CST)) {
            g_viol_t = t;
            g_viol_idx = idx;
            g_viol_dev = d;
            g_viol_used = u;
        }
    }
}

static void *worker(void *arg) {
    int t = (int)(intptr_t)arg;
    struct thread_prog *tp = &g_case.t[t];
    t_ncaptured = 0;
    api.cuCtxSetCurrent(g_prim[0]);
    pthread_barrier_wait(&g_start);
    for (size_t i = 0; i < tp->n; i++) {
        if (fake_note) fake_note(k_ops[tp->ops[i].code].name, t, i, 0);
        tp->rcs[i] = run_op(t, i, &tp->ops[i]);
        if (fake_note) fake_note("done", t, i, (unsigned long long)tp->rcs[i]);
        sample(t, i);
    }
    /* End the captures this thread began and that are still going (only it can end the
     * non-relaxed ones). */
    for (int k = 0; k < t_ncaptured; k++) {
        int st = 0;
        if (api.cuStreamIsCapturing((CUstream)(uintptr_t)t_captured[k], &st) != CUDA_SUCCESS || !st) continue;
        CUgraph g = NULL;
        api.cuStreamEndCapture((CUstream)(uintptr_t)t_captured[k], &g);
        if (g) reg_add(R_GRAPH, (u64)(uintptr_t)g);
    }
    return NULL;
}

/* ---------- cleanup and report ---------- */

static int cmp_u64(const void *x, const void *y) {
    u64 a = *(const u64 *)x, b = *(const u64 *)y;
    return a < b ? -1 : a > b;
}

static void dedup(struct reg *r) {
    if (!r->n) return;
    qsort(r->v, r->n, sizeof r->v[0], cmp_u64);
    size_t k = 1;
    for (size_t i = 1; i < r->n; i++)
        if (r->v[i] != r->v[k - 1]) r->v[k++] = r->v[i];
    r->n = k;
}

static void cleanup(void) {
    int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    api.cuThreadExchangeStreamCaptureMode(&mode);
    /* A primary context the case released to 0 or reset is retained again (its handle is
     * the same). Whether it is usable is asked with cuCtxGetLimit, which the library
     * passes through (cuCtxGetDevice names the device of a released primary context too). */
    for (int d = 0; d < g_case.ndev; d++) {
        size_t v;
        g_cleanup_retained[d] = 0;
        if (api.cuCtxSetCurrent(g_prim[d]) == CUDA_SUCCESS && api.cuCtxGetLimit(&v, 0) == CUDA_SUCCESS) continue;
        CUcontext c = NULL;
        if (api.cuDevicePrimaryCtxRetain(&c, d) == CUDA_SUCCESS) {
            g_prim[d] = c;
            g_cleanup_retained[d] = 1;
        }
    }
    api.cuCtxSetCurrent(g_prim[0]);
    /* Captures still going (begun by a thread whose end-of-program end failed): end, or
     * destroy the stream. */
    struct reg *rs = &g_reg[R_STREAM];
    for (size_t i = 0; i < rs->n; i++) {
        CUstream s = (CUstream)(uintptr_t)rs->v[i];
        int st = 0;
        if (api.cuStreamIsCapturing(s, &st) != CUDA_SUCCESS || !st) continue;
        CUgraph g = NULL;
        if (api.cuStreamEndCapture(s, &g) == CUDA_SUCCESS && g) reg_add(R_GRAPH, (u64)(uintptr_t)g);
        if (api.cuStreamIsCapturing(s, &st) == CUDA_SUCCESS && st) api.cuStreamDestroy_v2(s);
    }
    for (size_t i = 0; i < g_reg[R_EXEC].n; i++) api.cuGraphExecDestroy((CUgraphExec)(uintptr_t)g_reg[R_EXEC].v[i]);
    dedup(&g_reg[R_GRAPH]);
    for (size_t i = 0; i < g_reg[R_GRAPH].n; i++) api.cuGraphDestroy((CUgraph)(uintptr_t)g_reg[R_GRAPH].v[i]);
    dedup(&g_reg[R_PTR]);
    for (size_t i = 0; i < g_reg[R_PTR].n; i++) {
        CUdeviceptr p = g_reg[R_PTR].v[i];
        int frc = api.cuMemFree_v2(p), arc = -1;
        if (frc != CUDA_SUCCESS) arc = api.cuMemFreeAsync(p, NULL);
        if (getenv("PROP_TRACE")) fprintf(stderr, "trace cleanup free %#llx: %d %d\n", p, frc, arc);
    }
    for (size_t i = 0; i < g_reg[R_MAP_VA].n; i++) {
        api.cuMemUnmap(g_reg[R_MAP_VA].v[i], g_reg[R_MAP_SIZE].v[i]);
        api.cuMemAddressFree(g_reg[R_MAP_VA].v[i], g_reg[R_MAP_SIZE].v[i]);
    }
    dedup(&g_reg[R_VMM]);
    for (size_t i = 0; i < g_reg[R_VMM].n; i++)
        for (int k = 0; k < 256 && api.cuMemRelease(g_reg[R_VMM].v[i]) == CUDA_SUCCESS; k++) {
        }
    for (size_t i = 0; i < g_reg[R_ARRAY].n; i++) api.cuArrayDestroy((CUarray)(uintptr_t)g_reg[R_ARRAY].v[i]);
    for (size_t i = 0; i < g_reg[R_MIPMAP].n; i++)
        api.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)g_reg[R_MIPMAP].v[i]);
    for (size_t i = 0; i < rs->n; i++) {
        api.cuStreamSynchronize((CUstream)(uintptr_t)rs->v[i]);
        api.cuStreamDestroy_v2((CUstream)(uintptr_t)rs->v[i]);
    }
    for (int d = 0; d < g_case.ndev; d++) {
        CUmemoryPool def = NULL;
        if (api.cuDeviceGetDefaultMemPool(&def, d) == CUDA_SUCCESS) {
            api.cuDeviceSetMemPool(d, def);
            api.cuMemPoolTrimTo(def, 0);
        }
    }
    for (size_t i = 0; i < g_reg[R_POOL].n; i++) {
        CUmemoryPool pool = (CUmemoryPool)(uintptr_t)g_reg[R_POOL].v[i];
        api.cuMemPoolTrimTo(pool, 0);
        api.cuMemPoolDestroy(pool);
    }
    for (size_t i = 0; i < g_reg[R_CTX].n; i++) api.cuCtxDestroy_v2((CUcontext)(uintptr_t)g_reg[R_CTX].v[i]);
    for (int d = 0; d < g_case.ndev; d++) {
        api.cuCtxSetCurrent(g_prim[d]);
        for (int l = 0; l < 3; l++) api.cuCtxSetLimit(l, g_limit0[d][l]);
    }
    for (int d = 0; d < g_case.ndev; d++) {
        api.cuCtxSetCurrent(g_prim[d]);
        api.cuCtxSynchronize();
        api.cuDeviceGraphMemTrim(d);
    }
    api.cuThreadExchangeStreamCaptureMode(&mode);
}

static void reset_case(void) {
    for (int t = 0; t < MAX_THREADS; t++) {
        free(g_case.t[t].ops);
        free(g_case.t[t].rcs);
    }
    memset(&g_case, 0, sizeof g_case);
    memset(g_p, 0, sizeof g_p);
    memset(g_l, 0, sizeof g_l);
    memset(g_s, 0, sizeof g_s);
    memset(g_g, 0, sizeof g_g);
    memset(g_e, 0, sizeof g_e);
    memset(g_c, 0, sizeof g_c);
    for (int i = 0; i < NV; i++) g_v[i].handle = g_v[i].size = g_v[i].va = g_v[i].kind = 0;
    for (int i = 0; i < NA; i++) g_a[i].handle = g_a[i].size = g_a[i].va = g_a[i].kind = 0;
    for (int r = 0; r < R_COUNT; r++) g_reg[r].n = 0;
    g_viol = 0;
    g_stale_taken = 0;
    g_nforkmsg = 0;
}

static void run_case(void) {
    int n = g_case.nthreads;
    for (int d = 0; d < g_case.ndev; d++) fake_reset_peak(d);
    u64 pools_destroyed_live[MAX_DEVS], teardowns_shared[MAX_DEVS];
    for (int d = 0; d < g_case.ndev; d++) {
        pools_destroyed_live[d] = fake_pools_destroyed_live(d);
        teardowns_shared[d] = fake_teardowns_shared(d);
    }
    printf("begin %s\n", g_case.id);
    fflush(stdout);
    pthread_barrier_init(&g_start, NULL, (unsigned)n);
    pthread_t th[MAX_THREADS];
    for (int t = 0; t < n; t++)
        if (pthread_create(&th[t], NULL, worker, (void *)(intptr_t)t) != 0) die("pthread_create");
    for (int t = 0; t < n; t++) pthread_join(th[t], NULL);
    pthread_barrier_destroy(&g_start);
    for (int t = 0; t < n; t++) {
        printf("rc %d", t);
        for (size_t i = 0; i < g_case.t[t].n; i++) printf(" %d", g_case.t[t].rcs[i]);
        printf("\n");
    }
    if (g_stale_taken) printf("stalefree\n");
    for (int d = 0; d < g_case.ndev; d++) {
        if (fake_pools_destroyed_live(d) != pools_destroyed_live[d]) printf("pooldestroylive %d\n", d);
        if (fake_teardowns_shared(d) != teardowns_shared[d]) printf("teardownshared %d\n", d);
    }
    if (g_viol)
        printf("viol %d %zu %d %llu %llu\n", g_viol_t, g_viol_idx, g_viol_dev, g_viol_used,
               g_case.budget[g_viol_dev]);
    for (int i = 0; i < g_nforkmsg; i++) printf("%s\n", g_forkmsg[i]);
    u64 peak[MAX_DEVS];
    for (int d = 0; d < g_case.ndev; d++) peak[d] = fake_peak(d);
    if (fake_note) fake_note("cleanup", -1, 0, 0);
    cleanup();
    /* What the process holds (the fake) and what cuMemGetInfo says on each device. */
    printf("end %s", g_case.id);
    for (int d = 0; d < g_case.ndev; d++) {
        size_t f = 0, tot = 0;
        api.cuCtxSetCurrent(g_prim[d]);
        int rc = api.cuMemGetInfo_v2(&f, &tot);
        u64 base = g_case.has_budget ? g_case.budget[d] : (u64)tot;
        long long books = rc == CUDA_SUCCESS ? (long long)(base - (u64)f) : -1;
        if (books != 0 && g_case.has_budget && fake_journal_dump) fake_journal_dump(d, "books not zero after cleanup:", (u64)books);
        printf(" dev%d:peak=%llu,fake=%llu,books=%lld,inforc=%d,total=%zu", d, peak[d], fake_used(d), books, rc, tot);
    }
    printf("\n");
    fflush(stdout);
    /* Back to one retain of each primary context for the next case: the retains and
     * releases that succeeded are counted; a case that reset it gets reset + retain. */
    for (int d = 0; d < g_case.ndev; d++) {
        long count = 1 + g_cleanup_retained[d];
        int reset = 0;
        for (int t = 0; t < g_case.nthreads; t++)
            for (size_t i = 0; i < g_case.t[t].n; i++) {
                const struct op *o = &g_case.t[t].ops[i];
                if (g_case.t[t].rcs[i] != CUDA_SUCCESS || (int)o->a[0] != d) continue;
                if (o->code == O_RETAINPRIMARY) count++;
                else if (o->code == O_RELEASE) count--;
                else if (o->code == O_RESET) reset = 1;
            }
        if (reset) {
            CUcontext c = NULL;
            api.cuDevicePrimaryCtxReset_v2(d);
            if (api.cuDevicePrimaryCtxRetain(&c, d) == CUDA_SUCCESS) g_prim[d] = c;
        } else {
            for (; count > 1; count--) api.cuDevicePrimaryCtxRelease_v2(d);
        }
    }
    api.cuCtxSetCurrent(g_prim[0]);
}

/* ---------- input ---------- */

static void add_op(int t, struct op o) {
    struct thread_prog *tp = &g_case.t[t];
    if (tp->n == tp->cap) {
        size_t n = tp->cap ? tp->cap * 2 : 64;
        tp->ops = realloc(tp->ops, n * sizeof *tp->ops);
        tp->rcs = realloc(tp->rcs, n * sizeof *tp->rcs);
        if (!tp->ops || !tp->rcs) die("out of memory");
        tp->cap = n;
    }
    tp->ops[tp->n++] = o;
    if (t + 1 > g_case.nthreads) g_case.nthreads = t + 1;
}

int main(int argc, char **argv) {
    if (argc != 2) die("usage: prop_client gpa|gpa-ptsz|dlsym < cases");
    resolve_all(argv[1]);
    if (api.cuInit(0) != CUDA_SUCCESS) die("cuInit failed");
    int ndev = 0;
    for (int d = 0; d < MAX_DEVS; d++) {
        CUdevice dev;
        if (api.cuDeviceGet(&dev, d) != CUDA_SUCCESS) break;
        if (api.cuDevicePrimaryCtxRetain(&g_prim[d], dev) != CUDA_SUCCESS) die("retain %d", d);
        api.cuCtxSetCurrent(g_prim[d]);
        for (int l = 0; l < 3; l++)
            if (api.cuCtxGetLimit(&g_limit0[d][l], l) != CUDA_SUCCESS) die("limit %d of device %d", l, d);
        ndev = d + 1;
    }
    api.cuCtxSetCurrent(g_prim[0]);
    for (int i = 0; i < NV; i++) pthread_mutex_init(&g_v[i].mu, NULL);
    for (int i = 0; i < NA; i++) pthread_mutex_init(&g_a[i].mu, NULL);
    printf("ready devices=%d\n", ndev);
    fflush(stdout);

    char line[1024];
    int in_case = 0;
    while (fgets(line, sizeof line, stdin)) {
        char *save = NULL, *tok = strtok_r(line, " \t\r\n", &save);
        if (!tok || tok[0] == '#') continue;
        if (!strcmp(tok, "case")) {
            reset_case();
            in_case = 1;
            char *id = strtok_r(NULL, " \t\r\n", &save);
            char *nd = strtok_r(NULL, " \t\r\n", &save);
            if (!id || !nd) die("case ID NDEV [budget...]");
            snprintf(g_case.id, sizeof g_case.id, "%s", id);
            g_case.ndev = atoi(nd);
            if (g_case.ndev < 1 || g_case.ndev > ndev) die("case %s: %d devices, the driver has %d", id, g_case.ndev, ndev);
            for (int d = 0; d < g_case.ndev; d++) {
                char *b = strtok_r(NULL, " \t\r\n", &save);
                if (!b) break;
                g_case.has_budget = 1;
                g_case.budget[d] = strtoull(b, NULL, 10);
            }
        } else if (!strcmp(tok, "run")) {
            if (!in_case) die("run outside a case");
            if (g_case.nthreads == 0) add_op(0, (struct op){O_YIELD, {0}});
            run_case();
            in_case = 0;
        } else {
            if (!in_case) die("op outside a case");
            int t = atoi(tok);
            char *name = strtok_r(NULL, " \t\r\n", &save);
            if (t < 0 || t >= MAX_THREADS || !name) die("bad op line");
            struct op o;
            memset(&o, 0, sizeof o);
            o.code = -1;
            for (int c = 0; c < O_COUNT; c++)
                if (!strcmp(k_ops[c].name, name)) o.code = c;
            if (o.code < 0) die("unknown op %s", name);
            for (int i = 0; i < k_ops[o.code].nargs; i++) {
                char *v = strtok_r(NULL, " \t\r\n", &save);
                if (!v) die("op %s needs %d arguments", name, k_ops[o.code].nargs);
                o.a[i] = strtoull(v, NULL, 0);
            }
            add_op(t, o);
        }
    }
    return 0;
}
