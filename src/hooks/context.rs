//! Contexts: their creation and end (whose memory the footprint charges) and their
//! limits (`cuCtxSetLimit`, charged by what the change costs, one change at a time,
//! [`crate::admit::loads`]).

use std::ffi::{c_int, c_void};

use super::guard;
use crate::admit::{footprint, loads};
use crate::runtime::{Cx, DeviceCx};
use crate::sys::driver::{Context, CuResult, Device, Opaque, real};

/// Runs a context creation on `device` and charges the context when it succeeds. The
/// device is resolved here, once, and `create` gets it when it has a budget.
fn creating_context(
    cx: Cx,
    device: Device,
    create: impl FnOnce(Option<&DeviceCx>) -> CuResult,
) -> CuResult {
    if device < 0 {
        return create(None);
    }
    let ordinal = device as usize;
    let dev = cx.device(ordinal);
    footprint::before_context(ordinal, dev.as_ref());
    let rc = create(dev.as_ref());
    footprint::context_created(cx, ordinal, dev.as_ref(), rc.is_ok());
    rc
}

/// A context created beside another on its device: admitted by what it costs
/// ([`loads::another_context`]) when the device has a budget.
fn another_context(
    dev: Option<&DeviceCx>,
    ctx: *mut Context,
    create: impl FnOnce() -> CuResult,
) -> CuResult {
    // SAFETY: the context the driver just created, destroyed when it does not fit.
    let destroy = |c| unsafe { real::cuCtxDestroy_v2(c) };
    match dev {
        Some(dev) => loads::another_context(dev, ctx, create, destroy),
        None => create(),
    }
}

/// Runs a primary-context release (or reset) and tells the footprint when the context
/// it counted is gone. A reset of a primary context that was never active (what
/// `cudaDeviceReset` does beside a context from `cuCtxCreate`) ends nothing we counted.
fn releasing_primary(device: Device, release: impl FnOnce() -> CuResult) -> CuResult {
    if device < 0 {
        return release();
    }
    let mut books = footprint::context_books();
    let rc = release();
    let counted = books.primary.get(device as usize).copied().unwrap_or(false);
    if rc.is_ok() && counted && !primary_active(device) {
        books.primary[device as usize] = false;
        crate::lifecycle::context_gone(device as usize);
    }
    rc
}

fn primary_active(device: Device) -> bool {
    let (mut flags, mut active) = (0u32, 0 as c_int);
    // SAFETY: valid out-pointers.
    let state = unsafe { real::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active) };
    state.is_ok() && active != 0
}

/// # Safety
/// As the driver's `cuDevicePrimaryCtxRetain`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Context, device: Device) -> CuResult {
    guard("cuDevicePrimaryCtxRetain", || {
        // SAFETY: the caller's arguments.
        let retain = || unsafe { real::cuDevicePrimaryCtxRetain(ctx, device) };
        let cx = enter!(retain);
        if device < 0 {
            return retain();
        }
        let mut books = footprint::context_books();
        // A retain of an already active primary context creates nothing.
        if primary_active(device) {
            return retain();
        }
        let rc = creating_context(cx, device, |_| retain());
        if rc.is_ok()
            && let Some(counted) = books.primary.get_mut(device as usize)
        {
            *counted = true;
        }
        rc
    })
}

/// # Safety
/// As the driver's `cuDevicePrimaryCtxRelease_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(device: Device) -> CuResult {
    guard("cuDevicePrimaryCtxRelease", || {
        // SAFETY: the caller's argument.
        let release = || unsafe { real::cuDevicePrimaryCtxRelease_v2(device) };
        let _cx = enter!(release);
        releasing_primary(device, release)
    })
}

/// # Safety
/// As the driver's `cuDevicePrimaryCtxReset_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(device: Device) -> CuResult {
    guard("cuDevicePrimaryCtxReset", || {
        // SAFETY: the caller's argument.
        let release = || unsafe { real::cuDevicePrimaryCtxReset_v2(device) };
        let _cx = enter!(release);
        releasing_primary(device, release)
    })
}

/// Remembers a context from `cuCtxCreate` and its device, so its destruction can be told.
fn remember_created(ctx: *mut Context, device: Device, rc: CuResult) -> CuResult {
    if rc.is_ok() && !ctx.is_null() {
        // SAFETY: the driver wrote the new context.
        let handle = unsafe { *ctx }.key();
        footprint::context_books()
            .created
            .push((handle, device.max(0) as usize));
    }
    rc
}

/// # Safety
/// As the driver's `cuCtxCreate_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuCtxCreate_v2(ctx: *mut Context, flags: u32, device: Device) -> CuResult {
    guard("cuCtxCreate", || {
        // SAFETY: the caller's arguments.
        let create = || unsafe { real::cuCtxCreate_v2(ctx, flags, device) };
        let cx = enter!(create);
        let rc = creating_context(cx, device, |dev| another_context(dev, ctx, create));
        remember_created(ctx, device, rc)
    })
}

/// # Safety
/// As the driver's `cuCtxCreate_v3`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuCtxCreate_v3(
    ctx: *mut Context,
    params: *mut c_void,
    num: c_int,
    flags: u32,
    device: Device,
) -> CuResult {
    guard("cuCtxCreate", || {
        // SAFETY: the caller's arguments.
        let create = || unsafe { real::cuCtxCreate_v3(ctx, params, num, flags, device) };
        let cx = enter!(create);
        let rc = creating_context(cx, device, |dev| another_context(dev, ctx, create));
        remember_created(ctx, device, rc)
    })
}

/// # Safety
/// As the driver's `cuCtxCreate_v4`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuCtxCreate_v4(
    ctx: *mut Context,
    params: *mut c_void,
    flags: u32,
    device: Device,
) -> CuResult {
    guard("cuCtxCreate", || {
        // SAFETY: the caller's arguments.
        let create = || unsafe { real::cuCtxCreate_v4(ctx, params, flags, device) };
        let cx = enter!(create);
        let rc = creating_context(cx, device, |dev| another_context(dev, ctx, create));
        remember_created(ctx, device, rc)
    })
}

/// # Safety
/// As the driver's `cuCtxDestroy_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: Context) -> CuResult {
    guard("cuCtxDestroy", || {
        // SAFETY: the caller's argument.
        let destroy = || unsafe { real::cuCtxDestroy_v2(ctx) };
        let _cx = enter!(books, destroy);
        let rc = loads::unload(ctx, destroy);
        if rc.is_ok() {
            loads::context_destroyed(ctx);
            let device = {
                let created = &mut footprint::context_books().created;
                created
                    .iter()
                    .position(|&(c, _)| c == ctx.key())
                    .map(|i| created.swap_remove(i).1)
            };
            if let Some(device) = device {
                crate::lifecycle::context_gone(device);
            }
        }
        rc
    })
}

/// # Safety
/// As the driver's `cuCtxSetLimit`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuCtxSetLimit(limit: c_int, value: usize) -> CuResult {
    guard("cuCtxSetLimit", || {
        // SAFETY: the caller's limit, with the value asked for or the old one back.
        let set = |v| unsafe { real::cuCtxSetLimit(limit, v) };
        let cx = enter!(|| set(value));
        loads::set_limit(cx, limit, value, set)
    })
}
