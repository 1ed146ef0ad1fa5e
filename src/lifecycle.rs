//! The library's life in a process: its initialisation (entered lazily by the first hook
//! that needs the mode, never by a constructor or by `dlsym`), what a child of `fork()`
//! starts with, and what runs at exit. The one module that calls into the others to set
//! them up or reset them; they never call back up into it, except `runtime::mode` for
//! the first decision.

use std::cell::Cell;

use crate::config::{Config, ConfigError, LogLevel};
use crate::runtime::{self, Mode};
use crate::{driver, report};

thread_local! {
    /// Set while this thread initialises, so a hook it re-enters does not wait on itself.
    static INITIALISING: Cell<bool> = const { Cell::new(false) };
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
            Err(Some(error)) => report::config_error(&error),
            Err(None) => report::line(
                LogLevel::Error,
                format_args!(
                    "internal error while reading the configuration; CUDA is disabled for this process"
                ),
            ),
            Ok(Mode::NoDriver) => report::line(
                LogLevel::Error,
                format_args!("cannot open libcuda.so.1 from the library; CUDA calls will fail"),
            ),
            Ok(Mode::Budgeted) => {
                report::install_exit_summary();
                install_fork_handler();
                crate::tell::publish::start();
            }
            Ok(_) => {}
        }
    }
    runtime::mode()
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
    report::set_level(config.log);
    let unbudgeted = config.is_unbudgeted();
    runtime::set_config(config);
    if unbudgeted {
        // The driver's table fills on first use (driver::real): a process with no
        // budget opens nothing it did not open itself.
        return Ok(Mode::Passthrough);
    }
    if !driver::load() {
        return Ok(Mode::NoDriver);
    }
    let joining = std::time::Instant::now();
    if let Some(config) = runtime::config()
        && let Some(ledger) = job_ledger(config)
    {
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
                    report::line(
                        LogLevel::Warn,
                        format_args!(
                            "{}; {what}'s ledger is {} instead",
                            in_the_way.join("; "),
                            job.path()
                        ),
                    );
                }
                report::line(
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
                if say() {
                    report::line(
                        LogLevel::Warn,
                        format_args!(
                            "{}; {what} has no place for its ledger, so this process runs \
                             under its own budget alone",
                            in_the_way.join("; ")
                        ),
                    );
                }
            }
            Joined::Refused { path, why } => {
                if say() {
                    report::line(
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

/// A child of `fork()` cannot use its parent's CUDA context: it starts with an empty
/// ledger of its own. Before the fork, the parent waits (boundedly) for the library's
/// own calls to leave NVML and the loader ([`crate::nvml::before_fork`]).
fn install_fork_handler() {
    extern "C" fn child() {
        // Stores only: no lock is taken and nothing waits, whatever the parent's other
        // threads were doing (they did not come along).
        // SAFETY: an at-fork child handler, the one place these may run.
        unsafe {
            runtime::reset_in_child();
            crate::vmm::reset_in_child();
            crate::graphs::reset_in_child();
            crate::enforce::reset_in_child();
            crate::footprint::after_fork();
            crate::loads::after_fork();
            crate::books::job::after_fork();
            crate::wait::after_fork();
        }
        crate::nvml::after_fork();
        crate::capture::after_fork();
        crate::gate::after_fork();
        crate::pools::after_fork();
        crate::enforce::after_fork();
    }
    extern "C" fn prepare() {
        // In the parent: a bounded wait, without a lock, for the library's own calls to
        // leave NVML and the loader, so that the child gets both whole.
        crate::nvml::before_fork();
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
