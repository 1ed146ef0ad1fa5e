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
typedef struct fake_library *CUlibrary;
typedef struct fake_kernel *CUkernel;
typedef struct fake_graph *CUgraph;
typedef struct fake_gnode *CUgraphNode;
typedef struct fake_exec *CUgraphExec;

/* Special stream handles. */
#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
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
    struct { int type; int id; } location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

/* CUDA_MEM_ALLOC_NODE_PARAMS (v1). */
typedef struct {
    CUmemPoolProps poolProps;
    const CUmemAccessDesc *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;

/* CUDA_GRAPH_INSTANTIATE_PARAMS. */
typedef struct {
    unsigned long long flags;
    CUstream hUploadStream;
    CUgraphNode hErrNode_out;
    int result_out; /* CUgraphInstantiateResult */
} CUDA_GRAPH_INSTANTIATE_PARAMS;

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
    CU_STREAM_NON_BLOCKING = 1,
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0,
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
    CU_STREAM_CAPTURE_MODE_RELAXED = 2,
    CU_STREAM_CAPTURE_STATUS_NONE = 0,
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
    CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2,
    CU_GRAPH_NODE_TYPE_MEM_ALLOC = 10,
    CU_GRAPH_NODE_TYPE_MEM_FREE = 11,
    CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT = 0,
    CU_GRAPH_MEM_ATTR_USED_MEM_HIGH = 1,
    CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT = 2,
    CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH = 3,
    CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH = 1,
    CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD = 2,
    CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH = 4,
    CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY = 8,
    CU_MEM_ALLOCATION_TYPE_PINNED = 1,
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
    X(cuStreamGetCtx, (CUstream stream, CUcontext *pctx)) \
    X(cuStreamGetCtx_ptsz, (CUstream stream, CUcontext *pctx)) \
    X(cuStreamGetDevice, (CUstream stream, CUdevice *dev)) \
    X(cuStreamGetDevice_ptsz, (CUstream stream, CUdevice *dev)) \
    X(cuStreamBeginCapture_v2, (CUstream stream, int mode)) \
    X(cuStreamBeginCapture_v2_ptsz, (CUstream stream, int mode)) \
    X(cuStreamEndCapture, (CUstream stream, CUgraph *graph)) \
    X(cuStreamEndCapture_ptsz, (CUstream stream, CUgraph *graph)) \
    X(cuStreamIsCapturing, (CUstream stream, int *status)) \
    X(cuStreamIsCapturing_ptsz, (CUstream stream, int *status)) \
    X(cuThreadExchangeStreamCaptureMode, (int *mode)) \
    X(cuGraphCreate, (CUgraph *graph, unsigned int flags)) \
    X(cuGraphDestroy, (CUgraph graph)) \
    X(cuGraphAddMemAllocNode, (CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps, \
                               CUDA_MEM_ALLOC_NODE_PARAMS *params)) \
    X(cuGraphAddMemFreeNode, (CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps, \
                              CUdeviceptr dptr)) \
    X(cuGraphMemAllocNodeGetParams, (CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS *params)) \
    X(cuGraphMemFreeNodeGetParams, (CUgraphNode node, CUdeviceptr *dptr)) \
    X(cuGraphGetNodes, (CUgraph graph, CUgraphNode *nodes, size_t *num)) \
    X(cuGraphNodeGetType, (CUgraphNode node, int *type)) \
    X(cuGraphInstantiateWithFlags, (CUgraphExec *exec, CUgraph graph, unsigned long long flags)) \
    X(cuGraphInstantiateWithParams, (CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params)) \
    X(cuGraphInstantiateWithParams_ptsz, (CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params)) \
    X(cuGraphUpload, (CUgraphExec exec, CUstream stream)) \
    X(cuGraphUpload_ptsz, (CUgraphExec exec, CUstream stream)) \
    X(cuGraphLaunch, (CUgraphExec exec, CUstream stream)) \
    X(cuGraphLaunch_ptsz, (CUgraphExec exec, CUstream stream)) \
    X(cuGraphExecDestroy, (CUgraphExec exec)) \
    X(cuDeviceGetGraphMemAttribute, (CUdevice dev, int attr, void *value)) \
    X(cuDeviceSetGraphMemAttribute, (CUdevice dev, int attr, void *value)) \
    X(cuDeviceGraphMemTrim, (CUdevice dev)) \
    X(cuModuleLoad, (CUmodule *module, const char *fname)) \
    X(cuModuleLoadData, (CUmodule *module, const void *image)) \
    X(cuModuleGetLoadingMode, (int *mode)) \
    X(cuModuleLoadDataEx, (CUmodule *module, const void *image, unsigned int n, int *options, void **values)) \
    X(cuModuleLoadFatBinary, (CUmodule *module, const void *fatbin)) \
    X(cuModuleUnload, (CUmodule module)) \
    X(cuLibraryLoadData, (CUlibrary *library, const void *code, int *jo, void **jv, unsigned int nj, int *lo, \
                          void **lv, unsigned int nl)) \
    X(cuLibraryLoadFromFile, (CUlibrary *library, const char *file, int *jo, void **jv, unsigned int nj, int *lo, \
                              void **lv, unsigned int nl)) \
    X(cuLibraryUnload, (CUlibrary library)) \
    X(cuLibraryGetGlobal, (CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name)) \
    X(cuLibraryGetManaged, (CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name)) \
    X(cuLibraryGetModule, (CUmodule *module, CUlibrary library)) \
    X(cuLibraryGetKernel, (CUkernel *kernel, CUlibrary library, const char *name)) \
    X(cuCtxSetLimit, (int limit, size_t value)) \
    X(cuCtxGetLimit, (size_t *value, int limit)) \
    X(cuMemGetAllocationGranularity, (size_t *gran, const CUmemAllocationProp *prop, int option)) \
    X(cuMemCreate, (CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, unsigned long long flags)) \
    X(cuMemRelease, (CUmemGenericAllocationHandle handle)) \
    X(cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle *handle, void *addr)) \
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
FAKE_EXPORT void fake_cuda_reset_peak(int ordinal);
FAKE_EXPORT void fake_cuda_limit_hook(void (*hook)(int phase, int limit, size_t value));

#endif
