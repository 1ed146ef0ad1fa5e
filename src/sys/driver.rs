//! The real CUDA driver: our own `dlopen("libcuda.so.1")` handle, one table of the
//! driver's entry points, and typed calls into them.
//!
//! This is the only module that knows where the driver lives and what its functions look
//! like. It never calls through our exported names (that would re-enter the hooks): every
//! symbol is looked up with the *real* `dlsym`, which [`real_dlsym`] finds with `dlvsym`.
//! Nothing here runs in a constructor or inside `dlsym`; [`load`] runs at the first hook
//! call.

#![allow(non_snake_case)]

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::atomic::{AtomicPtr, AtomicU8, Ordering};

/// A driver status code as the driver returned it. Never turned into a Rust `enum`: an
/// unknown value must stay a value.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CuResult(pub u32);

impl CuResult {
    pub const SUCCESS: Self = Self(0);
    pub const INVALID_VALUE: Self = Self(1);
    pub const OUT_OF_MEMORY: Self = Self(2);
    pub const NOT_INITIALIZED: Self = Self(3);
    pub const SHARED_OBJECT_INIT_FAILED: Self = Self(303);
    pub const NOT_PERMITTED: Self = Self(800);
    pub const STREAM_CAPTURE_INVALIDATED: Self = Self(901);
    pub const UNKNOWN: Self = Self(999);

