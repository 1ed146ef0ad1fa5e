//! Budgets: what a user relies on when they set one. An allocation that would cross the
//! budget is refused with `CUDA_ERROR_OUT_OF_MEMORY` and one line saying why, frees make
//! room again, every allocation call counts, per-device budgets and percentages mean what
//! they say, HAMi-core's variables budget too (the smaller budget wins), and a variable
//! the library cannot honour refuses CUDA with one line instead of running unbudgeted.

mod bad_config;
mod enforced;
mod observe;
mod sources;
