//! Job scope: one budget per device for every process of a job
//! (`CUDABUDGET_SCOPE=job:<name>`, or HAMi's `CUDA_DEVICE_MEMORY_SHARED_CACHE`).
//!
//! # Where
//! The job's books are a file mapped by each member, in the user's own directory
//! `cudabudget-<uid>` (0700) under the first of the configured roots that gives one
//! (`CUDABUDGET_JOB_DIR` or `/dev/shm`, then `$XDG_RUNTIME_DIR`, `$HOME/.cache`):
//! `job-<name>`. Nobody else can create, replace or rename anything in that directory, and
//! the file is opened through its descriptor (no link followed, owner, mode, type and one
//! link checked). HAMi's shared cache gets its ledger beside the cache file when that
//! directory passes the same checks, else in the private directory under a name derived
//! from the cache path. A process joins the job's ledger wherever one exists (looking in
//! every root's private directory without creating anything) before it makes one, in
//! the first usable root: one job, one ledger, even when the first root's name was
//! freed after the job began. When another user holds a name (a file, a link, a
//! directory), the next root is tried; when none works the process runs under its own
//! budget, and says which file is in the way. Layout: [`cudabudget_spec::job_file`].
//!
//! # Creation
//! A ledger is made under a temporary name (`O_EXCL`), initialised, then given its name
//! with `renameat2(RENAME_NOREPLACE)`: a file at the name is always whole, and is never
//! made again. Two processes creating at once: one name wins, the other joins it.
//!
//! # Removal
//! Each member holds a shared `flock` on its own open of the file for as long as it is a
//! member. The member that leaves last (at exit) takes the exclusive lock, cleans the
//! dead, and removes the name if every slot is free and the name is still this file; a
//! process that opened the file meanwhile gets its shared lock only after that, sees
//! the file unlinked and makes a new ledger. A ledger whose last member was killed
//! stays until the job's next process leaves it; a damaged one stays for its operator.
//!
//! # The books
//! Each member owns a slot (its claim: pid and a per-claim generation; its start time; the
//! descriptor it keeps the file open with) and writes only its own shares: per device what
//! it holds, and the bitwise complement of that. The process keeps the truth of what it
//! holds in its own memory and writes it out on each change (restoring its slot if
//! anything else wrote there). A share is read as the larger of the two words, so a stray
//! write lowers it only by writing both consistently; a free slot holds (0, !0), and
//! anything else there counts (fail closed) until a scan has seen it for a second and
//! cleans it. The claim, start time and descriptor carry a seal (a function of the
//! three): a slot whose seal does not match is neither free nor judged dead, its shares
//! keep counting, and its owner restores it at its next call.
//!
//! What the job holds on a device is the sum of the slots' shares; no total is kept.
//! Admission adds to the member's own share first, then sums (all sequentially
//! consistent) and takes the bytes back if the sum passes the budget: two admitters
//! racing for the last bytes cannot both pass, whoever sees whom (Dekker). The device's
//! admission lock only orders admitters so that they do not both back off; it names its
//! holder by slot and claim generation (a reused slot does not inherit it), is taken
//! over at once from a slot that no longer has that claim, after a millisecond from a
//! dead holder, and after [`LOCK_PATIENCE_MS`] from a live one (stopped, say). Frees,
//! charges and exits take no lock and wait for nobody.
//!
//! # Dead members
//! A member lives while it holds the open-file-description lock on its slot's byte
//! ([`liveness`]): the kernel drops it when the process exits, is killed or execs, in
//! whatever PID namespace it runs, so the members of a job spread over several pods
//! judge each other rightly. Where the lock is not held (or the file system has no such
//! locks), a member is dead when its pid is gone, its start time differs (a reused pid),
//! it is a zombie (state Z or X), or it exec'd (the descriptor it kept, close-on-exec, no
//! longer is the ledger, and its address space no longer maps the file): a member that
//! closed the library's descriptors is still found alive in its own PID namespace. A
//! process that joins frees a slot carrying its own pid and start time (its previous
//! image's) unless that slot's lock is held. Dead members'
//! shares are given back by whoever looks first: at most once a second per job while
//! admitting or waiting, and before every denial. A slot is taken out of use with a
//! tombstone claim first, so that two processes cleaning it cannot clean a new owner's.
//! A slot left half written (its seal does not match) by a process that died or stopped
//! mid-change is cleaned once its claim's process has been dead for a second, and a
//! tombstone left unfinished for a second is finished whoever wrote it; a garbled slot of
//! a live process keeps counting. A member leaves, and restores its slot, only by
//! compare-and-swap on its own claim, never over a newcomer's. The ledger's descriptor
//! is checked to still be the ledger (device and inode) before it is measured or written:
//! a program may close it and reuse the number.
//!
//! # Damage
//! The header (the first 40 bytes, written once) is checked on every admission, the size
//! at every scan. A ledger cut under its members would raise SIGBUS at the next access:
//! a handler (installed once, chained to whatever was there) maps zeroed memory over the
//! mapping when the fault lies in it, and the job is then damaged. A member that finds
//! damage zeroes the file's magic through its descriptor (its own writes may no longer
//! reach the file), so that every member stops trusting it. A damaged job admits
//! nothing (fail closed) and says so once, naming the file; frees and exits go on. A
//! damaged ledger is never made again while it may have members: a process that joins
//! one is refused CUDA with a line naming the file (remove it once the job's processes
//! are gone). Limits: a handler installed after ours (by the program) takes SIGBUS from
//! us; a member stopped while a stray write wiped its slot may see its share cleaned
//! after a second.
//!
//! # Waits
//! `CUDABUDGET_ON_EXCEED=wait:<d>`: each waiting thread takes an entry of the job's queue
//! with a ticket (arrival order) and a heartbeat. The oldest live entry whose heartbeat
//! is fresh (within [`TURN_STALE_MS`]) goes first; a waiter that is stopped or killed
//! stops beating and so loses its turn. Waiters sleep on the device's futex word, which
//! every member's free bumps, and wake at least every [`NAP_MS`] to beat.

