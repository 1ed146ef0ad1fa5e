//! cudabudget: hard device-memory budgets for CUDA processes.
//!
//! Loaded with `LD_PRELOAD`, the library interposes the CUDA driver API on every path a
//! program reaches it by (`dlsym`, `cuGetProcAddress`, direct linking), keeps exact
//! accounting of the device memory the process holds, returns
//! `CUDA_ERROR_OUT_OF_MEMORY` before a budget is crossed, and makes the process see its
//! budget as the size of the card. See README.md for use and docs/design.md for the
//! internals.
//!
//! Modules, in layers: each imports only the layers below it, and the imports among the
//! files form no circle.
//! - `hooks`: the exported symbols only, one file per API family; each enters once
//!   (`lifecycle::enter`) and passes the call context down.
//! - `lifecycle`: initialisation (deciding the mode lazily), `fork()`, exit, the end of a
//!   device's last context, the background thread.
//! - `admit`: what a call may take before the driver is asked, and the allocation and
//!   free flows built on that (`admit::flow`); module images (`admit::image`,
//!   `admit::loads`), the footprint, the pools, graph memory, captures and the gate
//!   between stream-ordered allocations and switches of a device's current pool.
//! - `tell`: `tell::report` (what the user is told), `tell::events` (the events file,
//!   `CUDABUDGET_EVENTS`), `tell::publish` (the per-process record that
//!   `cudabudget status` and the exporter read).
//! - `runtime`: the process-wide state (the mode, once decided; the configuration; the
//!   ledger) and which device a call is for.
//! - `books`: state without driver calls: the device ledger and the address tables
//!   (`books::ledger`), the VMM handles (`books::vmm`), a job's shared books
//!   (`books::job`, `CUDABUDGET_SCOPE=job:…`, a mapped file).
//! - `sys`: the real driver and NVML from our own handles, the one lock kind (which a
//!   child of `fork()` takes back without waiting), futexes, clocks, bounded waits, the
//!   log line.
//! - [`quantity`], [`config`] (the `cudabudget-spec` crate): environment → budgets (pure).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
// Under `cargo test` the hooks are not exported (see hooks/mod.rs), so they look unused.
#![cfg_attr(test, allow(dead_code))]

// Every hook turns a panic into an error code (`hooks::guard`), and a decoder's panic on
// a bad module image into "cannot say": with `-C panic=abort` each would end the
// program the library runs in instead.
#[cfg(panic = "abort")]
compile_error!(
    "cudabudget must be built with panic=unwind: it catches its panics at the FFI boundary"
);

mod admit;
mod books;
pub use cudabudget_spec::config;
mod hooks;
#[cfg(test)]
mod layers;
mod lifecycle;
pub use cudabudget_spec::quantity;
mod runtime;
mod sys;
mod tell;
