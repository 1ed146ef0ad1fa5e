//! Futexes on words that other processes may share (a job's ledger, a records
//! directory's doorbell): never the private flag, so a wake in one process reaches a
//! sleeper in another.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `word` still holds `seen`, at most `timeout` (or until a wake, or a
/// signal). Returns at once if the word already changed.
pub fn wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    // SAFETY: a live, 4-byte aligned word of ours.
    let _ = unsafe { wait_at(word.as_ptr(), seen, timeout) };
}

/// Wakes every sleeper on `word`.
pub fn wake_all(word: &AtomicU32) {
    // SAFETY: a live, 4-byte aligned word of ours.
    unsafe { wake_all_at(word.as_ptr()) };
}

/// [`wait`] on an address the program never reads itself (a mapped page that may lie
/// past the end of its file: the kernel then answers `EFAULT`). The error is the call's.
///
/// # Safety
/// `addr` is 4-byte aligned and inside a mapping this process holds for the call.
pub unsafe fn wait_at(addr: *const u32, seen: u32, timeout: Duration) -> std::io::Result<()> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a shared futex wait on an address the caller vouches for, with a valid
    // timeout; the kernel only reads the word.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            addr,
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// [`wake_all`] on an address the program never reads itself.
///
/// # Safety
/// As for [`wait_at`].
pub unsafe fn wake_all_at(addr: *const u32) {
    // SAFETY: a shared futex wake on an address the caller vouches for; the kernel only
    // resolves it.
    unsafe {
        libc::syscall(libc::SYS_futex, addr, libc::FUTEX_WAKE, i32::MAX);
    }
}