use std::path::PathBuf;
use std::sync::atomic::{AtomicPtr, Ordering};

mod file;
mod liveness;
mod members;
mod shares;
mod sigbus;
mod turn;
mod words;

pub use file::Ledger;
pub use words::Job;

use file::open_ledger;
use sigbus::MAPPED;
use words::FILE_BYTES;

impl Drop for Job {
    fn drop(&mut self) {
        if let Some(i) = self.mapping {
            MAPPED[i].slot.store(0, Ordering::Release);
            MAPPED[i].fd.store(u32::MAX, Ordering::Release);
            MAPPED[i].base.store(0, Ordering::Release);
        }
        // SAFETY: our own mapping of FILE_BYTES; nothing refers to it after the drop.
        unsafe { libc::munmap(self.base.cast(), FILE_BYTES) };
    }
}

/// The job the process joined (null until then, and in a child of `fork()`).
static JOINED: AtomicPtr<Job> = AtomicPtr::new(std::ptr::null_mut());
/// The job this process belongs to, if it joined one.
#[inline]
pub fn joined() -> Option<&'static Job> {
    let p = JOINED.load(Ordering::Acquire);
    // SAFETY: a published Job is leaked (never freed) for the process's life.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// How joining went.
pub enum Joined {
    /// In the job; `in_the_way` names what was passed over to get there.
    Job {
        job: &'static Job,
        in_the_way: Vec<String>,
    },
    /// No place for the ledger: the process keeps its own budget. What was in the way.
    Alone { in_the_way: Vec<String> },
    /// The ledger exists and is not one this build can use (damaged, another layout):
    /// the process must not run unbudgeted, nor beside the job's members.
    Refused { path: String, why: String },
}

/// Joins the job's ledger (creating it if no process has): the first place that works.
pub fn join(ledger: Ledger<'_>, roots: &[PathBuf]) -> Joined {
    if let Some(job) = joined() {
        return Joined::Job {
            job,
            in_the_way: Vec::new(),
        };
    }
    let mut in_the_way = Vec::new();
    match open_ledger(ledger, roots, &mut in_the_way) {
        Err((path, why)) => Joined::Refused { path, why },
        Ok(None) => Joined::Alone { in_the_way },
        Ok(Some(job)) => {
            let job = Box::into_raw(Box::new(job));
            match JOINED.compare_exchange(
                std::ptr::null_mut(),
                job,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    // SAFETY: just published, never freed.
                    let job = unsafe { &*job };
                    file::publish_alive(job);
                    Joined::Job { job, in_the_way }
                }
                Err(first) => {
                    // Another thread joined first: give this slot back, use that one.
                    // SAFETY: our own Box, never published.
                    let mine = unsafe { Box::from_raw(job) };
                    mine.leave();
                    Joined::Job {
                        // SAFETY: `first` is published and never freed.
                        job: unsafe { &*first },
                        in_the_way,
                    }
                }
            }
        }
    }
}

/// In the child of `fork()`: the child is not the parent's member of the job.
pub fn after_fork() {
    JOINED.store(std::ptr::null_mut(), Ordering::Release);
    // SAFETY: in the child of fork() only the forking thread runs: no guard of JOINING
    // is alive here (a thread that held it in the parent did not come along).
    unsafe { file::JOINING.reset_in_child(()) };
    file::close_alive_in_child();
}

#[cfg(test)]
mod tests;
