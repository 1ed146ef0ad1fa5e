//! The library's life in a process: its initialisation (entered lazily by the first hook
//! that needs the mode, never by a constructor or by `dlsym`), what a child of `fork()`
//! starts with, and what runs at exit; the entry every hook makes ([`enter`]), the end of
//! a device's last context, and the background thread. The one module that calls into
//! the others to set them up or reset them; they never call back up into it.

use std::cell::Cell;

use crate::books::ledger::{Budget, Denial, DeviceLedger};
use crate::config::{Config, ConfigError, LogLevel};
use crate::runtime::{self, Cx, Mode};
use crate::sys::driver;
use crate::sys::driver::CuResult;
use crate::tell::report;

thread_local! {
    /// Set while this thread initialises, so a hook it re-enters does not wait on itself.
    static INITIALISING: Cell<bool> = const { Cell::new(false) };
}

/// What a hook may do, decided once at its entry.
pub enum Entered {
    /// Call the driver and nothing else (no budget, or our own initialisation).
    Pass,
    /// Return this code without calling the driver (a malformed configuration, or no
    /// driver of our own).
    Refuse(CuResult),
    /// Budgets are enforced: the context the decisions below take.
    Budgeted(Cx),
}

/// The one entry of a hook: the mode (deciding it on first use), as what the hook does.
/// Once decided, it costs one load.
#[inline(always)]
pub fn enter() -> Entered {
    if runtime::is_budgeted() {
        return Entered::Budgeted(Cx::budgeted());
    }
    enter_otherwise()
}

/// [`enter`] outside a budgeted process, or before the mode is decided: out of the
/// hooks' way.
#[cold]
#[inline(never)]
fn enter_otherwise() -> Entered {
    match mode() {
        Mode::Budgeted => Entered::Budgeted(Cx::budgeted()),
        Mode::Passthrough => Entered::Pass,
        Mode::Refused => Entered::Refuse(CuResult::NOT_PERMITTED),
        Mode::NoDriver => Entered::Refuse(CuResult::SHARED_OBJECT_INIT_FAILED),
    }
}

/// The entry of a hook that only keeps books of what the driver did (a release, a map,
/// a trim): outside a budgeted process it calls the driver, whatever the reason.
#[inline(always)]
pub fn enter_books() -> Option<Cx> {
    if runtime::is_budgeted() {
        return Some(Cx::budgeted());
    }
    match enter_otherwise() {
        Entered::Budgeted(cx) => Some(cx),
        Entered::Pass | Entered::Refuse(_) => None,
    }
}

/// The mode, deciding it on first use.
#[inline(always)]
pub fn mode() -> Mode {
    match runtime::known_mode() {
        Some(mode) => mode,
        None => init(),
    }
}

/// Works out the mode. No thread ever waits for another here (a waiter could hold the
/// loader lock that the initialising thread's `dlopen` needs): each thread that arrives
/// before the answer is published computes it itself, and the first answer stands.
#[cold]
pub fn init() -> Mode {
    if INITIALISING.with(Cell::get) {
        // Re-entered from our own initialisation: let the driver answer.
        return Mode::Passthrough;
    }
    let decided = decide_once(decide);
    let mode = match &decided {
        Ok(mode) => *mode,
        Err(_) => Mode::Refused,
    };
    if runtime::settle_mode(mode) {
        // Only the thread whose answer stands tells the user, once.
        match decided {
            Err(Some(error)) => crate::sys::log::config_error(&error),
            Err(None) => crate::sys::log::line(
                LogLevel::Error,
                format_args!(
                    "internal error while reading the configuration; CUDA is disabled for this process"
                ),
            ),
            Ok(Mode::NoDriver) => crate::sys::log::line(
                LogLevel::Error,
                format_args!("cannot open libcuda.so.1 from the library; CUDA calls will fail"),
            ),
            Ok(Mode::Budgeted) => {
                // Settled as budgeted by this thread: the configuration is set.
                let config = Cx::budgeted().config();
                crate::tell::events::remember_program_name();
                report::unknown_variables(config);
                report::install_exit_summary();
                install_fork_handler();
                start_background(config);
            }
            Ok(_) => {}
        }
    }
    runtime::known_mode().unwrap_or(mode)
}

/// Runs `decide` with the thread marked as initialising, and unmarks it whatever
/// happens. A panic inside is `Err(None)`: the process is refused, never left
/// unbudgeted (a thread still marked would answer `Passthrough` for good).
fn decide_once(
    decide: impl FnOnce() -> Result<Mode, ConfigError> + std::panic::UnwindSafe,
) -> Result<Mode, Option<ConfigError>> {
    INITIALISING.with(|c| c.set(true));
    let decided = std::panic::catch_unwind(decide);
    INITIALISING.with(|c| c.set(false));
    match decided {
        Ok(decided) => decided.map_err(Some),
        Err(_) => Err(None),
    }
}

