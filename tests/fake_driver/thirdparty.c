/* A third-party LD_PRELOAD wrapper that relies on RTLD_NEXT, the way many real ones do.
 * If a dlsym forwarder preloaded before it changes the caller seen by glibc, RTLD_NEXT
 * resolves back to this very function, which then recurses until the stack overflows. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <unistd.h>

static int calls;

__attribute__((visibility("default"))) int getpagesize(void) {
    static int (*next)(void);
    if (!next) next = (int (*)(void))dlsym(RTLD_NEXT, "getpagesize");
    __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
    return next();
}

__attribute__((visibility("default"))) int thirdparty_calls(void) { return __atomic_load_n(&calls, __ATOMIC_RELAXED); }

/* dlsym(RTLD_NEXT, name) asked from this library: the next definition after it. (Not a
 * tail call: glibc must see this library as the caller.) */
__attribute__((visibility("default"))) void *thirdparty_next(const char *name) {
    void *p = dlsym(RTLD_NEXT, name);
    __asm__ volatile("" : : "r"(p) : "memory");
    return p;
}
