//! Contexts: a context is charged when it is created (what NVML measures, or the growth
//! of the device across its creation), on every device, and its charge goes when its
//! last retain is released or it is destroyed; memory no call names is reconciled
//! into the books.

use crate::util::scripts::python_script;
use crate::util::{GI, MI, budget_run};

#[test]
fn the_context_is_charged_when_it_is_created() {
    let run = budget_run(
        "gpa",
        &["info", "alloc:7Gi", "alloc:513Mi", "phys"],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
        ],
    );
    assert_eq!(run.num("info", 0, "free"), 8 * GI - 512 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0);
    assert_eq!(
        run.rc("alloc", 1),
        2,
        "7 GiB + 512 MiB of context is the whole budget"
    );
    assert!(run.num("phys", 0, "peak") <= 8 * GI);
}

#[test]
fn an_allocation_right_after_the_context_waits_for_its_charge_on_every_path() {
    // NVML is slow to start: the context exists before it can be measured. The first
    // allocation must not pass as if the context took nothing.
    for op in ["alloc:8Gi", "create:8Gi", "async:8Gi"] {
        let run = budget_run(
            "gpa",
            &[op, "phys"],
            &[
                ("CUDABUDGET_LIMIT", "8Gi"),
                ("FAKE_CUDA_CTX_BYTES", "536870912"),
                ("FAKE_NVML_INIT_DELAY_MS", "300"),
            ],
        );
        let name = op.split(':').next().unwrap_or(op);
        assert_eq!(
            run.rc(name, 0),
            2,
            "{op}: 8 GiB + 512 MiB of context\n{run:?}"
        );
        assert!(run.num("phys", 0, "peak") <= 8 * GI, "{op}: {run:?}");
    }
}

#[test]
fn where_the_contexts_cost_is_known_nothing_waits_for_nvml() {
    // NVML takes a minute to start (longer than the client runs, however busy the
    // machine), and the context's cost is known (600 MiB here): it is
    // charged that until NVML measures it, a view shows it, and an allocation that fits
    // beside a context twice that size is admitted at once, on every path, without
    // measuring the context first.
    for op in ["alloc:1Gi", "create:1Gi", "async:1Gi"] {
        let run = budget_run(
            "gpa",
            &["info", op],
            &[
                ("CUDABUDGET_LIMIT", "8Gi"),
                ("CUDABUDGET_CONTEXT_MEMORY", "600Mi"),
                ("CUDABUDGET_LOG", "debug"),
                ("FAKE_CUDA_CTX_BYTES", "536870912"),
                ("FAKE_NVML_INIT_DELAY_MS", "60000"),
            ],
        );
        let name = op.split(':').next().unwrap_or(op);
        assert_eq!(run.num("info", 0, "free"), 8 * GI - 600 * MI, "{run:?}");
        assert_eq!(run.rc(name, 0), 0, "{op}: {run:?}");
        assert!(
            run.stderr
                .contains("context charged its estimate, 600.00 MiB, until NVML measures it"),
            "{op}: {run:?}"
        );
        assert!(
            !run.stderr.contains("for the context's charge"),
            "{op}: measured before NVML was up\n{run:?}"
        );
    }
}

#[test]
fn a_context_larger_than_its_estimate_still_keeps_the_budget_before_nvml_measures_it() {
    // The context holds 1100 MiB, its estimate says 600 MiB, and NVML starts late. An
    // allocation that fits beside the estimate (600 MiB + 7.0 GiB) but not beside twice it
    // is decided on NVML's figure: 1100 MiB + 7.0 GiB does not fit in 8 GiB.
    for op in ["alloc:7Gi", "create:7Gi", "async:7Gi"] {
        let run = budget_run(
            "gpa",
            &[op, "phys", "info"],
            &[
                ("CUDABUDGET_LIMIT", "8Gi"),
                ("CUDABUDGET_CONTEXT_MEMORY", "600Mi"),
                ("FAKE_CUDA_CTX_BYTES", "1153433600"),
                ("FAKE_NVML_INIT_DELAY_MS", "300"),
            ],
        );
        let name = op.split(':').next().unwrap_or(op);
        assert_eq!(run.rc(name, 0), 2, "{op}: {run:?}");
        assert!(run.num("phys", 0, "peak") <= 8 * GI, "{op}: {run:?}");
        assert_eq!(
            run.num("info", 0, "free"),
            8 * GI - 1100 * MI,
            "{op}: NVML's figure replaces the estimate\n{run:?}"
        );
    }
}

