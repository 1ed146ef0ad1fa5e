//! Waiting (`CUDABUDGET_ON_EXCEED=wait:<time>`): a waiting allocation goes through as soon
//! as room comes (a free, a holder killed), waiters are served in arrival order and sleep
//! meanwhile, and a request that can never fit (or is made during a capture) never waits.

use super::*;

#[test]
fn a_waiting_allocation_goes_through_when_a_peer_frees_and_times_out_otherwise() {
    let dir = job_dir("wait");
    let e = envs(&dir, "job:w", "1Gi");
    let mut holder = spawn(&["alloc:700Mi", "sleep:700", "free:0", "sleep:1500"], &e);
    util::wait_for_line(&mut holder, "alloc");
    let mut waiting = e.clone();
    waiting.push(("CUDABUDGET_ON_EXCEED", "wait:5s"));
    let t = Instant::now();
    let run = client(&["alloc:700Mi"], &waiting);
    let waited = t.elapsed();
    finish(holder);
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    // It waited: the free came 700 ms after the holder's allocation.
    assert!(waited >= Duration::from_millis(250), "{waited:?}");

    let holder = Holder::start(&["alloc:700Mi"], &e);
    let mut short = e.clone();
    short.push(("CUDABUDGET_ON_EXCEED", "wait:300ms"));
    let t = Instant::now();
    let run = client(&["alloc:700Mi"], &short);
    let waited = t.elapsed();
    holder.finish();
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
    let (ok, out, err) = crate::util::python_under_library(
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
    assert!(waited >= 0.3, "it did not wait for the free: {out}");
}

#[test]
fn two_threads_waiting_for_one_freed_block_both_go_through_in_turn() {
    // One free makes room for one of them: the other, woken too or beaten to it, waits
    // on until the first gives its block back, well within its patience.
    let script = r#"
import ctypes, threading, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
held = ctypes.c_uint64()
assert cuda.cuMemAlloc_v2(ctypes.byref(held), ctypes.c_size_t(700 << 20)) == 0
results = {}
def waiter(name):
    assert cuda.cuCtxSetCurrent(ctx) == 0
    p = ctypes.c_uint64()
    t = time.time()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(700 << 20))
    results[name] = (rc, time.time() - t)
    if rc == 0:
        time.sleep(0.4)
        assert cuda.cuMemFree_v2(p) == 0
threads = [threading.Thread(target=waiter, args=(n,)) for n in ("a", "b")]
for th in threads:
    th.start()
time.sleep(0.3)
assert cuda.cuMemFree_v2(held) == 0
for th in threads:
    th.join()
print(results["a"][0], results["b"][0], round(max(r[1] for r in results.values()), 2))
"#;
    let (ok, out, err) = crate::util::python_under_library(
        script,
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_ON_EXCEED", "wait:5s"),
            ("FAKE_NVML_PID_OFFSET", "100000"),
        ],
    );
    assert!(ok, "{out}\n{err}");
    let fields: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(fields[..2], ["0", "0"], "{out}\n{err}");
    let waited: f64 = fields[2].parse().unwrap();
    assert!(
        waited >= 0.5,
        "one of them did not wait for the other: {out}"
    );
}

#[test]
fn a_request_larger_than_the_budget_or_made_during_a_capture_never_waits() {
    // A day's patience: a request that waited would run past the client's time limit
    // (`util::run`) and fail the test; one refused at once returns.
    let e = [
        ("CUDABUDGET_LIMIT", "1Gi"),
        ("CUDABUDGET_ON_EXCEED", "wait:24h"),
        ("FAKE_NVML_PID_OFFSET", "100000"),
    ];
    let run = crate::util::budget_run("gpa", &["alloc:2Gi"], &e);
    assert_eq!(run.rc("alloc", 0), 2, "{run:?}");
    // While a stream captures, nobody waits: the 700 MiB are refused at once.
    let run = crate::util::budget_run(
        "gpa",
        &["alloc:700Mi", "stream", "capture:0:relaxed", "alloc:700Mi"],
        &e,
    );
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
}

#[test]
fn a_vmm_creation_or_a_pool_growth_that_does_not_fit_is_refused_at_once_even_when_waiting_is_allowed()
 {
    // Their callers may hold the lock a freeing thread needs (PyTorch's allocator holds
    // its mutex around cuMemCreate and stream-ordered growth): waiting there would only
    // delay the refusal by the whole patience.
    // A day's patience: a request that waited would run past the client's time limit
    // (`util::run`) and fail the test; one refused at once returns.
    let e = [
        ("CUDABUDGET_LIMIT", "1Gi"),
        ("CUDABUDGET_ON_EXCEED", "wait:24h"),
        ("FAKE_NVML_PID_OFFSET", "100000"),
    ];
    let run = crate::util::budget_run("gpa", &["alloc:700Mi", "create:512Mi"], &e);
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("create", 0), 2, "{run:?}");
    let run = crate::util::budget_run("gpa", &["alloc:700Mi", "async:512Mi"], &e);
    assert_eq!(run.rc("async", 0), 2, "{run:?}");
}

