//! Synchronous allocations, pitched allocations, arrays and VMM memory: each is charged
//! what the driver really gave (the pitch it chose, the array's descriptor, a VMM
//! handle until it is released and unmapped), and what the driver refuses charges
//! nothing and keeps the books for the correct free.

use crate::util::scripts::{
    books_script, budget_without_rereads, holds_a_gibibyte_with, python_script, value_of,
};
use crate::util::{GI, MI, budget_run};

#[test]
fn vmm_memory_counts_until_released_and_unmapped() {
    let run = budget_run(
        "dlsym",
        &[
            "create:4Gi",
            "map:0",
            "create:4Gi",
            "release:0",
            "create:4Gi",
            "unmap:0",
            "create:4Gi",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "6Gi")],
    );
    assert_eq!(run.rc("create", 0), 0);
    assert_eq!(run.rc("create", 1), 2, "{run:?}");
    assert_eq!(run.rc("create", 2), 2, "released but still mapped\n{run:?}");
    assert_eq!(run.rc("create", 3), 0, "released and unmapped\n{run:?}");
    assert!(run.num("phys", 0, "peak") <= 6 * GI);
}

#[test]
fn the_driver_rejects_what_it_rejects_before_the_budget_decides() {
    // PyTorch tries a FABRIC handle first and falls back on any error but OOM.
    let run = budget_run(
        "gpa",
        &["createfabric:2Gi", "createfabric:20Gi", "create:20Gi"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(run.rc("createfabric", 0), 801, "{run:?}");
    assert_eq!(
        run.rc("createfabric", 1),
        801,
        "not supported beats out of budget\n{run:?}"
    );
    assert_eq!(run.rc("create", 0), 2);
}

#[test]
fn host_memory_from_cu_mem_create_is_not_device_memory() {
    let run = budget_run("gpa", &["createhost:16Gi"], &[("CUDABUDGET_LIMIT", "8Gi")]);
    assert_eq!(run.rc("createhost", 0), 0);
}

#[test]
fn arrays_are_charged_from_their_descriptors() {
    // 1024 x 1024 x 4 channels of float: 16 MiB each.
    let run = budget_run(
        "gpa",
        &[
            "array:1024:1024:0x20:4",
            "array:1024:1024:0x20:4",
            "destroy:0",
            "array3d:64:64:64:0x20:4",
            "mipmap:1024:1024:0:0x20:4:11",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "20Mi")],
    );
    assert_eq!(run.rc("array", 0), 0);
    assert_eq!(run.rc("array", 1), 2, "{run:?}");
    assert_eq!(run.rc("destroy", 0), 0);
    assert_eq!(run.rc("array3d", 0), 0);
    assert_eq!(run.rc("mipmap", 0), 2, "4 + 21.3 MiB > 20 MiB\n{run:?}");
    assert_eq!(run.num("info", 0, "free"), 16 * MI);
}

/// `cuMemAllocPitch` is reserved at a 512-byte pitch, then charged at the pitch the
/// driver chose, wider or narrower; the free gives back exactly that.
#[test]
fn a_pitched_allocation_is_charged_at_the_drivers_pitch() {
    for (align, pitch) in [("1024", 1024), ("256", 256), ("512", 512)] {
        let run = budget_without_rereads(
            &["pitch:100:1024", "info", "free:0", "info"],
            &[
                ("CUDABUDGET_LIMIT", "1Gi"),
                ("FAKE_CUDA_PITCH_ALIGN", align),
            ],
        );
        run.assert_completed();
        assert_eq!(run.num("pitch", 0, "pitch"), pitch, "{}", run.dump());
        assert_eq!(
            run.num("info", 0, "free"),
            GI - pitch * 1024,
            "align {align}: charged at the driver's pitch\n{}",
            run.dump()
        );
        assert_eq!(
            run.num("info", 1, "free"),
            GI,
            "align {align}\n{}",
            run.dump()
        );
    }
}

/// A pitched allocation wider than the estimate still cannot take the budget past its
/// end: the next allocation sees the real charge.
#[test]
fn a_wider_pitch_counts_against_the_next_allocation() {
    // 100 B rows at a 1024 B pitch: 512 MiB charged, not the 256 MiB estimate.
    let run = budget_without_rereads(
        &["pitch:100:524288", "alloc:600Mi", "alloc:500Mi"],
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("FAKE_CUDA_PITCH_ALIGN", "1024"),
        ],
    );
    run.assert_completed();
    assert_eq!(run.rc("pitch", 0), 0, "{}", run.dump());
    assert_eq!(
        run.rc("alloc", 0),
        2,
        "512 + 600 MiB > 1 GiB\n{}",
        run.dump()
    );
    assert_eq!(run.rc("alloc", 1), 0, "512 + 500 MiB fits\n{}", run.dump());
}

