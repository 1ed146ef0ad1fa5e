//! The allocation and release entry points, one per driver variant, in the order of
//! DESIGN.md's table. Each is resolve → reserve → real call → commit or roll back, in
//! [`crate::admit::flow`].

use super::guard;
use crate::admit::flow::{self, array_bytes};
use crate::admit::{gate, pools};
use crate::books::vmm;
use crate::runtime::{self, Cx};
use crate::sys::driver::{
    Array3dDescriptor, ArrayDescriptor, CuResult, DevicePtr, Handle, MEM_ALLOCATION_TYPE_PINNED,
    MEM_LOCATION_TYPE_DEVICE, MemAllocationProp, MemLocation, MemPoolProps, real,
};

/// # Safety
/// As the driver's `cuMemAlloc_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevicePtr, bytes: usize) -> CuResult {
    guard("cuMemAlloc", || {
        // SAFETY: the caller's arguments.
        let alloc = || unsafe { real::cuMemAlloc_v2(dptr, bytes) };
        let cx = enter!(alloc);
        flow::alloc_direct(cx, "cuMemAlloc", bytes as u64, None, dptr, alloc)
    })
}

/// # Safety
/// As the driver's `cuMemAllocPitch_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut DevicePtr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: u32,
) -> CuResult {
    guard("cuMemAllocPitch", || {
        // SAFETY: the caller's arguments.
        let alloc = || unsafe { real::cuMemAllocPitch_v2(dptr, pitch, width, height, elem) };
        let cx = enter!(alloc);
        flow::alloc_pitch(cx, width, height, dptr, pitch, alloc)
    })
}

/// Managed memory is counted in full: it may all come to live on the device.
///
/// # Safety
/// As the driver's `cuMemAllocManaged`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut DevicePtr,
    bytes: usize,
    flags: u32,
) -> CuResult {
    guard("cuMemAllocManaged", || {
        // SAFETY: the caller's arguments.
        let alloc = || unsafe { real::cuMemAllocManaged(dptr, bytes, flags) };
        let cx = enter!(alloc);
        flow::alloc_direct(cx, "cuMemAllocManaged", bytes as u64, None, dptr, alloc)
    })
}

/// # Safety
/// As the driver's `cuMemFree_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemFree_v2(dptr: DevicePtr) -> CuResult {
    guard("cuMemFree", || {
        // SAFETY: the caller's argument.
        let free = || unsafe { real::cuMemFree_v2(dptr) };
        let cx = enter!(free);
        flow::free(cx, dptr, free)
    })
}

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

/// # Safety
/// As the driver's `cuMemAllocAsync`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut DevicePtr,
    bytes: usize,
    stream: Handle,
) -> CuResult {
    guard("cuMemAllocAsync", || {
        // SAFETY: the caller's arguments (here and in the driver's call below).
        let cx = enter!(|| unsafe { real::cuMemAllocAsync(dptr, bytes, stream) });
        flow::alloc_async(
            cx,
            bytes as u64,
            stream,
            dptr,
            #[inline(always)]
            // SAFETY: the caller's arguments.
            || unsafe { real::cuMemAllocAsync(dptr, bytes, stream) },
        )
    })
}

/// # Safety
/// As the driver's `cuMemAllocAsync_ptsz`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut DevicePtr,
    bytes: usize,
    stream: Handle,
) -> CuResult {
    guard("cuMemAllocAsync", || {
        // SAFETY: the caller's arguments (here and in the driver's call below).
        let cx = enter!(|| unsafe { real::cuMemAllocAsync_ptsz(dptr, bytes, stream) });
        flow::alloc_async(
            cx,
            bytes as u64,
            stream,
            dptr,
            #[inline(always)]
            // SAFETY: the caller's arguments.
            || unsafe { real::cuMemAllocAsync_ptsz(dptr, bytes, stream) },
        )
    })
}

/// # Safety
/// As the driver's `cuMemAllocFromPoolAsync`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut DevicePtr,
    bytes: usize,
    pool: Handle,
    stream: Handle,
) -> CuResult {
    guard("cuMemAllocFromPoolAsync", || {
        // SAFETY: the caller's arguments.
        let alloc = || unsafe { real::cuMemAllocFromPoolAsync(dptr, bytes, pool, stream) };
        let cx = enter!(alloc);
        let bytes = bytes as u64;
        flow::alloc_pooled(
            cx,
            "cuMemAllocFromPoolAsync",
            bytes,
            Some(pool),
            stream,
            dptr,
            alloc,
        )
    })
}

