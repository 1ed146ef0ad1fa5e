//! State kept by the library, without driver calls: the per-device ledger and the
//! address tables, the VMM handles' books, a job's shared books.

pub mod job;
pub mod ledger;
pub mod vmm;
