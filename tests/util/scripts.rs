//! Python `ctypes` programs against the fake driver under the library, and runs whose
//! books show exactly what the hooks charged.

use super::{GI, MI, Run, budget_run, python_under_library};

/// NVML is made to list this process under another pid, so the library never finds its
/// footprint when it reads it again: the books show exactly what the hooks charged,
/// however slowly the test runs (a re-read would hide an under-charge after a second).
pub const NVML_BLIND: (&str, &str) = ("FAKE_NVML_PID_OFFSET", "1000000");

/// Runs the client (`gpa` mode) under the library with [`NVML_BLIND`].
pub fn budget_without_rereads(ops: &[&str], envs: &[(&str, &str)]) -> Run {
    let mut all = envs.to_vec();
    all.push(NVML_BLIND);
    budget_run("gpa", ops, &all)
}

/// What most scripts start with, after `import ctypes`: the driver initialised, device
/// 0's primary context retained and current (`{PRIMARY}` in a script stands for it).
const PRIMARY: &str = r#"cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0"#;

/// `CUmemPoolProps` as `Props(alloc_type, handle_types, location_type, location_id)`
/// (`{POOL_PROPS}` in a script).
const POOL_PROPS: &str = r#"class Props(ctypes.Structure):
    _fields_ = [("alloc_type", ctypes.c_int), ("handle_types", ctypes.c_int),
                ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                ("win32", ctypes.c_void_p), ("max_size", ctypes.c_size_t),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 54)]"#;

/// Runs a Python `ctypes` program under the library with `{PRIMARY}` and `{POOL_PROPS}`
/// filled in; returns (success, stdout, stderr).
pub fn python_script(script: &str, envs: &[(&str, &str)]) -> (bool, String, String) {
    let script = script
        .replace("{PRIMARY}", PRIMARY)
        .replace("{POOL_PROPS}", POOL_PROPS);
    python_under_library(&script, envs)
}

/// `{PRELUDE}` of [`books_script`]: `{PRIMARY}`, `{POOL_PROPS}`, `threading` imported,
/// and helpers: `books(budget)` (what the books hold, in MiB, from `cuMemGetInfo`),
/// `alloc_async(n, pool=None)`, `alloc(n)` (both return `(rc, pointer)`),
/// `free_async(p)`, `MI`.
const PRELUDE: &str = r#"import ctypes, threading
{PRIMARY}
{POOL_PROPS}
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

/// Runs a Python program under the library with [`NVML_BLIND`]; `{PRELUDE}` in it stands
/// for the driver initialised, device 0's primary context current (`ctx`), `Props` and
/// the helpers of [`PRELUDE`]. Panics unless it succeeds; returns its output.
pub fn books_script(script: &str, envs: &[(&str, &str)]) -> String {
    let script = script.replace("{PRELUDE}", PRELUDE);
    let mut all = vec![NVML_BLIND];
    all.extend_from_slice(envs);
    let (ok, stdout, stderr) = python_script(&script, &all);
    assert!(
        ok,
        "the script failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stdout
}

/// The value of `key=` among the `key=value` words of `out`.
pub fn value_of(out: &str, key: &str) -> i64 {
    let prefix = format!("{key}=");
    out.split_whitespace()
        .find_map(|w| w.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no {key}= in\n{out}"))
        .parse()
        .unwrap_or_else(|_| panic!("{key}= is not a number in\n{out}"))
}

/// Fills the device with 32 MiB `cuMemAlloc`s until one is refused, then prints the
/// most the fake device ever held (`{FILL}` in a script).
pub const FILL: &str = r#"while cuda.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(32 << 20)) == 0:
    pass
cuda.fake_cuda_peak.restype = ctypes.c_ulonglong
print("peak", cuda.fake_cuda_peak(0))"#;

/// Runs `script` (which ends in `{FILL}`) under a 1 GiB budget with the fake driver's
/// `pause` (in `knob`: `FAKE_CUDA_PAUSE` or `FAKE_CUDA_PAUSE_AFTER`), and asserts that the
/// device never held more.
pub fn holds_a_gibibyte_with(pause: &str, script: &str, knob: &str) {
    let script = script.replace("{FILL}", FILL);
    let (ok, stdout, stderr) = python_script(
        &script,
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_LOG", "error"),
            (knob, pause),
        ],
    );
    assert!(ok, "{stdout}\n{stderr}");
    let peak: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("peak "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no peak in {stdout:?}"));
    assert!(
        peak <= GI,
        "the device held {} MiB under a 1 GiB budget\n{stderr}",
        peak / MI
    );
}
