//! Self-tests of the fake CUDA driver, fake NVML and the C clients, run WITHOUT cudabudget:
//! the other integration tests rely on these semantics.

use crate::util;

use util::{GIB, KIB, MIB, client};

const MODES: &[&str] = &["gpa", "gpa-ptsz", "gpa-legacy", "dlsym", "linked"];

#[test]
fn every_loading_mode_resolves_and_allocates() {
    for mode in MODES {
        let r = client(
            mode,
            &["alloc:1Gi", "phys", "info", "free:0", "phys"],
            &[],
            None,
        );
        r.assert_completed();
        assert_eq!(r.rc("init", 0), 0, "{mode}");
        assert_eq!(r.rc("alloc", 0), 0, "{mode}");
        assert_eq!(r.num("phys", 0, "used"), GIB, "{mode}");
        assert_eq!(r.num("info", 0, "total"), 80 * GIB, "{mode}");
        assert_eq!(r.num("info", 0, "free"), 79 * GIB, "{mode}");
        assert_eq!(r.rc("free", 0), 0, "{mode}");
        assert_eq!(r.num("phys", 1, "used"), 0, "{mode}");
        assert_eq!(r.num("phys", 1, "peak"), GIB, "{mode}");
    }
}

#[test]
fn cu_get_proc_address_picks_the_variant_for_the_requested_version() {
    let sym = |mode: &str, name: &str| {
        let r = client(mode, &[&format!("sym:{name}")], &[], None);
        r.assert_completed();
        (
            r.rc("sym", 0),
            r.field("sym", 0, "lib"),
            r.field("sym", 0, "name"),
        )
    };
    let found = |lib: &str, name: &str| (0, lib.to_owned(), name.to_owned());
    assert_eq!(
        sym("gpa", "cuMemAlloc"),
        found("libcuda.so.1", "cuMemAlloc_v2")
    );
    assert_eq!(
        sym("gpa", "cuCtxCreate"),
        found("libcuda.so.1", "cuCtxCreate_v4")
    );
    assert_eq!(
        sym("gpa-legacy", "cuCtxCreate"),
        found("libcuda.so.1", "cuCtxCreate_v3")
    );
    assert_eq!(
        sym("gpa", "cuGetProcAddress"),
        found("libcuda.so.1", "cuGetProcAddress_v2")
    );
    assert_eq!(
        sym("gpa-legacy", "cuDeviceGetUuid"),
        found("libcuda.so.1", "cuDeviceGetUuid_v2")
    );
    assert_eq!(
        sym("gpa", "cuMemAllocAsync"),
        found("libcuda.so.1", "cuMemAllocAsync")
    );
    assert_eq!(
        sym("gpa-ptsz", "cuMemAllocAsync"),
        found("libcuda.so.1", "cuMemAllocAsync_ptsz")
    );
    assert_eq!(
        sym("gpa-ptsz", "cuMemcpyHtoD"),
        found("libcuda.so.1", "cuMemcpyHtoD_v2_ptds")
    );
    assert_eq!(
        sym("gpa-ptsz", "cuMemAlloc"),
        found("libcuda.so.1", "cuMemAlloc_v2")
    );
    assert_eq!(
        sym("dlsym", "cuMemCreate"),
        found("libcuda.so.1", "cuMemCreate")
    );
    assert_eq!(
        sym("linked", "cuMemAlloc_v2"),
        found("libcuda.so.1", "cuMemAlloc_v2")
    );
    assert_eq!(sym("gpa", "cuNoSuchThing").0, -1);
    assert_eq!(
        sym("gpa", "cuMemAlloc_v2").0,
        -1,
        "gpa takes base names only"
    );
    assert_eq!(
        sym("dlsym", "cuMemAlloc").0,
        -1,
        "the driver exports no unversioned cuMemAlloc"
    );
}

/// In-process checks of what the client cannot reach: state before cuInit, status codes
/// of cuGetProcAddress_v2, and that the table points at the exported functions.
#[test]
fn driver_entry_points_behave_before_init_and_resolve_to_exports() {
    use std::ffi::{CString, c_char, c_int, c_void};
    type Gpa2 =
        unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;
    type Alloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
    type Used = unsafe extern "C" fn(c_int) -> u64;

    let path = CString::new(util::fake_cuda_lib()).unwrap();
    // SAFETY: loading the fake driver runs only its constructor (pthread_atfork).
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null());
    let sym = |name: &str| {
        let c = CString::new(name).unwrap();
        // SAFETY: h is a live handle; c is NUL-terminated.
        let p = unsafe { libc::dlsym(h, c.as_ptr()) };
        assert!(!p.is_null(), "{name} not exported");
        p
    };
    // SAFETY: the pointers come from the fake's exports, whose C signatures match these types.
    unsafe {
        let gpa2: Gpa2 = std::mem::transmute(sym("cuGetProcAddress_v2"));
        let alloc: Alloc = std::mem::transmute(sym("cuMemAlloc_v2"));
        let used: Used = std::mem::transmute(sym("fake_cuda_used"));
        let phys_used: Used = std::mem::transmute(sym("fake_cuda_phys_used"));
        assert_eq!(used(0), 0);
        assert_eq!(phys_used(0), 0);
        let mut p = 0u64;
        assert_eq!(alloc(&mut p, 4096), 3, "NOT_INITIALIZED before cuInit");

        let mut pfn: *mut c_void = std::ptr::null_mut();
        let mut status: c_int = -1;
        let name = CString::new("cuMemAlloc").unwrap();
        assert_eq!(gpa2(name.as_ptr(), &mut pfn, 13000, 0, &mut status), 0);
        assert_eq!(status, 0);
        assert_eq!(
            pfn,
            sym("cuMemAlloc_v2"),
            "table entry must be the exported function"
        );

        let name = CString::new("cuMemCreate").unwrap();
        assert_eq!(gpa2(name.as_ptr(), &mut pfn, 10000, 0, &mut status), 500);
        assert_eq!(status, 2, "VERSION_NOT_SUFFICIENT");
        assert!(pfn.is_null());

        let name = CString::new("cuBogus").unwrap();
        assert_eq!(gpa2(name.as_ptr(), &mut pfn, 13000, 0, &mut status), 500);
        assert_eq!(status, 1, "SYMBOL_NOT_FOUND");

        let name = CString::new("cuStreamSynchronize").unwrap();
        assert_eq!(gpa2(name.as_ptr(), &mut pfn, 13000, 2, &mut status), 0);
        assert_eq!(pfn, sym("cuStreamSynchronize_ptsz"));
    }
}

