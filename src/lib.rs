//! cudabudget: hard device-memory budgets for CUDA processes.
//!
//! Loaded with `LD_PRELOAD`, the library interposes the CUDA driver API on every path a
//! program reaches it by (`dlsym`, `cuGetProcAddress`, direct linking), keeps exact
//! accounting of the device memory the process holds, returns
//! `CUDA_ERROR_OUT_OF_MEMORY` before a budget is crossed, and makes the process see its
//! budget as the size of the card. See README.md for use and docs/design.md for the
//! internals.
//!
//! Modules:
//! - [`quantity`], [`config`]: environment → budgets (pure).
//! - [`ledger`]: per-device reservations and the address table (pure, thread-safe).
//! - `books::job`: a job's shared books (`CUDABUDGET_SCOPE=job:…`), a mapped file.
//! - `sys`: clocks and futexes.
//! - `driver`, `nvml`: the real libraries, from our own handles.
//! - `runtime`: the process-wide state; `lifecycle`: initialisation, `fork()` and exit.
//! - `enforce`, `pools`, `vmm`, `graphs`, `capture`, `footprint`, `loads`: what the hooks
//!   decide.
//! - `gate`: stream-ordered allocations against switches of a device's current pool.
//! - `lock`: the one lock kind, which a child of `fork()` takes back without waiting.
//! - `admit`: decisions before a call (`admit::image`: what a module image places on the
//!   device).
//! - `hooks`: the exported symbols only.
//! - `report`: what the user is told; `tell`: what the process tells others
//!   (`tell::events`: the events file, `CUDABUDGET_EVENTS`; `tell::publish`: the
//!   per-process record that `cudabudget status` and the exporter read).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
// Under `cargo test` the hooks are not exported (see hooks/mod.rs), so they look unused.
#![cfg_attr(test, allow(dead_code))]

mod admit;
mod books;
mod capture;
pub use cudabudget_spec::config;
mod driver;
mod enforce;
mod footprint;
mod gate;
mod graphs;
mod hooks;
pub mod ledger;
mod lifecycle;
mod loads;
mod lock;
mod nvml;
mod pools;
pub use cudabudget_spec::quantity;
mod report;
mod runtime;
mod sys;
mod tell;
mod vmm;
mod wait;
