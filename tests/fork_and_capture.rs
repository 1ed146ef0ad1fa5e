//! Fork and capture: a program that forks, or captures its streams into graphs, keeps
//! working under the library as it does natively. A forked child never hangs (whatever
//! another thread of the parent was doing), has a working NVML and charges the context
//! it creates; a capture is never invalidated by the library's own queries, allocations
//! captured into a graph are graph nodes (not memory), and a capture starting during a
//! free keeps the block charged.

use crate::util;

use util::scripts::{NVML_BLIND, budget_without_rereads, holds_a_gibibyte_with, python_script};
use util::{MI, budget_run};
const MODULE_300MI: (&str, &str) = ("FAKE_CUDA_MODULE_BYTES", "314572800");
/// What the context costs in these tests: 512 MiB.
const CTX: &str = "536870912";

/// `fork()` while another thread is inside the library's denial path (which holds the
/// pool's lock across driver and NVML calls): the child never waits for that lock in
/// its at-fork handler, not even a child that only calls `_exit`.
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
    let (ok, stdout, stderr) = python_script(
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

/// A capture in global mode with stream-ordered allocations and frees inside works as
/// natively: the library's own pool queries never invalidate it (which the driver
/// would answer with 900 at the allocation and 901 at the end of the capture).
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

/// A stream-ordered free and the start of a capture of its stream by another thread:
/// the free either reaches the driver before the capture starts (the block is freed)
/// or is recorded into the graph (the block stays allocated, and charged). A capture
/// that starts between the library's look at the stream and the driver's call makes the
/// free a node of the graph, nothing freed: the block's 256 MiB must not go back to the
/// thread's credit, or its next allocation, paid from that credit, would make the pool
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

/// A child forked while the library's own thread is inside `nvmlInit` (which it calls
/// on a thread of its own after `cuInit`; the fake's holds NVML's lock `locked_ms`): the
/// script waits until that call has taken the lock (the fake's counter, a handshake),
/// forks, and notes whether the call had ended when `os.fork()` returned. The child calls
/// `cuMemAlloc`, `cuMemGetInfo`, `cuMemAlloc` past its budget (exit 4 if granted) and,
/// when `own_nvml`, NVML itself. Returns the child's
/// exit code (or `signal_N`, `hang`), whether NVML's initialisation had ended when the
/// fork returned, and how long `os.fork()` took, in ms (for the messages).
fn fork_during_nvml_start(locked_ms: &str, own_nvml: bool) -> (String, bool, u64) {
    let script = r#"
import ctypes, os, signal, time
{PRIMARY}
fake_nvml = ctypes.CDLL("libnvidia-ml.so.1")
deadline = time.monotonic() + 30
while fake_nvml.fake_nvml_inits_entered() == 0:
    assert time.monotonic() < deadline, "the library's thread never called nvmlInit"
    time.sleep(0.001)
t0 = time.monotonic()
pid = os.fork()
if pid == 0:
    signal.alarm(3)
    p = ctypes.c_uint64()
    if cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1 << 20)) == 0:
        cuda.cuMemFree_v2(p)
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    cuda.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t))
    # Over the budget: before a denial the library reads the footprint again, through
    # NVML where NVML is there for it (in a child without it, never).
    if cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(2 << 30)) == 0:
        os._exit(4)
    if {OWN}:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        os._exit(0 if nvml.nvmlInit_v2() == 0 else 3)
    os._exit(0)
waited = time.monotonic() - t0
ended = fake_nvml.fake_nvml_inits_done() > 0
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
print("status", status.replace(" ", "_"), "ended", int(ended), "waited_ms", int(waited * 1000))
"#
    .replace("{OWN}", if own_nvml { "True" } else { "False" });
    let envs = [
        ("CUDABUDGET_LIMIT", "1Gi"),
        ("CUDABUDGET_LOG", "error"),
        ("FAKE_NVML_INIT_LOCKED_MS", locked_ms),
    ];
    let (ok, stdout, stderr) = python_script(&script, &envs);
    assert!(ok, "{stdout}\n{stderr}");
    let fields: Vec<&str> = stdout.split_whitespace().collect();
    assert_eq!(fields.len(), 6, "{stdout}\n{stderr}");
    (
        fields[1].to_string(),
        fields[3] == "1",
        fields[5].parse().unwrap(),
    )
}

