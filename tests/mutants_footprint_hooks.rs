//! Behaviour that the footprint, the pools' books and the hooks' routing must keep:
//! each test here was written against a mutant of that code that the rest of the suite
//! let through (see docs/mutants/footprint-pools-hooks.md).

mod util;

use util::{GI, MI, budget_run};

/// What every test here budgets: 8 GiB on each device, and a context of 512 MiB.
const CTX: &str = "536870912";

fn free_of(run: &util::Run, nth: usize) -> u64 {
    assert_eq!(run.rc("info", nth), 0, "{run:?}");
    run.num("info", nth, "free")
}

#[test]
fn the_primary_context_of_a_second_device_is_charged_and_its_end_clears_its_books() {
    let run = budget_run(
        "gpa",
        &[
            "ctx:1",
            "info",
            "alloc:5Gi",
            "ctxreset:1",
            "ctx:1",
            "info",
            "alloc:7Gi",
            "alloc:513Mi",
            "phys",
        ],
        &[
            ("FAKE_CUDA_DEVICES", "2"),
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("FAKE_CUDA_CTX_BYTES", CTX),
        ],
    );
    run.assert_completed();
    assert_eq!(
        free_of(&run, 0),
        8 * GI - 512 * MI,
        "device 1's context is charged\n{run:?}"
    );
    assert_eq!(run.rc("ctxreset", 0), 0, "{run:?}");
    assert_eq!(
        free_of(&run, 1),
        8 * GI - 512 * MI,
        "the 5 GiB went with the context; the new context is charged\n{run:?}"
    );
    assert_eq!(
        run.rc("alloc", 1),
        0,
        "7 GiB fit beside the context\n{run:?}"
    );
    assert_eq!(run.rc("alloc", 2), 2, "past the budget\n{run:?}");
    assert!(run.num("phys", 0, "peak") <= 8 * GI, "{run:?}");
}

