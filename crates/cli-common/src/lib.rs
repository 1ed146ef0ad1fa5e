//! What cudabudget's two binaries share: the user's `cudabudget` (`run`, `status`,
//! `limit`, `doctor`, `install`) and the node services' `cudabudget-node` (the device
//! plugin, the webhook, the exporter). Light on purpose: it is compiled into the user's
//! CLI, so it takes nothing beyond `cudabudget-spec`, libc and serde.
//!
//! Neither binary links the library crate (it exports `dlsym` and the driver's names,
//! which would interpose on the binary itself); what they share with it is
//! `cudabudget-spec`.

pub mod figures;
pub mod gpu;
pub mod preload;
pub mod records;
pub mod tell;
