//! What the benchmarks share: how many runs, and their median and spread.

/// `BENCH_REPS` runs of each measurement (default 5).
pub fn reps() -> usize {
    std::env::var("BENCH_REPS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5)
}

/// The median, the least and the greatest of `v`.
pub fn median_spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}
