//! The process-wide state the hooks share: whether the library budgets at all, the
//! configuration, the ledger, and which device a call is for; and the call's context
//! ([`Cx`]), which resolves a call's device once ([`DeviceCx`]: its ledger, the budget in
//! force, its job) for the decisions below.
//!
//! The mode is a state machine in one atomic (bytehound's pattern), decided lazily
//! ([`crate::lifecycle`]) by the first hook that needs it — never by a constructor or by
//! `dlsym`. After that, deciding what to do costs a hook one load. This module only
//! keeps the answer: it never calls up into the decision.

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

use crate::books::ledger::{
    AddrTable, Budget, Denial, DeviceLedger, InForce, Ledger, PointerMap, Reservation,
};
use crate::config::Config;
use crate::sys::driver::{Stream, real};

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
static CONFIG: Settled = Settled::new();
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

/// A hook's context ([`crate::lifecycle::enter`]): the proof that it entered a budgeted
/// process, and the configuration, so that the decisions below neither ask the mode again
/// nor look the configuration up. [`Cx::device`] resolves a device for the call, once.
/// Costs nothing to make nor to pass: the configuration is set before the mode is
/// `Budgeted`, at a fixed place, so the context carries it in its type.
#[derive(Clone, Copy)]
pub struct Cx(());

impl Cx {
    /// Only for [`crate::lifecycle`], once the mode is `Budgeted` (the configuration is
    /// then set for good).
    #[inline(always)]
    pub(crate) const fn budgeted() -> Cx {
        Cx(())
    }

    /// The configuration the process runs under.
    #[inline(always)]
    pub fn config(self) -> &'static Config {
        // SAFETY: a `Cx` is made only once the mode is `Budgeted`, which it is only once
        // the configuration is set (`lifecycle::decide` sets it before the mode is
        // settled), and it never changes.
        unsafe { CONFIG.get_unchecked() }
    }

    /// Device `ordinal` for this call, when it has a budget: its ledger and the budget in
    /// force now (working out the budget on the device's first call). `None`: the device
    /// has no budget (or not yet: a percentage before the device's size is known), and
    /// the call passes through.
    #[inline]
    pub fn device(self, ordinal: usize) -> Option<DeviceCx> {
        self.device_sized(ordinal, None)
    }

    /// As [`Cx::device`], where the caller knows the device's size (NVML, in a process
    /// that never initialised CUDA).
    pub fn device_of_size(self, ordinal: usize, total: u64) -> Option<DeviceCx> {
        self.device_sized(ordinal, Some(total))
    }

    /// The calling context's device, as [`Cx::device`].
    #[inline]
    pub fn current_device(self) -> Option<DeviceCx> {
        self.device(current_device()?)
    }

    #[inline(always)]
    fn device_sized(self, ordinal: usize, total: Option<u64>) -> Option<DeviceCx> {
        let ledger = LEDGER.device(ordinal)?;
        let in_force = match ledger.budget() {
            Budget::Unbudgeted => return None,
            Budget::Unresolved => resolve_budget(self.config(), ordinal, ledger, total)?,
            // The device's own budget, unless it is a job's (then as the job's ledger
            // holds it now).
            Budget::Bytes(bytes) => match ledger.job() {
                None => InForce { bytes, job: None },
                Some(_) => ledger.in_force(),
            },
        };
        Some(DeviceCx::new(ordinal, ledger, in_force))
    }
}

/// A budgeted device as one call sees it, resolved once ([`Cx::device`]): its ordinal,
/// its ledger, the budget in force (the device's own, or its job's, with the job whose
/// books a reservation must fit too) and the configuration. What the decisions below take
/// instead of looking any of them up again.
#[derive(Clone, Copy)]
pub struct DeviceCx {
    pub ordinal: usize,
    pub ledger: &'static DeviceLedger,
    /// The budget in force when the call was resolved: a request is measured against it.
    pub budget: u64,
    /// The job the budget is, if it is one's (the device's index there is its ordinal).
    job: Option<&'static crate::books::job::Job>,
}

impl DeviceCx {
    #[inline(always)]
    fn new(ordinal: usize, ledger: &'static DeviceLedger, in_force: InForce) -> DeviceCx {
        DeviceCx {
            ordinal,
            ledger,
            budget: in_force.bytes,
            job: in_force.job.map(|(job, _)| job),
        }
    }

