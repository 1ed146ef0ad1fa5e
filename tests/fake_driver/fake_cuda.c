/* Fake libcuda.so.1 for tests without a GPU. See README.md for the model.
 * Device memory is a counter per physical device; no real memory backs it.
 * One global mutex guards all state; the current context is thread-local. */
#define _GNU_SOURCE
#include "fake_cuda_api.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

typedef unsigned long long u64;

#define MAX_DEV 64
#define MIB (1ull << 20)
#define GRANULARITY (2 * MIB)
#define POOL_CHUNK (32 * MIB)
#define DEVPTR_BASE 0x7f0000000000ull
#define VA_BASE 0x200000000000ull
#define GVA_BASE 0x400000000000ull /* graph allocations (alloc nodes) */
#define GVA_END 0x7e0000000000ull
#define HANDLE_BASE 0x100000000ull
#define CTX_STACK 32

/* ---------- global state (all guarded by g_mu) ---------- */

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_config_loaded;
static int g_inited;
static int g_nphys;
static u64 g_mem;
static u64 g_ctx_bytes;
/* FAKE_CUDA_DEVICE_NAME: what cuDeviceGetName says. */
static char g_device_name[96] = "Fake GPU";
static u64 g_other;       /* bytes other processes hold on every physical device */
static u64 g_module_bytes; /* what a module or library whose image the fake cannot read costs */
static int g_cc_major = 9, g_cc_minor; /* FAKE_CUDA_CC=<major>.<minor>: the compute capability (9.0) */
static u64 g_module_loads; /* calls that reached a module or library load */
static int g_eager;          /* CUDA_MODULE_LOADING=EAGER: libraries load at once */
static int g_no_loading_mode; /* FAKE_CUDA_NO_LOADING_MODE: cuModuleGetLoadingMode unsupported */
static u64 g_queries_in_capture; /* cuMemGetInfo/cuCtxGetLimit calls while a capture is ongoing */
/* By physical index: cuMemPoolDestroy calls on a pool with blocks in use, and context
 * teardowns after which another context of the device lived or its pool or graph memory
 * remained (note_teardown). */
static u64 g_pools_destroyed_live[MAX_DEV], g_teardowns_shared[MAX_DEV];
static u64 g_stack_threads;  /* FAKE_CUDA_STACK_THREADS: threads a stack limit is paid for */
static u64 g_launch_local;   /* FAKE_CUDA_LAUNCH_LOCAL_BYTES: a context's first launch grows local memory */
static int g_free_refuses_async; /* FAKE_CUDA_FREE_REFUSES_ASYNC */
/* FAKE_CUDA_PAUSE=<call>:<ms>: that call sleeps first, before it looks at anything (so a
 * test can make another thread's call land inside it, as a preempted thread would). */
static char g_pause_call[64];
static unsigned g_pause_ms;
/* FAKE_CUDA_PAUSE_AFTER=<call>:<ms>: that call sleeps once its work is done, before it
 * returns (a preempted caller that has not yet seen the answer). */
static char g_pause_after_call[64];
static unsigned g_pause_after_ms;
static int g_nvis;
static int g_vis[MAX_DEV]; /* ordinal -> physical index */
static u64 g_used[MAX_DEV]; /* by physical index */
static u64 g_peak[MAX_DEV];

/* FAKE_CUDA_JOURNAL=<dir> with FAKE_CUDA_JOURNAL_LIMITS=<b0>[,<b1>...]: a debugging aid
 * for races. The fake keeps the last JOURNAL_LEN memory events (what changed the device's
 * use, what the pools' attributes answered, and the notes a test client adds) and, the
 * first time a device's use passes its limit after a reset of the peak or when a client
 * asks (fake_cuda_journal_dump), writes them to <dir>/journal-<pid>-<n>.txt. Off (one
 * branch per event) unless both are set. */
#define JOURNAL_LEN 4096
struct jev {
    const char *what;
    const char *fn;
    long tid;
    int dev;
    u64 a, b, c;
};
static struct jev g_journal[JOURNAL_LEN];
static u64 g_jn;
static int g_jon = -1;
static u64 g_jlimit[MAX_DEV];
static int g_jdumped;
static u64 g_jdumps;
static int g_jpid; /* the process that loaded the journal: a fork child's copy stays quiet */

static void journal_load(void) {
    if (g_jon >= 0) return;
    const char *dir = getenv("FAKE_CUDA_JOURNAL"), *lim = getenv("FAKE_CUDA_JOURNAL_LIMITS");
    g_jon = dir && lim;
    g_jpid = (int)getpid();
    for (int i = 0; i < MAX_DEV; i++) g_jlimit[i] = ~0ull;
    for (int i = 0; g_jon && lim && *lim && i < MAX_DEV; i++) {
        char *end;
        g_jlimit[i] = strtoull(lim, &end, 10);
        lim = *end == ',' ? end + 1 : end;
    }
}

static void jev(const char *what, const char *fn, int dev, u64 a, u64 b, u64 c) {
    journal_load();
    if (!g_jon) return;
    struct jev *e = &g_journal[g_jn++ % JOURNAL_LEN];
    e->what = what;
    e->fn = fn;
    e->tid = (long)gettid();
    e->dev = dev;
    e->a = a;
    e->b = b;
    e->c = c;
}

static void journal_write(const char *why, int dev, u64 used) {
    char path[512];
    snprintf(path, sizeof path, "%s/journal-%d-%llu.txt", getenv("FAKE_CUDA_JOURNAL"), (int)getpid(), g_jdumps++);
    FILE *f = fopen(path, "w");
    if (!f) return;
    fprintf(f, "device %d %s %llu (limit %llu)\n", dev, why, used, g_jlimit[dev]);
    u64 first = g_jn > JOURNAL_LEN ? g_jn - JOURNAL_LEN : 0;
    for (u64 i = first; i < g_jn; i++) {
        struct jev *e = &g_journal[i % JOURNAL_LEN];
        fprintf(f, "%llu tid%ld %s %s dev%d %llu %llu %llu\n", i, e->tid, e->what, e->fn ? e->fn : "-", e->dev,
                e->a, e->b, e->c);
    }
    fclose(f);
}

static void journal_dump(int dev, u64 used) {
    if (!g_jon || g_jdumped || (int)getpid() != g_jpid) return;
    g_jdumped = 1;
    journal_write("used more than its limit:", dev, used);
}

/* A test client found something wrong that the fake cannot see (books left after a
 * cleanup, say): the journal as it is now, whatever the limits. */
void fake_cuda_journal_dump(int ordinal, const char *why, unsigned long long value) {
    pthread_mutex_lock(&g_mu);
    journal_load();
    if (g_jon && (int)getpid() == g_jpid) journal_write(why, ordinal, value);
    pthread_mutex_unlock(&g_mu);
}

/* A note from a test client (its op about to run, or just run), in the journal. */
void fake_cuda_journal_note(const char *what, int t, unsigned long long idx, unsigned long long rc) {
    pthread_mutex_lock(&g_mu);
    jev(what, NULL, t, idx, rc, 0);
    pthread_mutex_unlock(&g_mu);
}

struct fake_ctx {
    int device; /* ordinal */
    int primary;
    int destroyed;
    int refcount; /* primary only */
    unsigned flags;
    unsigned gen; /* primary: bumped each time the context goes away (streams die with it) */
    /* Limits: the stack is paid at once (above the default, for g_stack_threads threads);
     * the heap and the printf FIFO (above their defaults) at the first launch, after which
     * they cannot change; that launch also grows local memory by g_launch_local. */
    u64 stack, heap, fifo, launched_bytes;
    int launched;
};
static struct fake_ctx g_primary[MAX_DEV];
static struct fake_ctx **g_ctxs; /* created (non-primary) contexts; never freed so stale handles stay safe */
static size_t g_nctxs, g_capctxs;

struct fake_pool {
    int device;
    int is_default;
    int destroyed;
    u64 reserve, live, threshold, reserve_high, used_high;
    u64 used_told; /* the last USED_MEM_CURRENT answer */
};
static struct fake_pool g_default_pool[MAX_DEV];
static struct fake_pool *g_cur_pool[MAX_DEV];
static struct fake_pool **g_pools; /* created pools; never freed */
static size_t g_npools, g_cappools;

/* Graph memory per ordinal: reserve charged to the device, bytes live in allocations. */
static u64 g_graph_reserved[MAX_DEV], g_graph_used[MAX_DEV];
static u64 g_graph_reserved_high[MAX_DEV], g_graph_used_high[MAX_DEV];

static u64 g_dev_bump[MAX_DEV];
static u64 g_va_bump = VA_BASE;
static u64 g_gva_bump = GVA_BASE;
static u64 g_handle_bump = HANDLE_BASE;

static __thread struct fake_ctx *t_cur;
static __thread struct fake_ctx *t_stack[CTX_STACK];
static __thread int t_depth;

/* ---------- ptr/handle table ---------- */

enum kind { K_DEV = 1, K_MANAGED, K_ASYNC, K_VMM, K_ARRAY, K_MIPMAP, K_STREAM, K_GVA, K_GRAPH, K_GNODE, K_EXEC, K_MODULE };

struct capture;

struct entry {
    u64 key;
    struct entry *next;
    int kind;
    int device;
    int host;     /* VMM: host location, not device memory */
    u64 size;
    u64 refs;     /* VMM: handle references (create + retains - releases); GVA: graphs/execs naming it */
    u64 mapcount; /* VMM */
    struct fake_pool *pool; /* K_ASYNC */
    /* K_STREAM */
    struct fake_ctx *ctx;
    unsigned gen;
    unsigned flags;
    u64 pending; /* K_MODULE: a lazily loaded library's globals, placed at its first look-up */
    struct capture *cap;
    /* K_GVA: live (allocated by a launch, not yet freed); obj = its alloc node while the graph exists.
     * K_GRAPH, K_GNODE, K_EXEC: obj = the object. */
    int live;
    void *obj;
};

static struct entry **g_buckets;
static size_t g_nbuckets, g_count;

static size_t hslot(u64 key, size_t n) {
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdull;
    key ^= key >> 33;
    return (size_t)key & (n - 1);
}

static struct entry *tfind(u64 key) {
    if (!g_nbuckets) return NULL;
    for (struct entry *e = g_buckets[hslot(key, g_nbuckets)]; e; e = e->next)
        if (e->key == key) return e;
    return NULL;
}

static int tgrow(void) {
    size_t n = g_nbuckets ? g_nbuckets * 2 : 1024;
    struct entry **b = calloc(n, sizeof *b);
    if (!b) return -1;
    for (size_t i = 0; i < g_nbuckets; i++) {
        struct entry *e = g_buckets[i];
        while (e) {
            struct entry *next = e->next;
            size_t s = hslot(e->key, n);
            e->next = b[s];
            b[s] = e;
            e = next;
        }
    }
    free(g_buckets);
    g_buckets = b;
    g_nbuckets = n;
    return 0;
}

static struct entry *tadd(u64 key, int kind, int device, u64 size) {
    if (g_count >= g_nbuckets && tgrow() != 0) return NULL;
    struct entry *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->key = key;
    e->kind = kind;
    e->device = device;
    e->size = size;
    size_t s = hslot(key, g_nbuckets);
    e->next = g_buckets[s];
    g_buckets[s] = e;
    g_count++;
    return e;
}

static void tdel(struct entry *victim) {
    struct entry **pp = &g_buckets[hslot(victim->key, g_nbuckets)];
    while (*pp && *pp != victim) pp = &(*pp)->next;
    if (*pp) {
        *pp = victim->next;
        g_count--;
    }
    free(victim);
}

/* ---------- helpers ---------- */

static u64 round_up(u64 x, u64 a) {
    if (x > ~0ull - (a - 1)) return ~0ull / a * a;
    return (x + a - 1) / a * a;
}

static u64 max_u64(u64 a, u64 b) { return a > b ? a : b; }

static u64 env_u64(const char *name, u64 def) {
    const char *s = getenv(name);
    if (!s || !*s) return def;
    char *end;
    errno = 0;
    u64 v = strtoull(s, &end, 10);
    if (*end || errno) return def;
    return v;
}

static void uuid_bytes(int phys, unsigned char out[16]) {
    static const unsigned char head[4] = {0xfa, 0xce, 0xb0, 0x0c};
    memset(out, 0, 16);
    memcpy(out, head, 4);
    out[15] = (unsigned char)phys;
}