#[test]
fn synchronous_allocations_are_counted_and_refused_when_the_device_is_full() {
    let env = [("FAKE_CUDA_MEM", "4294967296")];
    let r = client(
        "gpa",
        &[
            "alloc:3Gi",
            "alloc:2Gi",
            "free:0",
            "alloc:2Gi",
            "pitch:1000:10",
            "managed:1Mi",
            "phys",
            "free:1",
            "free:1",
            "freeptr:0x1234",
            "free:2",
            "phys",
        ],
        &env,
        None,
    );
    r.assert_completed();
    assert_eq!(r.rc("alloc", 0), 0);
    assert_eq!(r.field("alloc", 0, "slot"), "0");
    assert_eq!(r.rc("alloc", 1), 2, "OUT_OF_MEMORY");
    assert!(
        r.line_opt("alloc", 1).unwrap().find("slot=").is_none(),
        "failures take no slot"
    );
    assert_eq!(r.rc("alloc", 2), 0);
    assert_eq!(r.field("alloc", 2, "slot"), "1");
    assert_eq!(r.num("pitch", 0, "pitch"), 1024);
    assert_eq!(r.field("pitch", 0, "slot"), "2");
    assert_eq!(r.num("phys", 0, "used"), 2 * GIB + 10 * 1024 + MIB);
    // The driver reuses a freed address (slot 1 got slot 0's), as the real one does.
    assert_eq!(r.field("alloc", 2, "ptr"), r.field("alloc", 0, "ptr"));
    assert_eq!(r.rc("free", 1), 0);
    assert_eq!(r.rc("free", 2), 1, "double free is INVALID_VALUE");
    assert_eq!(r.rc("freeptr", 0), 1, "unknown pointer is INVALID_VALUE");
    assert_eq!(
        r.num("phys", 1, "used"),
        MIB,
        "only the managed allocation is left"
    );
}

#[test]
fn pools_grow_in_32_mib_steps_and_keep_the_reserve_until_sync() {
    let r = client(
        "gpa",
        &[
            "async:4Ki",
            "reserve",
            "async:104857601",
            "reserve",
            "phys",
            "freeasync:0",
            "freeasync:1",
            "reserve",
            "phys",
            "sync",
            "reserve",
            "phys",
        ],
        &[],
        None,
    );
    r.assert_completed();
    assert_eq!(r.num("reserve", 0, "bytes"), 32 * MIB);
    assert_eq!(
        r.num("reserve", 1, "bytes"),
        128 * MIB,
        "4 KiB + 100 MiB + 1 B rounds to 128 MiB"
    );
    assert_eq!(r.num("phys", 0, "used"), 128 * MIB);
    assert_eq!(
        r.num("reserve", 2, "bytes"),
        128 * MIB,
        "free does not shrink the reserve"
    );
    assert_eq!(r.num("phys", 1, "used"), 128 * MIB);
    assert_eq!(r.rc("sync", 0), 0);
    assert_eq!(r.num("reserve", 3, "bytes"), 0);
    assert_eq!(r.num("phys", 2, "used"), 0);
}

#[test]
fn a_release_threshold_keeps_memory_until_a_synchronous_allocation_needs_it() {
    for mode in ["gpa", "gpa-ptsz", "dlsym"] {
        let r = client(
            mode,
            &[
                "threshold:max",
                "poolasync:3Gi",
                "freeasync:0",
                "sync",
                "reserve",
                "phys",
                "alloc:3Gi",
                "reserve",
                "phys",
            ],
            &[("FAKE_CUDA_MEM", "4294967296")],
            None,
        );
        r.assert_completed();
        assert_eq!(r.rc("threshold", 0), 0);
        assert_eq!(
            r.num("reserve", 0, "bytes"),
            3 * GIB,
            "{mode}: kept above threshold max"
        );
        assert_eq!(r.num("phys", 0, "used"), 3 * GIB);
        assert_eq!(
            r.rc("alloc", 0),
            0,
            "{mode}: the driver trims its pools for a synchronous alloc"
        );
        assert_eq!(r.num("reserve", 1, "bytes"), 0);
        assert_eq!(r.num("phys", 1, "used"), 3 * GIB);
    }
}

#[test]
fn pool_growth_fails_when_the_device_is_full_and_trim_gives_memory_back() {
    let r = client(
        "gpa",
        &[
            "threshold:max",
            "async:1Gi",
            "async:1Gi",
            "freeasync:0",
            "trim:0",
            "reserve",
            "newpool",
            "poolasyncin:0:10Mi",
            "phys",
            "sync",
            "phys",
        ],
        &[("FAKE_CUDA_MEM", "1610612736")],
        None,
    );
    r.assert_completed();
    assert_eq!(r.rc("async", 1), 2);
    assert_eq!(r.num("reserve", 0, "bytes"), 0);
    assert_eq!(r.rc("newpool", 0), 0);
    assert_eq!(r.rc("poolasyncin", 0), 0);
    assert_eq!(r.num("phys", 0, "used"), 32 * MIB);
    assert_eq!(
        r.num("phys", 1, "used"),
        32 * MIB,
        "live allocations keep their chunk"
    );
}

#[test]
fn vmm_memory_returns_only_after_release_and_unmap() {
    let r = client(
        "gpa",
        &[
            "create:2Gi",
            "map:0",
            "phys",
            "release:0",
            "phys",
            "unmap:0",
            "phys",
            "create:4Mi",
            "release:1",
            "phys",
            "create:3Mi",
            "createfabric:2Mi",
            "createhost:2Mi",
            "create:100Gi",
            "phys",
            "release:1",
        ],
        &[],
        None,
    );
    r.assert_completed();
    assert_eq!(r.rc("create", 0), 0);
    assert_eq!(r.rc("map", 0), 0);
    assert_eq!(r.num("phys", 0, "used"), 2 * GIB);
    assert_eq!(r.rc("release", 0), 0);
    assert_eq!(r.num("phys", 1, "used"), 2 * GIB, "still mapped");
    assert_eq!(r.rc("unmap", 0), 0);
    assert_eq!(r.num("phys", 2, "used"), 0);
    assert_eq!(
        r.num("phys", 3, "used"),
        0,
        "released unmapped handle frees at once"
    );
    assert_eq!(r.rc("create", 2), 1, "size must be a multiple of 2 MiB");
    assert_eq!(r.rc("createfabric", 0), 801, "FABRIC is NOT_SUPPORTED");
    assert_eq!(r.rc("createhost", 0), 0);
    assert_eq!(r.rc("create", 3), 2, "OUT_OF_MEMORY after validation");
    assert_eq!(
        r.num("phys", 4, "used"),
        0,
        "host memory is not device memory"
    );
    assert_eq!(r.rc("release", 2), 1, "double release is INVALID_VALUE");
}

#[test]
fn arrays_are_sized_from_their_descriptors() {
    let r = client(
        "dlsym",
        &[
            "array:1024:1024:0x20:4",
            "phys",
            "destroy:0",
            "array:16:0:32:1",
            "phys",
            "destroy:1",
            "array3d:64:64:64:0x10:2",
            "phys",
            "destroy:2",
            "mipmap:256:256:0:0x01:1:3",
            "phys",
            "destroy:3",
            "array:16:16:7:1",
            "phys",
        ],
        &[],
        None,
    );
    r.assert_completed();
    assert_eq!(r.num("phys", 0, "used"), 16 * MIB);
    assert_eq!(r.num("phys", 1, "used"), 64, "height 0 is a 1D array");
    assert_eq!(r.num("phys", 2, "used"), 64 * 64 * 64 * 2 * 2);
    assert_eq!(r.num("phys", 3, "used"), 256 * 256 + 128 * 128 + 64 * 64);
    assert_eq!(
        r.lines_of("destroy")
            .iter()
            .filter(|l| l.contains("rc=0"))
            .count(),
        4
    );
    assert_eq!(r.rc("array", 2), 1, "unknown format");
    assert_eq!(r.num("phys", 4, "used"), 0);
}

