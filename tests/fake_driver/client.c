/* Test client: loads the CUDA driver the ways real programs do and runs a list of ops,
 * printing one line per op. Usage: client MODE OP...   (see README.md)
 * Built twice: `client` (dlopen only) and `client_linked` (-DLINKED, linked with -lcuda). */
#define _GNU_SOURCE
#include "fake_cuda_api.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef unsigned long long u64;

/* X(concrete name, base name for cuGetProcAddress, version): gpa modes ask for the base
 * name at 13000 (gpa-legacy: 12000, or `version` where the variant the client calls is
 * newer than that: cuCtxCreate_v4, cuStreamGetDevice). */
#define CLIENT_FUNCS(X) \
    X(cuInit, "cuInit", 0)                                                       \
    X(cuDeviceGet, "cuDeviceGet", 0)                                             \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 0)                   \
    X(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 0)              \
    X(cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", 0)                  \
    X(cuCtxSetCurrent, "cuCtxSetCurrent", 0)                                     \
    X(cuCtxGetCurrent, "cuCtxGetCurrent", 0)                                     \
    X(cuCtxGetDevice, "cuCtxGetDevice", 0)                                       \
    X(cuCtxCreate_v4, "cuCtxCreate", 12050)                                      \
    X(cuCtxDestroy_v2, "cuCtxDestroy", 0)                                        \
    X(cuCtxPopCurrent_v2, "cuCtxPopCurrent", 0)                                  \
    X(cuCtxSynchronize, "cuCtxSynchronize", 0)                                   \
    X(cuMemAlloc_v2, "cuMemAlloc", 0)                                            \
    X(cuMemAllocPitch_v2, "cuMemAllocPitch", 0)                                  \
    X(cuMemAllocManaged, "cuMemAllocManaged", 0)                                 \
    X(cuMemFree_v2, "cuMemFree", 0)                                              \
    X(cuMemGetInfo_v2, "cuMemGetInfo", 0)                                        \
    X(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 0)                                \
    X(cuMemAllocAsync, "cuMemAllocAsync", 0)                                     \
    X(cuMemFreeAsync, "cuMemFreeAsync", 0)                                       \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 0)                     \
    X(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", 0)                 \
    X(cuMemPoolCreate, "cuMemPoolCreate", 0)                                     \
    X(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", 0)                         \
    X(cuMemPoolGetAttribute, "cuMemPoolGetAttribute", 0)                         \
    X(cuMemPoolTrimTo, "cuMemPoolTrimTo", 0)                                     \
    X(cuStreamSynchronize, "cuStreamSynchronize", 0)                             \
    X(cuStreamCreate, "cuStreamCreate", 0)                                       \
    X(cuStreamDestroy_v2, "cuStreamDestroy", 0)                                  \
    X(cuStreamGetCtx, "cuStreamGetCtx", 0)                                       \
    X(cuStreamGetDevice, "cuStreamGetDevice", 12080)                             \
    X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 0)                        \
    X(cuStreamEndCapture, "cuStreamEndCapture", 0)                               \
    X(cuStreamIsCapturing, "cuStreamIsCapturing", 0)                             \
    X(cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode", 0) \
    X(cuGraphCreate, "cuGraphCreate", 0)                                         \
    X(cuGraphDestroy, "cuGraphDestroy", 0)                                       \
    X(cuGraphAddMemAllocNode, "cuGraphAddMemAllocNode", 0)                       \
    X(cuGraphAddMemFreeNode, "cuGraphAddMemFreeNode", 0)                         \
    X(cuGraphMemAllocNodeGetParams, "cuGraphMemAllocNodeGetParams", 0)           \
    X(cuGraphGetNodes, "cuGraphGetNodes", 0)                                     \
    X(cuGraphNodeGetType, "cuGraphNodeGetType", 0)                               \
    X(cuGraphInstantiateWithFlags, "cuGraphInstantiate", 0)                      \
    X(cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams", 0)           \
    X(cuGraphUpload, "cuGraphUpload", 0)                                         \
    X(cuGraphLaunch, "cuGraphLaunch", 0)                                         \
    X(cuGraphExecDestroy, "cuGraphExecDestroy", 0)                               \
    X(cuDeviceGetGraphMemAttribute, "cuDeviceGetGraphMemAttribute", 0)           \
    X(cuDeviceSetGraphMemAttribute, "cuDeviceSetGraphMemAttribute", 0)           \
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
    X(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 0)                     \
    X(cuModuleLoad, "cuModuleLoad", 0)                                           \
    X(cuModuleLoadData, "cuModuleLoadData", 0)                                   \
    X(cuModuleUnload, "cuModuleUnload", 0)                                       \
    X(cuLibraryLoadData, "cuLibraryLoadData", 0)                                 \
    X(cuLibraryUnload, "cuLibraryUnload", 0)                                     \
    X(cuLibraryGetGlobal, "cuLibraryGetGlobal", 0)                               \
    X(cuLibraryGetKernel, "cuLibraryGetKernel", 0)                               \
    X(cuCtxSetLimit, "cuCtxSetLimit", 0)                                         \
    X(cuCtxGetLimit, "cuCtxGetLimit", 0)                                         \
    X(cuLaunchKernel, "cuLaunchKernel", 0)

#define FIELD(c, b, v) __typeof__(&c) c;
static struct {
    CLIENT_FUNCS(FIELD)
} api;
#undef FIELD

enum mode { M_GPA, M_GPA_PTSZ, M_GPA_LEGACY, M_DLSYM, M_LINKED };
static enum mode g_mode;
static void *g_cuda; /* dlopen handle of libcuda.so.1 (NULL in linked mode) */
static __typeof__(&cuGetProcAddress_v2) g_gpa2;
static __typeof__(&cuGetProcAddress) g_gpa1;
static CUcontext g_ctx;

/* ---------- output ---------- */

static void out(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void out(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
}

static void usage_error(const char *op, const char *why) {
    fprintf(stderr, "client: cannot parse op '%s': %s\n", op, why);
    exit(2);
}

/* ---------- resolution ---------- */

static void *resolve(const char *concrete, const char *base, int version) {
    void *p = NULL;
    int status = 0;
    switch (g_mode) {
    case M_GPA:
    case M_GPA_PTSZ:
        if (g_gpa2(base, &p, 13000, g_mode == M_GPA_PTSZ ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0,
                   &status) != CUDA_SUCCESS)
            p = NULL;
        break;
    case M_GPA_LEGACY:
        if (g_gpa1(base, &p, version > 12000 ? version : 12000, 0) != CUDA_SUCCESS) p = NULL;
        break;
    case M_DLSYM: p = dlsym(g_cuda, concrete); break;
    case M_LINKED: p = dlsym(RTLD_DEFAULT, concrete); break;
    }
    return p;
}

static void resolve_all(void) {
#ifdef LINKED
    if (g_mode == M_LINKED) {
#define DIRECT(c, b, v) api.c = &c;
        CLIENT_FUNCS(DIRECT)
#undef DIRECT
        return;
    }
#endif
    g_cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!g_cuda) {
        out("resolve:libcuda.so.1 rc=-1 err=%s", dlerror());
        exit(3);
    }
    if (g_mode == M_GPA || g_mode == M_GPA_PTSZ) {
        g_gpa2 = (__typeof__(g_gpa2))dlsym(g_cuda, "cuGetProcAddress_v2");
        if (!g_gpa2) {
            out("resolve:cuGetProcAddress_v2 rc=-1");
            exit(3);
        }
    } else if (g_mode == M_GPA_LEGACY) {
        g_gpa1 = (__typeof__(g_gpa1))dlsym(g_cuda, "cuGetProcAddress");
        if (!g_gpa1) {
            out("resolve:cuGetProcAddress rc=-1");
            exit(3);
        }
    }
#define RESOLVE(c, b, v)                                       \
    api.c = (__typeof__(api.c))resolve(#c, b, v);              \
    if (!api.c) {                                              \
        out("resolve:%s rc=-1", g_mode == M_DLSYM ? #c : b);   \
        exit(3);                                               \
    }
    CLIENT_FUNCS(RESOLVE)
#undef RESOLVE
}

/* fake_cuda_used / fake_cuda_peak: from the libcuda handle, or the global scope when linked. */
static void *helper(const char *name) { return dlsym(g_cuda ? g_cuda : RTLD_DEFAULT, name); }

/* ---------- parsing ---------- */

static int parse_u64(const char *s, u64 *out_v) {
    if (!s || !*s || *s == '-') return -1;
    if (!strcmp(s, "max")) {
        *out_v = ~0ull;
        return 0;
    }
    char *end;
    errno = 0;
    u64 v = strtoull(s, &end, (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) ? 16 : 10);
    if (errno || end == s) return -1;
    unsigned shift = 0;
    if (!strcmp(end, "Ki")) shift = 10;
    else if (!strcmp(end, "Mi")) shift = 20;
    else if (!strcmp(end, "Gi")) shift = 30;
    else if (!strcmp(end, "Ti")) shift = 40;
    else if (*end) return -1;
    if (shift && v > (~0ull >> shift)) return -1;
    *out_v = v << shift;
    return 0;
}

#define MAX_FIELDS 8
struct op {
    const char *text;
    char buf[256];
    char *f[MAX_FIELDS]; /* f[0] = op name */
    int n;
};

static void split(struct op *op, const char *text) {
    op->text = text;
    snprintf(op->buf, sizeof op->buf, "%s", text);
    op->n = 0;
    char *save = NULL;
    for (char *t = strtok_r(op->buf, ":", &save); t && op->n < MAX_FIELDS; t = strtok_r(NULL, ":", &save))
        op->f[op->n++] = t;
}

static u64 num_field(struct op *op, int i) {
    u64 v;
    if (i >= op->n || parse_u64(op->f[i], &v) != 0) usage_error(op->text, "bad or missing number");
    return v;
}

static void need_fields(struct op *op, int n) {
    if (op->n != n) usage_error(op->text, "wrong number of fields");
}

/* ---------- slots ---------- */

enum slot_kind { S_PTR, S_ASYNC, S_VMM, S_ARRAY, S_MIPMAP, S_GRAPH, S_MODULE, S_LIBRARY };
struct slot {
    enum slot_kind kind;
    u64 value;
    u64 size;
    u64 va;
};
static struct slot *g_slots;
static size_t g_nslots, g_capslots;
static CUmemoryPool g_pools[256];
static size_t g_npools;
/* Handles the new ops create, each in its own numbering (stream=<k>, graph=<g>, ...). */
#define MAX_HANDLES 256
static CUstream g_streams[MAX_HANDLES];
static size_t g_nstreams;
static CUgraph g_graphs[MAX_HANDLES];
static size_t g_ngraphs;
static CUgraphExec g_execs[MAX_HANDLES];
static size_t g_nexecs;
static CUcontext g_cctxs[MAX_HANDLES];
static CUcontext g_prim[64]; /* primary contexts as `ctx:DEV` (and the start) retained them */
static size_t g_ncctxs;

static size_t add_slot(enum slot_kind kind, u64 value, u64 size) {
    if (g_nslots == g_capslots) {
        size_t n = g_capslots ? g_capslots * 2 : 64;
        struct slot *s = realloc(g_slots, n * sizeof *s);
        if (!s) {
            perror("client: realloc");
            exit(4);
        }
        g_slots = s;
        g_capslots = n;
    }
    g_slots[g_nslots] = (struct slot){kind, value, size, 0};
    return g_nslots++;
}

static struct slot *slot_field(struct op *op, int i) {
    u64 k = num_field(op, i);
    if (k >= g_nslots) usage_error(op->text, "no such slot");
    return &g_slots[k];
}

static u64 index_field(struct op *op, int i, size_t n, const char *what) {
    u64 k = num_field(op, i);
    if (k >= n) usage_error(op->text, what);
    return k;
}

/* A stream argument: a `stream` slot, or null / legacy / ptds. */
static CUstream stream_field(struct op *op, int i) {
    if (i < op->n && !strcmp(op->f[i], "null")) return NULL;
    if (i < op->n && !strcmp(op->f[i], "legacy")) return CU_STREAM_LEGACY;
    if (i < op->n && !strcmp(op->f[i], "ptds")) return CU_STREAM_PER_THREAD;
    return g_streams[index_field(op, i, g_nstreams, "no such stream")];
}

static const char *const k_capmodes[] = {"global", "thread", "relaxed"};

static int capmode_field(struct op *op, int i) {
    for (int m = 0; m < 3; m++)
        if (i < op->n && !strcmp(op->f[i], k_capmodes[m])) return m;
    usage_error(op->text, "mode must be global, thread or relaxed");
    return -1;
}

/* A context as the new ops print it: p<dev> (a primary context), c<k> (ctxcreate slot). */
static void ctx_name(CUcontext c, char *buf, size_t len) {
    for (size_t k = 0; k < g_ncctxs; k++)
        if (g_cctxs[k] == c) {
            snprintf(buf, len, "c%zu", k);
            return;
        }
    for (int d = 0; d < 64; d++)
        if (c && g_prim[d] == c) {
            snprintf(buf, len, "p%d", d);
            return;
        }
    snprintf(buf, len, c ? "?" : "none");
}

static void print_alloc(const char *name, int rc, enum slot_kind kind, u64 value, u64 size) {
    if (rc == CUDA_SUCCESS) {
        size_t k = add_slot(kind, value, size);
        out("%s rc=%d slot=%zu ptr=0x%llx", name, rc, k, value);
    } else {
        out("%s rc=%d", name, rc);
    }
}

static int current_device(CUdevice *dev) { return api.cuCtxGetDevice(dev); }

static CUmemoryPool default_pool(int *rc) {
    CUdevice dev = 0;
    CUmemoryPool pool = NULL;
    *rc = current_device(&dev);
    if (*rc == CUDA_SUCCESS) *rc = api.cuDeviceGetDefaultMemPool(&pool, dev);
    return pool;
}

/* ---------- races ---------- */

struct race {
    u64 iters, size;
    u64 ok, denied, other;
    pthread_barrier_t start, hold;
};

static void short_pause(void) {
    struct timespec ts = {0, 3000};
    nanosleep(&ts, NULL);
}

static void *race_thread(void *arg) {
    struct race *r = arg;
    api.cuCtxSetCurrent(g_ctx);
    pthread_barrier_wait(&r->start);
    for (u64 i = 0; i < r->iters; i++) {
        CUdeviceptr p;
        int rc = api.cuMemAlloc_v2(&p, r->size);
        if (rc == CUDA_SUCCESS) {
            __atomic_add_fetch(&r->ok, 1, __ATOMIC_RELAXED);
            short_pause();
            if (api.cuMemFree_v2(p) != CUDA_SUCCESS) __atomic_add_fetch(&r->other, 1, __ATOMIC_RELAXED);
        } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            __atomic_add_fetch(&r->denied, 1, __ATOMIC_RELAXED);
        } else {
            __atomic_add_fetch(&r->other, 1, __ATOMIC_RELAXED);
        }
    }
    return NULL;
}

static void *racehold_thread(void *arg) {
    struct race *r = arg;
    api.cuCtxSetCurrent(g_ctx);
    size_t n = 0, cap = 64;
    CUdeviceptr *held = malloc(cap * sizeof *held);
    pthread_barrier_wait(&r->start);
    int rc = CUDA_SUCCESS;
    while (held && n < (1u << 24)) {
        CUdeviceptr p;
        rc = api.cuMemAlloc_v2(&p, r->size);
        if (rc != CUDA_SUCCESS) break;
        if (n == cap) {
            CUdeviceptr *h = realloc(held, 2 * cap * sizeof *h);
            if (!h) {
                api.cuMemFree_v2(p);
                break;
            }
            held = h;
            cap *= 2;
        }
        held[n++] = p;
    }
    __atomic_add_fetch(&r->ok, n, __ATOMIC_RELAXED);
    __atomic_add_fetch(rc == CUDA_ERROR_OUT_OF_MEMORY ? &r->denied : &r->other, 1, __ATOMIC_RELAXED);
    pthread_barrier_wait(&r->hold); /* everyone holds its maximum at the same time */
    for (size_t i = 0; i < n; i++) api.cuMemFree_v2(held[i]);
    free(held);
    return NULL;
}

/* asyncrelay: each thread allocates stream-ordered blocks and hands them to the next
 * thread, which frees them (as PyTorch's autograd thread frees what the forward pass
 * allocated). Mailboxes are small stacks under one mutex. syncrelay: the same with
 * cuMemAlloc and cuMemFree. */
#define RELAY_MAX_THREADS 64
#define RELAY_BOX 256
static struct relay_box {
    CUdeviceptr p[RELAY_BOX];
    unsigned n;
} g_boxes[RELAY_MAX_THREADS];
static pthread_mutex_t g_relay_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned g_relay_threads, g_relay_next;
static int g_relay_sync;

static int relay_alloc(CUdeviceptr *p, u64 size) {
    return g_relay_sync ? api.cuMemAlloc_v2(p, size) : api.cuMemAllocAsync(p, size, NULL);
}

static int relay_free(CUdeviceptr p) {
    return g_relay_sync ? api.cuMemFree_v2(p) : api.cuMemFreeAsync(p, NULL);
}

static void relay_drain(struct race *r, unsigned me) {
    for (;;) {
        pthread_mutex_lock(&g_relay_mu);
        CUdeviceptr p = g_boxes[me].n ? g_boxes[me].p[--g_boxes[me].n] : 0;
        pthread_mutex_unlock(&g_relay_mu);
        if (!p) return;
        if (relay_free(p) != CUDA_SUCCESS) __atomic_add_fetch(&r->other, 1, __ATOMIC_RELAXED);
    }
}

static void *relay_thread(void *arg) {
    struct race *r = arg;
    unsigned me = __atomic_fetch_add(&g_relay_next, 1, __ATOMIC_RELAXED);
    unsigned next = (me + 1) % g_relay_threads;
    api.cuCtxSetCurrent(g_ctx);
    pthread_barrier_wait(&r->start);
    for (u64 i = 0; i < r->iters; i++) {
        CUdeviceptr p;
        int rc = relay_alloc(&p, r->size);
        if (rc == CUDA_SUCCESS) {
            __atomic_add_fetch(&r->ok, 1, __ATOMIC_RELAXED);
            pthread_mutex_lock(&g_relay_mu);
            int full = g_boxes[next].n == RELAY_BOX;
            if (!full) g_boxes[next].p[g_boxes[next].n++] = p;
            pthread_mutex_unlock(&g_relay_mu);
            if (full && relay_free(p) != CUDA_SUCCESS) __atomic_add_fetch(&r->other, 1, __ATOMIC_RELAXED);
        } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            __atomic_add_fetch(&r->denied, 1, __ATOMIC_RELAXED);
        } else {
            __atomic_add_fetch(&r->other, 1, __ATOMIC_RELAXED);
        }
        relay_drain(r, me);
    }
    pthread_barrier_wait(&r->hold); /* nobody sends any more */
    relay_drain(r, me);
    return NULL;
}

/* synckeep: each thread allocates ITERS blocks with cuMemAlloc, keeps them in one list
 * and exits with them live; `freekept` frees the list from the calling thread (as a
 * program frees what its finished workers allocated). */
#define KEPT_MAX 65536
static CUdeviceptr g_kept[KEPT_MAX];
static unsigned g_nkept;

static void *keep_thread(void *arg) {
    struct race *r = arg;
    api.cuCtxSetCurrent(g_ctx);
    pthread_barrier_wait(&r->start);
    for (u64 i = 0; i < r->iters; i++) {
        CUdeviceptr p;
        int rc = api.cuMemAlloc_v2(&p, r->size);
        if (rc == CUDA_SUCCESS) {
            pthread_mutex_lock(&g_relay_mu);
            int full = g_nkept == KEPT_MAX;
            if (!full) g_kept[g_nkept++] = p;
            pthread_mutex_unlock(&g_relay_mu);
            if (full) {
                api.cuMemFree_v2(p);
                __atomic_add_fetch(&r->other, 1, __ATOMIC_RELAXED);
            } else {
                __atomic_add_fetch(&r->ok, 1, __ATOMIC_RELAXED);
            }
        } else {
            __atomic_add_fetch(rc == CUDA_ERROR_OUT_OF_MEMORY ? &r->denied : &r->other, 1, __ATOMIC_RELAXED);
        }
    }
    return NULL;
}

/* keydtor: each thread's only CUDA calls are made from a pthread-key destructor, which
 * glibc runs after the thread-local destructors (as a library cleaning up per-thread
 * state at thread exit would): a stream-ordered pair, then the thread is gone. */
static pthread_key_t g_keydtor_key;

static void keydtor_cleanup(void *arg) {
    struct race *r = arg;
    CUdeviceptr p;
    int rc = api.cuMemAllocAsync(&p, r->size, NULL);
    if (rc == CUDA_SUCCESS) rc = api.cuMemFreeAsync(p, NULL);
    __atomic_add_fetch(rc == CUDA_SUCCESS ? &r->ok : rc == CUDA_ERROR_OUT_OF_MEMORY ? &r->denied : &r->other, 1,
                       __ATOMIC_RELAXED);
}

static void *keydtor_thread(void *arg) {
    api.cuCtxSetCurrent(g_ctx);
    pthread_setspecific(g_keydtor_key, arg);
    return NULL;
}

static struct race *run_threads(u64 threads, u64 iters, u64 size, void *(*fn)(void *)) {
    static struct race r;
    memset(&r, 0, sizeof r);
    r.iters = iters;
    r.size = size;
    pthread_barrier_init(&r.start, NULL, (unsigned)threads);
    pthread_barrier_init(&r.hold, NULL, (unsigned)threads);
    pthread_t *t = calloc(threads, sizeof *t);
    if (!t) exit(4);
    for (u64 i = 0; i < threads; i++)
        if (pthread_create(&t[i], NULL, fn, &r) != 0) {
            perror("client: pthread_create");
            exit(4);
        }
    for (u64 i = 0; i < threads; i++) pthread_join(t[i], NULL);
    free(t);
    pthread_barrier_destroy(&r.start);
    pthread_barrier_destroy(&r.hold);
    return &r;
}

/* limitrace and limitalloc: concurrent cuCtxSetLimit calls ordered through the fake's
 * limit hook (fake_cuda_limit_hook). Each thread has a role; the hook acts only on the
 * calls of threads with one. */
static __thread int t_limit_role; /* 1: the first setter (or the only one), 2: the second */
static pthread_mutex_t g_lim_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_lim_cv = PTHREAD_COND_INITIALIZER;
static int g_lim_read[3], g_lim_set1, g_lim_alloc_go, g_lim_alloc_done;
static u64 g_lim_alloc_size;
static CUdeviceptr g_lim_alloc_ptr;
static int g_lim_alloc_rc;
static CUcontext g_lim_ctx;

/* Waits (g_lim_mu held) until *flag is set, for at most a second: the ordering is asked
 * for, not required (a library that serialises the calls never lets the other thread
 * arrive while it waits). */
static void lim_wait(const int *flag) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 1;
    while (!*flag)
        if (pthread_cond_timedwait(&g_lim_cv, &g_lim_mu, &until) != 0) break;
}