static void uuid_string(int phys, char *out, size_t len) {
    unsigned char u[16];
    uuid_bytes(phys, u);
    snprintf(out, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
             u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

static int parse_visible_token(const char *tok) {
    if (!*tok) return -1;
    int digits = 1;
    for (const char *c = tok; *c; c++)
        if (*c < '0' || *c > '9') digits = 0;
    if (digits) {
        long v = strtol(tok, NULL, 10);
        return v < g_nphys ? (int)v : -1;
    }
    if (strncasecmp(tok, "GPU-", 4) != 0) return -1;
    for (int p = 0; p < g_nphys; p++) {
        char u[64];
        uuid_string(p, u, sizeof u);
        if (strncasecmp(u, tok, strlen(tok)) == 0) return p;
    }
    return -1;
}

/* Reads the environment once (at cuInit, or at the first stats helper). */
static void load_config_locked(void) {
    if (g_config_loaded) return;
    g_config_loaded = 1;
    u64 n = env_u64("FAKE_CUDA_DEVICES", 1);
    g_nphys = n > MAX_DEV ? MAX_DEV : (int)n;
    g_mem = env_u64("FAKE_CUDA_MEM", 85899345920ull);
    g_ctx_bytes = env_u64("FAKE_CUDA_CTX_BYTES", 0);
    const char *name = getenv("FAKE_CUDA_DEVICE_NAME");
    if (name && *name) snprintf(g_device_name, sizeof g_device_name, "%s", name);
    g_other = env_u64("FAKE_CUDA_OTHER_USED", 0);
    g_module_bytes = env_u64("FAKE_CUDA_MODULE_BYTES", 0);
    const char *cc = getenv("FAKE_CUDA_CC");
    if (cc && *cc) {
        char *dot;
        g_cc_major = (int)strtol(cc, &dot, 10);
        g_cc_minor = *dot == '.' ? (int)strtol(dot + 1, NULL, 10) : 0;
    }
    const char *loading = getenv("CUDA_MODULE_LOADING");
    g_eager = loading && strcasecmp(loading, "EAGER") == 0;
    g_stack_threads = env_u64("FAKE_CUDA_STACK_THREADS", 1024);
    g_launch_local = env_u64("FAKE_CUDA_LAUNCH_LOCAL_BYTES", 0);
    g_free_refuses_async = env_u64("FAKE_CUDA_FREE_REFUSES_ASYNC", 0) != 0;
    g_no_loading_mode = env_u64("FAKE_CUDA_NO_LOADING_MODE", 0) != 0;
    const char *pause = getenv("FAKE_CUDA_PAUSE");
    const char *colon = pause ? strchr(pause, ':') : NULL;
    if (colon && (size_t)(colon - pause) < sizeof g_pause_call) {
        memcpy(g_pause_call, pause, (size_t)(colon - pause));
        g_pause_ms = (unsigned)strtoul(colon + 1, NULL, 10);
    }
    pause = getenv("FAKE_CUDA_PAUSE_AFTER");
    colon = pause ? strchr(pause, ':') : NULL;
    if (colon && (size_t)(colon - pause) < sizeof g_pause_after_call) {
        memcpy(g_pause_after_call, pause, (size_t)(colon - pause));
        g_pause_after_ms = (unsigned)strtoul(colon + 1, NULL, 10);
    }

    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    g_nvis = 0;
    if (!cvd) {
        for (int p = 0; p < g_nphys; p++) g_vis[g_nvis++] = p;
    } else {
        /* Like the real driver: the list stops at the first invalid or repeated entry. */
        char buf[1024];
        snprintf(buf, sizeof buf, "%s", cvd);
        char *save = NULL;
        for (char *tok = strtok_r(buf, ",", &save); tok && g_nvis < MAX_DEV; tok = strtok_r(NULL, ",", &save)) {
            while (*tok == ' ') tok++;
            size_t l = strlen(tok);
            while (l && tok[l - 1] == ' ') tok[--l] = 0;
            int p = parse_visible_token(tok);
            if (p < 0) break;
            int dup = 0;
            for (int i = 0; i < g_nvis; i++)
                if (g_vis[i] == p) dup = 1;
            if (dup) break;
            g_vis[g_nvis++] = p;
        }
    }
    for (int d = 0; d < MAX_DEV; d++) {
        g_primary[d].device = d;
        g_primary[d].primary = 1;
        g_default_pool[d].device = d;
        g_default_pool[d].is_default = 1;
        g_cur_pool[d] = &g_default_pool[d];
    }
}

static int valid_dev(int dev) { return dev >= 0 && dev < g_nvis; }

static void pause_in(const char *call);

static void pool_shrink_to(struct fake_pool *p, u64 target);

static void uncharge_at(const char *fn, int dev, u64 bytes) {
    int p = g_vis[dev];
    g_used[p] -= bytes > g_used[p] ? g_used[p] : bytes;
    jev("uncharge", fn, dev, bytes, g_used[p], 0);
}
#define uncharge(dev, bytes) uncharge_at(__func__, dev, bytes)

static int fits(int dev, u64 bytes) {
    u64 held = g_used[g_vis[dev]] + g_other;
    return held <= g_mem && bytes <= g_mem - held;
}

static void trim_device_pools(int dev) {
    struct fake_pool *d = &g_default_pool[dev];
    pool_shrink_to(d, round_up(d->live, POOL_CHUNK));
    for (size_t i = 0; i < g_npools; i++)
        if (g_pools[i]->device == dev) pool_shrink_to(g_pools[i], round_up(g_pools[i]->live, POOL_CHUNK));
}

/* Charges physical memory on ordinal dev. A synchronous allocation that does not fit
 * first trims the device's pools to their live bytes, as the real driver does. */
static CUresult charge_at(const char *fn, int dev, u64 bytes, int may_trim) {
    if (bytes > g_mem) return CUDA_ERROR_OUT_OF_MEMORY; /* can never fit: touch nothing */
    if (!fits(dev, bytes)) {
        if (may_trim) trim_device_pools(dev);
        if (!fits(dev, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    int p = g_vis[dev];
    g_used[p] += bytes;
    if (g_used[p] > g_peak[p]) g_peak[p] = g_used[p];
    jev("charge", fn, dev, bytes, g_used[p], 0);
    if (g_used[p] > g_jlimit[dev]) journal_dump(dev, g_used[p]);
    return CUDA_SUCCESS;
}
#define charge(dev, bytes, may_trim) charge_at(__func__, dev, bytes, may_trim)

static void pool_shrink_to(struct fake_pool *p, u64 target) {
    if (p->reserve > target) {
        uncharge(p->device, p->reserve - target);
        p->reserve = target;
    }
}

static void sync_device(int dev) {
    struct fake_pool *d = &g_default_pool[dev];
    pool_shrink_to(d, max_u64(round_up(d->live, POOL_CHUNK), d->threshold));
    for (size_t i = 0; i < g_npools; i++) {
        struct fake_pool *p = g_pools[i];
        if (p->device != dev) continue;
        pool_shrink_to(p, p->destroyed ? round_up(p->live, POOL_CHUNK)
                                       : max_u64(round_up(p->live, POOL_CHUNK), p->threshold));
    }
}

/* FAKE_CUDA_REUSE_HANDLES=1: array, module and library handles that went away (destroyed,
 * unloaded, or with their context) are handed out again, latest first, as a real driver
 * may. */
static u64 next_handle(void);
static u64 g_free_handles[64];
static size_t g_nfree_handles;

static void handle_gone(const struct entry *e) {
    if ((e->kind == K_ARRAY || e->kind == K_MIPMAP || e->kind == K_MODULE) && g_nfree_handles < 64 &&
        getenv("FAKE_CUDA_REUSE_HANDLES"))
        g_free_handles[g_nfree_handles++] = e->key;
}

static u64 reused_handle(void) {
    while (g_nfree_handles) {
        u64 h = g_free_handles[--g_nfree_handles];
        if (!tfind(h)) return h;
    }
    return next_handle();
}

static int ctx_owned_kind(int kind) {
    return kind == K_DEV || kind == K_MANAGED || kind == K_ARRAY || kind == K_MIPMAP || kind == K_MODULE;
}

/* A context went away: the device, managed and array memory allocated in it goes too
 * (CUDA 13's cuCtxDestroy: not VMM, not stream-ordered memory). */
#define STACK_DEFAULT 1024ull
#define HEAP_DEFAULT (8ull << 20)
#define FIFO_DEFAULT 8650752ull
static u64 excess(u64 v, u64 def) { return v > def ? v - def : 0; }
static u64 stack_bytes(u64 stack) { return excess(stack, STACK_DEFAULT) * g_stack_threads; }
static u64 limits_held(const struct fake_ctx *c) { return stack_bytes(c->stack) + c->launched_bytes; }
static u64 limit_of(const struct fake_ctx *c, int limit) {
    switch (limit) {
    case 0: return c->stack ? c->stack : STACK_DEFAULT;
    case 1: return c->fifo ? c->fifo : FIFO_DEFAULT;
    default: return c->heap ? c->heap : HEAP_DEFAULT;
    }
}

static void drop_context_memory(struct fake_ctx *ctx) {
    uncharge(ctx->device, limits_held(ctx));
    ctx->stack = ctx->heap = ctx->fifo = ctx->launched_bytes = 0;
    ctx->launched = 0;
    for (size_t i = 0; i < g_nbuckets; i++) {
        struct entry *e = g_buckets[i];
        while (e) {
            struct entry *next = e->next;
            if (ctx_owned_kind(e->kind) && e->ctx == ctx) {
                uncharge(e->device, e->size);
                handle_gone(e);
                tdel(e);
            }
            e = next;
        }
    }
}

/* The primary context of dev went away, and with it every allocation made in it (device,
 * managed, arrays), and the device's stream-ordered memory (pools are emptied). Memory of
 * contexts from cuCtxCreate stays. */
static void drop_device_memory(int dev) {
    drop_context_memory(&g_primary[dev]);
    for (size_t i = 0; i < g_nbuckets; i++) {
        struct entry *e = g_buckets[i];
        while (e) {
            struct entry *next = e->next;
            if (e->device == dev && e->kind == K_ASYNC) tdel(e);
            e = next;
        }
    }
    struct fake_pool *d = &g_default_pool[dev];
    d->live = 0;
    pool_shrink_to(d, 0);
    for (size_t i = 0; i < g_npools; i++)
        if (g_pools[i]->device == dev) {
            g_pools[i]->live = 0;
            pool_shrink_to(g_pools[i], 0);
        }
}

static int pool_known(struct fake_pool *p) {
    if (!p) return 0;
    for (int d = 0; d < g_nvis; d++)
        if (p == &g_default_pool[d]) return 1;
    for (size_t i = 0; i < g_npools; i++)
        if (g_pools[i] == p) return !p->destroyed;
    return 0;
}

static int ctx_known(struct fake_ctx *c) {
    for (int d = 0; d < g_nvis; d++)
        if (c == &g_primary[d]) return 1;
    for (size_t i = 0; i < g_nctxs; i++)
        if (g_ctxs[i] == c) return !c->destroyed;
    return 0;
}

static int ctx_usable(struct fake_ctx *c) {
    return c && !c->destroyed && (!c->primary || c->refcount > 0);
}

static CUresult cur_device(int *dev) {
    if (!ctx_usable(t_cur)) return CUDA_ERROR_INVALID_CONTEXT;
    *dev = t_cur->device;
    return CUDA_SUCCESS;
}

static u64 next_devptr(int dev, u64 size) {
    if (!g_dev_bump[dev]) g_dev_bump[dev] = DEVPTR_BASE + ((u64)dev << 40);
    u64 p;
    do {
        p = g_dev_bump[dev];
        g_dev_bump[dev] += round_up(size ? size : 1, GRANULARITY);
    } while (tfind(p));
    return p;
}

/* A freed block at the top of the bump goes back to it, so that alloc/free loops reuse
 * addresses as the real driver does. */
static void return_devptr(int dev, u64 p, u64 size) {
    if (p + round_up(size ? size : 1, GRANULARITY) == g_dev_bump[dev]) g_dev_bump[dev] = p;
}

static u64 next_handle(void) {
    g_handle_bump += 0x10;
    return g_handle_bump;
}

/* ---------- streams, stream capture, graphs: state and helpers ---------- */

struct gnode {
    u64 id; /* handle (K_GNODE key) */
    struct fake_graph *graph;
    int type; /* CU_GRAPH_NODE_TYPE_MEM_ALLOC / _MEM_FREE */
    int device;
    u64 size;  /* alloc: bytesize */
    u64 dptr;  /* alloc: its VA; free: the pointer it frees */
    int freed_in_graph; /* alloc: a free node of the same graph frees it */
    CUmemPoolProps props;
};

struct fake_graph {
    u64 id; /* handle (K_GRAPH key) */
    int in_capture; /* being built by a capture: not yet visible through the graph API */
    int nexecs;     /* live executable graphs instantiated from it */
    struct gnode **nodes;
    size_t n, cap;
};

struct xalloc {
    u64 va, size;
    int device, freed;
};

struct fake_exec {
    u64 id; /* handle (K_EXEC key) */
    u64 graph_id;
    u64 flags;
    struct xalloc *allocs;
    size_t nallocs;
    u64 *frees; /* pointers from outside the graph that its free nodes free */
    size_t nfrees;
};

struct capture {
    struct capture *next;
    struct entry *stream;
    int mode;
    int invalidated;
    u64 owner; /* thread id of the thread that began it */
    struct fake_graph *graph;
};

static struct capture *g_caps; /* ongoing (active or invalidated, not yet ended) captures */
static __thread int t_capmode; /* CU_STREAM_CAPTURE_MODE_GLOBAL */
static __thread u64 t_tid;
static u64 g_tid_bump;

static u64 my_tid(void) {
    if (!t_tid) t_tid = ++g_tid_bump;
    return t_tid;
}

static u64 rsize(u64 size) { return round_up(size, GRANULARITY); }

static void note_graph_high(int dev) {
    g_graph_used_high[dev] = max_u64(g_graph_used_high[dev], g_graph_used[dev]);
    g_graph_reserved_high[dev] = max_u64(g_graph_reserved_high[dev], g_graph_reserved[dev]);
}

/* A graph VA entry goes when no graph or exec names it and it is not live. */
static void gva_maybe_drop(struct entry *e) {
    if (e->refs == 0 && !e->live) tdel(e);
}

static void gva_unref(u64 va) {
    struct entry *e = tfind(va);
    if (!e || e->kind != K_GVA) return;
    if (e->refs) e->refs--;
    gva_maybe_drop(e);
}

/* A live graph allocation is freed (by cuMemFree*, a free node, auto-free, or its device's
 * primary context going away): the graph pool's use drops, its reserve stays. */
static void gva_free_live(struct entry *e) {
    u64 r = rsize(e->size);
    g_graph_used[e->device] -= r > g_graph_used[e->device] ? g_graph_used[e->device] : r;
    e->live = 0;
    gva_maybe_drop(e);
}

static struct fake_graph *graph_new(int in_capture) {
    struct fake_graph *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->id = next_handle();
    g->in_capture = in_capture;
    struct entry *e = tadd(g->id, K_GRAPH, 0, 0);
    if (!e) {
        free(g);
        return NULL;
    }
    e->obj = g;
    return g;
}

static void graph_free(struct fake_graph *g) {
    for (size_t i = 0; i < g->n; i++) {
        struct gnode *nd = g->nodes[i];
        if (nd->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
            struct entry *v = tfind(nd->dptr);
            if (v && v->kind == K_GVA) {
                v->obj = NULL;
                if (v->refs) v->refs--;
                gva_maybe_drop(v);
            }
        }
        struct entry *ne = tfind(nd->id);
        if (ne && ne->kind == K_GNODE) tdel(ne);
        free(nd);
    }
    struct entry *ge = tfind(g->id);
    if (ge && ge->kind == K_GRAPH) tdel(ge);
    free(g->nodes);
    free(g);
}

static struct gnode *graph_push(struct fake_graph *g, int type) {
    if (g->n == g->cap) {
        size_t n = g->cap ? g->cap * 2 : 8;
        struct gnode **v = realloc(g->nodes, n * sizeof *v);
        if (!v) return NULL;
        g->nodes = v;
        g->cap = n;
    }
    struct gnode *nd = calloc(1, sizeof *nd);
    if (!nd) return NULL;
    nd->id = next_handle();
    struct entry *e = tadd(nd->id, K_GNODE, 0, 0);
    if (!e) {
        free(nd);
        return NULL;
    }
    e->obj = nd;
    nd->graph = g;
    nd->type = type;
    g->nodes[g->n++] = nd;
    return nd;
}

/* An alloc node: a fresh VA of its own range, nothing physical until a launch. */
static CUresult graph_add_alloc(struct fake_graph *g, int dev, u64 size, const CUmemPoolProps *props,
                                struct gnode **out) {
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (size > g_mem) return CUDA_ERROR_OUT_OF_MEMORY;
    u64 r = rsize(size);
    if (g_gva_bump > GVA_END - r) return CUDA_ERROR_OUT_OF_MEMORY;
    u64 va = g_gva_bump;
    struct entry *v = tadd(va, K_GVA, dev, size);
    if (!v) return CUDA_ERROR_OUT_OF_MEMORY;
    struct gnode *nd = graph_push(g, CU_GRAPH_NODE_TYPE_MEM_ALLOC);
    if (!nd) {
        tdel(v);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g_gva_bump += r;
    v->refs = 1;
    v->obj = nd;
    nd->device = dev;
    nd->size = size;
    nd->dptr = va;
    if (props) nd->props = *props;
    nd->props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    nd->props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    nd->props.location.id = dev;
    *out = nd;
    return CUDA_SUCCESS;
}

/* A free node: of an allocation of this graph (then freed in the graph), or of any other
 * known device pointer (freed when the graph is launched). */
static CUresult graph_add_free(struct fake_graph *g, u64 ptr, struct gnode **out) {
    struct entry *e = tfind(ptr);
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    struct gnode *own = NULL;
    if (e->kind == K_GVA) {
        struct gnode *a = e->obj;
        if (a && a->graph == g) {
            if (a->freed_in_graph) return CUDA_ERROR_INVALID_VALUE;
            own = a;
        }
    } else if (e->kind != K_DEV && e->kind != K_MANAGED && e->kind != K_ASYNC) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct gnode *nd = graph_push(g, CU_GRAPH_NODE_TYPE_MEM_FREE);
    if (!nd) return CUDA_ERROR_OUT_OF_MEMORY;
    nd->dptr = ptr;
    nd->device = e->device;
    if (own) own->freed_in_graph = 1;
    if (out) *out = nd;
    return CUDA_SUCCESS;
}

static void capture_terminate(struct capture *c) {
    for (struct capture **pp = &g_caps; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    if (c->stream) c->stream->cap = NULL;
    if (c->graph) graph_free(c->graph);
    free(c);
}

/* Potentially unsafe calls (see README) are prohibited while a capture says so: the
 * calling thread's mode is not RELAXED and it began an ongoing non-RELAXED capture, or
 * (its mode is GLOBAL and) another thread began an ongoing GLOBAL capture. Such a call
 * fails with 900 and invalidates every capture that prohibited it. */
static CUresult capture_unsafe_call(void) {
    if (!g_caps || t_capmode == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
    u64 me = my_tid();
    int hit = 0;
    for (struct capture *c = g_caps; c; c = c->next) {
        int own = c->owner == me && c->mode != CU_STREAM_CAPTURE_MODE_RELAXED;
        int other = c->owner != me && t_capmode == CU_STREAM_CAPTURE_MODE_GLOBAL && c->mode == CU_STREAM_CAPTURE_MODE_GLOBAL;
        if (own || other) {
            c->invalidated = 1;
            hit = 1;
        }
    }
    return hit ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

/* Work on the legacy NULL stream would wait for every blocking stream of its context:
 * with one of them capturing, that is an implicit dependency (906), which invalidates it. */
static CUresult legacy_stream_use(struct fake_ctx *ctx) {
    int hit = 0;
    for (struct capture *c = g_caps; c; c = c->next)
        if (c->stream->ctx == ctx && !(c->stream->flags & CU_STREAM_NON_BLOCKING)) {
            c->invalidated = 1;
            hit = 1;
        }
    return hit ? CUDA_ERROR_STREAM_CAPTURE_IMPLICIT : CUDA_SUCCESS;
}

static int stream_alive(struct entry *e) {
    return e->ctx && !e->ctx->destroyed && e->gen == e->ctx->gen && (!e->ctx->primary || e->ctx->refcount > 0);
}

/* What a stream argument means: NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD are the
 * current context's (NULL is the legacy stream unless the call is a _ptsz variant). */
struct sref {
    int dev;
    struct fake_ctx *ctx;
    struct entry *e; /* NULL for the special streams */
    int legacy;
};

static CUresult stream_resolve(CUstream s, int ptsz, struct sref *r) {
    u64 k = (u64)(uintptr_t)s;
    r->e = NULL;
    r->legacy = 0;
    if (k <= 2) {
        if (!ctx_usable(t_cur)) return CUDA_ERROR_INVALID_CONTEXT;
        r->ctx = t_cur;
        r->dev = t_cur->device;
        r->legacy = k == 1 || (k == 0 && !ptsz);
        return CUDA_SUCCESS;
    }
    struct entry *e = tfind(k);
    if (!e || e->kind != K_STREAM || !stream_alive(e)) return CUDA_ERROR_INVALID_HANDLE;
    r->e = e;
    r->ctx = e->ctx;
    r->dev = e->device;
    return CUDA_SUCCESS;
}

/* Resolves the stream of a stream-ordered call; fails on the legacy stream while a
 * blocking stream of its context captures. */
static CUresult stream_for_work(CUstream s, int ptsz, struct sref *r) {
    CUresult rc = stream_resolve(s, ptsz, r);
    if (rc == CUDA_SUCCESS && r->legacy) rc = legacy_stream_use(r->ctx);
    return rc;
}

/* The context ctx went away: its streams die, their captures end (graphs discarded). */
static void drop_streams_of(struct fake_ctx *ctx) {
    for (struct capture *c = g_caps, *next; c; c = next) {
        next = c->next;
        if (c->stream->ctx == ctx) capture_terminate(c);
    }
}

/* The primary context of dev went away: graph memory of the device goes with it. */
static void drop_graph_memory(int dev) {
    for (size_t i = 0; i < g_nbuckets; i++) {
        struct entry *e = g_buckets[i];
        while (e) {
            struct entry *next = e->next;
            if (e->kind == K_GVA && e->device == dev && e->live) {
                e->live = 0;
                gva_maybe_drop(e);
            }
            e = next;
        }
    }
    uncharge(dev, g_graph_reserved[dev]);
    g_graph_reserved[dev] = 0;
    g_graph_used[dev] = 0;
}

#define BEGIN                                  \
    CUresult rc_ = CUDA_SUCCESS;               \
    pthread_mutex_lock(&g_mu);                 \
    if (!g_inited) {                           \
        rc_ = CUDA_ERROR_NOT_INITIALIZED;      \
        goto out;                              \
    }
#define FAIL(code)   \
    do {             \
        rc_ = (code); \
        goto out;    \
    } while (0)
#define TRY(expr)                          \
    do {                                   \
        if ((rc_ = (expr)) != CUDA_SUCCESS) \
            goto out;                      \
    } while (0)
#define END                      \
    out:                         \
    pthread_mutex_unlock(&g_mu); \
    return rc_;

/* ---------- init, devices ---------- */

CUresult cuInit(unsigned int flags) {
    pthread_mutex_lock(&g_mu);
    load_config_locked();
    CUresult rc = CUDA_SUCCESS;
    if (flags != 0) rc = CUDA_ERROR_INVALID_VALUE;
    else if (g_nvis == 0) rc = CUDA_ERROR_NO_DEVICE;
    else g_inited = 1;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = 13000;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    BEGIN;
    if (!count) FAIL(CUDA_ERROR_INVALID_VALUE);
    *count = g_nvis;
    END
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    BEGIN;
    if (!dev) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(ordinal)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    *dev = ordinal;
    END
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    BEGIN;
    if (!name || len <= 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    snprintf(name, (size_t)len, "%s", g_device_name);
    END
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    BEGIN;
    if (!bytes) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    *bytes = g_mem;
    END
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    BEGIN;
    if (!uuid) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    uuid_bytes(g_vis[dev], (unsigned char *)uuid->bytes);
    END
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid(uuid, dev); }

/* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR (75) and _MINOR (76) as FAKE_CUDA_CC says;
 * every other attribute 1. */
CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev) {
    BEGIN;
    if (!value) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    /* Compute capability (75, 76); one multiprocessor (16) of g_stack_threads threads
     * (39: MAX_THREADS_PER_MULTIPROCESSOR), the threads a stack limit is paid for. */
    *value = attrib == 75 ? g_cc_major : attrib == 76 ? g_cc_minor : attrib == 39 ? (int)g_stack_threads : 1;
    END
}

/* ---------- contexts ---------- */

/* A context of dev is gone: counted when another context of the device lives on, or
 * stream-ordered or graph memory of the device outlives it (a pool's reserve, the graph
 * memory's). The library clears a device's books only with its last context, and charges
 * what outlives that again, so these are the teardowns after which its books may stay
 * above what the device holds (docs/operations.md, "Limits, in full"). VMM memory that outlives it does not
 * count: the library charges it again exactly. */
static void note_teardown(int dev) {
    int others = g_primary[dev].refcount > 0;
    for (size_t i = 0; i < g_nctxs && !others; i++)
        others = g_ctxs[i]->device == dev && !g_ctxs[i]->destroyed;
    u64 outlives = g_default_pool[dev].reserve + g_graph_reserved[dev];
    for (size_t i = 0; i < g_npools; i++)
        if (g_pools[i]->device == dev) outlives += g_pools[i]->reserve;
    if (others || outlives) g_teardowns_shared[g_vis[dev]]++;
}

/* The primary context of dev is gone (released to 0 or reset): with it its memory, its
 * graph memory, its streams and their captures. */
static void drop_primary(int dev) {
    drop_device_memory(dev);
    drop_graph_memory(dev);
    drop_streams_of(&g_primary[dev]);
    g_primary[dev].gen++;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    BEGIN;
    if (!pctx) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    struct fake_ctx *c = &g_primary[dev];
    if (c->refcount == 0 && g_ctx_bytes) TRY(charge(dev, g_ctx_bytes, 1));
    c->refcount++;
    *pctx = c;
    END
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    BEGIN;
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    struct fake_ctx *c = &g_primary[dev];
    if (c->refcount == 0) FAIL(CUDA_ERROR_INVALID_CONTEXT);
    if (--c->refcount == 0) {
        uncharge(dev, g_ctx_bytes);
        drop_primary(dev);
        note_teardown(dev);
    }
    END
}

CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    BEGIN;
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    struct fake_ctx *c = &g_primary[dev];
    if (c->refcount > 0) uncharge(dev, g_ctx_bytes);
    c->refcount = 0;
    drop_primary(dev);
    note_teardown(dev);
    END
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    BEGIN;
    if (!flags || !active) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    *flags = g_primary[dev].flags;
    *active = g_primary[dev].refcount > 0;
    END
}

static void push_current(struct fake_ctx *c) {
    if (t_depth < CTX_STACK) t_stack[t_depth++] = t_cur;
    t_cur = c;
}

static CUresult ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    BEGIN;
    if (!pctx) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    if (g_nctxs == g_capctxs) {
        size_t n = g_capctxs ? g_capctxs * 2 : 16;
        struct fake_ctx **v = realloc(g_ctxs, n * sizeof *v);
        if (!v) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
        g_ctxs = v;
        g_capctxs = n;
    }
    struct fake_ctx *c = calloc(1, sizeof *c);
    if (!c) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    if (g_ctx_bytes && charge(dev, g_ctx_bytes, 1) != CUDA_SUCCESS) {
        free(c);
        FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    }
    c->device = dev;
    c->flags = flags;
    g_ctxs[g_nctxs++] = c;
    push_current(c);
    *pctx = c;
    END
}

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) { return ctx_create(pctx, flags, dev); }

CUresult cuCtxCreate_v3(CUcontext *pctx, void *affinity, int n, unsigned int flags, CUdevice dev) {
    (void)affinity;
    (void)n;
    return ctx_create(pctx, flags, dev);
}

CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned int flags, CUdevice dev) {
    (void)params;
    return ctx_create(pctx, flags, dev);
}

CUresult cuCtxDestroy_v2(CUcontext ctx) {
    BEGIN;
    if (!ctx || ctx->primary || !ctx_known(ctx)) FAIL(CUDA_ERROR_INVALID_CONTEXT);
    ctx->destroyed = 1;
    uncharge(ctx->device, g_ctx_bytes);
    drop_streams_of(ctx);
    drop_context_memory(ctx);
    note_teardown(ctx->device);
    if (t_cur == ctx) t_cur = t_depth ? t_stack[--t_depth] : NULL;
    END
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    BEGIN;
    if (ctx && !ctx_known(ctx)) FAIL(CUDA_ERROR_INVALID_CONTEXT);
    t_cur = ctx;
    END
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    BEGIN;
    if (!pctx) FAIL(CUDA_ERROR_INVALID_VALUE);
    *pctx = t_cur;
    END
}

/* As the H200 answers (driver 580): a primary context left current after its reset or its
 * last release still names its device, although nothing else can use it (cuMemGetInfo
 * there: CUDA_ERROR_CONTEXT_IS_DESTROYED). */
CUresult cuCtxGetDevice(CUdevice *dev) {
    BEGIN;
    if (!dev) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (t_cur && t_cur->primary) {
        *dev = t_cur->device;
        goto out;
    }
    TRY(cur_device(dev));
    END
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    BEGIN;
    if (!ctx || !ctx_known(ctx)) FAIL(CUDA_ERROR_INVALID_CONTEXT);
    push_current(ctx);
    END
}

CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    BEGIN;
    if (!t_cur) FAIL(CUDA_ERROR_INVALID_CONTEXT);
    if (pctx) *pctx = t_cur;
    t_cur = t_depth ? t_stack[--t_depth] : NULL;
    END
}

CUresult cuCtxSynchronize(void) {
    BEGIN;
    TRY(capture_unsafe_call());
    int dev;
    TRY(cur_device(&dev));
    sync_device(dev);
    END
}

/* ---------- synchronous memory ---------- */

static CUresult sync_alloc(CUdeviceptr *dptr, u64 size, int kind) {
    BEGIN;
    TRY(capture_unsafe_call());
    int dev;
    TRY(cur_device(&dev));
    if (!dptr || size == 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    TRY(charge(dev, size, 1));
    struct entry *e = tadd(next_devptr(dev, size), kind, dev, size);
    if (!e) {
        uncharge(dev, size);
        FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    }
    e->ctx = t_cur;
    *dptr = e->key;
    END
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) { return sync_alloc(dptr, bytes, K_DEV); }

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem) {
    if (!pitch || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16)) {
        pthread_mutex_lock(&g_mu);
        CUresult rc = g_inited ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
        pthread_mutex_unlock(&g_mu);
        return rc;
    }
    u64 p, bytes;
    /* The row alignment the driver picks (FAKE_CUDA_PITCH_ALIGN, default 512; read here:
     * the environment is fixed for the process). */
    static u64 align;
    if (!align) {
        u64 a = env_u64("FAKE_CUDA_PITCH_ALIGN", 512);
        align = a ? a : 512;
    }
    if (width > ~0ull - (align - 1)) return CUDA_ERROR_OUT_OF_MEMORY;
    p = round_up(width, align);
    if (__builtin_mul_overflow(p, (u64)height, &bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = sync_alloc(dptr, bytes, K_DEV);
    if (rc == CUDA_SUCCESS) *pitch = p;
    return rc;
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    if (flags != 1 && flags != 2) {
        pthread_mutex_lock(&g_mu);
        CUresult rc = g_inited ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
        pthread_mutex_unlock(&g_mu);
        return rc;
    }
    return sync_alloc(dptr, bytes, K_MANAGED);
}

/* Returns a stream-ordered allocation to its pool (live drops, reserve stays). */
static void pool_release_entry(struct entry *e) {
    struct fake_pool *p = e->pool;
    p->live -= e->size > p->live ? p->live : e->size;
    if (p->destroyed && p->live == 0) pool_shrink_to(p, 0);
    return_devptr(e->device, e->key, e->size);
    tdel(e);
}

/* Frees a device, managed, stream-ordered or live graph allocation. sync: cuMemFree_v2
 * (which refuses stream-ordered blocks under FAKE_CUDA_FREE_REFUSES_ASYNC). */
static CUresult free_any(CUdeviceptr dptr, int sync) {
    struct entry *e = tfind(dptr);
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    if (e->kind == K_GVA) {
        if (!e->live) return CUDA_ERROR_INVALID_VALUE;
        gva_free_live(e);
        return CUDA_SUCCESS;
    }
    if (e->kind == K_DEV || e->kind == K_MANAGED) {
        uncharge(e->device, e->size);
        return_devptr(e->device, e->key, e->size);
        tdel(e);
        return CUDA_SUCCESS;
    }
    if (e->kind == K_ASYNC) {
        if (sync && g_free_refuses_async) return CUDA_ERROR_INVALID_VALUE;
        jev("asyncfree", sync ? "cuMemFree" : "cuMemFreeAsync", e->device, (u64)(uintptr_t)e->pool, e->size, dptr);
        pool_release_entry(e);
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    BEGIN;
    TRY(capture_unsafe_call());
    int dev;
    TRY(cur_device(&dev));
    TRY(free_any(dptr, 1));
    END
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    BEGIN;
    if (g_caps) g_queries_in_capture++;
    int dev;
    TRY(cur_device(&dev));
    if (!free_bytes || !total_bytes) FAIL(CUDA_ERROR_INVALID_VALUE);
    u64 used = g_used[g_vis[dev]];
    used += g_other;
    *free_bytes = used > g_mem ? 0 : g_mem - used;
    *total_bytes = g_mem;
    END
}

/* ---------- never hooked: succeed ---------- */

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes) {
    (void)dst;
    (void)src;
    (void)bytes;
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t bytes) { return cuMemcpyHtoD_v2(dst, src, bytes); }

CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                        unsigned int by, unsigned int bz, unsigned int shmem, CUstream stream, void **params,
                        void **extra) {
    (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)stream, (void)params,
        (void)extra;
    BEGIN;
    int dev;
    TRY(cur_device(&dev));
    if (!t_cur->launched) {
        /* The first launch allocates the heap and the FIFO as set, and local memory. */
        u64 bytes = excess(t_cur->heap, HEAP_DEFAULT) + excess(t_cur->fifo, FIFO_DEFAULT) + g_launch_local;
        if (bytes) TRY(charge(dev, bytes, 1));
        t_cur->launched_bytes = bytes;
        t_cur->launched = 1;
    }
    END
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                             unsigned int by, unsigned int bz, unsigned int shmem, CUstream stream, void **params,
                             void **extra) {
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
}

CUresult cuStreamCreate(CUstream *pstream, unsigned int flags) {
    BEGIN;
    int dev;
    TRY(cur_device(&dev));
    if (!pstream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct entry *e = tadd(next_handle(), K_STREAM, dev, 0);
    if (!e) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    e->ctx = t_cur;
    e->gen = t_cur->gen;
    e->flags = flags;
    *pstream = (CUstream)(uintptr_t)e->key;
    END
}

/* Destroying a capturing stream ends its capture (the graph is discarded). */
CUresult cuStreamDestroy_v2(CUstream stream) {
    BEGIN;
    struct entry *e = tfind((u64)(uintptr_t)stream);
    if (!e || e->kind != K_STREAM) FAIL(CUDA_ERROR_INVALID_HANDLE);
    int alive = stream_alive(e);
    if (e->cap) capture_terminate(e->cap);
    tdel(e);
    if (!alive) FAIL(CUDA_ERROR_INVALID_HANDLE);
    END
}

/* Synchronizing gives back pool memory above each pool's release threshold. A capturing
 * stream cannot be synchronized (900, and its capture is invalidated). */
static CUresult stream_sync(CUstream stream, int ptsz) {
    BEGIN;
    struct sref r;
    TRY(stream_for_work(stream, ptsz, &r));
    if (r.e && r.e->cap) {
        r.e->cap->invalidated = 1;
        FAIL(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    sync_device(r.dev);
    END
}

CUresult cuStreamSynchronize(CUstream stream) { return stream_sync(stream, 0); }

CUresult cuStreamSynchronize_ptsz(CUstream stream) { return stream_sync(stream, 1); }

static CUresult stream_get(CUstream stream, int ptsz, CUcontext *pctx, CUdevice *pdev) {
    BEGIN;
    if (!pctx && !pdev) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct sref r;
    TRY(stream_resolve(stream, ptsz, &r));
    if (pctx) *pctx = r.ctx;
    if (pdev) *pdev = r.dev;
    END
}

CUresult cuStreamGetCtx(CUstream stream, CUcontext *pctx) { return stream_get(stream, 0, pctx, NULL); }

CUresult cuStreamGetCtx_ptsz(CUstream stream, CUcontext *pctx) { return stream_get(stream, 1, pctx, NULL); }

CUresult cuStreamGetDevice(CUstream stream, CUdevice *dev) { return stream_get(stream, 0, NULL, dev); }

CUresult cuStreamGetDevice_ptsz(CUstream stream, CUdevice *dev) { return stream_get(stream, 1, NULL, dev); }

/* ---------- stream capture ---------- */

/* Captures only on created streams: the NULL/legacy stream cannot be captured (900, as on
 * the real driver); the fake refuses the per-thread stream too. */
static CUresult begin_capture(CUstream stream, int mode, int ptsz) {
    BEGIN;
    if (mode < CU_STREAM_CAPTURE_MODE_GLOBAL || mode > CU_STREAM_CAPTURE_MODE_RELAXED) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct sref r;
    TRY(stream_resolve(stream, ptsz, &r));
    if (!r.e) FAIL(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    if (r.e->cap) FAIL(CUDA_ERROR_ILLEGAL_STATE);
    struct capture *c = calloc(1, sizeof *c);
    if (!c) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    c->graph = graph_new(1);
    if (!c->graph) {
        free(c);
        FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    }
    c->stream = r.e;
    c->mode = mode;
    c->owner = my_tid();
    c->next = g_caps;
    g_caps = c;
    r.e->cap = c;
    END
}

CUresult cuStreamBeginCapture_v2(CUstream stream, int mode) { return begin_capture(stream, mode, 0); }

CUresult cuStreamBeginCapture_v2_ptsz(CUstream stream, int mode) { return begin_capture(stream, mode, 1); }

static CUresult end_capture(CUstream stream, CUgraph *pgraph, int ptsz) {
    BEGIN;
    if (!pgraph) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct sref r;
    TRY(stream_resolve(stream, ptsz, &r));
    struct capture *c = r.e ? r.e->cap : NULL;
    if (!c) FAIL(CUDA_ERROR_ILLEGAL_STATE);
    if (c->mode != CU_STREAM_CAPTURE_MODE_RELAXED && c->owner != my_tid())
        FAIL(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
    *pgraph = NULL;
    if (c->invalidated) {
        capture_terminate(c);
        FAIL(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    struct fake_graph *g = c->graph;
    c->graph = NULL;
    g->in_capture = 0;
    capture_terminate(c);
    *pgraph = (CUgraph)(uintptr_t)g->id;
    END
}

CUresult cuStreamEndCapture(CUstream stream, CUgraph *pgraph) { return end_capture(stream, pgraph, 0); }

CUresult cuStreamEndCapture_ptsz(CUstream stream, CUgraph *pgraph) { return end_capture(stream, pgraph, 1); }

/* The legacy stream answers 906 while a blocking stream of its context captures. */
static CUresult is_capturing(CUstream stream, int *status, int ptsz) {
    BEGIN;
    if (!status) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct sref r;
    TRY(stream_resolve(stream, ptsz, &r));
    if (r.legacy) {
        for (struct capture *c = g_caps; c; c = c->next)
            if (c->stream->ctx == r.ctx && !(c->stream->flags & CU_STREAM_NON_BLOCKING))
                FAIL(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    }
    struct capture *c = r.e ? r.e->cap : NULL;
    *status = !c ? CU_STREAM_CAPTURE_STATUS_NONE
                 : c->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    END
}

CUresult cuStreamIsCapturing(CUstream stream, int *status) { return is_capturing(stream, status, 0); }

CUresult cuStreamIsCapturing_ptsz(CUstream stream, int *status) { return is_capturing(stream, status, 1); }

/* Thread-local, needs no context (works before cuInit too, as a plain exchange). */
CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    if (!mode || *mode < CU_STREAM_CAPTURE_MODE_GLOBAL || *mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    int old = t_capmode;
    t_capmode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

/* ---------- modules, libraries, limits ---------- */

/* What a cubin or fatbinary image places on the device, read as the driver would: the
 * sizes of a cubin's (ELF64) .text*, .nv.constant* and .nv.global* sections; from a
 * fatbinary, the cubin for the device's compute capability (FAKE_CUDA_CC), else the newest
 * lower one of the same major. `len`: how many bytes are known to be there (a file's
 * size; for memory, the image's own headers are trusted, as the driver trusts them).
 * Returns 0 when it cannot say (another format, a compressed entry, PTX to compile): the
 * load then costs FAKE_CUDA_MODULE_BYTES. Written apart from the library's parser, so that
 * the tests check one against the other. */
static u64 rd16(const unsigned char *p) { return (u64)p[0] | (u64)p[1] << 8; }
static u64 rd32(const unsigned char *p) { return rd16(p) | rd16(p + 2) << 16; }
static u64 rd64(const unsigned char *p) { return rd32(p) | rd32(p + 4) << 32; }

static int cubin_bytes(const unsigned char *p, u64 len, u64 *bytes) {
    if (len < 64 || memcmp(p, "\x7f" "ELF", 4) != 0 || p[4] != 2 || p[5] != 1) return 0;
    u64 shoff = rd64(p + 0x28), shentsize = rd16(p + 0x3a), shnum = rd16(p + 0x3c), shstrndx = rd16(p + 0x3e);
    if (shentsize < 64 || shstrndx >= shnum || shoff > len || shnum * shentsize > len - shoff) return 0;
    const unsigned char *names = p + shoff + shstrndx * shentsize;
    u64 noff = rd64(names + 0x18), nsize = rd64(names + 0x20);
    if (noff > len || nsize > len - noff) return 0;
    static const char *const device_sections[] = {".text", ".nv.constant", ".nv.global"};
    u64 total = 0;
    for (u64 i = 0; i < shnum; i++) {
        const unsigned char *sh = p + shoff + i * shentsize;
        u64 name = rd32(sh);
        if (name >= nsize) continue;
        const char *n = (const char *)p + noff + name;
        size_t n_len = strnlen(n, (size_t)(nsize - name));
        for (int k = 0; k < 3; k++) {
            size_t plen = strlen(device_sections[k]);
            if (n_len >= plen && !memcmp(n, device_sections[k], plen)) total += rd64(sh + 0x20);
        }
    }
    *bytes = total;
    return 1;
}

static int image_bytes(const unsigned char *p, u64 len, u64 *bytes) {
    if (!p || len < 16) return 0;
    if (!memcmp(p, "\x7f" "ELF", 4)) return cubin_bytes(p, len, bytes);
    if (rd32(p) != 0xBA55ED50ull) return 0;
    u64 end = rd16(p + 6) + rd64(p + 8), cc = (u64)(g_cc_major * 10 + g_cc_minor);
    if (end > len) return 0;
    u64 chosen = 0, chosen_arch = 0, chosen_len = 0, chosen_flags = 0;
    int exact = 0;
    for (u64 at = rd16(p + 6); at + 64 <= end;) {
        const unsigned char *e = p + at;
        u64 head = rd32(e + 4), size = rd64(e + 8), kind = rd16(e), arch = rd32(e + 28);
        if (head < 64 || size > end - at - head) return 0;
        int usable = kind == 2 && (arch == cc || (arch / 10 == cc / 10 && arch < cc));
        if (usable && !exact && (!chosen || arch > chosen_arch)) {
            chosen = at + head, chosen_arch = arch, chosen_len = size, chosen_flags = rd64(e + 40);
            exact = arch == cc;
        }
        at += head + size;
    }
    if (!chosen || (chosen_flags & (0x2000 | 0x8000))) return 0;
    return cubin_bytes(p + chosen, chosen_len, bytes);
}

/* A module's or library's globals are device memory that no allocation call names: each
 * costs what its image says (above), else FAKE_CUDA_MODULE_BYTES, on the current device,
 * as the H200 measured: a module at its load; a library at its load with
 * CUDA_MODULE_LOADING=EAGER, else (lazy loading) at its first cuLibraryGet*. An unload,
 * or the context's end, gives it back. */
#define MODULE_PENDING 1u

static CUresult module_load(u64 *out, int library, const void *image, u64 len) {
    BEGIN;
    g_module_loads++;
    int dev;
    TRY(cur_device(&dev));
    if (!out) FAIL(CUDA_ERROR_INVALID_VALUE);
    u64 cost = g_module_bytes;
    (void)image_bytes(image, len, &cost);
    int lazy = library && !g_eager;
    u64 bytes = lazy ? 0 : cost;
    if (bytes) TRY(charge(dev, bytes, 1));
    struct entry *e = tadd(reused_handle(), K_MODULE, dev, bytes);
    if (!e) {
        uncharge(dev, bytes);
        FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    }
    e->ctx = t_cur;
    e->flags = lazy ? MODULE_PENDING : 0;
    e->pending = lazy ? cost : 0;
    *out = e->key;
    END
}

/* A file's image, read whole (at most 64 MiB), for module_load; NULL when unreadable. */
static unsigned char *read_image(const char *path, u64 *len) {
    *len = 0;
    FILE *f = path ? fopen(path, "rb") : NULL;
    if (!f) return NULL;
    unsigned char *buf = malloc(64 * MIB);
    if (buf) *len = fread(buf, 1, 64 * MIB, f);
    fclose(f);
    return buf;
}

static CUresult file_load(u64 *out, int library, const char *path) {
    u64 len;
    unsigned char *image = read_image(path, &len);
    CUresult rc = module_load(out, library, image, len);
    free(image);
    return rc;
}

/* Memory images: their own headers say how long they are. */
#define IMAGE_LEN (1ull << 40)

static CUresult module_unload(u64 key) {
    BEGIN;
    struct entry *e = tfind(key);
    if (!e || e->kind != K_MODULE) FAIL(CUDA_ERROR_INVALID_HANDLE);
    uncharge(e->device, e->size);
    handle_gone(e);
    tdel(e);
    END
}

/* A library's first look-up loads it (lazy loading). */
static CUresult library_lookup(u64 key, void *out) {
    BEGIN;
    struct entry *e = tfind(key);
    if (!e || e->kind != K_MODULE) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (!out) FAIL(CUDA_ERROR_INVALID_VALUE);
    if ((e->flags & MODULE_PENDING) && e->pending) {
        TRY(charge(e->device, e->pending, 1));
        e->size += e->pending;
    }
    e->flags &= ~MODULE_PENDING;
    END
}

#define AS_MODULE(out, rc_expr)                        \
    u64 h_ = 0;                                        \
    CUresult r_ = (rc_expr);                           \
    if (r_ == CUDA_SUCCESS) *(out) = (void *)(uintptr_t)h_; \
    return r_;

/* CU_MODULE_EAGER_LOADING (1) with CUDA_MODULE_LOADING=EAGER, else CU_MODULE_LAZY_LOADING (2).
 * FAKE_CUDA_NO_LOADING_MODE=1: the driver cannot say (CUDA_ERROR_NOT_SUPPORTED), and still
 * loads libraries lazily unless told EAGER. */
CUresult cuModuleGetLoadingMode(int *mode) {
    BEGIN;
    if (!mode) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (g_no_loading_mode) FAIL(CUDA_ERROR_NOT_SUPPORTED);
    *mode = g_eager ? 1 : 2;
    END
}

CUresult cuModuleLoad(CUmodule *module, const char *fname) {
    AS_MODULE((void **)module, file_load(module ? &h_ : NULL, 0, fname))
}
CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    AS_MODULE((void **)module, module_load(module ? &h_ : NULL, 0, image, IMAGE_LEN))
}
CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int n, int *options, void **values) {
    (void)n, (void)options, (void)values;
    AS_MODULE((void **)module, module_load(module ? &h_ : NULL, 0, image, IMAGE_LEN))
}
CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatbin) {
    AS_MODULE((void **)module, module_load(module ? &h_ : NULL, 0, fatbin, IMAGE_LEN))
}
CUresult cuModuleUnload(CUmodule module) { return module_unload((u64)(uintptr_t)module); }

CUresult cuLibraryLoadData(CUlibrary *library, const void *code, int *jo, void **jv, unsigned int nj, int *lo,
                           void **lv, unsigned int nl) {
    (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
    pause_in("cuLibraryLoadData");
    AS_MODULE((void **)library, module_load(library ? &h_ : NULL, 1, code, IMAGE_LEN))
}
CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *file, int *jo, void **jv, unsigned int nj, int *lo,
                               void **lv, unsigned int nl) {
    (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
    AS_MODULE((void **)library, file_load(library ? &h_ : NULL, 1, file))
}
CUresult cuLibraryUnload(CUlibrary library) { return module_unload((u64)(uintptr_t)library); }

CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name) {
    (void)name;
    pause_in("cuLibraryGetGlobal");
    CUresult rc = library_lookup((u64)(uintptr_t)library, dptr);
    if (rc == CUDA_SUCCESS) {
        *dptr = 0x7000000000ull;
        if (bytes) *bytes = (size_t)g_module_bytes;
    }
    return rc;
}
CUresult cuLibraryGetManaged(CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name) {
    return cuLibraryGetGlobal(dptr, bytes, library, name);
}
CUresult cuLibraryGetModule(CUmodule *module, CUlibrary library) {
    CUresult rc = library_lookup((u64)(uintptr_t)library, module);
    if (rc == CUDA_SUCCESS) *module = (CUmodule)(uintptr_t)library;
    return rc;
}
CUresult cuLibraryGetKernel(CUkernel *kernel, CUlibrary library, const char *name) {
    (void)name;
    CUresult rc = library_lookup((u64)(uintptr_t)library, kernel);
    if (rc == CUDA_SUCCESS) *kernel = (CUkernel)(uintptr_t)0x2000;
    return rc;
}

/* fake_cuda_limit_hook: a test's function, called outside the fake's lock at the start of
 * cuCtxGetLimit (phase 0) and cuCtxSetLimit (phase 1), and at the end of a cuCtxSetLimit
 * that succeeded (phase 2), so that a test can order concurrent limit calls (or run
 * other calls inside one). NULL (the default): nothing is called. */
static void (*volatile g_limit_hook)(int phase, int limit, size_t value);

void fake_cuda_limit_hook(void (*hook)(int phase, int limit, size_t value)) {
    __atomic_store_n(&g_limit_hook, hook, __ATOMIC_SEQ_CST);
}

static void limit_hook(int phase, int limit, size_t value) {
    void (*hook)(int, int, size_t) = __atomic_load_n(&g_limit_hook, __ATOMIC_SEQ_CST);
    if (hook) hook(phase, limit, value);
}

static CUresult get_limit(size_t *value, int limit) {
    BEGIN;
    if (g_caps) g_queries_in_capture++;
    int dev;
    TRY(cur_device(&dev));
    if (!value || limit < 0 || limit > 2) FAIL(CUDA_ERROR_INVALID_VALUE);
    *value = (size_t)limit_of(t_cur, limit);
    END
}

CUresult cuCtxGetLimit(size_t *value, int limit) {
    limit_hook(0, limit, 0);
    return get_limit(value, limit);
}

/* CU_LIMIT_STACK_SIZE (0) is paid at once; CU_LIMIT_PRINTF_FIFO_SIZE (1) and
 * CU_LIMIT_MALLOC_HEAP_SIZE (2) at the context's first launch, and refused after it. */
static CUresult set_limit(int limit, size_t value) {
    BEGIN;
    int dev;
    TRY(cur_device(&dev));
    if (limit < 0 || limit > 2) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (limit == 0) {
        u64 old = stack_bytes(t_cur->stack), now = stack_bytes(value);
        if (now > old) TRY(charge(dev, now - old, 1));
        else uncharge(dev, old - now);
        t_cur->stack = value;
    } else {
        if (t_cur->launched) FAIL(CUDA_ERROR_INVALID_VALUE);
        if (limit == 1) t_cur->fifo = value;
        else t_cur->heap = value;
    }
    END
}

CUresult cuCtxSetLimit(int limit, size_t value) {
    limit_hook(1, limit, value);
    CUresult rc = set_limit(limit, value);
    if (rc == CUDA_SUCCESS) limit_hook(2, limit, value);
    return rc;
}

/* ---------- virtual memory management ---------- */

static CUresult check_location(const CUmemAllocationProp *prop) {
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        return valid_dev(prop->location.id) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_HOST) return CUDA_SUCCESS;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemGetAllocationGranularity(size_t *gran, const CUmemAllocationProp *prop, int option) {
    BEGIN;
    if (!gran || (option != 0 && option != 1)) FAIL(CUDA_ERROR_INVALID_VALUE);
    TRY(check_location(prop));
    *gran = GRANULARITY;
    END
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
    BEGIN;
    TRY(capture_unsafe_call());
    if (!handle || flags != 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    TRY(check_location(prop));
    if (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC) FAIL(CUDA_ERROR_NOT_SUPPORTED);
    if (size == 0 || size % GRANULARITY) FAIL(CUDA_ERROR_INVALID_VALUE);
    int host = prop->location.type == CU_MEM_LOCATION_TYPE_HOST;
    int dev = host ? 0 : prop->location.id;
    if (!host) TRY(charge(dev, size, 1));
    struct entry *e = tadd(next_handle(), K_VMM, dev, size);
    if (!e) {
        if (!host) uncharge(dev, size);
        FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    }
    e->host = host;
    e->refs = 1;
    *handle = e->key;
    END
}

/* Physical memory goes back only when every reference is released and no mapping remains. */
static void vmm_maybe_free(struct entry *e) {
    if (e->refs == 0 && e->mapcount == 0) {
        if (!e->host) uncharge(e->device, e->size);
        tdel(e);
    }
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    BEGIN;
    struct entry *e = tfind(handle);
    if (!e || e->kind != K_VMM || e->refs == 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    e->refs--;
    vmm_maybe_free(e);
    END
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
    (void)addr;
    (void)flags;
    BEGIN;
    if (!ptr || size == 0 || size % GRANULARITY || (align & (align - 1))) FAIL(CUDA_ERROR_INVALID_VALUE);
    u64 a = align > GRANULARITY ? align : GRANULARITY;
    u64 p = round_up(g_va_bump, a);
    if (p > ~0ull - size) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    g_va_bump = p + size;
    *ptr = p;
    END
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    BEGIN;
    if (!ptr || size == 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    END
}

struct mapping {
    u64 va, size, handle;
};
static struct mapping *g_maps;
static size_t g_nmaps, g_capmaps;

static void pause_after(const char *call) {
    if (g_pause_after_ms && strcmp(g_pause_after_call, call) == 0) usleep(g_pause_after_ms * 1000u);
}

static CUresult mem_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                        unsigned long long flags);

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    CUresult rc = mem_map(ptr, size, offset, handle, flags);
    pause_after("cuMemMap");
    return rc;
}

static CUresult mem_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    BEGIN;
    struct entry *e = tfind(handle);
    if (!ptr || size == 0 || flags != 0 || !e || e->kind != K_VMM || e->refs == 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (offset > e->size || size > e->size - offset) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (g_nmaps == g_capmaps) {
        size_t n = g_capmaps ? g_capmaps * 2 : 64;
        struct mapping *m = realloc(g_maps, n * sizeof *m);
        if (!m) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
        g_maps = m;
        g_capmaps = n;
    }
    g_maps[g_nmaps++] = (struct mapping){ptr, size, handle};
    e->mapcount++;
    END
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    BEGIN;
    if (!ptr || size == 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    size_t removed = 0;
    for (size_t i = 0; i < g_nmaps;) {
        struct mapping m = g_maps[i];
        if (m.va >= ptr && m.va - ptr < size) {
            g_maps[i] = g_maps[--g_nmaps];
            removed++;
            struct entry *e = tfind(m.handle);
            if (e && e->kind == K_VMM) {
                e->mapcount--;
                vmm_maybe_free(e);
            }
        } else {
            i++;
        }
    }
    if (!removed) FAIL(CUDA_ERROR_INVALID_VALUE);
    END
}

/* The handle mapped at addr (anywhere inside a mapping), with one more reference. */
static CUresult retain_handle(CUmemGenericAllocationHandle *handle, void *addr);

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    CUresult rc = retain_handle(handle, addr);
    pause_after("cuMemRetainAllocationHandle");
    return rc;
}

static CUresult retain_handle(CUmemGenericAllocationHandle *handle, void *addr) {
    BEGIN;
    if (!handle) FAIL(CUDA_ERROR_INVALID_VALUE);
    u64 a = (u64)(uintptr_t)addr;
    for (size_t i = 0; i < g_nmaps; i++) {
        struct mapping m = g_maps[i];
        if (a >= m.va && a - m.va < m.size) {
            struct entry *e = tfind(m.handle);
            if (!e || e->kind != K_VMM) break;
            e->refs++;
            *handle = m.handle;
            goto out;
        }
    }
    FAIL(CUDA_ERROR_INVALID_VALUE);
    END
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count) {
    (void)ptr;
    (void)size;
    (void)desc;
    (void)count;
    BEGIN;
    END
}

/* ---------- stream-ordered pools ---------- */

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
    BEGIN;
    if (!pool) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    *pool = &g_default_pool[dev];
    END
}

CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    BEGIN;
    if (!pool) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    *pool = g_cur_pool[dev];
    END
}

CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
    BEGIN;
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    if (!pool_known(pool) || pool->device != dev) FAIL(CUDA_ERROR_INVALID_VALUE);
    g_cur_pool[dev] = pool;
    END
}

CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    BEGIN;
    if (!pool || !props || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(props->location.id)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    if (g_npools == g_cappools) {
        size_t n = g_cappools ? g_cappools * 2 : 16;
        struct fake_pool **v = realloc(g_pools, n * sizeof *v);
        if (!v) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
        g_pools = v;
        g_cappools = n;
    }
    struct fake_pool *p = calloc(1, sizeof *p);
    if (!p) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    p->device = props->location.id;
    g_pools[g_npools++] = p;
    *pool = p;
    END
}

static void pause_in(const char *call);

CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    pause_in("cuMemPoolDestroy");
    BEGIN;
    if (!pool_known(pool) || pool->is_default) FAIL(CUDA_ERROR_INVALID_VALUE);
    pool->destroyed = 1;
    /* In use now, or when the caller last asked: the library looks just before it
     * destroys, and a cuMemFree on another thread may come in between. */
    if (pool->live || pool->used_told) g_pools_destroyed_live[g_vis[pool->device]]++;
    if (g_cur_pool[pool->device] == pool) g_cur_pool[pool->device] = &g_default_pool[pool->device];
    pool_shrink_to(pool, round_up(pool->live, POOL_CHUNK));
    END
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    BEGIN;
    TRY(capture_unsafe_call());
    if (!pool_known(pool) || !value) FAIL(CUDA_ERROR_INVALID_VALUE);
    u64 v = *(u64 *)value;
    switch (attr) {
    case 1: case 2: case 3: break; /* reuse policies (int): accepted, no effect */
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: pool->threshold = v; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
        if (v) FAIL(CUDA_ERROR_INVALID_VALUE);
        pool->reserve_high = pool->reserve;
        break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        if (v) FAIL(CUDA_ERROR_INVALID_VALUE);
        pool->used_high = pool->live;
        break;
    default: FAIL(CUDA_ERROR_INVALID_VALUE);
    }
    END
}

CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
    BEGIN;
    TRY(capture_unsafe_call());
    if (!pool_known(pool) || !value) FAIL(CUDA_ERROR_INVALID_VALUE);
    u64 *out = value;
    switch (attr) {
    case 1: case 2: case 3: *(int *)value = 1; break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *out = pool->threshold; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *out = pool->reserve; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *out = pool->reserve_high; break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *out = pool->used_told = pool->live; break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *out = pool->used_high; break;
    default: FAIL(CUDA_ERROR_INVALID_VALUE);
    }
    if (attr >= CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) jev("poolattr", __func__, pool->device, (u64)(uintptr_t)pool, (u64)attr, *out);
    END
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t min_keep) {
    BEGIN;
    TRY(capture_unsafe_call());
    if (!pool_known(pool)) FAIL(CUDA_ERROR_INVALID_VALUE);
    pool_shrink_to(pool, max_u64(round_up(pool->live, POOL_CHUNK), round_up(min_keep, POOL_CHUNK)));
    jev("pooltrim", __func__, pool->device, (u64)(uintptr_t)pool, pool->live, pool->reserve);
    END
}

/* pool == NULL: the current pool of the stream's device. On a capturing stream nothing
 * is allocated: an alloc node joins the capture's graph and its VA is returned. */
static CUresult async_alloc(CUdeviceptr *dptr, u64 size, struct fake_pool *pool, CUstream stream, int ptsz) {
    BEGIN;
    struct sref r;
    TRY(stream_for_work(stream, ptsz, &r));
    if (!dptr || size == 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!pool) pool = g_cur_pool[r.dev];
    else if (!pool_known(pool)) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (r.e && r.e->cap) {
        struct gnode *nd;
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        TRY(graph_add_alloc(r.e->cap->graph, pool->device, size, &props, &nd));
        *dptr = nd->dptr;
        goto out;
    }
    if (size > g_mem || size > ~0ull - pool->live) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    u64 grown = 0;
    if (pool->live + size > pool->reserve) {
        u64 want = round_up(pool->live + size, POOL_CHUNK);
        grown = want - pool->reserve;
        TRY(charge(pool->device, grown, 0));
        pool->reserve = want;
    }
    struct entry *e = tadd(next_devptr(pool->device, size), K_ASYNC, pool->device, size);
    if (!e) {
        pool->reserve -= grown;
        uncharge(pool->device, grown);
        FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    }
    e->pool = pool;
    pool->live += size;
    jev("asyncalloc", __func__, pool->device, (u64)(uintptr_t)pool, size, pool->reserve);
    pool->reserve_high = max_u64(pool->reserve_high, pool->reserve);
    pool->used_high = max_u64(pool->used_high, pool->live);
    *dptr = e->key;
    END
}

/* FAKE_CUDA_PAUSE: outside the fake's lock, so other threads' calls go on meanwhile. */
static void pause_in(const char *call) {
    if (g_pause_ms && strcmp(g_pause_call, call) == 0) usleep(g_pause_ms * 1000u);
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream stream) {
    pause_in("cuMemAllocAsync");
    return async_alloc(dptr, bytes, NULL, stream, 0);
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream stream) {
    return async_alloc(dptr, bytes, NULL, stream, 1);
}

static CUresult from_pool_async(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream stream, int ptsz) {
    if (!pool) {
        pthread_mutex_lock(&g_mu);
        CUresult rc = g_inited ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
        pthread_mutex_unlock(&g_mu);
        return rc;
    }
    return async_alloc(dptr, bytes, pool, stream, ptsz);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream stream) {
    return from_pool_async(dptr, bytes, pool, stream, 0);
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream stream) {
    return from_pool_async(dptr, bytes, pool, stream, 1);
}

/* On a capturing stream: a free node (see graph_add_free); else frees at once. */
static CUresult free_async(CUdeviceptr dptr, CUstream stream, int ptsz) {
    BEGIN;
    struct sref r;
    TRY(stream_for_work(stream, ptsz, &r));
    if (r.e && r.e->cap) {
        TRY(graph_add_free(r.e->cap->graph, dptr, NULL));
        goto out;
    }
    TRY(free_any(dptr, 0));
    END
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    pause_in("cuMemFreeAsync");
    return free_async(dptr, stream, 0);
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream) { return free_async(dptr, stream, 1); }

/* ---------- arrays ---------- */

static int format_bytes(int format) {
    switch (format) {
    case 0x01: case 0x08: return 1;
    case 0x02: case 0x09: case 0x10: return 2;
    case 0x03: case 0x0a: case 0x20: return 4;
    default: return 0;
    }
}

static u64 dim(u64 x, unsigned level) {
    x >>= level;
    return x ? x : 1;
}

/* Bytes of a (mipmapped) array; 0 when the descriptor is invalid or overflows. */
static u64 array_bytes(u64 w, u64 h, u64 d, int format, unsigned ch, unsigned levels) {
    u64 elem = (u64)format_bytes(format);
    if (!elem || w == 0 || (ch != 1 && ch != 2 && ch != 4) || levels == 0) return 0;
    u64 total = 0;
    for (unsigned l = 0; l < levels && l < 64; l++) {
        u64 t;
        if (__builtin_mul_overflow(dim(w, l), dim(h, l), &t) || __builtin_mul_overflow(t, dim(d, l), &t) ||
            __builtin_mul_overflow(t, elem * ch, &t) || __builtin_add_overflow(total, t, &total))
            return 0;
    }
    return total;
}

static CUresult array_create(u64 *out, u64 bytes, int kind) {
    BEGIN;
    int dev;
    TRY(cur_device(&dev));
    if (!out || bytes == 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    TRY(charge(dev, bytes, 1));
    struct entry *e = tadd(reused_handle(), kind, dev, bytes);
    if (!e) {
        uncharge(dev, bytes);
        FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    }
    e->ctx = t_cur;
    *out = e->key;
    END
}

CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *desc) {
    u64 bytes = desc ? array_bytes(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels, 1) : 0;
    u64 h = 0;
    CUresult rc = array_create(arr ? &h : NULL, bytes, K_ARRAY);
    if (rc == CUDA_SUCCESS) *arr = (CUarray)(uintptr_t)h;
    return rc;
}

CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    u64 bytes = desc ? array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels, 1) : 0;
    u64 h = 0;
    CUresult rc = array_create(arr ? &h : NULL, bytes, K_ARRAY);
    if (rc == CUDA_SUCCESS) *arr = (CUarray)(uintptr_t)h;
    return rc;
}

CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned int levels) {
    u64 bytes =
        desc ? array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels, levels) : 0;
    u64 h = 0;
    CUresult rc = array_create(arr ? &h : NULL, bytes, K_MIPMAP);
    if (rc == CUDA_SUCCESS) *arr = (CUmipmappedArray)(uintptr_t)h;
    return rc;
}

static CUresult array_destroy(u64 key, int kind) {
    BEGIN;
    struct entry *e = tfind(key);
    if (!e || e->kind != kind) FAIL(CUDA_ERROR_INVALID_VALUE);
    uncharge(e->device, e->size);
    handle_gone(e);
    tdel(e);
    END
}

CUresult cuArrayDestroy(CUarray arr) { return array_destroy((u64)(uintptr_t)arr, K_ARRAY); }

CUresult cuMipmappedArrayDestroy(CUmipmappedArray arr) { return array_destroy((u64)(uintptr_t)arr, K_MIPMAP); }

/* ---------- graphs and graph memory ---------- */

static struct fake_graph *graph_lookup(CUgraph graph) {
    struct entry *e = tfind((u64)(uintptr_t)graph);
    if (!e || e->kind != K_GRAPH) return NULL;
    struct fake_graph *g = e->obj;
    return g->in_capture ? NULL : g;
}

static struct gnode *node_lookup(CUgraphNode node) {
    struct entry *e = tfind((u64)(uintptr_t)node);
    return e && e->kind == K_GNODE ? e->obj : NULL;
}

static struct fake_exec *exec_lookup(CUgraphExec exec) {
    struct entry *e = tfind((u64)(uintptr_t)exec);
    return e && e->kind == K_EXEC ? e->obj : NULL;
}

static CUresult check_deps(struct fake_graph *g, const CUgraphNode *deps, size_t n) {
    if (n && !deps) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < n; i++) {
        struct gnode *d = node_lookup(deps[i]);
        if (!d || d->graph != g) return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult cuGraphCreate(CUgraph *graph, unsigned int flags) {
    BEGIN;
    if (!graph || flags) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct fake_graph *g = graph_new(0);
    if (!g) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    *graph = (CUgraph)(uintptr_t)g->id;
    END
}

/* Allocations the graph made that are live stay live (and keep their VA). */
CUresult cuGraphDestroy(CUgraph graph) {
    BEGIN;
    struct fake_graph *g = graph_lookup(graph);
    if (!g) FAIL(CUDA_ERROR_INVALID_VALUE);
    graph_free(g);
    END
}

CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                CUDA_MEM_ALLOC_NODE_PARAMS *params) {
    BEGIN;
    struct fake_graph *g = graph_lookup(graph);
    if (!node || !g || !params) FAIL(CUDA_ERROR_INVALID_VALUE);
    TRY(check_deps(g, deps, ndeps));
    const CUmemPoolProps *p = &params->poolProps;
    if (p->allocType != CU_MEM_ALLOCATION_TYPE_PINNED || p->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(p->location.id)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    struct gnode *nd;
    TRY(graph_add_alloc(g, p->location.id, params->bytesize, p, &nd));
    params->dptr = nd->dptr;
    *node = (CUgraphNode)(uintptr_t)nd->id;
    END
}

CUresult cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                               CUdeviceptr dptr) {
    BEGIN;
    struct fake_graph *g = graph_lookup(graph);
    if (!node || !g) FAIL(CUDA_ERROR_INVALID_VALUE);
    TRY(check_deps(g, deps, ndeps));
    struct gnode *nd;
    TRY(graph_add_free(g, dptr, &nd));
    *node = (CUgraphNode)(uintptr_t)nd->id;
    END
}

CUresult cuGraphMemAllocNodeGetParams(CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS *params) {
    BEGIN;
    struct gnode *nd = node_lookup(node);
    if (!nd || !params || nd->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC) FAIL(CUDA_ERROR_INVALID_VALUE);
    memset(params, 0, sizeof *params);
    params->poolProps = nd->props;
    params->bytesize = nd->size;
    params->dptr = nd->dptr;
    END
}

CUresult cuGraphMemFreeNodeGetParams(CUgraphNode node, CUdeviceptr *dptr) {
    BEGIN;
    struct gnode *nd = node_lookup(node);
    if (!nd || !dptr || nd->type != CU_GRAPH_NODE_TYPE_MEM_FREE) FAIL(CUDA_ERROR_INVALID_VALUE);
    *dptr = nd->dptr;
    END
}

/* nodes == NULL: *num = the count. Else fills min(*num, count) handles (the rest of the
 * array NULL) and sets *num to the number written. */
CUresult cuGraphGetNodes(CUgraph graph, CUgraphNode *nodes, size_t *num) {
    BEGIN;
    struct fake_graph *g = graph_lookup(graph);
    if (!g || !num) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!nodes) {
        *num = g->n;
        goto out;
    }
    size_t k = *num < g->n ? *num : g->n;
    for (size_t i = 0; i < *num; i++) nodes[i] = i < k ? (CUgraphNode)(uintptr_t)g->nodes[i]->id : NULL;
    *num = k;
    END
}

CUresult cuGraphNodeGetType(CUgraphNode node, int *type) {
    BEGIN;
    struct gnode *nd = node_lookup(node);
    if (!nd || !type) FAIL(CUDA_ERROR_INVALID_VALUE);
    *type = nd->type;
    END
}

static CUresult exec_run(struct fake_exec *x, CUstream stream, int ptsz, int launch);

/* A graph with memory nodes has at most one executable graph at a time. */
static CUresult instantiate(CUgraphExec *exec, CUgraph graph, u64 flags) {
    BEGIN;
    struct fake_graph *g = graph_lookup(graph);
    if (!exec || !g) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (flags & ~(u64)(CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH | CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD |
                       CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY))
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (g->n && g->nexecs) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct fake_exec *x = calloc(1, sizeof *x);
    if (!x) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    x->allocs = calloc(g->n ? g->n : 1, sizeof *x->allocs);
    x->frees = calloc(g->n ? g->n : 1, sizeof *x->frees);
    struct entry *xe = x->allocs && x->frees ? tadd(next_handle(), K_EXEC, 0, 0) : NULL;
    if (!xe) {
        free(x->allocs);
        free(x->frees);
        free(x);
        FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    }
    xe->obj = x;
    x->id = xe->key;
    x->graph_id = g->id;
    x->flags = flags;
    for (size_t i = 0; i < g->n; i++) {
        struct gnode *nd = g->nodes[i];
        if (nd->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
            x->allocs[x->nallocs++] = (struct xalloc){nd->dptr, nd->size, nd->device, nd->freed_in_graph};
            struct entry *v = tfind(nd->dptr);
            if (v && v->kind == K_GVA) v->refs++;
        } else {
            struct entry *t = tfind(nd->dptr);
            struct gnode *a = t && t->kind == K_GVA ? t->obj : NULL;
            if (!a || a->graph != g) x->frees[x->nfrees++] = nd->dptr;
        }
    }
    g->nexecs++;
    *exec = (CUgraphExec)(uintptr_t)x->id;
    END
}

static CUresult instantiate_upload(CUgraphExec *exec, CUgraph graph, u64 flags, CUstream upload, int ptsz) {
    CUresult rc = instantiate(exec, graph, flags);
    if (rc != CUDA_SUCCESS || !(flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD)) return rc;
    pthread_mutex_lock(&g_mu);
    struct fake_exec *x = exec_lookup(*exec);
    rc = x ? exec_run(x, upload, ptsz, 0) : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&g_mu);
    if (rc != CUDA_SUCCESS) {
        cuGraphExecDestroy(*exec);
        *exec = NULL;
    }
    return rc;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long flags) {
    if (flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) return CUDA_ERROR_INVALID_VALUE; /* WithParams only */
    return instantiate(exec, graph, flags);
}

