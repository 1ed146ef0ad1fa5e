//! `cuInit` and the device views (`cuMemGetInfo`, `cuDeviceTotalMem`): a budgeted device
//! shows its budget as its size.

use super::guard;
use crate::admit::footprint;
use crate::sys::driver::{CuResult, Device, real};

/// Refused with `CUDA_ERROR_NOT_PERMITTED` when the configuration is malformed: the
/// process must not run unbudgeted.
///
/// # Safety
/// As the driver's `cuInit`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuInit(flags: u32) -> CuResult {
    guard("cuInit", || {
        // SAFETY: the caller's argument.
        let init = || unsafe { real::cuInit(flags) };
        let cx = enter!(init);
        let rc = init();
        footprint::driver_initialised(cx, rc.is_ok());
        rc
    })
}

/// Total = min(budget, physical); free = min(physical free, budget − used).
///
/// # Safety
/// As the driver's `cuMemGetInfo_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    guard("cuMemGetInfo", || {
        // SAFETY: the caller's out-pointers.
        let get = || unsafe { real::cuMemGetInfo_v2(free, total) };
        let cx = enter!(get);
        let rc = get();
        if rc.is_ok()
            && !free.is_null()
            && !total.is_null()
            && let Some(dev) = cx.current_device()
        {
            footprint::settle_before_admission(&dev);
            crate::admit::flow::refresh_pools(&dev);
            footprint::maybe_reconcile(&dev);
            let (budget, d) = (dev.budget, dev.ledger);
            // SAFETY: the driver just filled both.
            unsafe {
                *total = (*total as u64).min(budget) as usize;
                *free = (*free as u64).min(budget.saturating_sub(d.budget_used())) as usize;
            }
        }
        rc
    })
}

/// min(budget, physical).
///
/// # Safety
/// As the driver's `cuDeviceTotalMem_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: Device) -> CuResult {
    guard("cuDeviceTotalMem", || {
        // SAFETY: the caller's arguments.
        let total = || unsafe { real::cuDeviceTotalMem_v2(bytes, device) };
        let cx = enter!(total);
        let rc = total();
        if rc.is_ok()
            && !bytes.is_null()
            && device >= 0
            && let Some(dev) = cx.device(device as usize)
        {
            // SAFETY: the driver just filled it.
            unsafe { *bytes = (*bytes as u64).min(dev.budget) as usize };
        }
        rc
    })
}
