//! Allocation paths: every way a program can get device memory is counted against its
//! budget, and given back when it is freed. Synchronous, pitched and managed
//! allocations, arrays, VMM (`cuMemCreate` and its mappings), stream-ordered allocations
//! and their pools (the pools' reserve, the credit a thread keeps, pools the program
//! creates), and graphs (memory nodes, free nodes, trims); and a refusal by the driver,
//! or a race between threads, never leaves the books wrong.

mod graphs;
mod stream_ordered;
mod synchronous;