/// `fork()` while the library's own thread is inside NVML's initialisation, which holds
/// NVML's lock: a child that inherited that lock held would hang at its first NVML call
/// (as would the library's, and a `dlopen` half done in the parent would make the
/// child's `dlopen` fail ld.so's assertion, exit 127). The fork waits for the library's
/// thread to leave NVML, and the child's NVML works as it would without the library.
#[test]
fn a_fork_while_the_library_starts_nvml_leaves_the_child_a_working_nvml() {
    let (status, ended, waited) = fork_during_nvml_start("200", true);
    // A fork that waited on past NVML's initialisation would hang the script, which
    // `python_script` reports: no bound on the time is needed.
    assert!(
        ended,
        "the fork returned while NVML's initialisation held its lock (waited {waited} ms)"
    );
    assert_eq!(status, "0", "the child's own nvmlInit (waited {waited} ms)");
}

/// Where NVML stays inside a call longer than a fork waits (500 ms), the fork goes on
/// and the child does without NVML: the library makes no NVML call there (one would
/// hang on the lock the parent's thread held). NVML holds its lock 30 s here: the fork
/// must return before that call ends (an order, not a time bound).
#[test]
fn a_fork_that_cannot_wait_for_nvml_leaves_the_child_without_it_and_never_hangs() {
    let (status, ended, waited) = fork_during_nvml_start("30000", false);
    assert_eq!(status, "0", "the child (the fork waited {waited} ms)");
    assert!(
        !ended,
        "the fork waited for NVML's initialisation to end instead of at most about 500 ms: \
         {waited} ms"
    );
}

/// A graph launched into a capture runs nothing (it becomes a node of the captured
/// graph): the budget neither admits nor refuses it, the driver answers (the fake: 801).
/// Outside a capture the same launch is refused.
#[test]
fn a_graph_launched_into_a_capture_is_the_drivers_business() {
    let run = budget_without_rereads(
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

/// While a capture is under way a stream-ordered allocation on the capturing stream is a
/// graph node, not memory: the thread's credit is not spent on it (nor lost), and the
/// books return to zero after a trim.
#[test]
fn an_allocation_captured_into_a_graph_spends_no_credit() {
    let run = budget_without_rereads(
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
    let (ok, stdout, stderr) = util::python_under_library(
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
fn the_library_makes_no_query_of_its_own_during_a_capture() {
    // A first look-up, a limit and a second context during a capture are passed through
    // unmeasured (the footprint re-read counts them later): the library asks the driver
    // nothing while a capture is on. The client's `setlimit` reads the limit back itself:
    // one query.
    let run = budget_run(
        "gpa",
        &[
            "libload",
            "stream:1",
            "capture:0:relaxed",
            "libglobal:0",
            "ctxcreate:0",
            "ctxpop",
            "queries",
            "setlimit:2:268435456",
            "queries",
            "endcapture:0",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi"), MODULE_300MI, NVML_BLIND],
    );
    run.assert_completed();
    assert_eq!(run.rc("capture", 0), 0, "{run:?}");
    assert_eq!(run.rc("libglobal", 0), 0, "{run:?}");
    assert_eq!(run.rc("ctxcreate", 0), 0, "{run:?}");
    assert_eq!(run.num("queries", 0, "in_capture"), 0, "{run:?}");
    assert_eq!(run.rc("setlimit", 0), 0, "{run:?}");
    assert_eq!(run.num("queries", 1, "in_capture"), 1, "{run:?}");
    assert_eq!(run.rc("endcapture", 0), 0, "{run:?}");
}