fn decide() -> Result<Mode, ConfigError> {
    let config = Config::from_env()?;
    crate::sys::log::set_level(config.log);
    let config = runtime::set_config(config);
    if config.is_unbudgeted() {
        // The driver's table fills on first use (driver::real): a process with no
        // budget opens nothing it did not open itself.
        return Ok(Mode::Passthrough);
    }
    if !driver::load() {
        return Ok(Mode::NoDriver);
    }
    let joining = std::time::Instant::now();
    if let Some(ledger) = job_ledger(config) {
        use crate::books::job::{self, Joined};
        let what = match ledger {
            job::Ledger::Named(name) => format!("job {name}"),
            job::Ledger::Hami(cache) => format!("the job of HAMi's shared cache {cache}"),
        };
        // Threads that arrive together may each decide: one line between them.
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let say = || !SAID.swap(true, std::sync::atomic::Ordering::Relaxed);
        match job::join(ledger, &config.job_dirs) {
            Joined::Job { job, in_the_way } => {
                if !in_the_way.is_empty() && say() {
                    crate::sys::log::line(
                        LogLevel::Warn,
                        format_args!(
                            "{}; {what}'s ledger is {} instead",
                            in_the_way.join("; "),
                            job.path()
                        ),
                    );
                }
                crate::sys::log::line(
                    LogLevel::Debug,
                    format_args!(
                        "joined job ledger {} in {:.1} µs",
                        job.path(),
                        joining.elapsed().as_secs_f64() * 1e6
                    ),
                );
                extern "C" fn leave_job() {
                    if let Some(job) = crate::books::job::joined() {
                        job.leave();
                    }
                }
                // SAFETY: registers a plain extern "C" function.
                unsafe { libc::atexit(leave_job) };
            }
            Joined::Alone { in_the_way } => {
                // Alone, each member would have the job's whole budget: never.
                if say() {
                    crate::sys::log::line(
                        LogLevel::Error,
                        format_args!(
                            "{}; {what} has no place for its ledger; CUDA is disabled for \
                             this process (a job's budget is never replaced by a \
                             per-process one; set CUDABUDGET_JOB_DIR to a directory only \
                             you or root can write)",
                            in_the_way.join("; ")
                        ),
                    );
                }
                return Ok(Mode::Refused);
            }
            Joined::Refused { path, why } => {
                if say() {
                    crate::sys::log::line(
                        LogLevel::Error,
                        format_args!(
                            "job ledger {path}: {why}; CUDA is disabled for this process (a \
                         job's budget is never replaced by a per-process one; remove the \
                         file once the job's processes have ended)"
                        ),
                    );
                }
                return Ok(Mode::Refused);
            }
        }
    }
    Ok(Mode::Budgeted)
}

/// The job ledger, when the budget is a job's: `CUDABUDGET_SCOPE=job:<name>`, or HAMi's
/// shared cache file when HAMi's variables set the budget.
fn job_ledger(config: &Config) -> Option<crate::books::job::Ledger<'_>> {
    use crate::books::job::Ledger;
    match &config.scope {
        crate::config::Scope::Job(name) => Some(Ledger::Named(name)),
        crate::config::Scope::Process => config.hami_shared_cache.as_deref().map(Ledger::Hami),
    }
}

/// Starts the library's background thread, once: it prepares the gate's barrier
/// ([`crate::admit::gate::prepare`]) and then publishes this process's figures
/// ([`crate::tell::publish::run`]). Called at the end of a successful initialisation;
/// costs the caller one thread creation and nothing after.
fn start_background(config: &'static Config) {
    static STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if STARTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("cudabudget-pub".into())
        .stack_size(256 << 10)
        .spawn(|| {
            // Off the program's threads: in a process that already has threads, the
            // registration waits for an RCU grace period (milliseconds).
            crate::admit::gate::prepare();
            crate::tell::publish::run(config, follow_budgets);
        });
    if let Err(error) = spawned {
        crate::sys::log::line(
            LogLevel::Info,
            format_args!(
                "cannot start the thread that publishes this process's figures ({error}); `cudabudget status` will not show it"
            ),
        );
    }
}

/// Follows budget changes made while the process runs (`cudabudget limit`), on the
/// background thread when the doorbell rings and every [`crate::tell::publish::INTERVAL`]
/// ([`crate::tell::publish::run`]): a request beside the
/// process's record changes its own budgets; a job's budget is its ledger's, which every
/// admission reads as it is then, and the device's figures (the views, the record)
/// follow it here. True when a budget changed.
fn follow_budgets() -> bool {
    crate::admit::footprint::routine_tick();
    let mut changed = false;
    match crate::tell::publish::new_limit_request() {
        Some(Ok(request)) => changed |= apply_limit_request(&request),
        Some(Err(why)) => crate::sys::log::line(
            LogLevel::Warn,
            format_args!("a budget-change request for this process was ignored: {why}"),
        ),
        None => {}
    }
    if let Some(job) = crate::books::job::joined() {
        static SEEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let generation = job.budget_generation();
        if SEEN.swap(generation, std::sync::atomic::Ordering::Relaxed) != generation {
            for (ordinal, d) in crate::runtime::ledger().devices() {
                let (Some((_, index)), Budget::Bytes(previous)) = (d.job(), d.budget()) else {
                    continue;
                };
                if let Some(now) = job.budget(index).filter(|&now| now != previous) {
                    changed = true;
                    budget_changed(ordinal, d, previous, now, job.budget_changed_by());
                }
            }
        }
    }
    changed
}

