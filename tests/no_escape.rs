//! No escape, no harm: each way a program once got past its budget (or was broken by
//! the library) is tried here, against the fake driver, and must no longer work.

mod util;

use util::{GI, MI, budget_run};

/// An allocation no budget could hold fails in the driver; it must not leave credit
/// behind that later allocations spend (it once gave back credit it never took).
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

/// Runs a Python `ctypes` program against the fake driver under the library.
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

fn python(script: &str, envs: &[(&str, &str)]) -> (bool, String, String) {
    let script = script
        .replace("{PRIMARY}", PRIMARY)
        .replace("{POOL_PROPS}", POOL_PROPS);
    util::python_under_library(&script, envs)
}

/// `fork()` while another thread is inside the library's denial path (which holds the
/// pool's lock across driver and NVML calls): the child must not wait for that lock. It
/// once hung in its at-fork handler, even a child that only calls `_exit`.
#[test]
fn a_fork_while_another_thread_is_being_denied_never_hangs_the_child() {
    let script = r#"
import ctypes, os, threading, time, warnings
warnings.simplefilter("ignore")
{PRIMARY}
held = ctypes.c_uint64()
assert cuda.cuMemAllocAsync(ctypes.byref(held), ctypes.c_size_t(800 << 20), None) == 0
stop = False
denials = 0
def deny():
    global denials
    assert cuda.cuCtxSetCurrent(ctx) == 0
    while not stop:
        p = ctypes.c_uint64()
        if cuda.cuMemAllocAsync(ctypes.byref(p), ctypes.c_size_t(512 << 20), None) == 2:
            denials += 1
threads = [threading.Thread(target=deny) for _ in range(2)]
for t in threads: t.start()
hung = 0
for i in range(40):
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    deadline = time.time() + 5
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WEXITSTATUS(status) == 7, status
            break
        if time.time() > deadline:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.001)
stop = True
for t in threads: t.join()
print("hung", hung, "denials", denials)
"#;
    let (ok, stdout, stderr) = python(
        script,
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_LOG", "error"),
            ("FAKE_NVML_PROC_DELAY_MS", "5"),
        ],
    );
    assert!(ok, "{stdout}\n{stderr}");
    let fields: Vec<&str> = stdout.split_whitespace().collect();
    assert_eq!(fields[..2], ["hung", "0"], "{stdout}\n{stderr}");
    assert_ne!(
        fields[3], "0",
        "the threads were denied meanwhile: {stdout}"
    );
}