#[test]
fn nvml_reports_the_memory_the_process_holds() {
    for mode in ["gpa", "linked"] {
        let r = client(mode, &["nvml:0", "alloc:1Gi", "nvml:0"], &[], None);
        r.assert_completed();
        assert_eq!(r.rc("nvml", 0), 0);
        assert_eq!(r.num("nvml", 0, "used"), 0);
        assert_eq!(r.num("nvml", 1, "used"), GIB, "{mode}");
        assert_eq!(r.num("nvml", 1, "total"), 80 * GIB);
        assert_eq!(r.num("nvml", 1, "free"), 79 * GIB);
        assert_eq!(r.num("nvml", 1, "used2"), GIB);
        assert_eq!(r.num("nvml", 1, "free2"), 79 * GIB);
    }
}

#[test]
fn context_bytes_are_charged_while_the_primary_context_is_retained() {
    let r = client(
        "gpa",
        &[
            "nvml:0",
            "ctx:0",
            "nvml:0",
            "ctxrelease:0",
            "nvml:0",
            "ctxrelease:0",
            "nvml:0",
            "ctxrelease:0",
        ],
        &[("FAKE_CUDA_CTX_BYTES", "536870912")],
        None,
    );
    r.assert_completed();
    assert_eq!(r.num("nvml", 0, "used"), 512 * MIB);
    assert_eq!(
        r.num("nvml", 1, "used"),
        512 * MIB,
        "second retain charges nothing"
    );
    assert_eq!(r.num("nvml", 2, "used"), 512 * MIB);
    assert_eq!(r.num("nvml", 3, "used"), 0);
    assert_eq!(r.rc("ctxrelease", 2), 201);
}

#[test]
fn two_devices_are_counted_separately() {
    let r = client(
        "gpa",
        &[
            "ctx:1",
            "alloc:1Gi",
            "phys",
            "info",
            "ctx:0",
            "phys",
            "total:1",
            "ctx:2",
            "nvml:0",
            "nvml:1",
        ],
        &[("FAKE_CUDA_DEVICES", "2")],
        None,
    );
    r.assert_completed();
    assert_eq!(r.num("phys", 0, "used"), GIB);
    assert_eq!(r.num("info", 0, "free"), 79 * GIB);
    assert_eq!(r.num("phys", 1, "used"), 0);
    assert_eq!(r.num("total", 0, "bytes"), 80 * GIB);
    assert_eq!(r.rc("ctx", 2), 101, "INVALID_DEVICE");
    assert_eq!(r.num("nvml", 0, "used"), 0);
    assert_eq!(r.num("nvml", 1, "used"), GIB);
    let ptr = r.num("alloc", 0, "ptr");
    assert!(
        ptr >= 0x7f00_0000_0000 + (1 << 40),
        "device 1 pointers come from its own range: {ptr:#x}"
    );
}

#[test]
fn cuda_visible_devices_renumbers_devices_but_not_nvml() {
    for cvd in [
        "1",
        "GPU-faceb00c-0000-0000-0000-000000000001",
        "1,0",
        "GPU-faceb00c-0000-0000-0000-000000000001,0",
    ] {
        let r = client(
            "gpa",
            &["alloc:1Gi", "nvml:0", "nvml:1", "ctx:1", "phys"],
            &[("FAKE_CUDA_DEVICES", "2"), ("CUDA_VISIBLE_DEVICES", cvd)],
            None,
        );
        r.assert_completed();
        assert_eq!(r.num("nvml", 0, "used"), 0, "{cvd}");
        assert_eq!(
            r.num("nvml", 1, "used"),
            GIB,
            "{cvd}: ordinal 0 is physical 1"
        );
        if cvd.contains(',') {
            assert_eq!(r.rc("ctx", 0), 0);
            assert_eq!(
                r.num("phys", 0, "used"),
                0,
                "{cvd}: ordinal 1 is physical 0"
            );
        } else {
            assert_eq!(r.rc("ctx", 0), 101, "{cvd}: one device visible");
        }
    }
    let r = client("gpa", &["alloc:1Gi"], &[("CUDA_VISIBLE_DEVICES", "")], None);
    assert!(r.status.success());
    assert_eq!(
        r.lines,
        vec!["init rc=100"],
        "no visible device: cuInit fails, no ops run"
    );
}

#[test]
fn concurrent_allocations_never_exceed_the_device() {
    let env = [("FAKE_CUDA_MEM", "1073741824")];
    let r = client(
        "linked",
        &["race:8:200:256Mi", "phys", "racehold:8:64Mi", "phys"],
        &env,
        None,
    );
    r.assert_completed();
    assert_eq!(r.num("race", 0, "ok") + r.num("race", 0, "denied"), 1600);
    assert_eq!(r.num("race", 0, "other"), 0);
    assert_eq!(r.num("phys", 0, "used"), 0);
    assert!(r.num("phys", 0, "peak") <= GIB);
    assert_eq!(r.num("racehold", 0, "ok"), 16);
    assert_eq!(r.num("racehold", 0, "held_max"), GIB);
    assert_eq!(r.num("racehold", 0, "other"), 0);
    assert_eq!(r.num("phys", 1, "used"), 0);
}

#[test]
fn a_hundred_thousand_live_allocations_are_tracked() {
    let env = [("FAKE_CUDA_MEM", &*(100_000 * 4 * KIB).to_string())];
    let r = client("dlsym", &["racehold:4:4Ki", "phys"], &env, None);
    r.assert_completed();
    assert_eq!(r.num("racehold", 0, "ok"), 100_000);
    assert_eq!(r.num("phys", 0, "used"), 0);
    assert_eq!(r.num("phys", 0, "peak"), 100_000 * 4 * KIB);
}

#[test]
fn the_thirdparty_preload_forwards_through_rtld_next() {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let r = client(
        "gpa",
        &["pagesize", "pagesize"],
        &[("LD_PRELOAD", util::thirdparty_lib())],
        None,
    );
    r.assert_completed();
    assert_eq!(r.num("pagesize", 1, "value"), page as u64);
    assert_eq!(r.num("pagesize", 1, "calls"), 2);
}

#[test]
fn unparsable_ops_exit_2_before_running_anything() {
    for bad in ["bogus", "alloc:12Qi", "alloc", "free:5"] {
        let r = client("gpa", &["alloc:1Mi", bad], &[], None);
        assert_eq!(r.status.code(), Some(2), "{bad}: {}", r.dump());
        assert!(!r.stderr.is_empty());
    }
    let r = client("gpa", &["bogus"], &[], None);
    assert!(r.lines.is_empty(), "unknown op names are refused up front");
    let r = client("linked-nope", &[], &[], None);
    assert_eq!(r.status.code(), Some(2));
}

