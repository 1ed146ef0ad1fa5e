//! `cuGetProcAddress` and its variants: how cudart (PyTorch, CuPy, nvcc programs) reaches
//! every other entry point.
//!
//! We call the real one, then look at the pointer the driver chose: the driver's answer
//! decides the variant (and so the ABI), and we hand back our hook for *that exact*
//! variant. Asked for `cuGetProcAddress` itself, we hand back our wrapper of the variant
//! the driver returned. Everything else comes back untouched.
//!
//! Here too, [`hook_for`]: the one list of what is interposed, which `dlsym` answers
//! from as well.

use std::ffi::{CStr, c_char, c_int, c_void};

use super::guard;
use crate::runtime::Mode;
use crate::sys::driver::{self, CuResult, Sym, real};

/// Replaces the driver's answer `found` for `symbol` with our hook for that variant when
/// we wrap it.
fn redirect(symbol: *const c_char, found: *mut c_void) -> *mut c_void {
    if found.is_null() {
        return found;
    }
    let sym = driver::sym_of_real(found).or_else(|| {
        // `dladdr` scans the driver's symbol table: only worth it for a name of ours
        // (cudart asks for hundreds of others at start-up).
        // SAFETY: the caller's symbol name, NUL-terminated (the driver just took it).
        let requested = (!symbol.is_null()).then(|| unsafe { CStr::from_ptr(symbol) });
        requested
            .is_some_and(|name| driver::is_variant_of_ours(name.to_bytes()))
            .then(|| named_by_dladdr(found))
            .flatten()
    });
    let Some(sym) = sym else { return found };
    if matches!(
        sym,
        Sym::cuGetProcAddress | Sym::cuGetProcAddress_v2 | Sym::cuGetProcAddress_v2_ptsz
    ) {
        return hook_for(sym).unwrap_or(found);
    }
    // A process with no budget keeps the driver's own functions.
    if !matches!(crate::lifecycle::mode(), Mode::Budgeted | Mode::Refused) {
        return found;
    }
    hook_for(sym).unwrap_or(found)
}

/// The variant `p` is, by the name `dladdr` gives it, when it is exactly an exported
/// driver function we know but our table holds another pointer for it.
fn named_by_dladdr(p: *mut c_void) -> Option<Sym> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the address and fills `info`.
    let ok = unsafe { libc::dladdr(p, &mut info) } != 0;
    if !ok || info.dli_sname.is_null() || info.dli_saddr != p {
        return None;
    }
    // SAFETY: dladdr returned a NUL-terminated symbol name.
    let name = unsafe { CStr::from_ptr(info.dli_sname) }.to_bytes();
    let sym = driver::sym_named(name)?;
    // Only when our own table has nothing for it (two different drivers in one process
    // are not ours to mix), and then the hook calls this very function: without it in
    // the table, the hook would answer NOT_INITIALIZED instead of the driver.
    driver::adopt(sym, p).then_some(sym)
}

fn resolve(
    call: impl FnOnce() -> CuResult,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
) -> CuResult {
    if !driver::load() {
        return CuResult::SHARED_OBJECT_INIT_FAILED;
    }
    let rc = call();
    if rc.is_ok() && !pfn.is_null() {
        // SAFETY: the driver just wrote a pointer through `pfn`.
        unsafe { *pfn = redirect(symbol, *pfn) };
    }
    rc
}

/// # Safety
/// As the driver's `cuGetProcAddress`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CuResult {
    guard("cuGetProcAddress", || {
        resolve(
            // SAFETY: the caller's arguments, passed on unchanged.
            || unsafe { real::cuGetProcAddress(symbol, pfn, version, flags) },
            symbol,
            pfn,
        )
    })
}

/// # Safety
/// As the driver's `cuGetProcAddress_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CuResult {
    guard("cuGetProcAddress_v2", || {
        resolve(
            // SAFETY: the caller's arguments, passed on unchanged.
            || unsafe { real::cuGetProcAddress_v2(symbol, pfn, version, flags, status) },
            symbol,
            pfn,
        )
    })
}

