//! The budget decisions of `src/enforce.rs`, each pinned by what a program sees: the
//! books (`cuMemGetInfo`) match what it holds, memory that fits is never refused, and a
//! denial comes exactly when the budget is reached. Written against the mutants that
//! `cargo mutants -f src/enforce.rs` found uncaught (see docs/mutants/enforce.md).

mod util;

use util::{GI, MI, Run, budget_run};

/// NVML is made to list this process under another pid, so the library never re-reads
/// its footprint: the books show exactly what the hooks tracked, however slowly the test
/// runs (a re-read would hide an under-charge after a second).
const NO_REREAD: (&str, &str) = ("FAKE_NVML_PID_OFFSET", "1000000");

/// Runs the client (`gpa` mode) under the library, without footprint re-reads.
fn budget(ops: &[&str], envs: &[(&str, &str)]) -> Run {
    let mut all = envs.to_vec();
    all.push(NO_REREAD);
    budget_run("gpa", ops, &all)
}

/// Runs a Python `ctypes` program against the fake driver under the library. `{PRELUDE}`
/// in a script stands for the driver initialised, device 0's primary context current
/// (`ctx`), `Props` (`CUmemPoolProps`) and a few helpers.
fn python(script: &str, envs: &[(&str, &str)]) -> String {
    let script = script.replace("{PRELUDE}", PRELUDE);
    let mut all = vec![NO_REREAD];
    all.extend_from_slice(envs);
    let (ok, stdout, stderr) = util::python_under_library(&script, &all);
    assert!(
        ok,
        "the script failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stdout
}

const PRELUDE: &str = r#"import ctypes, threading
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
class Props(ctypes.Structure):
    _fields_ = [("alloc_type", ctypes.c_int), ("handle_types", ctypes.c_int),
                ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                ("win32", ctypes.c_void_p), ("max_size", ctypes.c_size_t),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 54)]
MI = 1 << 20
def books(budget):
    f = ctypes.c_size_t(); t = ctypes.c_size_t()
    assert cuda.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)) == 0
    return (budget - f.value) // MI
def alloc_async(n, pool=None):
    p = ctypes.c_uint64()
    if pool is None:
        rc = cuda.cuMemAllocAsync(ctypes.byref(p), ctypes.c_size_t(n), None)
    else:
        rc = cuda.cuMemAllocFromPoolAsync(ctypes.byref(p), ctypes.c_size_t(n), pool, None)
    return rc, p.value
def alloc(n):
    p = ctypes.c_uint64()
    return cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), p.value
def free_async(p):
    return cuda.cuMemFreeAsync(ctypes.c_uint64(p), None)
"#;

/// The value of `key=` among the `key=value` words of `out`.
fn value(out: &str, key: &str) -> i64 {
    let prefix = format!("{key}=");
    out.split_whitespace()
        .find_map(|w| w.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no {key}= in\n{out}"))
        .parse()
        .unwrap_or_else(|_| panic!("{key}= is not a number in\n{out}"))
}

/// `cuMemAllocPitch` is reserved at a 512-byte pitch, then charged at the pitch the
/// driver chose, wider or narrower; the free gives back exactly that.
#[test]
fn a_pitched_allocation_is_charged_at_the_drivers_pitch() {
    for (align, pitch) in [("1024", 1024), ("256", 256), ("512", 512)] {
        let run = budget(
            &["pitch:100:1024", "info", "free:0", "info"],
            &[
                ("CUDABUDGET_LIMIT", "1Gi"),
                ("FAKE_CUDA_PITCH_ALIGN", align),
            ],
        );
        run.assert_completed();
        assert_eq!(run.num("pitch", 0, "pitch"), pitch, "{}", run.dump());
        assert_eq!(
            run.num("info", 0, "free"),
            GI - pitch * 1024,
            "align {align}: charged at the driver's pitch\n{}",
            run.dump()
        );
        assert_eq!(
            run.num("info", 1, "free"),
            GI,
            "align {align}\n{}",
            run.dump()
        );
    }
}

/// A pitched allocation wider than the estimate still cannot take the budget past its
/// end: the next allocation sees the real charge.
#[test]
fn a_wider_pitch_counts_against_the_next_allocation() {
    // 100 B rows at a 1024 B pitch: 512 MiB charged, not the 256 MiB estimate.
    let run = budget(
        &["pitch:100:524288", "alloc:600Mi", "alloc:500Mi"],
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("FAKE_CUDA_PITCH_ALIGN", "1024"),
        ],
    );
    run.assert_completed();
    assert_eq!(run.rc("pitch", 0), 0, "{}", run.dump());
    assert_eq!(
        run.rc("alloc", 0),
        2,
        "512 + 600 MiB > 1 GiB\n{}",
        run.dump()
    );
    assert_eq!(run.rc("alloc", 1), 0, "512 + 500 MiB fits\n{}", run.dump());
}

