//! Install: `cudabudget install` puts the library and the CLI where `LD_PRELOAD` can
//! name them (and refuses places others could change), a CLI alone carries the library,
//! the deploy files (Kubernetes, compose, Slurm, the entrypoint) budget what they run,
//! Ray's recipe budgets actors on a real two-node Ray cluster, and the shipped binaries
//! load on glibc 2.17.

mod deploy;
mod docs;
mod glibc_versions;
mod install_command;
mod ray;
mod slurm;
