//! Module and library loads, context limits (heap, stack), a second context and the
//! context where NVML cannot measure it: each counts against the budget at the call
//! that costs it (what the H200 measured, as the fake driver models it:
//! tests/fake_driver/README.md), and is given back when it goes.

use crate::util::{GI, MI, Run, budget_run};

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
fn a_stack_that_does_not_fit_is_refused_and_a_smaller_one_gives_memory_back() {
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
    assert_eq!(
        run.num("setlimit", 0, "now"),
        1024,
        "the old limit stays\n{run:?}"
    );
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
    // A "Fake H200": the H200's measured context (518 MiB).
    let envs = [
        ("FAKE_CUDA_DEVICE_NAME", "Fake H200"),
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
fn an_estimate_settled_where_nvml_cannot_measure_stays_whole_beside_earlier_allocations() {
    // As under MIG, with NVML slow to start: the context (648 MiB, its estimate too) is
    // charged the estimate, 100 MiB are admitted beside it before NVML is up, and NVML
    // then cannot measure the context. The estimate stays whole: the hooks' 100 MiB are
    // not taken out of it, so 1350 MiB more do not fit in 2 GiB.
    let run = budget_run(
        "gpa",
        &["alloc:100Mi", "alloc:1350Mi", "phys", "info"],
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_CONTEXT_MEMORY", "648Mi"),
            ("FAKE_NVML_FOREIGN_UUIDS", "1"),
            ("FAKE_NVML_INIT_DELAY_MS", "300"),
            ("FAKE_CUDA_CTX_BYTES", "679477248"),
        ],
    );
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
    assert!(run.num("phys", 0, "peak") <= 2 * GI, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), 2 * GI - 748 * MI, "{run:?}");
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
    // at its figure (100 MiB) once NVML has measured it, which the views wait for
    // (`infountil`, not a sleep that a busy machine could outlast).
    let measured = (2 * GI - 100 * MI).to_string();
    let run = budget_run(
        "gpa",
        &[
            "info",
            &format!("infountil:{measured}"),
            "alloc:1Mi",
            "info",
        ],
        &[
            ("FAKE_CUDA_DEVICE_NAME", "Fake H200"),
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("FAKE_NVML_INIT_DELAY_MS", "2500"),
            ("FAKE_CUDA_CTX_BYTES", "104857600"),
        ],
    );
    assert_eq!(run.num("info", 0, "free"), 2 * GI - 518 * MI, "{run:?}");
    assert_eq!(run.rc("infountil", 0), 0, "never measured\n{run:?}");
    assert_eq!(run.num("info", 1, "free"), 2 * GI - 101 * MI, "{run:?}");
}

// Loads, look-ups, unloads and limits: a library's charge is its own (never what another
// thread allocates meanwhile), every library is charged whatever the order of its
// look-ups, an unload gives back only its own charge, and limits can always shrink.

/// Runs `steps` in Python with the primary context of device 0 current, with helpers:
/// `load()` (a library, from `cuLibraryLoadData`), `lookup(lib)` (`cuLibraryGetGlobal`'s
/// return), `free_mib()` (what `cuMemGetInfo` says is free, in MiB) and
/// `meanwhile(call)` (runs `call` while another thread allocates 300 MiB 100 ms into it,
/// then frees that block again and returns `call`'s result). Returns the script's output.
fn library_script(steps: &str, envs: &[(&str, &str)]) -> String {
    let script = format!(
        r#"
import ctypes, threading, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
image = ctypes.create_string_buffer(b"fake image")
def load():
    lib = ctypes.c_void_p()
    assert cuda.cuLibraryLoadData(ctypes.byref(lib), image, None, None, 0, None, None, 0) == 0
    return lib
def lookup(lib):
    p, n = ctypes.c_uint64(), ctypes.c_size_t()
    return cuda.cuLibraryGetGlobal(ctypes.byref(p), ctypes.byref(n), lib, b"big")
def free_mib():
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    assert cuda.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)) == 0
    return f.value >> 20
def meanwhile(call):
    block = ctypes.c_uint64()
    def other():
        assert cuda.cuCtxSetCurrent(ctx) == 0
        time.sleep(0.1)
        assert cuda.cuMemAlloc_v2(ctypes.byref(block), ctypes.c_size_t(300 << 20)) == 0
    t = threading.Thread(target=other)
    t.start()
    out = call()
    t.join()
    assert cuda.cuMemFree_v2(block) == 0
    return out
{steps}
"#
    );
    let (ok, stdout, stderr) = crate::util::python_under_library(&script, envs);
    assert!(ok, "{stdout}\n{stderr}");
    stdout.trim().to_string()
}

