//! The process-wide state the hooks share: whether the library budgets at all, the
//! configuration, the ledger, and which device a call is for.
//!
//! The mode is a state machine in one atomic (bytehound's pattern), decided lazily
//! ([`crate::lifecycle`]) by the first hook that needs it — never by a constructor or by
//! `dlsym`. After that, deciding what to do costs a hook one load. This module only
//! keeps the answer: it never calls up into the decision.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

use crate::books::ledger::{AddrTable, Budget, DeviceLedger, Ledger, PointerMap};
use crate::config::Config;
use crate::sys::driver::real;

/// What the hooks do in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Budgets are configured: account and enforce.
    Budgeted,
    /// No budget variable is set: call the driver and nothing else.
    Passthrough,
    /// The configuration is malformed: CUDA is refused.
    Refused,
    /// `libcuda.so.1` could not be opened by us.
    NoDriver,
}

const UNINIT: u8 = 0;
const BUDGETED: u8 = 2;
const PASSTHROUGH: u8 = 3;
const REFUSED: u8 = 4;
const NO_DRIVER: u8 = 5;

static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static CONFIG: OnceLock<Config> = OnceLock::new();
static LEDGER: Ledger = Ledger::new();
/// Device pointers from every allocation path. Apart from the ledger so that it is
/// zero-initialised (in .bss, not 12 MiB of the library's file).
static POINTERS: PointerMap = PointerMap::new();
/// Array handles (`CUarray`, `CUmipmappedArray`) and what they hold.
static ARRAYS: AddrTable<{ 1 << 12 }> = AddrTable::new();

/// Whether the mode is decided and is `Budgeted`: one load, what every hook asks first.
#[inline(always)]
pub fn is_budgeted() -> bool {
    STATE.load(Ordering::Acquire) == BUDGETED
}

/// The mode, once decided; `None` before ([`crate::lifecycle::mode`] decides it).
#[inline(always)]
pub fn known_mode() -> Option<Mode> {
    match STATE.load(Ordering::Acquire) {
        BUDGETED => Some(Mode::Budgeted),
        PASSTHROUGH => Some(Mode::Passthrough),
        REFUSED => Some(Mode::Refused),
        NO_DRIVER => Some(Mode::NoDriver),
        _ => None,
    }
}

/// A hook's proof that it entered a budgeted process ([`crate::lifecycle::enter`]): the
/// decisions below take it instead of asking the mode again. Costs nothing to pass.
#[derive(Clone, Copy)]
pub struct Cx(());

impl Cx {
    /// Only for [`crate::lifecycle::enter`], once the mode is `Budgeted` (and unit tests).
    #[inline(always)]
    pub(crate) const fn budgeted() -> Cx {
        Cx(())
    }
}

/// The state a decision ([`crate::lifecycle`]) arrived at, as stored.
fn state_of(mode: Mode) -> u8 {
    match mode {
        Mode::Budgeted => BUDGETED,
        Mode::Passthrough => PASSTHROUGH,
        Mode::Refused => REFUSED,
        Mode::NoDriver => NO_DRIVER,
    }
}

/// Publishes the process's mode, once: true for the one caller whose answer stands.
pub(crate) fn settle_mode(mode: Mode) -> bool {
    STATE
        .compare_exchange(UNINIT, state_of(mode), Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
}

/// Keeps the configuration (the first one set stands).
pub(crate) fn set_config(config: Config) {
    let _ = CONFIG.set(config);
}

/// In the child of `fork()`: empty books and address tables.
///
/// # Safety
/// Only from an at-fork child handler.
pub(crate) unsafe fn reset_in_child() {
    // SAFETY: the caller's guarantee.
    unsafe {
        for (_, d) in LEDGER.devices() {
            d.clear_in_child();
        }
        POINTERS.reset_in_child();
        ARRAYS.reset_in_child();
    }
}

pub fn config() -> Option<&'static Config> {
    CONFIG.get()
}

pub fn ledger() -> &'static Ledger {
    &LEDGER
}

pub fn pointers() -> &'static PointerMap {
    &POINTERS
}

pub fn arrays() -> &'static AddrTable<{ 1 << 12 }> {
    &ARRAYS
}

/// Devices the process sees (0 until asked successfully).
static DEVICE_COUNT: AtomicU32 = AtomicU32::new(0);

fn device_count() -> u32 {
    let n = DEVICE_COUNT.load(Ordering::Relaxed);
    if n != 0 {
        return n;
    }
    let mut count = 0;
    // SAFETY: a valid out-pointer.
    let rc = unsafe { real::cuDeviceGetCount(&mut count) };
    if rc.is_ok() && count > 0 {
        DEVICE_COUNT.store(count as u32, Ordering::Relaxed);
        count as u32
    } else {
        0
    }
}

