//! The real footprint: what `nvidia-smi` shows for the process, not only what the hooks
//! saw. The context is charged when it is created; after that, NVML's per-process figure
//! is compared with what the ledger tracks, at a bounded rate (never per call), and the
//! difference — modules, the context, anything allocated by paths we do not hook — is
//! charged as the device's overhead.
//!
//! NVML costs tens of milliseconds to start (its initialisation, then attaching to each
//! GPU), and that work contends with the driver's own in the kernel: beside `cuInit` it
//! made `cuInit` 9 ms slower on an H200, beside the first context's creation it made that
//! 5 ms slower on an H100. So it runs on a thread of its own, and nothing on the
//! program's threads waits for it at start-up where that can be helped:
//! - Where the context's cost is known (measured for the model, or
//!   `CUDABUDGET_CONTEXT_MEMORY`), NVML starts once the first context exists, and until
//!   it has measured the context, the context is charged that estimate ([`estimate_of`]),
//!   views show it, and an allocation is admitted at once only if it would also fit
//!   beside a context twice that size, and at least the model's figure larger
//!   ([`margin`]); one that would not waits (bounded) for NVML's figure.
//! - Elsewhere NVML starts at `cuInit`, and a context created before NVML is ready is
//!   charged by NVML's thread as soon as it is, and — the one wait, bounded — before the
//!   first allocation or view on that device if that comes sooner.
//! - In a PID namespace the device's use must be read before the context, so NVML starts
//!   at `cuInit` and the first context waits for it.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};

use crate::books::ledger::MAX_DEVICES;
use crate::books::vmm;
use crate::config::LogLevel;
use crate::runtime::{self, Cx, DeviceCx};
use crate::sys::lock::{Guard, Lock};
use crate::sys::nvml;
use crate::tell::report::{self, Bytes};

/// Which contexts the process holds that the footprint counts: the primary context of
/// each device while it is active (retained by us seeing it go from inactive), and every
/// context from `cuCtxCreate` with its device. Held across a primary retain or release,
/// so that two threads cannot both take one retain for the context's creation (or miss
/// its end).
pub struct ContextBooks {
    pub primary: [bool; MAX_DEVICES],
    /// `(context handle, device)` of the contexts from `cuCtxCreate`.
    pub created: Vec<(usize, usize)>,
}

static CONTEXT_BOOKS: Lock<ContextBooks> = Lock::new(ContextBooks {
    primary: [false; MAX_DEVICES],
    created: Vec::new(),
});

/// The context books, locked.
pub fn context_books() -> Guard<'static, ContextBooks> {
    CONTEXT_BOOKS.lock()
}

/// Routine re-reads: at most once a second per device.
const ROUTINE_MS: u64 = 1000;
/// Re-reads before a denial: at most ten a second per device.
const URGENT_MS: u64 = 100;

static LAST_MS: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
static CONTEXTS: [AtomicU32; MAX_DEVICES] = [const { AtomicU32::new(0) }; MAX_DEVICES];
/// Contexts being created on the device right now (their memory is arriving).
static CREATING: [AtomicU32; MAX_DEVICES] = [const { AtomicU32::new(0) }; MAX_DEVICES];
/// In a PID namespace, the pids NVML listed on a device just before our first context
/// there: the one that appears with the context is ours.
static BEFORE_PIDS: Lock<Vec<(usize, Vec<u32>)>> = Lock::new(Vec::new());
/// Device-wide use (NVML) before the device's first context; [`UNKNOWN`] until read.
static BEFORE: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(UNKNOWN) }; MAX_DEVICES];
/// Where the charge of the device's first context stands: [`SETTLED`], [`PENDING`] (the
/// context exists, NVML was not ready; admissions wait), [`ESTIMATED`] (charged its
/// estimate until NVML measures it; admissions keep a [`margin`]) or [`CHARGING`] (a
/// thread is measuring it now; admissions wait).
static CHARGE: [AtomicU8; MAX_DEVICES] = [const { AtomicU8::new(SETTLED) }; MAX_DEVICES];
const SETTLED: u8 = 0;
const PENDING: u8 = 1;
const CHARGING: u8 = 2;
const ESTIMATED: u8 = 3;
/// While the device's first context is charged its estimate: that estimate again, which
/// an admission leaves free beside what it reserves (0 otherwise).
static MARGIN: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// Set by the cuInit hook once the driver is initialised.
static DRIVER_READY: AtomicBool = AtomicBool::new(false);
/// Set by NVML's thread once it has attached the budgeted devices: from then on a
/// context is charged as it is created.
static NVML_WARM: AtomicBool = AtomicBool::new(false);
const UNKNOWN: u64 = u64::MAX;