#[test]
fn new_entry_points_resolve_in_every_mode() {
    let sym = |mode: &str, name: &str| {
        let r = client(mode, &[&format!("sym:{name}")], &[], None);
        r.assert_completed();
        (
            r.rc("sym", 0),
            r.field("sym", 0, "lib"),
            r.field("sym", 0, "name"),
        )
    };
    let found = |name: &str| (0, "libcuda.so.1".to_owned(), name.to_owned());
    for (mode, base, variant) in [
        ("gpa", "cuGraphInstantiate", "cuGraphInstantiateWithFlags"),
        (
            "gpa-legacy",
            "cuGraphInstantiate",
            "cuGraphInstantiateWithFlags",
        ),
        (
            "gpa",
            "cuGraphInstantiateWithParams",
            "cuGraphInstantiateWithParams",
        ),
        (
            "gpa-ptsz",
            "cuGraphInstantiateWithParams",
            "cuGraphInstantiateWithParams_ptsz",
        ),
        ("gpa", "cuStreamBeginCapture", "cuStreamBeginCapture_v2"),
        (
            "gpa-ptsz",
            "cuStreamBeginCapture",
            "cuStreamBeginCapture_v2_ptsz",
        ),
        ("gpa-ptsz", "cuStreamEndCapture", "cuStreamEndCapture_ptsz"),
        (
            "gpa-ptsz",
            "cuStreamIsCapturing",
            "cuStreamIsCapturing_ptsz",
        ),
        ("gpa", "cuGraphLaunch", "cuGraphLaunch"),
        ("gpa-ptsz", "cuGraphLaunch", "cuGraphLaunch_ptsz"),
        ("gpa-ptsz", "cuGraphUpload", "cuGraphUpload_ptsz"),
        ("gpa", "cuStreamGetDevice", "cuStreamGetDevice"),
        ("gpa-ptsz", "cuStreamGetCtx", "cuStreamGetCtx_ptsz"),
        (
            "gpa",
            "cuThreadExchangeStreamCaptureMode",
            "cuThreadExchangeStreamCaptureMode",
        ),
        ("gpa", "cuDeviceGraphMemTrim", "cuDeviceGraphMemTrim"),
        (
            "gpa-legacy",
            "cuMemRetainAllocationHandle",
            "cuMemRetainAllocationHandle",
        ),
        ("dlsym", "cuGraphAddMemAllocNode", "cuGraphAddMemAllocNode"),
        (
            "dlsym",
            "cuMemRetainAllocationHandle",
            "cuMemRetainAllocationHandle",
        ),
        (
            "linked",
            "cuDeviceGetGraphMemAttribute",
            "cuDeviceGetGraphMemAttribute",
        ),
        ("linked", "cuStreamGetDevice_ptsz", "cuStreamGetDevice_ptsz"),
    ] {
        assert_eq!(sym(mode, base), found(variant), "{mode} {base}");
    }
    assert_eq!(
        sym("gpa-legacy", "cuStreamGetDevice").0,
        -1,
        "cuStreamGetDevice is 12.8: not there for a 12.0 request"
    );
    // The client resolves every function it calls (new ones included) at start, in each mode.
    for mode in MODES {
        let r = client(mode, &["stream", "graph"], &[], None);
        r.assert_completed();
        assert_eq!(r.rc("stream", 0), 0, "{mode}");
        assert_eq!(r.rc("graph", 0), 0, "{mode}");
    }
}

#[test]
fn streams_belong_to_their_context_and_stream_ordered_memory_to_the_streams_device() {
    let r = client(
        "gpa",
        &[
            "stream",
            "ctx:1",
            "stream",
            "streaminfo:0",
            "streaminfo:1",
            "streaminfo:null",
            "streaminfo:ptds",
            "asyncon:0:1Gi",
            "nvml:0",
            "nvml:1",
            "newpool",
            "ctx:0",
            "poolasyncon:null:0:64Mi",
            "nvml:1",
            "freeasyncon:1:0",
            "freeasyncon:legacy:1",
            "streamsync:0",
            "streamsync:1",
            "nvml:0",
            "nvml:1",
            "ctxcreate:0",
            "stream",
            "streaminfo:2",
            "streaminfo:legacy",
            "ctxdestroy:0",
            "streaminfo:2",
            "asyncon:2:1Mi",
            "streamsync:2",
            "streamdestroy:2",
            "streamdestroy:0",
            "streamsync:0",
        ],
        &[("FAKE_CUDA_DEVICES", "2")],
        None,
    );
    r.assert_completed();
    let info = |n| {
        (
            r.rc("streaminfo", n),
            r.num("streaminfo", n, "dev"),
            r.field("streaminfo", n, "ctx"),
        )
    };
    assert_eq!(info(0), (0, 0, "p0".to_owned()));
    assert_eq!(info(1), (0, 1, "p1".to_owned()));
    assert_eq!(
        info(2),
        (0, 1, "p1".to_owned()),
        "NULL: the current context"
    );
    assert_eq!(
        info(3),
        (0, 1, "p1".to_owned()),
        "per-thread: the current context"
    );
    assert_eq!(r.rc("asyncon", 0), 0);
    assert_eq!(
        r.num("nvml", 0, "used"),
        GIB,
        "from the pool of stream 0's device, not the current one"
    );
    assert_eq!(r.num("nvml", 1, "used"), 0);
    assert_eq!(r.rc("poolasyncon", 0), 0);
    assert_eq!(
        r.num("nvml", 2, "used"),
        64 * MIB,
        "a pool of device 1 allocates on device 1 whatever the stream"
    );
    assert_eq!(r.rc("freeasyncon", 0), 0, "freed on another stream");
    assert_eq!(r.rc("freeasyncon", 1), 0);
    assert_eq!(r.rc("streamsync", 0), 0);
    assert_eq!(
        r.num("nvml", 3, "used"),
        0,
        "stream 0's sync trims device 0"
    );
    assert_eq!(
        r.num("nvml", 4, "used"),
        0,
        "stream 1's sync trims device 1"
    );
    assert_eq!(
        info(4),
        (0, 0, "c0".to_owned()),
        "a stream of a created context"
    );
    assert_eq!(info(5), (0, 0, "c0".to_owned()));
    assert_eq!(
        r.rc("streaminfo", 6),
        400,
        "the stream died with its context"
    );
    assert_eq!(r.rc("asyncon", 1), 400);
    assert_eq!(r.rc("streamsync", 2), 400);
    assert_eq!(r.rc("streamdestroy", 0), 400);
    assert_eq!(r.rc("streamdestroy", 1), 0);
    assert_eq!(r.rc("streamsync", 3), 400, "a destroyed stream");
}