/* limitrace: each setter's first cuCtxGetLimit waits for the other's (both read the old
 * value), and the second setter's cuCtxSetLimit waits until the first's is done. */
static void race_hook(int phase, int limit, size_t value) {
    (void)limit, (void)value;
    int role = t_limit_role;
    if (!role) return;
    pthread_mutex_lock(&g_lim_mu);
    if (phase == 0 && !g_lim_read[role]) {
        g_lim_read[role] = 1;
        pthread_cond_broadcast(&g_lim_cv);
        lim_wait(&g_lim_read[3 - role]);
    } else if (phase == 1 && role == 2) {
        lim_wait(&g_lim_set1);
    } else if (phase == 2 && role == 1) {
        g_lim_set1 = 1;
        pthread_cond_broadcast(&g_lim_cv);
    }
    pthread_mutex_unlock(&g_lim_mu);
}

struct limit_setter {
    int role, limit;
    size_t value;
    int rc;
};

static void *limit_setter_thread(void *arg) {
    struct limit_setter *s = arg;
    api.cuCtxSetCurrent(g_lim_ctx);
    t_limit_role = s->role;
    s->rc = api.cuCtxSetLimit(s->limit, s->value);
    return NULL;
}

/* limitalloc: inside the setter's cuCtxSetLimit, another thread allocates (cuMemAlloc)
 * and the call goes on once the allocation returned. */