/// The program's `cuInit` returned (`ok`: it succeeded). NVML starts now, on its own
/// thread, unless the first device's context has a known cost and the process is not in
/// a PID namespace: then once the first context exists ([`context_created`]).
pub fn driver_initialised(cx: Cx, ok: bool) {
    let later = ok && !in_pid_namespace() && known_cost(cx.config(), 0);
    if !later {
        nvml::prewarm(move |ok| nvml_ready(cx, ok));
    }
    if ok {
        DRIVER_READY.store(true, Ordering::Release);
    }
}

/// Whether a context's cost on CUDA ordinal `device` is known before NVML measures it:
/// `CUDABUDGET_CONTEXT_MEMORY`, or measured for the device's model.
fn known_cost(config: &crate::config::Config, device: usize) -> bool {
    config.context_memory.is_some() || model_estimate(&device_name(device)).is_some()
}

/// On NVML's thread, once NVML's initialisation has ended (`ok`: NVML is there): waits
/// for the driver, attaches each budgeted device, then charges the contexts created
/// meanwhile. All of it off the program's threads. Without NVML, a context charged its
/// estimate keeps it, and admissions no longer keep a margin for it.
pub fn nvml_ready(cx: Cx, ok: bool) {
    if !ok {
        settle_all(cx);
        return;
    }
    let start = std::time::Instant::now();
    while !DRIVER_READY.load(Ordering::Acquire) {
        // Quick at first (cuInit is under way); then slowly, for a program whose cuInit
        // failed and may be retried later.
        let nap = if start.elapsed() < std::time::Duration::from_secs(10) {
            500
        } else {
            50_000
        };
        std::thread::sleep(std::time::Duration::from_micros(nap));
    }
    nvml::background_busy(true);
    for device in 0..runtime::visible_devices().min(MAX_DEVICES) {
        if cx.device(device).is_some() {
            nvml::attach(device);
        }
    }
    NVML_WARM.store(true, Ordering::SeqCst);
    settle_all(cx);
    nvml::background_busy(false);
    crate::sys::log::line(
        LogLevel::Debug,
        format_args!(
            "NVML attached {:.1} ms after initialisation",
            start.elapsed().as_secs_f64() * 1e3
        ),
    );
}

/// Charges every device's first context that is pending or charged its estimate (only a
/// budgeted device's ever is) with what NVML gives now.
fn settle_all(cx: Cx) {
    for (device, charge) in CHARGE.iter().enumerate() {
        if charge.load(Ordering::SeqCst) != SETTLED
            && let Some(dev) = cx.device(device)
        {
            settle(&dev);
        }
    }
}

/// Reads the device's use now as the "before" of its first context, if no context of
/// ours is on it or being created (checked on both sides of the reading).
fn read_before(device: usize) {
    let quiet = || {
        CONTEXTS[device].load(Ordering::Acquire) == 0
            && CREATING[device].load(Ordering::Acquire) == 0
    };
    if !quiet() {
        return;
    }
    if let Some(used) = nvml::device_used(device)
        && quiet()
    {
        BEFORE[device].store(used, Ordering::Release);
    }
}

/// A context is about to be created on `device` (`dev`: the device, when it has a
/// budget). Waits for NVML only in a PID
/// namespace (a container), where NVML does not list this process and the device's use
/// before the context is the only way to measure it; elsewhere the context is charged
/// from NVML's per-process figure later, and nothing waits.
pub fn before_context(device: usize, dev: Option<&DeviceCx>) {
    let Some(creating) = CREATING.get(device) else {
        return;
    };
    if CONTEXTS[device].load(Ordering::Acquire) == 0 && dev.is_some() {
        if !NVML_WARM.load(Ordering::Acquire) && in_pid_namespace() {
            let waited = runtime::wait_while(std::time::Duration::from_secs(2), || {
                !NVML_WARM.load(Ordering::Acquire) && nvml::usable()
            });
            crate::sys::log::line(
                LogLevel::Debug,
                format_args!("device {device}: waited {waited:?} for NVML before the context"),
            );
        }
        if NVML_WARM.load(Ordering::Acquire) {
            read_before(device);
            if in_pid_namespace()
                && let Some(pids) = nvml::pids(device)
            {
                let mut before = BEFORE_PIDS.lock();
                before.retain(|(d, _)| *d != device);
                before.push((device, pids));
            }
        }
    }
    creating.fetch_add(1, Ordering::AcqRel);
}

