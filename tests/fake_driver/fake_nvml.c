/* Fake libnvidia-ml.so.1: physical devices from FAKE_CUDA_DEVICES / FAKE_CUDA_MEM (it ignores
 * CUDA_VISIBLE_DEVICES, as real NVML does); memory in use comes from the fake libcuda of the
 * same process (fake_cuda_phys_used), or 0 when libcuda is not loaded. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <strings.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEV 64

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_GPU_IS_LOST = 15,
};

struct fake_nvml_device {
    unsigned index;
};
typedef struct fake_nvml_device *nvmlDevice_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t layout");

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_init_count;
static int g_inits_entered, g_inits_done;
static int g_loaded;
static unsigned g_count;
static unsigned long long g_mem;
static struct fake_nvml_device g_devices[MAX_DEV];

static unsigned long long env_u64(const char *name, unsigned long long def) {
    const char *s = getenv(name);
    if (!s || !*s) return def;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || errno) return def;
    return v;
}

static void load_locked(void) {
    if (g_loaded) return;
    g_loaded = 1;
    unsigned long long n = env_u64("FAKE_CUDA_DEVICES", 1);
    g_count = n > MAX_DEV ? MAX_DEV : (unsigned)n;
    g_mem = env_u64("FAKE_CUDA_MEM", 85899345920ull);
    for (unsigned i = 0; i < MAX_DEV; i++) g_devices[i].index = i;
}

static int inited(void) {
    pthread_mutex_lock(&g_mu);
    int v = g_init_count > 0;
    pthread_mutex_unlock(&g_mu);
    return v;
}

static int valid(nvmlDevice_t d) { return d && d >= &g_devices[0] && d < &g_devices[g_count]; }

/* libcuda may be loaded RTLD_LOCAL (cudart does that), so look it up by name first. */
/* What other processes hold on every device (FAKE_CUDA_OTHER_USED, as in libcuda). */
static unsigned long long other_used(void) {
    const char *s = getenv("FAKE_CUDA_OTHER_USED");
    return s ? strtoull(s, NULL, 10) : 0;
}

static unsigned long long phys_used(unsigned p) {
    typedef unsigned long long (*used_fn)(int);
    unsigned long long v = 0;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    used_fn f = (used_fn)dlsym(h ? h : RTLD_DEFAULT, "fake_cuda_phys_used");
    if (f) v = f((int)p);
    if (h) dlclose(h);
    return v;
}

static void uuid_string(unsigned p, char *out, size_t len) {
    /* Same bytes as the fake libcuda: fa ce b0 0c 00 .. 00 p */
    snprintf(out, len, "GPU-faceb00c-0000-0000-0000-0000000000%02x", p & 0xff);
}

/* FAKE_NVML_INIT_DELAY_MS, FAKE_NVML_PROC_DELAY_MS: a slow NVML, as on a real machine
 * (initialisation tens of ms, a process query a fraction of one). */
