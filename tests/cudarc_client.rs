//! A Rust program on `cudarc`, the Rust ecosystem's CUDA crate, under the library: what a
//! Rust user of cudabudget runs. cudarc loads `libcuda` with `dlopen` and each function
//! with `dlsym` (its `dynamic-loading` feature), the path XLA takes too.
//!
//! One binary, two roles (`harness = false`):
//! - `cudarc_client --client SIZE...` is the client: a primary context
//!   (`CudaContext::new`), `mem_get_info`, then for each SIZE a `cuMemAlloc_v2`
//!   (`result::malloc_sync`), all freed (`cuMemFree_v2`), then for each SIZE a
//!   stream-ordered allocation through the safe API (`CudaStream::alloc`:
//!   `cuMemAllocAsync` where the device has memory pools), all dropped
//!   (`cuMemFreeAsync`), then the `cuMemAlloc_v2` round again (`alloc_again`, which
//!   under a budget needs the pool that kept the freed blocks trimmed). One line per
//!   step: `<op> rc=<CUresult> [key=value]...`, then `done`.
//!   `scripts/gpu/rust_client.sh` runs it so on the H200.
//! - without `--client` (as `cargo test` runs it) it checks the client against the fake
//!   driver, with and without the library, and prints `N passed, M failed`.

mod util;

use std::process::ExitCode;

use cudarc::driver::{CudaContext, DriverError, result};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    // cargo-nextest lists a custom harness's tests with `--list`: this binary is one
    // test, `checks` (cargo-mutants runs the suite under nextest).
    if args.iter().any(|a| a == "--list") {
        if !args.iter().any(|a| a == "--ignored") {
            println!("checks: test");
        }
        return ExitCode::SUCCESS;
    }
    if args.get(1).map(String::as_str) == Some("--client") {
        let sizes: Result<Vec<usize>, _> = args[2..].iter().map(|s| s.parse()).collect();
        return match sizes {
            Ok(sizes) => client(&sizes),
            Err(e) => {
                eprintln!("usage: cudarc_client --client BYTES...: {e}");
                ExitCode::from(2)
            }
        };
    }
    checks()
}

fn rc(result: &Result<impl Sized, DriverError>) -> u32 {
    match result {
        Ok(_) => 0,
        Err(DriverError(code)) => *code as u32,
    }
}

fn client(sizes: &[usize]) -> ExitCode {
    let ctx = CudaContext::new(0);
    println!("context rc={}", rc(&ctx));
    let Ok(ctx) = ctx else {
        return ExitCode::FAILURE;
    };
    // The events cudarc records around each use of a buffer are not what is checked here
    // (and the fake driver has none); allocation and free are.
    // SAFETY: one stream, one thread; nothing relies on the events.
    unsafe { ctx.disable_event_tracking() };
    let info = |step: &str| match ctx.mem_get_info() {
        Ok((free, total)) => println!("info rc=0 step={step} free={free} total={total}"),
        Err(e) => println!("info rc={} step={step}", e.0 as u32),
    };
    info("start");

    // The driver API as cudarc's `result` layer calls it.
    sync_round(sizes, "alloc", "free");
    info("freed");

    // The safe API: stream-ordered memory on the context's default stream.
    let stream = ctx.default_stream();
    let mut slices = Vec::new();
    for &size in sizes {
        // SAFETY: the memory is never read.
        let r = unsafe { stream.alloc::<u8>(size) };
        println!("alloc_async rc={} bytes={size}", rc(&r));
        slices.extend(r.ok());
    }
    info("allocated_async");
    drop(slices);
    let r = stream.synchronize().and_then(|()| ctx.check_err());
    println!("free_async rc={}", rc(&r));
    info("freed_async");

    // Again with cuMemAlloc_v2, while the stream-ordered pool may still hold what was
    // freed into it: under a budget, the library trims the pool before it refuses.
    sync_round(sizes, "alloc_again", "free_again");
    info("end");
    println!("done");
    ExitCode::SUCCESS
}

/// `cuMemAlloc_v2` of each size (the ones that succeed held), then `cuMemFree_v2` of each.
fn sync_round(sizes: &[usize], alloc: &str, free: &str) {
    let mut held = Vec::new();
    for &size in sizes {
        // SAFETY: the context is current (CudaContext::new binds it to this thread).
        let r = unsafe { result::malloc_sync(size) };
        println!("{alloc} rc={} bytes={size}", rc(&r));
        held.extend(r.ok());
    }
    if let Ok((free, total)) = result::mem_get_info() {
        println!("info rc=0 step={alloc} free={free} total={total}");
    }
    for ptr in held {
        // SAFETY: a pointer cuMemAlloc_v2 returned, freed once.
        let r = unsafe { result::free_sync(ptr) };
        println!("{free} rc={}", rc(&r));
    }
}