/// Whether the process holds a context on `device` that the footprint counts.
pub fn has_context(device: usize) -> bool {
    CONTEXTS
        .get(device)
        .is_some_and(|c| c.load(Ordering::Acquire) > 0)
}

/// Whether this process is in a PID namespace other than the initial one, whose
/// `/proc/self/ns/pid` inode is fixed (PROC_PID_INIT_INO). NVML lists host pids, so
/// there it never finds ours.
fn in_pid_namespace() -> bool {
    const PROC_PID_INIT_INO: u64 = 0xEFFF_FFFC;
    static NAMESPACED: AtomicU8 = AtomicU8::new(0);
    match NAMESPACED.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            // Unknown (no /proc) counts as namespaced: the cost is a bounded wait.
            let nested = std::fs::metadata("/proc/self/ns/pid")
                .map(|m| std::os::unix::fs::MetadataExt::ino(&m) != PROC_PID_INIT_INO)
                .unwrap_or(true);
            NAMESPACED.store(if nested { 2 } else { 1 }, Ordering::Relaxed);
            nested
        }
    }
}

/// The context creation that [`before_context`] announced has ended; `created` when it
/// succeeded. The device's first context is charged now when NVML is ready. Else, where
/// its cost is known (outside a PID namespace), it is charged that estimate now and NVML
/// starts (its thread measures the context as soon as it can); elsewhere it is charged
/// by NVML's thread as soon as NVML is ready, and before any allocation or view on the
/// device in between.
pub fn context_created(cx: Cx, device: usize, dev: Option<&DeviceCx>, created: bool) {
    let (Some(count), Some(creating)) = (CONTEXTS.get(device), CREATING.get(device)) else {
        return;
    };
    // Pending before the context counts as there: a thread that creates a second
    // context at the same time cannot allocate past an uncounted first one.
    let budgeted = if created { dev } else { None };
    if budgeted.is_some() && count.load(Ordering::Acquire) == 0 {
        let _ =
            CHARGE[device].compare_exchange(SETTLED, PENDING, Ordering::SeqCst, Ordering::SeqCst);
    }
    let first = created && count.fetch_add(1, Ordering::AcqRel) == 0;
    creating.fetch_sub(1, Ordering::AcqRel);
    // Either this thread sees NVML warm or NVML's thread sees the charge pending (both
    // SeqCst).
    let Some(dev) = budgeted.filter(|_| first) else {
        return;
    };
    if NVML_WARM.load(Ordering::SeqCst) || nvml::unavailable() {
        // Measured now, or charged its estimate for good.
        settle(dev);
    } else {
        if !in_pid_namespace() && known_cost(dev.config(), device) {
            charge_estimate(dev);
        }
        // NVML's thread measures it as soon as it can (started now, where the first
        // device's known cost kept it from starting at `cuInit`).
        nvml::prewarm(move |ok| nvml_ready(cx, ok));
    }
}

/// The device's first context, pending, is charged its estimate until NVML measures it
/// (unless a thread is measuring it already).
fn charge_estimate(dev: &DeviceCx) {
    let (device, d) = (dev.ordinal, dev.ledger);
    if CHARGE[device]
        .compare_exchange(PENDING, CHARGING, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        return;
    }
    let (bytes, _) = estimate_of(dev);
    super::after::overhead_after(d, bytes.max(d.overhead()));
    // Room for a context of twice the estimate, and of the model's figure more than the
    // estimate where `CUDABUDGET_CONTEXT_MEMORY` says less.
    MARGIN[device].store(bytes.max(model_figure(device)), Ordering::SeqCst);
    CHARGE[device].store(ESTIMATED, Ordering::SeqCst);
    crate::sys::log::line(
        LogLevel::Debug,
        format_args!(
            "device {device}: context charged its estimate, {}, until NVML measures it",
            Bytes(bytes)
        ),
    );
}