static void alloc_hook(int phase, int limit, size_t value) {
    (void)limit, (void)value;
    if (t_limit_role != 1 || phase != 1) return;
    pthread_mutex_lock(&g_lim_mu);
    g_lim_alloc_go = 1;
    pthread_cond_broadcast(&g_lim_cv);
    while (!g_lim_alloc_done) pthread_cond_wait(&g_lim_cv, &g_lim_mu);
    pthread_mutex_unlock(&g_lim_mu);
}

static void *limit_alloc_thread(void *arg) {
    (void)arg;
    api.cuCtxSetCurrent(g_lim_ctx);
    pthread_mutex_lock(&g_lim_mu);
    while (!g_lim_alloc_go) pthread_cond_wait(&g_lim_cv, &g_lim_mu);
    pthread_mutex_unlock(&g_lim_mu);
    CUdeviceptr p = 0;
    int rc = api.cuMemAlloc_v2(&p, g_lim_alloc_size);
    pthread_mutex_lock(&g_lim_mu);
    g_lim_alloc_rc = rc;
    g_lim_alloc_ptr = p;
    g_lim_alloc_done = 1;
    pthread_cond_broadcast(&g_lim_cv);
    pthread_mutex_unlock(&g_lim_mu);
    return NULL;
}

static void set_limit_hook(void (*hook)(int, int, size_t)) {
    void (*set)(void (*)(int, int, size_t)) = (void (*)(void (*)(int, int, size_t)))helper("fake_cuda_limit_hook");
    if (!set) {
        fprintf(stderr, "client: the driver has no fake_cuda_limit_hook\n");
        exit(4);
    }
    set(hook);
}