#[test]
fn a_lazily_loaded_librarys_load_is_not_charged_with_what_another_thread_allocates_meanwhile() {
    // A lazy load brings nothing (cudart makes hundreds at start-up): it is not measured,
    // so the 300 MiB another thread allocates during it are not taken for the library's.
    let out = library_script(
        "lib = meanwhile(load)\nprint(free_mib())",
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("FAKE_CUDA_PAUSE", "cuLibraryLoadData:400"),
            MODULE_300MI,
            NVML_BLIND,
        ],
    );
    assert_eq!(out, "1024", "nothing stays charged once the block is freed");
}

#[test]
fn a_look_up_that_brings_nothing_is_not_charged_with_what_another_thread_allocates_meanwhile() {
    let envs = |eager| {
        let mut envs = vec![
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("FAKE_CUDA_PAUSE", "cuLibraryGetGlobal:400"),
            MODULE_300MI,
            NVML_BLIND,
        ];
        if eager {
            envs.push(("CUDA_MODULE_LOADING", "EAGER"));
        }
        envs
    };
    // Eager loading: the library's 300 MiB came at its load, and its first look-up
    // brings nothing.
    let out = library_script(
        "lib = load()\nprint(meanwhile(lambda: lookup(lib)), free_mib())",
        &envs(true),
    );
    assert_eq!(out, "0 724", "only the library's 300 MiB stay charged");
    // Lazy loading: the second look-up of a library brings nothing, while another
    // library's first look-up is still to come.
    let out = library_script(
        "a = load()\nassert lookup(a) == 0\nb = load()\nprint(meanwhile(lambda: lookup(a)), free_mib())",
        &envs(false),
    );
    assert_eq!(
        out, "0 724",
        "only the first library's 300 MiB stay charged"
    );
}

#[test]
fn where_the_driver_cannot_say_how_it_loads_a_librarys_first_look_up_is_still_measured() {
    // cuModuleGetLoadingMode fails: the load is measured as an eager one, finds nothing,
    // and the library's first look-up, which brings its globals, is measured too.
    let run = budget_run(
        "gpa",
        &["libload", "info", "libglobal:0", "info", "unload:0", "info"],
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("FAKE_CUDA_NO_LOADING_MODE", "1"),
            MODULE_300MI,
            NVML_BLIND,
        ],
    );
    run.assert_completed();
    assert_eq!(run.num("info", 0, "free"), GI, "{run:?}");
    assert_eq!(run.rc("libglobal", 0), 0, "{run:?}");
    assert_eq!(run.num("info", 1, "free"), GI - 300 * MI, "{run:?}");
    assert_eq!(run.num("info", 2, "free"), GI, "{run:?}");
}

#[test]
fn libraries_looked_up_in_another_order_than_they_were_loaded_are_each_charged() {
    let run = budget_run(
        "gpa",
        &[
            "libload",
            "libload",
            "libglobal:1",
            "libglobal:0",
            "phys",
            "info",
            "libload",
            "libglobal:2",
        ],
        &[("CUDABUDGET_LIMIT", "700Mi"), MODULE_300MI, NVML_BLIND],
    );
    assert_eq!(run.rc("libglobal", 1), 0, "{run:?}");
    assert_eq!(used(&run, 0), 600 * MI, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), 100 * MI, "{run:?}");
    assert_eq!(run.rc("libglobal", 2), 2, "a third does not fit\n{run:?}");
}

#[test]
fn unloading_a_library_or_a_module_leaves_the_others_charge_alone() {
    let envs = [("CUDABUDGET_LIMIT", "1Gi"), MODULE_300MI, NVML_BLIND];
    // The library never looked up holds nothing: its unload gives nothing back.
    let run = budget_run("gpa", &["modload", "libload", "unload:1", "info"], &envs);
    assert_eq!(run.rc("unload", 0), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), GI - 300 * MI, "{run:?}");
    // The module's unload leaves the library's first look-up to be charged.
    let run = budget_run(
        "gpa",
        &["modload", "libload", "unload:0", "libglobal:1", "info"],
        &envs,
    );
    assert_eq!(run.rc("libglobal", 0), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), GI - 300 * MI, "{run:?}");
}

