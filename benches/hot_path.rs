//! `cargo bench`: what the library adds to the allocation hot paths, measured against the
//! fake driver in one run, with and without the library, interleaved.
//!
//! Runs `scripts/gpu/bench/driver_bench.c` (built by the dev-dependency
//! `cudabudget-fake-driver`, against nothing: it resolves the driver as cudart does) on
//! 1, 2 and 4 threads, `BENCH_REPS` times each way (default 5), and prints medians and
//! spreads. It also checks that a
//! function the library does not wrap resolves to the driver's own code.
//!
//! The fake driver is not the real one (its calls cost tens of nanoseconds, not
//! microseconds), so the deltas here are the library's own cost; the H200 figures come
//! from `scripts/gpu/bench/run_bench.sh`.

mod common;
#[path = "../tests/util/mod.rs"]
mod util;

use std::process::Command;

const METRICS: &[(&str, &str)] = &[
    ("sync_4k_ns", "cuMemAlloc+cuMemFree, 1 thread (ns/pair)"),
    (
        "async_1t_ns",
        "cuMemAllocAsync+cuMemFreeAsync, 1 thread (ns/pair)",
    ),
    (
        "sync_mt_ns_per_pair_per_thread",
        "cuMemAlloc+cuMemFree, each of N threads (ns/pair)",
    ),
    (
        "async_16t_ns_per_pair_per_thread",
        "cuMemAllocAsync+cuMemFreeAsync, each of N threads (ns/pair)",
    ),
    ("meminfo_ns", "cuMemGetInfo (ns/call)"),
    ("untouched_ns", "cuCtxGetDevice, not wrapped (ns/call)"),
];

fn field<'a>(json: &'a str, key: &str) -> Option<&'a str> {
    let start = json.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &json[start..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    Some(rest[..end].trim_matches('"'))
}

fn run(threads: u32, preload: bool) -> String {
    let mut cmd = Command::new(cudabudget_fake_driver::FAKE_DRIVER_BENCH);
    cmd.args(["--scale", "0.5", "--threads", &threads.to_string()])
        .env("LD_LIBRARY_PATH", util::fake_dir())
        .env_remove("LD_PRELOAD");
    if preload {
        cmd.env("LD_PRELOAD", util::lib_path())
            .env("CUDABUDGET_LIMIT", "100Gi");
    }
    let out = cmd.output().expect("driver_bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "driver_bench failed: {stdout}");
    let json = stdout.lines().last().unwrap_or_default().to_string();
    assert_eq!(field(&json, "errors"), Some(""), "{json}");
    json
}

fn main() {
    let reps = common::reps();
    println!("cudabudget hot path against the fake driver: {reps} interleaved runs each way");
    println!("| threads | metric | native median (min..max) | budget median (min..max) | delta |");
    println!("|---|---|---|---|---|");
    for threads in [1u32, 2, 4] {
        let (mut native, mut budget) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            native.push(run(threads, false));
            budget.push(run(threads, true));
        }
        let last = budget.last().expect("at least one run");
        // The proof that untouched calls cost nothing: they are the driver's own code.
        assert_eq!(
            field(last, "untouched_owner"),
            Some("libcuda.so.1"),
            "{last}"
        );
        assert_eq!(
            field(last, "alloc_owner"),
            Some("libcudabudget.so"),
            "{last}"
        );
        // What the GPU runs report as preloaded, whatever the library's file is named.
        assert_eq!(field(last, "preloaded"), Some("true"), "{last}");
        let alone = native.last().expect("at least one run");
        assert_eq!(field(alone, "preloaded"), Some("false"), "{alone}");
        for &(key, label) in METRICS {
            if threads > 1 && !key.contains("_mt_") && !key.contains("16t") {
                continue;
            }
            if threads == 1 && (key.contains("_mt_") || key.contains("16t")) {
                continue;
            }
            let values = |runs: &[String]| -> Vec<f64> {
                runs.iter()
                    .filter_map(|j| field(j, key)?.parse().ok())
                    .collect()
            };
            let (nm, nlo, nhi) = common::median_spread(values(&native));
            let (bm, blo, bhi) = common::median_spread(values(&budget));
            println!(
                "| {threads} | {label} | {nm:.1} ({nlo:.1}..{nhi:.1}) | {bm:.1} ({blo:.1}..{bhi:.1}) | {:+.1} |",
                bm - nm
            );
        }
    }
    // In one process under the library, the hooks against the driver's own functions in
    // alternating blocks: the most precise figure (no process-to-process noise).
    println!();
    println!(
        "In-process A/B under the library (1 thread, {reps} runs, each the median of 32 alternating blocks):"
    );
    println!("| call | hook median (min..max) | driver's own median (min..max) | added |");
    println!("|---|---|---|---|");
    let runs: Vec<String> = (0..reps).map(|_| run(1, true)).collect();
    for (label, hook, native) in [
        (
            "cuMemAllocAsync+cuMemFreeAsync pair",
            "ab_async_hook_ns",
            "ab_async_native_ns",
        ),
        (
            "cuMemAlloc+cuMemFree 4 KiB pair",
            "ab_sync_hook_ns",
            "ab_sync_native_ns",
        ),
        ("cuMemGetInfo", "ab_meminfo_hook_ns", "ab_meminfo_native_ns"),
    ] {
        let values = |key: &str| -> Vec<f64> {
            runs.iter()
                .filter_map(|j| field(j, key)?.parse().ok())
                .collect()
        };
        let (hm, hlo, hhi) = common::median_spread(values(hook));
        let (nm, nlo, nhi) = common::median_spread(values(native));
        println!(
            "| {label} | {hm:.1} ({hlo:.1}..{hhi:.1}) | {nm:.1} ({nlo:.1}..{nhi:.1}) | {:+.1} ns |",
            hm - nm
        );
    }
    println!(
        "untouched functions resolve to libcuda.so.1 under the library: the driver's own pointer, +0 ns by construction"
    );
    let valgrind = Command::new("valgrind").arg("--version").output();
    if !valgrind.is_ok_and(|o| o.status.success()) {
        println!();
        println!("(valgrind not found: instructions and cache lines per pair not counted)");
        return;
    }
    instructions();
    cache_lines();
}

