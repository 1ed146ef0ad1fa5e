//! Stream capture and CUDA graphs: the captures the library must stay out of, and the
//! executable graphs whose memory nodes it charges at upload or launch.

use std::ffi::{c_char, c_int, c_void};

use super::guard;
use crate::admit::{capture, flow, graphs};
use crate::sys::driver::{CuResult, Device, Graph, GraphExec, GraphNode, Stream, real};

with_ptsz! {
    cuStreamBeginCapture_v2, driver, fn(stream: Stream, mode: c_int) {
        guard("cuStreamBeginCapture", || {
            // SAFETY: the caller's arguments.
            let real = || unsafe { driver(stream, mode) };
            let _cx = enter!(books, real);
            capture::begin(real)
        })
    }
}

with_ptsz! {
    cuStreamBeginCaptureToGraph, driver,
    fn(
        stream: Stream,
        graph: Graph,
        deps: *const GraphNode,
        data: *const c_void,
        n: usize,
        mode: c_int,
    ) {
        guard("cuStreamBeginCaptureToGraph", || {
            // SAFETY: the caller's arguments.
            let real =
                || unsafe { driver(stream, graph, deps, data, n, mode) };
            let _cx = enter!(books, real);
            capture::begin(real)
        })
    }
}

with_ptsz! {
    cuStreamEndCapture, driver, fn(stream: Stream, graph: *mut Graph) {
        guard("cuStreamEndCapture", || {
            // SAFETY: the caller's arguments.
            let real = || unsafe { driver(stream, graph) };
            let _cx = enter!(books, real);
            capture::end(real)
        })
    }
}

/// Remembers the memory and free nodes of a graph just instantiated into `exec`.
fn instantiated(exec: *mut GraphExec, graph: Graph, rc: CuResult) -> CuResult {
    if rc.is_ok() && !exec.is_null() {
        // SAFETY: the driver wrote the new executable graph.
        graphs::instantiated(unsafe { *exec }, graphs::memory_of(graph));
    }
    rc
}

/// # Safety
/// As the driver's `cuGraphInstantiateWithFlags`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    exec: *mut GraphExec,
    graph: Graph,
    flags: u64,
) -> CuResult {
    guard("cuGraphInstantiate", || {
        // SAFETY: the caller's arguments.
        let instantiate = || unsafe { real::cuGraphInstantiateWithFlags(exec, graph, flags) };
        let _cx = enter!(books, instantiate);
        instantiated(exec, graph, instantiate())
    })
}

with_ptsz! {
    cuGraphInstantiateWithParams, driver,
    fn(
        exec: *mut GraphExec,
        graph: Graph,
        params: *mut c_void,
    ) {
        guard("cuGraphInstantiate", || {
            // SAFETY: the caller's arguments.
            let instantiate = || unsafe { driver(exec, graph, params) };
            let _cx = enter!(books, instantiate);
            instantiated(exec, graph, instantiate())
        })
    }
}

/// # Safety
/// As the driver's `cuGraphInstantiate_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGraphInstantiate_v2(
    exec: *mut GraphExec,
    graph: Graph,
    error_node: *mut GraphNode,
    log: *mut c_char,
    log_size: usize,
) -> CuResult {
    guard("cuGraphInstantiate", || {
        // SAFETY: the caller's arguments.
        let instantiate =
            || unsafe { real::cuGraphInstantiate_v2(exec, graph, error_node, log, log_size) };
        let _cx = enter!(books, instantiate);
        instantiated(exec, graph, instantiate())
    })
}

/// # Safety
/// As the driver's `cuGraphExecDestroy`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGraphExecDestroy(exec: GraphExec) -> CuResult {
    guard("cuGraphExecDestroy", || {
        // SAFETY: the caller's argument.
        let destroy = || unsafe { real::cuGraphExecDestroy(exec) };
        let _cx = enter!(books, destroy);
        let rc = destroy();
        if rc.is_ok() {
            graphs::destroyed(exec);
        }
        rc
    })
}

with_ptsz! {
    cuGraphUpload, driver, fn(exec: GraphExec, stream: Stream) {
        guard("cuGraphUpload", || {
            // SAFETY: the caller's arguments.
            let launch = || unsafe { driver(exec, stream) };
            let cx = enter!(books, launch);
            flow::launch_graph(cx, "cuGraphUpload", false, exec, stream, launch)
        })
    }
}

with_ptsz! {
    cuGraphLaunch, driver, fn(exec: GraphExec, stream: Stream) {
        guard("cuGraphLaunch", || {
            // SAFETY: the caller's arguments.
            let launch = || unsafe { driver(exec, stream) };
            let cx = enter!(books, launch);
            flow::launch_graph(cx, "cuGraphLaunch", true, exec, stream, launch)
        })
    }
}

/// What the device's graphs give back is no longer charged.
///
/// # Safety
/// As the driver's `cuDeviceGraphMemTrim`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuDeviceGraphMemTrim(device: Device) -> CuResult {
    guard("cuDeviceGraphMemTrim", || {
        // SAFETY: the caller's argument.
        let trim = || unsafe { real::cuDeviceGraphMemTrim(device) };
        let cx = enter!(books, trim);
        let rc = crate::admit::program_trim(trim);
        if rc.is_ok() && device >= 0 {
            flow::graph_memory_changed(cx, device as usize);
        }
        rc
    })
}