#[test]
fn a_capture_turns_stream_ordered_calls_into_graph_nodes() {
    let r = client(
        "gpa",
        &[
            "stream",
            "capture:null:global",
            "capture:legacy:global",
            "capture:ptds:global",
            "capture:0:global",
            "capture:0:relaxed",
            "capturing:0",
            "capturing:null",
            "asyncon:0:1Gi",
            "phys",
            "freeasyncon:0:0",
            "freeasyncon:0:0",
            "asyncon:0:0",
            "asyncon:0:1Ti",
            "alloc:8Mi",
        ],
        &[],
        None,
    );
    r.assert_completed();
    assert_eq!(
        r.rc("capture", 0),
        900,
        "the NULL stream cannot be captured"
    );
    assert_eq!(r.rc("capture", 1), 900, "nor the legacy stream");
    assert_eq!(r.rc("capture", 2), 900, "nor (here) the per-thread stream");
    assert_eq!(r.rc("capture", 3), 0);
    assert_eq!(r.rc("capture", 4), 401, "already capturing");
    assert_eq!(r.num("capturing", 0, "status"), 1);
    assert_eq!(
        r.rc("capturing", 1),
        906,
        "the legacy stream while a blocking stream captures"
    );
    let va = r.num("asyncon", 0, "ptr");
    assert!(
        (0x4000_0000_0000..0x7e00_0000_0000).contains(&va),
        "a VA from the graph range: {va:#x}"
    );
    assert_eq!(r.num("phys", 0, "used"), 0, "nothing allocated at capture");
    assert_eq!(r.rc("freeasyncon", 0), 0, "a free node");
    assert_eq!(r.rc("freeasyncon", 1), 1, "freed twice in the same graph");
    assert_eq!(r.rc("asyncon", 1), 1, "size 0");
    assert_eq!(r.rc("asyncon", 2), 2, "larger than the device");
    assert_eq!(
        r.rc("alloc", 0),
        900,
        "cuMemAlloc is prohibited in the capturing thread (global mode)"
    );

    let r = client(
        "gpa",
        &[
            "stream",
            "capture:0:relaxed",
            "asyncon:0:100Mi",
            "asyncon:0:64Mi",
            "freeasyncon:0:1",
            "alloc:8Mi",
            "freeasyncon:0:2",
            "phys",
            "endcapture:0",
            "capturing:0",
            "endcapture:0",
            "nodes:0",
            "phys",
        ],
        &[],
        None,
    );
    r.assert_completed();
    assert_eq!(r.rc("alloc", 0), 0, "relaxed: not prohibited");
    assert_eq!(
        r.rc("freeasyncon", 1),
        0,
        "a free node of an outside pointer"
    );
    assert_eq!(
        r.num("phys", 0, "used"),
        8 * MIB,
        "only the cuMemAlloc block: nothing freed at capture"
    );
    assert_eq!(r.field("endcapture", 0, "graph"), "0");
    assert_eq!(r.num("capturing", 0, "status"), 0);
    assert_eq!(r.rc("endcapture", 1), 401, "not capturing any more");
    assert_eq!(r.num("nodes", 0, "count"), 4);
    assert_eq!(r.num("nodes", 0, "got"), 4);
    assert_eq!(r.num("nodes", 0, "tail_null"), 1);
    assert_eq!(r.num("nodes", 0, "alloc"), 2);
    assert_eq!(r.num("nodes", 0, "free"), 2);
    assert_eq!(r.num("nodes", 0, "bytes"), 164 * MIB);
    assert_eq!(r.num("phys", 1, "used"), 8 * MIB);
}

#[test]
fn potentially_unsafe_calls_invalidate_the_captures_that_prohibit_them() {
    let r = client(
        "gpa",
        &[
            "stream",
            // global: the capturing thread may not call cuMemAlloc
            "capture:0:global",
            "info",
            "alloc:1Mi",
            "capturing:0",
            "endcapture:0",
            "capturing:0",
            // thread-local capture; the thread's own mode decides
            "capture:0:thread",
            "capmode:relaxed",
            "alloc:1Mi",
            "trim:0",
            "capturing:0",
            "capmode:thread",
            "reserve",
            "capturing:0",
            "endcapture:0",
            "capmode:global",
            // a relaxed capture prohibits nothing, but its stream cannot be synchronized
            "capture:0:relaxed",
            "alloc:1Mi",
            "ctxsync",
            "graphmem:0",
            "capturing:0",
            "streamsync:0",
            "capturing:0",
            "endcapture:0",
        ],
        &[],
        None,
    );
    r.assert_completed();
    assert_eq!(r.rc("info", 0), 0, "cuMemGetInfo is allowed");
    assert_eq!(r.rc("alloc", 0), 900);
    assert_eq!(r.num("capturing", 0, "status"), 2, "invalidated");
    assert_eq!(r.rc("endcapture", 0), 901);
    assert_eq!(r.num("endcapture", 0, "null"), 1);
    assert_eq!(r.num("capturing", 1, "status"), 0, "the capture is over");
    assert_eq!(r.field("capmode", 0, "old"), "global", "the default mode");
    assert_eq!(r.rc("alloc", 1), 0, "relaxed thread");
    assert_eq!(r.rc("trim", 0), 0);
    assert_eq!(r.num("capturing", 2, "status"), 1);
    assert_eq!(r.field("capmode", 1, "old"), "relaxed");
    assert_eq!(
        r.rc("reserve", 0),
        900,
        "cuMemPoolGetAttribute is prohibited"
    );
    assert_eq!(r.num("capturing", 3, "status"), 2);
    assert_eq!(r.rc("endcapture", 1), 901);
    assert_eq!(r.rc("alloc", 2), 0, "relaxed capture");
    assert_eq!(r.rc("ctxsync", 0), 0);
    assert_eq!(r.rc("graphmem", 0), 0);
    assert_eq!(r.num("capturing", 4, "status"), 1);
    assert_eq!(
        r.rc("streamsync", 0),
        900,
        "a capturing stream cannot be synchronized"
    );
    assert_eq!(r.num("capturing", 5, "status"), 2);
    assert_eq!(r.rc("endcapture", 2), 901);
}

#[test]
fn legacy_stream_work_during_a_blocking_streams_capture_is_an_implicit_dependency() {
    let ops = [
        "stream:1", // non-blocking
        "stream",   // blocking
        "capture:0:relaxed",
        "async:1Mi",
        "endcapture:0",
        "capture:1:relaxed",
        "asyncon:ptds:1Mi",
        "capturing:1",
        "async:1Mi",
        "capturing:1",
        "capturing:null",
        "endcapture:1",
        "async:1Mi",
    ];
    let r = client("gpa", &ops, &[], None);
    r.assert_completed();
    assert_eq!(
        r.rc("async", 0),
        0,
        "a non-blocking capture is not disturbed"
    );
    assert_eq!(r.field("endcapture", 0, "graph"), "0");
    assert_eq!(
        r.rc("asyncon", 0),
        0,
        "the per-thread stream is not the legacy one"
    );
    assert_eq!(r.num("capturing", 0, "status"), 1);
    assert_eq!(r.rc("async", 1), 906);
    assert_eq!(r.num("capturing", 1, "status"), 2, "invalidated");
    assert_eq!(r.rc("capturing", 2), 906);
    assert_eq!(r.rc("endcapture", 1), 901);
    assert_eq!(r.rc("async", 2), 0);
    // Through the _ptsz variants NULL is the per-thread stream.
    let r = client("gpa-ptsz", &ops, &[], None);
    r.assert_completed();
    assert_eq!(r.rc("async", 1), 0);
    assert_eq!(r.num("capturing", 1, "status"), 1);
}