#[test]
fn releasing_one_of_two_retains_of_the_primary_context_keeps_its_books() {
    // The client retained device 0's primary context once at start; `ctx:0` retains it
    // again, so the release below ends nothing.
    let run = budget_run(
        "gpa",
        &[
            "alloc:5Gi",
            "ctx:0",
            "ctxrelease:0",
            "info",
            "alloc:5Gi",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    run.assert_completed();
    assert_eq!(run.rc("ctxrelease", 0), 0, "{run:?}");
    assert_eq!(
        free_of(&run, 0),
        3 * GI,
        "the 5 GiB are still held\n{run:?}"
    );
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
    assert!(run.num("phys", 0, "peak") <= 8 * GI, "{run:?}");
}

#[test]
fn the_last_release_of_a_primary_context_retained_twice_clears_its_books() {
    let run = budget_run(
        "gpa",
        &[
            "alloc:5Gi",
            "ctx:0",
            "ctxrelease:0",
            "ctxrelease:0",
            "ctx:0",
            "info",
            "alloc:7Gi",
            "alloc:513Mi",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi"), ("FAKE_CUDA_CTX_BYTES", CTX)],
    );
    run.assert_completed();
    assert_eq!(
        free_of(&run, 0),
        8 * GI - 512 * MI,
        "the old context and its 5 GiB are gone; the new context is charged\n{run:?}"
    );
    assert_eq!(run.rc("alloc", 1), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 2), 2, "{run:?}");
    assert!(run.num("phys", 0, "peak") <= 8 * GI, "{run:?}");
}

#[test]
fn destroying_the_last_created_context_clears_its_books() {
    let run = budget_run(
        "gpa",
        &[
            "ctxreset:0",
            "ctxcreate:0",
            "alloc:5Gi",
            "ctxdestroy:0",
            "ctx:0",
            "info",
            "alloc:7Gi",
            "alloc:513Mi",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi"), ("FAKE_CUDA_CTX_BYTES", CTX)],
    );
    run.assert_completed();
    assert_eq!(run.rc("ctxcreate", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("ctxdestroy", 0), 0, "{run:?}");
    assert_eq!(
        free_of(&run, 0),
        8 * GI - 512 * MI,
        "the created context took its 5 GiB with it\n{run:?}"
    );
    assert_eq!(run.rc("alloc", 1), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 2), 2, "{run:?}");
    assert!(run.num("phys", 0, "peak") <= 8 * GI, "{run:?}");
}

#[test]
fn destroying_a_created_context_beside_the_primary_one_keeps_the_primarys_books() {
    // Two contexts on device 0: the primary one (holding 5 GiB) and a created one. The
    // created one going is not the last context going.
    let run = budget_run(
        "gpa",
        &[
            "alloc:5Gi",
            "ctxcreate:0",
            "ctxdestroy:0",
            "ctx:0",
            "info",
            "alloc:5Gi",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    run.assert_completed();
    assert_eq!(run.rc("ctxcreate", 0), 0, "{run:?}");
    assert_eq!(run.rc("ctxdestroy", 0), 0, "{run:?}");
    assert_eq!(
        free_of(&run, 0),
        3 * GI,
        "the 5 GiB are still held\n{run:?}"
    );
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
    assert!(run.num("phys", 0, "peak") <= 8 * GI, "{run:?}");
}

#[test]
fn before_a_denial_the_footprint_is_read_again_and_memory_that_fits_is_admitted() {
    // Two contexts of 512 MiB; the routine re-read (a view more than a second after the
    // first context's charge) counts both. The created one then goes, beside the primary
    // one: the books still count its 512 MiB until the footprint is read again — which a
    // request that does not fit by the books must trigger (the sleeps only make sure the
    // re-reads are due; they are lower bounds, not races).
    let run = budget_run(
        "gpa",
        &[
            "info",
            "ctxcreate:0",
            "sleep:1100",
            "info",
            "ctxdestroy:0",
            "ctx:0",
            "sleep:150",
            "alloc:1280Mi",
            "info",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "2Gi"), ("FAKE_CUDA_CTX_BYTES", CTX)],
    );
    run.assert_completed();
    assert_eq!(free_of(&run, 0), 2 * GI - 512 * MI, "{run:?}");
    assert_eq!(free_of(&run, 1), GI, "both contexts are counted\n{run:?}");
    assert_eq!(run.rc("ctxdestroy", 0), 0, "{run:?}");
    assert_eq!(
        run.rc("alloc", 0),
        0,
        "512 MiB of context + 1280 MiB fit in 2 GiB\n{run:?}"
    );
    assert_eq!(free_of(&run, 2), 256 * MI, "{run:?}");
    assert!(run.num("phys", 0, "peak") <= 2 * GI + 512 * MI, "{run:?}");
}

/// Runs a Python `ctypes` script against the fake driver under the library; returns
/// (success, stdout, stderr).
fn python(script: &str, envs: &[(&str, &str)]) -> (bool, String, String) {
    util::python_under_library(script, envs)
}

#[test]
fn a_forked_child_charges_the_context_it_creates() {
    // The fake driver's state is inherited by the child, so the child resets device 0's
    // primary context and creates it again: that context is the child's first, and it is
    // charged, whatever the parent's contexts were.
    let script = r#"
import ctypes, os, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
free, total = ctypes.c_size_t(), ctypes.c_size_t()
assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
print("parent", free.value >> 20, flush=True)
time.sleep(0.3)
pid = os.fork()
if pid == 0:
    rcs = [cuda.cuDevicePrimaryCtxReset_v2(0)]
    rcs.append(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0))
    rcs.append(cuda.cuCtxSetCurrent(ctx))
    rcs.append(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
    print("child", *rcs, free.value >> 20, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"#;
    let (ok, stdout, stderr) = python(
        script,
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_LOG", "error"),
            ("FAKE_CUDA_CTX_BYTES", CTX),
        ],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(
        stdout.trim(),
        "parent 1536\nchild 0 0 0 0 1536",
        "2 GiB less the context's 512 MiB, in the parent and in the child\n{stderr}"
    );
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

#[test]
fn dlsym_rtld_next_from_a_library_preloaded_after_us_keeps_its_meaning() {
    // `dlsym(RTLD_NEXT, "cuMemAlloc_v2")` from a wrapper preloaded after cudabudget is
    // the next definition after *that wrapper*: the driver's, as glibc would answer.
    let preload = format!("{}:{}", util::lib_path().display(), util::thirdparty_lib());
    let run = util::client_with_preload(
        "linked",
        &["nextsym:cuMemAlloc_v2", "nextsym:getpagesize", "alloc:9Gi"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
        &preload,
    );
    run.assert_completed();
    assert_eq!(run.rc("nextsym", 0), 0, "{run:?}");
    assert_eq!(run.field("nextsym", 0, "lib"), "libcuda.so.1", "{run:?}");
    assert_eq!(run.field("nextsym", 0, "name"), "cuMemAlloc_v2", "{run:?}");
    assert_ne!(
        run.field("nextsym", 1, "lib"),
        "libthirdparty.so",
        "the next getpagesize is not the wrapper's own\n{run:?}"
    );
    assert_eq!(
        run.rc("alloc", 0),
        2,
        "the program's own calls are budgeted\n{run:?}"
    );
}
