//! Job budgets (`CUDABUDGET_SCOPE=job:<name>`, or HAMi's shared cache): what users rely
//! on when several processes share one budget. Together they never pass it, a process
//! that exits, is killed, stops or execs gives its share back, a waiting allocation goes
//! through as soon as room comes (in arrival order) and sleeps meanwhile, and a damaged
//! or foreign ledger refuses CUDA with one line instead of admitting past the budget.
//! Each test keeps its job ledgers in a directory of its own (`CUDABUDGET_JOB_DIR`).

mod util;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use util::{GI, MI, Run};

/// A fresh directory for a test's ledgers.
fn job_dir(test: &str) -> String {
    let dir = std::env::temp_dir().join(format!("cudabudget-job-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.to_str().unwrap().to_string()
}

/// NVML listing the process under another pid: nothing but the hooks charges.
fn envs<'a>(dir: &'a str, job: &'a str, limit: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("CUDABUDGET_JOB_DIR", dir),
        ("CUDABUDGET_SCOPE", job),
        ("CUDABUDGET_LIMIT", limit),
        ("FAKE_NVML_PID_OFFSET", "100000"),
        // No fallback place outside the test's directory ($HOME/.cache would be one).
        ("HOME", dir),
        ("XDG_RUNTIME_DIR", ""),
    ]
}

