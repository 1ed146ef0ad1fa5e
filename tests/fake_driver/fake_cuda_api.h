/* Declarations of the CUDA driver API subset the fake implements (no cuda.h in CI).
 * Shared by fake_cuda.c (definitions) and client.c (types; direct calls with -DLINKED).
 * Signatures follow cuda.h for CUDA 13.0. */
#ifndef FAKE_CUDA_API_H
#define FAKE_CUDA_API_H

#include <stddef.h>

#define FAKE_EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct fake_ctx *CUcontext;
typedef struct fake_stream *CUstream;
typedef struct fake_pool *CUmemoryPool;
typedef struct fake_array *CUarray;
typedef struct fake_mipmap *CUmipmappedArray;
typedef struct fake_module *CUmodule;
typedef struct fake_function *CUfunction;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

typedef struct { char bytes[16]; } CUuuid;

typedef struct {
    int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_FABRIC = 8 */
    struct { int type; int id; } location; /* DEVICE = 1, HOST = 2 */
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;

typedef struct {
    int allocType;
    int handleTypes;
    struct { int type; int id; } location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

typedef struct {
    size_t Width;
    size_t Height;
    int Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct {
    size_t Width;
    size_t Height;
    size_t Depth;
    int Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

enum {
    CU_MEM_LOCATION_TYPE_DEVICE = 1,
    CU_MEM_LOCATION_TYPE_HOST = 2,
    CU_MEM_HANDLE_TYPE_FABRIC = 8,
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4,
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5,
    CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6,
    CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7,
    CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8,
    CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2,
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
};

#define FAKE_CUDA_FUNCS(X) \
    X(cuInit, (unsigned int flags)) \
    X(cuDriverGetVersion, (int *version)) \
    X(cuDeviceGetCount, (int *count)) \
    X(cuDeviceGet, (CUdevice *dev, int ordinal)) \
    X(cuDeviceGetName, (char *name, int len, CUdevice dev)) \
    X(cuDeviceTotalMem_v2, (size_t *bytes, CUdevice dev)) \
    X(cuDeviceGetUuid, (CUuuid *uuid, CUdevice dev)) \
    X(cuDeviceGetUuid_v2, (CUuuid *uuid, CUdevice dev)) \
    X(cuDeviceGetAttribute, (int *value, int attrib, CUdevice dev)) \
    X(cuDevicePrimaryCtxRetain, (CUcontext *pctx, CUdevice dev)) \
    X(cuDevicePrimaryCtxRelease_v2, (CUdevice dev)) \
    X(cuDevicePrimaryCtxReset_v2, (CUdevice dev)) \
    X(cuDevicePrimaryCtxGetState, (CUdevice dev, unsigned int *flags, int *active)) \
    X(cuCtxCreate_v2, (CUcontext *pctx, unsigned int flags, CUdevice dev)) \
    X(cuCtxCreate_v3, (CUcontext *pctx, void *affinity, int n, unsigned int flags, CUdevice dev)) \
    X(cuCtxCreate_v4, (CUcontext *pctx, void *params, unsigned int flags, CUdevice dev)) \
    X(cuCtxDestroy_v2, (CUcontext ctx)) \
    X(cuCtxSetCurrent, (CUcontext ctx)) \
    X(cuCtxGetCurrent, (CUcontext *pctx)) \
    X(cuCtxGetDevice, (CUdevice *dev)) \
    X(cuCtxPushCurrent_v2, (CUcontext ctx)) \
    X(cuCtxPopCurrent_v2, (CUcontext *pctx)) \
    X(cuCtxSynchronize, (void)) \
    X(cuMemAlloc_v2, (CUdeviceptr *dptr, size_t bytes)) \
    X(cuMemAllocPitch_v2, (CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem)) \
    X(cuMemAllocManaged, (CUdeviceptr *dptr, size_t bytes, unsigned int flags)) \
    X(cuMemFree_v2, (CUdeviceptr dptr)) \
    X(cuMemGetInfo_v2, (size_t *free_bytes, size_t *total_bytes)) \
    X(cuMemcpyHtoD_v2, (CUdeviceptr dst, const void *src, size_t bytes)) \
    X(cuMemcpyHtoD_v2_ptds, (CUdeviceptr dst, const void *src, size_t bytes)) \
    X(cuLaunchKernel, (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, \
                       unsigned int by, unsigned int bz, unsigned int shmem, CUstream stream, void **params, void **extra)) \
    X(cuLaunchKernel_ptsz, (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, \
                            unsigned int by, unsigned int bz, unsigned int shmem, CUstream stream, void **params, void **extra)) \
    X(cuStreamCreate, (CUstream *pstream, unsigned int flags)) \
    X(cuStreamDestroy_v2, (CUstream stream)) \
    X(cuStreamSynchronize, (CUstream stream)) \
    X(cuStreamSynchronize_ptsz, (CUstream stream)) \
    X(cuModuleLoad, (CUmodule *module, const char *fname)) \
    X(cuMemGetAllocationGranularity, (size_t *gran, const CUmemAllocationProp *prop, int option)) \
    X(cuMemCreate, (CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, unsigned long long flags)) \
    X(cuMemRelease, (CUmemGenericAllocationHandle handle)) \
    X(cuMemAddressReserve, (CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags)) \
    X(cuMemAddressFree, (CUdeviceptr ptr, size_t size)) \
    X(cuMemMap, (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags)) \
    X(cuMemUnmap, (CUdeviceptr ptr, size_t size)) \
    X(cuMemSetAccess, (CUdeviceptr ptr, size_t size, const void *desc, size_t count)) \
    X(cuDeviceGetDefaultMemPool, (CUmemoryPool *pool, CUdevice dev)) \
    X(cuDeviceGetMemPool, (CUmemoryPool *pool, CUdevice dev)) \
    X(cuDeviceSetMemPool, (CUdevice dev, CUmemoryPool pool)) \
    X(cuMemPoolCreate, (CUmemoryPool *pool, const CUmemPoolProps *props)) \
    X(cuMemPoolDestroy, (CUmemoryPool pool)) \
    X(cuMemPoolSetAttribute, (CUmemoryPool pool, int attr, void *value)) \
    X(cuMemPoolGetAttribute, (CUmemoryPool pool, int attr, void *value)) \
    X(cuMemPoolTrimTo, (CUmemoryPool pool, size_t min_keep)) \
    X(cuMemAllocAsync, (CUdeviceptr *dptr, size_t bytes, CUstream stream)) \
    X(cuMemAllocAsync_ptsz, (CUdeviceptr *dptr, size_t bytes, CUstream stream)) \
    X(cuMemAllocFromPoolAsync, (CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream stream)) \
    X(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream stream)) \
    X(cuMemFreeAsync, (CUdeviceptr dptr, CUstream stream)) \
    X(cuMemFreeAsync_ptsz, (CUdeviceptr dptr, CUstream stream)) \
    X(cuArrayCreate_v2, (CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *desc)) \
    X(cuArray3DCreate_v2, (CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc)) \
    X(cuMipmappedArrayCreate, (CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned int levels)) \
    X(cuArrayDestroy, (CUarray arr)) \
    X(cuMipmappedArrayDestroy, (CUmipmappedArray arr)) \
    X(cuGetProcAddress, (const char *sym, void **pfn, int version, unsigned long long flags)) \
    X(cuGetProcAddress_v2, (const char *sym, void **pfn, int version, unsigned long long flags, int *status)) \
    X(cuGetProcAddress_v2_ptsz, (const char *sym, void **pfn, int version, unsigned long long flags, int *status))

#define FAKE_DECLARE(name, args) FAKE_EXPORT CUresult name args;
FAKE_CUDA_FUNCS(FAKE_DECLARE)
#undef FAKE_DECLARE

/* Test helpers (not part of the real driver). */
FAKE_EXPORT unsigned long long fake_cuda_used(int ordinal);
FAKE_EXPORT unsigned long long fake_cuda_peak(int ordinal);
FAKE_EXPORT unsigned long long fake_cuda_phys_used(int physical_index);

#endif