static void join_or_die(pthread_t t) {
    if (pthread_join(t, NULL) != 0) exit(4);
}

static void start_or_die(pthread_t *t, void *(*fn)(void *), void *arg) {
    if (pthread_create(t, NULL, fn, arg) != 0) {
        perror("client: pthread_create");
        exit(4);
    }
}

/* ---------- NVML ---------- */

typedef struct { unsigned long long total, free, used; } nvml_mem1;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvml_mem2;

static void op_nvml(struct op *op) {
    need_fields(op, 2);
    u64 idx = num_field(op, 1);
    static void *h;
    if (!h) h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    int (*init)(void) = h ? (int (*)(void))dlsym(h, "nvmlInit_v2") : NULL;
    int (*by_index)(unsigned, void **) = h ? (int (*)(unsigned, void **))dlsym(h, "nvmlDeviceGetHandleByIndex_v2") : NULL;
    int (*mem1)(void *, nvml_mem1 *) = h ? (int (*)(void *, nvml_mem1 *))dlsym(h, "nvmlDeviceGetMemoryInfo") : NULL;
    int (*mem2)(void *, nvml_mem2 *) = h ? (int (*)(void *, nvml_mem2 *))dlsym(h, "nvmlDeviceGetMemoryInfo_v2") : NULL;
    if (!init || !by_index || !mem1 || !mem2) {
        out("nvml rc=-1");
        return;
    }
    nvml_mem1 m1 = {0, 0, 0};
    nvml_mem2 m2 = {(unsigned)sizeof(nvml_mem2) | (2u << 24), 0, 0, 0, 0};
    void *dev = NULL;
    int rc = init();
    if (rc == 0) rc = by_index((unsigned)idx, &dev);
    if (rc == 0) rc = mem1(dev, &m1);
    if (rc == 0) rc = mem2(dev, &m2);
    out("nvml rc=%d total=%llu free=%llu used=%llu total2=%llu free2=%llu used2=%llu", rc, m1.total, m1.free, m1.used,
        m2.total, m2.free, m2.used);
}

/* ---------- ops ---------- */

static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static void op_sym(struct op *op) {
    if (op->n != 2) usage_error(op->text, "sym:NAME");
    void *p = resolve(op->f[1], op->f[1], 0);
    Dl_info info;
    if (!p) {
        out("sym rc=-1 lib= name=");
    } else if (dladdr(p, &info) && info.dli_fname) {
        out("sym rc=0 lib=%s name=%s", base_name(info.dli_fname), info.dli_sname ? info.dli_sname : "?");
    } else {
        out("sym rc=0 lib=? name=?");
    }
}

static int vmm_prop(CUmemAllocationProp *prop, int kind) {
    memset(prop, 0, sizeof *prop);
    CUdevice dev = 0;
    int rc = current_device(&dev);
    prop->type = 1;
    prop->location.type = kind == 2 ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = kind == 2 ? 0 : dev;
    if (kind == 1) prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
    return rc;
}

