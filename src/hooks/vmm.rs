//! The virtual memory management calls: `cuMemCreate` is admitted like any allocation
//! ([`crate::admit::flow::alloc_vmm`]); release, map, unmap and retain keep the books of
//! what the handles hold ([`crate::books::vmm`]) in the driver's order.

use super::guard;
use crate::admit::flow;
use crate::books::vmm;
use crate::runtime;
use crate::sys::driver::{CuResult, DevicePtr, MemAllocationProp, real};

/// Device memory from `cuMemCreate` counts from creation until it really goes back
/// (released and unmapped); see [`flow::alloc_vmm`].
///
/// # Safety
/// As the driver's `cuMemCreate`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const MemAllocationProp,
    flags: u64,
) -> CuResult {
    guard("cuMemCreate", || {
        // SAFETY: the caller's arguments.
        let create = || unsafe { real::cuMemCreate(handle, size, prop, flags) };
        let cx = enter!(create);
        // SAFETY: the caller's property struct, valid for the driver (or null).
        unsafe { flow::alloc_vmm(cx, handle, size, prop, flags, create) }
    })
}

/// # Safety
/// As the driver's `cuMemRelease`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> CuResult {
    guard("cuMemRelease", || {
        // SAFETY: the caller's argument.
        let release = || unsafe { real::cuMemRelease(handle) };
        let _cx = enter!(books, release);
        // The books follow the driver's order: the lock is held across the driver's
        // call (see `vmm_call`).
        let (rc, returned) = vmm_call(release, |v| v.released(handle));
        give_back(returned.flatten());
        rc
    })
}

/// # Safety
/// As the driver's `cuMemMap`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemMap(
    ptr: DevicePtr,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> CuResult {
    guard("cuMemMap", || {
        // SAFETY: the caller's arguments.
        let map = || unsafe { real::cuMemMap(ptr, size, offset, handle, flags) };
        let _cx = enter!(books, map);
        vmm_call(map, |v| v.mapped(ptr, size as u64, handle)).0
    })
}

/// # Safety
/// As the driver's `cuMemUnmap`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemUnmap(ptr: DevicePtr, size: usize) -> CuResult {
    guard("cuMemUnmap", || {
        // SAFETY: the caller's arguments.
        let unmap = || unsafe { real::cuMemUnmap(ptr, size) };
        let _cx = enter!(books, unmap);
        let (rc, returned) = vmm_call(unmap, |v| v.unmapped(ptr, size as u64));
        for r in returned.into_iter().flatten() {
            give_back(Some(r));
        }
        rc
    })
}

/// Each handle it gives out is one more reference, which needs its own `cuMemRelease`.
///
/// # Safety
/// As the driver's `cuMemRetainAllocationHandle`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut u64,
    addr: *mut std::ffi::c_void,
) -> CuResult {
    guard("cuMemRetainAllocationHandle", || {
        // SAFETY: the caller's arguments.
        let retain = || unsafe { real::cuMemRetainAllocationHandle(handle, addr) };
        let _cx = enter!(books, retain);
        if handle.is_null() {
            return retain();
        }
        // SAFETY: the driver wrote the handle (the closure runs only on success).
        vmm_call(retain, |v| v.retained(unsafe { *handle })).0
    })
}

/// Makes the driver's VMM call `real` and, when it succeeded, the matching change to the
/// books (`books`), with the books locked across both: another thread's map, unmap,
/// retain or release of the same handle then comes wholly before or wholly after, in
/// the driver and in the books alike. (Made in between, a release could see no mapping
/// the driver already had, or miss a reference it had just given, and give back memory
/// the driver keeps.) These calls are short and never call back into the library.
fn vmm_call<R>(
    real: impl FnOnce() -> CuResult,
    books: impl FnOnce(&mut vmm::Vmm) -> R,
) -> (CuResult, Option<R>) {
    let mut v = vmm::lock();
    let rc = real();
    let changed = rc.is_ok().then(|| books(&mut v));
    (rc, changed)
}

fn give_back(returned: vmm::Returned) {
    if let Some((device, bytes)) = returned
        && let Some(d) = runtime::ledger().device(device)
    {
        d.release(bytes);
    }
}