#[test]
fn a_process_over_its_budget_can_still_shrink_its_limits_and_create_a_context_that_costs_nothing() {
    // The context's estimate (200 MiB) alone is over the 100 MiB budget: what frees
    // memory, or costs none, is never refused.
    let run = budget_run(
        "gpa",
        &[
            "info",
            "ctxcreate:0",
            "ctxpop",
            "setlimit:0:512",
            "setlimit:2:1048576",
        ],
        &[
            ("CUDABUDGET_LIMIT", "100Mi"),
            ("CUDABUDGET_CONTEXT_MEMORY", "200Mi"),
            ("FAKE_NVML_ABSENT", "1"),
        ],
    );
    assert_eq!(run.num("info", 0, "free"), 0, "{run:?}");
    assert_eq!(run.rc("ctxcreate", 0), 0, "{run:?}");
    assert_eq!(run.rc("setlimit", 0), 0, "{run:?}");
    assert_eq!(run.num("setlimit", 0, "now"), 512, "{run:?}");
    assert_eq!(run.rc("setlimit", 1), 0, "{run:?}");
    assert_eq!(run.num("setlimit", 1, "now"), MI, "{run:?}");
}

#[test]
fn a_heap_shrunk_below_its_default_gives_back_only_what_was_charged() {
    // 248 MiB charged for the heap above its 8 MiB default, given back when it returns
    // to 8 MiB; the 7 MiB below the default were never charged and are not given back.
    let run = budget_run(
        "gpa",
        &[
            "alloc:100Mi",
            "info",
            "setlimit:2:268435456",
            "info",
            "setlimit:2:8388608",
            "setlimit:2:1048576",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi"), NVML_BLIND],
    );
    run.assert_completed();
    assert_eq!(run.num("info", 0, "free"), GI - 100 * MI, "{run:?}");
    assert_eq!(run.num("info", 1, "free"), GI - 348 * MI, "{run:?}");
    assert_eq!(run.num("info", 2, "free"), GI - 100 * MI, "{run:?}");
}

#[test]
fn after_the_last_context_goes_new_loads_are_charged_and_given_back_as_ever() {
    // A library looked up before the reset; after it, a new one's first look-up is
    // measured.
    let run = budget_run(
        "gpa",
        &[
            "libload",
            "libglobal:0",
            "ctxreset:0",
            "ctx:0",
            "libload",
            "libglobal:1",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi"), MODULE_300MI, NVML_BLIND],
    );
    run.assert_completed();
    assert_eq!(run.num("info", 0, "free"), GI - 300 * MI, "{run:?}");
    // The driver hands the module's handle out again after the reset: the new module's
    // unload gives its charge back.
    let run = budget_run(
        "gpa",
        &[
            "modload",
            "ctxreset:0",
            "ctx:0",
            "modload",
            "info",
            "unload:1",
            "info",
        ],
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("FAKE_CUDA_REUSE_HANDLES", "1"),
            MODULE_300MI,
            NVML_BLIND,
        ],
    );
    run.assert_completed();
    assert_eq!(
        run.field("modload", 0, "ptr"),
        run.field("modload", 1, "ptr"),
        "the handle was reused\n{run:?}"
    );
    assert_eq!(run.num("info", 0, "free"), GI - 300 * MI, "{run:?}");
    assert_eq!(run.rc("unload", 0), 0, "{run:?}");
    assert_eq!(run.num("info", 1, "free"), GI, "{run:?}");
}

#[test]
fn the_end_of_one_devices_contexts_leaves_a_library_pending_on_another() {
    let run = budget_run(
        "gpa",
        &[
            "ctx:1",
            "libload",
            "ctx:0",
            "ctxreset:0",
            "ctx:1",
            "libglobal:0",
            "info",
        ],
        &[
            ("FAKE_CUDA_DEVICES", "2"),
            ("CUDABUDGET_LIMIT", "1Gi"),
            MODULE_300MI,
            NVML_BLIND,
        ],
    );
    run.assert_completed();
    assert_eq!(run.rc("libglobal", 0), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), GI - 300 * MI, "{run:?}");
}

#[test]
fn a_context_created_after_the_last_one_went_is_charged_once() {
    // The reset leaves the device without a context: the next one is the device's
    // first, charged as the context (its estimate), not measured on top.
    let run = budget_run(
        "gpa",
        &["info", "ctxreset:0", "ctxcreate:0", "info"],
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("FAKE_CUDA_CTX_BYTES", "314572800"),
            ("FAKE_NVML_ABSENT", "1"),
            ("CUDABUDGET_CONTEXT_MEMORY", "300Mi"),
        ],
    );
    run.assert_completed();
    assert_eq!(run.num("info", 0, "free"), GI - 300 * MI, "{run:?}");
    assert_eq!(run.rc("ctxcreate", 0), 0, "{run:?}");
    assert_eq!(run.num("info", 1, "free"), GI - 300 * MI, "{run:?}");
}

