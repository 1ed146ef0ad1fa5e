//! Loaders: however a program finds the driver's functions (linked, `dlopen`/`dlsym`,
//! cudart's `cuGetProcAddress` for any variant, per-thread streams, XLA's `dlsym` of
//! concrete names, Python `ctypes`), it gets the library's hooks; functions the library
//! does not wrap are the driver's own; a third-party `RTLD_NEXT` wrapper keeps working;
//! and programs that never touch CUDA are not disturbed.

use crate::util;

use util::{GI, budget_run, client, fake_dir, lib_path};

#[test]
fn cudart_style_resolution_hands_back_our_hook_for_the_variant_the_driver_chose() {
    let run = budget_run(
        "gpa",
        &[
            "sym:cuMemAlloc",
            "sym:cuMemGetInfo",
            "sym:cuMemAllocAsync",
            "sym:cuGetProcAddress",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(run.field("sym", 0, "lib"), "libcudabudget.so", "{run:?}");
    assert_eq!(run.field("sym", 0, "name"), "cuMemAlloc_v2");
    assert_eq!(run.field("sym", 1, "name"), "cuMemGetInfo_v2");
    assert_eq!(run.field("sym", 2, "name"), "cuMemAllocAsync");
    assert_eq!(run.field("sym", 3, "lib"), "libcudabudget.so");
    assert_eq!(run.field("sym", 3, "name"), "cuGetProcAddress_v2");
}

#[test]
fn per_thread_stream_variants_get_their_own_hooks() {
    let run = budget_run(
        "gpa-ptsz",
        &[
            "sym:cuMemAllocAsync",
            "sym:cuMemFreeAsync",
            "sym:cuMemcpyHtoD",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(run.field("sym", 0, "name"), "cuMemAllocAsync_ptsz");
    assert_eq!(run.field("sym", 0, "lib"), "libcudabudget.so");
    assert_eq!(run.field("sym", 1, "name"), "cuMemFreeAsync_ptsz");
    assert_eq!(run.field("sym", 2, "name"), "cuMemcpyHtoD_v2_ptds");
    assert_eq!(
        run.field("sym", 2, "lib"),
        "libcuda.so.1",
        "untouched: the driver's own"
    );
}

#[test]
fn the_legacy_cu_get_proc_address_is_wrapped_too() {
    let run = budget_run(
        "gpa-legacy",
        &["sym:cuMemAlloc", "sym:cuGetProcAddress", "alloc:9Gi"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(run.field("sym", 0, "name"), "cuMemAlloc_v2");
    assert_eq!(run.field("sym", 0, "lib"), "libcudabudget.so");
    assert_eq!(run.field("sym", 1, "lib"), "libcudabudget.so");
    assert_eq!(run.rc("alloc", 0), 2);
}

#[test]
fn functions_we_do_not_wrap_are_the_driver_s_own_pointers() {
    for mode in ["gpa", "dlsym", "linked"] {
        let run = budget_run(
            mode,
            &[
                "sym:cuLaunchKernel",
                "sym:cuStreamCreate",
                "sym:cuCtxGetDevice",
                "sym:cuMemcpyHtoD_v2",
            ],
            &[("CUDABUDGET_LIMIT", "8Gi")],
        );
        for nth in 0..3 {
            assert_eq!(
                run.field("sym", nth, "lib"),
                "libcuda.so.1",
                "{mode} #{nth}\n{run:?}"
            );
        }
    }
}

#[test]
fn xla_style_dlsym_of_concrete_names_returns_our_hooks() {
    let run = budget_run(
        "dlsym",
        &[
            "sym:cuMemAlloc_v2",
            "sym:cuMemCreate",
            "sym:cuMemAllocFromPoolAsync",
            "sym:cuGetProcAddress_v2",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    for nth in 0..4 {
        assert_eq!(
            run.field("sym", nth, "lib"),
            "libcudabudget.so",
            "#{nth}\n{run:?}"
        );
    }
}

#[test]
fn a_name_the_driver_lacks_stays_missing() {
    let run = budget_run(
        "dlsym",
        &["sym:cuNoSuchFunction", "sym:cudnnCreate"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(run.rc("sym", 0), -1);
    assert_eq!(run.rc("sym", 1), -1);
}

#[test]
fn without_a_budget_cudart_gets_the_driver_s_own_functions() {
    let run = client("gpa", &["sym:cuMemAlloc", "alloc:1Gi"], &[], true);
    assert_eq!(run.field("sym", 0, "lib"), "libcuda.so.1");
    assert_eq!(run.rc("alloc", 0), 0);
}

#[test]
fn a_third_party_rtld_next_wrapper_still_works_under_the_preload() {
    let preload = format!("{}:{}", lib_path().display(), util::thirdparty_lib());
    let run = util::client_with_preload(
        "dlsym",
        &["pagesize", "alloc:9Gi"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
        &preload,
    );
    assert!(run.status.success(), "{run:?}");
    assert_eq!(run.num("pagesize", 0, "value"), 4096);
    assert_eq!(run.rc("alloc", 0), 2, "and the budget still holds");
}

#[test]
fn python_ctypes_reaches_the_same_hooks() {
    let script = r#"
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
p = ctypes.c_uint64()
a = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(5 << 30))
b = cuda.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(4 << 30))
free, total = ctypes.c_size_t(), ctypes.c_size_t()
c = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
d = cuda.cuMemFree_v2(p)
e = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(4 << 30))
print(a, b, c, total.value, free.value, d, e)
"#;
    let out = util::isolate(&mut std::process::Command::new("python3"))
        .args(["-c", script])
        .env("LD_LIBRARY_PATH", fake_dir())
        .env("LD_PRELOAD", lib_path())
        .env("CUDABUDGET_LIMIT", "8Gi")
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected = format!("0 2 0 {} {} 0 0", 8 * GI, 3 * GI);
    assert_eq!(stdout.trim(), expected);
}

#[test]
fn programs_that_never_touch_cuda_are_not_disturbed() {
    let out = util::isolate(&mut std::process::Command::new("sh"))
        .args(["-c", "echo hello; ls / > /dev/null"])
        .env("LD_PRELOAD", lib_path())
        .env("CUDABUDGET_LIMIT", "8Gi")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
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

#[test]
fn a_cuda_name_asked_of_a_library_that_lacks_it_is_missing_as_glibc_answers() {
    // dlsym on a non-CUDA library's handle (libm) for a name we wrap: glibc answers NULL,
    // and so must we, never our hook; the driver's handle still gets the hook.
    let script = r#"
import ctypes
def has(lib, name):
    try:
        getattr(lib, name)
        return "found"
    except AttributeError:
        return "missing"
libm = ctypes.CDLL("libm.so.6")
cuda = ctypes.CDLL("libcuda.so.1")
print(has(libm, "cuMemAlloc_v2"), has(libm, "nvmlDeviceGetMemoryInfo"), has(cuda, "cuMemAlloc_v2"))
"#;
    let (ok, stdout, stderr) = util::python_under_library(script, &[("CUDABUDGET_LIMIT", "8Gi")]);
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "missing missing found");
}