/// A graph launched into a capture runs nothing (it becomes a node of the captured
/// graph): the budget neither admits nor refuses it, the driver answers (the fake: 801).
/// Outside a capture the same launch is refused.
#[test]
fn a_graph_launched_into_a_capture_is_the_drivers_business() {
    let run = budget(
        &[
            "stream",
            "graph",
            "memnode:0:2Gi",
            "instantiate:0",
            "capture:0:relaxed",
            "launch:0:0",
            "endcapture:0",
            "launch:0:0",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    run.assert_completed();
    assert_eq!(run.rc("launch", 0), 801, "{}", run.dump());
    assert_eq!(run.rc("launch", 1), 2, "{}", run.dump());
}

/// `cuDeviceGraphMemTrim` gives the graph reserve back to the driver, and to the budget.
#[test]
fn a_graph_memory_trim_gives_the_reserve_back() {
    let run = budget(
        &[
            "stream",
            "graph",
            "memnode:0:256Mi",
            "instantiate:0",
            "launch:0:0",
            "info",
            "freeasyncon:0:0",
            "streamsync:0",
            "info",
            "graphtrim:0",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    run.assert_completed();
    assert_eq!(run.num("info", 0, "free"), GI - 256 * MI, "{}", run.dump());
    assert_eq!(
        run.num("info", 1, "free"),
        GI - 256 * MI,
        "the reserve stays until trimmed\n{}",
        run.dump()
    );
    assert_eq!(run.num("info", 2, "free"), GI, "{}", run.dump());
}

/// A pool the program created and destroyed with nothing live gives its reserve back;
/// one destroyed with a block still live keeps it (the driver does too).
#[test]
fn a_destroyed_created_pool_gives_back_its_reserve_when_empty() {
    let out = python(
        r#"{PRELUDE}
pool = ctypes.c_void_p()
assert cuda.cuMemPoolCreate(ctypes.byref(pool), ctypes.byref(Props(1, 0, 1, 0))) == 0
rc, p = alloc_async(100 * MI, pool); assert rc == 0
print("held=%d" % books(1024 * MI))
assert free_async(p) == 0
assert cuda.cuMemPoolDestroy(pool) == 0
print("empty=%d" % books(1024 * MI))
pool = ctypes.c_void_p()
assert cuda.cuMemPoolCreate(ctypes.byref(pool), ctypes.byref(Props(1, 0, 1, 0))) == 0
rc, p = alloc_async(100 * MI, pool); assert rc == 0
assert cuda.cuMemPoolDestroy(pool) == 0
print("live=%d" % books(1024 * MI))
"#,
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    assert_eq!(value(&out, "held"), 128, "{out}");
    assert_eq!(value(&out, "empty"), 0, "{out}");
    assert_eq!(value(&out, "live"), 128, "{out}");
}

/// Credit a thread kept for itself (its stream-ordered frees) goes back when the thread
/// ends: afterwards the whole budget can be allocated again. (The client's thread is
/// joined with `pthread_join`, which returns after its key destructors ran.)
#[test]
fn the_credit_of_an_ended_thread_is_not_lost() {
    for _ in 0..3 {
        let run = budget(
            &["asyncrelay:1:1:4Mi", "info", "alloc:48Mi"],
            &[("CUDABUDGET_LIMIT", "64Mi")],
        );
        run.assert_completed();
        assert_eq!(run.num("asyncrelay", 0, "ok"), 1, "{}", run.dump());
        assert_eq!(
            run.num("info", 0, "free"),
            32 * MI,
            "the pool's reserve\n{}",
            run.dump()
        );
        assert_eq!(
            run.rc("alloc", 0),
            0,
            "48 MiB fit once the pool is trimmed\n{}",
            run.dump()
        );
    }
}

/// A graph's free node frees its outside block when the graph is launched, not when it
/// is uploaded: until then the block stays charged and the budget holds.
#[test]
fn a_graph_free_node_frees_at_launch_not_at_upload() {
    let run = budget(
        &[
            "alloc:512Mi",
            "stream",
            "graph",
            "freenode:0:0",
            "instantiate:0",
            "upload:0:0",
            "info",
            "alloc:600Mi",
            "launch:0:0",
            "info",
            "alloc:600Mi",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    run.assert_completed();
    assert_eq!(run.rc("upload", 0), 0, "{}", run.dump());
    assert_eq!(run.num("info", 0, "free"), GI - 512 * MI, "{}", run.dump());
    assert_eq!(
        run.rc("alloc", 1),
        2,
        "512 + 600 MiB > 1 GiB\n{}",
        run.dump()
    );
    assert_eq!(run.rc("launch", 0), 0, "{}", run.dump());
    assert_eq!(run.num("info", 1, "free"), GI, "{}", run.dump());
    assert_eq!(run.rc("alloc", 2), 0, "{}", run.dump());
}

/// One thread that frees and allocates stream-ordered blocks again and again (its own
/// credit, the fast path) gets exactly what the budget holds, no more, round after
/// round; once it has freed everything and trimmed the pool, the books are back to zero
/// and the whole budget fits in one allocation.
#[test]
fn a_thread_reusing_its_own_credit_gets_exactly_the_budget() {
    let mut ops: Vec<String> = vec!["async:4Mi".into(), "freeasync:0".into()];
    for round in 0..2 {
        ops.extend((0..20).map(|_| "async:4Mi".to_string()));
        ops.push("phys".into());
        ops.extend((1..=16).map(|k| format!("freeasync:{}", k + 16 * round)));
    }
    ops.extend(["info", "trim:0", "info", "alloc:64Mi"].map(String::from));
    let ops: Vec<&str> = ops.iter().map(String::as_str).collect();
    let run = budget(&ops, &[("CUDABUDGET_LIMIT", "64Mi")]);
    run.assert_completed();
    for round in 0..2 {
        let granted = (1..=20)
            .filter(|&k| run.rc("async", k + 20 * round) == 0)
            .count();
        assert_eq!(
            granted,
            16,
            "round {round}: 64 MiB hold 16 blocks of 4 MiB\n{}",
            run.dump()
        );
        assert!(run.num("phys", round, "peak") <= 64 * MI, "{}", run.dump());
    }
    for k in 0..33 {
        assert_eq!(run.rc("freeasync", k), 0, "{}", run.dump());
    }
    assert_eq!(
        run.num("info", 0, "free"),
        0,
        "the pool keeps its reserve\n{}",
        run.dump()
    );
    assert_eq!(run.num("info", 1, "free"), 64 * MI, "{}", run.dump());
    assert_eq!(run.rc("alloc", 0), 0, "{}", run.dump());
}

/// Credit a thread kept from before its context was reset belongs to books that are
/// gone: it is never spent, and credit given after the reset is not lost with it. The
/// budget holds exactly as many blocks as before, and the books return to zero.
#[test]
fn credit_from_before_a_context_reset_is_void() {
    let mut ops: Vec<String> = ["async:4Mi", "freeasync:0", "ctxreset:0", "ctx:0"]
        .map(String::from)
        .to_vec();
    ops.extend((0..20).map(|_| "async:4Mi".to_string()));
    ops.push("phys".into());
    ops.extend((1..=16).map(|k| format!("freeasync:{k}")));
    ops.extend(["trim:0", "info"].map(String::from));
    let ops: Vec<&str> = ops.iter().map(String::as_str).collect();
    let run = budget(&ops, &[("CUDABUDGET_LIMIT", "64Mi")]);
    run.assert_completed();
    let granted = (1..=20).filter(|&k| run.rc("async", k) == 0).count();
    assert_eq!(
        granted,
        16,
        "64 MiB hold 16 blocks of 4 MiB\n{}",
        run.dump()
    );
    assert!(run.num("phys", 0, "peak") <= 64 * MI, "{}", run.dump());
    assert_eq!(run.num("info", 0, "free"), 64 * MI, "{}", run.dump());
}

/// Credit a thread kept on one device is never spent on another: device 1's pool is
/// charged to device 1.
#[test]
fn credit_kept_for_one_device_is_not_spent_on_another() {
    let run = budget(
        &[
            "async:4Mi",
            "freeasync:0",
            "ctx:1",
            "async:4Mi",
            "info",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "64Mi"), ("FAKE_CUDA_DEVICES", "2")],
    );
    run.assert_completed();
    assert_eq!(run.rc("async", 1), 0, "{}", run.dump());
    assert_eq!(run.num("phys", 0, "used"), 32 * MI, "{}", run.dump());
    assert_eq!(
        run.num("info", 0, "free"),
        32 * MI,
        "device 1's pool reserve is charged to device 1\n{}",
        run.dump()
    );
}

/// A thread that frees a block another thread allocated, and never allocates itself,
/// keeps no credit (it has no exit handler to give it back): the credit goes to the
/// shared books at once, and the whole budget can be used again.
#[test]
fn a_thread_that_only_frees_keeps_no_credit() {
    let out = python(
        r#"{PRELUDE}
rc, p = alloc_async(4 * MI); assert rc == 0
def worker():
    assert cuda.cuCtxSetCurrent(ctx) == 0
    assert free_async(p) == 0
t = threading.Thread(target=worker); t.start(); t.join()
print("pools=%d" % books(64 * MI))
rc, q = alloc(48 * MI)
print("rc=%d" % rc)
"#,
        &[("CUDABUDGET_LIMIT", "64Mi")],
    );
    assert_eq!(value(&out, "pools"), 32, "{out}");
    assert_eq!(
        value(&out, "rc"),
        0,
        "48 MiB fit once the pool is trimmed\n{out}"
    );
}

/// What a live thread keeps for itself is bounded (8 MiB): another thread's allocation
/// is refused at most one pool step (32 MiB) early, however much the first one freed.
#[test]
fn the_credit_a_live_thread_keeps_is_bounded() {
    let out = python(
        r#"{PRELUDE}
ready = threading.Event(); done = threading.Event()
def worker():
    assert cuda.cuCtxSetCurrent(ctx) == 0
    for size in (4 * MI, 100 * MI, 4 * MI):
        rc, p = alloc_async(size); assert rc == 0
        assert free_async(p) == 0
    ready.set()
    done.wait()
t = threading.Thread(target=worker); t.start()
ready.wait()
print("pools=%d" % books(1024 * MI))
rc, q = alloc(960 * MI)
print("rc=%d" % rc)
done.set(); t.join()
"#,
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    assert_eq!(value(&out, "pools"), 128, "{out}");
    assert_eq!(
        value(&out, "rc"),
        0,
        "960 MiB fit next to 32 MiB of pool\n{out}"
    );
}

/// A stream-ordered block freed with `cuMemFree` (the driver accepts it) gives its
/// credit back like `cuMemFreeAsync`: after a trim the books are at zero.
#[test]
fn a_stream_ordered_block_freed_synchronously_gives_its_credit_back() {
    let run = budget(
        &[
            "async:4Mi",
            "async:4Mi",
            "free:0",
            "free:1",
            "trim:0",
            "info",
            "alloc:64Mi",
        ],
        &[("CUDABUDGET_LIMIT", "64Mi")],
    );
    run.assert_completed();
    assert_eq!(run.rc("free", 0), 0, "{}", run.dump());
    assert_eq!(run.num("info", 0, "free"), 64 * MI, "{}", run.dump());
    assert_eq!(run.rc("alloc", 0), 0, "{}", run.dump());
}

/// A stream-ordered allocation that the budget admits but the driver refuses (the
/// device is full: a budget larger than the card, 150 MiB on 128 MiB) gives back the
/// credit it took, the thread's own and the shared: after everything is freed and
/// trimmed the books are at zero (free = the card's 128 MiB, not budget - 32 MiB).
#[test]
fn a_refused_stream_ordered_allocation_gives_its_credit_back() {
    let run = budget(
        &[
            "async:4Mi",
            "freeasync:0",
            "alloc:116Mi",
            "async:4Mi",
            "async:4Mi",
            "free:1",
            "trim:0",
            "info",
        ],
        &[
            ("CUDABUDGET_LIMIT", "150Mi"),
            ("FAKE_CUDA_MEM", "134217728"),
        ],
    );
    run.assert_completed();
    assert_eq!(run.rc("alloc", 0), 0, "{}", run.dump());
    assert_eq!(run.rc("async", 1), 2, "the card is full\n{}", run.dump());
    assert_eq!(run.rc("async", 2), 2, "the card is full\n{}", run.dump());
    assert_eq!(run.num("info", 0, "free"), 128 * MI, "{}", run.dump());
}

/// While a capture is under way a stream-ordered allocation on the capturing stream is a
/// graph node, not memory: the thread's credit is not spent on it (nor lost), and the
/// books return to zero after a trim.
#[test]
fn an_allocation_captured_into_a_graph_spends_no_credit() {
    let run = budget(
        &[
            "async:4Mi",
            "freeasync:0",
            "stream",
            "capture:0:relaxed",
            "asyncon:0:4Mi",
            "endcapture:0",
            "trim:0",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "64Mi")],
    );
    run.assert_completed();
    assert_eq!(run.rc("asyncon", 0), 0, "{}", run.dump());
    assert_eq!(run.rc("endcapture", 0), 0, "{}", run.dump());
    assert_eq!(run.num("info", 0, "free"), 64 * MI, "{}", run.dump());
}

/// A refused `cuMemAllocPitch` whose out-variables still hold an earlier allocation's
/// address and pitch (a program that reuses them) leaves that allocation's charge alone.
#[test]
fn a_refused_pitched_allocation_leaves_earlier_charges_alone() {
    let out = python(
        r#"{PRELUDE}
rc, p = alloc(256 * MI); assert rc == 0
dptr = ctypes.c_uint64(p)
pitch = ctypes.c_size_t(512)
rc = cuda.cuMemAllocPitch_v2(ctypes.byref(dptr), ctypes.byref(pitch), ctypes.c_size_t(4096), ctypes.c_size_t(1 << 20), 4)
print("rc=%d" % rc)
print("books=%d" % books(1024 * MI))
"#,
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    assert_eq!(value(&out, "rc"), 2, "4 GiB do not fit in 1 GiB\n{out}");
    assert_eq!(value(&out, "books"), 256, "{out}");
}

/// A pool growth refused at first and admitted once the graph memory is trimmed is
/// charged once: the books show the pool's reserve, and what is left of the budget
/// still fits.
#[test]
fn a_pool_growth_admitted_after_a_trim_is_charged_once() {
    let run = budget(
        &[
            "stream",
            "graph",
            "memnode:0:64Mi",
            "instantiate:0",
            "launch:0:0",
            "freeasyncon:0:0",
            "streamsync:0",
            "info",
            "async:80Mi",
            "info",
            "alloc:30Mi",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "128Mi")],
    );
    run.assert_completed();
    assert_eq!(
        run.num("info", 0, "free"),
        64 * MI,
        "the graph reserve\n{}",
        run.dump()
    );
    assert_eq!(run.rc("async", 0), 0, "{}", run.dump());
    assert_eq!(
        run.num("info", 1, "free"),
        32 * MI,
        "a 96 MiB pool, the graph reserve trimmed\n{}",
        run.dump()
    );
    assert_eq!(run.rc("alloc", 0), 0, "{}", run.dump());
    assert!(run.num("phys", 0, "peak") <= 128 * MI, "{}", run.dump());
}

/// A created context that goes while the primary one stays clears nothing: a block
/// still live in the pool is not counted twice, and the books return to zero.
#[test]
fn a_context_that_is_not_the_last_leaves_the_pool_books_alone() {
    let run = budget(
        &[
            "async:4Mi",
            "ctxcreate:0",
            "ctxdestroy:0",
            "ctx:0",
            "info",
            "freeasync:0",
            "trim:0",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "64Mi")],
    );
    run.assert_completed();
    assert_eq!(run.rc("ctxdestroy", 0), 0, "{}", run.dump());
    assert_eq!(run.num("info", 0, "free"), 32 * MI, "{}", run.dump());
    assert_eq!(run.num("info", 1, "free"), 64 * MI, "{}", run.dump());
}

/// A device's last context goes (here a created one, the primary released first) while
/// its pool still holds memory: the books are cleared, and the pool's reserve, which
/// the driver keeps, is charged again.
#[test]
fn a_pool_that_outlives_the_last_context_is_charged_again() {
    let run = budget(
        &[
            "ctxcreate:0",
            "ctxrelease:0",
            "async:4Mi",
            "info",
            "ctxdestroy:0",
            "ctx:0",
            "info",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "64Mi")],
    );
    run.assert_completed();
    assert_eq!(run.rc("ctxdestroy", 0), 0, "{}", run.dump());
    assert_eq!(run.num("phys", 0, "used"), 32 * MI, "{}", run.dump());
    assert_eq!(run.num("info", 0, "free"), 32 * MI, "{}", run.dump());
    assert_eq!(
        run.num("info", 1, "free"),
        32 * MI,
        "the pool's 32 MiB survive the context\n{}",
        run.dump()
    );
}

/// Pool memory the driver gave back (a synchronize below the release threshold) leaves
/// the views at most once a second, as the README says: a view within a second of the
/// last one still shows the pool's reserve, the first view after a second shows it gone.
/// The views stay cheap (no pool query each time), and never follow the pools faster.
#[test]
fn the_views_follow_the_pools_given_back_at_most_once_a_second() {
    let run = budget(
        &[
            "async:4Ki",
            "info",
            "freeasync:0",
            "sync",
            "info",
            "sleep:1200",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    run.assert_completed();
    assert_eq!(run.rc("sync", 0), 0, "{}", run.dump());
    assert_eq!(
        run.num("info", 0, "free"),
        8 * GI - 32 * MI,
        "{}",
        run.dump()
    );
    assert_eq!(
        run.num("info", 1, "free"),
        8 * GI - 32 * MI,
        "within a second of the last view the pool's charge is not refreshed\n{}",
        run.dump()
    );
    assert_eq!(
        run.num("info", 2, "free"),
        8 * GI,
        "a second later the view follows the driver's empty pool\n{}",
        run.dump()
    );
}

/// The same for a pool the program created: its memory that the driver gave back
/// leaves the views a second later.
#[test]
fn the_views_follow_a_created_pool_given_back() {
    let run = budget(
        &[
            "newpool",
            "poolasyncin:0:4Ki",
            "info",
            "freeasync:0",
            "sync",
            "sleep:1200",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    run.assert_completed();
    assert_eq!(run.rc("poolasyncin", 0), 0, "{}", run.dump());
    assert_eq!(
        run.num("info", 0, "free"),
        8 * GI - 32 * MI,
        "{}",
        run.dump()
    );
    assert_eq!(
        run.num("info", 1, "free"),
        8 * GI,
        "the created pool's reserve went back to the driver\n{}",
        run.dump()
    );
}
