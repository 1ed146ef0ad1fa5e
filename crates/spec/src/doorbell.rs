//! The doorbell of a user's records directory: how `cudabudget limit` tells that user's
//! budgeted processes to look at their budgets now, instead of at their next look
//! (every 200 ms).
//!
//! A file [`NAME`] beside the records (in the owner's private directory, mode 0700;
//! created 0600 by the first process that publishes there) holds one 32-bit counter at
//! offset 0. Each process's background thread maps the file and sleeps on the counter
//! with a futex (shared, not private: the key is the file's page, so sleepers in every
//! process meet there) for at most its interval; `limit` adds one to the counter and
//! wakes them all. An idle process therefore wakes no more often than it publishes.
//!
//! The mapping is never read or written by the program: the counter is read and written
//! with `pread`/`pwrite`, and only the kernel looks at the mapped page (for the futex).
//! A file truncated behind our back makes the futex calls fail (`EFAULT`), never the
//! process (`SIGBUS`). Whoever rings may miss a sleeper that read the counter after the
//! ring; the sleeper then finds the change on its next look, as it would without a bell.
//! A program may close descriptors it did not open and reuse the number: the bell then
//! reads nothing through it (no count, so the sleeper sleeps without it) and never
//! closes it.

use std::fs::File;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::FileExt;
use std::time::Duration;

use crate::futex;
use crate::place::{Access, Create, Dir, FileOpen, PlaceError};

/// The doorbell's file name in a records directory (never a record's name).
pub const NAME: &str = "doorbell";

/// The bytes a doorbell file has at least: the counter.
const LEN: u64 = 4;

/// A records directory's doorbell, opened and mapped.
pub struct Doorbell {
    /// Closed at drop only while it still is the doorbell (see the module's comment).
    file: ManuallyDrop<File>,
    /// The file's device and inode, to tell it is still ours.
    identity: (u64, u64),
    /// The first page of the file, mapped shared and read-only; only its address is
    /// used (by the futex calls).
    page: *mut libc::c_void,
    page_len: usize,
}

// SAFETY: `page` is only an address handed to the kernel, never dereferenced; the file is
// used through `pread`/`pwrite`, which are safe from any thread.
unsafe impl Send for Doorbell {}
// SAFETY: as for Send: no method reads or writes through `page`.
unsafe impl Sync for Doorbell {}

impl Doorbell {
    /// The doorbell in `dir`, a directory of `owner`'s; made (0600) when missing and
    /// `create` is true. The file must be a regular file of `owner`'s that nobody else
    /// may write ([`Dir::open_file_of`]).
    pub fn open(dir: &Dir, owner: u32, create: bool) -> Result<Doorbell, PlaceError> {
        let open = FileOpen {
            access: Access::ReadWrite,
            create: if create {
                Create::IfMissing
            } else {
                Create::No
            },
            mode: 0o600,
        };
        let file = dir.open_file_of(NAME, open, owner)?;
        let path = dir.path().join(NAME);
        let st = crate::place::fstat(file.as_fd()).map_err(|e| PlaceError::io(&path, e))?;
        let len = st.st_size as u64;
        if len < LEN {
            // Extending never changes the counter another process may have written.
            file.set_len(LEN).map_err(|e| PlaceError::io(&path, e))?;
        }
        // SAFETY: sysconf has no preconditions.
        let page_len = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            n if n > 0 => n as usize,
            _ => 4096,
        };
        // SAFETY: a new shared read-only mapping of a file we hold open; the kernel
        // chooses the address. Nothing reads through it (see the module's comment).
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                page_len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if page == libc::MAP_FAILED {
            return Err(PlaceError::io(&path, io::Error::last_os_error()));
        }
        Ok(Doorbell {
            file: ManuallyDrop::new(file),
            identity: (st.st_dev, st.st_ino),
            page,
            page_len,
        })
    }

    /// Whether our descriptor still is the doorbell file.
    fn still_ours(&self) -> bool {
        crate::place::fstat(self.file.as_fd())
            .is_ok_and(|st| (st.st_dev, st.st_ino) == self.identity)
    }

    /// The counter now: read before looking at what a ring would announce, then handed
    /// to [`Doorbell::wait`], so that a ring in between is not slept through. None when
    /// the descriptor is no longer the doorbell's: sleep without it.
    pub fn count(&self) -> Option<u32> {
        if !self.still_ours() {
            return None;
        }
        let mut bytes = [0u8; 4];
        match self.file.read_at(&mut bytes, 0) {
            Ok(4) => Some(u32::from_ne_bytes(bytes)),
            _ => Some(0),
        }
    }

    /// Sleeps until the bell rings after `seen` was read, at most `timeout` (returns at
    /// once if it already rang; early on a signal or when the file is damaged).
    pub fn wait(&self, seen: u32, timeout: Duration) {
        // SAFETY: the first word of our own live mapping (page-aligned); the kernel reads
        // it and answers EFAULT if the page is gone.
        let rc = unsafe { futex::wait_at(self.page.cast(), seen, timeout) };
        if rc.is_err_and(|e| e.raw_os_error() == Some(libc::EFAULT)) {
            // A file truncated behind our back: sleep the timeout out rather than spin.
            std::thread::sleep(timeout);
        }
    }

    /// Rings: adds one to the counter and wakes every sleeper.
    pub fn ring(&self) -> io::Result<()> {
        let count = self
            .count()
            .ok_or_else(|| io::Error::other("the doorbell's descriptor was replaced"))?;
        self.file
            .write_all_at(&count.wrapping_add(1).to_ne_bytes(), 0)?;
        // SAFETY: the first word of our own live mapping; the kernel only resolves it.
        unsafe { futex::wake_all_at(self.page.cast()) };
        Ok(())
    }
}

