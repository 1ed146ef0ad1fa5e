//! State kept by the library, without driver calls.

pub mod job;
