//! The ledger file: where it lives, how it is made (whole, by rename), opened and checked,
//! its damage, and its removal by the last member.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::Duration;

use cudabudget_spec::job_file as layout;
use cudabudget_spec::place::{self, Access, Create, Dir, FileOpen, PlaceError};

use crate::sys::clock::monotonic_ms;
use crate::sys::lock::Lock;

use super::members::proc_stat;
use super::sigbus::*;
use super::words::*;

/// Which job's ledger.
#[derive(Clone, Copy, Debug)]
pub enum Ledger<'a> {
    /// `CUDABUDGET_SCOPE=job:<name>`.
    Named(&'a str),
    /// HAMi's `CUDA_DEVICE_MEMORY_SHARED_CACHE` path.
    Hami(&'a str),
}

/// One join at a time in this process (so that a slot being claimed by one thread is not
/// taken by another for a previous image's).
pub(super) static JOINING: Lock<()> = Lock::new(());

/// The places a ledger may be, best first: (directory, file name) or why a place is
/// unusable. The user's own directories are made where missing.
pub(super) fn places(
    ledger: Ledger<'_>,
    roots: &[PathBuf],
) -> Vec<Result<(Dir, String), PlaceError>> {
    places_in(ledger, roots, true)
}

/// The places where the job's ledger exists now, best first; nothing is created (a
/// process joins a ledger wherever one exists before making one, so that one job never
/// gets two ledgers).
pub(super) fn existing(ledger: Ledger<'_>, roots: &[PathBuf]) -> Vec<(Dir, String)> {
    places_in(ledger, roots, false)
        .into_iter()
        .filter_map(Result::ok)
        .filter(|(d, name)| d.stat_at(name).is_ok())
        .collect()
}

/// [`places`], making the user's own directories only when `make` is set.
pub(super) fn places_in(
    ledger: Ledger<'_>,
    roots: &[PathBuf],
    make: bool,
) -> Vec<Result<(Dir, String), PlaceError>> {
    let mut out = Vec::new();
    let name = match ledger {
        Ledger::Named(name) => format!("job-{name}"),
        Ledger::Hami(cache) => {
            let cache = Path::new(cache);
            if let (Some(parent), Some(file)) = (cache.parent(), cache.file_name()) {
                out.push(
                    Dir::open_trusted(parent)
                        .map(|d| (d, format!("{}.cudabudget", file.to_string_lossy()))),
                );
            }
            format!("hami-{:016x}", fnv1a(cache.as_os_str().as_encoded_bytes()))
        }
    };
    let me = place::euid();
    for root in roots {
        if make {
            let mut in_the_way = Vec::new();
            let mine = place::private_in(root, 0o700, &mut in_the_way);
            out.extend(in_the_way.into_iter().map(Err));
            out.extend(mine.map(|d| Ok((d, name.clone()))));
        } else if let Ok(d) = Dir::open_trusted(root) {
            out.extend(
                place::user_dirs_of(&d, me)
                    .into_iter()
                    .map(|d| Ok((d, name.clone()))),
            );
        }
    }
    out
}

pub(super) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Opens the job's ledger: one that exists in any of the places first, else a new one
/// in the first place that works. `None`: no place works (what was in the way is in
/// `in_the_way`); `Err`: the ledger (path) cannot be used (why).
pub(super) fn open_ledger(
    ledger: Ledger<'_>,
    roots: &[PathBuf],
    in_the_way: &mut Vec<String>,
) -> Result<Option<Job>, (String, String)> {
    let said = in_the_way.len();
    for _ in 0..3 {
        in_the_way.truncate(said);
        let Some(job) = open_ledger_once(ledger, roots, in_the_way)? else {
            return Ok(None);
        };
        if !better_ledger_exists(ledger, roots, &job) {
            return Ok(Some(job));
        }
        // Another process made the job's ledger in a better place while this one made
        // or joined its own (a name another user planted, then removed, between their
        // looks): the best place's ledger is the job's. Leave this one (its last member
        // removes it) and join that, before anything is allocated.
        job.leave();
    }
    open_ledger_once(ledger, roots, in_the_way)
}

/// Whether the job's ledger exists in a better place than `job`'s: the first of the
/// places that hold one is not `job`'s file.
pub(super) fn better_ledger_exists(ledger: Ledger<'_>, roots: &[PathBuf], job: &Job) -> bool {
    existing(ledger, roots).first().is_some_and(|(dir, name)| {
        dir.stat_at(name)
            .is_ok_and(|st| (st.st_dev, st.st_ino) != (job.dev, job.ino))
    })
}

/// [`open_ledger`]'s one look: a ledger that exists in any of the places first, else a
/// new one in the first place that works.
fn open_ledger_once(
    ledger: Ledger<'_>,
    roots: &[PathBuf],
    in_the_way: &mut Vec<String>,
) -> Result<Option<Job>, (String, String)> {
    for (dir, name) in existing(ledger, roots) {
        // What is in the way in the better places is said as when making one.
        for place in places(ledger, roots) {
            match place {
                Err(e) => in_the_way.push(e.to_string()),
                Ok((d, _)) if d.path() == dir.path() => break,
                Ok(_) => {}
            }
        }
        match open_in(&dir, &name) {
            Ok(job) => return Ok(Some(job)),
            Err(Failed::Place(e)) => in_the_way.push(e.to_string()),
            Err(Failed::Refused(path, why)) => return Err((path, why)),
        }
    }
    for place in places(ledger, roots) {
        let (dir, name) = match place {
            Ok(p) => p,
            Err(e) => {
                in_the_way.push(e.to_string());
                continue;
            }
        };
        match open_in(&dir, &name) {
            Ok(job) => return Ok(Some(job)),
            Err(Failed::Place(e)) => in_the_way.push(e.to_string()),
            Err(Failed::Refused(path, why)) => return Err((path, why)),
        }
    }
    Ok(None)
}

pub(super) enum Failed {
    /// This place cannot hold the ledger: try the next.
    Place(PlaceError),
    /// The ledger is there and cannot be used.
    Refused(String, String),
}

pub(super) const RW: FileOpen = FileOpen {
    access: Access::ReadWrite,
    create: Create::No,
    mode: 0,
};
pub(super) const NEW: FileOpen = FileOpen {
    access: Access::ReadWrite,
    create: Create::New,
    mode: 0o600,
};

/// Opens (or makes) the ledger `name` in `dir` and takes a slot in it.
pub(super) fn open_in(dir: &Dir, name: &str) -> Result<Job, Failed> {
    let path = dir.path().join(name).display().to_string();
    let mut tries = 0;
    loop {
        tries += 1;
        match dir.open_file(name, RW) {
            Ok(file) => {
                let fd = OwnedFd::from(file);
                if !hold_shared(&fd) {
                    return Err(Failed::Refused(
                        path,
                        format!(
                            "its last member began removing it and has not finished for \
                             {} ms (stopped?)",
                            REMOVAL_PATIENCE_MS
                        ),
                    ));
                }
                // Removed by its last member after we opened it: make a new one.
                if place::fstat(std::os::fd::AsFd::as_fd(&fd)).is_ok_and(|st| st.st_nlink == 0) {
                    continue;
                }
                let dir = dir.try_clone().map_err(|error| {
                    Failed::Place(PlaceError::Io {
                        path: dir.path().to_path_buf(),
                        error,
                    })
                })?;
                return attach(fd, dir, name, path);
            }
            Err(PlaceError::Io { error, .. }) if error.kind() == std::io::ErrorKind::NotFound => {
                match create(dir, name) {
                    Ok(()) => continue,
                    Err(e) => return Err(Failed::Place(e)),
                }
            }
            // Another process publishing with link + unlink (no renameat2 here): the
            // name has two links for a moment.
            Err(PlaceError::Untrusted { why, .. }) if why.contains("hard links") => {
                if tries >= 50 {
                    // Not a publication in progress: refused, not passed over (the job's
                    // members may be using it).
                    return Err(Failed::Refused(path, why));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(Failed::Place(e)),
        }
        if tries > 100 {
            return Err(Failed::Refused(path, "it keeps changing".to_string()));
        }
    }
}

/// Makes a whole ledger under a temporary name and gives it `name`, unless a ledger
/// got the name first (then that one is used).
pub(super) fn create(dir: &Dir, name: &str) -> Result<(), PlaceError> {
    pub(super) static SEQ: AtomicU64 = AtomicU64::new(0);
    let tmp = format!(
        ".{name}.{}.{}.new",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let tmp_path = dir.path().join(&tmp);
    let io = |error: std::io::Error| PlaceError::Io {
        path: tmp_path.clone(),
        error,
    };
    let file = dir.open_file(&tmp, NEW)?;
    let made = (|| -> std::io::Result<()> {
        file.set_len(FILE_BYTES as u64)?;
        let base = map(file.as_raw_fd())?;
        // SAFETY: a fresh mapping of FILE_BYTES zeroed bytes, ours alone until renamed.
        unsafe {
            std::ptr::copy_nonoverlapping(layout::header().as_ptr(), base, layout::HEADER_BYTES);
            let shares = base.add(layout::SHARES_AT) as *mut u64;
            for i in 0..DEVICES * SLOTS {
                *shares.add(2 * i + 1) = !0;
            }
            for i in 0..SLOTS {
                let claim = base.add(layout::claim_at(i)) as *mut u64;
                *claim.add(3) = !0;
            }
            libc::munmap(base.cast(), FILE_BYTES);
        }
        Ok(())
    })();
    if let Err(e) = made {
        let _ = dir.remove_file(&tmp);
        return Err(io(e));
    }
    match publish(dir, &tmp, name) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = dir.remove_file(&tmp);
            if e.raw_os_error() == Some(libc::EEXIST) {
                Ok(())
            } else {
                Err(io(e))
            }
        }
    }
}

/// Gives `tmp` the name `name` unless something has it: renameat2(RENAME_NOREPLACE), or
/// link + unlink where the file system has no renameat2.
pub(super) fn publish(dir: &Dir, tmp: &str, name: &str) -> std::io::Result<()> {
    let c = |s: &str| std::ffi::CString::new(s).map_err(std::io::Error::other);
    let (from, to) = (c(tmp)?, c(name)?);
    let fd = dir.fd().as_raw_fd();
    // SAFETY: a live directory descriptor and NUL-terminated names (a system call, so
    // that glibc's version does not matter).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            fd,
            from.as_ptr(),
            fd,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if !matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS)) {
        return Err(e);
    }
    // SAFETY: as above; linkat fails with EEXIST when the name is taken.
    if unsafe { libc::linkat(fd, from.as_ptr(), fd, to.as_ptr(), 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    dir.remove_file(tmp)
}

pub(super) fn map(fd: libc::c_int) -> std::io::Result<*mut u8> {
    // SAFETY: a shared read-write mapping of FILE_BYTES of our descriptor.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            FILE_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p.cast())
}

/// How long a joiner waits for a last member that is removing the ledger.
pub(super) const REMOVAL_PATIENCE_MS: u64 = 2000;

/// Takes the shared lock every member holds on the ledger for as long as it is a member
/// (on its own open of the file: a child of `fork()` shares its parent's until it joins
/// with its own). A last member removes the ledger only under the exclusive lock, so
/// never under a member ([`Job::leave`]). False only while a remover holds the file for
/// [`REMOVAL_PATIENCE_MS`]; a file system without locks lets everyone in (and the
/// ledger is then never removed while a slot is claimed).
pub(super) fn hold_shared(fd: &OwnedFd) -> bool {
    let since = monotonic_ms();
    loop {
        // SAFETY: flock on a live descriptor of ours.
        if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
            return true;
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EWOULDBLOCK) | Some(libc::EINTR) => {}
            _ => return true,
        }
        if monotonic_ms().saturating_sub(since) >= REMOVAL_PATIENCE_MS {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Maps an opened ledger, checks it and takes a slot.
pub(super) fn attach(fd: OwnedFd, dir: Dir, name: &str, path: String) -> Result<Job, Failed> {
    let named = path.clone();
    let refused = move |why: String| Failed::Refused(named.clone(), why);
    let st = place::fstat(std::os::fd::AsFd::as_fd(&fd))
        .map_err(|e| refused(format!("cannot stat it: {e}")))?;
    if st.st_size as usize != FILE_BYTES {
        return Err(refused(
            layout::problem(&[], st.st_size as u64).unwrap_or_default(),
        ));
    }
    install_sigbus_handler();
    let base = map(fd.as_raw_fd()).map_err(|e| refused(format!("cannot map it: {e}")))?;
    let mapping = register_mapping(base, st.st_dev, st.st_ino, fd.as_raw_fd() as u32);
    let mut job = Job {
        base,
        slot: usize::MAX,
        claim: 0,
        start: 0,
        fdno: 0,
        lock_id: 0,
        path,
        dir,
        name: name.to_string(),
        dev: st.st_dev,
        ino: st.st_ino,
        fd,
        alive_fd: None,
        mapping,
        mine: [const { AtomicU64::new(0) }; DEVICES],
        writing: Lock::new(()),
        damaged: AtomicBool::new(false),
        damage_said: AtomicBool::new(false),
        damage_why: Lock::new(None),
        suspects: [const { AtomicU64::new(0) }; SLOTS],
        lingering: [const { (AtomicU64::new(u64::MAX), AtomicU64::new(0)) }; SLOTS],
    };
    if let Some(why) = job.header_problem() {
        return Err(refused(why));
    }
    job.alive_fd = job.second_open();
    let _one = JOINING.lock();
    // Known before its lock is taken: a child forked from now on closes its copy.
    publish_alive(&job);
    let pid = std::process::id();
    let me = proc_stat(pid);
    let start = me.map(|s| s.start).unwrap_or(0);
    // A slot with this pid and start time not used by this image is its previous
    // image's (before an exec): that image is gone.
    for i in 0..SLOTS {
        if let Holder::Member {
            claim, start: s, ..
        } = job.holder(i)
            && claim as u32 == pid
            && s == start
            && !ours_in_this_image(job.dev, job.ino, i)
            && job.lock_held(i) != Some(true)
        {
            job.free_slot(i, claim);
        }
    }
    let (slot, claim) = match job.claim_slot(pid, start) {
        Some(s) => s,
        None => {
            job.reclaim_dead();
            job.claim_slot(pid, start)
                .ok_or_else(|| refused(format!("all {SLOTS} process slots of the job are taken")))?
        }
    };
    job.slot = slot;
    job.claim = claim;
    job.start = start;
    job.fdno = job.fd.as_raw_fd() as u32;
    job.lock_id = (slot as u64 + 1) | (claim & 0xFFFF_FFFF_0000_0000);
    if let Some(i) = mapping {
        MAPPED[i].slot.store(slot + 1, Ordering::Release);
    }
    Ok(job)
}

impl Job {
    /// What is wrong with the header now, if anything.
    pub(super) fn header_problem(&self) -> Option<String> {
        let mut head = [0u8; layout::HEADER_BYTES];
        for (i, chunk) in head.chunks_mut(8).enumerate() {
            chunk.copy_from_slice(&self.word64(i * 8).load(Ordering::Acquire).to_le_bytes());
        }
        layout::problem(&head, FILE_BYTES as u64)
    }

    /// Whether the job is damaged (found so once: for good).
    pub fn is_damaged(&self) -> bool {
        if self.damaged.load(Ordering::Acquire) {
            return true;
        }
        let why = if self
            .mapping
            .is_some_and(|i| MAPPED[i].damaged.load(Ordering::Acquire))
        {
            Some("it was cut short under this process".to_string())
        } else {
            self.header_problem()
        };
        match why {
            Some(why) => {
                self.mark_damaged(why);
                true
            }
            None => false,
        }
    }

    pub(super) fn mark_damaged(&self, why: String) {
        if !self.damaged.swap(true, Ordering::AcqRel) {
            *self.damage_why.lock() = Some(why);
            poison(self.fd.as_raw_fd() as u32, self.dev, self.ino);
        }
    }

    /// Once, after the job was found damaged: the line to tell the user.
    pub fn damage_news(&self) -> Option<String> {
        if !self.damaged.load(Ordering::Acquire) || self.damage_said.swap(true, Ordering::AcqRel) {
            return None;
        }
        let why = self.damage_why.lock().clone().unwrap_or_default();
        Some(format!(
            "job ledger {}: damaged ({why}); new allocations are refused, memory already \
             held keeps working; remove the file once the job's processes have ended",
            self.path
        ))
    }

    /// A second open of the ledger (its own open file description, close-on-exec), for
    /// our slot's [`liveness`] lock; `None` if the name is no longer this file.
    pub(super) fn second_open(&self) -> Option<OwnedFd> {
        let file = self.dir.open_file(&self.name, RW).ok()?;
        let st = place::fstat(file.as_fd()).ok()?;
        ((st.st_dev, st.st_ino) == (self.dev, self.ino)).then(|| OwnedFd::from(file))
    }

    /// Removes the ledger when this process was its last member: under the exclusive
    /// lock (no other open of the file holds the members' shared lock), with every slot
    /// free once the dead are cleaned, and only while the name is still this file. A
    /// joiner that opened the file meanwhile waits for the lock, sees the file unlinked
    /// and makes a new one ([`open_in`]). A damaged ledger stays for its operator.
    pub(super) fn remove_if_last(&self) {
        if self.damaged.load(Ordering::Acquire) || !self.is_still_the_ledger() {
            return;
        }
        // SAFETY: flock on our own descriptor, checked above to be the ledger. A failed
        // conversion may drop our shared lock: we are leaving anyway.
        if unsafe { libc::flock(self.fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return;
        }
        self.reclaim_dead();
        let empty = (0..SLOTS).all(|i| self.holder(i) == Holder::Free);
        if empty
            && self
                .dir
                .stat_at(&self.name)
                .is_ok_and(|st| (st.st_dev, st.st_ino) == (self.dev, self.ino))
        {
            let _ = self.dir.remove_file(&self.name);
        }
        // SAFETY: as above; back to shared (a process may call leave twice).
        unsafe { libc::flock(self.fd.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
    }

    /// Whether our descriptor is still the ledger (a program may close it and reuse the
    /// number).
    pub(super) fn is_still_the_ledger(&self) -> bool {
        place::fstat(std::os::fd::AsFd::as_fd(&self.fd))
            .is_ok_and(|st| (st.st_dev, st.st_ino) == (self.dev, self.ino))
    }
}

/// The descriptor holding the joining or joined job's [`liveness`] lock (-1: none) and
/// the ledger it is open on: a child of `fork()` closes its copy, so that it never keeps
/// its parent alive to the job.
static ALIVE_FD: AtomicI32 = AtomicI32::new(-1);
static ALIVE_DEV: AtomicU64 = AtomicU64::new(0);
static ALIVE_INO: AtomicU64 = AtomicU64::new(0);

/// Makes `job`'s lock descriptor the one a child of `fork()` closes.
pub(super) fn publish_alive(job: &Job) {
    if let Some(fd) = &job.alive_fd {
        ALIVE_DEV.store(job.dev, Ordering::Release);
        ALIVE_INO.store(job.ino, Ordering::Release);
        ALIVE_FD.store(fd.as_raw_fd(), Ordering::Release);
    }
}

/// In the child of `fork()`: closes its copy of the lock descriptor, only while that
/// number is still the ledger's (the program may have closed it and reused the number,
/// which is then left alone). Plain system calls only (fstat, close).
pub(super) fn close_alive_in_child() {
    let fd = ALIVE_FD.swap(-1, Ordering::AcqRel);
    if fd >= 0
        && is_file(
            fd as u32,
            ALIVE_DEV.load(Ordering::Acquire),
            ALIVE_INO.load(Ordering::Acquire),
        )
    {
        // SAFETY: the child's copy of the lock descriptor, used by nothing in the child
        // (its Job is the parent's, no longer reachable), checked above to be the
        // ledger; close is async-signal-safe. The parent's open keeps its lock.
        unsafe { libc::close(fd) };
    }
}