static void delay_ms(const char *var) {
    unsigned long long ms = env_u64(var, 0);
    if (ms) {
        struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

/* FAKE_NVML_LOST_FILE=<path>: the devices whose indexes that file lists (decimal, separated
 * by spaces, commas or newlines) have fallen off the bus: their queries answer
 * NVML_ERROR_GPU_IS_LOST. The file is read at each call, so a test loses a GPU (or gets it
 * back) while the process runs; no file, no lost device. */
static int lost(unsigned index) {
    const char *path = getenv("FAKE_NVML_LOST_FILE");
    if (!path || !*path) return 0;
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    char text[512];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    for (char *p = text; *p;) {
        if (*p < '0' || *p > '9') {
            p++;
            continue;
        }
        char *end;
        unsigned long v = strtoul(p, &end, 10);
        if (v == index) return 1;
        p = end;
    }
    return 0;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    /* FAKE_NVML_ABSENT=1: a machine whose NVML cannot start (as in a container that
     * mounts libcuda but no NVML driver): every initialisation fails. */
    const char *absent = getenv("FAKE_NVML_ABSENT");
    if (absent && *absent == '1') return NVML_ERROR_LIBRARY_NOT_FOUND;
    delay_ms("FAKE_NVML_INIT_DELAY_MS");
    pthread_mutex_lock(&g_mu);
    __atomic_add_fetch(&g_inits_entered, 1, __ATOMIC_SEQ_CST);
    /* FAKE_NVML_INIT_LOCKED_MS: an initialisation that holds NVML's own lock that long. */
    delay_ms("FAKE_NVML_INIT_LOCKED_MS");
    load_locked();
    g_init_count++;
    __atomic_add_fetch(&g_inits_done, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&g_mu);
    return NVML_SUCCESS;
}

/* The fake's own (no lock taken, so a test can ask while an initialisation holds NVML's):
 * how many nvmlInit calls of this process have taken NVML's lock, and how many have
 * finished. A test waits for the first to be inside (a handshake), then orders its own
 * events against the end. */
EXPORT int fake_nvml_inits_entered(void) { return __atomic_load_n(&g_inits_entered, __ATOMIC_SEQ_CST); }
EXPORT int fake_nvml_inits_done(void) { return __atomic_load_n(&g_inits_done, __ATOMIC_SEQ_CST); }

EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return nvmlInit_v2();
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (g_init_count == 0) rc = NVML_ERROR_UNINITIALIZED;
    else g_init_count--;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t rc) {
    switch (rc) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = g_count;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= g_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_devices[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device || !*uuid) return NVML_ERROR_INVALID_ARGUMENT;
    /* FAKE_NVML_FOREIGN_UUIDS=1: no CUDA UUID is an NVML device's, as under MIG, where
     * CUDA names the instance ("MIG-…") and NVML lists the whole GPU. */
    const char *foreign = getenv("FAKE_NVML_FOREIGN_UUIDS");
    if (foreign && *foreign == '1') return NVML_ERROR_NOT_FOUND;
    for (unsigned p = 0; p < g_count; p++) {
        char u[64];
        uuid_string(p, u, sizeof u);
        if (strncasecmp(u, uuid, strlen(uuid)) == 0) {
            *device = &g_devices[p];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = device->index;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !uuid) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(device->index)) return NVML_ERROR_GPU_IS_LOST;
    char u[64];
    uuid_string(device->index, u, sizeof u);
    if (length < strlen(u) + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(uuid, u, strlen(u) + 1);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(device->index)) return NVML_ERROR_GPU_IS_LOST;
    unsigned long long used = phys_used(device->index) + other_used();
    memory->total = g_mem;
    memory->used = used;
    memory->free = used > g_mem ? 0 : g_mem - used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(device->index)) return NVML_ERROR_GPU_IS_LOST;
    unsigned long long used = phys_used(device->index) + other_used();
    memory->total = g_mem;
    memory->reserved = 0;
    memory->used = used;
    memory->free = used > g_mem ? 0 : g_mem - used;
    return NVML_SUCCESS;
}

static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    delay_ms("FAKE_NVML_PROC_DELAY_MS");
    if (!valid(device) || !count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long used = phys_used(device->index);
    unsigned need = used > 0 ? 1 : 0;
    if (*count < need) {
        *count = need;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *count = need;
    if (need) {
        if (!infos) return NVML_ERROR_INVALID_ARGUMENT;
        /* FAKE_NVML_PID_OFFSET: report another pid, as NVML does for a process in a PID
         * namespace (it lists host pids). */
        infos[0].pid = (unsigned)getpid() + (unsigned)env_u64("FAKE_NVML_PID_OFFSET", 0);
        infos[0].usedGpuMemory = used;
        infos[0].gpuInstanceId = 0xFFFFFFFFu;
        infos[0].computeInstanceId = 0xFFFFFFFFu;
    }
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                             nvmlProcessInfo_t *infos) {
    return running_processes(device, count, infos);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                             nvmlProcessInfo_t *infos) {
    return running_processes(device, count, infos);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *count,
                                                          nvmlProcessInfo_t *infos) {
    return running_processes(device, count, infos);
}
