//! Stream-ordered memory pools: the pools a program creates (counted by their reserve),
//! trims, destroys, and which pool is a device's current one.

use super::guard;
use crate::admit::{flow, gate, pools};
use crate::runtime;
use crate::sys::driver::{
    CuResult, MEM_ALLOCATION_TYPE_PINNED, MEM_LOCATION_TYPE_DEVICE, MemLocation, MemPool,
    MemPoolProps, real,
};

/// Remembers the pool and its device, so its reserve is counted and trimmed.
///
/// # Safety
/// As the driver's `cuMemPoolCreate`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut MemPool,
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
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: MemPool, keep: usize) -> CuResult {
    guard("cuMemPoolTrimTo", || {
        // SAFETY: the caller's arguments.
        let trim = || unsafe { real::cuMemPoolTrimTo(pool, keep) };
        let cx = enter!(books, trim);
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
                flow::pool_trimmed(cx, device, pool);
            }
        }
        rc
    })
}

/// # Safety
/// As the driver's `cuMemPoolDestroy`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: MemPool) -> CuResult {
    guard("cuMemPoolDestroy", || {
        // SAFETY: the caller's argument.
        let destroy = || unsafe { real::cuMemPoolDestroy(pool) };
        let cx = enter!(books, destroy);
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
        gate::closed(|| flow::created_pool_destroyed(cx, pool, destroy))
    })
}

/// Remembers which pool `cuMemAllocAsync` allocates from on the device.
///
/// # Safety
/// As the driver's `cuDeviceSetMemPool`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuDeviceSetMemPool(
    device: crate::sys::driver::Device,
    pool: MemPool,
) -> CuResult {
    guard("cuDeviceSetMemPool", || {
        // SAFETY: the caller's arguments.
        let set = || unsafe { real::cuDeviceSetMemPool(device, pool) };
        let _cx = enter!(books, set);
        set_device_pool(device, pool, set)
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
    pool: MemPool,
) -> CuResult {
    guard("cuMemSetMemPool", || {
        // SAFETY: the caller's arguments.
        let set = || unsafe { real::cuMemSetMemPool(location, kind, pool) };
        let _cx = enter!(books, set);
        // SAFETY: read only when non-null; the caller's location.
        let device = (!location.is_null())
            .then(|| unsafe { *location })
            .filter(|l| l.kind == MEM_LOCATION_TYPE_DEVICE && kind == MEM_ALLOCATION_TYPE_PINNED)
            .map(|l| l.id);
        match device {
            Some(device) => set_device_pool(device, pool, set),
            None => set(),
        }
    })
}

/// Makes `pool` the device's current pool (`real`).
fn set_device_pool(
    device: crate::sys::driver::Device,
    pool: MemPool,
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
