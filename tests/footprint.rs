//! The whole footprint: device memory that no allocation call names — modules and
//! libraries, context limits, a second context, the context where NVML cannot measure it,
//! pool memory the driver gave back, memory a kernel launch grows — counts against the
//! budget, against the fake driver (which costs each of them what the H200 measured, at
//! the same call: tests/fake_driver/README.md).

mod util;

use util::{GI, MI, Run, budget_run};

/// NVML present and listing the process under another pid, so the footprint re-read
/// never finds it: what is charged here is what the hooks charged, however slowly the
/// test runs.
const NVML_BLIND: (&str, &str) = ("FAKE_NVML_PID_OFFSET", "100000");
const MODULE_300MI: (&str, &str) = ("FAKE_CUDA_MODULE_BYTES", "314572800");

fn used(run: &Run, nth: usize) -> u64 {
    run.num("phys", nth, "used")
}

#[test]
fn a_modules_globals_are_charged_at_its_load_and_given_back_at_its_unload() {
    let run = budget_run(
        "gpa",
        &[
            "modload", "modload", "modload", "modload", "phys", "info", "unload:0", "info",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi"), MODULE_300MI, NVML_BLIND],
    );
    for nth in 0..3 {
        assert_eq!(run.rc("modload", nth), 0, "{run:?}");
    }
    assert_eq!(run.rc("modload", 3), 2, "the fourth crosses 1 GiB\n{run:?}");
    assert_eq!(
        used(&run, 0),
        900 * MI,
        "the refused load was undone\n{run:?}"
    );
    assert_eq!(run.num("info", 0, "free"), GI - 900 * MI, "{run:?}");
    assert_eq!(run.rc("unload", 0), 0);
    assert_eq!(run.num("info", 1, "free"), GI - 600 * MI, "{run:?}");
}

#[test]
fn a_load_the_driver_refuses_returns_the_drivers_error() {
    // No current context: the driver refuses the load (201), and so does the hook.
    let run = budget_run(
        "gpa",
        &["ctxpop", "modload", "libload"],
        &[("CUDABUDGET_LIMIT", "1Gi"), MODULE_300MI, NVML_BLIND],
    );
    assert_eq!(run.rc("modload", 0), 201, "{run:?}");
    assert_eq!(run.rc("libload", 0), 201, "{run:?}");
}

#[test]
fn a_load_that_costs_nothing_is_never_refused() {
    // Over its budget already (its context's estimate alone is larger), the process
    // can still load a module that holds no device memory: there is nothing to refuse.
    let run = budget_run(
        "gpa",
        &["info", "modload", "alloc:1Mi"],
        &[
            ("CUDABUDGET_LIMIT", "100Mi"),
            ("CUDABUDGET_CONTEXT_MEMORY", "200Mi"),
            ("FAKE_NVML_ABSENT", "1"),
        ],
    );
    assert_eq!(run.num("info", 0, "free"), 0, "{run:?}");
    assert_eq!(run.rc("modload", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 2, "{run:?}");
}

#[test]
fn a_lazily_loaded_librarys_globals_are_charged_at_its_first_look_up() {
    let run = budget_run(
        "gpa",
        &[
            "libload",
            "info",
            "libglobal:0",
            "libkernel:0",
            "info",
            "libload",
            "libload",
            "libkernel:1",
            "libglobal:2",
            "phys",
            "info",
            "unload:2",
            "unload:0",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "700Mi"), MODULE_300MI, NVML_BLIND],
    );
    assert_eq!(run.rc("libload", 0), 0);
    assert_eq!(
        run.num("info", 0, "free"),
        700 * MI,
        "nothing loaded yet\n{run:?}"
    );
    assert_eq!(run.rc("libglobal", 0), 0);
    assert_eq!(run.rc("libkernel", 0), 0, "loaded already: costs nothing");
    assert_eq!(run.num("info", 1, "free"), 400 * MI, "{run:?}");
    assert_eq!(run.rc("libkernel", 1), 0, "{run:?}");
    // The third library's first look-up brings 300 MiB that do not fit: the look-up
    // fails, and what the driver holds for it stays charged until its unload.
    assert_eq!(run.rc("libglobal", 1), 2, "{run:?}");
    assert_eq!(used(&run, 0), 900 * MI, "{run:?}");
    assert_eq!(run.num("info", 2, "free"), 0, "{run:?}");
    assert_eq!(run.num("info", 3, "free"), 400 * MI, "{run:?}");
}

#[test]
fn with_eager_loading_a_library_that_does_not_fit_is_refused_at_its_load() {
    let run = budget_run(
        "gpa",
        &["libload", "libload", "libload", "phys", "info"],
        &[
            ("CUDABUDGET_LIMIT", "700Mi"),
            ("CUDA_MODULE_LOADING", "EAGER"),
            MODULE_300MI,
            NVML_BLIND,
        ],
    );
    assert_eq!(run.rc("libload", 1), 0, "{run:?}");
    assert_eq!(run.rc("libload", 2), 2, "{run:?}");
    assert_eq!(used(&run, 0), 600 * MI, "undone\n{run:?}");
}

#[test]
fn a_device_heap_that_does_not_fit_is_refused_and_the_old_limit_stays() {
    let run = budget_run(
        "gpa",
        &[
            "alloc:600Mi",
            "setlimit:2:536870912",
            "setlimit:2:268435456",
            "info",
            "kernel",
            "phys",
            "setlimit:1:134217728",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi"), NVML_BLIND],
    );
    // 600 MiB held: a 512 MiB heap (504 MiB over the 8 MiB default) does not fit.
    assert_eq!(run.rc("setlimit", 0), 2, "{run:?}");
    assert_eq!(
        run.num("setlimit", 0, "now"),
        8 * MI,
        "the old limit stays\n{run:?}"
    );
    assert_eq!(run.rc("setlimit", 1), 0, "{run:?}");
    assert_eq!(run.num("setlimit", 1, "now"), 256 * MI);
    assert_eq!(
        run.num("info", 0, "free"),
        GI - 600 * MI - 248 * MI,
        "charged when set\n{run:?}"
    );
    // The launch allocates it: the device then holds what was charged.
    assert_eq!(used(&run, 0), 600 * MI + 248 * MI, "{run:?}");
    // After a launch the driver refuses a change of the FIFO as of the heap.
    assert_eq!(run.rc("setlimit", 2), 1, "{run:?}");
}

#[test]
fn a_stack_that_does_not_fit_is_set_back_and_a_smaller_one_gives_memory_back() {
    // The fake pays a stack limit for 1024 threads: 64 KiB a thread is 63 MiB more.
    let run = budget_run(
        "gpa",
        &[
            "alloc:60Mi",
            "setlimit:0:65536",
            "phys",
            "setlimit:0:16384",
            "info",
            "setlimit:0:1024",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "100Mi"), NVML_BLIND],
    );
    assert_eq!(run.rc("setlimit", 0), 2, "{run:?}");
    assert_eq!(run.num("setlimit", 0, "now"), 1024, "set back\n{run:?}");
    assert_eq!(used(&run, 0), 60 * MI, "{run:?}");
    assert_eq!(run.rc("setlimit", 1), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), 40 * MI - 15 * MI, "{run:?}");
    assert_eq!(run.rc("setlimit", 2), 0);
    assert_eq!(run.num("info", 1, "free"), 40 * MI, "given back\n{run:?}");
}

