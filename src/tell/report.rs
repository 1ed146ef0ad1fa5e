//! What the library tells the user: denials and overruns (rate-limited) and the summary
//! at exit; and, when `CUDABUDGET_EVENTS` names a file, one JSON line per denial or
//! overrun appended to it
//! ([`crate::tell::events`]). The lines themselves are [`crate::sys::log`]'s.
//!
//! Denial lines and the exit summary name the process (`pid 1234 (python3, job train)`)
//! so the lines of several processes sharing a terminal or a log can be told apart.

use std::fmt;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use crate::books::ledger::Denial;
use crate::config::{Config, LogLevel};
use crate::sys::log::{emit, enabled, line};

pub use crate::sys::clock::monotonic_ms;

/// At most one line a second of a kind, the others counted.
struct Throttle {
    last_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl Throttle {
    const fn new() -> Throttle {
        Throttle {
            last_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(lines left out since the last one)` when a line may be written now.
    fn pass(&self) -> Option<u64> {
        let now = monotonic_ms().max(1);
        let last = self.last_ms.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < 1000
            || self
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

static DENIALS: Throttle = Throttle::new();
static OVERRUNS: Throttle = Throttle::new();

/// A refused allocation: one event (when `CUDABUDGET_EVENTS` is set), and at most one
/// line a second, with a count of those left out.
pub fn denial(config: &'static Config, call: &str, device: usize, denial: &Denial) {
    damage_news();
    crate::tell::events::denial(config, call, device, denial);
    if !enabled(LogLevel::Warn) {
        return;
    }
    let Some(suppressed) = DENIALS.pass() else {
        return;
    };
    emit(format_args!(
        "{}: denied {call} of {} on device {device}: {} in use, budget {}{}",
        Process,
        Bytes(denial.requested),
        Bytes(denial.used),
        Bytes(denial.budget),
        Suppressed(suppressed, "denials"),
    ));
}

/// An allocation admitted past the budget (`CUDABUDGET_ON_EXCEED=warn`; `request` is
/// what it asked for, and what the device held and allowed before it): as a denial, one
/// event, and at most one line a second (its own second: overruns never hide denials),
/// with a count of those left out.
pub fn overrun(config: &'static Config, call: &str, device: usize, request: &Denial) {
    damage_news();
    crate::tell::events::overrun(config, call, device, request);
    if !enabled(LogLevel::Warn) {
        return;
    }
    let Some(suppressed) = OVERRUNS.pass() else {
        return;
    };
    emit(format_args!(
        "{}: {call} of {} on device {device} admitted past the budget \
         (CUDABUDGET_ON_EXCEED=warn): {} in use, budget {}{}",
        Process,
        Bytes(request.requested),
        Bytes(request.used),
        Bytes(request.budget),
        Suppressed(suppressed, "overruns"),
    ));
}

/// A job whose ledger was found damaged says so once, naming the file.
fn damage_news() {
    if let Some(news) = crate::books::job::joined().and_then(|job| job.damage_news()) {
        line(LogLevel::Error, format_args!("{news}"));
    }
}

/// This process as the lines name it: `pid 1234 (python3)`, or `pid 1234 (python3, job
/// train)` in a job. Costs a `getpid` (the pid changes across `fork`), so it is only for
/// lines that are rare by nature.
struct Process;
impl fmt::Display for Process {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SAFETY: getpid touches no memory.
        let pid = unsafe { libc::getpid() };
        write!(f, "pid {pid} ({}", crate::tell::events::program_name())?;
        if let Some(job) = crate::tell::events::job() {
            write!(f, ", job {job}")?;
        }
        write!(f, ")")
    }
}

/// ` (N more <what> not shown)`, or nothing when none was left out.
struct Suppressed(u64, &'static str);
impl fmt::Display for Suppressed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => Ok(()),
            n => write!(f, " ({n} more {} not shown)", self.1),
        }
    }
}

/// `, N admitted past the budget` in observe mode, or nothing when none was.
struct Overruns(u64);
impl fmt::Display for Overruns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => Ok(()),
            n => write!(f, ", {n} admitted past the budget"),
        }
    }
}

/// Bytes in the human form, formatted without allocating a String on the hot path.
pub struct Bytes(pub u64);
impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
        if self.0 < 1024 {
            return write!(f, "{} B", self.0);
        }
        let mut unit = 0;
        let mut scale = 1024u64;
        while unit + 1 < UNITS.len() && self.0 / scale >= 1024 {
            scale *= 1024;
            unit += 1;
        }
        let whole = self.0 / scale;
        let hundredths = (self.0 % scale) as u128 * 100 / scale as u128;
        write!(f, "{whole}.{hundredths:02} {}", UNITS[unit])
    }
}

/// Once, when the process is budgeted: the `CUDABUDGET_*` variables this release does
/// not know, which it ignores (beside a budget; alone they refuse CUDA instead).
pub fn unknown_variables(config: &Config) {
    if let Some(warning) = config.unknown_warning() {
        line(LogLevel::Warn, format_args!("{}: {warning}", Process));
    }
}

/// A panic caught at the FFI boundary.
#[cold]
#[inline(never)]
pub fn caught_panic(call: &str) {
    emit(format_args!(
        "internal error in {call}; the call failed with CUDA_ERROR_UNKNOWN"
    ));
}

static SUMMARY_INSTALLED: AtomicU8 = AtomicU8::new(0);

/// At `info`, registers the exit summary (peak and denials per budgeted device).
pub fn install_exit_summary() {
    if enabled(LogLevel::Info) && SUMMARY_INSTALLED.swap(1, Ordering::Relaxed) == 0 {
        // SAFETY: registers a plain extern "C" function.
        unsafe {
            libc::atexit(exit_summary);
        }
    }
}

extern "C" fn exit_summary() {
    let ledger = crate::runtime::ledger();
    for (device, d) in ledger.devices() {
        let crate::books::ledger::Budget::Bytes(budget) = d.budget() else {
            continue;
        };
        emit(format_args!(
            "{}: device {device}: peak {} of budget {}, {} in use at exit, {} denied{}",
            Process,
            Bytes(d.peak()),
            Bytes(budget),
            Bytes(d.used()),
            d.denials(),
            Overruns(d.overruns()),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_read_like_the_budget_variables() {
        assert_eq!(Bytes(0).to_string(), "0 B");
        assert_eq!(Bytes(1023).to_string(), "1023 B");
        assert_eq!(Bytes(8 << 30).to_string(), "8.00 GiB");
        assert_eq!(Bytes((5 << 30) + (1 << 29)).to_string(), "5.50 GiB");
        assert_eq!(Bytes(520 << 20).to_string(), "520.00 MiB");
    }
}
