//! Stream-ordered allocations (`cuMemAllocAsync`, pools): charged by the pool's reserve,
//! the credit a thread keeps for itself comes back (when it frees, when it exits, when
//! the pools are trimmed), created pools are the process's too, and no credit is ever
//! spent twice or lost.

use crate::util::scripts::{
    books_script, budget_without_rereads, holds_a_gibibyte_with, python_script, value_of,
};
use crate::util::{GI, MI, budget_run};

#[test]
fn stream_ordered_allocations_are_budgeted_by_the_pools_reserve() {
    for mode in ["gpa", "gpa-ptsz", "dlsym"] {
        let run = budget_run(
            mode,
            &[
                "async:5Gi",
                "async:4Gi",
                "freeasync:0",
                "async:4Gi",
                "reserve",
                "phys",
            ],
            &[("CUDABUDGET_LIMIT", "8Gi")],
        );
        assert_eq!(run.rc("async", 0), 0, "{mode}\n{run:?}");
        assert_eq!(run.rc("async", 1), 2, "{mode}: 5 + 4 > 8\n{run:?}");
        assert_eq!(
            run.rc("async", 2),
            0,
            "{mode}: the freed block is reused\n{run:?}"
        );
        assert!(run.num("phys", 0, "peak") <= 8 * GI, "{mode}");
    }
}

#[test]
fn stream_ordered_blocks_freed_by_other_threads_give_their_credit_back() {
    // Eight threads each allocate 4000 blocks of 64 KiB (2 GiB in all, against a 1 GiB
    // budget) and hand every block to the next thread, which frees it. Blocks freed on
    // another thread than their own must be found, or their credit never comes back and
    // the budget runs out.
    for mode in ["gpa", "dlsym"] {
        let run = budget_run(
            mode,
            &[
                "threshold:max",
                "asyncrelay:8:4000:64Ki",
                "sync",
                "trim:0",
                "alloc:900Mi",
                "phys",
            ],
            &[("CUDABUDGET_LIMIT", "1Gi")],
        );
        assert_eq!(run.num("asyncrelay", 0, "ok"), 32_000, "{mode}\n{run:?}");
        assert_eq!(run.num("asyncrelay", 0, "denied"), 0, "{mode}\n{run:?}");
        assert_eq!(run.num("asyncrelay", 0, "other"), 0, "{mode}\n{run:?}");
        assert_eq!(
            run.rc("alloc", 0),
            0,
            "{mode}: all blocks were freed, so 900 MiB fits\n{run:?}"
        );
        assert!(run.num("phys", 0, "peak") <= GI, "{mode}\n{run:?}");
    }
}

#[test]
fn what_a_thread_kept_for_itself_comes_back_when_it_exits() {
    // Sixteen threads each allocate 4 MiB blocks and free the previous thread's: each
    // keeps up to 8 MiB of the freed credit for its own next allocations, 64 MiB or
    // more in all. When they have exited, that credit must be the process's again, or a
    // 980 MiB allocation (992 MiB of pool growth) no longer fits in 1 GiB.
    for mode in ["gpa", "dlsym"] {
        let run = budget_run(
            mode,
            &["threshold:max", "asyncrelay:16:8:4Mi", "async:980Mi"],
            &[("CUDABUDGET_LIMIT", "1Gi")],
        );
        assert_eq!(run.num("asyncrelay", 0, "ok"), 128, "{mode}\n{run:?}");
        assert_eq!(run.num("asyncrelay", 0, "denied"), 0, "{mode}\n{run:?}");
        assert_eq!(run.rc("async", 0), 0, "{mode}\n{run:?}");
    }
}