#[test]
fn a_second_context_is_charged_and_refused_when_it_does_not_fit() {
    let envs = |limit| {
        [
            ("CUDABUDGET_LIMIT", limit),
            ("FAKE_CUDA_CTX_BYTES", "314572800"),
            ("FAKE_NVML_ABSENT", "1"),
            ("CUDABUDGET_CONTEXT_MEMORY", "300Mi"),
        ]
    };
    let run = budget_run("gpa", &["info", "ctxcreate:0", "info"], &envs("1Gi"));
    assert_eq!(run.num("info", 0, "free"), GI - 300 * MI, "{run:?}");
    assert_eq!(run.rc("ctxcreate", 0), 0);
    assert_eq!(run.num("info", 1, "free"), GI - 600 * MI, "{run:?}");

    let run = budget_run("gpa", &["ctxcreate:0", "phys", "info"], &envs("500Mi"));
    assert_eq!(run.rc("ctxcreate", 0), 2, "{run:?}");
    assert_eq!(
        used(&run, 0),
        300 * MI,
        "the second context was destroyed\n{run:?}"
    );
}

#[test]
fn without_nvml_the_context_is_charged_as_an_estimate_and_said_once() {
    // The fake calls itself "Fake H200": the H200's measured context (518 MiB).
    let envs = [
        ("CUDABUDGET_LIMIT", "2Gi"),
        ("FAKE_NVML_ABSENT", "1"),
        ("FAKE_CUDA_CTX_BYTES", "536870912"),
        ("CUDABUDGET_LOG", "info"),
    ];
    let run = budget_run("gpa", &["info", "alloc:1500Mi", "alloc:1Gi"], &envs);
    assert_eq!(run.num("info", 0, "free"), 2 * GI - 518 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0);
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
    let said = run
        .stderr
        .lines()
        .filter(|l| l.contains("NVML cannot measure"))
        .count();
    assert_eq!(said, 1, "{run:?}");

    // CUDABUDGET_CONTEXT_MEMORY states it.
    let mut envs = envs.to_vec();
    envs.push(("CUDABUDGET_CONTEXT_MEMORY", "700Mi"));
    let run = budget_run("gpa", &["info"], &envs);
    assert_eq!(run.num("info", 0, "free"), 2 * GI - 700 * MI, "{run:?}");
}