static CUresult instantiate_params(CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params,
                                   int ptsz) {
    if (!params) return CUDA_ERROR_INVALID_VALUE;
    params->hErrNode_out = NULL;
    CUresult rc = instantiate_upload(exec, graph, params->flags, params->hUploadStream, ptsz);
    params->result_out = rc == CUDA_SUCCESS ? 0 : 1;
    return rc;
}

CUresult cuGraphInstantiateWithParams(CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params) {
    return instantiate_params(exec, graph, params, 0);
}

CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params) {
    return instantiate_params(exec, graph, params, 1);
}

/* Upload (launch = 0) or launch. Footprint F per device = its alloc nodes, each rounded up
 * to 2 MiB; the device's graph reserve grows to round_up(used + F, 32 MiB) if it is short
 * (no pool trimming; 2 if that does not fit, and nothing happens). A launch then makes the
 * allocations the graph does not free live and performs its free nodes of outside
 * pointers. Relaunching while its allocations are live: 1 (unless AUTO_FREE_ON_LAUNCH,
 * which frees them first). On a capturing stream: 801 (the fake does not nest graphs). */
static CUresult exec_run(struct fake_exec *x, CUstream stream, int ptsz, int launch) {
    struct sref r;
    CUresult rc = stream_for_work(stream, ptsz, &r);
    if (rc != CUDA_SUCCESS) return rc;
    if (r.e && r.e->cap) return CUDA_ERROR_NOT_SUPPORTED;
    int autofree = (x->flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) != 0;
    u64 used[MAX_DEV], need[MAX_DEV];
    memcpy(used, g_graph_used, sizeof used);
    memset(need, 0, sizeof need);
    for (size_t i = 0; i < x->nallocs; i++) {
        struct xalloc *a = &x->allocs[i];
        struct entry *v = tfind(a->va);
        if (launch && !a->freed && v && v->live) {
            if (!autofree) return CUDA_ERROR_INVALID_VALUE;
            used[a->device] -= rsize(a->size) > used[a->device] ? used[a->device] : rsize(a->size);
        }
        if (__builtin_add_overflow(need[a->device], rsize(a->size), &need[a->device])) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    u64 grow[MAX_DEV];
    memset(grow, 0, sizeof grow);
    for (int d = 0; d < g_nvis; d++) {
        u64 want;
        if (!need[d]) continue;
        if (__builtin_add_overflow(used[d], need[d], &want) || want > g_mem) return CUDA_ERROR_OUT_OF_MEMORY;
        if (want <= g_graph_reserved[d]) continue;
        grow[d] = round_up(want, POOL_CHUNK) - g_graph_reserved[d];
        if (!fits(d, grow[d])) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (int d = 0; d < g_nvis; d++)
        if (grow[d]) {
            charge(d, grow[d], 0);
            g_graph_reserved[d] += grow[d];
            note_graph_high(d);
        }
    if (!launch) return CUDA_SUCCESS;
    for (size_t i = 0; i < x->nallocs; i++) {
        struct xalloc *a = &x->allocs[i];
        struct entry *v = tfind(a->va);
        if (a->freed || !v || v->kind != K_GVA) continue;
        if (v->live) gva_free_live(v); /* auto-free on launch */
        v->live = 1;
        g_graph_used[a->device] += rsize(a->size);
        note_graph_high(a->device);
    }
    for (size_t i = 0; i < x->nfrees; i++) free_any(x->frees[i], 0);
    return CUDA_SUCCESS;
}

static CUresult exec_call(CUgraphExec exec, CUstream stream, int ptsz, int launch) {
    BEGIN;
    struct fake_exec *x = exec_lookup(exec);
    if (!x) FAIL(CUDA_ERROR_INVALID_VALUE);
    TRY(exec_run(x, stream, ptsz, launch));
    END
}

CUresult cuGraphUpload(CUgraphExec exec, CUstream stream) { return exec_call(exec, stream, 0, 0); }

CUresult cuGraphUpload_ptsz(CUgraphExec exec, CUstream stream) { return exec_call(exec, stream, 1, 0); }

CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream) {
    CUresult rc = exec_call(exec, stream, 0, 1);
    pause_after("cuGraphLaunch");
    return rc;
}

CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream) { return exec_call(exec, stream, 1, 1); }

