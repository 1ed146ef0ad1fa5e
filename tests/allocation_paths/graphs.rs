//! Graphs: a graph's memory nodes are charged, a graph past the budget is refused at
//! upload and launch, a free node frees at launch (not at upload), and a trim gives the
//! graph reserve back.

use crate::util::scripts::{budget_without_rereads, holds_a_gibibyte_with};
use crate::util::{GI, MI, budget_run};

/// `cuDeviceGraphMemTrim` gives the graph reserve back to the driver, and to the budget.
#[test]
fn a_graph_memory_trim_gives_the_reserve_back() {
    let run = budget_without_rereads(
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

/// A graph's free node frees its outside block when the graph is launched, not when it
/// is uploaded: until then the block stays charged and the budget holds.
#[test]
fn a_graph_free_node_frees_at_launch_not_at_upload() {
    let run = budget_without_rereads(
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
