//! The library's own calls into foreign libraries (NVML, the system's Zstandard decoder)
//! and into the loader for them (`dlopen`), counted so that a `fork()` does not copy one
//! half done: the parent waits for none to be under way ([`before_fork`], bounded), and a
//! child copied while one was under way anyway loads nothing and calls none of them
//! ([`loading`] answers `None` there), since it inherits the loader's and those
//! libraries' state half-changed and their locks held for good (`dlopen` there can fail
//! the loader's own assertions and end the process with 127).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// How many of the library's own calls are inside a foreign library or loading one, on
/// any thread, right now.
static INSIDE: AtomicUsize = AtomicUsize::new(0);

/// Set in a child forked while one of those calls was under way.
static OFF_IN_CHILD: AtomicBool = AtomicBool::new(false);

/// Counts the calling thread in [`INSIDE`] while it lives.
pub struct Inside;

impl Inside {
    /// Counts a call into a library already loaded.
    pub fn enter() -> Inside {
        INSIDE.fetch_add(1, Ordering::SeqCst);
        Inside
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Counts a `dlopen` of a foreign library (and the look-ups after it): `None` in a child
/// forked while such a call was under way, which loads nothing.
pub fn loading() -> Option<Inside> {
    (!OFF_IN_CHILD.load(Ordering::Acquire)).then(Inside::enter)
}

/// The longest a `fork()` waits for the library's calls to leave the foreign libraries
/// and the loader (NVML's initialisation took 30 ms on an H200; finding a device about
/// 6 ms).
const FORK_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Set once a fork's wait ran out: a foreign library is stuck inside a call, and later
/// forks do not wait for it again (their children do without those libraries).
static FORK_WAIT_SPENT: AtomicBool = AtomicBool::new(false);

/// In the parent, just before `fork()`: waits (at most [`FORK_WAIT`], sleeping, without a
/// lock) until none of the library's calls is inside a foreign library or loading one, so
/// that the child gets the loader and those libraries whole. Most forks find none and do
/// not wait.
pub fn before_fork() {
    if INSIDE.load(Ordering::SeqCst) == 0 || FORK_WAIT_SPENT.load(Ordering::Relaxed) {
        return;
    }
    let start = std::time::Instant::now();
    while INSIDE.load(Ordering::SeqCst) != 0 {
        if start.elapsed() >= FORK_WAIT {
            FORK_WAIT_SPENT.store(true, Ordering::Relaxed);
            return;
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// In the child of `fork()`: whether it was forked while one of those calls was under
/// way (the wait in [`before_fork`] ran out, or a call began after it). Their threads
/// did not come along, so their count is the child's no more; such a child loads and
/// calls nothing foreign from then on.
pub fn after_fork() -> bool {
    if INSIDE.swap(0, Ordering::SeqCst) != 0 {
        OFF_IN_CHILD.store(true, Ordering::Release);
        return true;
    }
    false
}
