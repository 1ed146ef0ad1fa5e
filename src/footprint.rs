//! The real footprint: what `nvidia-smi` shows for the process, not only what the hooks
//! saw. The context is charged when it is created; after that, NVML's per-process figure
//! is compared with what the ledger tracks, at a bounded rate (never per call), and the
//! difference — modules, the context, anything allocated by paths we do not hook — is
//! charged as the device's overhead.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::config::LogLevel;
use crate::ledger::{DeviceLedger, MAX_DEVICES};
use crate::report::{self, Bytes};
use crate::{nvml, runtime, vmm};

/// Routine re-reads: at most once a second per device.
const ROUTINE_MS: u64 = 1000;
/// Re-reads before a denial: at most ten a second per device.
const URGENT_MS: u64 = 100;

static LAST_MS: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
static CONTEXTS: [AtomicU32; MAX_DEVICES] = [const { AtomicU32::new(0) }; MAX_DEVICES];

/// Device-wide use before a context is created, to measure what the creation took when
/// NVML does not list this process. Only asked for the device's first context.
pub fn before_context(device: usize) -> Option<u64> {
    let first = CONTEXTS.get(device)?.load(Ordering::Acquire) == 0;
    if first && runtime::budgeted(device).is_some() {
        // NVML started initialising at cuInit; in a PID namespace this reading is the
        // only way to measure the context, so it is worth a bounded wait.
        nvml::wait_prewarm(std::time::Duration::from_secs(2));
        nvml::device_used(device)
    } else {
        None
    }
}

/// A context was created on `device`: charge it.
pub fn context_created(device: usize, before: Option<u64>) {
    let Some(count) = CONTEXTS.get(device) else {
        return;
    };
    let first = count.fetch_add(1, Ordering::AcqRel) == 0;
    let Some(d) = runtime::budgeted(device) else {
        return;
    };
    if !first {
        return;
    }
    // NVML started initialising at cuInit, in parallel with the context's creation:
    // it is almost always ready by now. The wait is bounded.
    nvml::wait_prewarm(std::time::Duration::from_secs(2));
    let tracked = d.used() - d.overhead().min(d.used());
    let charge = match nvml::process_used(device) {
        Some(process) => process.saturating_sub(tracked),
        None => match (before, nvml::device_used(device)) {
            (Some(before), Some(after)) => after.saturating_sub(before),
            _ => 0,
        },
    };
    d.set_overhead(charge.max(d.overhead()));
    if let Some(last) = LAST_MS.get(device) {
        last.store(report::monotonic_ms(), Ordering::Relaxed);
    }
    report::line(
        LogLevel::Debug,
        format_args!("device {device}: context charged {}", Bytes(charge)),
    );
}

/// A context on `device` is gone; when it was the last, so is all its memory.
pub fn context_gone(device: usize) {
    let Some(count) = CONTEXTS.get(device) else {
        return;
    };
    let left = count
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
            Some(c.saturating_sub(1))
        })
        .unwrap_or(0)
        .saturating_sub(1);
    if left != 0 {
        return;
    }
    if let Some(d) = runtime::ledger().device(device) {
        runtime::ledger().pointers.purge_device(device);
        vmm::lock().purge_device(device);
        d.clear();
    }
}

/// Re-reads the footprint if the routine interval has passed.
#[inline]
pub fn maybe_reconcile(device: usize, d: &DeviceLedger) {
    if !nvml::starting() && due(device, ROUTINE_MS) {
        reconcile(device, d);
    }
}

/// Re-reads the footprint before a denial (still at a bounded rate).
pub fn reconcile_now(device: usize, d: &DeviceLedger) {
    if !nvml::starting() && due(device, URGENT_MS) {
        reconcile(device, d);
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
fn reconcile(device: usize, d: &DeviceLedger) {
    let Some(process) = nvml::process_used(device) else {
        return;
    };
    let tracked = d.used().saturating_sub(d.overhead());
    d.set_overhead(process.saturating_sub(tracked));
}

/// After `fork()`: the child has no context of its own.
pub fn forget_contexts(device: usize) {
    if let (Some(count), Some(last)) = (CONTEXTS.get(device), LAST_MS.get(device)) {
        count.store(0, Ordering::Release);
        last.store(0, Ordering::Release);
    }
}