/// `pair_loop ARGS` under valgrind with `tool` (its options), through the library on the
/// fake driver; what valgrind reports (its standard error).
fn pair_loop_under(tool: &[&str], args: &[&str]) -> String {
    let out = Command::new("valgrind")
        .args(tool)
        .arg(cudabudget_fake_driver::FAKE_PAIR_LOOP)
        .args(args)
        .env("LD_LIBRARY_PATH", util::fake_dir())
        .env("LD_PRELOAD", util::lib_path())
        .env("CUDABUDGET_LIMIT", "100Gi")
        .output()
        .expect("valgrind runs");
    assert!(out.status.success(), "pair_loop {args:?} failed");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Instructions the hooks add per pair, counted by callgrind (exact, unlike time on a
/// shared machine): the same loop of N and 2N pairs through the hooks and through the
/// driver's own functions, in one process each; the difference of differences over N.
/// The background thread raises the footprint's routine flag by the clock, and the
/// loop's thread then takes one slower admission: over 100 000 pairs that moves the
/// figure by less than one (over 10 000 it moved it by two or three).
fn instructions() {
    let count = |arm: &str, kind: &str, n: u64| -> f64 {
        // Only what the program's main thread runs inside `main`: the library's
        // background thread wakes by the clock, and valgrind's clock is slow, so
        // counting it would make the figure depend on the machine's speed.
        let tool = [
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            "--collect-atstart=no",
            "--toggle-collect=main",
        ];
        let log = pair_loop_under(&tool, &[arm, kind, &n.to_string()]);
        let collected = log
            .lines()
            .find_map(|l| l.split("Collected : ").nth(1))
            .expect("callgrind reports what it collected");
        collected.trim().parse().expect("a count")
    };
    const N: u64 = 100_000;
    println!();
    println!(
        "Instructions per pair (callgrind, {N} and {} pairs):",
        2 * N
    );
    println!("| pair | driver's own | through the hooks | added |");
    println!("|---|---|---|---|");
    for kind in ["async", "sync"] {
        let per_pair = |arm| (count(arm, kind, 2 * N) - count(arm, kind, N)) / N as f64;
        let (driver, hook) = (per_pair("driver"), per_pair("hook"));
        println!(
            "| {kind} 4 KiB | {driver:.0} | {hook:.0} | {:+.0} |",
            hook - driver
        );
    }
}

/// Cache lines of data the hooks miss per pair when nothing of theirs is left in cache: a
/// model of the real driver's work between two calls (its own threads and data evict
/// ours), where each such line costs a trip to memory. `pair_loop … evict` reads 4 MiB
/// before every call, cachegrind simulates fixed caches (32 KiB L1, 2 MiB last level),
/// and the figure is the difference of differences of the last level's data misses, as
/// [`instructions`]: the median of three runs (the background thread's wake-ups move
/// one by a line or two).
fn cache_lines() {
    let misses = |arm: &str, kind: &str, n: u64| -> f64 {
        let tool = [
            "--tool=cachegrind",
            "--cache-sim=yes",
            "--cachegrind-out-file=/dev/null",
            "--I1=32768,8,64",
            "--D1=32768,8,64",
            "--LL=2097152,16,64",
        ];
        let log = pair_loop_under(&tool, &[arm, kind, &n.to_string(), "evict"]);
        let line = log
            .lines()
            .find_map(|l| l.split("LLd misses:").nth(1))
            .expect("cachegrind reports the last level's data misses");
        let total = line.split('(').next().unwrap_or_default();
        total.trim().replace(',', "").parse().expect("a count")
    };
    const N: u64 = 1_000;
    // The 4 MiB read before each of a pair's two calls, a line at a time.
    const SWEEP_LINES: f64 = (2 * (4 << 20) / 64) as f64;
    println!();
    println!(
        "Data cache lines missed per pair with 4 MiB read before each call (cachegrind, {N} and {} pairs, median of 3):",
        2 * N
    );
    println!("| pair | driver's own | through the hooks | added |");
    println!("|---|---|---|---|");
    for kind in ["async", "sync"] {
        let per_pair =
            |arm| (misses(arm, kind, 2 * N) - misses(arm, kind, N)) / N as f64 - SWEEP_LINES;
        // The median of three, each arm in turn: one run moves by a line or two.
        let runs: Vec<(f64, f64)> = (0..3)
            .map(|_| (per_pair("driver"), per_pair("hook")))
            .collect();
        let median = |xs: Vec<f64>| common::median_spread(xs).0;
        let driver = median(runs.iter().map(|r| r.0).collect());
        let hook = median(runs.iter().map(|r| r.1).collect());
        let added = median(runs.iter().map(|r| r.1 - r.0).collect());
        println!("| {kind} 4 KiB | {driver:.1} | {hook:.1} | {added:+.1} |");
    }
}