fn command(ops: &[&str], envs: &[(&str, &str)]) -> Command {
    let mut cmd = util::client_command("gpa", ops, envs, Some(&util::lib_path()));
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn spawn(ops: &[&str], envs: &[(&str, &str)]) -> Child {
    command(ops, envs).spawn().expect("spawn client")
}

fn finish(child: Child) -> Run {
    let out = child.wait_with_output().expect("wait client");
    Run {
        lines: String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect(),
        status: out.status,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn client(ops: &[&str], envs: &[(&str, &str)]) -> Run {
    util::run(command(ops, envs))
}

/// Waits until the job's file shows the process's first allocation (the holder is in).
fn settle() {
    std::thread::sleep(Duration::from_millis(300));
}

#[test]
fn processes_of_one_job_share_one_budget() {
    let dir = job_dir("share");
    let e = envs(&dir, "job:train", "1Gi");
    let holder = spawn(&["alloc:700Mi", "sleep:1500"], &e);
    settle();
    let run = client(&["info", "alloc:500Mi", "alloc:300Mi", "phys"], &e);
    let holder = finish(holder);
    assert_eq!(holder.rc("alloc", 0), 0, "{holder:?}");
    assert_eq!(run.num("info", 0, "free"), GI - 700 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 2, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 0, "{run:?}");
    assert!(run.stderr.contains("700.00 MiB in use"), "{}", run.stderr);
}

#[test]
fn a_denial_event_in_a_job_names_the_top_holders() {
    let dir = job_dir("events");
    let events = format!("{dir}/denials.jsonl");
    let mut e = envs(&dir, "job:ev", "1Gi");
    e.push(("CUDABUDGET_EVENTS", events.as_str()));
    let holder = spawn(&["alloc:700Mi", "sleep:1200"], &e);
    settle();
    let run = client(&["alloc:100Mi", "alloc:500Mi"], &e);
    let holder = finish(holder);
    assert_eq!(holder.rc("alloc", 0), 0, "{holder:?}");
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
    let text = std::fs::read_to_string(&events).unwrap();
    let line = text.lines().last().unwrap();
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let top = v["top_holders"].as_array().expect(line);
    assert_eq!(top.len(), 2, "{line}");
    assert_eq!(top[0]["used_bytes"], 700 * MI, "{line}");
    assert_eq!(top[1]["used_bytes"], 100 * MI, "{line}");
    assert_eq!(v["job"], "ev", "{line}");
}

#[test]
fn two_jobs_do_not_affect_each_other() {
    let dir = job_dir("two");
    let holder = spawn(&["alloc:700Mi", "sleep:1200"], &envs(&dir, "job:a", "1Gi"));
    settle();
    let other = client(&["alloc:900Mi"], &envs(&dir, "job:b", "1Gi"));
    let alone = client(&["alloc:900Mi"], &[("CUDABUDGET_LIMIT", "1Gi")]);
    finish(holder);
    assert_eq!(other.rc("alloc", 0), 0, "{other:?}");
    assert_eq!(alone.rc("alloc", 0), 0, "{alone:?}");
}

#[test]
fn racing_processes_never_pass_the_job_budget_together() {
    // Four processes each ask for 64 MiB twenty times; 16 × 64 MiB fill the budget.
    let dir = job_dir("race");
    let e = envs(&dir, "job:race", "1Gi");
    let mut ops = vec!["alloc:64Mi"; 20];
    ops.push("sleep:800");
    let children: Vec<Child> = (0..4).map(|_| spawn(&ops, &e)).collect();
    let runs: Vec<Run> = children.into_iter().map(finish).collect();
    let granted: usize = runs
        .iter()
        .map(|r| {
            r.lines_of("alloc")
                .iter()
                .filter(|l| l.contains("rc=0"))
                .count()
        })
        .sum();
    assert_eq!(granted, 16, "{runs:?}");
}

#[test]
fn a_killed_holders_share_comes_back_within_a_second() {
    let dir = job_dir("kill");
    let e = envs(&dir, "job:k", "1Gi");
    let mut holder = spawn(&["alloc:800Mi", "sleep:30000"], &e);
    settle();
    let before = client(&["alloc:800Mi"], &e);
    assert_eq!(
        before.rc("alloc", 0),
        2,
        "the holder still holds it\n{before:?}"
    );
    holder.kill().unwrap();
    holder.wait().unwrap();
    let t = Instant::now();
    let after = client(&["alloc:800Mi"], &e);
    assert_eq!(after.rc("alloc", 0), 0, "{after:?}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

#[test]
fn a_waiting_allocation_goes_through_when_a_peer_frees_and_times_out_otherwise() {
    let dir = job_dir("wait");
    let e = envs(&dir, "job:w", "1Gi");
    let holder = spawn(&["alloc:700Mi", "sleep:700", "free:0", "sleep:1500"], &e);
    settle();
    let mut waiting = e.clone();
    waiting.push(("CUDABUDGET_ON_EXCEED", "wait:5s"));
    let t = Instant::now();
    let run = client(&["alloc:700Mi"], &waiting);
    let waited = t.elapsed();
    finish(holder);
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert!(waited >= Duration::from_millis(250), "{waited:?}");
    assert!(waited < Duration::from_secs(3), "{waited:?}");

    let holder = spawn(&["alloc:700Mi", "sleep:2000"], &e);
    settle();
    let mut short = e.clone();
    short.push(("CUDABUDGET_ON_EXCEED", "wait:300ms"));
    let t = Instant::now();
    let run = client(&["alloc:700Mi"], &short);
    let waited = t.elapsed();
    finish(holder);
    assert_eq!(run.rc("alloc", 0), 2, "{run:?}");
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
}

#[test]
fn a_waiting_thread_goes_through_when_another_thread_of_its_process_frees() {
    // Process scope: no job; the free of another thread of the process makes room.
    let script = r#"
import ctypes, threading, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
held = ctypes.c_uint64()
assert cuda.cuMemAlloc_v2(ctypes.byref(held), ctypes.c_size_t(700 << 20)) == 0
def free_later():
    assert cuda.cuCtxSetCurrent(ctx) == 0
    time.sleep(0.5)
    assert cuda.cuMemFree_v2(held) == 0
threading.Thread(target=free_later).start()
t = time.time()
p = ctypes.c_uint64()
rc = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(700 << 20))
print(rc, round(time.time() - t, 2))
"#;
    let (ok, out, err) = util::python_under_library(
        script,
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_ON_EXCEED", "wait:5s"),
            ("FAKE_NVML_PID_OFFSET", "100000"),
        ],
    );
    assert!(ok, "{out}\n{err}");
    let mut fields = out.split_whitespace();
    assert_eq!(fields.next(), Some("0"), "{out}\n{err}");
    let waited: f64 = fields.next().unwrap().parse().unwrap();
    assert!((0.3..3.0).contains(&waited), "{out}");
}

#[test]
fn a_request_larger_than_the_budget_or_made_during_a_capture_never_waits() {
    let e = [
        ("CUDABUDGET_LIMIT", "1Gi"),
        ("CUDABUDGET_ON_EXCEED", "wait:5s"),
        ("FAKE_NVML_PID_OFFSET", "100000"),
    ];
    let t = Instant::now();
    let run = util::budget_run("gpa", &["alloc:2Gi"], &e);
    assert_eq!(run.rc("alloc", 0), 2, "{run:?}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // While a stream captures, nobody waits: the 700 MiB are refused at once.
    let t = Instant::now();
    let run = util::budget_run(
        "gpa",
        &["alloc:700Mi", "stream", "capture:0:relaxed", "alloc:700Mi"],
        &e,
    );
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

#[test]
fn a_damaged_or_foreign_ledger_refuses_cuda_with_one_line() {
    let dir = job_dir("corrupt");
    let e = envs(&dir, "job:bad", "1Gi");
    let private = format!("{dir}/cudabudget-{}", unsafe_uid());
    std::fs::create_dir_all(&private).unwrap();
    set_mode(&private, 0o700);
    let path = format!("{private}/job-bad");
    for (what, bytes) in [
        ("truncated", vec![0u8; 100]),
        ("foreign", vec![0x41u8; 1 << 20]),
        ("empty", Vec::new()),
    ] {
        std::fs::write(&path, &bytes).unwrap();
        set_mode(&path, 0o600);
        let run = client(&["info"], &e);
        assert_eq!(run.rc("init", 0), 800, "{what}: {run:?}");
        let lines: Vec<&str> = run
            .stderr
            .lines()
            .filter(|l| l.contains("job ledger"))
            .collect();
        assert_eq!(lines.len(), 1, "{what}: {}", run.stderr);
        assert!(lines[0].contains(&path), "{what}: {}", lines[0]);
        assert_eq!(
            std::fs::read(&path).unwrap(),
            bytes,
            "{what}: the ledger was made again"
        );
    }
    // A ledger of a valid size whose header is damaged.
    let good = job_dir("corrupt-good");
    let ok = client(&["info"], &envs(&good, "job:bad", "1Gi"));
    assert_eq!(ok.rc("init", 0), 0, "{ok:?}");
    let good_path = ledger_file(&good, "bad");
    let mut bytes = std::fs::read(&good_path).unwrap();
    bytes[8] ^= 0xff; // the version
    std::fs::write(&path, &bytes).unwrap();
    set_mode(&path, 0o600);
    let run = client(&["info"], &e);
    assert_eq!(run.rc("init", 0), 800, "{run:?}");
    assert!(run.stderr.contains("layout version"), "{}", run.stderr);
}

#[test]
fn a_ledger_others_may_write_or_another_user_owns_is_passed_over_with_one_line() {
    // Not a ledger to trust: the process keeps a budget (here its own, as the test's
    // job has no other place) and says which file is in the way.
    let dir = job_dir("perm");
    let e = envs(&dir, "job:p", "1Gi");
    let ok = client(&["info"], &e);
    assert_eq!(ok.rc("init", 0), 0, "{ok:?}");
    let path = ledger_file(&dir, "p");
    set_mode(&path, 0o666);
    let run1 = client(&["alloc:700Mi", "alloc:500Mi"], &e);
    assert_eq!(run1.rc("init", 0), 0, "{run1:?}");
    assert_eq!(run1.rc("alloc", 1), 2, "unbudgeted: {run1:?}");
    let named: Vec<&str> = run1.stderr.lines().filter(|l| l.contains(&path)).collect();
    assert_eq!(named.len(), 1, "{}", run1.stderr);
    assert!(named[0].contains("others may write"), "{}", named[0]);
    set_mode(&path, 0o600);
    // Another owner: possible to arrange only as root.
    if unsafe_uid() == 0 {
        let c = std::ffi::CString::new(path.clone()).unwrap();
        // SAFETY: a valid path; 65534 is nobody.
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
        let run2 = client(&["alloc:700Mi", "alloc:500Mi"], &e);
        assert_eq!(run2.rc("init", 0), 0, "{run2:?}");
        assert_eq!(run2.rc("alloc", 1), 2, "unbudgeted: {run2:?}");
        assert!(run2.stderr.contains("uid 65534"), "{}", run2.stderr);
    }
}

#[test]
fn a_thousand_and_twenty_four_processes_join_one_job() {
    let dir = job_dir("many");
    let e = envs(&dir, "job:many", "64Gi");
    let t = Instant::now();
    let mut failures = Vec::new();
    for wave in 0..16 {
        let children: Vec<Child> = (0..64)
            .map(|_| spawn(&["alloc:1Mi", "sleep:50"], &e))
            .collect();
        for run in children.into_iter().map(finish) {
            if run.rc("alloc", 0) != 0 {
                failures.push((wave, run));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
    // They all left: the job holds nothing.
    let after = client(&["info"], &e);
    assert_eq!(
        after.num("info", 0, "free"),
        64 * GI,
        "{after:?} after {:?}",
        t.elapsed()
    );
}

#[test]
fn processes_naming_one_hami_shared_cache_share_one_budget() {
    let dir = job_dir("hami");
    let cache = format!("{dir}/vgpu.cache");
    let e = [
        ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
        ("CUDA_DEVICE_MEMORY_SHARED_CACHE", cache.as_str()),
        ("FAKE_NVML_PID_OFFSET", "100000"),
    ];
    let holder = spawn(&["alloc:700Mi", "sleep:1200"], &e);
    settle();
    let run = client(&["alloc:500Mi", "alloc:300Mi"], &e);
    finish(holder);
    assert_eq!(run.rc("alloc", 0), 2, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 0, "{run:?}");
    assert!(std::path::Path::new(&format!("{cache}.cudabudget")).exists());
}

#[test]
fn sixty_four_processes_started_at_once_all_join() {
    // Informational figure for the README (not a timed assertion): the join, from the
    // library's debug line, for 64 processes started at once.
    let dir = job_dir("joins");
    let mut e = envs(&dir, "job:joins", "8Gi");
    e.push(("CUDABUDGET_LOG", "debug"));
    let children: Vec<Child> = (0..64).map(|_| spawn(&["alloc:1Mi"], &e)).collect();
    let mut micros: Vec<f64> = children
        .into_iter()
        .map(finish)
        .filter_map(|r| {
            let line = r.stderr.lines().find(|l| l.contains("joined job ledger"))?;
            line.split(" in ")
                .nth(1)?
                .trim_end_matches(" µs")
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(micros.len(), 64, "every process joined");
    micros.sort_by(f64::total_cmp);
    println!(
        "join: median {:.1} µs, max {:.1} µs (64 processes at once)",
        micros[32], micros[63]
    );
}

fn unsafe_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn set_mode(path: &str, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn the_debug_log_names_the_job_ledger_joined() {
    // Where a job's books are, for whoever troubleshoots it: CUDABUDGET_LOG=debug says.
    let dir = job_dir("logpath");
    let mut e = envs(&dir, "job:named", "1Gi");
    e.push(("CUDABUDGET_LOG", "debug"));
    let run = client(&["alloc:1Mi"], &e);
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    let path = format!("{dir}/cudabudget-{}/job-named", unsafe_uid());
    assert!(
        run.stderr
            .contains(&format!("joined job ledger {path} in ")),
        "{}",
        run.stderr
    );
}

#[test]
fn a_process_that_exits_gives_its_share_back_at_once() {
    // A member that ends (exit, not killed) leaves the job: the next process sees the
    // whole budget free, before anything looks for dead members.
    let dir = job_dir("leave");
    let e = envs(&dir, "job:leave", "1Gi");
    let first = client(&["alloc:700Mi"], &e);
    assert_eq!(first.rc("alloc", 0), 0, "{first:?}");
    let next = client(&["info"], &e);
    assert_eq!(next.num("info", 0, "free"), GI, "{next:?}");
}

#[test]
fn a_waiting_allocation_goes_through_soon_after_its_holder_is_killed() {
    // A killed holder frees nothing and wakes nobody: the waiter finds it dead (it
    // looks every 100 ms while it waits, at most once a second per job) and goes
    // through long before its patience runs out.
    let dir = job_dir("killwait");
    let e = envs(&dir, "job:kw", "1Gi");
    let mut holder = spawn(&["alloc:800Mi", "sleep:30000"], &e);
    settle();
    let mut waiting = e.clone();
    waiting.push(("CUDABUDGET_ON_EXCEED", "wait:20s"));
    let t = Instant::now();
    let waiter = spawn(&["alloc:800Mi"], &waiting);
    std::thread::sleep(Duration::from_millis(500));
    holder.kill().unwrap();
    holder.wait().unwrap();
    let run = finish(waiter);
    let waited = t.elapsed();
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert!(waited < Duration::from_secs(8), "{waited:?}");
}

/// A process's threads: device 0's primary context current in each, `alloc(n)` and
/// `free(p)` through the driver API.
const THREADS_PRELUDE: &str = r#"
import ctypes, threading, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
MI = 1 << 20
def alloc(n):
    assert cuda.cuCtxSetCurrent(ctx) == 0
    p = ctypes.c_uint64()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))
    return rc, p.value
def free(p):
    assert cuda.cuCtxSetCurrent(ctx) == 0
    assert cuda.cuMemFree_v2(ctypes.c_uint64(p)) == 0
"#;

fn python_threads(script: &str, patience: &str) -> String {
    let (ok, out, err) = util::python_under_library(
        &format!("{THREADS_PRELUDE}{script}"),
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_ON_EXCEED", patience),
            ("FAKE_NVML_PID_OFFSET", "100000"),
        ],
    );
    assert!(ok, "{out}\n{err}");
    out
}

#[test]
fn waiting_threads_are_served_in_arrival_order() {
    // 900 MiB held; a 700 MiB request waits, then a 200 MiB one. When 300 MiB come
    // back the small one would fit, but the large one waits before it: it is not
    // overtaken. When the rest comes back both go, at once.
    let out = python_threads(
        r#"
rc, a = alloc(300 * MI); assert rc == 0
rc, b = alloc(600 * MI); assert rc == 0
got = {}
def want(n, name):
    rc, p = alloc(n)
    got[name] = (rc, time.time())
big = threading.Thread(target=want, args=(700 * MI, "big")); big.start()
time.sleep(0.3)
small = threading.Thread(target=want, args=(200 * MI, "small")); small.start()
time.sleep(0.3)
free(a)
time.sleep(0.7)
freed_all = time.time()
free(b)
big.join(); small.join()
print(got["big"][0], got["small"][0], got["big"][1] - freed_all, got["small"][1] - freed_all)
"#,
        "wait:10s",
    );
    let fields: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(&fields[..2], ["0", "0"], "{out}");
    let big_after: f64 = fields[2].parse().unwrap();
    let small_after: f64 = fields[3].parse().unwrap();
    assert!(small_after >= 0.0, "the small request overtook: {out}");
    assert!((0.0..2.0).contains(&big_after), "{out}");
    assert!(
        small_after < 2.0,
        "the small request waited on after the large one went: {out}"
    );
}

#[test]
fn a_free_wakes_a_waiting_thread_at_once() {
    // Two threads hand 700 MiB of a 1 GiB budget back and forth 60 times: each holds it
    // 10 ms while the other waits for it, and asks again once the other has it. A free
    // wakes the waiter at once; a waiter that found out only at its next look (every
    // 100 ms) would take some 5 s.
    let out = python_threads(
        r#"
cv = threading.Condition()
got = [0]
def player(me):
    for _ in range(30):
        with cv:
            cv.wait_for(lambda: got[0] % 2 == me)
        rc, p = alloc(700 * MI)
        assert rc == 0, rc
        with cv:
            got[0] += 1
            cv.notify_all()
        time.sleep(0.01)
        free(p)
t0 = time.time()
ts = [threading.Thread(target=player, args=(me,)) for me in (0, 1)]
for t in ts: t.start()
for t in ts: t.join()
print(round(time.time() - t0, 2))
"#,
        "wait:20s",
    );
    let took: f64 = out.trim().parse().unwrap();
    assert!(took < 3.5, "{out}");
}

/// Runs `script` (after [`THREADS_PRELUDE`]) as a member of job `name`, in `dir`, with a
/// 1 GiB budget and `patience`; `CHILD` in the script is a program that runs the
/// prelude then `exec(sys.argv[1])`, for other members of the job started with
/// `member(code)` (a `subprocess.Popen` with pipes).
fn python_job(dir: &str, name: &str, script: &str, patience: &str) -> String {
    let members = r#"
import subprocess, sys
CHILD = "import sys\n" + PRELUDE + "\nexec(sys.argv[1])\n"
def member(code):
    return subprocess.Popen([sys.executable, "-c", CHILD, code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)
"#;
    let script = format!("PRELUDE = {THREADS_PRELUDE:?}\n{THREADS_PRELUDE}{members}{script}");
    let scope = format!("job:{name}");
    let (ok, out, err) = util::python_under_library(
        &script,
        &[
            ("CUDABUDGET_JOB_DIR", dir),
            ("CUDABUDGET_SCOPE", scope.as_str()),
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_ON_EXCEED", patience),
            ("FAKE_NVML_PID_OFFSET", "100000"),
        ],
    );
    assert!(ok, "{out}\n{err}");
    out
}

#[test]
fn waiting_members_of_a_job_are_served_in_arrival_order() {
    // As for threads, across the processes of a job: this process holds 900 MiB; one
    // member waits for 700 MiB, then another for 200 MiB. 300 MiB back: the small one
    // still waits behind the large one; the rest back: both go, at once.
    let dir = job_dir("order");
    let out = python_job(
        &dir,
        "order",
        r#"
rc, a = alloc(300 * MI); assert rc == 0
rc, b = alloc(600 * MI); assert rc == 0
want = """
print("asking", flush=True)
rc, p = alloc(int(sys.argv[2]) * MI)
print(rc, time.time(), flush=True)
"""
def ask(n):
    m = subprocess.Popen([sys.executable, "-c", CHILD, want, str(n)], stdout=subprocess.PIPE,
                         text=True, bufsize=1)
    assert m.stdout.readline().strip() == "asking"
    time.sleep(0.3)
    return m
big = ask(700)
small = ask(200)
free(a)
time.sleep(0.7)
freed_all = time.time()
free(b)
(big_rc, big_at), (small_rc, small_at) = [tuple(m.stdout.readline().split()) for m in (big, small)]
big.wait(); small.wait()
print(big_rc, small_rc, float(big_at) - freed_all, float(small_at) - freed_all)
"#,
        "wait:10s",
    );
    let fields: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(&fields[..2], ["0", "0"], "{out}");
    let big_after: f64 = fields[2].parse().unwrap();
    let small_after: f64 = fields[3].parse().unwrap();
    assert!(small_after >= 0.0, "the small request overtook: {out}");
    assert!((0.0..2.0).contains(&big_after), "{out}");
    assert!(small_after < 2.0, "{out}");
}

#[test]
fn a_free_wakes_a_waiting_member_of_the_job_at_once() {
    // Two processes of a job hand 700 MiB of its 1 GiB back and forth 60 times, each
    // holding it 10 ms while the other waits for it. A free wakes the other process at
    // once; finding out at its next look (every 100 ms) would take some 5 s.
    let dir = job_dir("pingpong");
    let out = python_job(
        &dir,
        "pingpong",
        r#"
player = """
def turn(first):
    if not first:
        assert sys.stdin.readline().strip() == "go"
    rc, p = alloc(700 * MI)
    assert rc == 0, rc
    print("go", flush=True)
    time.sleep(0.01)
    free(p)
"""
other = member(player + "\nfor i in range(30): turn(False)\n")
exec(player.replace("sys.stdin.readline()", "other.stdout.readline()").replace(
    'print("go", flush=True)', 'other.stdin.write("go\\n"); other.stdin.flush()'))
t0 = time.time()
for i in range(30):
    turn(i == 0)
assert other.wait() == 0
print(round(time.time() - t0, 2))
"#,
        "wait:20s",
    );
    let took: f64 = out.trim().parse().unwrap();
    assert!(took < 3.5, "{out}");
}

#[test]
fn a_request_for_the_whole_budget_waits_for_it() {
    // 100 MiB held by another thread, freed after half a second: a request for exactly
    // the budget could fit then, so it waits for it rather than being refused at once.
    let out = python_threads(
        r#"
rc, p = alloc(100 * MI); assert rc == 0
def later():
    time.sleep(0.5)
    free(p)
threading.Thread(target=later).start()
t0 = time.time()
rc, q = alloc(1024 * MI)
print(rc, round(time.time() - t0, 2))
"#,
        "wait:5s",
    );
    let mut fields = out.split_whitespace();
    assert_eq!(fields.next(), Some("0"), "{out}");
    let waited: f64 = fields.next().unwrap().parse().unwrap();
    assert!((0.3..3.0).contains(&waited), "{out}");
}

#[test]
fn a_waiting_thread_sleeps() {
    // A wait is a sleep on a futex, not a loop: a thread that waits a second for room
    // that never comes uses next to no CPU time.
    let out = python_threads(
        r#"
rc, p = alloc(700 * MI); assert rc == 0
c0, t0 = time.process_time(), time.time()
rc, q = alloc(700 * MI)
print(rc, round(time.time() - t0, 2), round(time.process_time() - c0, 3))
"#,
        "wait:1s",
    );
    let fields: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(fields[0], "2", "refused in the end: {out}");
    let waited: f64 = fields[1].parse().unwrap();
    let cpu: f64 = fields[2].parse().unwrap();
    assert!(waited >= 1.0, "{out}");
    assert!(
        cpu < 0.25,
        "a wait of {waited} s used {cpu} s of CPU: {out}"
    );
}

#[test]
fn a_waiting_member_of_a_job_sleeps() {
    // As for a process's own budget: a member that waits a second for room in its job
    // sleeps on the job's futex, using next to no CPU time.
    let dir = job_dir("sleeps");
    let out = python_job(
        &dir,
        "sleeps",
        r#"
rc, p = alloc(700 * MI); assert rc == 0
c0, t0 = time.process_time(), time.time()
rc, q = alloc(700 * MI)
print(rc, round(time.time() - t0, 2), round(time.process_time() - c0, 3))
"#,
        "wait:1s",
    );
    let fields: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(fields[0], "2", "refused in the end: {out}");
    let waited: f64 = fields[1].parse().unwrap();
    let cpu: f64 = fields[2].parse().unwrap();
    assert!(waited >= 1.0, "{out}");
    assert!(
        cpu < 0.25,
        "a wait of {waited} s used {cpu} s of CPU: {out}"
    );
}

#[test]
fn a_process_started_with_its_standard_input_closed_joins_its_job() {
    // A daemon may start with descriptor 0 closed: the ledger's file may then be opened
    // as descriptor 0, which is a descriptor like any other.
    use std::os::unix::process::CommandExt;
    let dir = job_dir("nostdin");
    let e = envs(&dir, "job:nostdin", "1Gi");
    let mut cmd = command(&["alloc:1Mi"], &e);
    // SAFETY: close(2) is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::close(0);
            Ok(())
        });
    }
    let run = util::run(cmd);
    assert_eq!(run.rc("init", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
}

#[test]
fn a_member_that_exits_takes_only_its_own_share_out_of_the_job() {
    // One member holds 400 MiB; another allocates, frees, allocates again and exits.
    // The job's books then hold exactly the first member's 400 MiB.
    let dir = job_dir("ownshare");
    let e = envs(&dir, "job:own", "1Gi");
    let holder = spawn(&["alloc:400Mi", "sleep:3000"], &e);
    settle();
    let other = client(&["alloc:100Mi", "free:0", "alloc:300Mi"], &e);
    assert_eq!(other.rc("alloc", 1), 0, "{other:?}");
    let view = client(&["info"], &e);
    finish(holder);
    assert_eq!(view.num("info", 0, "free"), GI - 400 * MI, "{view:?}");
}

#[test]
fn each_members_context_counts_against_the_jobs_budget() {
    // Where nothing measures a context, each member's is charged the estimate (at its
    // first view or allocation), to the job's books as well as its own.
    let dir = job_dir("contexts");
    let mut e = envs(&dir, "job:ctx", "1Gi");
    e.push(("FAKE_NVML_ABSENT", "1"));
    e.push(("CUDABUDGET_CONTEXT_MEMORY", "300Mi"));
    let holder = spawn(&["info", "sleep:2000"], &e);
    settle();
    let view = client(&["info", "alloc:425Mi"], &e);
    finish(holder);
    assert_eq!(view.num("info", 0, "free"), GI - 600 * MI, "{view:?}");
    assert_eq!(view.rc("alloc", 0), 2, "{view:?}");
}

#[test]
fn a_member_whose_memory_went_with_its_context_holds_nothing_in_the_job() {
    // A reset of the primary context frees everything allocated in it: the process's
    // share of the job goes back with it.
    let dir = job_dir("teardown");
    let e = envs(&dir, "job:teardown", "1Gi");
    let holder = spawn(&["alloc:700Mi", "ctxreset:0", "ctx:0", "sleep:1500"], &e);
    std::thread::sleep(Duration::from_millis(600));
    let view = client(&["info"], &e);
    let holder = finish(holder);
    assert_eq!(holder.rc("ctxreset", 0), 0, "{holder:?}");
    assert_eq!(view.num("info", 0, "free"), GI, "{view:?}");
}

#[test]
fn a_forked_child_is_not_its_parents_member() {
    // The child of fork() does not share its parent's slot: when it exits, the
    // parent's share stays in the job's books.
    let dir = job_dir("fork");
    let out = python_job(
        &dir,
        "fork",
        r#"
import os
rc, p = alloc(700 * MI); assert rc == 0
pid = os.fork()
if pid == 0:
    sys.exit(0)
os.waitpid(pid, 0)
view = member("""
f = ctypes.c_size_t(); t = ctypes.c_size_t()
assert cuda.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)) == 0
print(f.value // MI, flush=True)
""")
print(view.stdout.readline().strip())
view.wait()
"#,
        "fail",
    );
    assert_eq!(out.trim(), "324", "{out}");
}

/// The job's ledger file in `dir`, wherever this build keeps it: in the user's own
/// directory there (`cudabudget-<uid>/job-<name>`), or, in builds before that, at
/// `cudabudget-<uid>-job-<name>`.
fn ledger_file(dir: &str, name: &str) -> String {
    let uid = unsafe_uid();
    let private = format!("{dir}/cudabudget-{uid}/job-{name}");
    if std::path::Path::new(&private).exists() {
        private
    } else {
        format!("{dir}/cudabudget-{uid}-job-{name}")
    }
}

/// Writes `bytes` at `offset` of `path` (in place, as a stray write would).
fn write_at(path: &str, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
}

/// Where the admission lock word of device 0 lies in the ledger at `path`, by its
/// layout (the magic's last two bytes are its version).
fn lock_offset(path: &str) -> u64 {
    let head = std::fs::read(path).unwrap();
    match &head[..8] {
        b"CBJOBv01" => 64,
        b"CBJOBv02" => 128,
        other => panic!("unknown layout {other:?}"),
    }
}

/// A Python member of job `name` in `dir` (1 GiB, `patience`), started now: `code` runs
/// after [`THREADS_PRELUDE`]; its standard output is piped.
fn python_member(dir: &str, name: &str, code: &str, patience: &str) -> Child {
    util::isolate(&mut Command::new("python3"))
        .args(["-c", &format!("{THREADS_PRELUDE}{code}")])
        .env("LD_LIBRARY_PATH", util::fake_dir())
        .env("LD_PRELOAD", util::lib_path())
        .env("CUDABUDGET_JOB_DIR", dir)
        .env("CUDABUDGET_SCOPE", format!("job:{name}"))
        .env("CUDABUDGET_LIMIT", "1Gi")
        .env("CUDABUDGET_ON_EXCEED", patience)
        .env("FAKE_NVML_PID_OFFSET", "100000")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs")
}

/// Reads one line of a member's standard output.
fn read_line(child: &mut Child) -> String {
    use std::io::BufRead;
    let mut line = String::new();
    let out = child.stdout.as_mut().unwrap();
    std::io::BufReader::new(out).read_line(&mut line).unwrap();
    line
}

#[test]
fn a_killed_member_not_yet_reaped_gives_its_share_back() {
    // A zombie runs nothing and holds nothing: its share comes back before its parent
    // reaps it (this test reaps it only at the end).
    let dir = job_dir("zombie");
    let e = envs(&dir, "job:z", "1Gi");
    let mut holder = spawn(&["alloc:800Mi", "sleep:30000"], &e);
    settle();
    // SAFETY: a plain signal to our own child, which is not reaped (it stays a zombie).
    unsafe { libc::kill(holder.id() as i32, libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    let after = client(&["alloc:800Mi"], &e);
    let took = t.elapsed();
    holder.wait().unwrap();
    assert_eq!(
        after.rc("alloc", 0),
        0,
        "the zombie's share stayed\n{after:?}"
    );
    assert!(took < Duration::from_secs(3), "{took:?}");
}

#[test]
fn a_member_that_execs_another_program_gives_its_share_back() {
    // After exec the process is another program: what the old image held is gone with
    // its address space, whether or not the new one uses CUDA.
    let dir = job_dir("exec");
    let mut member = python_member(
        &dir,
        "exec",
        r#"
import os
rc, p = alloc(800 * MI); assert rc == 0
print("held", flush=True)
os.execv("/bin/sleep", ["sleep", "30"])
"#,
        "fail",
    );
    assert_eq!(read_line(&mut member).trim(), "held");
    std::thread::sleep(Duration::from_millis(200));
    let e = envs(&dir, "job:exec", "1Gi");
    let t = Instant::now();
    let after = client(&["alloc:800Mi"], &e);
    let took = t.elapsed();
    member.kill().unwrap();
    member.wait().unwrap();
    assert_eq!(
        after.rc("alloc", 0),
        0,
        "the old image's share stayed\n{after:?}"
    );
    assert!(took < Duration::from_secs(3), "{took:?}");
}

#[test]
fn a_member_that_execs_into_another_member_starts_with_nothing_held() {
    // The new image joins the job with the same pid and start time as the old one: it
    // is a new member, and the old image's 800 MiB are not charged to it or the job.
    let dir = job_dir("reexec");
    let mut member = python_member(
        &dir,
        "reexec",
        r#"
import os, sys
if len(sys.argv) < 2:
    rc, p = alloc(800 * MI); assert rc == 0
    os.execv(sys.executable, [sys.executable, "-c", PRELUDE_AGAIN, "again"])
"#
        .replace(
            "PRELUDE_AGAIN",
            &format!(
                "{:?}",
                format!("{THREADS_PRELUDE}\nrc, p = alloc(800 * MI)\nprint(rc, flush=True)\n")
            ),
        )
        .as_str(),
        "fail",
    );
    let line = read_line(&mut member);
    let out = member.wait_with_output().unwrap();
    assert_eq!(
        line.trim(),
        "0",
        "the new image was charged the old one's share\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A Python member of job `name` in `dir` that watches itself: an allocation or free
/// that takes over `limit_s` prints `stuck` and ends the process.
const WATCHDOG: &str = r#"
import os, signal
def timed(f, *a, limit_s=2.0):
    done = threading.Event()
    def watch():
        if not done.wait(limit_s):
            print("stuck", flush=True)
            os._exit(3)
    threading.Thread(target=watch, daemon=True).start()
    t = time.time()
    r = f(*a)
    done.set()
    return r, time.time() - t
"#;

#[test]
fn a_stopped_member_never_holds_up_the_others_frees_or_allocations() {
    // A member allocating and freeing in a loop is stopped (SIGSTOP) a hundred times,
    // at whatever point of its calls the signal finds it; each time, another member
    // allocates and frees: neither waits on the stopped one beyond the bound.
    let dir = job_dir("stopped");
    let mut busy = python_member(
        &dir,
        "stopped",
        r#"
print("busy", flush=True)
while True:
    rc, p = alloc(MI)
    if rc == 0:
        free(p)
"#,
        "fail",
    );
    assert_eq!(read_line(&mut busy).trim(), "busy");
    let pid = busy.id();
    let other = python_member(
        &dir,
        "stopped",
        &format!(
            r#"{WATCHDOG}
busy = {pid}
worst = 0.0
for i in range(100):
    os.kill(busy, signal.SIGSTOP)
    time.sleep(0.002)
    (rc, p), took = timed(alloc, 100 * MI)
    assert rc == 0, rc
    _, took2 = timed(free, p)
    worst = max(worst, took, took2)
    os.kill(busy, signal.SIGCONT)
print("worst", worst, flush=True)
"#
        ),
        "fail",
    );
    let out = other.wait_with_output().unwrap();
    let _ = busy.kill();
    let _ = busy.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    let worst: f64 = text
        .split_whitespace()
        .nth(1)
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("{text}\n{}", String::from_utf8_lossy(&out.stderr)));
    assert!(
        worst < 0.5,
        "an allocation or free waited {worst} s: {text}"
    );
}

#[test]
fn a_lock_word_naming_a_live_member_that_is_not_admitting_holds_nobody_up() {
    // A member killed while it held a device's lock, its slot then reused by a new live
    // member (or a crafted lock=1 on slot 0, which a live member then took): the lock
    // names a live process that is not admitting. Others allocate and free within the
    // bound; they do not spin.
    let dir = job_dir("stale-lock");
    let e = envs(&dir, "job:sl", "1Gi");
    let idle = spawn(&["alloc:1Mi", "sleep:6000"], &e);
    settle();
    let path = ledger_file(&dir, "sl");
    // Slot 0 + 1 (its first generation): the idle member's slot.
    write_at(&path, lock_offset(&path), &1u64.to_le_bytes());
    let mut cmd = command(&["alloc:100Mi", "free:0", "alloc:100Mi"], &e);
    let t = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if t.elapsed() > Duration::from_secs(4) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = t.elapsed();
    // The idle member's own exit gives its share back without waiting on the lock.
    let mut idle = idle;
    let idle_exited = (0..1000).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        idle.try_wait().unwrap().is_some()
    });
    if !idle_exited {
        let _ = idle.kill();
    }
    let _ = idle.wait();
    assert!(status.is_some(), "the member spun on the lock for {took:?}");
    assert!(idle_exited, "the idle member spun on the lock at its exit");
    let run = finish(child);
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 0, "{run:?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
}

#[test]
fn three_waiting_threads_of_one_member_are_all_served_when_room_comes() {
    // 900 MiB held in three pieces; three threads each wait for 300 MiB. Everything
    // comes back: all three go, soon, not one of them and two at the end of their time.
    let dir = job_dir("three");
    let out = python_job(
        &dir,
        "three",
        r#"
held = [alloc(300 * MI)[1] for _ in range(3)]
got = {}
def want(name):
    rc, p = alloc(300 * MI)
    got[name] = (rc, time.time())
ts = [threading.Thread(target=want, args=(i,)) for i in range(3)]
for t in ts:
    t.start()
    time.sleep(0.1)
time.sleep(0.3)
freed = time.time()
for p in held:
    free(p)
for t in ts: t.join()
print(" ".join(f"{got[i][0]}:{got[i][1] - freed:.2f}" for i in range(3)))
"#,
        "wait:8s",
    );
    for field in out.split_whitespace() {
        let (rc, after) = field.split_once(':').unwrap();
        assert_eq!(rc, "0", "{out}");
        let after: f64 = after.parse().unwrap();
        assert!(after < 2.0, "a waiting thread was served late: {out}");
    }
    assert_eq!(out.split_whitespace().count(), 3, "{out}");
}

#[test]
fn a_stopped_waiter_at_the_head_of_the_queue_loses_its_turn() {
    // One member waits first (for 700 MiB) and is stopped; another waits behind it for
    // 200 MiB. When everything comes back, the one behind goes at once: the stopped one
    // does not hold the queue.
    let dir = job_dir("stophead");
    let mut holder = python_member(
        &dir,
        "stophead",
        r#"
import sys
rc, a = alloc(900 * MI); assert rc == 0
print("held", flush=True)
sys.stdin.readline()
free(a)
print("freed", time.time(), flush=True)
time.sleep(3)
"#,
        "fail",
    );
    assert_eq!(read_line(&mut holder).trim(), "held");
    let mut head = python_member(
        &dir,
        "stophead",
        "print('asking', flush=True)\nrc, p = alloc(700 * MI)\nprint(rc, flush=True)\n",
        "wait:20s",
    );
    assert_eq!(read_line(&mut head).trim(), "asking");
    // Long enough for its first call (the library's start) to be made and queued.
    std::thread::sleep(Duration::from_millis(1000));
    // SAFETY: a plain signal to our own child.
    unsafe { libc::kill(head.id() as i32, libc::SIGSTOP) };
    let mut behind = python_member(
        &dir,
        "stophead",
        "print('asking', flush=True)\nrc, p = alloc(200 * MI)\nprint(rc, time.time(), flush=True)\n",
        "wait:6s",
    );
    assert_eq!(read_line(&mut behind).trim(), "asking");
    std::thread::sleep(Duration::from_millis(1000));
    {
        use std::io::Write;
        let stdin = holder.stdin.as_mut().unwrap();
        stdin.write_all(b"free\n").unwrap();
        stdin.flush().unwrap();
    }
    let freed_line = read_line(&mut holder);
    let behind_line = read_line(&mut behind);
    // SAFETY: as above.
    unsafe { libc::kill(head.id() as i32, libc::SIGCONT) };
    let _ = head.kill();
    let _ = head.wait();
    let _ = holder.kill();
    let _ = holder.wait();
    let _ = behind.wait();
    let freed_at: f64 = freed_line
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let mut fields = behind_line.split_whitespace();
    assert_eq!(fields.next(), Some("0"), "{behind_line}");
    let at: f64 = fields.next().unwrap().parse().unwrap();
    assert!(
        at - freed_at < 1.0,
        "the member behind a stopped waiter waited {} s after the free",
        at - freed_at
    );
}

#[test]
fn a_ledger_truncated_under_its_members_neither_kills_them_nor_is_made_anew() {
    // The file is cut to 0 bytes while a member holds 700 MiB of the job's 1 GiB: the
    // member goes on (no SIGBUS), frees what it holds, and is refused anything new with
    // a line naming the file; a process that comes after does not make a fresh ledger
    // next to the live member (which would give each of them the whole budget).
    let dir = job_dir("truncate");
    let e = envs(&dir, "job:t", "1Gi");
    let member = spawn(
        &[
            "alloc:700Mi",
            "sleep:800",
            "free:0",
            "alloc:100Mi",
            "sleep:800",
        ],
        &e,
    );
    settle();
    let path = ledger_file(&dir, "t");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();
    let next = client(&["alloc:500Mi"], &e);
    let member = finish(member);
    assert!(member.status.success(), "the member died: {member:?}");
    assert_eq!(member.rc("free", 0), 0, "{member:?}");
    assert_eq!(
        member.rc("alloc", 1),
        2,
        "admitted from a damaged ledger: {member:?}"
    );
    assert!(
        member.stderr.contains(&path) && member.stderr.contains("damaged"),
        "{}",
        member.stderr
    );
    assert!(
        !next.lines.iter().any(|l| l.starts_with("alloc rc=0")),
        "a fresh ledger beside a live member: {next:?}"
    );
    assert!(next.stderr.contains(&path), "{}", next.stderr);
}

#[test]
fn a_stray_write_of_where_the_jobs_total_was_kept_neither_denies_nor_admits_past_the_budget() {
    // Any process of the user can write the ledger. Layout 1 kept the job's total at
    // byte 56 and trusted it: all ones denied every member for good, zero admitted past
    // the budget. What the job holds is the sum of its members' own shares.
    let dir = job_dir("total");
    let e = envs(&dir, "job:tot", "1Gi");
    let holder = spawn(&["alloc:700Mi", "sleep:2000"], &e);
    settle();
    let path = ledger_file(&dir, "tot");
    write_at(&path, 56, &u64::MAX.to_le_bytes());
    let small = client(&["alloc:100Mi"], &e);
    write_at(&path, 56, &0u64.to_le_bytes());
    let large = client(&["alloc:500Mi"], &e);
    finish(holder);
    assert_eq!(small.rc("alloc", 0), 0, "denied for good: {small:?}");
    assert_eq!(
        large.rc("alloc", 0),
        2,
        "admitted past the budget: {large:?}"
    );
}

#[test]
fn doctor_names_a_damaged_job_ledger() {
    let dir = job_dir("doctor");
    let e = envs(&dir, "job:doc", "1Gi");
    let ok = client(&["info"], &e);
    assert_eq!(ok.rc("init", 0), 0, "{ok:?}");
    let path = ledger_file(&dir, "doc");
    let doctor = |envs: &[(&str, &str)]| -> serde_json::Value {
        let mut cmd = util::cli::cudabudget(&["doctor", "--json"]);
        cmd.envs(envs.iter().copied());
        let out = util::cli::output(&mut cmd);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "job-ledger")
            .cloned()
            .unwrap()
    };
    let whole = doctor(&e);
    assert_eq!(whole["status"], "ok", "{whole:#}");
    write_at(&path, 0, b"garbage!");
    let damaged = doctor(&e);
    assert_eq!(damaged["status"], "fail", "{damaged:#}");
    assert!(
        damaged["summary"].as_str().unwrap().contains(&path),
        "{damaged:#}"
    );
}

#[test]
fn a_member_whose_name_is_not_utf8_keeps_its_share_counted() {
    // A program's name in /proc/<pid>/stat is 15 bytes of its file name, cut wherever
    // they end: here inside a character. The member is alive and its share counts.
    let dir = job_dir("name-not-utf8");
    let e = envs(&dir, "job:n", "1Gi");
    let program = std::path::Path::new(&dir).join("a训练脚本模型");
    std::fs::copy(util::client_bin("gpa"), &program).unwrap();
    let mut holder = util::fixture_command(program.to_str().unwrap(), &e, Some(&util::lib_path()));
    holder
        .args(["gpa", "alloc:800Mi", "sleep:30000"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut holder = holder.spawn().unwrap();
    settle();
    std::thread::sleep(Duration::from_millis(300));
    let stat = std::fs::read(format!("/proc/{}/stat", holder.id())).unwrap();
    assert!(
        std::str::from_utf8(&stat).is_err(),
        "the name is UTF-8 after all"
    );
    // Twice, a second apart: each denial looks for dead members first.
    let first = client(&["alloc:800Mi"], &e);
    std::thread::sleep(Duration::from_millis(1100));
    let second = client(&["alloc:800Mi"], &e);
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert_ne!(
        first.rc("alloc", 0),
        0,
        "admitted past the job's budget\n{first:?}"
    );
    assert_ne!(
        second.rc("alloc", 0),
        0,
        "admitted past the job's budget\n{second:?}"
    );
}