/// # Safety
/// As the driver's `cuMemAllocFromPoolAsync_ptsz`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut DevicePtr,
    bytes: usize,
    pool: Handle,
    stream: Handle,
) -> CuResult {
    guard("cuMemAllocFromPoolAsync", || {
        // SAFETY: the caller's arguments.
        let alloc = || unsafe { real::cuMemAllocFromPoolAsync_ptsz(dptr, bytes, pool, stream) };
        let cx = enter!(alloc);
        let bytes = bytes as u64;
        flow::alloc_pooled(
            cx,
            "cuMemAllocFromPoolAsync",
            bytes,
            Some(pool),
            stream,
            dptr,
            alloc,
        )
    })
}

/// # Safety
/// As the driver's `cuMemFreeAsync`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: DevicePtr, stream: Handle) -> CuResult {
    guard("cuMemFreeAsync", || {
        // SAFETY: the caller's arguments (here and in the driver's call below).
        let cx = enter!(|| unsafe { real::cuMemFreeAsync(dptr, stream) });
        flow::free_async(
            cx,
            dptr,
            stream,
            #[inline(always)]
            // SAFETY: the caller's arguments.
            || unsafe { real::cuMemFreeAsync(dptr, stream) },
        )
    })
}

/// # Safety
/// As the driver's `cuMemFreeAsync_ptsz`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: DevicePtr, stream: Handle) -> CuResult {
    guard("cuMemFreeAsync", || {
        // SAFETY: the caller's arguments (here and in the driver's call below).
        let cx = enter!(|| unsafe { real::cuMemFreeAsync_ptsz(dptr, stream) });
        flow::free_async(
            cx,
            dptr,
            stream,
            #[inline(always)]
            // SAFETY: the caller's arguments.
            || unsafe { real::cuMemFreeAsync_ptsz(dptr, stream) },
        )
    })
}

/// Remembers the pool and its device, so its reserve is counted and trimmed.
///
/// # Safety
/// As the driver's `cuMemPoolCreate`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut Handle,
    props: *const MemPoolProps,
) -> CuResult {
    guard("cuMemPoolCreate", || {
        // SAFETY: the caller's arguments.
        let create = || unsafe { real::cuMemPoolCreate(pool, props) };
        let _cx = enter!(books, create);
        let rc = create();
        if rc.is_ok() && !pool.is_null() && !props.is_null() {
            // SAFETY: the driver accepted `props` and wrote the pool.
            let (location, handle) = unsafe { ((*props).location, *pool) };
            if location.kind == MEM_LOCATION_TYPE_DEVICE && location.id >= 0 {
                pools::register_created(handle, location.id as usize);
            } else {
                pools::register_host(handle);
            }
        }
        rc
    })
}

/// What the pool gives back is no longer charged.
///
/// # Safety
/// As the driver's `cuMemPoolTrimTo`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: Handle, keep: usize) -> CuResult {
    guard("cuMemPoolTrimTo", || {
        // SAFETY: the caller's arguments.
        let trim = || unsafe { real::cuMemPoolTrimTo(pool, keep) };
        let _cx = enter!(books, trim);
        // A created pool's reserve is what its growths are admitted by.
        let rc = if pools::created(pool).is_some() {
            crate::admit::program_trim(trim)
        } else {
            trim()
        };
        if rc.is_ok() {
            let device = match pools::place_of(pool) {
                pools::Place::Device(device) => Some(device),
                pools::Place::Unknown => runtime::current_device(),
                pools::Place::Host => None,
            };
            if let Some(device) = device {
                flow::pool_trimmed(device, pool);
            }
        }
        rc
    })
}

/// # Safety
/// As the driver's `cuMemPoolDestroy`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: Handle) -> CuResult {
    guard("cuMemPoolDestroy", || {
        // SAFETY: the caller's argument.
        let destroy = || unsafe { real::cuMemPoolDestroy(pool) };
        let _cx = enter!(books, destroy);
        if pools::created(pool).is_none() {
            let rc = destroy();
            if rc.is_ok() {
                // A host pool (or one never seen): forgotten, its slot free again.
                let _ = pools::unregister(pool);
            }
            return rc;
        }
        // A device's current pool, when destroyed, hands the device back to its default
        // pool: a switch like cuDeviceSetMemPool's (crate::admit::gate).
        gate::closed(|| flow::created_pool_destroyed(pool, destroy))
    })
}

