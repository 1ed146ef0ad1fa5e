//! What the library tells the world about a process.
//!
//! - `events`: one JSON line per denial in `CUDABUDGET_EVENTS`, written off the
//!   allocating thread.
//! - `publish`: the per-process record that `cudabudget status` and the exporter read.

pub mod events;
pub(crate) mod publish;
pub mod report;
