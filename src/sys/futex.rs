//! Futexes on words that other processes may share: the command line's and ours are one
//! ([`cudabudget_spec::futex`]).

pub use cudabudget_spec::futex::{wait, wake_all};