/// `cudaDeviceReset` resets the primary context; beside a context from `cuCtxCreate`
/// that primary was never active, and its reset ends nothing the books count. It once
/// cleared the device's books, and a second 2.5 GiB then passed a 4 GiB budget.
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
    let (ok, stdout, stderr) = python(
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

/// A free the driver refuses leaves the block allocated, so its record must stay: here
/// a mipmapped array given to `cuArrayDestroy` (refused with `INVALID_VALUE`), then
/// destroyed correctly. The record was once dropped at the refusal, and the correct
/// destroy then never gave the charge back.
#[test]
fn a_free_the_driver_refuses_keeps_the_record_for_the_correct_free() {
    let script = r#"
import ctypes
{PRIMARY}
class Desc(ctypes.Structure):
    _fields_ = [("w", ctypes.c_size_t), ("h", ctypes.c_size_t), ("d", ctypes.c_size_t),
                ("fmt", ctypes.c_int), ("ch", ctypes.c_uint), ("flags", ctypes.c_uint)]
rcs = []
for _ in range(3):
    m = ctypes.c_void_p()
    # 16384 x 16384 floats, 1 level: 1 GiB
    rcs.append(cuda.cuMipmappedArrayCreate(ctypes.byref(m), ctypes.byref(Desc(16384, 16384, 0, 0x20, 1, 0)), 1))
    rcs.append(cuda.cuArrayDestroy(m))
    rcs.append(cuda.cuMipmappedArrayDestroy(m))
free, total = ctypes.c_size_t(), ctypes.c_size_t()
rcs.append(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
print(*rcs, free.value >> 20)
"#;
    let (ok, stdout, stderr) = python(
        script,
        &[("CUDABUDGET_LIMIT", "2Gi"), ("CUDABUDGET_LOG", "error")],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(
        stdout.trim(),
        "0 1 0 0 1 0 0 1 0 0 2048",
        "each 1 GiB array fits again after its correct destroy, and the books end empty\n{stderr}"
    );
}

/// Before refusing a `cuMemCreate`, the library asks the driver whether it would accept
/// the kind of request at all, with a real allocation of the smallest size. At the budget
/// that probe must not be made: it once took the process past its budget.
#[test]
fn the_cu_mem_create_probe_never_takes_the_process_past_its_budget() {
    let run = budget_run(
        "gpa",
        &["create:1Gi", "create:2Mi", "createfabric:2Mi", "phys"],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    assert_eq!(run.rc("create", 0), 0, "{run:?}");
    assert_eq!(run.rc("create", 1), 2, "{run:?}");
    assert_eq!(
        run.rc("createfabric", 0),
        2,
        "at the budget, the budget answers\n{run:?}"
    );
    assert!(run.num("phys", 0, "peak") <= GI, "{run:?}");
    // Below the budget the driver's own refusal still wins.
    let run = budget_run(
        "gpa",
        &["create:512Mi", "createfabric:1Gi"],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    assert_eq!(run.rc("createfabric", 0), 801, "{run:?}");
}

/// The library trims the pools before a denial; credit a thread kept for its next
/// stream-ordered allocations then stands for memory the pools gave back. That credit
/// was once spent as it was: the driver grew the pool by a 32 MiB step that nothing
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
    let (ok, stdout, stderr) = python(
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

/// The driver's refusal of a synchronous allocation (here the card itself is full)
/// leaves nothing charged: the budget is whole afterwards.
#[test]
fn a_synchronous_allocation_the_driver_refuses_charges_nothing() {
    let run = budget_run(
        "gpa",
        &["alloc:1536Mi", "info", "alloc:1Gi", "info"],
        &[("CUDABUDGET_LIMIT", "2Gi"), ("FAKE_CUDA_MEM", "1073741824")],
    );
    assert_eq!(run.rc("alloc", 0), 2, "the card has 1 GiB\n{run:?}");
    assert_eq!(run.num("info", 0, "free"), GI, "nothing charged\n{run:?}");
    assert_eq!(run.rc("alloc", 1), 0, "{run:?}");
    assert_eq!(run.num("info", 1, "free"), 0, "{run:?}");
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
    let (ok, stdout, stderr) = python(
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
    let (ok, stdout, stderr) = python(
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

/// A capture in global mode with stream-ordered allocations and frees inside works as
/// natively: the library's own pool queries once invalidated it (900 at the allocation,
/// 901 at the end of the capture).
#[test]
fn a_global_capture_of_stream_ordered_memory_works_under_the_library() {
    let ops = [
        "stream",
        "async:64Mi",
        "freeasync:0",
        "capture:0:global",
        "asyncon:0:256Mi",
        "freeasyncon:0:1",
        "asyncon:0:128Mi",
        "capturing:0",
        "endcapture:0",
        "instantiate:0",
        "launch:0:0",
        "streamsync:0",
        "launch:0:0",
        "streamsync:0",
    ];
    let native = util::client("gpa", &ops, &[("CUDABUDGET_LIMIT", "1Gi")], false);
    let run = budget_run("gpa", &ops, &[("CUDABUDGET_LIMIT", "1Gi")]);
    for op in [
        "asyncon",
        "freeasyncon",
        "endcapture",
        "instantiate",
        "launch",
    ] {
        for nth in 0..run.lines_of(op).len() {
            assert_eq!(
                run.rc(op, nth),
                native.rc(op, nth),
                "{op} #{nth} as natively\n{run:?}\nnative: {native:?}"
            );
        }
    }
    assert_eq!(run.rc("endcapture", 0), 0, "{run:?}");
    assert_eq!(run.num("capturing", 0, "status"), 1, "{run:?}");
}

/// Graph memory counts: a graph whose memory node fits runs, and its reserve is charged;
/// one that would cross the budget is refused at upload and launch with
/// `CUDA_ERROR_OUT_OF_MEMORY`, and the device never holds more than the budget.
#[test]
fn graph_memory_is_charged_and_a_graph_past_the_budget_is_refused() {
    let run = budget_run(
        "gpa",
        &[
            "graph",
            "memnode:0:512Mi",
            "instantiate:0",
            "launch:0:null",
            "alloc:600Mi",
            "graph",
            "memnode:1:1536Mi",
            "instantiate:1",
            "upload:1:null",
            "launch:1:null",
            "graphmem:0",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    assert_eq!(run.rc("instantiate", 0), 0, "{run:?}");
    assert_eq!(
        run.rc("launch", 0),
        0,
        "512 MiB of graph memory fit\n{run:?}"
    );
    assert_eq!(
        run.rc("alloc", 0),
        2,
        "the graph's 512 MiB are charged: 600 MiB more do not fit\n{run:?}"
    );
    assert_eq!(run.rc("instantiate", 1), 0, "{run:?}");
    assert_eq!(run.rc("upload", 0), 2, "{run:?}");
    assert_eq!(run.rc("launch", 1), 2, "{run:?}");
    assert!(run.num("phys", 0, "peak") <= GI, "{run:?}");
}

/// The card is shared: what other processes hold is not free for this one, whatever
/// its budget says. The views never show more free memory than the card really has.
#[test]
fn the_views_never_show_more_free_memory_than_the_card_has() {
    let run = budget_run(
        "gpa",
        &["info", "alloc:1Gi", "info", "nvml:0"],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("FAKE_CUDA_MEM", "10737418240"),
            ("FAKE_CUDA_OTHER_USED", "7516192768"),
        ],
    );
    assert_eq!(run.num("info", 0, "total"), 8 * GI, "{run:?}");
    assert_eq!(
        run.num("info", 0, "free"),
        3 * GI,
        "10 - 7 GiB are free\n{run:?}"
    );
    assert_eq!(run.num("info", 1, "free"), 2 * GI, "{run:?}");
    let line = run.line("nvml", 0).to_string();
    assert!(run.num("nvml", 0, "free") <= 2 * GI, "{line}");
    assert!(
        run.num("nvml", 0, "free") + run.num("nvml", 0, "used") <= run.num("nvml", 0, "total"),
        "{line}"
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
time.sleep(1.2)
free, total = ctypes.c_size_t(), ctypes.c_size_t()
rcs.append(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
rcs.append(cuda.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(512 << 20)))
print(*rcs, free.value >> 20)
"#;
    let (ok, stdout, stderr) = python(
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
    let (ok, stdout, stderr) = python(
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

/// `cuMemAllocPitch`: the driver picks the pitch. The reservation assumes 512-byte rows;
/// a wider pitch is charged in full after the call, a narrower one gives the difference
/// back.
#[test]
fn a_pitched_allocation_is_charged_by_the_pitch_the_driver_chose() {
    // 2048-byte rows for 1000 bytes of width: 256 MiB reserved, 512 MiB allocated.
    let run = budget_run(
        "gpa",
        &["pitch:1000:262144", "alloc:600Mi", "info"],
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("FAKE_CUDA_PITCH_ALIGN", "2048"),
        ],
    );
    assert_eq!(run.rc("pitch", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 2, "512 + 600 MiB do not fit\n{run:?}");
    assert_eq!(run.num("info", 0, "free"), 512 * MI, "{run:?}");
    // 256-byte rows for 200 bytes: 1 GiB reserved, 512 MiB allocated.
    let run = budget_run(
        "gpa",
        &["pitch:200:2097152", "alloc:512Mi", "info"],
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("FAKE_CUDA_PITCH_ALIGN", "256"),
        ],
    );
    assert_eq!(run.rc("pitch", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "the difference came back\n{run:?}");
    assert_eq!(run.num("info", 0, "free"), 0, "{run:?}");
}

/// An array handle the driver hands out again after a context teardown (which destroyed
/// the array it named) must not find the old array's record: its destroy once gave back
/// the old array's size (100 MiB for a 1 MiB array), and the next allocation passed the
/// budget. The fake driver reuses handles here (`FAKE_CUDA_REUSE_HANDLES`).
#[test]
fn an_array_handle_reused_after_a_teardown_releases_its_own_size() {
    let script = r#"
import ctypes
class Desc(ctypes.Structure):
    _fields_ = [("w", ctypes.c_size_t), ("h", ctypes.c_size_t), ("fmt", ctypes.c_int), ("ch", ctypes.c_uint)]
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
def primary():
    ctx = ctypes.c_void_p()
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0
primary()
big, small = ctypes.c_void_p(), ctypes.c_void_p()
# 8192 x 3200 floats: 100 MiB; 1024 x 256 floats: 1 MiB.
assert cuda.cuArrayCreate_v2(ctypes.byref(big), ctypes.byref(Desc(8192, 3200, 0x20, 1))) == 0
assert cuda.cuDevicePrimaryCtxReset_v2(0) == 0
primary()
assert cuda.cuArrayCreate_v2(ctypes.byref(small), ctypes.byref(Desc(1024, 256, 0x20, 1))) == 0
a, b = ctypes.c_uint64(), ctypes.c_uint64()
first = cuda.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t(1000 << 20))
destroyed = cuda.cuArrayDestroy(small)
second = cuda.cuMemAlloc_v2(ctypes.byref(b), ctypes.c_size_t(100 << 20))
print(big.value == small.value, first, destroyed, second)
"#;
    let (ok, stdout, stderr) = python(
        script,
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_LOG", "error"),
            ("FAKE_CUDA_REUSE_HANDLES", "1"),
        ],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(
        stdout.trim(),
        "True 0 0 2",
        "the handle came back; 1000 MiB + 100 MiB do not fit in 1 GiB\n{stderr}"
    );
}

/// Fills the device with 32 MiB `cuMemAlloc`s until one is refused, then prints the
/// most the fake device ever held (`{FILL}` in a script).
const FILL: &str = r#"while cuda.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(32 << 20)) == 0:
    pass
cuda.fake_cuda_peak.restype = ctypes.c_ulonglong
print("peak", cuda.fake_cuda_peak(0))"#;

/// Runs `script` (which ends in `{FILL}`) under a 1 GiB budget with the fake driver's
/// `pause` (in `knob`: `FAKE_CUDA_PAUSE` or `FAKE_CUDA_PAUSE_AFTER`), and asserts that the
/// device never held more.
fn holds_a_gibibyte_with(pause: &str, script: &str, knob: &str) {
    let script = script.replace("{FILL}", FILL);
    let (ok, stdout, stderr) = python(
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

/// A stream-ordered allocation decides which pool pays before its driver call; a switch
/// of the device's current pool (`cuDeviceSetMemPool`) that lands in between once made
/// the driver grow the new pool with nothing charged for it. The driver's call is held
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
/// look at its use and its end, once kept memory the books had given back. The driver's
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

/// A stream-ordered free and the start of a capture of its stream by another thread:
/// the free either reaches the driver before the capture starts (the block is freed)
/// or is recorded into the graph (the block stays allocated, and charged). Once, a
/// capture that started between the library's look at the stream and the driver's call
/// made the free a node of the graph, nothing freed, yet the block's 256 MiB went back
/// to the thread's credit: its next allocation, paid from that credit, made the pool
/// grow with nothing charged (128 MiB here). The driver's free is held for 300 ms here, and the capture
/// started meanwhile. The thread that frees is the one that allocated (`freer_allocated`:
/// the fast path) or another (the full path).
fn a_capture_starting_during_a_free(freer_allocated: bool) {
    let script = r#"
import ctypes, threading, time
{PRIMARY}
stream = ctypes.c_void_p()
assert cuda.cuStreamCreate(ctypes.byref(stream), 0) == 0
block = ctypes.c_uint64()
def allocate():
    assert cuda.cuMemAllocAsync(ctypes.byref(block), ctypes.c_size_t(256 << 20), stream) == 0
ready, freed, ended = threading.Event(), threading.Event(), threading.Event()
rcs = []
def free():
    assert cuda.cuCtxSetCurrent(ctx) == 0
    if FREER_ALLOCATED:
        allocate()
        ready.set()
    rcs.append(cuda.cuMemFreeAsync(block, stream))
    freed.set()
    ended.wait()
    again = ctypes.c_uint64()
    rcs.append(cuda.cuMemAllocAsync(ctypes.byref(again), ctypes.c_size_t(128 << 20), stream))
if not FREER_ALLOCATED:
    allocate()
    ready.set()
t = threading.Thread(target=free)
t.start()
ready.wait()
time.sleep(0.1)
assert cuda.cuStreamBeginCapture_v2(stream, 0) == 0
freed.wait()
graph = ctypes.c_void_p()
assert cuda.cuStreamEndCapture(stream, ctypes.byref(graph)) == 0
assert cuda.cuGraphDestroy(graph) == 0
ended.set()
t.join()
assert rcs == [0, 0], rcs
{FILL}
"#
    .replace(
        "FREER_ALLOCATED",
        if freer_allocated { "True" } else { "False" },
    );
    holds_a_gibibyte_with("cuMemFreeAsync:300", &script, "FAKE_CUDA_PAUSE");
}

#[test]
fn a_capture_starting_during_a_free_by_the_allocating_thread_keeps_the_block_charged() {
    a_capture_starting_during_a_free(true);
}

#[test]
fn a_capture_starting_during_a_free_by_another_thread_keeps_the_block_charged() {
    a_capture_starting_during_a_free(false);
}

/// A graph whose free node names a block the program has already freed, launched while
/// another thread's allocation gets that address from the driver: the new block stays
/// charged. Once, the launch's bookkeeping after the driver's answer removed whatever
/// was recorded at the free node's address — the new block, 256 MiB — and gave its
/// charge back. The launch's return is held for 300 ms here, and the allocation made
/// meanwhile.
#[test]
fn an_allocation_at_a_graph_free_nodes_address_during_its_launch_stays_charged() {
    let script = r#"
import ctypes, threading, time
{PRIMARY}
block = ctypes.c_uint64()
assert cuda.cuMemAlloc_v2(ctypes.byref(block), ctypes.c_size_t(256 << 20)) == 0
graph = ctypes.c_void_p()
assert cuda.cuGraphCreate(ctypes.byref(graph), 0) == 0
node = ctypes.c_void_p()
assert cuda.cuGraphAddMemFreeNode(ctypes.byref(node), graph, None, ctypes.c_size_t(0), block) == 0
exe = ctypes.c_void_p()
assert cuda.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, ctypes.c_uint64(0)) == 0
assert cuda.cuMemFree_v2(block) == 0
again = ctypes.c_uint64()
rcs = []
def reuse():
    assert cuda.cuCtxSetCurrent(ctx) == 0
    time.sleep(0.1)
    rcs.append(cuda.cuMemAlloc_v2(ctypes.byref(again), ctypes.c_size_t(256 << 20)))
t = threading.Thread(target=reuse)
t.start()
cuda.cuGraphLaunch(exe, None)
t.join()
assert rcs == [0], rcs
assert again.value == block.value, "the driver gave the freed address again"
{FILL}
"#;
    holds_a_gibibyte_with("cuGraphLaunch:300", script, "FAKE_CUDA_PAUSE_AFTER");
}

/// Creates a 256 MiB VMM handle `h` on device 0 and reserves `va` for it (`{VMM}`).
const VMM: &str = r#"h = ctypes.c_uint64()
assert cuda.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(256 << 20), ctypes.byref(Props(1, 0, 1, 0)), ctypes.c_uint64(0)) == 0
va = ctypes.c_uint64()
assert cuda.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(256 << 20), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)) == 0
def map_it():
    return cuda.cuMemMap(va, ctypes.c_size_t(256 << 20), ctypes.c_size_t(0), h, ctypes.c_uint64(0))"#;

/// A handle mapped by one thread and released by another while the driver's map is
/// returning: the mapping keeps the memory. The books once saw the release before the
/// mapping and gave the 256 MiB back while the driver kept them.
#[test]
fn a_release_racing_a_map_keeps_the_mapped_memory_charged() {
    let script = r#"
import ctypes, threading, time
{PRIMARY}
{POOL_PROPS}
{VMM}
rcs = []
t = threading.Thread(target=lambda: rcs.append(map_it()))
t.start()
time.sleep(0.1)
rcs.append(cuda.cuMemRelease(h))
t.join()
assert rcs == [0, 0], rcs
{FILL}
"#
    .replace("{VMM}", VMM);
    holds_a_gibibyte_with("cuMemMap:300", &script, "FAKE_CUDA_PAUSE_AFTER");
}

/// A reference taken by one thread (`cuMemRetainAllocationHandle`) while another
/// releases and unmaps: the new reference keeps the memory. The books once counted the
/// reference after the release and unmap had given the memory back.
#[test]
fn a_retain_racing_a_release_keeps_the_memory_charged() {
    let script = r#"
import ctypes, threading, time
{PRIMARY}
{POOL_PROPS}
{VMM}
assert map_it() == 0
rcs = []
def retain():
    r = ctypes.c_uint64()
    rcs.append(cuda.cuMemRetainAllocationHandle(ctypes.byref(r), ctypes.c_void_p(va.value)))
t = threading.Thread(target=retain)
t.start()
time.sleep(0.1)
rcs.append(cuda.cuMemRelease(h))
rcs.append(cuda.cuMemUnmap(va, ctypes.c_size_t(256 << 20)))
t.join()
assert rcs == [0, 0, 0], rcs
{FILL}
"#
    .replace("{VMM}", VMM);
    holds_a_gibibyte_with(
        "cuMemRetainAllocationHandle:300",
        &script,
        "FAKE_CUDA_PAUSE_AFTER",
    );
}

/// A child forked 100 ms after `cuInit` (the library starts NVML on a thread of its own
/// then, whose `nvmlInit` holds NVML's lock `locked_ms`), which calls `cuMemAlloc`,
/// `cuMemGetInfo` and, when `own_nvml`, NVML itself: the child's exit code (or
/// `signal_N`, `hang`) and how long `os.fork()` took, in ms.
fn fork_during_nvml_start(locked_ms: &str, own_nvml: bool) -> (String, u64) {
    let script = r#"
import ctypes, os, signal, time
{PRIMARY}
time.sleep(0.1)
t0 = time.monotonic()
pid = os.fork()
if pid == 0:
    signal.alarm(3)
    p = ctypes.c_uint64()
    if cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1 << 20)) == 0:
        cuda.cuMemFree_v2(p)
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    cuda.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t))
    if {OWN}:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        os._exit(0 if nvml.nvmlInit_v2() == 0 else 3)
    os._exit(0)
waited = time.monotonic() - t0
deadline = time.monotonic() + 8
status = "hang"
while time.monotonic() < deadline:
    done, st = os.waitpid(pid, os.WNOHANG)
    if done:
        status = f"signal {os.WTERMSIG(st)}" if os.WIFSIGNALED(st) else str(os.WEXITSTATUS(st))
        break
    time.sleep(0.005)
if status == "hang":
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print("status", status.replace(" ", "_"), "waited_ms", int(waited * 1000))
"#
    .replace("{OWN}", if own_nvml { "True" } else { "False" });
    let envs = [
        ("CUDABUDGET_LIMIT", "1Gi"),
        ("CUDABUDGET_LOG", "error"),
        ("FAKE_NVML_INIT_LOCKED_MS", locked_ms),
    ];
    let (ok, stdout, stderr) = python(&script, &envs);
    assert!(ok, "{stdout}\n{stderr}");
    let fields: Vec<&str> = stdout.split_whitespace().collect();
    assert_eq!(fields.len(), 4, "{stdout}\n{stderr}");
    (fields[1].to_string(), fields[3].parse().unwrap())
}

/// `fork()` while the library's own thread is inside NVML's initialisation, which holds
/// NVML's lock: the child once inherited that lock held, and its own first NVML call
/// hung (as would the library's: a `dlopen` half done in the parent also made the child's
/// `dlopen` fail ld.so's assertion, exit 127). The fork now waits for the library's
/// thread to leave NVML, and the child's NVML works as it would without the library.
#[test]
fn a_fork_while_the_library_starts_nvml_leaves_the_child_a_working_nvml() {
    let (status, waited) = fork_during_nvml_start("400", true);
    assert_eq!(status, "0", "the child's own nvmlInit (waited {waited} ms)");
    assert!(
        waited < 1500,
        "the fork waited for NVML's initialisation to end, no longer: {waited} ms"
    );
}

/// Where NVML stays inside a call longer than a fork waits (500 ms), the fork goes on
/// and the child does without NVML: the library makes no NVML call there (one would
/// hang on the lock the parent's thread held).
#[test]
fn a_fork_that_cannot_wait_for_nvml_leaves_the_child_without_it_and_never_hangs() {
    let (status, waited) = fork_during_nvml_start("2500", false);
    assert_eq!(status, "0", "the child (the fork waited {waited} ms)");
    assert!(
        waited < 1500,
        "the fork waited at most about 500 ms: {waited} ms"
    );
}
