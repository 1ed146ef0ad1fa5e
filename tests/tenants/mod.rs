//! Tenants: what another user on the same node can do must not harm a budgeted user.
//! Files, directories, links and FIFOs planted in shared places (events, job ledgers,
//! records, the library cache) are passed over, the exporter keeps answering under
//! hostile clients, and a system install budgets a process that dropped `LD_PRELOAD`.
//! These run as two unprivileged users they create, so they need root; otherwise each
//! test prints that it is skipped.

mod events;
mod exporter;
mod job;
mod limit;
mod preload;
mod records;