/// What an admission on `device` leaves free beside its request: while the device's
/// first context is charged its estimate, the estimate again, or the model's figure where
/// that is more (a context up to that much above its estimate stays within the budget);
/// else 0.
#[inline]
pub fn margin(device: usize) -> u64 {
    MARGIN.get(device).map_or(0, |m| m.load(Ordering::Acquire))
}

/// Before an allocation is admitted on `device`, or a view of it: a context not charged
/// yet is charged first, waiting (bounded) for NVML if it is still starting, so that the
/// budget never admits memory the context already holds. One charged its estimate does
/// not wait.
#[inline]
pub fn settle_before_admission(dev: &DeviceCx) {
    if !is_charged(dev.ordinal) {
        settle_now(dev);
    }
}

/// Whether the device's first context is charged: measured, or its estimate (or there
/// was none pending).
#[inline]
fn is_charged(device: usize) -> bool {
    CHARGE
        .get(device)
        .is_none_or(|c| matches!(c.load(Ordering::Acquire), SETTLED | ESTIMATED))
}

/// Whether the charge of the device's first context is settled: measured (or was never
/// pending).
#[inline]
fn is_settled(device: usize) -> bool {
    CHARGE
        .get(device)
        .is_none_or(|c| c.load(Ordering::Acquire) == SETTLED)
}

/// The device's first context charged now, if it is pending or charged its estimate:
/// waits (bounded) for NVML if it is still starting, and for a thread measuring it. Also
/// for a request that did not fit beside the [`margin`], decided then on the figure.
#[cold]
#[inline(never)]
pub fn settle_now(dev: &DeviceCx) {
    let device = dev.ordinal;
    let waited = runtime::wait_while(std::time::Duration::from_secs(2), nvml::starting);
    settle(dev);
    // Another thread may be measuring the context right now: its figure first.
    let measured = runtime::wait_while(std::time::Duration::from_secs(2), || {
        CHARGE[device].load(Ordering::Acquire) == CHARGING
    });
    crate::sys::log::line(
        LogLevel::Debug,
        format_args!(
            "device {device}: waited {:?} for the context's charge",
            waited + measured
        ),
    );
}

