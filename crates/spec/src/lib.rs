//! What the cudabudget library (the `cdylib`) and its command line share, so that both
//! read the environment, the records and the shared places the same way:
//!
//! - [`quantity`]: `20Gi`, `40%`, HAMi's `1g`.
//! - [`config`]: the environment turned into one validated [`config::Config`].
//! - [`record`]: the layout of the per-process record `status` and the exporter read.
//! - [`job_file`]: the layout of a job's ledger file (library and `doctor`).
//! - [`control`]: a request to change a running process's budget (`cudabudget limit`).
//! - [`doorbell`]: how `cudabudget limit` wakes a user's processes to look at once.
//! - [`futex`]: waits and wakes on words other processes may share.
//! - [`place`]: directories and files in places other users can reach (`/tmp`,
//!   `/dev/shm`, a configured directory), opened without trusting a name.
//!
//! Pure apart from [`place`] (file-system calls) and `Config::from_env`; no driver calls,
//! no threads, no global state.

pub mod config;
pub mod control;
pub mod doorbell;
pub mod futex;
pub mod job_file;
pub mod place;
pub mod quantity;
pub mod record;
