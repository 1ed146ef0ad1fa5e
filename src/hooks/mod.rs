//! The exported symbols, and nothing else, one file per API family: `memory`, `vmm`,
//! `pools`, `arrays`, `graphs` (stream capture too), `context`, `device` (`cuInit` and
//! the views), `modules`, `nvml`, `dlsym`, `proc_address`. Each hook that budgets starts
//! with the one prologue, `enter!`, and hands the call context to [`crate::admit`].
//!
//! `proc_address::hook_for` is the one list of what is interposed; `dlsym` and
//! `cuGetProcAddress` both answer from it, so every way a program reaches the driver
//! ends in the same hook.

//! Exports carry `cfg_attr(not(test), no_mangle)` so that unit-test binaries do not
//! interpose themselves.

#![allow(non_snake_case)]

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::sys::driver::CuResult;

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

/// A hook and its twin for the per-thread default stream (`NAME_ptsz`, the driver
/// table's `+ ptsz` line), written from one body so that they never drift apart: in the
/// body, `$driver` is the driver's function of the variant being written (`real::NAME`,
/// `real::NAME_ptsz`). Both are exported (outside unit tests) and resolve alike through
/// `dlsym` and `cuGetProcAddress`.
macro_rules! with_ptsz {
    ($name:ident, $driver:ident, fn($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        #[doc = concat!("# Safety\nAs the driver's `", stringify!($name), "`.")]
        #[cfg_attr(not(test), unsafe(no_mangle))]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CuResult {
            use crate::sys::driver::real::$name as $driver;
            $body
        }

        pastey::paste! {
            #[doc = concat!("# Safety\nAs the driver's `", stringify!($name), "_ptsz`.")]
            #[cfg_attr(not(test), unsafe(no_mangle))]
            pub unsafe extern "C" fn [<$name _ptsz>]($($arg: $ty),*) -> CuResult {
                use crate::sys::driver::real::[<$name _ptsz>] as $driver;
                $body
            }
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