/// What one client run printed, by op.
struct Lines(Vec<String>);

impl Lines {
    fn all(&self, op: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|l| l.split(' ').next() == Some(op))
            .map(String::as_str)
            .collect()
    }
    fn value(line: &str, key: &str) -> Option<u64> {
        line.split(' ')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
    }
    /// `(free, total)` of the `info` line of `step`.
    fn info(&self, step: &str) -> Option<(u64, u64)> {
        let tag = format!("step={step} ");
        let line = self.all("info").into_iter().find(|l| l.contains(&tag))?;
        Some((Self::value(line, "free")?, Self::value(line, "total")?))
    }
    fn rcs(&self, op: &str) -> Vec<u64> {
        self.all(op)
            .into_iter()
            .filter_map(|l| Self::value(l, "rc"))
            .collect()
    }
}

fn run_client(sizes: &[usize], envs: &[(&str, &str)], preload: bool) -> (Lines, String) {
    let exe = std::env::current_exe().expect("current_exe");
    let exe = exe.to_str().expect("a UTF-8 path");
    let lib = preload.then(util::lib_path);
    let mut cmd = util::fixture_command(exe, envs, lib.as_deref());
    cmd.arg("--client").args(sizes.iter().map(usize::to_string));
    let run = util::run(cmd);
    (
        Lines(run.lines),
        format!("{:?}\n{}", run.status, run.stderr),
    )
}

const OOM: u64 = 2; // CUDA_ERROR_OUT_OF_MEMORY

fn checks() -> ExitCode {
    let mut passed = 0;
    let mut failed = 0;
    let mut check = |name: &str, ok: bool, detail: &dyn std::fmt::Debug| {
        if ok {
            passed += 1;
            println!("test cudarc_client::{name} ... ok");
        } else {
            failed += 1;
            println!("test cudarc_client::{name} ... FAILED: {detail:#?}");
        }
    };
    // The first fits a 1 GiB budget, twice over only if the pool gives it back; the second
    // never does.
    let sizes = [768 * MIB, 2 * GIB];

    // Under a 1 GiB budget.
    let (lines, stderr) = run_client(&sizes, &[("CUDABUDGET_LIMIT", "1Gi")], true);
    let seen = (&lines.0, &stderr);
    check(
        "budget_context_and_done",
        lines.rcs("context") == [0] && lines.0.last().is_some_and(|l| l == "done"),
        &seen,
    );
    check(
        "budget_mem_get_info_reads_the_budget",
        lines
            .info("start")
            .is_some_and(|(free, total)| total == GIB as u64 && free <= total),
        &seen,
    );
    check(
        "budget_cuMemAlloc_in_budget_ok_past_it_oom",
        lines.rcs("alloc") == [0, OOM],
        &seen,
    );
    check(
        "budget_mem_get_info_counts_the_allocation",
        match (
            lines.info("start"),
            lines.info("alloc"),
            lines.info("freed"),
        ) {
            (Some((f0, _)), Some((f1, _)), Some((f2, _))) => {
                f1 + 768 * MIB as u64 <= f0 && f2 == f0
            }
            _ => false,
        },
        &seen,
    );
    check("budget_cuMemFree_ok", lines.rcs("free") == [0], &seen);
    check(
        "budget_stream_alloc_in_budget_ok_past_it_oom",
        lines.rcs("alloc_async") == [0, OOM] && lines.rcs("free_async") == [0],
        &seen,
    );
    check(
        "budget_pool_trimmed_before_refusing",
        lines.rcs("alloc_again") == [0, OOM] && lines.rcs("free_again") == [0],
        &seen,
    );
    check(
        "budget_all_given_back",
        lines
            .info("end")
            .zip(lines.info("start"))
            .is_some_and(|((end, _), (start, _))| end == start),
        &seen,
    );

    // The same program without the library: the fake card (80 GiB) and no refusal.
    let (lines, stderr) = run_client(&sizes, &[], false);
    let seen = (&lines.0, &stderr);
    check(
        "native_sees_the_card_and_both_fit",
        lines
            .info("start")
            .is_some_and(|(_, total)| total == 80 * GIB as u64)
            && lines.rcs("alloc") == [0, 0]
            && lines.rcs("alloc_async") == [0, 0]
            && lines.rcs("alloc_again") == [0, 0]
            && lines.0.last().is_some_and(|l| l == "done"),
        &seen,
    );

    println!("\ncudarc_client: {passed} passed, {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