/// Remembers which pool `cuMemAllocAsync` allocates from on the device.
///
/// # Safety
/// As the driver's `cuDeviceSetMemPool`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuDeviceSetMemPool(
    device: crate::sys::driver::Device,
    pool: Handle,
) -> CuResult {
    guard("cuDeviceSetMemPool", || {
        // SAFETY: the caller's arguments.
        let set = || unsafe { real::cuDeviceSetMemPool(device, pool) };
        let cx = enter!(books, set);
        set_device_pool(cx, device, pool, set)
    })
}

/// CUDA 13's form of `cuDeviceSetMemPool`: for a device's pinned memory it is the same
/// call; host and managed locations are not device memory the budget counts.
///
/// # Safety
/// As the driver's `cuMemSetMemPool`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemSetMemPool(
    location: *mut MemLocation,
    kind: std::ffi::c_int,
    pool: Handle,
) -> CuResult {
    guard("cuMemSetMemPool", || {
        // SAFETY: the caller's arguments.
        let set = || unsafe { real::cuMemSetMemPool(location, kind, pool) };
        let cx = enter!(books, set);
        // SAFETY: read only when non-null; the caller's location.
        let device = (!location.is_null())
            .then(|| unsafe { *location })
            .filter(|l| l.kind == MEM_LOCATION_TYPE_DEVICE && kind == MEM_ALLOCATION_TYPE_PINNED)
            .map(|l| l.id);
        match device {
            Some(device) => set_device_pool(cx, device, pool, set),
            None => set(),
        }
    })
}

/// Makes `pool` the device's current pool (`real`).
fn set_device_pool(
    _cx: Cx,
    device: crate::sys::driver::Device,
    pool: Handle,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    // No stream-ordered allocation is between its look at the current pool and its
    // driver call while the pool changes (crate::admit::gate); those after see the new pool.
    gate::closed(|| {
        let rc = real();
        if rc.is_ok() && device >= 0 {
            pools::made_current(device as usize, pool);
        }
        rc
    })
}

/// # Safety
/// As the driver's `cuArrayCreate_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuArrayCreate_v2(
    array: *mut Handle,
    desc: *const ArrayDescriptor,
) -> CuResult {
    guard("cuArrayCreate", || {
        // SAFETY: the caller's arguments.
        let create = || unsafe { real::cuArrayCreate_v2(array, desc) };
        if desc.is_null() {
            return create();
        }
        // SAFETY: checked non-null.
        let d = unsafe { &*desc };
        let bytes = array_bytes(d.width, d.height, 0, d.format, d.num_channels, 1);
        let cx = enter!(create);
        flow::alloc_array(cx, "cuArrayCreate", bytes, array, create)
    })
}

/// # Safety
/// As the driver's `cuArray3DCreate_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    array: *mut Handle,
    desc: *const Array3dDescriptor,
) -> CuResult {
    guard("cuArray3DCreate", || {
        // SAFETY: the caller's arguments.
        let create = || unsafe { real::cuArray3DCreate_v2(array, desc) };
        if desc.is_null() {
            return create();
        }
        // SAFETY: checked non-null.
        let d = unsafe { &*desc };
        let bytes = array_bytes(d.width, d.height, d.depth, d.format, d.num_channels, 1);
        let cx = enter!(create);
        flow::alloc_array(cx, "cuArray3DCreate", bytes, array, create)
    })
}

/// # Safety
/// As the driver's `cuMipmappedArrayCreate`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    array: *mut Handle,
    desc: *const Array3dDescriptor,
    levels: u32,
) -> CuResult {
    guard("cuMipmappedArrayCreate", || {
        // SAFETY: the caller's arguments.
        let create = || unsafe { real::cuMipmappedArrayCreate(array, desc, levels) };
        if desc.is_null() {
            return create();
        }
        // SAFETY: checked non-null.
        let d = unsafe { &*desc };
        let bytes = array_bytes(d.width, d.height, d.depth, d.format, d.num_channels, levels);
        let cx = enter!(create);
        flow::alloc_array(cx, "cuMipmappedArrayCreate", bytes, array, create)
    })
}

/// # Safety
/// As the driver's `cuArrayDestroy`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuArrayDestroy(array: Handle) -> CuResult {
    guard("cuArrayDestroy", || {
        // SAFETY: the caller's argument.
        let destroy = || unsafe { real::cuArrayDestroy(array) };
        let cx = enter!(destroy);
        flow::free_array(cx, array, destroy)
    })
}

/// # Safety
/// As the driver's `cuMipmappedArrayDestroy`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(array: Handle) -> CuResult {
    guard("cuMipmappedArrayDestroy", || {
        // SAFETY: the caller's argument.
        let destroy = || unsafe { real::cuMipmappedArrayDestroy(array) };
        let cx = enter!(destroy);
        flow::free_array(cx, array, destroy)
    })
}