impl Drop for Doorbell {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `page_len` bytes, not used after this.
        unsafe { libc::munmap(self.page, self.page_len) };
        if self.still_ours() {
            // SAFETY: dropped once, here, and never used after.
            unsafe { ManuallyDrop::drop(&mut self.file) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    fn private_dir() -> (std::path::PathBuf, Dir) {
        let base = std::env::temp_dir().join(format!(
            "cb-doorbell-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir(&base).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o700)).unwrap();
        let dir = Dir::open_trusted(&base).unwrap();
        (base, dir)
    }

    #[test]
    fn a_ring_wakes_a_sleeper_at_once_and_a_quiet_bell_sleeps_the_timeout() {
        let (base, dir) = private_dir();
        let me = crate::place::euid();
        let sleeper = Arc::new(Doorbell::open(&dir, me, true).unwrap());
        // Nobody rings: the whole timeout.
        let started = Instant::now();
        sleeper.wait(sleeper.count().unwrap(), Duration::from_millis(150));
        assert!(started.elapsed() >= Duration::from_millis(140));
        // A ring from another opening of the file (as `limit` does) wakes it long
        // before its 10 s timeout.
        let seen = sleeper.count().unwrap();
        let s = Arc::clone(&sleeper);
        let woken = std::thread::spawn(move || {
            let started = Instant::now();
            s.wait(seen, Duration::from_secs(10));
            started.elapsed()
        });
        std::thread::sleep(Duration::from_millis(100));
        Doorbell::open(&dir, me, false).unwrap().ring().unwrap();
        assert!(woken.join().unwrap() < Duration::from_secs(5));
        // A ring between reading the counter and sleeping is not slept through.
        let seen = sleeper.count().unwrap();
        Doorbell::open(&dir, me, false).unwrap().ring().unwrap();
        let started = Instant::now();
        sleeper.wait(seen, Duration::from_secs(10));
        assert!(started.elapsed() < Duration::from_secs(5));
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_truncated_bell_neither_kills_nor_spins() {
        let (base, dir) = private_dir();
        let me = crate::place::euid();
        let bell = Doorbell::open(&dir, me, true).unwrap();
        std::fs::File::options()
            .write(true)
            .open(base.join(NAME))
            .unwrap()
            .set_len(0)
            .unwrap();
        let started = Instant::now();
        bell.wait(bell.count().unwrap(), Duration::from_millis(100));
        assert!(started.elapsed() >= Duration::from_millis(90));
        bell.ring().unwrap();
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_descriptor_the_program_reused_is_neither_read_nor_closed() {
        let (base, dir) = private_dir();
        let me = crate::place::euid();
        let bell = Doorbell::open(&dir, me, true).unwrap();
        let fd = bell.file.as_raw_fd();
        // The program puts another file under the bell's number (as a daemon that closed
        // every descriptor and opened its own would).
        let other = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: dup2 onto a descriptor this test owns (the bell's), atomically.
        assert_eq!(unsafe { libc::dup2(other.as_raw_fd(), fd) }, fd);
        assert_eq!(bell.count(), None);
        assert!(bell.ring().is_err());
        drop(bell);
        // SAFETY: fcntl on a number; -1 if it was closed.
        assert_ne!(unsafe { libc::fcntl(fd, libc::F_GETFD) }, -1, "left open");
        // SAFETY: the number is ours again (the program's stand-in), closed once.
        unsafe { libc::close(fd) };
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn only_an_existing_bell_is_rung_and_never_through_a_link() {
        let (base, dir) = private_dir();
        let me = crate::place::euid();
        assert!(Doorbell::open(&dir, me, false).is_err());
        std::os::unix::fs::symlink("/etc/passwd", base.join(NAME)).unwrap();
        assert!(Doorbell::open(&dir, me, true).is_err());
        std::fs::remove_dir_all(base).unwrap();
    }
}