/// Charges the device's first context if it is still pending or charged its estimate
/// (once, whoever comes first); admissions wait while it is measured.
fn settle(dev: &DeviceCx) {
    let device = dev.ordinal;
    struct Settled(usize);
    impl Drop for Settled {
        fn drop(&mut self) {
            MARGIN[self.0].store(0, Ordering::Release);
            CHARGE[self.0].store(SETTLED, Ordering::Release);
        }
    }
    let claim = |c: &AtomicU8, from| {
        c.compare_exchange(from, CHARGING, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    };
    if CHARGE
        .get(device)
        .is_some_and(|c| claim(c, PENDING) || claim(c, ESTIMATED))
    {
        let _settled = Settled(device);
        // An estimate charged until now is replaced by the figure measured.
        charge_context(dev, MARGIN[device].load(Ordering::Acquire));
    }
}

/// Charges the device's first context what NVML measures, in place of `estimated` (the
/// estimate it was charged until now, or 0).
fn charge_context(dev: &DeviceCx, estimated: u64) {
    let (device, d) = (dev.ordinal, dev.ledger);
    // In a PID namespace: our entry in NVML's list is the pid that appeared with the
    // context; once known, the per-process figure works as on the host.
    let before_pids = {
        let mut before = BEFORE_PIDS.lock();
        let at = before.iter().position(|(d, _)| *d == device);
        at.map(|i| before.swap_remove(i).1)
    };
    if let Some(pids) = before_pids {
        let found = nvml::find_own_pid(device, &pids);
        crate::sys::log::line(
            LogLevel::Debug,
            format_args!("device {device}: own entry in NVML's list found: {found}"),
        );
    }
    let epoch = d.books_epoch();
    let tracked = || d.used() - d.overhead().min(d.used());
    let before = BEFORE[device].load(Ordering::Acquire);
    // What the hooks track must not move while NVML is read (a pooled block can still
    // be freed meanwhile): read again until it holds still, a few times at most.
    let mut charge = 0;
    for _ in 0..3 {
        let seen = tracked();
        charge = match nvml::process_used(device) {
            Some(process) => process.saturating_sub(seen),
            // In a PID namespace NVML does not list us: the device's growth across the
            // context's creation (and what the hooks tracked since, taken out).
            None => match (before, nvml::device_used(device)) {
                (before, Some(after)) if before != UNKNOWN => {
                    after.saturating_sub(before).saturating_sub(seen)
                }
                // NVML answers and does not list us: the context holds nothing it sees.
                _ if nvml::initialised() && nvml::sees(device) && !in_pid_namespace() => 0,
                // Nothing measures it: the estimate is the context's alone (what the hooks
                // track is charged besides it).
                _ => estimate(dev),
            },
        };
        if tracked() == seen {
            break;
        }
    }
    // A context destroyed meanwhile took its memory with it.
    if d.books_epoch() != epoch {
        return;
    }
    // Never below what was charged already besides an estimate. (An allocation admitted
    // beside the estimate that has not reached the driver yet is missing from NVML's
    // figure, as it is at any routine re-read; the next one, within a second, has it.)
    super::after::overhead_after(d, charge.max(d.overhead().saturating_sub(estimated)));
    if let Some(last) = LAST_MS.get(device) {
        last.store(report::monotonic_ms(), Ordering::Relaxed);
    }
    crate::sys::log::line(
        LogLevel::Debug,
        format_args!("device {device}: context charged {}", Bytes(charge)),
    );
}

/// What a context costs where nothing can measure it (no NVML, or NVML not started
/// in time): `CUDABUDGET_CONTEXT_MEMORY`, else the figure measured for the device's
/// model, else [`DEFAULT_CONTEXT`]. The footprint re-read replaces it by NVML's figure
/// once NVML can give one.
fn estimate(dev: &DeviceCx) -> u64 {
    let device = dev.ordinal;
    static SAID: AtomicBool = AtomicBool::new(false);
    let (bytes, from) = estimate_of(dev);
    if !SAID.swap(true, Ordering::Relaxed) {
        crate::sys::log::line(
            LogLevel::Info,
            format_args!(
                "NVML cannot measure this process's context on device {device}: charged {} \
                 ({from})",
                Bytes(bytes)
            ),
        );
    }
    bytes
}

/// A context's estimated cost, and where the figure comes from.
fn estimate_of(dev: &DeviceCx) -> (u64, &'static str) {
    match dev.config().context_memory {
        Some(bytes) => (bytes, "CUDABUDGET_CONTEXT_MEMORY"),
        None => match model_estimate(&device_name(dev.ordinal)) {
            Some(bytes) => (bytes, "measured for this model"),
            None => (DEFAULT_CONTEXT, "default; set CUDABUDGET_CONTEXT_MEMORY"),
        },
    }
}

/// What a context costs on CUDA ordinal `device` by its model: measured, else
/// [`DEFAULT_CONTEXT`].
fn model_figure(device: usize) -> u64 {
    model_estimate(&device_name(device)).unwrap_or(DEFAULT_CONTEXT)
}

/// A context's cost where no figure is measured for the model: above every figure
/// measured so far.
pub const DEFAULT_CONTEXT: u64 = 640 << 20;

/// A context's device memory by model, as nvidia-smi showed it for a process with one
/// context and lazy module loading (the default). H200, driver 580, CUDA 13:
/// 518 MiB (scripts/gpu/footprint_probe.sh); H100 80GB HBM3 (SXM), driver 580: 518 MiB
/// (NVML's figure, `startup_forks.py --probe ctypes` with `CUDABUDGET_LOG=debug`).
pub fn model_estimate(name: &str) -> Option<u64> {
    const MODELS: &[(&str, u64)] = &[("H200", 518 << 20), ("H100 80GB HBM3", 518 << 20)];
    MODELS
        .iter()
        .find(|(model, _)| name.contains(model))
        .map(|&(_, bytes)| bytes)
}

fn device_name(device: usize) -> String {
    let mut handle = 0;
    let mut name = [0 as std::ffi::c_char; 96];
    // SAFETY: valid out-pointers; the driver writes at most `name.len()` bytes, NUL
    // included.
    let ok = unsafe {
        crate::sys::driver::real::cuDeviceGet(&mut handle, device as i32).is_ok()
            && crate::sys::driver::real::cuDeviceGetName(
                name.as_mut_ptr(),
                name.len() as i32,
                handle,
            )
            .is_ok()
    };
    if !ok {
        return String::new();
    }
    name[name.len() - 1] = 0;
    // SAFETY: NUL-terminated (the last byte is forced to NUL).
    unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// A context on `device` is gone; when it was the last, so is all its memory, and the
/// books are cleared (memory from `cuMemCreate`, which outlives contexts, stays
/// charged), after `forget` (what else the device's contexts held: modules, limits).
/// Returns whether they were: the pools' and graphs' survivors are charged again by the
/// caller ([`crate::admit::flow::context_gone`]).
pub fn context_gone(device: usize, forget: impl FnOnce()) -> bool {
    let Some(count) = CONTEXTS.get(device) else {
        return false;
    };
    let left = count
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
            Some(c.saturating_sub(1))
        })
        .unwrap_or(0)
        .saturating_sub(1);
    if left != 0 {
        return false;
    }
    BEFORE[device].store(UNKNOWN, Ordering::Release);
    for from in [PENDING, ESTIMATED] {
        let _ = CHARGE[device].compare_exchange(from, SETTLED, Ordering::AcqRel, Ordering::Relaxed);
    }
    MARGIN[device].store(0, Ordering::Release);
    let Some(d) = runtime::ledger().device(device) else {
        return false;
    };
    // The purge is part of the clear (a free refused meanwhile puts nothing back).
    // Memory from cuMemCreate belongs to the process, not to a context: it outlives the
    // teardown and stays charged, by what the VMM books hold under their lock.
    let mut forget = Some(forget);
    let mut vmm = None;
    d.clear_after(&mut || {
        runtime::pointers().purge_device(device);
        runtime::arrays().purge_device(device);
        if let Some(forget) = forget.take() {
            forget();
        }
        vmm = Some(vmm::lock());
    });
    if let Some(vmm) = vmm {
        super::after::charge_after(d, 0, vmm.bytes_on(device));
    }
    true
}

/// Whether an admission on `device` has nothing to do first: the charge of its first
/// context settled ([`settle_before_admission`]) and no routine re-read due
/// ([`maybe_reconcile`]). Two loads, for the synchronous fast path, which leaves both to
/// the full one.
#[inline(always)]
pub fn admission_ready(device: usize) -> bool {
    is_settled(device)
        && ROUTINE_DUE
            .get(device)
            .is_some_and(|flag| !flag.load(Ordering::Relaxed))
}

/// Re-reads the footprint if the routine interval has passed.
#[inline]
pub fn maybe_reconcile(dev: &DeviceCx) {
    // One load of a flag the background thread raises once a second (`routine_tick`):
    // an admission reads no clock.
    let Some(flag) = ROUTINE_DUE.get(dev.ordinal) else {
        return;
    };
    if flag.load(Ordering::Relaxed) && !nvml::starting() && flag.swap(false, Ordering::AcqRel) {
        if let Some(last) = LAST_MS.get(dev.ordinal) {
            last.store(report::monotonic_ms(), Ordering::Relaxed);
        }
        if CHARGE[dev.ordinal].load(Ordering::Acquire) == ESTIMATED {
            // NVML's thread did not measure it (NVML was started by another path).
            settle(dev);
        } else {
            reconcile(dev);
        }
    }
}

/// Raised for every device once a second by [`routine_tick`]; lowered by the admission
/// that takes the routine re-read.
static ROUTINE_DUE: [AtomicBool; MAX_DEVICES] = [const { AtomicBool::new(false) }; MAX_DEVICES];