/* Live allocations of the exec stay live. */
CUresult cuGraphExecDestroy(CUgraphExec exec) {
    BEGIN;
    struct fake_exec *x = exec_lookup(exec);
    if (!x) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct entry *ge = tfind(x->graph_id);
    if (ge && ge->kind == K_GRAPH) {
        struct fake_graph *g = ge->obj;
        if (g->nexecs) g->nexecs--;
    }
    for (size_t i = 0; i < x->nallocs; i++) gva_unref(x->allocs[i].va);
    tdel(tfind(x->id));
    free(x->allocs);
    free(x->frees);
    free(x);
    END
}

CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, int attr, void *value) {
    BEGIN;
    TRY(capture_unsafe_call());
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    if (!value) FAIL(CUDA_ERROR_INVALID_VALUE);
    u64 *out = value;
    switch (attr) {
    case CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT: *out = g_graph_used[dev]; break;
    case CU_GRAPH_MEM_ATTR_USED_MEM_HIGH: *out = g_graph_used_high[dev]; break;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: *out = g_graph_reserved[dev]; break;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH: *out = g_graph_reserved_high[dev]; break;
    default: FAIL(CUDA_ERROR_INVALID_VALUE);
    }
    END
}

/* Only the high-water marks can be set, and only to 0 (reset to the current value). */
CUresult cuDeviceSetGraphMemAttribute(CUdevice dev, int attr, void *value) {
    BEGIN;
    TRY(capture_unsafe_call());
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    if (!value || *(u64 *)value != 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (attr == CU_GRAPH_MEM_ATTR_USED_MEM_HIGH) g_graph_used_high[dev] = g_graph_used[dev];
    else if (attr == CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH) g_graph_reserved_high[dev] = g_graph_reserved[dev];
    else FAIL(CUDA_ERROR_INVALID_VALUE);
    END
}

CUresult cuDeviceGraphMemTrim(CUdevice dev) {
    BEGIN;
    TRY(capture_unsafe_call());
    if (!valid_dev(dev)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    u64 keep = round_up(g_graph_used[dev], POOL_CHUNK);
    if (g_graph_reserved[dev] > keep) {
        uncharge(dev, g_graph_reserved[dev] - keep);
        g_graph_reserved[dev] = keep;
    }
    END
}

/* ---------- cuGetProcAddress ---------- */

struct proc {
    const char *name;
    int version;
    int per_thread;
    void *fn;
};

#define P(n, v, f) {n, v, 0, (void *)f}
#define PT(n, v, f) {n, v, 1, (void *)f}
static const struct proc g_procs[] = {
    P("cuInit", 2000, cuInit),
    P("cuDriverGetVersion", 2020, cuDriverGetVersion),
    P("cuDeviceGet", 2000, cuDeviceGet),
    P("cuDeviceGetCount", 2000, cuDeviceGetCount),
    P("cuDeviceGetName", 2000, cuDeviceGetName),
    P("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
    P("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
    P("cuDeviceGetUuid", 9020, cuDeviceGetUuid),
    P("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
    P("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
    P("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
    P("cuDevicePrimaryCtxReset", 11000, cuDevicePrimaryCtxReset_v2),
    P("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState),
    P("cuCtxCreate", 3020, cuCtxCreate_v2),
    P("cuCtxCreate", 11040, cuCtxCreate_v3),
    P("cuCtxCreate", 12050, cuCtxCreate_v4),
    P("cuCtxDestroy", 4000, cuCtxDestroy_v2),
    P("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
    P("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
    P("cuCtxGetDevice", 2000, cuCtxGetDevice),
    P("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2),
    P("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2),
    P("cuCtxSynchronize", 2000, cuCtxSynchronize),
    P("cuMemAlloc", 3020, cuMemAlloc_v2),
    P("cuMemAllocPitch", 3020, cuMemAllocPitch_v2),
    P("cuMemAllocManaged", 6000, cuMemAllocManaged),
    P("cuMemFree", 3020, cuMemFree_v2),
    P("cuMemGetInfo", 3020, cuMemGetInfo_v2),
    P("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2),
    PT("cuMemcpyHtoD", 7000, cuMemcpyHtoD_v2_ptds),
    P("cuLaunchKernel", 4000, cuLaunchKernel),
    PT("cuLaunchKernel", 7000, cuLaunchKernel_ptsz),
    P("cuStreamCreate", 2000, cuStreamCreate),
    P("cuStreamDestroy", 4000, cuStreamDestroy_v2),
    P("cuStreamSynchronize", 2000, cuStreamSynchronize),
    PT("cuStreamSynchronize", 7000, cuStreamSynchronize_ptsz),
    P("cuStreamGetCtx", 9020, cuStreamGetCtx),
    PT("cuStreamGetCtx", 9020, cuStreamGetCtx_ptsz),
    P("cuStreamGetDevice", 12080, cuStreamGetDevice),
    PT("cuStreamGetDevice", 12080, cuStreamGetDevice_ptsz),
    P("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2),
    PT("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2_ptsz),
    P("cuStreamEndCapture", 10000, cuStreamEndCapture),
    PT("cuStreamEndCapture", 10000, cuStreamEndCapture_ptsz),
    P("cuStreamIsCapturing", 10000, cuStreamIsCapturing),
    PT("cuStreamIsCapturing", 10000, cuStreamIsCapturing_ptsz),
    P("cuThreadExchangeStreamCaptureMode", 10010, cuThreadExchangeStreamCaptureMode),
    P("cuGraphCreate", 10000, cuGraphCreate),
    P("cuGraphDestroy", 10000, cuGraphDestroy),
    P("cuGraphAddMemAllocNode", 11040, cuGraphAddMemAllocNode),
    P("cuGraphAddMemFreeNode", 11040, cuGraphAddMemFreeNode),
    P("cuGraphMemAllocNodeGetParams", 11040, cuGraphMemAllocNodeGetParams),
    P("cuGraphMemFreeNodeGetParams", 11040, cuGraphMemFreeNodeGetParams),
    P("cuGraphGetNodes", 10000, cuGraphGetNodes),
    P("cuGraphNodeGetType", 10000, cuGraphNodeGetType),
    P("cuGraphInstantiate", 12000, cuGraphInstantiateWithFlags),
    P("cuGraphInstantiateWithFlags", 11040, cuGraphInstantiateWithFlags),
    P("cuGraphInstantiateWithParams", 12000, cuGraphInstantiateWithParams),
    PT("cuGraphInstantiateWithParams", 12000, cuGraphInstantiateWithParams_ptsz),
    P("cuGraphUpload", 11010, cuGraphUpload),
    PT("cuGraphUpload", 11010, cuGraphUpload_ptsz),
    P("cuGraphLaunch", 10000, cuGraphLaunch),
    PT("cuGraphLaunch", 10000, cuGraphLaunch_ptsz),
    P("cuGraphExecDestroy", 10000, cuGraphExecDestroy),
    P("cuDeviceGetGraphMemAttribute", 11040, cuDeviceGetGraphMemAttribute),
    P("cuDeviceSetGraphMemAttribute", 11040, cuDeviceSetGraphMemAttribute),
    P("cuDeviceGraphMemTrim", 11040, cuDeviceGraphMemTrim),
    P("cuModuleLoad", 2000, cuModuleLoad),
    P("cuModuleLoadData", 2000, cuModuleLoadData),
    P("cuModuleGetLoadingMode", 11070, cuModuleGetLoadingMode),
    P("cuModuleLoadDataEx", 2010, cuModuleLoadDataEx),
    P("cuModuleLoadFatBinary", 2000, cuModuleLoadFatBinary),
    P("cuModuleUnload", 2000, cuModuleUnload),
    P("cuLibraryLoadData", 12000, cuLibraryLoadData),
    P("cuLibraryLoadFromFile", 12000, cuLibraryLoadFromFile),
    P("cuLibraryUnload", 12000, cuLibraryUnload),
    P("cuLibraryGetGlobal", 12000, cuLibraryGetGlobal),
    P("cuLibraryGetManaged", 12000, cuLibraryGetManaged),
    P("cuLibraryGetModule", 12000, cuLibraryGetModule),
    P("cuLibraryGetKernel", 12000, cuLibraryGetKernel),
    P("cuCtxSetLimit", 3010, cuCtxSetLimit),
    P("cuCtxGetLimit", 3010, cuCtxGetLimit),
    P("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity),
    P("cuMemCreate", 10020, cuMemCreate),
    P("cuMemRelease", 10020, cuMemRelease),
    P("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle),
    P("cuMemAddressReserve", 10020, cuMemAddressReserve),
    P("cuMemAddressFree", 10020, cuMemAddressFree),
    P("cuMemMap", 10020, cuMemMap),
    P("cuMemUnmap", 10020, cuMemUnmap),
    P("cuMemSetAccess", 10020, cuMemSetAccess),
    P("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool),
    P("cuDeviceGetMemPool", 11020, cuDeviceGetMemPool),
    P("cuDeviceSetMemPool", 11020, cuDeviceSetMemPool),
    P("cuMemPoolCreate", 11020, cuMemPoolCreate),
    P("cuMemPoolDestroy", 11020, cuMemPoolDestroy),
    P("cuMemPoolSetAttribute", 11020, cuMemPoolSetAttribute),
    P("cuMemPoolGetAttribute", 11020, cuMemPoolGetAttribute),
    P("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo),
    P("cuMemAllocAsync", 11020, cuMemAllocAsync),
    PT("cuMemAllocAsync", 11020, cuMemAllocAsync_ptsz),
    P("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync),
    PT("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync_ptsz),
    P("cuMemFreeAsync", 11020, cuMemFreeAsync),
    PT("cuMemFreeAsync", 11020, cuMemFreeAsync_ptsz),
    P("cuArrayCreate", 3020, cuArrayCreate_v2),
    P("cuArray3DCreate", 3020, cuArray3DCreate_v2),
    P("cuMipmappedArrayCreate", 5000, cuMipmappedArrayCreate),
    P("cuArrayDestroy", 2000, cuArrayDestroy),
    P("cuMipmappedArrayDestroy", 5000, cuMipmappedArrayDestroy),
    P("cuGetProcAddress", 11030, cuGetProcAddress),
    P("cuGetProcAddress", 12000, cuGetProcAddress_v2),
};

/* Works before cuInit, like the real driver (cudart resolves cuInit through it). */
static CUresult proc_lookup(const char *sym, void **pfn, int version, unsigned long long flags, int *status) {
    if (!sym || !pfn) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    int known = 0, best = -1, best_pt = -1;
    for (int i = 0; i < (int)(sizeof g_procs / sizeof g_procs[0]); i++) {
        const struct proc *p = &g_procs[i];
        if (strcmp(p->name, sym) != 0) continue;
        known = 1;
        if (p->version > version) continue;
        int *slot = p->per_thread ? &best_pt : &best;
        if (*slot < 0 || g_procs[*slot].version < p->version) *slot = i;
    }
    int pick = ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best_pt >= 0) ? best_pt : best;
    if (pick < 0) {
        if (status) *status = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = g_procs[pick].fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

CUresult cuGetProcAddress(const char *sym, void **pfn, int version, unsigned long long flags) {
    return proc_lookup(sym, pfn, version, flags, NULL);
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, unsigned long long flags, int *status) {
    return proc_lookup(sym, pfn, version, flags, status);
}

CUresult cuGetProcAddress_v2_ptsz(const char *sym, void **pfn, int version, unsigned long long flags, int *status) {
    return proc_lookup(sym, pfn, version, flags, status);
}

/* ---------- test helpers ---------- */

static u64 stat_ordinal(int ordinal, const u64 *arr) {
    pthread_mutex_lock(&g_mu);
    load_config_locked();
    u64 v = valid_dev(ordinal) ? arr[g_vis[ordinal]] : 0;
    pthread_mutex_unlock(&g_mu);
    return v;
}

unsigned long long fake_cuda_used(int ordinal) { return stat_ordinal(ordinal, g_used); }

/* How many cuMemGetInfo and cuCtxGetLimit calls were made while a capture was ongoing
 * (begun, not yet ended): the library makes none of its own then. */
unsigned long long fake_cuda_queries_in_capture(void) {
    pthread_mutex_lock(&g_mu);
    u64 n = g_queries_in_capture;
    pthread_mutex_unlock(&g_mu);
    return n;
}

unsigned long long fake_cuda_peak(int ordinal) { return stat_ordinal(ordinal, g_peak); }

/* How many module and library loads reached the fake (a load the library refuses first
 * never does). */
unsigned long long fake_cuda_module_loads(void) {
    pthread_mutex_lock(&g_mu);
    u64 n = g_module_loads;
    pthread_mutex_unlock(&g_mu);
    return n;
}

/* How many pools of device `ordinal` were destroyed while they had blocks in use (or the
 * last answer about their use said so): the library keeps such a pool's reserve charged
 * (docs/operations.md, "Limits, in full"), the one case of a pool's that may leave its books above zero. */
unsigned long long fake_cuda_pools_destroyed_live(int ordinal) {
    return stat_ordinal(ordinal, g_pools_destroyed_live);
}

/* How many context teardowns on device `ordinal` left another context of it living, or
 * its pool or graph memory. */
unsigned long long fake_cuda_teardowns_shared(int ordinal) { return stat_ordinal(ordinal, g_teardowns_shared); }

unsigned long long fake_cuda_phys_used(int physical_index) {
    pthread_mutex_lock(&g_mu);
    load_config_locked();
    u64 v = physical_index >= 0 && physical_index < g_nphys ? g_used[physical_index] : 0;
    pthread_mutex_unlock(&g_mu);
    return v;
}

void fake_cuda_reset_peak(int ordinal) {
    pthread_mutex_lock(&g_mu);
    load_config_locked();
    if (valid_dev(ordinal)) g_peak[g_vis[ordinal]] = g_used[g_vis[ordinal]];
    journal_load();
    g_jdumped = 0;
    jev("reset_peak", NULL, ordinal, 0, 0, 0);
    pthread_mutex_unlock(&g_mu);
}

/* fork() while another thread holds the lock must not leave the child deadlocked. */
static void fork_prepare(void) { pthread_mutex_lock(&g_mu); }
static void fork_parent(void) { pthread_mutex_unlock(&g_mu); }
static void fork_child(void) { pthread_mutex_unlock(&g_mu); }

__attribute__((constructor)) static void fake_cuda_ctor(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }
