//! Self-tests of the fake CUDA driver, fake NVML and the C clients, run WITHOUT cudabudget:
//! the other integration tests rely on these semantics.

mod util;

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
