//! NVML's memory views: the device a budget applies to reports total = budget, used =
//! what this process holds, free = the rest (and never more than is really free), so
//! `nvidia-smi` and NVML-based tools inside the job show the job's own numbers.

use std::ffi::{c_int, c_void};

use crate::sys::nvml::{self, F, Memory, MemoryV2, NvmlDevice};

/// Our NVML hook for an exact name.
pub fn hook_named(name: &[u8]) -> Option<*mut c_void> {
    match name {
        b"nvmlDeviceGetMemoryInfo" => Some(nvmlDeviceGetMemoryInfo as *mut c_void),
        b"nvmlDeviceGetMemoryInfo_v2" => Some(nvmlDeviceGetMemoryInfo_v2 as *mut c_void),
        _ => None,
    }
}

const NVML_ERROR_UNKNOWN: c_int = 999;
const NVML_ERROR_UNINITIALIZED: c_int = 1;

/// (total, free, used) as this process should see them on `device`, if it is budgeted.
fn view(device: NvmlDevice, total: u64, free: u64) -> Option<(u64, u64, u64)> {
    let cx = crate::lifecycle::enter_books()?;
    let visible = cx.config().cuda_visible_devices.as_deref();
    let ordinal = nvml::ordinal_of(device, visible)?;
    let dev = cx.device_of_size(ordinal, total)?;
    crate::admit::footprint::settle_before_admission(&dev);
    crate::admit::flow::refresh_pools(&dev);
    let budget = dev.budget.min(total);
    let used = dev.ledger.budget_used().min(budget);
    Some((budget, free.min(budget - used), used))
}

fn call_guarded(body: impl FnOnce() -> c_int) -> c_int {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or_else(|_| {
        crate::tell::report::caught_panic("nvmlDeviceGetMemoryInfo");
        NVML_ERROR_UNKNOWN
    })
}

/// # Safety
/// As NVML's `nvmlDeviceGetMemoryInfo`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(device: NvmlDevice, memory: *mut Memory) -> c_int {
    call_guarded(|| {
        let f = nvml::real_fn(F::GetMemoryInfo);
        if f.is_null() {
            return NVML_ERROR_UNINITIALIZED;
        }
        // SAFETY: the real function of the same signature, with the caller's arguments.
        let rc = unsafe {
            let f: unsafe extern "C" fn(NvmlDevice, *mut Memory) -> c_int = std::mem::transmute(f);
            f(device, memory)
        };
        if rc == 0 && !memory.is_null() {
            // SAFETY: NVML filled the struct.
            let m = unsafe { &mut *memory };
            if let Some((total, free, used)) = view(device, m.total, m.free) {
                (m.total, m.free, m.used) = (total, free, used);
            }
        }
        rc
    })
}

/// # Safety
/// As NVML's `nvmlDeviceGetMemoryInfo_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: NvmlDevice,
    memory: *mut MemoryV2,
) -> c_int {
    call_guarded(|| {
        let f = nvml::real_fn(F::GetMemoryInfoV2);
        if f.is_null() {
            return NVML_ERROR_UNINITIALIZED;
        }
        // SAFETY: the real function of the same signature, with the caller's arguments.
        let rc = unsafe {
            let f: unsafe extern "C" fn(NvmlDevice, *mut MemoryV2) -> c_int =
                std::mem::transmute(f);
            f(device, memory)
        };
        if rc == 0 && !memory.is_null() {
            // SAFETY: NVML filled the struct.
            let m = unsafe { &mut *memory };
            if let Some((total, free, used)) = view(device, m.total, m.free) {
                (m.total, m.reserved, m.free, m.used) = (total, 0, free, used);
            }
        }
        rc
    })
}
