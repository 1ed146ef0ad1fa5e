//! Decisions: what a call may take before the driver is asked.

pub mod image;
