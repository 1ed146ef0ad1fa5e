//! What the library tells: the denial events (`CUDABUDGET_EVENTS`).

pub mod events;