#[test]
fn credit_of_threads_whose_last_calls_come_from_exit_handlers_comes_back_too() {
    // Sixteen threads make their only CUDA calls from a pthread-key destructor, which
    // glibc runs after the thread-local destructors: each allocates and frees 4 MiB
    // stream-ordered and keeps the credit. It must still come back when the thread is
    // gone, or the 980 MiB allocation (992 MiB of pool growth) does not fit in 1 GiB.
    for mode in ["gpa", "dlsym"] {
        let run = budget_run(
            mode,
            &["threshold:max", "keydtor:16:4Mi", "async:980Mi"],
            &[("CUDABUDGET_LIMIT", "1Gi")],
        );
        assert_eq!(run.num("keydtor", 0, "ok"), 16, "{mode}\n{run:?}");
        assert_eq!(run.rc("async", 0), 0, "{mode}\n{run:?}");
    }
}

#[test]
fn allocations_from_an_explicit_pool_count_too() {
    let run = budget_run(
        "dlsym",
        &[
            "poolasync:3Gi",
            "newpool",
            "poolasyncin:0:3Gi",
            "poolasyncin:0:3Gi",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(run.rc("poolasync", 0), 0);
    assert_eq!(run.rc("poolasyncin", 0), 0, "{run:?}");
    assert_eq!(run.rc("poolasyncin", 1), 2, "{run:?}");
    assert!(run.num("phys", 0, "peak") <= 8 * GI);
}

#[test]
fn a_synchronous_allocation_after_an_async_free_stays_within_the_budget_physically() {
    // PyTorch sets the release threshold to the maximum: freed blocks stay in the pool.
    let run = budget_run(
        "gpa",
        &[
            "threshold:max",
            "async:5Gi",
            "freeasync:0",
            "sync",
            "reserve",
            "alloc:4Gi",
            "reserve",
            "phys",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(
        run.num("reserve", 0, "bytes"),
        5 * GI,
        "the pool kept the block\n{run:?}"
    );
    assert_eq!(
        run.rc("alloc", 0),
        0,
        "the pool is trimmed before a denial\n{run:?}"
    );
    assert_eq!(run.num("reserve", 1, "bytes"), 0);
    assert!(
        run.num("phys", 0, "peak") <= 8 * GI,
        "physical peak {}",
        run.num("phys", 0, "peak")
    );
    assert_eq!(run.num("phys", 0, "used"), 4 * GI);
    assert_eq!(run.num("info", 0, "free"), 4 * GI);
}

#[test]
fn the_pools_cached_memory_is_charged_until_it_really_goes_back() {
    let run = budget_run(
        "gpa",
        &["threshold:max", "async:5Gi", "freeasync:0", "sync", "info"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    // The pool still holds 5 GiB of the device: the view says so.
    assert_eq!(run.num("info", 0, "free"), 3 * GI, "{run:?}");
}

/// A pool the program created and destroyed with nothing live gives its reserve back;
/// one destroyed with a block still live keeps it (the driver does too).
#[test]
fn a_destroyed_created_pool_gives_back_its_reserve_when_empty() {
    let out = books_script(
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
    assert_eq!(value_of(&out, "held"), 128, "{out}");
    assert_eq!(value_of(&out, "empty"), 0, "{out}");
    assert_eq!(value_of(&out, "live"), 128, "{out}");
}

/// Credit a thread kept for itself (its stream-ordered frees) goes back when the thread
/// ends: afterwards the whole budget can be allocated again. (The client's thread is
/// joined with `pthread_join`, which returns after its key destructors ran.)
#[test]
fn the_credit_of_an_ended_thread_is_not_lost() {
    for _ in 0..3 {
        let run = budget_without_rereads(
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
    let run = budget_without_rereads(&ops, &[("CUDABUDGET_LIMIT", "64Mi")]);
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
    let run = budget_without_rereads(&ops, &[("CUDABUDGET_LIMIT", "64Mi")]);
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
    let run = budget_without_rereads(
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
    let out = books_script(
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
    assert_eq!(value_of(&out, "pools"), 32, "{out}");
    assert_eq!(
        value_of(&out, "rc"),
        0,
        "48 MiB fit once the pool is trimmed\n{out}"
    );
}

/// What a live thread keeps for itself is bounded (8 MiB): another thread's allocation
/// is refused at most one pool step (32 MiB) early, however much the first one freed.
#[test]
fn the_credit_a_live_thread_keeps_is_bounded() {
    let out = books_script(
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
    assert_eq!(value_of(&out, "pools"), 128, "{out}");
    assert_eq!(
        value_of(&out, "rc"),
        0,
        "960 MiB fit next to 32 MiB of pool\n{out}"
    );
}

/// A stream-ordered block freed with `cuMemFree` (the driver accepts it) gives its
/// credit back like `cuMemFreeAsync`: after a trim the books are at zero.
#[test]
fn a_stream_ordered_block_freed_synchronously_gives_its_credit_back() {
    let run = budget_without_rereads(
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
    let run = budget_without_rereads(
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

/// A pool growth refused at first and admitted once the graph memory is trimmed is
/// charged once: the books show the pool's reserve, and what is left of the budget
/// still fits.
#[test]
fn a_pool_growth_admitted_after_a_trim_is_charged_once() {
    let run = budget_without_rereads(
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
    let run = budget_without_rereads(
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
    let run = budget_without_rereads(
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

/// An allocation no budget could hold fails in the driver; it must not leave credit
/// behind that later allocations spend (it gives back no credit it never took).
#[test]
fn an_impossible_stream_ordered_request_leaves_the_budget_whole() {
    for huge in [
        "0xffffffffffffffff",
        "0x4000000000000000",
        "0x3fffffffffffffff",
    ] {
        for op in ["async", "poolasync"] {
            let mut ops = vec![format!("{op}:{huge}"), format!("{op}:{huge}")];
            ops.extend((0..10).map(|_| format!("{op}:1Gi")));
            ops.push("phys".to_string());
            let ops: Vec<&str> = ops.iter().map(String::as_str).collect();
            let run = budget_run("gpa", &ops, &[("CUDABUDGET_LIMIT", "1Gi")]);
            assert_eq!(run.rc(op, 0), 2, "{op}:{huge}\n{run:?}");
            assert_eq!(run.rc(op, 2), 0, "the first 1 GiB fits\n{run:?}");
            for nth in 3..12 {
                assert_eq!(
                    run.rc(op, nth),
                    2,
                    "{op}:{huge}: #{nth} must be refused\n{run:?}"
                );
            }
            assert!(
                run.num("phys", 0, "peak") <= GI,
                "{op}:{huge}: the device held {} MiB\n{run:?}",
                run.num("phys", 0, "peak") / MI
            );
        }
    }
}

/// The library trims the pools before a denial; credit a thread kept for its next
/// stream-ordered allocations then stands for memory the pools gave back, and is not
/// spent as it was: the driver would grow the pool by a 32 MiB step that nothing
/// admitted, past the budget.
#[test]
fn credit_a_thread_kept_is_not_spent_after_the_pools_were_trimmed() {
    let run = budget_run(
        "gpa",
        &[
            "async:4Mi",
            "freeasync:0",
            "alloc:990Mi",
            "alloc:10Mi",
            "async:4Mi",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    assert_eq!(run.rc("alloc", 1), 0, "the trim made room\n{run:?}");
    assert_eq!(
        run.rc("async", 1),
        2,
        "1000 MiB + a 32 MiB pool step do not fit in 1 GiB\n{run:?}"
    );
    assert!(
        run.num("phys", 0, "peak") <= GI,
        "the device held {} MiB\n{run:?}",
        run.num("phys", 0, "peak") / MI
    );
}

/// A stream-ordered allocation the driver refuses (here: from a pool that was destroyed)
/// took credit that must come back in full; otherwise the budget shrinks for good and an
/// allocation that fits is refused.
#[test]
fn a_stream_ordered_allocation_the_driver_refuses_gives_its_credit_back() {
    let script = r#"
import ctypes
{PRIMARY}
{POOL_PROPS}
pool = ctypes.c_void_p()
assert cuda.cuMemPoolCreate(ctypes.byref(pool), ctypes.byref(Props(1, 0, 1, 0))) == 0
assert cuda.cuMemPoolDestroy(pool) == 0
p = ctypes.c_uint64()
rcs = []
for _ in range(3):
    rcs.append(cuda.cuMemAllocFromPoolAsync(ctypes.byref(p), ctypes.c_size_t(900 << 20), pool, None))
rcs.append(cuda.cuMemAllocAsync(ctypes.byref(p), ctypes.c_size_t(1000 << 20), None))
print(*rcs)
"#;
    let (ok, stdout, stderr) = python_script(
        script,
        &[("CUDABUDGET_LIMIT", "1Gi"), ("CUDABUDGET_LOG", "error")],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(
        stdout.trim(),
        "1 1 1 0",
        "the driver's refusals pass through, and 1000 MiB still fit in 1 GiB\n{stderr}"
    );
}

/// Stream-ordered memory lives on the stream's device, whatever context is current: a
/// device-1 stream used while device 0 is current is charged to device 1.
#[test]
fn stream_ordered_memory_is_charged_to_the_streams_device() {
    let run = budget_run(
        "gpa",
        &[
            "ctx:1",
            "stream",
            "ctx:0",
            "streaminfo:0",
            "asyncon:0:768Mi",
            "async:768Mi",
            "asyncon:0:512Mi",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi"), ("FAKE_CUDA_DEVICES", "2")],
    );
    assert_eq!(run.field("streaminfo", 0, "dev"), "1", "{run:?}");
    assert_eq!(run.rc("asyncon", 0), 0, "{run:?}");
    assert_eq!(
        run.rc("async", 0),
        0,
        "device 0 holds nothing yet: 768 MiB fit\n{run:?}"
    );
    assert_eq!(run.rc("asyncon", 1), 2, "device 1 is full\n{run:?}");
}

/// Pools the program created are the process's too: trimmed before a denial, and
/// charged to their own device whatever context is current.
#[test]
fn created_pools_are_trimmed_before_a_denial_and_charged_to_their_device() {
    let script = r#"
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
{POOL_PROPS}
pool0, pool1 = ctypes.c_void_p(), ctypes.c_void_p()
assert cuda.cuMemPoolCreate(ctypes.byref(pool0), ctypes.byref(Props(1, 0, 1, 0))) == 0
assert cuda.cuMemPoolCreate(ctypes.byref(pool1), ctypes.byref(Props(1, 0, 1, 1))) == 0
maxed = ctypes.c_uint64(1 << 62)
assert cuda.cuMemPoolSetAttribute(pool0, 4, ctypes.byref(maxed)) == 0
p = ctypes.c_uint64()
rcs = [cuda.cuMemAllocFromPoolAsync(ctypes.byref(p), ctypes.c_size_t(768 << 20), pool0, None)]
rcs.append(cuda.cuMemFreeAsync(p, None))
assert cuda.cuCtxSynchronize() == 0
# pool0 keeps its 768 MiB (threshold at max): a trim must give them back for this.
rcs.append(cuda.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(768 << 20)))
# Device 1's pool, with device 0 current: device 1 pays.
rcs.append(cuda.cuMemAllocFromPoolAsync(ctypes.byref(p), ctypes.c_size_t(768 << 20), pool1, None))
rcs.append(cuda.cuMemAllocFromPoolAsync(ctypes.byref(p), ctypes.c_size_t(512 << 20), pool1, None))
print(*rcs)
"#;
    let (ok, stdout, stderr) = python_script(
        script,
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_LOG", "error"),
            ("FAKE_CUDA_DEVICES", "2"),
        ],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "0 0 0 0 2", "{stderr}");
}

/// A stream-ordered allocation decides which pool pays before its driver call; a switch
/// of the device's current pool (`cuDeviceSetMemPool`) that lands in between must not
/// let the driver grow the new pool with nothing charged for it. The driver's call is held
/// for 300 ms here, as a preempted thread's would be, and the switch made meanwhile.
#[test]
fn a_pool_switch_during_another_threads_allocation_charges_the_pool_that_grew() {
    let script = r#"
import ctypes, threading, time
{PRIMARY}
{POOL_PROPS}
pool = ctypes.c_void_p()
assert cuda.cuMemPoolCreate(ctypes.byref(pool), ctypes.byref(Props(1, 0, 1, 0))) == 0
maxed = ctypes.c_uint64(1 << 62)
assert cuda.cuMemPoolSetAttribute(pool, 4, ctypes.byref(maxed)) == 0
block = ctypes.c_uint64()
def allocate():
    assert cuda.cuCtxSetCurrent(ctx) == 0
    assert cuda.cuMemAllocAsync(ctypes.byref(block), ctypes.c_size_t(4096), None) == 0
t = threading.Thread(target=allocate)
t.start()
time.sleep(0.1)
assert cuda.cuDeviceSetMemPool(0, pool) == 0
t.join()
assert cuda.cuMemFreeAsync(block, None) == 0
assert cuda.cuCtxSynchronize() == 0
default = ctypes.c_void_p()
assert cuda.cuDeviceGetDefaultMemPool(ctypes.byref(default), 0) == 0
assert cuda.cuMemPoolTrimTo(default, 0) == 0
{FILL}
"#;
    holds_a_gibibyte_with("cuMemAllocAsync:300", script, "FAKE_CUDA_PAUSE");
}

/// `cuMemPoolDestroy` of a pool the program created gives its charge back when nothing
/// in it is in use; an allocation from that pool by another thread, landing between the
/// look at its use and its end, keeps its memory charged. The driver's
/// destroy is held for 300 ms here, and the allocation made meanwhile.
#[test]
fn an_allocation_from_a_pool_being_destroyed_stays_charged() {
    let script = r#"
import ctypes, threading, time
{PRIMARY}
{POOL_PROPS}
pool = ctypes.c_void_p()
assert cuda.cuMemPoolCreate(ctypes.byref(pool), ctypes.byref(Props(1, 0, 1, 0))) == 0
rcs = []
def destroy():
    rcs.append(cuda.cuMemPoolDestroy(pool))
t = threading.Thread(target=destroy)
t.start()
time.sleep(0.1)
block = ctypes.c_uint64()
late = cuda.cuMemAllocFromPoolAsync(ctypes.byref(block), ctypes.c_size_t(4096), pool, None)
t.join()
assert rcs == [0], rcs
{FILL}
"#;
    holds_a_gibibyte_with("cuMemPoolDestroy:300", script, "FAKE_CUDA_PAUSE");
}

#[test]
fn stream_ordered_blocks_that_outlive_the_last_context_are_no_credit() {
    // The only context is a created one; its stream-ordered 1 GiB stays in use in the
    // device's pool after it is destroyed (the driver keeps pools across contexts). The
    // books are rebuilt from the pool: its reserve is charged, and what it has in use is
    // no credit for later stream-ordered allocations.
    let run = budget_run(
        "gpa",
        &[
            "ctxreset:0",
            "ctxcreate:0",
            "async:1Gi",
            "ctxdestroy:0",
            "ctx:0",
            "async:1Gi",
            "async:1Gi",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "2Gi")],
    );
    run.assert_completed();
    assert_eq!(run.rc("async", 0), 0, "{run:?}");
    assert_eq!(run.rc("ctxdestroy", 0), 0, "{run:?}");
    assert_eq!(run.rc("async", 1), 0, "the second GiB fits\n{run:?}");
    assert_eq!(run.rc("async", 2), 2, "a third does not\n{run:?}");
    assert!(run.num("phys", 0, "peak") <= 2 * GI, "{run:?}");
}