#[test]
fn graph_memory_is_reserved_at_upload_and_live_after_launch() {
    let r = client(
        "gpa",
        &[
            "stream",
            "capture:0:relaxed",
            "asyncon:0:100Mi",
            "asyncon:0:63Mi",
            "freeasyncon:0:1",
            "endcapture:0",
            "instantiate:0",
            "instantiate:0",
            "graphmem:0",
            "upload:0:0",
            "graphmem:0",
            "phys",
            "nvml:0",
            "launch:0:0",
            "graphmem:0",
            "launch:0:null",
            "free:0",
            "graphmem:0",
            "free:0",
            "launch:0:0",
            "freeasync:0",
            "graphtrim:0",
            "graphmem:0",
            "phys",
            "graphreset:0",
            "graphmem:0",
            "execdestroy:0",
            "instantiate:0",
            "graphdestroy:0",
            "launch:1:0",
            "graphmem:0",
            "freeasync:0",
            "graphtrim:0",
            "phys",
        ],
        &[],
        None,
    );
    r.assert_completed();
    assert_eq!(r.rc("instantiate", 0), 0);
    assert_eq!(
        r.rc("instantiate", 1),
        1,
        "one executable graph at a time for a graph with memory nodes"
    );
    let gm = |n, k: &str| r.num("graphmem", n, k);
    assert_eq!((gm(0, "used"), gm(0, "reserved")), (0, 0));
    assert_eq!(r.rc("upload", 0), 0);
    // F = 100 MiB + 64 MiB (63 rounded up to 2 MiB); reserve round_up(164, 32) = 192 MiB.
    assert_eq!((gm(1, "used"), gm(1, "reserved")), (0, 192 * MIB));
    assert_eq!(r.num("phys", 0, "used"), 192 * MIB);
    assert_eq!(
        r.num("nvml", 0, "used"),
        192 * MIB,
        "graph memory in NVML too"
    );
    assert_eq!(r.rc("launch", 0), 0);
    assert_eq!(
        (gm(2, "used"), gm(2, "reserved")),
        (100 * MIB, 192 * MIB),
        "the allocation the graph does not free is live"
    );
    assert_eq!(
        r.rc("launch", 1),
        1,
        "relaunching while its allocation is live"
    );
    assert_eq!(r.rc("free", 0), 0, "cuMemFree_v2 of a graph allocation");
    assert_eq!((gm(3, "used"), gm(3, "reserved")), (0, 192 * MIB));
    assert_eq!(gm(3, "usedhigh"), 100 * MIB);
    assert_eq!(r.rc("free", 1), 1, "not live any more");
    assert_eq!(r.rc("launch", 2), 0);
    assert_eq!(
        r.rc("freeasync", 0),
        0,
        "cuMemFreeAsync of a graph allocation"
    );
    assert_eq!(r.rc("graphtrim", 0), 0);
    assert_eq!((gm(4, "used"), gm(4, "reserved")), (0, 0));
    assert_eq!(r.num("phys", 1, "used"), 0);
    assert_eq!(r.rc("graphreset", 0), 0);
    assert_eq!((gm(5, "usedhigh"), gm(5, "reservedhigh")), (0, 0));
    assert_eq!(r.rc("execdestroy", 0), 0);
    assert_eq!(r.rc("instantiate", 2), 0, "after the first exec is gone");
    assert_eq!(r.rc("graphdestroy", 0), 0);
    assert_eq!(r.rc("launch", 3), 0, "an exec outlives its graph");
    assert_eq!(gm(6, "used"), 100 * MIB);
    assert_eq!(r.rc("freeasync", 1), 0, "and so does its live allocation");
    assert_eq!(r.num("phys", 2, "used"), 0);
}

#[test]
fn graph_launches_free_outside_pointers_auto_free_and_fail_cleanly_when_full() {
    let r = client(
        "gpa",
        &[
            "alloc:8Mi",
            "stream",
            "capture:0:relaxed",
            "freeasyncon:0:0",
            "endcapture:0",
            "phys",
            "instantiate:0",
            "launch:0:0",
            "phys",
            "free:0",
            // explicit nodes, auto-free on launch
            "graph",
            "memnode:1:32Mi",
            "instantiate:1:1",
            "launch:1:0",
            "launch:1:0",
            "graphmem:0",
            "free:1",
            // does not fit: 2, nothing happens
            "graph",
            "memnode:2:700Mi",
            "alloc:512Mi",
            "instantiate:2",
            "upload:2:0",
            "launch:2:0",
            "graphmem:0",
            "free:2",
            // the primary context's end drops graph memory
            "launch:1:0",
            "graphmem:0",
            "ctxreset:0",
            "ctx:0",
            "graphmem:0",
            "phys",
            "free:1",
        ],
        &[("FAKE_CUDA_MEM", "1073741824")],
        None,
    );
    r.assert_completed();
    assert_eq!(
        r.num("phys", 0, "used"),
        8 * MIB,
        "captured free: not freed yet"
    );
    assert_eq!(r.rc("launch", 0), 0);
    assert_eq!(r.num("phys", 1, "used"), 0, "freed by the launch");
    assert_eq!(r.rc("free", 0), 1, "already freed");
    assert_eq!(r.rc("instantiate", 1), 0);
    assert_eq!(
        r.rc("launch", 2),
        0,
        "auto-free on launch frees the live allocation first"
    );
    assert_eq!(r.num("graphmem", 0, "used"), 32 * MIB);
    assert_eq!(r.rc("free", 1), 0);
    assert_eq!(r.rc("alloc", 1), 0);
    assert_eq!(r.rc("upload", 0), 2, "700 MiB does not fit beside 512 MiB");
    assert_eq!(r.rc("launch", 3), 2);
    assert_eq!(r.num("graphmem", 1, "used"), 0);
    assert_eq!(
        r.num("graphmem", 1, "reserved"),
        32 * MIB,
        "unchanged by the failures"
    );
    assert_eq!(r.rc("free", 2), 1, "the failed launch allocated nothing");
    assert_eq!(r.rc("launch", 4), 0);
    assert_eq!(r.num("graphmem", 2, "used"), 32 * MIB);
    assert_eq!(r.rc("ctxreset", 0), 0);
    assert_eq!(
        (
            r.num("graphmem", 3, "used"),
            r.num("graphmem", 3, "reserved")
        ),
        (0, 0)
    );
    assert_eq!(
        r.num("phys", 2, "used"),
        0,
        "the 512 MiB went with the primary too"
    );
    assert_eq!(
        r.rc("free", 3),
        1,
        "the live graph allocation ended with the context"
    );
}

#[test]
fn vmm_handles_take_a_reference_per_retain() {
    let r = client(
        "gpa",
        &[
            "create:4Mi",
            "retain:0",
            "map:0",
            "retain:0",
            "retain:0",
            "release:0",
            "release:0",
            "phys",
            "unmap:0",
            "phys",
            "release:0",
            "phys",
            "release:0",
            "retain:0",
        ],
        &[],
        None,
    );
    r.assert_completed();
    assert_eq!(r.rc("retain", 0), 1, "nothing mapped there");
    assert_eq!(r.rc("retain", 1), 0);
    assert_eq!(
        r.num("retain", 1, "same"),
        1,
        "the handle of the mapping (address inside it)"
    );
    assert_eq!(r.rc("retain", 2), 0);
    assert_eq!(r.num("phys", 0, "used"), 4 * MIB);
    assert_eq!(
        r.num("phys", 1, "used"),
        4 * MIB,
        "unmapped, one reference left"
    );
    assert_eq!(r.rc("release", 2), 0);
    assert_eq!(r.num("phys", 2, "used"), 0);
    assert_eq!(r.rc("release", 3), 1, "no reference left");
    assert_eq!(r.rc("retain", 3), 1);
}

