//! Decisions: what a call may take before the driver is asked, and the flows built on
//! them.

pub mod capture;
pub mod flow;
pub mod footprint;
pub mod gate;
pub mod graphs;
pub mod image;
pub mod loads;
pub mod pools;