#[test]
fn an_estimate_set_too_low_still_keeps_room_for_the_models_figure() {
    // CUDABUDGET_CONTEXT_MEMORY=0 (wrong: the context holds 512 MiB) and NVML slow: the
    // context is charged nothing until NVML measures it, but an admission meanwhile still
    // keeps room for a context of the model's figure (640 MiB for an unmeasured model),
    // so 7.6 GiB is decided on NVML's figure and refused.
    let run = budget_run(
        "gpa",
        &["alloc:7782Mi", "phys", "info"],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("CUDABUDGET_CONTEXT_MEMORY", "0"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
            ("FAKE_NVML_INIT_DELAY_MS", "300"),
        ],
    );
    assert_eq!(run.rc("alloc", 0), 2, "{run:?}");
    assert!(run.num("phys", 0, "peak") <= 8 * GI, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), 8 * GI - 512 * MI, "{run:?}");
}

#[test]
fn allocations_racing_the_contexts_measurement_are_not_counted_as_context() {
    // Eight threads allocate while NVML's process query (50 ms) measures the context
    // (0 B here): what they allocate meanwhile must not be charged as context memory.
    let run = budget_run(
        "gpa",
        &["race:8:2000:1Gi", "info"],
        &[
            ("CUDABUDGET_LIMIT", "10Gi"),
            ("FAKE_NVML_INIT_DELAY_MS", "5"),
            ("FAKE_NVML_PROC_DELAY_MS", "50"),
        ],
    );
    assert_eq!(run.num("race", 0, "ok"), 16_000, "{run:?}");
    assert_eq!(run.num("race", 0, "denied"), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), 10 * GI, "{run:?}");
}

#[test]
fn in_a_pid_namespace_the_context_is_the_devices_growth_across_its_creation() {
    // NVML lists host pids in a PID namespace, so it never finds this process: the
    // context is measured from the device's use before and after it. (The first context
    // goes and a new one is made once NVML is surely up.)
    let run = budget_run(
        "gpa",
        &[
            "ctxreset:0",
            "sleep:200",
            "ctx:0",
            "info",
            "alloc:7Gi",
            "alloc:513Mi",
        ],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
            ("FAKE_NVML_PID_OFFSET", "100000"),
        ],
    );
    assert_eq!(run.rc("ctx", 0), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), 8 * GI - 512 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0);
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
}

/// `cmd` run as PID 1 of a new PID namespace (`unshare -Urpf --mount-proc`), or `None`
/// where this machine cannot make one.
fn in_new_pid_namespace(cmd: &std::process::Command) -> Option<std::process::Command> {
    let probe = std::process::Command::new("unshare")
        .args(["-Urpf", "--mount-proc", "true"])
        .output()
        .ok()?;
    if !probe.status.success() {
        return None;
    }
    let mut wrapped = std::process::Command::new("unshare");
    wrapped
        .args(["-Urpf", "--mount-proc"])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        match value {
            Some(v) => wrapped.env(key, v),
            None => wrapped.env_remove(key),
        };
    }
    Some(wrapped)
}

#[test]
fn in_a_real_pid_namespace_the_first_context_waits_for_nvml_to_measure_it() {
    // A real PID namespace, and NVML reporting host pids (the offset): the library must
    // read the device's use before the context, even though NVML starts slowly.
    let cmd = crate::util::client_command(
        "gpa",
        &["info", "alloc:7Gi", "alloc:513Mi"],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
            ("FAKE_NVML_PID_OFFSET", "100000"),
            ("FAKE_NVML_INIT_DELAY_MS", "100"),
        ],
        Some(&crate::util::lib_path()),
    );
    let Some(cmd) = in_new_pid_namespace(&cmd) else {
        crate::util::skip("this machine cannot create a PID namespace (unshare -Urpf)");
        return;
    };
    let run = crate::util::run(cmd);
    assert_eq!(run.num("info", 0, "free"), 8 * GI - 512 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
}