#[test]
fn free_refuses_async_makes_cu_mem_free_refuse_stream_ordered_blocks() {
    let ops = [
        "async:1Mi",
        "free:0",
        "poolused",
        "freeasync:0",
        "alloc:1Mi",
        "free:1",
    ];
    let r = client("gpa", &ops, &[("FAKE_CUDA_FREE_REFUSES_ASYNC", "1")], None);
    r.assert_completed();
    assert_eq!(r.rc("free", 0), 1);
    assert_eq!(r.num("poolused", 0, "bytes"), MIB, "nothing freed");
    assert_eq!(r.rc("freeasync", 0), 0);
    assert_eq!(r.rc("free", 1), 0, "other blocks as before");
    let r = client("gpa", &ops, &[], None);
    r.assert_completed();
    assert_eq!(r.rc("free", 0), 0, "by default cuMemFree_v2 takes them");
}

#[test]
fn impossible_sizes_fail_without_touching_any_counter() {
    let r = client(
        "gpa",
        &[
            "threshold:max",
            "async:64Mi",
            "freeasync:0",
            "phys",
            "alloc:max",
            "alloc:0x4000000000000000",
            "managed:max",
            "pitch:max:1",
            "pitch:0x100000000:0x100000000",
            "async:max",
            "async:0x4000000000000000",
            "poolasync:max",
            "create:0x4000000000000000",
            "create:max",
            "array:0x10000000000:0x40000000:0x20:4",
            "graph",
            "memnode:0:max",
            "reserve",
            "phys",
        ],
        &[],
        None,
    );
    r.assert_completed();
    for (op, n, rc) in [
        ("alloc", 0, 2),
        ("alloc", 1, 2),
        ("managed", 0, 2),
        ("pitch", 0, 2),
        ("pitch", 1, 2),
        ("async", 1, 2),
        ("async", 2, 2),
        ("poolasync", 0, 2),
        ("create", 0, 2),
        ("create", 1, 1),
        ("array", 0, 1),
        ("memnode", 0, 2),
    ] {
        assert_eq!(r.rc(op, n), rc, "{op} #{n}");
    }
    assert_eq!(
        r.num("reserve", 0, "bytes"),
        64 * MIB,
        "nothing trimmed the pool"
    );
    assert_eq!(r.num("phys", 1, "used"), 64 * MIB);
    assert_eq!(r.num("phys", 1, "peak"), 64 * MIB);
}

#[test]
fn a_destroyed_context_frees_its_memory_and_a_primary_reset_only_the_primarys() {
    let r = client(
        "gpa",
        &[
            "ctxcreate:0",
            "alloc:4Mi",
            "array:1024:1024:0x20:1",
            "ctxpop",
            "alloc:8Mi",
            "create:2Mi",
            "phys",
            "ctxreset:0",
            "ctx:0",
            "phys",
            "ctxdestroy:0",
            "phys",
            "free:0",
            "release:3",
            "phys",
        ],
        &[],
        None,
    );
    r.assert_completed();
    assert_eq!(r.field("ctxpop", 0, "ctx"), "c0");
    assert_eq!(r.num("phys", 0, "used"), 18 * MIB);
    assert_eq!(
        r.num("phys", 1, "used"),
        10 * MIB,
        "the primary's 8 MiB went; the created context's 4 + 4 MiB and VMM stay"
    );
    assert_eq!(
        r.num("phys", 2, "used"),
        2 * MIB,
        "cuCtxDestroy frees its memory and arrays, not VMM"
    );
    assert_eq!(r.rc("free", 0), 1);
    assert_eq!(r.num("phys", 3, "used"), 0);
}

