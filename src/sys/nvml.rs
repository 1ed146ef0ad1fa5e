//! The real NVML (`libnvidia-ml.so.1`), from our own handle: the per-process memory
//! figure that `nvidia-smi` shows, and the mapping between NVML devices and this
//! process's CUDA ordinals.
//!
//! Loaded and initialised off the hot path: on a thread of its own when a budgeted
//! process calls `cuInit`, or else the first time a footprint is reconciled or an NVML
//! view is asked for.

#![allow(non_snake_case)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicU32, AtomicUsize, Ordering};

use crate::sys::driver::MAX_DEVICES;
use crate::sys::driver::{self, real};
use crate::sys::foreign;

pub type NvmlDevice = *mut c_void;

/// `nvmlMemory_t`.
#[repr(C)]
pub struct Memory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct MemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlProcessInfo_t` (v2 layout, used by `_v3` of the process queries).
#[repr(C)]
#[derive(Clone, Copy)]
struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

const NVML_SUCCESS: c_int = 0;
/// What NVML writes where it cannot give a figure.
const NVML_VALUE_NOT_AVAILABLE: u64 = u64::MAX;

#[derive(Clone, Copy)]
#[repr(usize)]
pub enum F {
    Init,
    GetHandleByUUID,
    GetIndex,
    GetUUID,
    GetMemoryInfo,
    GetMemoryInfoV2,
    GetComputeRunningProcessesV3,
}

const NAMES: [&CStr; 7] = [
    c"nvmlInit_v2",
    c"nvmlDeviceGetHandleByUUID",
    c"nvmlDeviceGetIndex",
    c"nvmlDeviceGetUUID",
    c"nvmlDeviceGetMemoryInfo",
    c"nvmlDeviceGetMemoryInfo_v2",
    c"nvmlDeviceGetComputeRunningProcesses_v3",
];

static REAL: [AtomicPtr<c_void>; NAMES.len()] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; NAMES.len()];

const UNLOADED: u8 = 0;
const LOADED: u8 = 1;
static LIBRARY: AtomicU8 = AtomicU8::new(UNLOADED);

/// The real function `f`, loading the library (without initialising it) first.
pub fn real_fn(f: F) -> *mut c_void {
    if LIBRARY.load(Ordering::Acquire) == UNLOADED {
        // Not in a child forked mid-call (crate::sys::foreign). Racing threads both load:
        // dlopen takes a reference, the slots get the same pointers, and nobody waits for
        // another thread.
        let Some(_loading) = foreign::loading() else {
            return std::ptr::null_mut();
        };
        load_library();
        LIBRARY.store(LOADED, Ordering::Release);
    }
    REAL[f as usize].load(Ordering::Acquire)
}

fn load_library() {
    // SAFETY: dlopen with a NUL-terminated name.
    let handle = unsafe {
        libc::dlopen(
            c"libnvidia-ml.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        )
    };
    if handle.is_null() {
        return;
    }
    for (slot, name) in REAL.iter().zip(NAMES) {
        slot.store(driver::lookup(handle, name), Ordering::Release);
    }
}

const IDLE: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;
const STARTING: u8 = 3;
static INITIALISED: AtomicU8 = AtomicU8::new(IDLE);

/// Starts NVML's initialisation on a thread of its own, then hands the thread to `ready`
/// with whether NVML is there (the footprint's per-device work,
/// [`crate::admit::footprint::nvml_ready`]). Called after the real `cuInit` or the first
/// context's creation (the footprint decides): NVML's own initialisation (about 10 ms)
/// then overlaps the program's next steps, and nothing on the program's threads waits
/// for it. Once only: later calls do nothing.
pub fn prewarm(ready: impl FnOnce(bool) + Send + 'static) {
    if INITIALISED
        .compare_exchange(IDLE, STARTING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    BACKGROUND_BUSY.store(true, Ordering::Release);
    let spawned = std::thread::Builder::new()
        .name("cudabudget-nvml".into())
        .spawn(move || {
            let state = init_now();
            INITIALISED.store(state, Ordering::SeqCst);
            BACKGROUND_BUSY.store(false, Ordering::Release);
            ready(state == OK);
        });
    if spawned.is_err() {
        BACKGROUND_BUSY.store(false, Ordering::Release);
        INITIALISED.store(IDLE, Ordering::Release);
        return;
    }
    // SAFETY: registers a plain extern "C" function that only reads an atomic and sleeps.
    unsafe {
        libc::atexit(wait_for_background);
    }
}

/// Set while NVML's thread is inside NVML (its initialisation, attaching a device).
static BACKGROUND_BUSY: AtomicBool = AtomicBool::new(false);

/// Marks NVML's thread as inside NVML, or out of it.
pub fn background_busy(busy: bool) {
    BACKGROUND_BUSY.store(busy, Ordering::Release);
}

/// At exit, before the libraries' destructors run (atexit handlers come first): a short
/// program can end while NVML's thread is still inside NVML, whose own teardown would
/// then pull its state away under it. Waits for that thread to leave NVML, at most
/// 200 ms.
extern "C" fn wait_for_background() {
    let start = std::time::Instant::now();
    while BACKGROUND_BUSY.load(Ordering::Acquire)
        && start.elapsed() < std::time::Duration::from_millis(200)
    {
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// NVML, loaded and initialised; false when it is not there, or while its
/// initialisation is still under way on another thread (callers never wait for it).
fn ready() -> bool {
    match INITIALISED.load(Ordering::Acquire) {
        OK => true,
        FAILED | STARTING => false,
        _ => {
            if INITIALISED
                .compare_exchange(IDLE, STARTING, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                return INITIALISED.load(Ordering::Acquire) == OK;
            }
            let state = init_now();
            INITIALISED.store(state, Ordering::Release);
            state == OK
        }
    }
}

/// Whether NVML is initialised or on its way (not missing, not failed).
pub fn usable() -> bool {
    matches!(INITIALISED.load(Ordering::Acquire), OK | STARTING)
}

/// Whether NVML is known to be missing or failed to start (in this process).
pub fn unavailable() -> bool {
    INITIALISED.load(Ordering::Acquire) == FAILED
}

/// Whether NVML is initialised (its figures can be asked for).
pub fn initialised() -> bool {
    INITIALISED.load(Ordering::Acquire) == OK
}

/// Whether the initialisation started by [`prewarm`] is still under way.
pub fn starting() -> bool {
    INITIALISED.load(Ordering::Acquire) == STARTING
}

/// In the child of `fork()`: an initialisation under way in the parent never finishes
/// here (its thread was not copied), so the child starts over when it needs NVML.
/// Forked while one of the library's calls was inside NVML or loading a library
/// (`forked_mid_call`, [`crate::sys::foreign::after_fork`]), the child does without NVML.
pub fn after_fork(forked_mid_call: bool) {
    BACKGROUND_BUSY.store(false, Ordering::Release);
    // The child is another process: its entry is found anew.
    OWN_PID.store(0, Ordering::Release);
    if forked_mid_call {
        INITIALISED.store(FAILED, Ordering::Release);
        return;
    }
    let _ = INITIALISED.compare_exchange(STARTING, IDLE, Ordering::AcqRel, Ordering::Relaxed);
}

fn init_now() -> u8 {
    let _inside = foreign::Inside::enter();
    let start = std::time::Instant::now();
    let init = real_fn(F::Init);
    // SAFETY: nvmlInit_v2 takes no argument; NVML counts initialisations, so ours does
    // not disturb the program's own.
    let rc = (!init.is_null()).then(|| unsafe {
        let init: unsafe extern "C" fn() -> c_int = std::mem::transmute(init);
        init()
    });
    let state = if rc == Some(NVML_SUCCESS) { OK } else { FAILED };
    crate::sys::log::line(
        crate::config::LogLevel::Debug,
        format_args!(
            "NVML {} in {:.1} ms",
            if state == OK {
                "initialised"
            } else {
                "unavailable"
            },
            start.elapsed().as_secs_f64() * 1e3
        ),
    );
    state
}

/// The UUID of CUDA ordinal `device`, as NVML writes it ("GPU-xxxxxxxx-…").
pub fn cuda_uuid(device: usize) -> Option<String> {
    let mut handle = 0;
    let mut uuid = [0u8; 16];
    // SAFETY: valid out-pointers.
    let ok = unsafe {
        real::cuDeviceGet(&mut handle, device as i32).is_ok()
            && (real::cuDeviceGetUuid_v2(&mut uuid, handle).is_ok()
                || real::cuDeviceGetUuid(&mut uuid, handle).is_ok())
    };
    ok.then(|| cudabudget_spec::record::gpu_uuid(&uuid))
}

/// NVML handles of CUDA ordinals, once found (0 = not yet): finding one costs NVML
/// attaching to the GPU (about 6 ms), so it is done once.
static HANDLES: [AtomicUsize; MAX_DEVICES] = [const { AtomicUsize::new(0) }; MAX_DEVICES];

fn handle_of(device: usize) -> Option<NvmlDevice> {
    if !ready() {
        return None;
    }
    let cached = HANDLES.get(device)?.load(Ordering::Acquire);
    if cached != 0 {
        return Some(cached as NvmlDevice);
    }
    let uuid = std::ffi::CString::new(cuda_uuid(device)?).ok()?;
    let f = real_fn(F::GetHandleByUUID);
    if f.is_null() {
        return None;
    }
    let mut handle: NvmlDevice = std::ptr::null_mut();
    let _inside = foreign::Inside::enter();
    // SAFETY: nvmlDeviceGetHandleByUUID(const char*, nvmlDevice_t*).
    let rc = unsafe {
        let f: unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> c_int =
            std::mem::transmute(f);
        f(uuid.as_ptr(), &mut handle)
    };
    if rc != NVML_SUCCESS || handle.is_null() {
        return None;
    }
    HANDLES[device].store(handle as usize, Ordering::Release);
    Some(handle)
}

/// Whether NVML knows CUDA ordinal `device` (it may not: under MIG an instance's CUDA
/// UUID is not an NVML device's).
pub fn sees(device: usize) -> bool {
    handle_of(device).is_some()
}

/// Finds (and keeps) the NVML handle of CUDA ordinal `device`, if NVML can.
pub fn attach(device: usize) {
    let _ = handle_of(device);
}

/// The processes NVML lists on CUDA ordinal `device` (at most 128), or `None` when
/// NVML cannot say.
fn processes(device: usize) -> Option<([ProcessInfo; 128], usize)> {
    let handle = handle_of(device)?;
    let f = real_fn(F::GetComputeRunningProcessesV3);
    if f.is_null() {
        return None;
    }
    let mut infos = [ProcessInfo {
        pid: 0,
        used_gpu_memory: 0,
        gpu_instance_id: 0,
        compute_instance_id: 0,
    }; 128];
    let mut count: c_uint = infos.len() as c_uint;
    let _inside = foreign::Inside::enter();
    // SAFETY: nvmlDeviceGetComputeRunningProcesses_v3(device, unsigned*, nvmlProcessInfo_t*)
    // with room for `count` entries.
    let rc = unsafe {
        let f: unsafe extern "C" fn(NvmlDevice, *mut c_uint, *mut ProcessInfo) -> c_int =
            std::mem::transmute(f);
        f(handle, &mut count, infos.as_mut_ptr())
    };
    (rc == NVML_SUCCESS).then_some((infos, (count as usize).min(128)))
}

/// This process's pid as NVML lists it: its own, or — in a PID namespace, where NVML
/// lists host pids — the one [`find_own_pid`] found (0 until then).
static OWN_PID: AtomicU32 = AtomicU32::new(0);

fn own_pid() -> u32 {
    match OWN_PID.load(Ordering::Acquire) {
        0 => std::process::id(),
        pid => pid,
    }
}

/// The pids NVML lists on `device` now, for [`find_own_pid`].
pub fn pids(device: usize) -> Option<Vec<u32>> {
    let (infos, count) = processes(device)?;
    Some(infos[..count].iter().map(|p| p.pid).collect())
}

/// In a PID namespace: our host pid is the one pid that appeared on `device` across our
/// first context's creation (`before`: the list just before it). With none or several
/// (another process started a context at the same moment), nothing is decided. Returns
/// whether this process's entry is known now.
pub fn find_own_pid(device: usize, before: &[u32]) -> bool {
    if OWN_PID.load(Ordering::Acquire) != 0 {
        return true;
    }
    let Some(after) = pids(device) else {
        return false;
    };
    let mut new = after.iter().filter(|p| !before.contains(p));
    match (new.next(), new.next()) {
        (Some(&pid), None) => {
            OWN_PID.store(pid, Ordering::Release);
            true
        }
        _ => false,
    }
}

/// What `nvidia-smi` shows for this process on CUDA ordinal `device`; `None` when NVML
/// cannot say (missing, or this process is not in its list, as in a PID namespace
/// before [`find_own_pid`] found it).
pub fn process_used(device: usize) -> Option<u64> {
    let (infos, count) = processes(device)?;
    let pid = own_pid();
    infos[..count]
        .iter()
        .find(|p| p.pid == pid)
        .map(|p| p.used_gpu_memory)
        // NVML_VALUE_NOT_AVAILABLE (MIG, vGPU, no permission): not a figure.
        .filter(|&used| used != NVML_VALUE_NOT_AVAILABLE)
}

/// Memory in use on the whole device (all processes).
pub fn device_used(device: usize) -> Option<u64> {
    let handle = handle_of(device)?;
    let f = real_fn(F::GetMemoryInfo);
    if f.is_null() {
        return None;
    }
    let mut m = Memory {
        total: 0,
        free: 0,
        used: 0,
    };
    let _inside = foreign::Inside::enter();
    // SAFETY: nvmlDeviceGetMemoryInfo(device, nvmlMemory_t*).
    let rc = unsafe {
        let f: unsafe extern "C" fn(NvmlDevice, *mut Memory) -> c_int = std::mem::transmute(f);
        f(handle, &mut m)
    };
    (rc == NVML_SUCCESS).then_some(m.used)
}

/// The CUDA ordinal of an NVML device in this process: by UUID when CUDA is initialised
/// here, else from `visible` (`CUDA_VISIBLE_DEVICES`: indices or UUID prefixes), as CUDA
/// would number the devices.
pub fn ordinal_of(device: NvmlDevice, visible: Option<&str>) -> Option<usize> {
    let uuid = nvml_uuid(device)?;
    let mut count = 0;
    // SAFETY: a valid out-pointer; fails harmlessly before cuInit.
    if driver::load() && unsafe { real::cuDeviceGetCount(&mut count) }.is_ok() {
        return (0..count.max(0) as usize).find(|&d| cuda_uuid(d).as_deref() == Some(&uuid));
    }
    let index = nvml_index(device)?;
    ordinal_from_visible(visible, index, &uuid)
}

fn nvml_uuid(device: NvmlDevice) -> Option<String> {
    let f = real_fn(F::GetUUID);
    if f.is_null() {
        return None;
    }
    let mut buf = [0 as c_char; 96];
    let _inside = foreign::Inside::enter();
    // SAFETY: nvmlDeviceGetUUID(device, char*, unsigned) with the buffer's size.
    let rc = unsafe {
        let f: unsafe extern "C" fn(NvmlDevice, *mut c_char, c_uint) -> c_int =
            std::mem::transmute(f);
        f(device, buf.as_mut_ptr(), buf.len() as c_uint)
    };
    if rc != NVML_SUCCESS {
        return None;
    }
    buf[buf.len() - 1] = 0;
    // SAFETY: NUL-terminated within the buffer (forced above).
    Some(
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned(),
    )
}

fn nvml_index(device: NvmlDevice) -> Option<u32> {
    let f = real_fn(F::GetIndex);
    if f.is_null() {
        return None;
    }
    let mut index: c_uint = 0;
    let _inside = foreign::Inside::enter();
    // SAFETY: nvmlDeviceGetIndex(device, unsigned*).
    let rc = unsafe {
        let f: unsafe extern "C" fn(NvmlDevice, *mut c_uint) -> c_int = std::mem::transmute(f);
        f(device, &mut index)
    };
    (rc == NVML_SUCCESS).then_some(index)
}

/// CUDA's numbering under `CUDA_VISIBLE_DEVICES`: the k-th valid entry is ordinal k; an
/// entry is an NVML index or a UUID prefix; parsing stops at the first invalid entry.
pub fn ordinal_from_visible(visible: Option<&str>, index: u32, uuid: &str) -> Option<usize> {
    let Some(visible) = visible else {
        return Some(index as usize);
    };
    for (ordinal, entry) in visible.split(',').map(str::trim).enumerate() {
        if let Ok(i) = entry.parse::<u32>() {
            if i == index {
                return Some(ordinal);
            }
        } else if entry.starts_with("GPU-") {
            if uuid.starts_with(entry) {
                return Some(ordinal);
            }
        } else {
            return None;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visible_devices_renumber_nvml_indices() {
        let uuid = "GPU-aaaa";
        assert_eq!(ordinal_from_visible(None, 1, uuid), Some(1));
        assert_eq!(ordinal_from_visible(Some("1"), 1, uuid), Some(0));
        assert_eq!(ordinal_from_visible(Some("1"), 0, uuid), None);
        assert_eq!(ordinal_from_visible(Some("2,0"), 0, uuid), Some(1));
        assert_eq!(ordinal_from_visible(Some("GPU-aa"), 3, uuid), Some(0));
        assert_eq!(ordinal_from_visible(Some("5,GPU-aa"), 3, uuid), Some(1));
        // CUDA stops at the first invalid entry.
        assert_eq!(ordinal_from_visible(Some("x,0"), 0, uuid), None);
    }
}
