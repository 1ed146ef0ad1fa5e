//! The exported symbols, and nothing else, one file per API family: `memory`, `vmm`,
//! `pools`, `arrays`, `graphs` (stream capture too), `context`, `device` (`cuInit` and
//! the views), `modules`, `nvml`, `dlsym`, `proc_address`. Each hook that budgets starts
//! with the one prologue, `enter!`, and hands the call context to [`crate::admit`].
//!
//! [`hook_for`] is the one list of what is interposed; `dlsym` and `cuGetProcAddress`
//! both answer from it, so every way a program reaches the driver ends in the same hook.
//! Exports carry `cfg_attr(not(test), no_mangle)` so that unit-test binaries do not
//! interpose themselves.

#![allow(non_snake_case)]

use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::sys::driver::{CuResult, Sym};

/// The one prologue of a hook that budgets: `let cx = enter!(real);` returns `real()` in
/// a process that does not budget, the refusal in one that must not run CUDA, and
/// otherwise gives the call context the decisions take ([`crate::lifecycle::enter`]).
/// `enter!(books, real)` is the prologue of a hook that only keeps books of what the
/// driver did: outside a budgeted process it calls the driver, whatever the reason.
macro_rules! enter {
    ($real:expr) => {
        match crate::lifecycle::enter() {
            crate::lifecycle::Entered::Budgeted(cx) => cx,
            crate::lifecycle::Entered::Pass => return $real(),
            crate::lifecycle::Entered::Refuse(rc) => return rc,
        }
    };
    (books, $real:expr) => {
        match crate::lifecycle::enter_books() {
            Some(cx) => cx,
            None => return $real(),
        }
    };
}

pub mod arrays;
pub mod context;
pub mod device;
pub mod dlsym;
pub mod graphs;
pub mod memory;
pub mod modules;
pub mod nvml;
pub mod pools;
pub mod proc_address;
pub mod vmm;

/// Runs a hook body; a panic becomes `CUDA_ERROR_UNKNOWN` instead of crossing into C.
#[inline(always)]
pub(crate) fn guard(call: &'static str, body: impl FnOnce() -> CuResult) -> CuResult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(rc) => rc,
        Err(_) => {
            crate::tell::report::caught_panic(call);
            CuResult::UNKNOWN
        }
    }
}

/// Our hook for the driver variant `sym`, if we wrap it.
pub fn hook_for(sym: Sym) -> Option<*mut c_void> {
    use arrays::*;
    use context::*;
    use device::*;
    use graphs::*;
    use memory::*;
    use modules::*;
    use pools::*;
    use proc_address::*;
    use vmm::*;
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
        return nvml::hook_named(name);
    }
    if !name.starts_with(b"cu") {
        return None;
    }
    crate::sys::driver::sym_named(name).and_then(hook_for)
}
