//! What the library tells the world about a process.
//!
//! - `publish`: the per-process record that `cudabudget status` and the exporter read.

pub(crate) mod publish;
