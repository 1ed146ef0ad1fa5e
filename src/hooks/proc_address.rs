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

/// The match of [`hook_for`] from two lists that name every [`Sym`] once (the match is
/// exhaustive): the hooked ones, a `+ ptsz` line standing for a hook and its
/// per-thread-stream twin (`with_ptsz!`), and the ones the library only calls.
macro_rules! hook_table {
    ($sym:expr; hooked: [$($name:ident $(+ $twin:ident)?,)*] called: [$($called:ident,)*]) => {
        pastey::paste! {
            match $sym {
                $(
                    Sym::$name => $name as *const (),
                    $(Sym::[<$name _ $twin>] => [<$name _ $twin>] as *const (),)?
                )*
                $(Sym::$called)|* => return None,
            }
        }
    };
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
    let f: *const () = hook_table!(sym;
        hooked: [
            cuInit,
            cuGetProcAddress,
            cuGetProcAddress_v2 + ptsz,
            cuDeviceTotalMem_v2,
            cuMemGetInfo_v2,
            cuDevicePrimaryCtxRetain,
            cuDevicePrimaryCtxRelease_v2,
            cuDevicePrimaryCtxReset_v2,
            cuCtxCreate_v2,
            cuCtxCreate_v3,
            cuCtxCreate_v4,
            cuCtxDestroy_v2,
            cuMemAlloc_v2,
            cuMemAllocPitch_v2,
            cuMemAllocManaged,
            cuMemFree_v2,
            cuMemCreate,
            cuMemRelease,
            cuMemMap,
            cuMemUnmap,
            cuMemRetainAllocationHandle,
            cuMemAllocAsync + ptsz,
            cuMemAllocFromPoolAsync + ptsz,
            cuMemFreeAsync + ptsz,
            cuMemPoolCreate,
            cuMemPoolDestroy,
            cuMemPoolTrimTo,
            cuDeviceSetMemPool,
            cuArrayCreate_v2,
            cuArray3DCreate_v2,
            cuMipmappedArrayCreate,
            cuArrayDestroy,
            cuMipmappedArrayDestroy,
            cuStreamBeginCapture_v2 + ptsz,
            cuStreamBeginCaptureToGraph + ptsz,
            cuStreamEndCapture + ptsz,
            cuGraphInstantiateWithFlags,
            cuGraphInstantiateWithParams + ptsz,
            cuGraphInstantiate_v2,
            cuGraphExecDestroy,
            cuGraphUpload + ptsz,
            cuGraphLaunch + ptsz,
            cuDeviceGraphMemTrim,
            cuModuleLoad,
            cuModuleLoadData,
            cuModuleLoadDataEx,
            cuModuleLoadFatBinary,
            cuModuleUnload,
            cuLibraryLoadData,
            cuLibraryLoadFromFile,
            cuLibraryUnload,
            cuLibraryGetGlobal,
            cuLibraryGetManaged,
            cuLibraryGetModule,
            cuLibraryGetKernel,
            cuCtxSetLimit,
            cuMemSetMemPool,
        ]
        // Called by the library, never wrapped.
        called: [
            cuDeviceGetCount,
            cuDeviceGet,
            cuDeviceGetName,
            cuDeviceGetUuid,
            cuDeviceGetUuid_v2,
            cuCtxGetDevice,
            cuCtxGetLimit,
            cuModuleGetLoadingMode,
            cuDevicePrimaryCtxGetState,
            cuMemGetAllocationGranularity,
            cuMemPoolGetAttribute,
            cuDeviceGetDefaultMemPool,
            cuDeviceGetMemPool,
            cuStreamGetDevice,
            cuStreamIsCapturing,
            cuThreadExchangeStreamCaptureMode,
            cuGraphGetNodes,
            cuGraphNodeGetType,
            cuGraphMemAllocNodeGetParams,
            cuGraphMemFreeNodeGetParams,
            cuGraphChildGraphNodeGetGraph,
            cuDeviceGetGraphMemAttribute,
            cuDeviceGetAttribute,
            cuCtxGetCurrent,
        ]
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The driver table's `+ ptsz` lines give each twin its base's name with `_ptsz`, and
    /// the hook table hooks a twin exactly when it hooks its base, with another function.
    #[test]
    fn a_per_thread_stream_twin_is_hooked_exactly_when_its_base_is() {
        let twins: Vec<Sym> = Sym::ALL
            .iter()
            .copied()
            .filter(|s| s.name().to_bytes().ends_with(b"_ptsz"))
            .collect();
        assert_eq!(twins.len(), 10, "{twins:?}");
        for twin in twins {
            let name = twin.name().to_bytes();
            let base = driver::sym_named(&name[..name.len() - 5]).expect("its base");
            assert_eq!(
                base as usize + 1,
                twin as usize,
                "declared on its base's line"
            );
            match (hook_for(base), hook_for(twin)) {
                (Some(b), Some(t)) => assert_ne!(b, t, "{twin:?} has a hook of its own"),
                (None, None) => {}
                other => panic!("{base:?} and {twin:?}: {other:?}"),
            }
        }
    }
}