static void run_op(const char *text) {
    struct op o, *op = &o;
    split(op, text);
    if (op->n == 0) usage_error(text, "empty op");
    const char *name = op->f[0];
    int rc;

    if (!strcmp(name, "ctx")) {
        need_fields(op, 2);
        CUdevice dev;
        rc = api.cuDeviceGet(&dev, (int)num_field(op, 1));
        CUcontext c = NULL;
        if (rc == CUDA_SUCCESS) rc = api.cuDevicePrimaryCtxRetain(&c, dev);
        if (rc == CUDA_SUCCESS) rc = api.cuCtxSetCurrent(c);
        if (rc == CUDA_SUCCESS) g_ctx = c;
        if (rc == CUDA_SUCCESS && dev >= 0 && dev < 64) g_prim[dev] = c;
        out("ctx rc=%d", rc);
    } else if (!strcmp(name, "ctxrelease") || !strcmp(name, "ctxreset")) {
        need_fields(op, 2);
        CUdevice dev;
        rc = api.cuDeviceGet(&dev, (int)num_field(op, 1));
        if (rc == CUDA_SUCCESS)
            rc = !strcmp(name, "ctxrelease") ? api.cuDevicePrimaryCtxRelease_v2(dev) : api.cuDevicePrimaryCtxReset_v2(dev);
        out("%s rc=%d", name, rc);
    } else if (!strcmp(name, "alloc")) {
        need_fields(op, 2);
        u64 size = num_field(op, 1);
        CUdeviceptr p = 0;
        rc = api.cuMemAlloc_v2(&p, size);
        print_alloc("alloc", rc, S_PTR, p, size);
    } else if (!strcmp(name, "pitch")) {
        need_fields(op, 3);
        u64 w = num_field(op, 1), h = num_field(op, 2);
        CUdeviceptr p = 0;
        size_t pitch = 0;
        rc = api.cuMemAllocPitch_v2(&p, &pitch, w, h, 4);
        if (rc == CUDA_SUCCESS) {
            size_t k = add_slot(S_PTR, p, (u64)pitch * h);
            out("pitch rc=%d slot=%zu pitch=%zu ptr=0x%llx", rc, k, pitch, p);
        } else {
            out("pitch rc=%d", rc);
        }
    } else if (!strcmp(name, "managed")) {
        need_fields(op, 2);
        u64 size = num_field(op, 1);
        CUdeviceptr p = 0;
        rc = api.cuMemAllocManaged(&p, size, 1);
        print_alloc("managed", rc, S_PTR, p, size);
    } else if (!strcmp(name, "free")) {
        need_fields(op, 2);
        out("free rc=%d", api.cuMemFree_v2(slot_field(op, 1)->value));
    } else if (!strcmp(name, "freeptr")) {
        need_fields(op, 2);
        char *end;
        errno = 0;
        u64 p = strtoull(op->f[1], &end, 16);
        if (errno || *end) usage_error(text, "freeptr:HEX");
        out("freeptr rc=%d", api.cuMemFree_v2(p));
    } else if (!strcmp(name, "info")) {
        need_fields(op, 1);
        size_t f = 0, t = 0;
        rc = api.cuMemGetInfo_v2(&f, &t);
        out("info rc=%d free=%zu total=%zu", rc, f, t);
    } else if (!strcmp(name, "infountil")) {
        /* infountil:FREE: a view every 5 ms until one shows FREE bytes free (30 s at
         * most): steps with a re-read the library's background thread makes due, where a
         * sleep would race it on a busy machine. rc=1: never shown. */
        need_fields(op, 2);
        u64 want = num_field(op, 1);
        size_t f = 0, t = 0;
        int waited = 0;
        for (;;) {
            rc = api.cuMemGetInfo_v2(&f, &t);
            if (rc != CUDA_SUCCESS || f == want || waited >= 30000) break;
            struct timespec ts = {0, 5 * 1000000L};
            nanosleep(&ts, NULL);
            waited += 5;
        }
        out("infountil rc=%d free=%zu total=%zu", rc != CUDA_SUCCESS ? (int)rc : (f == want ? 0 : 1), f, t);
    } else if (!strcmp(name, "total")) {
        need_fields(op, 2);
        CUdevice dev;
        size_t bytes = 0;
        rc = api.cuDeviceGet(&dev, (int)num_field(op, 1));
        if (rc == CUDA_SUCCESS) rc = api.cuDeviceTotalMem_v2(&bytes, dev);
        out("total rc=%d bytes=%zu", rc, bytes);
    } else if (!strcmp(name, "async")) {
        need_fields(op, 2);
        u64 size = num_field(op, 1);
        CUdeviceptr p = 0;
        rc = api.cuMemAllocAsync(&p, size, NULL);
        print_alloc("async", rc, S_ASYNC, p, size);
    } else if (!strcmp(name, "freeasync")) {
        need_fields(op, 2);
        out("freeasync rc=%d", api.cuMemFreeAsync(slot_field(op, 1)->value, NULL));
    } else if (!strcmp(name, "poolasync")) {
        need_fields(op, 2);
        u64 size = num_field(op, 1);
        CUdeviceptr p = 0;
        CUmemoryPool pool = default_pool(&rc);
        if (rc == CUDA_SUCCESS) rc = api.cuMemAllocFromPoolAsync(&p, size, pool, NULL);
        print_alloc("poolasync", rc, S_ASYNC, p, size);
    } else if (!strcmp(name, "newpool")) {
        need_fields(op, 1);
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        CUdevice dev = 0;
        CUmemoryPool pool = NULL;
        rc = current_device(&dev);
        props.allocType = 1;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = dev;
        if (rc == CUDA_SUCCESS) rc = api.cuMemPoolCreate(&pool, &props);
        if (rc == CUDA_SUCCESS && g_npools < sizeof g_pools / sizeof g_pools[0]) {
            g_pools[g_npools] = pool;
            out("newpool rc=%d pool=%zu", rc, g_npools++);
        } else {
            out("newpool rc=%d", rc);
        }
    } else if (!strcmp(name, "poolasyncin")) {
        need_fields(op, 3);
        u64 k = num_field(op, 1), size = num_field(op, 2);
        if (k >= g_npools) usage_error(text, "no such pool");
        CUdeviceptr p = 0;
        rc = api.cuMemAllocFromPoolAsync(&p, size, g_pools[k], NULL);
        print_alloc("poolasyncin", rc, S_ASYNC, p, size);
    } else if (!strcmp(name, "threshold")) {
        need_fields(op, 2);
        u64 v = num_field(op, 1);
        CUmemoryPool pool = default_pool(&rc);
        if (rc == CUDA_SUCCESS) rc = api.cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &v);
        out("threshold rc=%d", rc);
    } else if (!strcmp(name, "reserve") || !strcmp(name, "poolused")) {
        need_fields(op, 1);
        u64 v = 0;
        int attr = name[0] == 'r' ? CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT : CU_MEMPOOL_ATTR_USED_MEM_CURRENT;
        CUmemoryPool pool = default_pool(&rc);
        if (rc == CUDA_SUCCESS) rc = api.cuMemPoolGetAttribute(pool, attr, &v);
        out("%s rc=%d bytes=%llu", name, rc, v);
    } else if (!strcmp(name, "trim")) {
        need_fields(op, 2);
        u64 keep = num_field(op, 1);
        CUmemoryPool pool = default_pool(&rc);
        if (rc == CUDA_SUCCESS) rc = api.cuMemPoolTrimTo(pool, keep);
        out("trim rc=%d", rc);
    } else if (!strcmp(name, "sync")) {
        need_fields(op, 1);
        out("sync rc=%d", api.cuStreamSynchronize(NULL));
    } else if (!strcmp(name, "create") || !strcmp(name, "createfabric") || !strcmp(name, "createhost")) {
        need_fields(op, 2);
        u64 size = num_field(op, 1);
        CUmemAllocationProp prop;
        CUmemGenericAllocationHandle h = 0;
        rc = vmm_prop(&prop, !strcmp(name, "create") ? 0 : !strcmp(name, "createfabric") ? 1 : 2);
        if (rc == CUDA_SUCCESS) rc = api.cuMemCreate(&h, size, &prop, 0);
        print_alloc(name, rc, S_VMM, h, size);
    } else if (!strcmp(name, "map")) {
        need_fields(op, 2);
        struct slot *s = slot_field(op, 1);
        CUdeviceptr va = 0;
        rc = api.cuMemAddressReserve(&va, s->size, 0, 0, 0);
        if (rc == CUDA_SUCCESS) {
            rc = api.cuMemMap(va, s->size, 0, s->value, 0);
            if (rc == CUDA_SUCCESS) s->va = va;
            else api.cuMemAddressFree(va, s->size);
        }
        out("map rc=%d", rc);
    } else if (!strcmp(name, "unmap")) {
        need_fields(op, 2);
        struct slot *s = slot_field(op, 1);
        rc = api.cuMemUnmap(s->va, s->size);
        if (rc == CUDA_SUCCESS) {
            api.cuMemAddressFree(s->va, s->size);
            s->va = 0;
        }
        out("unmap rc=%d", rc);
    } else if (!strcmp(name, "release")) {
        need_fields(op, 2);
        out("release rc=%d", api.cuMemRelease(slot_field(op, 1)->value));
    } else if (!strcmp(name, "array")) {
        need_fields(op, 5);
        CUDA_ARRAY_DESCRIPTOR d = {num_field(op, 1), num_field(op, 2), (int)num_field(op, 3), (unsigned)num_field(op, 4)};
        CUarray a = NULL;
        rc = api.cuArrayCreate_v2(&a, &d);
        print_alloc("array", rc, S_ARRAY, (u64)(uintptr_t)a, 0);
    } else if (!strcmp(name, "array3d") || !strcmp(name, "mipmap")) {
        int mip = name[0] == 'm';
        need_fields(op, mip ? 7 : 6);
        CUDA_ARRAY3D_DESCRIPTOR d = {num_field(op, 1), num_field(op, 2), num_field(op, 3), (int)num_field(op, 4),
                                     (unsigned)num_field(op, 5), 0};
        if (mip) {
            CUmipmappedArray a = NULL;
            rc = api.cuMipmappedArrayCreate(&a, &d, (unsigned)num_field(op, 6));
            print_alloc("mipmap", rc, S_MIPMAP, (u64)(uintptr_t)a, 0);
        } else {
            CUarray a = NULL;
            rc = api.cuArray3DCreate_v2(&a, &d);
            print_alloc("array3d", rc, S_ARRAY, (u64)(uintptr_t)a, 0);
        }
    } else if (!strcmp(name, "modload") || !strcmp(name, "libload")) {
        /* a module (its globals arrive at the load) or a library (lazy: at its first look-up) */
        need_fields(op, 1);
        static const char image[16] = "fake image";
        if (name[0] == 'm') {
            CUmodule m = NULL;
            rc = api.cuModuleLoadData(&m, image);
            print_alloc("modload", rc, S_MODULE, (u64)(uintptr_t)m, 0);
        } else {
            CUlibrary l = NULL;
            rc = api.cuLibraryLoadData(&l, image, NULL, NULL, 0, NULL, NULL, 0);
            print_alloc("libload", rc, S_LIBRARY, (u64)(uintptr_t)l, 0);
        }
    } else if (!strcmp(name, "modimage") || !strcmp(name, "libimage") || !strcmp(name, "modfile")) {
        /* modimage:PATH / libimage:PATH: the file's bytes loaded from memory (a module, a
         * library); modfile:PATH: the module loaded by its path */
        need_fields(op, 2);
        const char *path = op->f[1];
        if (name[3] == 'f') {
            CUmodule m = NULL;
            rc = api.cuModuleLoad(&m, path);
            print_alloc(name, rc, S_MODULE, (u64)(uintptr_t)m, 0);
        } else {
            FILE *f = fopen(path, "rb");
            if (!f) usage_error(op->text, "cannot open the image");
            static unsigned char image[1 << 20];
            size_t len = fread(image, 1, sizeof image - 1, f);
            image[len] = 0;
            fclose(f);
            if (name[0] == 'm') {
                CUmodule m = NULL;
                rc = api.cuModuleLoadData(&m, image);
                print_alloc(name, rc, S_MODULE, (u64)(uintptr_t)m, 0);
            } else {
                CUlibrary l = NULL;
                rc = api.cuLibraryLoadData(&l, image, NULL, NULL, 0, NULL, NULL, 0);
                print_alloc(name, rc, S_LIBRARY, (u64)(uintptr_t)l, 0);
            }
        }
    } else if (!strcmp(name, "libso")) {
        /* libso:PATH:SYMBOL: a library loaded from the image a shared object carries at
         * SYMBOL (as cudart loads a program's fatbinaries) */
        need_fields(op, 3);
        void *so = dlopen(op->f[1], RTLD_NOW | RTLD_LOCAL);
        if (!so) usage_error(op->text, "cannot open the shared object");
        const void *image = dlsym(so, op->f[2]);
        if (!image) usage_error(op->text, "no such symbol");
        CUlibrary l = NULL;
        rc = api.cuLibraryLoadData(&l, image, NULL, NULL, 0, NULL, NULL, 0);
        print_alloc("libso", rc, S_LIBRARY, (u64)(uintptr_t)l, 0);
    } else if (!strcmp(name, "loads")) {
        /* how many module and library loads reached the driver */
        need_fields(op, 1);
        u64 (*loads)(void) = (u64(*)(void))helper("fake_cuda_module_loads");
        if (!loads) out("loads rc=-1");
        else out("loads rc=0 calls=%llu", loads());
    } else if (!strcmp(name, "libglobal") || !strcmp(name, "libkernel")) {
        need_fields(op, 2);
        CUlibrary l = (CUlibrary)(uintptr_t)slot_field(op, 1)->value;
        if (name[3] == 'g') {
            CUdeviceptr p = 0;
            size_t bytes = 0;
            rc = api.cuLibraryGetGlobal(&p, &bytes, l, "big");
        } else {
            CUkernel k = NULL;
            rc = api.cuLibraryGetKernel(&k, l, "touch");
        }
        out("%s rc=%d", name, rc);
    } else if (!strcmp(name, "unload")) {
        need_fields(op, 2);
        struct slot *s = slot_field(op, 1);
        rc = s->kind == S_LIBRARY ? api.cuLibraryUnload((CUlibrary)(uintptr_t)s->value)
                                  : api.cuModuleUnload((CUmodule)(uintptr_t)s->value);
        out("unload rc=%d", rc);
    } else if (!strcmp(name, "setlimit")) {
        /* setlimit:LIMIT:VALUE (0 stack, 1 printf FIFO, 2 malloc heap) */
        need_fields(op, 3);
        int limit = (int)num_field(op, 1);
        rc = api.cuCtxSetLimit(limit, num_field(op, 2));
        size_t now = 0;
        int grc = api.cuCtxGetLimit(&now, limit);
        out("setlimit rc=%d now=%zu (get rc=%d)", rc, now, grc);
    } else if (!strcmp(name, "limitrace")) {
        /* limitrace:LIMIT:FIRST:SECOND: two threads set LIMIT at once, to FIRST and SECOND */
        need_fields(op, 4);
        int limit = (int)num_field(op, 1);
        api.cuCtxGetCurrent(&g_lim_ctx);
        memset(g_lim_read, 0, sizeof g_lim_read);
        g_lim_set1 = 0;
        struct limit_setter s1 = {1, limit, num_field(op, 2), -1}, s2 = {2, limit, num_field(op, 3), -1};
        set_limit_hook(race_hook);
        pthread_t t1, t2;
        start_or_die(&t1, limit_setter_thread, &s1);
        start_or_die(&t2, limit_setter_thread, &s2);
        join_or_die(t1);
        join_or_die(t2);
        set_limit_hook(NULL);
        size_t now = 0;
        int grc = api.cuCtxGetLimit(&now, limit);
        out("limitrace rc=0 first=%d second=%d now=%zu (get rc=%d)", s1.rc, s2.rc, now, grc);
    } else if (!strcmp(name, "limitalloc")) {
        /* limitalloc:LIMIT:VALUE:SIZE: cuCtxSetLimit(LIMIT, VALUE), inside which another
         * thread allocates SIZE (takes a slot when it succeeds) */
        need_fields(op, 4);
        int limit = (int)num_field(op, 1);
        api.cuCtxGetCurrent(&g_lim_ctx);
        g_lim_alloc_go = g_lim_alloc_done = 0;
        g_lim_alloc_size = num_field(op, 3);
        g_lim_alloc_ptr = 0;
        g_lim_alloc_rc = -1;
        struct limit_setter s1 = {1, limit, num_field(op, 2), -1};
        set_limit_hook(alloc_hook);
        pthread_t t1, t2;
        start_or_die(&t2, limit_alloc_thread, NULL);
        start_or_die(&t1, limit_setter_thread, &s1);
        join_or_die(t1);
        if (!g_lim_alloc_go) { /* the hook never ran: let the allocation go after the call */
            pthread_mutex_lock(&g_lim_mu);
            g_lim_alloc_go = 1;
            pthread_cond_broadcast(&g_lim_cv);
            pthread_mutex_unlock(&g_lim_mu);
        }
        join_or_die(t2);
        set_limit_hook(NULL);
        if (g_lim_alloc_rc == CUDA_SUCCESS) {
            size_t k = add_slot(S_PTR, g_lim_alloc_ptr, g_lim_alloc_size);
            out("limitalloc rc=%d alloc=%d slot=%zu", s1.rc, g_lim_alloc_rc, k);
        } else {
            out("limitalloc rc=%d alloc=%d", s1.rc, g_lim_alloc_rc);
        }
    } else if (!strcmp(name, "kernel")) {
        need_fields(op, 1);
        out("kernel rc=%d", api.cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    } else if (!strcmp(name, "destroy")) {
        need_fields(op, 2);
        struct slot *s = slot_field(op, 1);
        rc = s->kind == S_MIPMAP ? api.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)s->value)
                                 : api.cuArrayDestroy((CUarray)(uintptr_t)s->value);
        out("destroy rc=%d", rc);
    } else if (!strcmp(name, "phys")) {
        need_fields(op, 1);
        u64 (*used)(int) = (u64(*)(int))helper("fake_cuda_used");
        u64 (*peak)(int) = (u64(*)(int))helper("fake_cuda_peak");
        CUdevice dev = 0;
        rc = current_device(&dev);
        if (!used || !peak) out("phys rc=-1");
        else out("phys rc=%d used=%llu peak=%llu", rc, used(dev), peak(dev));
    } else if (!strcmp(name, "queries")) {
        /* cuMemGetInfo and cuCtxGetLimit calls the fake saw while a capture was ongoing */
        need_fields(op, 1);
        u64 (*in_capture)(void) = (u64(*)(void))helper("fake_cuda_queries_in_capture");
        if (!in_capture) out("queries rc=-1");
        else out("queries rc=0 in_capture=%llu", in_capture());
    } else if (!strcmp(name, "race")) {
        need_fields(op, 4);
        u64 threads = num_field(op, 1), iters = num_field(op, 2), size = num_field(op, 3);
        if (threads == 0 || threads > 1024) usage_error(text, "THREADS must be 1..1024");
        struct race *r = run_threads(threads, iters, size, race_thread);
        out("race rc=0 ok=%llu denied=%llu other=%llu", r->ok, r->denied, r->other);
    } else if (!strcmp(name, "asyncrelay") || !strcmp(name, "syncrelay")) {
        need_fields(op, 4);
        u64 threads = num_field(op, 1), iters = num_field(op, 2), size = num_field(op, 3);
        if (threads == 0 || threads > RELAY_MAX_THREADS) usage_error(text, "THREADS must be 1..64");
        memset(g_boxes, 0, sizeof g_boxes);
        g_relay_threads = (unsigned)threads;
        g_relay_next = 0;
        g_relay_sync = !strcmp(name, "syncrelay");
        struct race *r = run_threads(threads, iters, size, relay_thread);
        out("%s rc=0 ok=%llu denied=%llu other=%llu", name, r->ok, r->denied, r->other);
    } else if (!strcmp(name, "synckeep")) {
        need_fields(op, 4);
        u64 threads = num_field(op, 1), iters = num_field(op, 2), size = num_field(op, 3);
        if (threads == 0 || threads > 1024) usage_error(text, "THREADS must be 1..1024");
        struct race *r = run_threads(threads, iters, size, keep_thread);
        out("synckeep rc=0 ok=%llu denied=%llu other=%llu", r->ok, r->denied, r->other);
    } else if (!strcmp(name, "freekept")) {
        need_fields(op, 1);
        u64 ok = 0, other = 0;
        for (unsigned i = 0; i < g_nkept; i++) {
            if (api.cuMemFree_v2(g_kept[i]) == CUDA_SUCCESS) ok++;
            else other++;
        }
        g_nkept = 0;
        out("freekept rc=0 ok=%llu other=%llu", ok, other);
    } else if (!strcmp(name, "keydtor")) {
        need_fields(op, 3);
        u64 threads = num_field(op, 1), size = num_field(op, 2);
        if (threads == 0 || threads > 1024) usage_error(text, "THREADS must be 1..1024");
        if (pthread_key_create(&g_keydtor_key, keydtor_cleanup) != 0) exit(4);
        struct race *r = run_threads(threads, 0, size, keydtor_thread);
        pthread_key_delete(g_keydtor_key);
        out("keydtor rc=0 ok=%llu denied=%llu other=%llu", r->ok, r->denied, r->other);
    } else if (!strcmp(name, "racehold")) {
        need_fields(op, 3);
        u64 threads = num_field(op, 1), size = num_field(op, 2);
        if (threads == 0 || threads > 1024) usage_error(text, "THREADS must be 1..1024");
        struct race *r = run_threads(threads, 0, size, racehold_thread);
        out("racehold rc=0 ok=%llu held_max=%llu other=%llu", r->ok, r->ok * size, r->other);
    } else if (!strcmp(name, "stream")) {
        if (op->n != 1 && op->n != 2) usage_error(text, "stream or stream:FLAGS");
        CUstream st = NULL;
        rc = api.cuStreamCreate(&st, op->n == 2 ? (unsigned)num_field(op, 1) : 0);
        if (rc == CUDA_SUCCESS && g_nstreams < MAX_HANDLES) {
            g_streams[g_nstreams] = st;
            out("stream rc=%d stream=%zu", rc, g_nstreams++);
        } else {
            out("stream rc=%d", rc);
        }
    } else if (!strcmp(name, "streaminfo")) {
        need_fields(op, 2);
        CUstream st = stream_field(op, 1);
        CUdevice dev = -1;
        CUcontext c = NULL;
        char cn[32];
        rc = api.cuStreamGetDevice(st, &dev);
        int rc2 = api.cuStreamGetCtx(st, &c);
        ctx_name(c, cn, sizeof cn);
        out("streaminfo rc=%d dev=%d ctxrc=%d ctx=%s", rc, dev, rc2, cn);
    } else if (!strcmp(name, "streamsync")) {
        need_fields(op, 2);
        out("streamsync rc=%d", api.cuStreamSynchronize(stream_field(op, 1)));
    } else if (!strcmp(name, "streamdestroy")) {
        need_fields(op, 2);
        out("streamdestroy rc=%d", api.cuStreamDestroy_v2(stream_field(op, 1)));
    } else if (!strcmp(name, "asyncon")) {
        need_fields(op, 3);
        CUstream st = stream_field(op, 1);
        u64 size = num_field(op, 2);
        CUdeviceptr p = 0;
        rc = api.cuMemAllocAsync(&p, size, st);
        print_alloc("asyncon", rc, S_ASYNC, p, size);
    } else if (!strcmp(name, "poolasyncon")) {
        need_fields(op, 4);
        CUstream st = stream_field(op, 1);
        u64 k = index_field(op, 2, g_npools, "no such pool"), size = num_field(op, 3);
        CUdeviceptr p = 0;
        rc = api.cuMemAllocFromPoolAsync(&p, size, g_pools[k], st);
        print_alloc("poolasyncon", rc, S_ASYNC, p, size);
    } else if (!strcmp(name, "freeasyncon")) {
        need_fields(op, 3);
        CUstream st = stream_field(op, 1);
        out("freeasyncon rc=%d", api.cuMemFreeAsync(slot_field(op, 2)->value, st));
    } else if (!strcmp(name, "capture")) {
        need_fields(op, 3);
        CUstream st = stream_field(op, 1);
        out("capture rc=%d", api.cuStreamBeginCapture_v2(st, capmode_field(op, 2)));
    } else if (!strcmp(name, "endcapture")) {
        need_fields(op, 2);
        CUgraph g = NULL;
        rc = api.cuStreamEndCapture(stream_field(op, 1), &g);
        if (rc == CUDA_SUCCESS && g && g_ngraphs < MAX_HANDLES) {
            g_graphs[g_ngraphs] = g;
            out("endcapture rc=%d graph=%zu", rc, g_ngraphs++);
        } else {
            out("endcapture rc=%d null=%d", rc, g == NULL);
        }
    } else if (!strcmp(name, "capturing")) {
        need_fields(op, 2);
        int st = -1;
        rc = api.cuStreamIsCapturing(stream_field(op, 1), &st);
        out("capturing rc=%d status=%d", rc, st);
    } else if (!strcmp(name, "capmode")) {
        need_fields(op, 2);
        int m = capmode_field(op, 1);
        rc = api.cuThreadExchangeStreamCaptureMode(&m);
        out("capmode rc=%d old=%s", rc, m >= 0 && m < 3 ? k_capmodes[m] : "?");
    } else if (!strcmp(name, "graph")) {
        need_fields(op, 1);
        CUgraph g = NULL;
        rc = api.cuGraphCreate(&g, 0);
        if (rc == CUDA_SUCCESS && g_ngraphs < MAX_HANDLES) {
            g_graphs[g_ngraphs] = g;
            out("graph rc=%d graph=%zu", rc, g_ngraphs++);
        } else {
            out("graph rc=%d", rc);
        }
    } else if (!strcmp(name, "memnode")) {
        need_fields(op, 3);
        CUgraph g = g_graphs[index_field(op, 1, g_ngraphs, "no such graph")];
        u64 size = num_field(op, 2);
        CUDA_MEM_ALLOC_NODE_PARAMS prm;
        memset(&prm, 0, sizeof prm);
        CUdevice dev = 0;
        CUgraphNode node = NULL;
        rc = current_device(&dev);
        prm.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        prm.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prm.poolProps.location.id = dev;
        prm.bytesize = size;
        if (rc == CUDA_SUCCESS) rc = api.cuGraphAddMemAllocNode(&node, g, NULL, 0, &prm);
        print_alloc("memnode", rc, S_GRAPH, prm.dptr, size);
    } else if (!strcmp(name, "freenode")) {
        need_fields(op, 3);
        CUgraph g = g_graphs[index_field(op, 1, g_ngraphs, "no such graph")];
        CUgraphNode node = NULL;
        out("freenode rc=%d", api.cuGraphAddMemFreeNode(&node, g, NULL, 0, slot_field(op, 2)->value));
    } else if (!strcmp(name, "nodes")) {
        need_fields(op, 2);
        CUgraph g = g_graphs[index_field(op, 1, g_ngraphs, "no such graph")];
        size_t n = 0;
        u64 nalloc = 0, nfree = 0, bytes = 0;
        rc = api.cuGraphGetNodes(g, NULL, &n);
        CUgraphNode *nodes = calloc(n + 1, sizeof *nodes);
        size_t got = n + 1; /* asks for one more than there is: the extra entry comes back NULL */
        if (rc == CUDA_SUCCESS && nodes) rc = api.cuGraphGetNodes(g, nodes, &got);
        for (size_t i = 0; rc == CUDA_SUCCESS && nodes && i < got; i++) {
            int type = 0;
            rc = api.cuGraphNodeGetType(nodes[i], &type);
            if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
                CUDA_MEM_ALLOC_NODE_PARAMS prm;
                nalloc++;
                if (rc == CUDA_SUCCESS) rc = api.cuGraphMemAllocNodeGetParams(nodes[i], &prm);
                if (rc == CUDA_SUCCESS) bytes += prm.bytesize;
            } else if (type == CU_GRAPH_NODE_TYPE_MEM_FREE) {
                nfree++;
            }
        }
        out("nodes rc=%d count=%zu got=%zu tail_null=%d alloc=%llu free=%llu bytes=%llu", rc, n, got,
            nodes ? nodes[n] == NULL : 0, nalloc, nfree, bytes);
        free(nodes);
    } else if (!strcmp(name, "instantiate") || !strcmp(name, "instparams")) {
        int prm = name[4] == 'p';
        if (prm) need_fields(op, 4);
        else if (op->n != 2 && op->n != 3) usage_error(text, "instantiate:G[:FLAGS]");
        CUgraph g = g_graphs[index_field(op, 1, g_ngraphs, "no such graph")];
        u64 flags = op->n >= 3 ? num_field(op, 2) : 0;
        CUgraphExec x = NULL;
        if (prm) {
            CUDA_GRAPH_INSTANTIATE_PARAMS ip = {flags, stream_field(op, 3), NULL, -1};
            rc = api.cuGraphInstantiateWithParams(&x, g, &ip);
        } else {
            rc = api.cuGraphInstantiateWithFlags(&x, g, flags);
        }
        if (rc == CUDA_SUCCESS && g_nexecs < MAX_HANDLES) {
            g_execs[g_nexecs] = x;
            out("%s rc=%d exec=%zu", name, rc, g_nexecs++);
        } else {
            out("%s rc=%d", name, rc);
        }
    } else if (!strcmp(name, "upload") || !strcmp(name, "launch")) {
        need_fields(op, 3);
        CUgraphExec x = g_execs[index_field(op, 1, g_nexecs, "no such exec")];
        CUstream st = stream_field(op, 2);
        rc = name[0] == 'u' ? api.cuGraphUpload(x, st) : api.cuGraphLaunch(x, st);
        out("%s rc=%d", name, rc);
    } else if (!strcmp(name, "execdestroy")) {
        need_fields(op, 2);
        out("execdestroy rc=%d", api.cuGraphExecDestroy(g_execs[index_field(op, 1, g_nexecs, "no such exec")]));
    } else if (!strcmp(name, "graphdestroy")) {
        need_fields(op, 2);
        out("graphdestroy rc=%d", api.cuGraphDestroy(g_graphs[index_field(op, 1, g_ngraphs, "no such graph")]));
    } else if (!strcmp(name, "graphmem")) {
        need_fields(op, 2);
        int dev = (int)num_field(op, 1);
        u64 v[4] = {0, 0, 0, 0};
        rc = CUDA_SUCCESS;
        for (int a = 0; a < 4 && rc == CUDA_SUCCESS; a++) rc = api.cuDeviceGetGraphMemAttribute(dev, a, &v[a]);
        out("graphmem rc=%d used=%llu usedhigh=%llu reserved=%llu reservedhigh=%llu", rc, v[0], v[1], v[2], v[3]);
    } else if (!strcmp(name, "graphtrim")) {
        need_fields(op, 2);
        out("graphtrim rc=%d", api.cuDeviceGraphMemTrim((int)num_field(op, 1)));
    } else if (!strcmp(name, "graphreset")) {
        need_fields(op, 2);
        int dev = (int)num_field(op, 1);
        u64 zero = 0;
        rc = api.cuDeviceSetGraphMemAttribute(dev, CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, &zero);
        if (rc == CUDA_SUCCESS) rc = api.cuDeviceSetGraphMemAttribute(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH, &zero);
        out("graphreset rc=%d", rc);
    } else if (!strcmp(name, "retain")) {
        need_fields(op, 2);
        struct slot *s = slot_field(op, 1);
        CUmemGenericAllocationHandle h = 0;
        rc = api.cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)(s->va + s->size / 2));
        out("retain rc=%d same=%d", rc, rc == CUDA_SUCCESS && h == s->value);
    } else if (!strcmp(name, "ctxcreate")) {
        need_fields(op, 2);
        CUdevice dev;
        CUcontext c = NULL;
        rc = api.cuDeviceGet(&dev, (int)num_field(op, 1));
        if (rc == CUDA_SUCCESS) rc = api.cuCtxCreate_v4(&c, NULL, 0, dev);
        if (rc == CUDA_SUCCESS && g_ncctxs < MAX_HANDLES) {
            g_cctxs[g_ncctxs] = c;
            out("ctxcreate rc=%d ctx=%zu", rc, g_ncctxs++);
        } else {
            out("ctxcreate rc=%d", rc);
        }
    } else if (!strcmp(name, "ctxdestroy")) {
        need_fields(op, 2);
        out("ctxdestroy rc=%d", api.cuCtxDestroy_v2(g_cctxs[index_field(op, 1, g_ncctxs, "no such context")]));
    } else if (!strcmp(name, "ctxset")) {
        need_fields(op, 2);
        out("ctxset rc=%d", api.cuCtxSetCurrent(g_cctxs[index_field(op, 1, g_ncctxs, "no such context")]));
    } else if (!strcmp(name, "ctxpop")) {
        need_fields(op, 1);
        CUcontext c = NULL;
        char cn[32];
        rc = api.cuCtxPopCurrent_v2(&c);
        ctx_name(c, cn, sizeof cn);
        out("ctxpop rc=%d ctx=%s", rc, cn);
    } else if (!strcmp(name, "ctxsync")) {
        need_fields(op, 1);
        out("ctxsync rc=%d", api.cuCtxSynchronize());
    } else if (!strcmp(name, "nvml")) {
        op_nvml(op);
    } else if (!strcmp(name, "sym")) {
        op_sym(op);
    } else if (!strcmp(name, "nextsym")) {
        need_fields(op, 2);
        void *(*next)(const char *) = (void *(*)(const char *))dlsym(RTLD_DEFAULT, "thirdparty_next");
        void *p = next ? next(op->f[1]) : NULL;
        Dl_info info;
        if (!next) out("nextsym rc=-2");
        else if (!p) out("nextsym rc=-1 lib= name=");
        else if (dladdr(p, &info) && info.dli_fname)
            out("nextsym rc=0 lib=%s name=%s", base_name(info.dli_fname), info.dli_sname ? info.dli_sname : "?");
        else out("nextsym rc=0 lib=? name=?");
    } else if (!strcmp(name, "waitfile")) {
        /* waitfile:PATH: until PATH exists (30 s at most), to step with the test. */
        need_fields(op, 2);
        int waited = 0;
        while (access(op->f[1], F_OK) != 0 && waited < 30000) {
            struct timespec ts = {0, 5 * 1000000L};
            nanosleep(&ts, NULL);
            waited += 5;
        }
        out("waitfile rc=%d", access(op->f[1], F_OK) == 0 ? 0 : 1);
    } else if (!strcmp(name, "sleep")) {
        need_fields(op, 2);
        u64 ms = num_field(op, 1);
        struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        out("sleep rc=0");
    } else if (!strcmp(name, "clock")) {
        /* clock: the library's clock (CLOCK_MONOTONIC_COARSE) in ms, to know how far apart
         * two calls came as the library saw them. */
        need_fields(op, 1);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
        out("clock rc=0 ms=%llu", (unsigned long long)ts.tv_sec * 1000ULL + (unsigned long long)ts.tv_nsec / 1000000ULL);
    } else if (!strcmp(name, "pagesize")) {
        need_fields(op, 1);
        int v = getpagesize();
        int (*calls)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "thirdparty_calls");
        if (calls) out("pagesize rc=0 value=%d calls=%d", v, calls());
        else out("pagesize rc=0 value=%d", v);
    } else {
        usage_error(text, "unknown op");
    }
}