#[test]
fn when_the_last_context_goes_its_memory_leaves_the_books() {
    let run = budget_run(
        "gpa",
        &["alloc:5Gi", "ctxreset:0", "ctx:0", "info", "alloc:6Gi"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(run.rc("ctxreset", 0), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), 8 * GI, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 0);
}

#[test]
fn in_a_real_pid_namespace_memory_no_call_names_is_reconciled_by_the_routine_re_read() {
    // NVML lists the process under a pid it cannot know (as host pids in a container):
    // the pid that appears with the first context is taken as its own, so the footprint
    // re-read (due once a second) finds the 300 MiB a kernel launch grew (local memory),
    // as on the host; the views wait for it (`infountil`), then an allocation counts
    // beside it.
    let reconciled = (8 * GI - 512 * MI - 300 * MI).to_string();
    let cmd = crate::util::client_command(
        "gpa",
        &[
            "info",
            "kernel",
            &format!("infountil:{reconciled}"),
            "alloc:1Mi",
            "info",
        ],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
            ("FAKE_CUDA_LAUNCH_LOCAL_BYTES", "314572800"),
            ("FAKE_NVML_PID_OFFSET", "100000"),
        ],
        Some(&crate::util::lib_path()),
    );
    let Some(cmd) = in_new_pid_namespace(&cmd) else {
        crate::util::skip("this machine cannot create a PID namespace (unshare -Urpf)");
        return;
    };
    let run = crate::util::run(cmd);
    assert_eq!(run.num("info", 0, "free"), 8 * GI - 512 * MI, "{run:?}");
    assert_eq!(run.rc("kernel", 0), 0, "{run:?}");
    assert_eq!(run.rc("infountil", 0), 0, "never reconciled\n{run:?}");
    assert_eq!(
        run.num("info", 1, "free"),
        8 * GI - 512 * MI - 300 * MI - MI,
        "{run:?}"
    );
}

/// The routine re-read of the footprint (once a second) is taken by the next admission,
/// on the synchronous fast path too: a thread that has allocated before (and so holds a
/// lane) finds the 300 MiB a kernel launch grew outside the hooks at its next
/// allocation, which then no longer fits. (The re-read is due after a second; the
/// library's thread raises it within 0.2 s of that, so 2 s leave room on a busy
/// machine.)
#[test]
fn a_threads_later_allocation_takes_the_routine_reread_too() {
    let run = budget_run(
        "gpa",
        &["alloc:1Mi", "kernel", "sleep:2000", "alloc:250Mi", "info"],
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
            ("FAKE_CUDA_LAUNCH_LOCAL_BYTES", "314572800"),
        ],
    );
    assert_eq!(run.rc("kernel", 0), 0, "{run:?}");
    assert_eq!(
        run.rc("alloc", 1),
        2,
        "512 MiB of context, 300 MiB of the kernel's, 1 MiB: 250 MiB more do not fit\n{run:?}"
    );
    assert_eq!(
        run.num("info", 0, "free"),
        GI - 512 * MI - 300 * MI - MI,
        "{run:?}"
    );
}

