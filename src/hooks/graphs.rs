//! Stream capture and CUDA graphs: the captures the library must stay out of, and the
//! executable graphs whose memory nodes it charges at upload or launch.

use std::ffi::{c_char, c_int, c_void};

use super::guard;
use crate::admit::{capture, flow, graphs};
use crate::runtime::Cx;
use crate::sys::driver::{CuResult, Device, Handle, real};

/// # Safety
/// As the driver's `cuStreamBeginCapture_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(stream: Handle, mode: c_int) -> CuResult {
    guard("cuStreamBeginCapture", || {
        // SAFETY: the caller's arguments.
        let real = || unsafe { real::cuStreamBeginCapture_v2(stream, mode) };
        let _cx = enter!(books, real);
        capture::begin(real)
    })
}

/// # Safety
/// As the driver's `cuStreamBeginCapture_v2_ptsz`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamBeginCapture_v2_ptsz(stream: Handle, mode: c_int) -> CuResult {
    guard("cuStreamBeginCapture", || {
        // SAFETY: the caller's arguments.
        let real = || unsafe { real::cuStreamBeginCapture_v2_ptsz(stream, mode) };
        let _cx = enter!(books, real);
        capture::begin(real)
    })
}

/// # Safety
/// As the driver's `cuStreamBeginCaptureToGraph`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamBeginCaptureToGraph(
    stream: Handle,
    graph: Handle,
    deps: *const Handle,
    data: *const c_void,
    n: usize,
    mode: c_int,
) -> CuResult {
    guard("cuStreamBeginCaptureToGraph", || {
        // SAFETY: the caller's arguments.
        let real =
            || unsafe { real::cuStreamBeginCaptureToGraph(stream, graph, deps, data, n, mode) };
        let _cx = enter!(books, real);
        capture::begin(real)
    })
}

/// # Safety
/// As the driver's `cuStreamBeginCaptureToGraph_ptsz`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamBeginCaptureToGraph_ptsz(
    stream: Handle,
    graph: Handle,
    deps: *const Handle,
    data: *const c_void,
    n: usize,
    mode: c_int,
) -> CuResult {
    guard("cuStreamBeginCaptureToGraph", || {
        // SAFETY: the caller's arguments.
        let real = || unsafe {
            real::cuStreamBeginCaptureToGraph_ptsz(stream, graph, deps, data, n, mode)
        };
        let _cx = enter!(books, real);
        capture::begin(real)
    })
}

/// # Safety
/// As the driver's `cuStreamEndCapture`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamEndCapture(stream: Handle, graph: *mut Handle) -> CuResult {
    guard("cuStreamEndCapture", || {
        // SAFETY: the caller's arguments.
        let real = || unsafe { real::cuStreamEndCapture(stream, graph) };
        let _cx = enter!(books, real);
        capture::end(real)
    })
}

/// # Safety
/// As the driver's `cuStreamEndCapture_ptsz`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamEndCapture_ptsz(stream: Handle, graph: *mut Handle) -> CuResult {
    guard("cuStreamEndCapture", || {
        // SAFETY: the caller's arguments.
        let real = || unsafe { real::cuStreamEndCapture_ptsz(stream, graph) };
        let _cx = enter!(books, real);
        capture::end(real)
    })
}

/// Remembers the memory and free nodes of a graph just instantiated into `exec`.
fn instantiated(_cx: Cx, exec: *mut Handle, graph: Handle, rc: CuResult) -> CuResult {
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
    exec: *mut Handle,
    graph: Handle,
    flags: u64,
) -> CuResult {
    guard("cuGraphInstantiate", || {
        // SAFETY: the caller's arguments.
        let instantiate = || unsafe { real::cuGraphInstantiateWithFlags(exec, graph, flags) };
        let cx = enter!(books, instantiate);
        instantiated(cx, exec, graph, instantiate())
    })
}

/// # Safety
/// As the driver's `cuGraphInstantiateWithParams`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGraphInstantiateWithParams(
    exec: *mut Handle,
    graph: Handle,
    params: *mut c_void,
) -> CuResult {
    guard("cuGraphInstantiate", || {
        // SAFETY: the caller's arguments.
        let instantiate = || unsafe { real::cuGraphInstantiateWithParams(exec, graph, params) };
        let cx = enter!(books, instantiate);
        instantiated(cx, exec, graph, instantiate())
    })
}

/// # Safety
/// As the driver's `cuGraphInstantiateWithParams_ptsz`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGraphInstantiateWithParams_ptsz(
    exec: *mut Handle,
    graph: Handle,
    params: *mut c_void,
) -> CuResult {
    guard("cuGraphInstantiate", || {
        // SAFETY: the caller's arguments.
        let instantiate =
            || unsafe { real::cuGraphInstantiateWithParams_ptsz(exec, graph, params) };
        let cx = enter!(books, instantiate);
        instantiated(cx, exec, graph, instantiate())
    })
}

/// # Safety
/// As the driver's `cuGraphInstantiate_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGraphInstantiate_v2(
    exec: *mut Handle,
    graph: Handle,
    error_node: *mut Handle,
    log: *mut c_char,
    log_size: usize,
) -> CuResult {
    guard("cuGraphInstantiate", || {
        // SAFETY: the caller's arguments.
        let instantiate =
            || unsafe { real::cuGraphInstantiate_v2(exec, graph, error_node, log, log_size) };
        let cx = enter!(books, instantiate);
        instantiated(cx, exec, graph, instantiate())
    })
}

/// # Safety
/// As the driver's `cuGraphExecDestroy`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGraphExecDestroy(exec: Handle) -> CuResult {
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

/// # Safety
/// As the driver's `cuGraphUpload`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGraphUpload(exec: Handle, stream: Handle) -> CuResult {
    guard("cuGraphUpload", || {
        // SAFETY: the caller's arguments.
        let launch = || unsafe { real::cuGraphUpload(exec, stream) };
        let cx = enter!(books, launch);
        flow::launch_graph(cx, "cuGraphUpload", false, exec, stream, launch)
    })
}

/// # Safety
/// As the driver's `cuGraphUpload_ptsz`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGraphUpload_ptsz(exec: Handle, stream: Handle) -> CuResult {
    guard("cuGraphUpload", || {
        // SAFETY: the caller's arguments.
        let launch = || unsafe { real::cuGraphUpload_ptsz(exec, stream) };
        let cx = enter!(books, launch);
        flow::launch_graph(cx, "cuGraphUpload", false, exec, stream, launch)
    })
}

/// # Safety
/// As the driver's `cuGraphLaunch`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGraphLaunch(exec: Handle, stream: Handle) -> CuResult {
    guard("cuGraphLaunch", || {
        // SAFETY: the caller's arguments.
        let launch = || unsafe { real::cuGraphLaunch(exec, stream) };
        let cx = enter!(books, launch);
        flow::launch_graph(cx, "cuGraphLaunch", true, exec, stream, launch)
    })
}

/// # Safety
/// As the driver's `cuGraphLaunch_ptsz`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGraphLaunch_ptsz(exec: Handle, stream: Handle) -> CuResult {
    guard("cuGraphLaunch", || {
        // SAFETY: the caller's arguments.
        let launch = || unsafe { real::cuGraphLaunch_ptsz(exec, stream) };
        let cx = enter!(books, launch);
        flow::launch_graph(cx, "cuGraphLaunch", true, exec, stream, launch)
    })
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
        let _cx = enter!(books, trim);
        let rc = crate::admit::program_trim(trim);
        if rc.is_ok() && device >= 0 {
            flow::graph_memory_changed(device as usize);
        }
        rc
    })
}