static const char *const k_ops[] = {
    "ctx", "ctxrelease", "ctxreset", "alloc", "pitch", "managed", "free", "freeptr", "info", "infountil", "total", "async",
    "freeasync", "poolasync", "newpool", "poolasyncin", "threshold", "reserve", "poolused", "trim", "sync", "create",
    "createfabric", "createhost", "map", "unmap", "release", "array", "array3d", "mipmap", "destroy", "phys", "queries", "race",
    "racehold", "asyncrelay", "syncrelay", "synckeep", "freekept", "keydtor", "nvml", "sym", "nextsym", "sleep", "clock", "waitfile", "pagesize", "stream", "streaminfo", "streamsync",
    "streamdestroy", "asyncon", "poolasyncon", "freeasyncon", "capture", "endcapture", "capturing", "capmode", "graph",
    "memnode", "freenode", "nodes", "instantiate", "instparams", "upload", "launch", "execdestroy", "graphdestroy",
    "graphmem", "graphtrim", "graphreset", "retain", "ctxcreate", "ctxdestroy", "ctxset", "ctxpop", "ctxsync",
    "modload", "libload", "modimage", "libimage", "libso", "modfile", "loads", "libglobal", "libkernel", "unload", "setlimit", "kernel",
    "limitrace", "limitalloc",
};

