// A module with 1 GiB of __device__ globals, a kernel that mallocs 1 GiB from the device
// heap, and a kernel with 64 KiB of local memory a thread: memory no allocation call names.
// Built to a cubin by scripts/gpu/footprint_probe.sh and by the footprint cases.
#include <stdint.h>
__device__ char big[1u << 30];
extern "C" __global__ void touch() {
    for (size_t i = threadIdx.x * 4096; i < sizeof(big); i += 32 * 4096) big[i] = 1;
}
extern "C" __global__ void heap() {
    char *p = (char *)malloc(1ull << 30);
    if (p) { for (size_t i = 0; i < (1ull << 30); i += 1 << 20) p[i] = 1; }
    big[0] = p ? 1 : 2;
}
extern "C" __global__ void spill() {
    volatile char local[64 << 10];
    for (int i = 0; i < (64 << 10); i += 512) local[i] = (char)i;
    big[threadIdx.x] = local[threadIdx.x * 64];
}