/// On the library's background thread, at every look at the books: once a routine
/// interval has passed, the next admission on each device re-reads the footprint. In a
/// process without that thread (it could not start) the footprint is re-read only before
/// a denial.
pub fn routine_tick() {
    static RAISED_MS: AtomicU64 = AtomicU64::new(0);
    let now = report::monotonic_ms().max(1);
    let raised = RAISED_MS.load(Ordering::Relaxed);
    if raised == 0 {
        // The first look: the routine interval starts now (the first context's charge
        // was just measured), as it did when each admission read the clock.
        RAISED_MS.store(now, Ordering::Relaxed);
    } else if now.saturating_sub(raised) >= ROUTINE_MS {
        RAISED_MS.store(now, Ordering::Relaxed);
        for flag in &ROUTINE_DUE {
            flag.store(true, Ordering::Release);
        }
    }
}

/// Re-reads the footprint before a denial (still at a bounded rate).
pub fn reconcile_now(dev: &DeviceCx) {
    if !nvml::starting() && due(dev.ordinal, URGENT_MS) {
        reconcile(dev);
    }
}

fn due(device: usize, interval: u64) -> bool {
    let Some(last) = LAST_MS.get(device) else {
        return false;
    };
    let now = report::monotonic_ms();
    let seen = last.load(Ordering::Relaxed);
    now.saturating_sub(seen) >= interval
        && last
            .compare_exchange(seen, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
}

#[cold]
fn reconcile(dev: &DeviceCx) {
    let d = dev.ledger;
    let Some(process) = nvml::process_used(dev.ordinal) else {
        return;
    };
    let tracked = d.used().saturating_sub(d.overhead());
    super::after::overhead_after(d, process.saturating_sub(tracked));
}

/// After `fork()`: the child has no context of its own, and no lock of the parent's.
///
/// # Safety
/// Only from an at-fork child handler.
pub unsafe fn after_fork() {
    // SAFETY: the caller's guarantee.
    unsafe {
        CONTEXT_BOOKS.reset_in_child(ContextBooks {
            primary: [false; MAX_DEVICES],
            created: Vec::new(),
        });
        BEFORE_PIDS.reset_in_child(Vec::new());
    };
    for device in 0..MAX_DEVICES {
        forget_contexts(device);
    }
}

fn forget_contexts(device: usize) {
    if let (Some(count), Some(last)) = (CONTEXTS.get(device), LAST_MS.get(device)) {
        count.store(0, Ordering::Release);
        last.store(0, Ordering::Release);
        CREATING[device].store(0, Ordering::Release);
        BEFORE[device].store(UNKNOWN, Ordering::Release);
        CHARGE[device].store(SETTLED, Ordering::Release);
        MARGIN[device].store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model nobody measured is charged the README's 640 MiB, above every model's
    /// measured figure, so that an unmeasured context is never under-charged by the
    /// default; a measured model gets its own figure.
    #[test]
    fn an_unmeasured_model_is_charged_640_mib_above_every_measured_one() {
        assert_eq!(DEFAULT_CONTEXT, 640 * 1024 * 1024);
        assert_eq!(model_estimate("NVIDIA H200"), Some(518 * 1024 * 1024));
        assert!(model_estimate("NVIDIA H200").unwrap() < DEFAULT_CONTEXT);
        assert_eq!(
            model_estimate("NVIDIA H100 80GB HBM3"),
            Some(518 * 1024 * 1024)
        );
        assert_eq!(model_estimate("NVIDIA H100 PCIe"), None, "not measured");
        assert_eq!(model_estimate("Tesla T4"), None);
    }

    /// The synchronous fast path admits only when nothing is due first: a context's
    /// charge pending or being measured, or the routine re-read, sends it to the full
    /// path. (Device 60: no other test touches it.)
    #[test]
    fn an_admission_is_ready_only_with_the_charge_settled_and_no_reread_due() {
        const D: usize = 60;
        // (A unit-test process runs no background thread to raise the re-read.)
        assert!(admission_ready(D));
        for state in [PENDING, CHARGING, ESTIMATED] {
            CHARGE[D].store(state, Ordering::Release);
            assert!(!admission_ready(D), "charge {state}");
        }
        CHARGE[D].store(SETTLED, Ordering::Release);
        ROUTINE_DUE[D].store(true, Ordering::Release);
        assert!(!admission_ready(D), "a re-read due");
        ROUTINE_DUE[D].store(false, Ordering::Release);
        assert!(admission_ready(D));
        assert!(!admission_ready(MAX_DEVICES), "no such device");
    }
}
