//! The exported `dlsym`.
//!
//! glibc's `dlsym` works out `RTLD_NEXT` from its caller's return address, so a wrapper
//! that simply calls it would make every other library's `dlsym(RTLD_NEXT, …)` resolve
//! relative to *us*. Our `dlsym` is therefore a naked function: it asks [`route`] what
//! to do and either returns our hook or tail-jumps to glibc's `dlsym` with the caller's
//! arguments and return address untouched. The only arch-specific code is the few
//! instructions below (x86_64 and aarch64).

use std::ffi::{CStr, c_char, c_void};

use crate::sys::driver;

/// The answer of [`route`]: `forward` null means "return `answer`"; otherwise jump to
/// `forward` (glibc's dlsym) as if the caller had called it.
#[repr(C)]
pub struct Route {
    answer: *mut c_void,
    forward: *const c_void,
}

/// Decides one `dlsym` call. Cheap for every name that is not ours: a two-byte prefix
/// check, then a jump to glibc. Never initialises anything.
pub extern "C" fn route(handle: *mut c_void, symbol: *const c_char) -> Route {
    let Some(real) = driver::real_dlsym() else {
        return Route {
            answer: std::ptr::null_mut(),
            forward: std::ptr::null(),
        };
    };
    let forward = Route {
        answer: std::ptr::null_mut(),
        forward: real as *const c_void,
    };
    if symbol.is_null() || handle == libc::RTLD_NEXT {
        return forward;
    }
    // SAFETY: dlsym's contract: `symbol` is a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    if !(name.starts_with(b"cu") || name.starts_with(b"nvml")) {
        return forward;
    }
    let Some(hook) = super::proc_address::hook_named(name) else {
        return forward;
    };
    // Only names the handle really has get our hook; a miss keeps dlsym's own answer
    // (and its dlerror message).
    // SAFETY: the caller's handle and name, passed on unchanged.
    let found = unsafe { real(handle, symbol) };
    Route {
        answer: if found.is_null() { found } else { hook },
        forward: std::ptr::null(),
    }
}

/// # Safety
/// As glibc's `dlsym`.
#[cfg(all(target_arch = "x86_64", not(test)))]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // Save the two arguments (and keep the stack 16-byte aligned for the call), ask
    // `route`, restore them, then return its answer (rax) or tail-jump to rdx.
    core::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {route}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rdx, rdx",
        "jnz 2f",
        "ret",
        "2:",
        "jmp rdx",
        route = sym route,
    )
}

/// # Safety
/// As glibc's `dlsym`.
#[cfg(all(target_arch = "aarch64", not(test)))]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // Save the frame and link registers and the two arguments, ask `route` (its `Route`
    // comes back in x0/x1), then either return its answer (x0) or restore everything
    // and branch to x1 through x16, so that glibc's dlsym sees our caller's return
    // address in x30 (and a `bti c` landing pad accepts a branch through x16).
    core::arch::naked_asm!(
        "stp x29, x30, [sp, #-32]!",
        "mov x29, sp",
        "stp x0, x1, [sp, #16]",
        "bl {route}",
        "cbnz x1, 2f",
        "ldp x29, x30, [sp], #32",
        "ret",
        "2:",
        "mov x16, x1",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "br x16",
        route = sym route,
    )
}