    /// The configuration the process runs under (made only from a [`Cx`]: it is set).
    #[inline(always)]
    pub fn config(&self) -> &'static Config {
        Cx::budgeted().config()
    }

    /// Reserves `bytes` within the budget in force ([`DeviceLedger::reserve`]).
    #[inline(always)]
    pub fn reserve(&self, bytes: u64) -> Result<Reservation<'static>, Denial> {
        let job = self.job();
        self.ledger.reserve(
            bytes,
            InForce {
                bytes: self.budget,
                job,
            },
        )
    }

    /// The same device with `bytes` less of its budget in force.
    pub fn less(&self, bytes: u64) -> DeviceCx {
        DeviceCx {
            budget: self.budget.saturating_sub(bytes),
            ..*self
        }
    }

    /// The same device with the budget in force as the ledger holds it now: a request
    /// that waits looks again, since the budget may change meanwhile (`cudabudget limit`).
    pub fn looked_again(self) -> DeviceCx {
        DeviceCx::new(self.ordinal, self.ledger, self.ledger.in_force())
    }

    /// The job this device's budget belongs to, with the device's index there.
    #[inline(always)]
    pub fn job(&self) -> Option<(&'static crate::books::job::Job, usize)> {
        self.job.map(|job| (job, self.ordinal))
    }
}

/// The configuration: set once, by the first thread to work it out; from then on at a
/// fixed place, so that a [`Cx`] carries it for nothing.
struct Settled {
    /// [`EMPTY`], [`WRITING`] (one thread is storing it), [`SET`].
    state: AtomicU8,
    value: UnsafeCell<MaybeUninit<Config>>,
}

const EMPTY: u8 = 0;
const WRITING: u8 = 1;
const SET: u8 = 2;

// SAFETY: the value is written once, by the one thread that moved `state` from EMPTY,
// and read only after `state` is SET (Release/Acquire), or once the mode is published
// (which happens after).
unsafe impl Sync for Settled {}

impl Settled {
    const fn new() -> Settled {
        Settled {
            state: AtomicU8::new(EMPTY),
            value: UnsafeCell::new(MaybeUninit::uninit()),
        }
    }

    /// Keeps `config` unless one is set; returns the one that stands. A thread that comes
    /// while another stores its own waits the few instructions of that store.
    fn set(&self, config: Config) -> &Config {
        if self
            .state
            .compare_exchange(EMPTY, WRITING, Ordering::Acquire, Ordering::Acquire)
            .is_ok()
        {
            // SAFETY: this thread alone moved the state from EMPTY: nobody reads yet.
            unsafe { (*self.value.get()).write(config) };
            self.state.store(SET, Ordering::Release);
        } else {
            while self.state.load(Ordering::Acquire) != SET {
                std::hint::spin_loop();
            }
        }
        // SAFETY: SET, seen with Acquire.
        unsafe { self.get_unchecked() }
    }

    fn get(&self) -> Option<&Config> {
        // SAFETY: SET, seen with Acquire.
        (self.state.load(Ordering::Acquire) == SET).then(|| unsafe { self.get_unchecked() })
    }

    /// # Safety
    /// Only once the value is set, as seen by this thread.
    #[inline(always)]
    unsafe fn get_unchecked(&self) -> &Config {
        // SAFETY: the caller's guarantee.
        unsafe { (*self.value.get()).assume_init_ref() }
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

/// Keeps the configuration (the first one set stands), and returns the one that stands.
pub(crate) fn set_config(config: Config) -> &'static Config {
    CONFIG.set(config)
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

/// The configuration, once set: for what runs outside a hook's call (the background
/// threads, the report at exit); a hook's decisions take it from their [`Cx`].
pub fn config() -> Option<&'static Config> {
    CONFIG.get()
}

pub fn ledger() -> &'static Ledger {
    &LEDGER
}

pub const fn pointers() -> &'static PointerMap {
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
pub fn stream_device(stream: Stream) -> Option<usize> {
    if single_device() {
        return Some(0);
    }
    if !stream.is_default() {
        let mut device = 0;
        // SAFETY: the caller's stream handle and a valid out-pointer.
        let rc = unsafe { real::cuStreamGetDevice(stream, &mut device) };
        if rc.is_ok() && device >= 0 {
            return Some(device as usize);
        }
    }
    current_device()
}

/// Works out device `ordinal`'s budget from the configuration, on its first call: the
/// bytes the configuration gives it (a percentage of the device's size), or in a job the
/// job's (the first member's, or an operator's), kept in the device's ledger for every
/// call after. Returns the budget in force; `None`: the device has none (or not yet).
#[cold]
fn resolve_budget(
    config: &Config,
    device: usize,
    d: &'static DeviceLedger,
    known_total: Option<u64>,
) -> Option<InForce> {
    let Some(limit) = config.limit_for(device as u32) else {
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
            // Joined first: a fast path that sees the budget sees the job too.
            d.join_job(device);
            d.set_budget(Budget::Bytes(in_force));
        }
        None => d.set_budget(Budget::Bytes(bytes)),
    }
    Some(d.in_force())
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