/// A refused `cuMemAllocPitch` whose out-variables still hold an earlier allocation's
/// address and pitch (a program that reuses them) leaves that allocation's charge alone.
#[test]
fn a_refused_pitched_allocation_leaves_earlier_charges_alone() {
    let out = books_script(
        r#"{PRELUDE}
rc, p = alloc(256 * MI); assert rc == 0
dptr = ctypes.c_uint64(p)
pitch = ctypes.c_size_t(512)
rc = cuda.cuMemAllocPitch_v2(ctypes.byref(dptr), ctypes.byref(pitch), ctypes.c_size_t(4096), ctypes.c_size_t(1 << 20), 4)
print("rc=%d" % rc)
print("books=%d" % books(1024 * MI))
"#,
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    assert_eq!(value_of(&out, "rc"), 2, "4 GiB do not fit in 1 GiB\n{out}");
    assert_eq!(value_of(&out, "books"), 256, "{out}");
}

/// A free the driver refuses leaves the block allocated, so its record must stay: here
/// a mipmapped array given to `cuArrayDestroy` (refused with `INVALID_VALUE`), then
/// destroyed correctly: the record stays through the refusal, and the correct destroy
/// gives the charge back.
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
    let (ok, stdout, stderr) = python_script(
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
/// that probe is not made, as it would take the process past its budget.
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

/// The driver's refusal of a synchronous allocation (here the card itself is full)
/// leaves nothing charged: the budget is whole afterwards. A thread's first allocation
/// takes the full path; after one of 512 MiB, its next take the fast path (its lane).
#[test]
fn a_synchronous_allocation_the_driver_refuses_charges_nothing() {
    for held in [0, 512 * MI] {
        let first = format!("alloc:{}Mi", held / MI);
        let fits = format!("alloc:{}Mi", (GI - held) / MI);
        let ops = [
            first.as_str(),
            "alloc:1536Mi",
            "info",
            fits.as_str(),
            "info",
        ];
        let run = budget_run(
            "gpa",
            &ops[usize::from(held == 0)..],
            &[("CUDABUDGET_LIMIT", "2Gi"), ("FAKE_CUDA_MEM", "1073741824")],
        );
        let k = usize::from(held > 0);
        assert_eq!(run.rc("alloc", k), 2, "the card is full\n{run:?}");
        assert_eq!(
            run.num("info", 0, "free"),
            GI - held,
            "nothing charged\n{run:?}"
        );
        assert_eq!(run.rc("alloc", k + 1), 0, "{run:?}");
        assert_eq!(run.num("info", 1, "free"), 0, "{run:?}");
    }
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
/// the array it named) must not find the old array's record: its destroy gives back its
/// own size (1 MiB, not the old array's 100 MiB), and the next allocation does not pass
/// the budget. The fake driver reuses handles here (`FAKE_CUDA_REUSE_HANDLES`).
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
    let (ok, stdout, stderr) = python_script(
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

/// Creates a 256 MiB VMM handle `h` on device 0 and reserves `va` for it (`{VMM}`).
const VMM: &str = r#"h = ctypes.c_uint64()
assert cuda.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(256 << 20), ctypes.byref(Props(1, 0, 1, 0)), ctypes.c_uint64(0)) == 0
va = ctypes.c_uint64()
assert cuda.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(256 << 20), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)) == 0
def map_it():
    return cuda.cuMemMap(va, ctypes.c_size_t(256 << 20), ctypes.c_size_t(0), h, ctypes.c_uint64(0))"#;

/// A handle mapped by one thread and released by another while the driver's map is
/// returning: the mapping keeps the memory, and the books keep its 256 MiB whichever
/// of the two they see first.
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
/// releases and unmaps: the new reference keeps the memory, and the books keep it
/// charged whatever order they see the calls in.
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

/// After a thread's first allocation its next ones take the fast path (the thread's own
/// lane): there too a request past the budget is refused before the driver sees it.
#[test]
fn a_threads_later_allocations_are_held_to_the_budget() {
    let run = budget_run(
        "gpa",
        &[
            "alloc:512Mi",
            "alloc:1536Mi",
            "info",
            "alloc:256Mi",
            "alloc:256Mi",
            "info",
        ],
        &[
            ("CUDABUDGET_LIMIT", "768Mi"),
            ("FAKE_CUDA_MEM", "1073741824"),
        ],
    );
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 2, "past the budget: refused\n{run:?}");
    assert_eq!(
        run.num("info", 0, "free"),
        256 * MI,
        "nothing charged\n{run:?}"
    );
    assert_eq!(run.rc("alloc", 2), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 3), 2, "the budget is spent\n{run:?}");
    assert_eq!(run.num("info", 1, "free"), 0, "{run:?}");
}