/// Sleeps in short steps while `busy()` holds, at most `limit`; returns the time spent.
/// Every wait of the library is one of these: bounded, never on a lock.
pub fn wait_while(limit: std::time::Duration, busy: impl Fn() -> bool) -> std::time::Duration {
    let start = std::time::Instant::now();
    while busy() && start.elapsed() < limit {
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    start.elapsed()
}

/// Devices the process sees, once the driver is initialised (0 before).
pub fn visible_devices() -> usize {
    device_count() as usize
}

/// Whether the process sees exactly one device (then every call is for ordinal 0).
#[inline]
pub fn single_device() -> bool {
    known_single_device() || device_count() == 1
}

/// As [`single_device`], from what is already known: never calls the driver.
#[inline(always)]
pub fn known_single_device() -> bool {
    DEVICE_COUNT.load(Ordering::Relaxed) == 1
}

/// The calling context's device. A process that sees one device needs no driver call.
#[inline]
pub fn current_device() -> Option<usize> {
    if single_device() {
        return Some(0);
    }
    let mut device = 0;
    // SAFETY: a valid out-pointer.
    let rc = unsafe { real::cuCtxGetDevice(&mut device) };
    (rc.is_ok() && device >= 0).then_some(device as usize)
}

/// The device of `stream`, where its stream-ordered memory lives: the stream's own
/// device, or the calling context's for the NULL, legacy and per-thread streams (and
/// for a driver that cannot say). A process that sees one device needs no driver call.
pub fn stream_device(stream: crate::sys::driver::Handle) -> Option<usize> {
    if single_device() {
        return Some(0);
    }
    // NULL, CU_STREAM_LEGACY (0x1), CU_STREAM_PER_THREAD (0x2).
    if stream as usize > 2 {
        let mut device = 0;
        // SAFETY: the caller's stream handle and a valid out-pointer.
        let rc = unsafe { real::cuStreamGetDevice(stream, &mut device) };
        if rc.is_ok() && device >= 0 {
            return Some(device as usize);
        }
    }
    current_device()
}

/// The ledger of `device` when that device has a budget.
#[inline]
pub fn budgeted(device: usize) -> Option<&'static DeviceLedger> {
    let d = LEDGER.device(device)?;
    match d.budget() {
        Budget::Unbudgeted => None,
        Budget::Unresolved => resolve_budget(device, d, None),
        Budget::Bytes(_) => Some(d),
    }
}

/// As [`budgeted`], where the caller knows the device's size (NVML, in a process that
/// never initialised CUDA).
pub fn budgeted_with_total(device: usize, total: u64) -> Option<&'static DeviceLedger> {
    let d = LEDGER.device(device)?;
    match d.budget() {
        Budget::Unbudgeted => None,
        Budget::Unresolved => resolve_budget(device, d, Some(total)),
        Budget::Bytes(_) => Some(d),
    }
}

/// The ledger of the calling context's device when it has a budget: what every
/// allocation hook starts with.
#[inline]
pub fn budgeted_current() -> Option<(usize, &'static DeviceLedger)> {
    let device = current_device()?;
    budgeted(device).map(|d| (device, d))
}

#[cold]
fn resolve_budget(
    device: usize,
    d: &'static DeviceLedger,
    known_total: Option<u64>,
) -> Option<&'static DeviceLedger> {
    let Some(limit) = config()?.limit_for(device as u32) else {
        d.set_budget(Budget::Unbudgeted);
        return None;
    };
    let bytes = match limit.fixed() {
        Some(b) => b,
        // A percentage needs the device's size; until it is known, stay unresolved.
        None => limit.resolve(physical_total(device).or(known_total)?),
    };
    match crate::books::job::joined() {
        Some(job) => {
            // The job's budget is its ledger's: the first member's, or an operator's.
            let in_force = job.adopt_budget(device, bytes);
            // Said once per device (the budget may be worked out again after a reset).
            static SAID: AtomicU64 = AtomicU64::new(0);
            let bit = 1u64 << (device % 64);
            if in_force != bytes && SAID.fetch_or(bit, Ordering::Relaxed) & bit == 0 {
                crate::sys::log::line(
                    crate::config::LogLevel::Warn,
                    format_args!(
                        "job ledger {}: device {device}'s budget is the job's {}, not this process's {}",
                        job.path(),
                        cudabudget_spec::quantity::format_bytes(in_force),
                        cudabudget_spec::quantity::format_bytes(bytes)
                    ),
                );
            }
            d.set_budget(Budget::Bytes(in_force));
            d.join_job(device);
        }
        None => d.set_budget(Budget::Bytes(bytes)),
    }
    Some(d)
}

/// The device's physical memory, from the driver.
pub fn physical_total(device: usize) -> Option<u64> {
    let mut handle = 0;
    let mut total = 0usize;
    // SAFETY: valid out-pointers.
    let ok = unsafe {
        real::cuDeviceGet(&mut handle, device as i32).is_ok()
            && real::cuDeviceTotalMem_v2(&mut total, handle).is_ok()
    };
    ok.then_some(total as u64)
}

/// This thread's pool-credit shard, from the address of its stack: threads' stacks lie
/// megabytes apart, so this spreads threads over the shards without a thread-local
/// variable (which, in a preloaded library, costs a call to `__tls_get_addr`). Any shard
/// is correct; the spread only keeps threads off each other's cache lines.
#[inline]
pub fn shard() -> usize {
    let marker = 0u8;
    let stack = std::ptr::addr_of!(marker) as usize >> 21;
    (stack.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 59) % crate::books::ledger::POOL_SHARDS
}
