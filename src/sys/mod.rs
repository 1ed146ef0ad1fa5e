//! Thin wrappers over the system, below everything else: the driver, NVML and the
//! system's Zstandard decoder (from our own handles, their calls counted for `fork()`),
//! the one lock kind, futexes, clocks, bounded waits and the log line.

pub mod clock;
pub mod driver;
pub mod foreign;
pub mod futex;
pub mod lock;
pub mod log;
pub mod nvml;
pub mod wait;
pub mod zstd;