/// Eight threads each allocate 4000 blocks of 64 KiB with `cuMemAlloc` (2 GiB in all,
/// against a 1 GiB budget) and hand every block to the next thread, which frees it with
/// `cuMemFree`. A block is recorded in its allocating thread's lane: freed by another
/// thread it must still be found and its bytes given back, or the budget runs out.
#[test]
fn synchronous_blocks_freed_by_other_threads_give_their_bytes_back() {
    for mode in ["gpa", "dlsym"] {
        let run = budget_run(
            mode,
            &["syncrelay:8:4000:64Ki", "info", "alloc:1000Mi", "phys"],
            &[("CUDABUDGET_LIMIT", "1Gi")],
        );
        assert_eq!(run.num("syncrelay", 0, "ok"), 32_000, "{mode}\n{run:?}");
        assert_eq!(run.num("syncrelay", 0, "denied"), 0, "{mode}\n{run:?}");
        assert_eq!(run.num("syncrelay", 0, "other"), 0, "{mode}\n{run:?}");
        assert_eq!(
            run.num("info", 0, "free"),
            GI,
            "{mode}: all given back\n{run:?}"
        );
        assert_eq!(run.rc("alloc", 0), 0, "{mode}\n{run:?}");
        assert!(run.num("phys", 0, "peak") <= GI, "{mode}\n{run:?}");
    }
}

/// Eight threads each allocate 50 blocks of 2 MiB with `cuMemAlloc` and exit with them
/// live; eight more threads (given the lanes the first ones left) allocate and free;
/// then the main thread frees the first threads' blocks. Every block is found whoever
/// frees it and whenever, and the budget is whole at the end.
#[test]
fn synchronous_blocks_outlive_the_threads_that_allocated_them() {
    let run = budget_run(
        "gpa",
        &[
            "synckeep:8:50:2Mi",
            "race:8:200:1Mi",
            "info",
            "freekept",
            "info",
            "alloc:1000Mi",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    assert_eq!(run.num("synckeep", 0, "ok"), 400, "{run:?}");
    assert_eq!(run.num("race", 0, "ok"), 1600, "{run:?}");
    assert_eq!(run.num("race", 0, "other"), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), GI - 800 * MI, "{run:?}");
    assert_eq!(run.num("freekept", 0, "ok"), 400, "{run:?}");
    assert_eq!(run.num("info", 1, "free"), GI, "all given back\n{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
}

/// A free the driver refuses on the fast path (`cuMemFree` is not allowed while a global
/// capture runs) leaves the block charged and recorded: the free after the capture gives
/// its bytes back, once.
#[test]
fn a_synchronous_free_the_driver_refuses_keeps_the_block_charged_for_the_next() {
    let run = budget_run(
        "gpa",
        &[
            "alloc:256Mi",
            "alloc:256Mi",
            "stream",
            "capture:0:global",
            "free:1",
            "endcapture:0",
            "info",
            "free:1",
            "info",
            "free:1",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    assert_ne!(run.rc("free", 0), 0, "refused in the capture\n{run:?}");
    assert_eq!(
        run.num("info", 0, "free"),
        512 * MI,
        "still charged\n{run:?}"
    );
    assert_eq!(run.rc("free", 1), 0, "{run:?}");
    assert_eq!(run.num("info", 1, "free"), 768 * MI, "{run:?}");
    assert_ne!(run.rc("free", 2), 0, "freed already\n{run:?}");
    assert_eq!(
        run.num("info", 2, "free"),
        768 * MI,
        "given back once\n{run:?}"
    );
}

/// One thread holds 20 000 blocks, more than its lane has room for (16 384, four to a
/// bucket): those whose bucket is full go to the shared table, each charged and found
/// by its free like the others.
#[test]
fn a_thread_holding_more_blocks_than_its_lane_has_room_for_is_charged_for_each() {
    let run = budget_run(
        "gpa",
        &["synckeep:1:20000:4Ki", "info", "freekept", "info"],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    assert_eq!(run.num("synckeep", 0, "ok"), 20_000, "{run:?}");
    assert_eq!(
        run.num("info", 0, "free"),
        GI - 20_000 * 4096,
        "every block charged\n{run:?}"
    );
    assert_eq!(run.num("freekept", 0, "ok"), 20_000, "{run:?}");
    assert_eq!(
        run.num("info", 1, "free"),
        GI,
        "every block given back\n{run:?}"
    );
}