    pub fn is_ok(self) -> bool {
        self == Self::SUCCESS
    }
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemLocation {
    pub kind: c_int,
    pub id: c_int,
}

/// Devices the library can budget (ordinals 0 to the configuration's highest); higher
/// ordinals pass through unbudgeted.
pub const MAX_DEVICES: usize = crate::config::MAX_ORDINAL as usize + 1;

pub const MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
pub const MEM_ALLOCATION_TYPE_PINNED: c_int = 1;

/// `CUmemAllocationProp`: only the leading fields are read.
#[repr(C)]
pub struct MemAllocationProp {
    pub alloc_type: c_int,
    pub requested_handle_types: c_int,
    pub location: MemLocation,
    pub win32_metadata: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// `CUmemPoolProps`: only the leading fields are read.
#[repr(C)]
pub struct MemPoolProps {
    pub alloc_type: c_int,
    pub handle_types: c_int,
    pub location: MemLocation,
}

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
pub struct ArrayDescriptor {
    pub width: usize,
    pub height: usize,
    pub format: c_int,
    pub num_channels: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR`.
#[repr(C)]
pub struct Array3dDescriptor {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: c_int,
    pub num_channels: u32,
    pub flags: u32,
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (v1): the pool's properties (`CUmemPoolProps`, 88
/// bytes), the access descriptors, the size and the address the driver chose.
#[repr(C)]
pub struct MemAllocNodeParams {
    pub pool: MemPoolProps,
    pub pool_rest: [u8; 72],
    pub access: *const c_void,
    pub access_count: usize,
    pub bytes: usize,
    pub dptr: u64,
}

const _: () = assert!(std::mem::size_of::<MemAllocNodeParams>() == 120);

/// `CU_GRAPH_NODE_TYPE_GRAPH` (a child graph), `_MEM_ALLOC` and `_MEM_FREE`.
pub const GRAPH_NODE_TYPE_GRAPH: c_int = 4;
pub const GRAPH_NODE_TYPE_MEM_ALLOC: c_int = 10;
pub const GRAPH_NODE_TYPE_MEM_FREE: c_int = 11;
/// `CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT`, `_RESERVED_MEM_CURRENT`.
pub const GRAPH_MEM_ATTR_USED_MEM_CURRENT: c_int = 0;
pub const GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: c_int = 2;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`, `CU_STREAM_CAPTURE_STATUS_NONE`.
pub const STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
pub const STREAM_CAPTURE_STATUS_NONE: c_int = 0;

pub type DevicePtr = u64;
pub type Device = c_int;

/// What every opaque handle of the driver is to the books: an address they key it by.
/// Only code that keeps any kind of handle alike names it (the loads' table: modules,
/// libraries and the contexts they go with; the array table: arrays and mipmapped
/// arrays); everything else names the handle's own type, so that a pool cannot be passed
/// where a stream is expected.
pub trait Opaque: Copy {
    /// The handle's address, by which the books key it.
    fn key(self) -> usize;
}

/// A `#[repr(transparent)]` newtype over the driver's pointer for each kind of handle:
/// ABI-identical to the C handle, in the hooks' exported signatures and the driver table.
macro_rules! opaque_handles {
    ($($(#[$doc:meta])* $name:ident;)*) => {$(
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct $name(*mut c_void);

        // Not every kind of handle needs every helper.
        #[allow(dead_code)]
        impl $name {
            /// No handle (what an out-pointer holds before the driver writes it).
            pub const NULL: Self = Self(std::ptr::null_mut());

            #[inline(always)]
            pub const fn from_raw(raw: *mut c_void) -> Self {
                Self(raw)
            }

            #[inline(always)]
            pub const fn as_raw(self) -> *mut c_void {
                self.0
            }

            #[inline(always)]
            pub fn is_null(self) -> bool {
                self.0.is_null()
            }
        }

        impl Opaque for $name {
            #[inline(always)]
            fn key(self) -> usize {
                self.0 as usize
            }
        }
    )*};
}

opaque_handles! {
    /// `CUcontext`.
    Context;
    /// `CUstream`; see [`Stream::LEGACY`] and [`Stream::PER_THREAD`] for its special values.
    Stream;
    /// `CUmemoryPool`.
    MemPool;
    /// `CUmodule`.
    Module;
    /// `CUlibrary`.
    Library;
    /// `CUkernel`.
    Kernel;
    /// `CUgraph`.
    Graph;
    /// `CUgraphNode`.
    GraphNode;
    /// `CUgraphExec`.
    GraphExec;
    /// `CUarray`.
    Array;
    /// `CUmipmappedArray`.
    MipmappedArray;
}

impl Stream {
    /// `CU_STREAM_LEGACY`: the legacy default stream, whatever the compilation.
    pub const LEGACY: Self = Self(std::ptr::without_provenance_mut(0x1));
    /// `CU_STREAM_PER_THREAD`: the calling thread's default stream.
    pub const PER_THREAD: Self = Self(std::ptr::without_provenance_mut(0x2));

    /// NULL, [`Self::LEGACY`] or [`Self::PER_THREAD`]: a default stream of the calling
    /// context, not a stream the driver created.
    #[inline(always)]
    pub fn is_default(self) -> bool {
        self == Self::NULL || self == Self::LEGACY || self == Self::PER_THREAD
    }
}

/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`.
pub const MEMPOOL_ATTR_RESERVED_MEM_CURRENT: c_int = 5;

/// The driver functions we call or hook, one line each: its name and C signature. A line
/// marked `+ ptsz` also declares the function's per-thread-default-stream twin
/// (`NAME_ptsz`, same signature), which the driver exports beside it.
macro_rules! driver_table {
    ($($name:ident $(+ $twin:ident)? ( $($arg:ident : $ty:ty),* );)*) => { pastey::paste! {
        /// One entry per driver function we call or hook; the index into [`REAL`].
        #[allow(non_camel_case_types, clippy::upper_case_acronyms)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(usize)]
        pub enum Sym { $($name, $([<$name _ $twin>],)?)* }

        impl Sym {
            pub const ALL: &'static [Sym] = &[$(Sym::$name, $(Sym::[<$name _ $twin>],)?)*];
            /// The exported name of this exact variant.
            pub fn name(self) -> &'static CStr {
                match self {
                    $(
                        Sym::$name => c_name!($name),
                        $(Sym::[<$name _ $twin>] => c_name!([<$name _ $twin>]),)?
                    )*
                }
            }
        }

        const SYMS: usize = Sym::ALL.len();

        /// Typed calls into the real driver. Each returns `NOT_INITIALIZED` when the
        /// driver lacks the function (or was never loaded), as the driver itself would.
        pub mod real {
            use super::*;
            $(real_fn!($name $(+ $twin)? ( $($arg : $ty),* ));)*
        }
    }};
}

/// A variant's exported name, NUL-terminated, as a `&'static CStr`.
macro_rules! c_name {
    ($name:ident) => {{
        const N: &CStr =
            match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                Ok(n) => n,
                Err(_) => panic!(),
            };
        N
    }};
}

/// The typed call of one driver variant, or of a variant and its twin (see
/// [`driver_table`]'s `real`).
macro_rules! real_fn {
    ($name:ident + $twin:ident ( $($arg:ident : $ty:ty),* )) => {
        real_fn!($name ( $($arg : $ty),* ));
        pastey::paste! { real_fn!([<$name _ $twin>] ( $($arg : $ty),* )); }
    };
    ($name:ident ( $($arg:ident : $ty:ty),* )) => {
        /// # Safety
        /// The arguments must be valid for the driver function of the same name.
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $name($($arg: $ty),*) -> CuResult {
            /// Not loaded yet (a hook that runs before any other), or the driver lacks
            /// the function: out of the caller's way, its arguments passed on as they
            /// came, so that the caller keeps none of them for this path.
            #[cold]
            #[inline(never)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn loading($($arg: $ty),*) -> CuResult {
                if !load() || REAL[Sym::$name as usize].load(Ordering::Acquire).is_null() {
                    return CuResult::NOT_INITIALIZED;
                }
                // SAFETY: the caller's arguments; the table's entry, once set, stays.
                unsafe { $name($($arg),*) }
            }
            let f = REAL[Sym::$name as usize].load(Ordering::Acquire);
            if f.is_null() {
                // SAFETY: the caller's arguments, passed on.
                return unsafe { loading($($arg),*) };
            }
            // SAFETY: `f` was returned by dlsym for this exact name, whose C
            // signature is the one spelled out in the table.
            unsafe {
                let f: unsafe extern "C" fn($($ty),*) -> CuResult = std::mem::transmute(f);
                f($($arg),*)
            }
        }
    };
}

driver_table! {
    cuInit(flags: u32);
    cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64);
    cuGetProcAddress_v2 + ptsz(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut c_int);
    cuDeviceGetCount(count: *mut c_int);
    cuDeviceGet(device: *mut Device, ordinal: c_int);
    cuDeviceTotalMem_v2(bytes: *mut usize, device: Device);
    cuDeviceGetName(name: *mut c_char, len: c_int, device: Device);
    cuDeviceGetAttribute(value: *mut c_int, attrib: c_int, device: Device);
    cuDeviceGetUuid(uuid: *mut [u8; 16], device: Device);
    cuDeviceGetUuid_v2(uuid: *mut [u8; 16], device: Device);
    cuCtxGetDevice(device: *mut Device);
    cuCtxGetCurrent(ctx: *mut Context);
    cuDevicePrimaryCtxRetain(ctx: *mut Context, device: Device);
    cuDevicePrimaryCtxRelease_v2(device: Device);
    cuDevicePrimaryCtxReset_v2(device: Device);
    cuDevicePrimaryCtxGetState(device: Device, flags: *mut u32, active: *mut c_int);
    cuCtxCreate_v2(ctx: *mut Context, flags: u32, device: Device);
    cuCtxCreate_v3(ctx: *mut Context, params: *mut c_void, num: c_int, flags: u32, device: Device);
    cuCtxCreate_v4(ctx: *mut Context, params: *mut c_void, flags: u32, device: Device);
    cuCtxDestroy_v2(ctx: Context);
    cuMemAlloc_v2(dptr: *mut DevicePtr, bytes: usize);
    cuMemAllocPitch_v2(dptr: *mut DevicePtr, pitch: *mut usize, width: usize, height: usize, elem: u32);
    cuMemAllocManaged(dptr: *mut DevicePtr, bytes: usize, flags: u32);
    cuMemFree_v2(dptr: DevicePtr);
    cuMemGetInfo_v2(free: *mut usize, total: *mut usize);
    cuMemCreate(handle: *mut u64, size: usize, prop: *const MemAllocationProp, flags: u64);
    cuMemRelease(handle: u64);
    cuMemMap(ptr: DevicePtr, size: usize, offset: usize, handle: u64, flags: u64);
    cuMemUnmap(ptr: DevicePtr, size: usize);
    cuMemRetainAllocationHandle(handle: *mut u64, addr: *mut c_void);
    cuMemGetAllocationGranularity(granularity: *mut usize, prop: *const MemAllocationProp, option: c_int);
    cuMemAllocAsync + ptsz(dptr: *mut DevicePtr, bytes: usize, stream: Stream);
    cuMemAllocFromPoolAsync + ptsz(dptr: *mut DevicePtr, bytes: usize, pool: MemPool, stream: Stream);
    cuMemFreeAsync + ptsz(dptr: DevicePtr, stream: Stream);
    cuMemPoolCreate(pool: *mut MemPool, props: *const MemPoolProps);
    cuMemPoolDestroy(pool: MemPool);
    cuMemPoolTrimTo(pool: MemPool, keep: usize);
    cuMemPoolGetAttribute(pool: MemPool, attr: c_int, value: *mut c_void);
    cuDeviceGetDefaultMemPool(pool: *mut MemPool, device: Device);
    cuDeviceGetMemPool(pool: *mut MemPool, device: Device);
    cuDeviceSetMemPool(device: Device, pool: MemPool);
    cuStreamGetDevice(stream: Stream, device: *mut Device);
    cuStreamIsCapturing(stream: Stream, status: *mut c_int);
    cuThreadExchangeStreamCaptureMode(mode: *mut c_int);
    cuStreamBeginCapture_v2 + ptsz(stream: Stream, mode: c_int);
    cuStreamBeginCaptureToGraph + ptsz(stream: Stream, graph: Graph, deps: *const GraphNode, data: *const c_void, n: usize, mode: c_int);
    cuStreamEndCapture + ptsz(stream: Stream, graph: *mut Graph);
    cuGraphGetNodes(graph: Graph, nodes: *mut GraphNode, count: *mut usize);
    cuGraphNodeGetType(node: GraphNode, kind: *mut c_int);
    cuGraphMemAllocNodeGetParams(node: GraphNode, params: *mut MemAllocNodeParams);
    cuGraphMemFreeNodeGetParams(node: GraphNode, dptr: *mut DevicePtr);
    cuGraphChildGraphNodeGetGraph(node: GraphNode, graph: *mut Graph);
    cuGraphInstantiateWithFlags(exec: *mut GraphExec, graph: Graph, flags: u64);
    cuGraphInstantiateWithParams + ptsz(exec: *mut GraphExec, graph: Graph, params: *mut c_void);
    cuGraphInstantiate_v2(exec: *mut GraphExec, graph: Graph, error_node: *mut GraphNode, log: *mut c_char, log_size: usize);
    cuGraphExecDestroy(exec: GraphExec);
    cuGraphUpload + ptsz(exec: GraphExec, stream: Stream);
    cuGraphLaunch + ptsz(exec: GraphExec, stream: Stream);
    cuDeviceGetGraphMemAttribute(device: Device, attr: c_int, value: *mut c_void);
    cuDeviceGraphMemTrim(device: Device);
    cuArrayCreate_v2(array: *mut Array, desc: *const ArrayDescriptor);
    cuArray3DCreate_v2(array: *mut Array, desc: *const Array3dDescriptor);
    cuMipmappedArrayCreate(array: *mut MipmappedArray, desc: *const Array3dDescriptor, levels: u32);
    cuArrayDestroy(array: Array);
    cuMipmappedArrayDestroy(array: MipmappedArray);
    cuModuleGetLoadingMode(mode: *mut c_int);
    cuModuleLoad(module: *mut Module, fname: *const c_char);
    cuModuleLoadData(module: *mut Module, image: *const c_void);
    cuModuleLoadDataEx(module: *mut Module, image: *const c_void, n: u32, options: *mut c_int, values: *mut *mut c_void);
    cuModuleLoadFatBinary(module: *mut Module, fatbin: *const c_void);
    cuModuleUnload(module: Module);
    cuLibraryLoadData(library: *mut Library, code: *const c_void, jit_options: *mut c_int, jit_values: *mut *mut c_void, n_jit: u32, lib_options: *mut c_int, lib_values: *mut *mut c_void, n_lib: u32);
    cuLibraryLoadFromFile(library: *mut Library, file: *const c_char, jit_options: *mut c_int, jit_values: *mut *mut c_void, n_jit: u32, lib_options: *mut c_int, lib_values: *mut *mut c_void, n_lib: u32);
    cuLibraryUnload(library: Library);
    cuLibraryGetGlobal(dptr: *mut DevicePtr, bytes: *mut usize, library: Library, name: *const c_char);
    cuLibraryGetManaged(dptr: *mut DevicePtr, bytes: *mut usize, library: Library, name: *const c_char);
    cuLibraryGetModule(module: *mut Module, library: Library);
    cuLibraryGetKernel(kernel: *mut Kernel, library: Library, name: *const c_char);
    cuCtxSetLimit(limit: c_int, value: usize);
    cuCtxGetLimit(value: *mut usize, limit: c_int);
    cuMemSetMemPool(location: *mut MemLocation, kind: c_int, pool: MemPool);
}

#[allow(clippy::declare_interior_mutable_const)]
const NULL_FN: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// The driver's own function for each [`Sym`], from our handle.
static REAL: [AtomicPtr<c_void>; SYMS] = [NULL_FN; SYMS];

/// The driver's own pointer for `sym` (null when the driver lacks it).
/// Takes `p` as the driver's function for `sym` when the table has none (the loader's
/// lookup missed a function the driver hands out by `cuGetProcAddress`, which `dladdr`
/// names exactly); false when the table already had one.
pub fn adopt(sym: Sym, p: *mut c_void) -> bool {
    !p.is_null()
        && REAL[sym as usize]
            .compare_exchange(std::ptr::null_mut(), p, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
}

pub fn real_ptr(sym: Sym) -> *mut c_void {
    REAL[sym as usize].load(Ordering::Acquire)
}

/// The variant whose real function is exactly `p`, if it is one in our table.
pub fn sym_of_real(p: *mut c_void) -> Option<Sym> {
    if p.is_null() {
        return None;
    }
    Sym::ALL.iter().copied().find(|&s| real_ptr(s) == p)
}

/// The variant whose name is exactly `name`.
pub fn sym_named(name: &[u8]) -> Option<Sym> {
    Sym::ALL
        .iter()
        .copied()
        .find(|s| s.name().to_bytes() == name)
}

/// Whether `requested` (a base name, as `cuGetProcAddress` is asked) names one of our
/// symbols or a variant of one (`cuMemAlloc` for `cuMemAlloc_v2`).
pub fn is_variant_of_ours(requested: &[u8]) -> bool {
    !requested.is_empty()
        && Sym::ALL.iter().any(|s| {
            let name = s.name().to_bytes();
            name.strip_prefix(requested)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(b"_"))
        })
}

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// glibc's `dlsym`, found with `dlvsym` so that our exported `dlsym` is never involved.
pub fn real_dlsym() -> Option<DlsymFn> {
    let mut p = REAL_DLSYM.load(Ordering::Acquire);
    if p.is_null() {
        // GLIBC_2.17: aarch64's name for it before glibc 2.34.
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
            // SAFETY: dlvsym with RTLD_NEXT and NUL-terminated names; it neither calls
            // dlsym nor allocates in a way that re-enters us.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !p.is_null() {
                break;
            }
        }
        if p.is_null() {
            return None;
        }
        REAL_DLSYM.store(p, Ordering::Release);
    }
    // SAFETY: `p` is glibc's dlsym, whose signature is `DlsymFn`.
    Some(unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p) })
}