#[test]
fn where_nvml_is_up_but_does_not_know_the_device_the_context_is_charged_as_an_estimate() {
    // As under MIG: NVML starts, but CUDA's device (an instance) is none of NVML's
    // devices, so nothing measures the context. It is charged the estimate, never
    // taken to hold nothing.
    let run = budget_run(
        "gpa",
        &["sleep:300", "info", "alloc:1400Mi", "alloc:1Mi"],
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_CONTEXT_MEMORY", "648Mi"),
            ("FAKE_NVML_FOREIGN_UUIDS", "1"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
        ],
    );
    assert_eq!(run.num("info", 0, "free"), 2 * GI - 648 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
}

#[test]
fn a_malformed_context_memory_refuses_cuda() {
    let run = budget_run(
        "gpa",
        &["info"],
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_CONTEXT_MEMORY", "50%"),
        ],
    );
    assert_ne!(run.rc("init", 0), 0, "{run:?}");
    assert!(
        run.stderr.contains("CUDABUDGET_CONTEXT_MEMORY"),
        "{}",
        run.stderr
    );
}

#[test]
fn the_estimate_gives_way_to_nvmls_figure_once_nvml_is_up() {
    // NVML takes 2.5 s to start: the context is charged as an estimate meanwhile, then
    // at its figure (100 MiB) once the footprint is re-read.
    let run = budget_run(
        "gpa",
        &["info", "sleep:3200", "alloc:1Mi", "info"],
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("FAKE_NVML_INIT_DELAY_MS", "2500"),
            ("FAKE_CUDA_CTX_BYTES", "104857600"),
        ],
    );
    assert_eq!(run.num("info", 0, "free"), 2 * GI - 518 * MI, "{run:?}");
    assert_eq!(run.num("info", 1, "free"), 2 * GI - 101 * MI, "{run:?}");
}

#[test]
fn pool_memory_the_driver_gave_back_shows_as_free_within_a_second() {
    // Release threshold 0: the synchronize gives the pool's 128 MiB back to the device.
    let run = budget_run(
        "gpa",
        &[
            "info",
            "async:100Mi",
            "freeasync:0",
            "sync",
            "sleep:1100",
            "info",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi"), NVML_BLIND],
    );
    assert_eq!(used(&run, 0), 0, "{run:?}");
    assert_eq!(run.num("info", 1, "free"), GI, "{run:?}");
}