/// Two threads set the device heap at once: one shrinks it back to its 8 MiB default,
/// the other grows it to 512 MiB again, each reading the old limit first where the
/// library lets them (the fake driver orders the calls: both reads, then the shrink,
/// then the growth). Whichever limit stays, the books charge it: once a launch allocates
/// the heap, the view equals what the device holds, and an allocation of more than is
/// left never takes the device over the budget.
#[test]
fn two_threads_setting_the_heap_at_once_leave_it_charged_as_it_stays() {
    for limit in ["2", "1"] {
        let grow = format!("setlimit:{limit}:536870912");
        let race = format!("limitrace:{limit}:1048576:536870912");
        let run = budget_run(
            "gpa",
            &[
                &grow,
                &race,
                "kernel",
                "info",
                "phys",
                "alloc:600Mi",
                "phys",
            ],
            &[("CUDABUDGET_LIMIT", "1Gi"), NVML_BLIND],
        );
        run.assert_completed();
        assert_eq!(run.rc("setlimit", 0), 0, "{run:?}");
        assert_eq!(run.num("limitrace", 0, "first"), 0, "{run:?}");
        assert_eq!(run.num("limitrace", 0, "second"), 0, "{run:?}");
        assert_eq!(run.rc("kernel", 0), 0, "{run:?}");
        let now = run.num("limitrace", 0, "now");
        assert!(now == MI || now == 512 * MI, "{run:?}");
        assert_eq!(
            GI - run.num("info", 0, "free"),
            used(&run, 0),
            "the view is what the device holds (limit {limit} at {now})\n{run:?}"
        );
        assert!(run.num("phys", 1, "peak") <= GI, "over the budget\n{run:?}");
    }
}

/// A limit set while another thread allocates: the allocation (made inside the
/// driver's `cuCtxSetLimit`, where a measurement around the call would see it) is the
/// allocation's, never the limit's. Once it is freed and the limit set back, the books
/// read zero again (the context costs nothing here).
#[test]
fn a_limit_set_while_another_thread_allocates_charges_only_the_limit() {
    // The heap and the FIFO are charged their growth above their defaults (8 MiB, and
    // 8650752 B); the stack 3 KiB for each of the fake's 1024 threads.
    for (limit, value, back, charged) in [
        ("2", "16Mi", "8Mi", 8 * MI),
        ("1", "16Mi", "8650752", 16 * MI - 8650752),
        ("0", "4096", "1024", 3 * MI),
    ] {
        let set = format!("limitalloc:{limit}:{value}:100Mi");
        let back = format!("setlimit:{limit}:{back}");
        let run = budget_run(
            "gpa",
            &[&set, "info", "free:0", &back, "info", "phys"],
            &[("CUDABUDGET_LIMIT", "1Gi"), NVML_BLIND],
        );
        run.assert_completed();
        assert_eq!(run.rc("limitalloc", 0), 0, "{run:?}");
        assert_eq!(run.num("limitalloc", 0, "alloc"), 0, "{run:?}");
        assert_eq!(
            run.num("info", 0, "free"),
            GI - 100 * MI - charged,
            "limit {limit}\n{run:?}"
        );
        assert_eq!(run.rc("free", 0), 0, "{run:?}");
        assert_eq!(run.rc("setlimit", 0), 0, "{run:?}");
        assert_eq!(used(&run, 0), 0, "{run:?}");
        assert_eq!(
            run.num("info", 1, "free"),
            GI,
            "limit {limit}: books at zero\n{run:?}"
        );
    }
}

/// A second context's limits are its own: the stack set in it is charged, and given
/// back when the context is destroyed (the driver frees it then), while the device's
/// first context lives on.
#[test]
fn the_limits_of_a_destroyed_context_are_given_back_with_it() {
    let run = budget_run(
        "gpa",
        &[
            "ctxcreate:0",
            "setlimit:0:4096",
            "info",
            "ctxdestroy:0",
            "ctx:0",
            "phys",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi"), NVML_BLIND],
    );
    run.assert_completed();
    assert_eq!(run.rc("setlimit", 0), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), GI - 3 * MI, "{run:?}");
    assert_eq!(run.rc("ctxdestroy", 0), 0, "{run:?}");
    assert_eq!(used(&run, 0), 0, "{run:?}");
    assert_eq!(run.num("info", 1, "free"), GI, "{run:?}");
}