#[test]
fn a_waiting_allocation_goes_through_soon_after_its_holder_is_killed() {
    // A killed holder frees nothing and wakes nobody: the waiter finds it dead (it
    // looks every 100 ms while it waits, at most once a second per job) and goes
    // through long before its patience runs out.
    let dir = job_dir("killwait");
    let e = envs(&dir, "job:kw", "1Gi");
    let mut holder = spawn(&["alloc:800Mi", "sleep:30000"], &e);
    util::wait_for_line(&mut holder, "alloc");
    let mut waiting = e.clone();
    waiting.push(("CUDABUDGET_ON_EXCEED", "wait:20s"));
    assert_eq!(waits_begun(&dir, "kw"), 0, "the holder did not wait");
    let waiter = spawn(&["alloc:800Mi"], &waiting);
    until_waits_begun(&dir, "kw", 1);
    holder.kill().unwrap();
    holder.wait().unwrap();
    let run = finish(waiter);
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
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
    assert!(big_after >= 0.0, "{out}");
}

/// Who got the block at each hand-off is the alternation `0 1 0 1 …`, each granted.
fn assert_handed_off_in_turn(got: &[String]) {
    let expected: Vec<String> = (0..util::handoff::HANDOFFS)
        .map(|i| format!("{}:0", i % 2))
        .collect();
    assert_eq!(got, expected, "a waiter was refused or served out of turn");
}

#[test]
fn a_free_hands_the_block_to_the_thread_waiting_for_it() {
    // Two threads hand 700 MiB of a 1 GiB budget back and forth 60 times: each holds it
    // 10 ms while the other waits for it, and asks again once the other has it. Every
    // free lets the waiter through, in turn, well within its patience. (How soon: the
    // wake against the 100 ms look is `cargo bench --bench waiting`'s.)
    let (got, _) = util::handoff::hand_offs(None, "wait:20s");
    assert_handed_off_in_turn(&got);
}

#[test]
fn waiting_members_of_a_job_are_served_in_arrival_order() {
    // As for threads, across the processes of a job: this process holds 900 MiB; one
    // member waits for 700 MiB, then another for 200 MiB (each asks once the one before
    // waits: the queue's ticket in the ledger, a handshake). 300 MiB back: the small one
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
def ask(n, waits):
    m = subprocess.Popen([sys.executable, "-c", CHILD, want, str(n)], stdout=subprocess.PIPE,
                         text=True, bufsize=1)
    assert m.stdout.readline().strip() == "asking"
    until_waits_begun(waits)
    return m
big = ask(700, 1)
small = ask(200, 2)
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
    assert!(big_after >= 0.0, "{out}");
}

#[test]
fn a_free_hands_the_block_to_the_member_of_the_job_waiting_for_it() {
    // As for threads, between two processes of a job: each free of one member lets the
    // other, waiting on the job's futex, through, in turn.
    let dir = job_dir("pingpong");
    let (got, _) = util::handoff::hand_offs(Some((&dir, "pingpong")), "wait:20s");
    assert_handed_off_in_turn(&got);
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
    assert!(waited >= 0.3, "it did not wait for the free: {out}");
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
fn three_waiting_threads_of_one_member_are_all_served_when_room_comes() {
    // 900 MiB held in three pieces; three threads each wait for 300 MiB (a day's
    // patience). Everything comes back: all three go, not one of them and two at the end
    // of their time (which would run past the script's time limit and fail the test).
    let dir = job_dir("three");
    let out = python_job(
        &dir,
        "three",
        r#"
held = [alloc(300 * MI)[1] for _ in range(3)]
got = {}
def want(name):
    rc, p = alloc(300 * MI)
    got[name] = rc
ts = [threading.Thread(target=want, args=(i,)) for i in range(3)]
for t in ts:
    t.start()
until_waits_begun(3)
for p in held:
    free(p)
for t in ts: t.join()
print(" ".join(str(got[i]) for i in range(3)))
"#,
        "wait:24h",
    );
    assert_eq!(
        out.split_whitespace().collect::<Vec<_>>(),
        ["0", "0", "0"],
        "{out}"
    );
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
    // Stopped once queued, not before.
    until_waits_begun(&dir, "stophead", 1);
    // SAFETY: a plain signal to our own child.
    unsafe { libc::kill(head.id() as i32, libc::SIGSTOP) };
    let mut behind = python_member(
        &dir,
        "stophead",
        "print('asking', flush=True)\nrc, p = alloc(200 * MI)\nprint(rc, time.time(), flush=True)\n",
        "wait:6s",
    );
    assert_eq!(read_line(&mut behind).trim(), "asking");
    until_waits_begun(&dir, "stophead", 2);
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