/// Looks `name` up in `handle` with the real dlsym.
pub fn lookup(handle: *mut c_void, name: &CStr) -> *mut c_void {
    match real_dlsym() {
        // SAFETY: a handle from dlopen (or a pseudo-handle) and a NUL-terminated name.
        Some(dlsym) => unsafe { dlsym(handle, name.as_ptr()) },
        None => std::ptr::null_mut(),
    }
}

const UNLOADED: u8 = 0;
const LOADED: u8 = 1;
const MISSING: u8 = 2;
static LOAD_STATE: AtomicU8 = AtomicU8::new(UNLOADED);

/// Opens our own handle on `libcuda.so.1` and fills the table. Returns whether the
/// driver is there. Threads that arrive before it is done load it too (dlopen takes a
/// reference, the table gets the same pointers): nobody waits for another thread.
pub fn load() -> bool {
    match LOAD_STATE.load(Ordering::Acquire) {
        LOADED => true,
        MISSING => false,
        _ => {
            let loaded = load_now();
            LOAD_STATE.store(if loaded { LOADED } else { MISSING }, Ordering::Release);
            loaded
        }
    }
}

fn load_now() -> bool {
    // SAFETY: dlopen with a NUL-terminated name. cudart opens the driver RTLD_LOCAL, so
    // RTLD_NEXT could not see it: our own handle is the reliable way in. When the driver
    // is loaded already (it always is by the time a hook runs) this only takes a reference.
    let handle =
        unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return false;
    }
    for &sym in Sym::ALL {
        REAL[sym as usize].store(lookup(handle, sym.name()), Ordering::Release);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_null_legacy_and_per_thread_streams_are_default_streams_and_others_are_not() {
        for default in [Stream::NULL, Stream::LEGACY, Stream::PER_THREAD] {
            assert!(default.is_default(), "{default:?}");
        }
        assert_eq!(Stream::LEGACY.as_raw() as usize, 0x1);
        assert_eq!(Stream::PER_THREAD.as_raw() as usize, 0x2);
        let created = Stream::from_raw(0x3 as *mut c_void);
        assert!(!created.is_default());
        assert!(!Stream::from_raw(usize::MAX as *mut c_void).is_default());
    }

    #[test]
    fn a_handle_is_the_driver_pointer_itself() {
        assert_eq!(size_of::<Stream>(), size_of::<*mut c_void>());
        assert_eq!(
            size_of::<Option<MemPool>>(),
            size_of::<Option<*mut c_void>>()
        );
        let raw = 0x7f00_1234_5000usize as *mut c_void;
        assert_eq!(GraphExec::from_raw(raw).as_raw(), raw);
        assert_eq!(Module::from_raw(raw).key(), 0x7f00_1234_5000);
        assert!(Context::NULL.is_null());
    }

    #[test]
    fn base_names_of_our_variants_are_recognised_and_others_are_not() {
        for ours in [
            &b"cuMemAlloc"[..],
            b"cuMemAlloc_v2",
            b"cuMemFreeAsync",
            b"cuGetProcAddress",
            b"cuCtxCreate",
            b"cuDeviceTotalMem",
        ] {
            assert!(
                is_variant_of_ours(ours),
                "{}",
                String::from_utf8_lossy(ours)
            );
        }
        // A prefix that is not a whole base name, and names we never wrap.
        for other in [
            &b""[..],
            b"cu",
            b"cuMem",
            b"cuMemAllo",
            b"cuLaunchKernel",
            b"cuModuleGetFunction",
            b"cuMemAllocHost",
        ] {
            assert!(
                !is_variant_of_ours(other),
                "{}",
                String::from_utf8_lossy(other)
            );
        }
    }
}