/* Unknown op names are refused before anything runs. */
static void check_op_names(int argc, char **argv) {
    for (int i = 2; i < argc; i++) {
        size_t len = strcspn(argv[i], ":");
        int known = 0;
        for (size_t k = 0; k < sizeof k_ops / sizeof k_ops[0]; k++)
            if (strlen(k_ops[k]) == len && !strncmp(k_ops[k], argv[i], len)) known = 1;
        if (!known) usage_error(argv[i], "unknown op");
    }
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODE OP...\n", argv[0]);
        return 2;
    }
    const char *m = argv[1];
    if (!strcmp(m, "gpa")) g_mode = M_GPA;
    else if (!strcmp(m, "gpa-ptsz")) g_mode = M_GPA_PTSZ;
    else if (!strcmp(m, "gpa-legacy")) g_mode = M_GPA_LEGACY;
    else if (!strcmp(m, "dlsym")) g_mode = M_DLSYM;
#ifdef LINKED
    else if (!strcmp(m, "linked")) g_mode = M_LINKED;
#endif
    else {
        fprintf(stderr, "client: unknown mode '%s'\n", m);
        return 2;
    }

    check_op_names(argc, argv);
    resolve_all();
    int rc = api.cuInit(0);
    if (rc != CUDA_SUCCESS) {
        out("init rc=%d", rc);
        return 0;
    }
    CUdevice dev = 0;
    int crc = api.cuDeviceGet(&dev, 0);
    if (crc == CUDA_SUCCESS) crc = api.cuDevicePrimaryCtxRetain(&g_ctx, dev);
    if (crc == CUDA_SUCCESS) crc = api.cuCtxSetCurrent(g_ctx);
    g_prim[0] = g_ctx;
    out("init rc=%d ctx=%d", rc, crc);

    for (int i = 2; i < argc; i++) run_op(argv[i]);
    out("done");
    free(g_slots);
    return 0;
}