/// Applies a change of this process's own budget.
fn apply_limit_request(request: &cudabudget_spec::control::LimitRequest) -> bool {
    let mut changed = false;
    for (ordinal, d) in crate::runtime::ledger().devices() {
        if request
            .device
            .is_some_and(|device| device as usize != ordinal)
        {
            continue;
        }
        let Budget::Bytes(previous) = d.budget() else {
            continue;
        };
        if d.job().is_some() {
            crate::sys::log::line(
                LogLevel::Warn,
                format_args!(
                    "a budget-change request for device {ordinal} was ignored: its budget is \
                     the job's (cudabudget limit --job)"
                ),
            );
            continue;
        }
        if request.bytes != previous {
            changed = true;
            budget_changed(
                ordinal,
                d,
                previous,
                request.bytes,
                (request.by_uid, request.by_pid),
            );
        }
    }
    changed
}

/// Sets device `ordinal`'s budget to `now`, wakes the waiters when it grew, and tells.
fn budget_changed(ordinal: usize, d: &DeviceLedger, previous: u64, now: u64, by: (u32, u32)) {
    d.set_budget(Budget::Bytes(now));
    if now > previous {
        crate::sys::wait::freed();
    }
    let used = d.budget_used();
    // On the background thread of a budgeted process: the configuration is set.
    crate::tell::events::budget_changed(
        Cx::budgeted().config(),
        ordinal,
        previous,
        &Denial {
            requested: 0,
            used,
            budget: now,
        },
        by,
    );
    crate::sys::log::line(
        LogLevel::Info,
        format_args!(
            "device {ordinal}'s budget changed from {} to {} by uid {} (pid {}); {} in use",
            crate::tell::report::Bytes(previous),
            crate::tell::report::Bytes(now),
            by.0,
            by.1,
            crate::tell::report::Bytes(used)
        ),
    );
}

/// The device's context `device` is gone (a destroy, a primary context's release or
/// reset): when it was the last, its books are cleared, its modules and limits
/// forgotten, and what survives it charged again ([`crate::admit::flow::context_gone`]).
pub fn context_gone(device: usize) {
    crate::admit::flow::context_gone(device, || crate::admit::loads::context_gone(device));
}

/// A child of `fork()` cannot use its parent's CUDA context: it starts with an empty
/// ledger of its own. Before the fork, the parent waits (boundedly) for the library's
/// own calls to leave NVML, libzstd and the loader ([`crate::sys::foreign::before_fork`]).
fn install_fork_handler() {
    extern "C" fn child() {
        // Stores only: no lock is taken and nothing waits, whatever the parent's other
        // threads were doing (they did not come along).
        // SAFETY: an at-fork child handler, the one place these may run.
        unsafe {
            runtime::reset_in_child();
            crate::books::vmm::reset_in_child();
            crate::admit::graphs::reset_in_child();
            crate::admit::reset_in_child();
            crate::admit::footprint::after_fork();
            crate::admit::loads::after_fork();
            crate::books::job::after_fork();
            crate::sys::wait::after_fork();
        }
        crate::sys::nvml::after_fork(crate::sys::foreign::after_fork());
        crate::admit::capture::after_fork();
        crate::admit::gate::after_fork();
        crate::admit::pools::after_fork();
        crate::admit::credit::after_fork();
    }
    extern "C" fn prepare() {
        // In the parent: a bounded wait, without a lock, for the library's own calls to
        // leave NVML, libzstd and the loader, so that the child gets them whole.
        crate::sys::foreign::before_fork();
    }
    // SAFETY: registers plain extern "C" functions: the child's only stores to memory,
    // the parent's reads an atomic and sleeps (boundedly).
    unsafe {
        libc::pthread_atfork(Some(prepare), None, Some(child));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_while_deciding_refuses_and_leaves_the_thread_able_to_decide_again() {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let decided = decide_once(|| panic!("injected"));
        std::panic::set_hook(previous);
        assert!(matches!(decided, Err(None)));
        assert!(
            !INITIALISING.with(Cell::get),
            "the thread is not left initialising"
        );
        assert_eq!(
            decide_once(|| Ok(Mode::Budgeted)).ok(),
            Some(Mode::Budgeted)
        );
    }
}