/// Capture modes across threads, deterministically: two threads of this process step in
/// turn (a barrier between steps) over a private copy of the fake driver (its state is
/// this test's alone; the other in-process test needs a driver before `cuInit`).
#[test]
fn capture_modes_decide_which_threads_are_prohibited() {
    use std::ffi::{CString, c_int, c_void};
    use std::sync::Barrier;
    type P = *mut c_void;
    type FnU32 = unsafe extern "C" fn(u32) -> c_int;
    type FnOutDev = unsafe extern "C" fn(*mut P, c_int) -> c_int;
    type FnP = unsafe extern "C" fn(P) -> c_int;
    type FnOutU32 = unsafe extern "C" fn(*mut P, u32) -> c_int;
    type FnPInt = unsafe extern "C" fn(P, c_int) -> c_int;
    type FnPOut = unsafe extern "C" fn(P, *mut P) -> c_int;
    type FnPOutInt = unsafe extern "C" fn(P, *mut c_int) -> c_int;
    type FnOutInt = unsafe extern "C" fn(*mut c_int) -> c_int;
    type FnAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
    type FnU64 = unsafe extern "C" fn(u64) -> c_int;
    #[derive(Clone, Copy)]
    struct Api {
        init: FnU32,
        retain: FnOutDev,
        set_current: FnP,
        stream_create: FnOutU32,
        begin: FnPInt,
        end: FnPOut,
        is_capturing: FnPOutInt,
        exchange: FnOutInt,
        alloc: FnAlloc,
        free: FnU64,
    }
    const GLOBAL: c_int = 0;
    const THREAD_LOCAL: c_int = 1;
    const RELAXED: c_int = 2;

    let dir = std::env::temp_dir().join(format!("cudabudget-fake-{}-capture", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("libcuda.so.1");
    std::fs::copy(util::fake_cuda_lib(), &copy).unwrap();
    let path = CString::new(copy.to_str().unwrap()).unwrap();
    // SAFETY: loading the fake driver runs only its constructor (pthread_atfork).
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null());
    let _ = std::fs::remove_dir_all(&dir);
    let sym = |name: &str| {
        let c = CString::new(name).unwrap();
        // SAFETY: h is a live handle; c is NUL-terminated.
        let p = unsafe { libc::dlsym(h, c.as_ptr()) };
        assert!(!p.is_null(), "{name} not exported");
        p
    };
    // SAFETY: the pointers come from the fake's exports, whose C signatures match these types.
    let api = unsafe {
        Api {
            init: std::mem::transmute::<P, FnU32>(sym("cuInit")),
            retain: std::mem::transmute::<P, FnOutDev>(sym("cuDevicePrimaryCtxRetain")),
            set_current: std::mem::transmute::<P, FnP>(sym("cuCtxSetCurrent")),
            stream_create: std::mem::transmute::<P, FnOutU32>(sym("cuStreamCreate")),
            begin: std::mem::transmute::<P, FnPInt>(sym("cuStreamBeginCapture_v2")),
            end: std::mem::transmute::<P, FnPOut>(sym("cuStreamEndCapture")),
            is_capturing: std::mem::transmute::<P, FnPOutInt>(sym("cuStreamIsCapturing")),
            exchange: std::mem::transmute::<P, FnOutInt>(sym("cuThreadExchangeStreamCaptureMode")),
            alloc: std::mem::transmute::<P, FnAlloc>(sym("cuMemAlloc_v2")),
            free: std::mem::transmute::<P, FnU64>(sym("cuMemFree_v2")),
        }
    };
    // SAFETY (all calls below): the fake's functions with valid out-pointers and handles
    // it returned.
    let mut ctx: P = std::ptr::null_mut();
    let mut stream: P = std::ptr::null_mut();
    unsafe {
        assert_eq!((api.init)(0), 0);
        assert_eq!((api.retain)(&mut ctx, 0), 0);
        assert_eq!((api.set_current)(ctx), 0);
        assert_eq!((api.stream_create)(&mut stream, 0), 0);
    }
    let (ctx, stream) = (ctx as usize, stream as usize);
    let status = move || {
        let mut st = -1;
        assert_eq!(unsafe { (api.is_capturing)(stream as P, &mut st) }, 0);
        st
    };
    let end = move || {
        let mut g: P = std::ptr::null_mut();
        let rc = unsafe { (api.end)(stream as P, &mut g) };
        (rc, !g.is_null())
    };
    let alloc_free = move || {
        let mut p = 0u64;
        let rc = unsafe { (api.alloc)(&mut p, 1 << 20) };
        if rc == 0 {
            assert_eq!(unsafe { (api.free)(p) }, 0);
        }
        rc
    };
    let exchange = move |mode: c_int| {
        let mut m = mode;
        assert_eq!(unsafe { (api.exchange)(&mut m) }, 0);
        m
    };
    let begin = move |mode| unsafe { (api.begin)(stream as P, mode) };
    let bar = Barrier::new(2);
    std::thread::scope(|s| {
        // Thread B: the other thread.
        s.spawn(|| {
            assert_eq!(unsafe { (api.set_current)(ctx as P) }, 0);
            bar.wait(); // A began a GLOBAL capture
            assert_eq!(alloc_free(), 900, "B (GLOBAL) vs A's GLOBAL capture");
            bar.wait();
            bar.wait(); // A began a new GLOBAL capture
            assert_eq!(exchange(THREAD_LOCAL), GLOBAL);
            assert_eq!(
                alloc_free(),
                0,
                "B (THREAD_LOCAL) ignores other threads' captures"
            );
            assert_eq!(exchange(RELAXED), THREAD_LOCAL);
            assert_eq!(alloc_free(), 0, "B (RELAXED)");
            assert_eq!(exchange(GLOBAL), RELAXED);
            assert_eq!(
                end(),
                (908, false),
                "a GLOBAL capture ended from another thread"
            );
            bar.wait();
            bar.wait(); // A began a THREAD_LOCAL capture
            assert_eq!(
                alloc_free(),
                0,
                "A's THREAD_LOCAL capture prohibits nothing in B"
            );
            bar.wait();
            bar.wait(); // A began a RELAXED capture
            assert_eq!(alloc_free(), 0);
            assert_eq!(
                end(),
                (0, true),
                "a RELAXED capture may end in another thread"
            );
            bar.wait();
        });
        // Thread A: the capturing thread.
        assert_eq!(begin(GLOBAL), 0);
        bar.wait();
        bar.wait(); // B was refused
        assert_eq!(status(), 2, "B's prohibited call invalidated A's capture");
        assert_eq!(end(), (901, false));
        assert_eq!(begin(GLOBAL), 0);
        bar.wait();
        bar.wait(); // B's calls in THREAD_LOCAL / RELAXED mode
        assert_eq!(status(), 1, "not invalidated by them");
        assert_eq!(end(), (0, true));
        assert_eq!(begin(THREAD_LOCAL), 0);
        bar.wait();
        bar.wait(); // B allocated
        assert_eq!(
            alloc_free(),
            900,
            "A's own THREAD_LOCAL capture prohibits A (GLOBAL mode)"
        );
        assert_eq!(status(), 2);
        assert_eq!(end(), (901, false));
        assert_eq!(begin(RELAXED), 0);
        assert_eq!(alloc_free(), 0, "a RELAXED capture prohibits nothing");
        bar.wait();
        bar.wait(); // B ended it
        assert_eq!(status(), 0);
    });
}

/// The executor of tests/property.rs, without cudabudget: threads, a capture and its
/// graph, a fork, two devices; everything is freed at the end of each case, and the peak
/// is the case's own. A free that takes a slot's old pointer (a double free) is reported,
/// and so are a pool destroyed with a block in use and a context torn down while another
/// context of its device lives or while pool memory of the device outlives it (the cases
/// whose books may end above zero), but not a pool destroyed empty nor a device's last
/// context released with nothing left on it.
///
/// Thread 0's first capture is thread-local: its own `alloc` is refused (900) whatever
/// thread 1 does, and thread 1's calls are never refused for it, in whatever order a
/// busy machine runs the two (a global capture failed thread 1's calls at random).
#[test]
fn the_property_executor_runs_a_case_and_frees_everything() {
    use std::io::Write;
    let input = "\
case a 2 1073741824 1073741824
0 stream 0 0
0 capture 0 1
0 async 0 0 104857600
0 alloc 3 1048576
0 endcapture 0 0
0 capture 0 2
0 async 1 0 104857600
0 endcapture 0 1
0 instantiate 0 1 0
0 launch 0 100
0 fork
1 setprimary 1
1 alloc 1 536870912
1 async 2 100 2097152
1 vcreate 0 1 4194304
1 vmap 0
1 vretain 0
1 pool 0 1
1 poolasync 4 102 0 1048576
run
case b 1
0 alloc 0 4096
0 freestale 0
0 free 0
0 free 0
run
case c 1
0 pool 0 0
0 poolasync 0 100 0 4096
0 pooldestroy 0
0 ctxcreate 0 0
0 ctxdestroy 0
run
case d 1
0 reset 0
0 ctxcreate 0 0
0 async 0 100 4096
0 ctxdestroy 0
run
case e 1
0 pool 0 0
0 pooldestroy 0
0 release 0
run
";
    let mut cmd =
        util::fixture_command(util::prop_client_bin(), &[("FAKE_CUDA_DEVICES", "2")], None);
    cmd.arg("gpa")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        [
            "ready devices=2",
            "begin a",
            "rc 0 0 0 0 900 901 0 0 0 0 0 0",
            "rc 1 0 0 0 0 0 0 0 0",
            &format!(
                "end a dev0:peak={},fake=0,books=-84825604096,inforc=0,total=85899345920 \
                 dev1:peak={},fake=0,books=-84825604096,inforc=0,total=85899345920",
                128 * MIB,
                512 * MIB + 32 * MIB + 4 * MIB + 32 * MIB
            ),
            "begin b",
            "rc 0 0 1 0 1",
            // The second `free 0` found the slot empty and took its old pointer.
            "stalefree",
            "end b dev0:peak=4096,fake=0,books=0,inforc=0,total=85899345920",
            "begin c",
            "rc 0 0 0 0 0 0",
            "pooldestroylive 0",
            "teardownshared 0",
            &format!(
                "end c dev0:peak={},fake=0,books=0,inforc=0,total=85899345920",
                32 * MIB
            ),
            // The device's last context destroyed while its default pool held memory.
            "begin d",
            "rc 0 0 0 0 0",
            "teardownshared 0",
            &format!(
                "end d dev0:peak={},fake=0,books=0,inforc=0,total=85899345920",
                32 * MIB
            ),
            "begin e",
            "rc 0 0 0 0",
            "end e dev0:peak=0,fake=0,books=0,inforc=0,total=85899345920",
        ],
        "{text}"
    );
}