/// # Safety
/// As the driver's `cuGetProcAddress_v2_ptsz`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGetProcAddress_v2_ptsz(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CuResult {
    guard("cuGetProcAddress_v2_ptsz", || {
        resolve(
            // SAFETY: the caller's arguments, passed on unchanged.
            || unsafe { real::cuGetProcAddress_v2_ptsz(symbol, pfn, version, flags, status) },
            symbol,
            pfn,
        )
    })
}

/// Our hook for the driver variant `sym`, if we wrap it.
pub fn hook_for(sym: Sym) -> Option<*mut c_void> {
    use super::arrays::*;
    use super::context::*;
    use super::device::*;
    use super::graphs::*;
    use super::memory::*;
    use super::modules::*;
    use super::pools::*;
    use super::vmm::*;
    let f: *const () = match sym {
        Sym::cuInit => cuInit as *const (),
        Sym::cuGetProcAddress => cuGetProcAddress as *const (),
        Sym::cuGetProcAddress_v2 => cuGetProcAddress_v2 as *const (),
        Sym::cuGetProcAddress_v2_ptsz => cuGetProcAddress_v2_ptsz as *const (),
        Sym::cuDeviceTotalMem_v2 => cuDeviceTotalMem_v2 as *const (),
        Sym::cuMemGetInfo_v2 => cuMemGetInfo_v2 as *const (),
        Sym::cuDevicePrimaryCtxRetain => cuDevicePrimaryCtxRetain as *const (),
        Sym::cuDevicePrimaryCtxRelease_v2 => cuDevicePrimaryCtxRelease_v2 as *const (),
        Sym::cuDevicePrimaryCtxReset_v2 => cuDevicePrimaryCtxReset_v2 as *const (),
        Sym::cuCtxCreate_v2 => cuCtxCreate_v2 as *const (),
        Sym::cuCtxCreate_v3 => cuCtxCreate_v3 as *const (),
        Sym::cuCtxCreate_v4 => cuCtxCreate_v4 as *const (),
        Sym::cuCtxDestroy_v2 => cuCtxDestroy_v2 as *const (),
        Sym::cuMemAlloc_v2 => cuMemAlloc_v2 as *const (),
        Sym::cuMemAllocPitch_v2 => cuMemAllocPitch_v2 as *const (),
        Sym::cuMemAllocManaged => cuMemAllocManaged as *const (),
        Sym::cuMemFree_v2 => cuMemFree_v2 as *const (),
        Sym::cuMemCreate => cuMemCreate as *const (),
        Sym::cuMemRelease => cuMemRelease as *const (),
        Sym::cuMemMap => cuMemMap as *const (),
        Sym::cuMemUnmap => cuMemUnmap as *const (),
        Sym::cuMemRetainAllocationHandle => cuMemRetainAllocationHandle as *const (),
        Sym::cuMemAllocAsync => cuMemAllocAsync as *const (),
        Sym::cuMemAllocAsync_ptsz => cuMemAllocAsync_ptsz as *const (),
        Sym::cuMemAllocFromPoolAsync => cuMemAllocFromPoolAsync as *const (),
        Sym::cuMemAllocFromPoolAsync_ptsz => cuMemAllocFromPoolAsync_ptsz as *const (),
        Sym::cuMemFreeAsync => cuMemFreeAsync as *const (),
        Sym::cuMemFreeAsync_ptsz => cuMemFreeAsync_ptsz as *const (),
        Sym::cuMemPoolCreate => cuMemPoolCreate as *const (),
        Sym::cuMemPoolDestroy => cuMemPoolDestroy as *const (),
        Sym::cuMemPoolTrimTo => cuMemPoolTrimTo as *const (),
        Sym::cuDeviceSetMemPool => cuDeviceSetMemPool as *const (),
        Sym::cuArrayCreate_v2 => cuArrayCreate_v2 as *const (),
        Sym::cuArray3DCreate_v2 => cuArray3DCreate_v2 as *const (),
        Sym::cuMipmappedArrayCreate => cuMipmappedArrayCreate as *const (),
        Sym::cuArrayDestroy => cuArrayDestroy as *const (),
        Sym::cuMipmappedArrayDestroy => cuMipmappedArrayDestroy as *const (),
        Sym::cuStreamBeginCapture_v2 => cuStreamBeginCapture_v2 as *const (),
        Sym::cuStreamBeginCapture_v2_ptsz => cuStreamBeginCapture_v2_ptsz as *const (),
        Sym::cuStreamBeginCaptureToGraph => cuStreamBeginCaptureToGraph as *const (),
        Sym::cuStreamBeginCaptureToGraph_ptsz => cuStreamBeginCaptureToGraph_ptsz as *const (),
        Sym::cuStreamEndCapture => cuStreamEndCapture as *const (),
        Sym::cuStreamEndCapture_ptsz => cuStreamEndCapture_ptsz as *const (),
        Sym::cuGraphInstantiateWithFlags => cuGraphInstantiateWithFlags as *const (),
        Sym::cuGraphInstantiateWithParams => cuGraphInstantiateWithParams as *const (),
        Sym::cuGraphInstantiateWithParams_ptsz => cuGraphInstantiateWithParams_ptsz as *const (),
        Sym::cuGraphInstantiate_v2 => cuGraphInstantiate_v2 as *const (),
        Sym::cuGraphExecDestroy => cuGraphExecDestroy as *const (),
        Sym::cuGraphUpload => cuGraphUpload as *const (),
        Sym::cuGraphUpload_ptsz => cuGraphUpload_ptsz as *const (),
        Sym::cuGraphLaunch => cuGraphLaunch as *const (),
        Sym::cuGraphLaunch_ptsz => cuGraphLaunch_ptsz as *const (),
        Sym::cuDeviceGraphMemTrim => cuDeviceGraphMemTrim as *const (),
        Sym::cuModuleLoad => cuModuleLoad as *const (),
        Sym::cuModuleLoadData => cuModuleLoadData as *const (),
        Sym::cuModuleLoadDataEx => cuModuleLoadDataEx as *const (),
        Sym::cuModuleLoadFatBinary => cuModuleLoadFatBinary as *const (),
        Sym::cuModuleUnload => cuModuleUnload as *const (),
        Sym::cuLibraryLoadData => cuLibraryLoadData as *const (),
        Sym::cuLibraryLoadFromFile => cuLibraryLoadFromFile as *const (),
        Sym::cuLibraryUnload => cuLibraryUnload as *const (),
        Sym::cuLibraryGetGlobal => cuLibraryGetGlobal as *const (),
        Sym::cuLibraryGetManaged => cuLibraryGetManaged as *const (),
        Sym::cuLibraryGetModule => cuLibraryGetModule as *const (),
        Sym::cuLibraryGetKernel => cuLibraryGetKernel as *const (),
        Sym::cuCtxSetLimit => cuCtxSetLimit as *const (),
        Sym::cuMemSetMemPool => cuMemSetMemPool as *const (),
        // Called by the library, never wrapped.
        Sym::cuDeviceGetCount
        | Sym::cuDeviceGet
        | Sym::cuDeviceGetName
        | Sym::cuDeviceGetUuid
        | Sym::cuDeviceGetUuid_v2
        | Sym::cuCtxGetDevice
        | Sym::cuCtxGetLimit
        | Sym::cuModuleGetLoadingMode
        | Sym::cuDevicePrimaryCtxGetState
        | Sym::cuMemGetAllocationGranularity
        | Sym::cuMemPoolGetAttribute
        | Sym::cuDeviceGetDefaultMemPool
        | Sym::cuDeviceGetMemPool
        | Sym::cuStreamGetDevice
        | Sym::cuStreamIsCapturing
        | Sym::cuThreadExchangeStreamCaptureMode
        | Sym::cuGraphGetNodes
        | Sym::cuGraphNodeGetType
        | Sym::cuGraphMemAllocNodeGetParams
        | Sym::cuGraphMemFreeNodeGetParams
        | Sym::cuGraphChildGraphNodeGetGraph
        | Sym::cuDeviceGetGraphMemAttribute
        | Sym::cuDeviceGetAttribute
        | Sym::cuCtxGetCurrent => return None,
    };
    Some(f as *mut c_void)
}

/// Our hook for an exact exported name (`dlsym`'s question), CUDA or NVML.
pub fn hook_named(name: &[u8]) -> Option<*mut c_void> {
    if name.starts_with(b"nvml") {
        return super::nvml::hook_named(name);
    }
    if !name.starts_with(b"cu") {
        return None;
    }
    crate::sys::driver::sym_named(name).and_then(hook_for)
}
