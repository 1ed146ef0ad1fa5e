//! A member's life, proven by the kernel in any PID namespace.
//!
//! Pods of one job run in PID namespaces of their own: a pid read from the ledger names
//! another process (or none) in the reader's namespace, so pid and start time cannot
//! tell a live member of another pod from a dead one. Each member therefore holds an
//! open-file-description lock (`F_OFD_SETLK`) on one byte that stands for its slot, on
//! an open of the ledger of its own (close-on-exec, closed in a child of `fork()`). The
//! kernel drops the lock when the process exits, is killed or execs, whatever namespace
//! it runs in; any member can ask whether the byte is locked (`F_OFD_GETLK`).
//!
//! The bytes lie far past the end of the file ([`LOCKS_AT`]): nothing reads or writes
//! them, and a lock there does not change the file. A file system without such locks
//! answers `None` ("cannot tell"), and the members fall back to pid and start time.

use std::os::fd::{AsRawFd, BorrowedFd};

/// Where slot `i`'s byte lies: `LOCKS_AT + i`.
pub const LOCKS_AT: i64 = 1 << 40;

fn request(kind: libc::c_short, slot: usize) -> libc::flock {
    // SAFETY: flock is plain data; all-zero is a valid value (l_pid must be 0 for OFD
    // locks), the fields that matter are set below.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = LOCKS_AT + slot as i64;
    lock.l_len = 1;
    lock
}

/// What taking a slot's byte gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Taken {
    /// The byte is ours until our open of the file is closed (or [`release`]).
    Yes,
    /// Another open holds it: a live process has the slot (or is taking it).
    Held,
    /// This file system has no such locks.
    Unsupported,
}

/// Takes slot `slot`'s byte on `fd` (never waits).
pub fn take(fd: BorrowedFd<'_>, slot: usize) -> Taken {
    let lock = request(libc::F_WRLCK as libc::c_short, slot);
    // SAFETY: fcntl on a live descriptor with a valid flock.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &lock) } == 0 {
        return Taken::Yes;
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Taken::Held,
        _ => Taken::Unsupported,
    }
}

/// Gives slot `slot`'s byte back (on the open that took it).
pub fn release(fd: BorrowedFd<'_>, slot: usize) {
    let lock = request(libc::F_UNLCK as libc::c_short, slot);
    // SAFETY: fcntl on a live descriptor with a valid flock.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &lock) };
}

/// Whether some open of the file other than `fd`'s holds slot `slot`'s byte: `Some(true)`
/// its member lives, `Some(false)` nobody holds it, `None` cannot tell.
pub fn held(fd: BorrowedFd<'_>, slot: usize) -> Option<bool> {
    let mut lock = request(libc::F_WRLCK as libc::c_short, slot);
    // SAFETY: fcntl on a live descriptor with a valid flock, which it fills in.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_GETLK, &mut lock) } != 0 {
        return None;
    }
    Some(lock.l_type != libc::F_UNLCK as libc::c_short)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn scratch(name: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("cb-liveness-{}-{name}", std::process::id()));
        std::fs::write(&path, b"ledger").unwrap();
        path
    }

    fn open(path: &std::path::Path) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap()
    }

    #[test]
    fn a_slot_taken_on_one_open_is_seen_held_from_another_until_it_is_closed() {
        let path = scratch("held");
        let (member, reader) = (open(&path), open(&path));
        assert_eq!(held(reader.as_fd(), 3), Some(false));
        assert_eq!(take(member.as_fd(), 3), Taken::Yes);
        assert_eq!(held(reader.as_fd(), 3), Some(true));
        assert_eq!(held(reader.as_fd(), 4), Some(false), "one byte per slot");
        assert_eq!(take(reader.as_fd(), 3), Taken::Held);
        drop(member);
        assert_eq!(held(reader.as_fd(), 3), Some(false));
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_released_slot_is_free_and_the_file_is_unchanged() {
        let path = scratch("release");
        let (member, reader) = (open(&path), open(&path));
        assert_eq!(take(member.as_fd(), 0), Taken::Yes);
        release(member.as_fd(), 0);
        assert_eq!(held(reader.as_fd(), 0), Some(false));
        assert_eq!(std::fs::read(&path).unwrap(), b"ledger");
        let _ = std::fs::remove_file(&path);
    }
}
