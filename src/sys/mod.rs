//! Thin wrappers over the system: clocks and futexes.

pub mod clock;
pub mod futex;
