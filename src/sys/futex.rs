//! Futexes on words that other processes may share (a job's ledger): never the
//! private flag, so a wake in one process reaches a sleeper in another.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `word` still holds `seen`, at most `timeout` (or until a wake, or a
/// signal). Returns at once if the word already changed.
pub fn wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a shared futex wait on a live 4-byte aligned word, with a valid timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every sleeper on `word`.
pub fn wake_all(word: &AtomicU32) {
    // SAFETY: a shared futex wake on a live 4-byte aligned word.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}