#[test]
fn in_a_real_pid_namespace_a_context_nvml_was_too_slow_to_measure_is_charged_the_estimate() {
    // NVML starts after the 2 s the first context waits for it: nothing measured the
    // device before the context, and NVML never lists this process (host pids). When
    // NVML comes up the context is charged CUDABUDGET_CONTEXT_MEMORY, as the README
    // says, not the nothing that the device's use minus an unknown "before" would give.
    let cmd = crate::util::client_command(
        "gpa",
        &["sleep:2500", "info", "alloc:7Gi", "alloc:425Mi"],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("CUDABUDGET_CONTEXT_MEMORY", "600Mi"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
            ("FAKE_NVML_PID_OFFSET", "100000"),
            ("FAKE_NVML_INIT_DELAY_MS", "3000"),
        ],
        Some(&crate::util::lib_path()),
    );
    let Some(cmd) = in_new_pid_namespace(&cmd) else {
        crate::util::skip("this machine cannot create a PID namespace (unshare -Urpf)");
        return;
    };
    let run = crate::util::run(cmd);
    assert_eq!(run.num("info", 0, "free"), 8 * GI - 600 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
}

/// What every test here budgets: 8 GiB on each device, and a context of 512 MiB.
const CTX: &str = "536870912";

fn free_of(run: &crate::util::Run, nth: usize) -> u64 {
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
    // first context's charge, which the views wait for) counts both. The created one
    // then goes, beside the primary one: the books still count its 512 MiB until the
    // footprint is read again — which a request that does not fit by the books must
    // trigger (the sleep only makes sure that re-read is due; a lower bound, not a race).
    let run = budget_run(
        "gpa",
        &[
            "info",
            "ctxcreate:0",
            &format!("infountil:{GI}"),
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
    assert_eq!(
        run.rc("infountil", 0),
        0,
        "both contexts are counted\n{run:?}"
    );
    assert_eq!(run.rc("ctxdestroy", 0), 0, "{run:?}");
    assert_eq!(
        run.rc("alloc", 0),
        0,
        "512 MiB of context + 1280 MiB fit in 2 GiB\n{run:?}"
    );
    assert_eq!(free_of(&run, 1), 256 * MI, "{run:?}");
    assert!(run.num("phys", 0, "peak") <= 2 * GI + 512 * MI, "{run:?}");
}

/// `cudaDeviceReset` resets the primary context; beside a context from `cuCtxCreate`
/// that primary was never active, and its reset ends nothing the books count: the
/// device's books stay, and a second 2.5 GiB does not pass a 4 GiB budget.
#[test]
fn a_reset_of_an_unused_primary_context_keeps_a_live_contexts_books() {
    let script = r#"
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
a, b = ctypes.c_uint64(), ctypes.c_uint64()
first = cuda.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t(5 << 29))
reset = cuda.cuDevicePrimaryCtxReset_v2(0)
second = cuda.cuMemAlloc_v2(ctypes.byref(b), ctypes.c_size_t(5 << 29))
free, total = ctypes.c_size_t(), ctypes.c_size_t()
info = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
print(first, reset, second, info, free.value >> 20)
"#;
    let (ok, stdout, stderr) = python_script(
        script,
        &[("CUDABUDGET_LIMIT", "4Gi"), ("CUDABUDGET_LOG", "error")],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(
        stdout.trim(),
        "0 0 2 0 1536",
        "the second 2.5 GiB is refused and 1.5 GiB stays free\n{stderr}"
    );
}

/// A primary context retained twice is still there after one release; after the second
/// it is gone with its memory, and the books start again from zero.
#[test]
fn a_primary_context_counts_as_gone_only_after_its_last_release() {
    let script = r#"
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
rcs = [cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0),
       cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)]
assert cuda.cuCtxSetCurrent(ctx) == 0
p = ctypes.c_uint64()
rcs.append(cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1 << 30)))
rcs.append(cuda.cuDevicePrimaryCtxRelease_v2(0))
# Still active: 1 GiB is still held, so another 1 GiB does not fit in 1.5 GiB.
rcs.append(cuda.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(1 << 30)))
rcs.append(cuda.cuDevicePrimaryCtxRelease_v2(0))
rcs.append(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0))
assert cuda.cuCtxSetCurrent(ctx) == 0
rcs.append(cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1 << 30)))
print(*rcs)
"#;
    let (ok, stdout, stderr) = python_script(
        script,
        &[("CUDABUDGET_LIMIT", "1536Mi"), ("CUDABUDGET_LOG", "error")],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "0 0 0 0 2 0 0 0", "{stderr}");
}

/// The context of every device is charged, device 1's too.
#[test]
fn the_context_on_a_second_device_is_charged_to_that_device() {
    let script = r#"
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
p = ctypes.c_uint64()
a = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(768 << 20))
b = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(256 << 20))
print(a, b)
"#;
    let (ok, stdout, stderr) = python_script(
        script,
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_LOG", "error"),
            ("FAKE_CUDA_DEVICES", "2"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
        ],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(
        stdout.trim(),
        "2 0",
        "512 MiB of context + 768 MiB do not fit in 1 GiB; 256 MiB do\n{stderr}"
    );
}

/// Memory no allocation call names (a module's globals) is found by the footprint's
/// reconciliation against NVML within a second, and counts against the budget.
#[test]
fn memory_outside_the_hooks_is_reconciled_into_the_books() {
    let script = r#"
import ctypes, time
{PRIMARY}
p = ctypes.c_uint64()
rcs = [cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(256 << 20))]
rcs.append(cuda.cuModuleLoad(ctypes.byref(ctypes.c_void_p()), b"kernels.cubin"))
# Views until the routine re-read (due once a second, by the library's background
# thread) shows the module's memory: 30 s at most, never a race with a busy machine.
free, total = ctypes.c_size_t(), ctypes.c_size_t()
for _ in range(3000):
    rc = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    if rc != 0 or free.value == 256 << 20:
        break
    time.sleep(0.01)
rcs.append(rc)
rcs.append(cuda.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(512 << 20)))
print(*rcs, free.value >> 20)
"#;
    let (ok, stdout, stderr) = python_script(
        script,
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_LOG", "error"),
            ("FAKE_CUDA_MODULE_BYTES", "536870912"),
        ],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(
        stdout.trim(),
        "0 0 0 2 256",
        "256 MiB + the module's 512 MiB leave 256 MiB: 512 MiB more are refused\n{stderr}"
    );
}
