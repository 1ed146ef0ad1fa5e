//! `cargo bench --bench waiting`: how soon a waiting allocation goes through once room
//! comes (`CUDABUDGET_ON_EXCEED=wait:<time>`), against the fake driver.
//!
//! Two threads of a process, then two members of a job, hand 700 MiB of a 1 GiB budget
//! back and forth 60 times (`tests/util/handoff.rs`, as `jobs::waiting`'s tests do),
//! each holding it 10 ms while the other waits for it. A free wakes the waiter at once:
//! a hand-off then costs the 10 ms hold and little more. A waiter that found out only at
//! its next look for room (every 100 ms) would take some 50 ms a hand-off on average.
//! `BENCH_REPS` runs each (default 5); prints medians and spreads.

mod common;
#[path = "../tests/util/mod.rs"]
mod util;

use util::handoff::{HANDOFFS, hand_offs};

fn main() {
    let reps = common::reps();
    let dir = util::binary_dir().join("bench-waiting");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory for the job's ledger");
    let dir = dir.to_str().expect("a UTF-8 path").to_string();
    println!("cudabudget waiting: {HANDOFFS} hand-offs of one block, each held 10 ms, {reps} runs");
    println!("| between | ms a hand-off, median (min..max) | of which beyond the hold |");
    println!("|---|---|---|");
    for (what, job) in [
        ("two threads", None),
        ("two members of a job", Some((dir.as_str(), "bench"))),
    ] {
        let per_handoff: Vec<f64> = (0..reps)
            .map(|_| {
                let (got, took) = hand_offs(job, "wait:20s");
                assert!(
                    got.len() == HANDOFFS && got.iter().all(|g| g.ends_with(":0")),
                    "a hand-off failed: {got:?}"
                );
                took * 1000.0 / HANDOFFS as f64
            })
            .collect();
        let (median, min, max) = common::median_spread(per_handoff);
        println!(
            "| {what} | {median:.1} ({min:.1}..{max:.1}) | {:.1} |",
            median - 10.0
        );
    }
    println!();
    println!("(a waiter woken only by its 100 ms look would add some 50 ms a hand-off)");
}
