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

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cudabudget_spec::job_file as layout;
use cudabudget_spec::place::{self, Access, Create, Dir, FileOpen, PlaceError};
use layout::TOMB;

use crate::sys::lock::Lock;
use crate::sys::{clock::monotonic_ms, futex};

mod liveness;

/// Processes a job holds at once.
pub const SLOTS: usize = layout::SLOTS;
const DEVICES: usize = layout::DEVICES;
const WAITERS: usize = layout::WAITERS;
const FILE_BYTES: usize = layout::FILE_BYTES;

/// How long an admitter waits for a live holder of a device's admission lock.
pub const LOCK_PATIENCE_MS: u64 = 50;
/// A waiter whose heartbeat is older than this has lost its turn.
pub const TURN_STALE_MS: u64 = 100;
/// The longest a waiter sleeps between heartbeats.
pub const NAP_MS: u64 = 40;
/// How often (at most) a member looks for dead ones.
const SCAN_EVERY_MS: u64 = 1000;
/// How long a free slot must hold what a free slot never holds before it is cleaned.
const SUSPECT_MS: u64 = 1000;

#[repr(C)]
struct DeviceWord {
    /// 0: free; else the holder: slot + 1 (low 16 bits), a thread tag (next 16), the
    /// holder's claim generation (high 32).
    lock: AtomicU64,
    /// The next ticket of the device's queue of waiters.
    next_ticket: AtomicU64,
    /// Bumped on every free (a futex word): waiters sleep on it.
    wake: AtomicU32,
    /// Threads waiting for room on the device (a hint: wakes are skipped while 0).
    waiters: AtomicU32,
    _pad: u64,
}

const _: () = assert!(std::mem::offset_of!(DeviceWord, wake) == layout::WAKE_IN_DEVICE_WORD);

#[repr(C)]
struct Waiter {
    /// 0: a free entry.
    ticket: AtomicU64,
    /// The claim of the waiting thread's slot.
    claim: AtomicU64,
    device: AtomicU32,
    slot: AtomicU32,
    /// When the waiter last showed it is there (ms, CLOCK_MONOTONIC).
    beat: AtomicU64,
}

#[repr(C)]
struct Claim {
    /// 0: free; pid (low 32 bits) and generation (high 32); or a tombstone.
    claim: AtomicU64,
    /// The process's start time (`/proc/<pid>/stat` field 22); 0 while it joins.
    start: AtomicU64,
    /// The descriptor the process keeps the ledger open with (close-on-exec).
    fd: AtomicU32,
    /// Bumped at each claim: the generation the next claim gets.
    generation: AtomicU32,
    /// [`seal`] of the claim, start time and descriptor: a slot whose seal does not match
    /// was written by something else, and is neither free nor judged dead.
    seal: AtomicU64,
}

/// The seal of a slot's claim, start time and descriptor (a free slot: all zero, seal
/// `!0`).
fn seal(claim: u64, start: u64, fd: u32) -> u64 {
    !(claim ^ start.rotate_left(17) ^ u64::from(fd))
}

/// Who holds a slot, by its words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holder {
    Free,
    Member {
        claim: u64,
        start: u64,
        fd: u32,
    },
    /// Being taken out of use by this pid.
    Tomb(u32),
    /// Words that do not agree (a stray write, or a claim being written).
    Garbled,
}

#[repr(C)]
struct Share {
    used: AtomicU64,
    /// `!used`.
    inv: AtomicU64,
}

const _: () = {
    assert!(std::mem::size_of::<DeviceWord>() == layout::DEVICE_WORD_BYTES);
    assert!(std::mem::size_of::<Waiter>() == layout::WAITER_BYTES);
    assert!(std::mem::size_of::<Claim>() == layout::CLAIM_BYTES);
    assert!(std::mem::size_of::<Share>() == layout::SHARE_BYTES);
};

const LAST_SCAN_AT: usize = 64;

// ---------------------------------------------------------------------------------------
// Mappings this process holds, for the SIGBUS handler.

struct Mapped {
    base: AtomicUsize,
    /// The file mapped (device and inode).
    dev: AtomicU64,
    ino: AtomicU64,
    damaged: AtomicBool,
    /// The slot of the Job using the mapping (+1; 0: none yet).
    slot: AtomicUsize,
    /// The descriptor the file is open with (to mark it damaged for every member).
    fd: AtomicU32,
}

const MAPPINGS: usize = 64;
static MAPPED: [Mapped; MAPPINGS] = [const {
    Mapped {
        base: AtomicUsize::new(0),
        dev: AtomicU64::new(0),
        ino: AtomicU64::new(0),
        damaged: AtomicBool::new(false),
        slot: AtomicUsize::new(0),
        fd: AtomicU32::new(u32::MAX),
    }
}; MAPPINGS];

/// The action SIGBUS had before ours (written once, before ours is installed).
struct OldAction(UnsafeCell<MaybeUninit<libc::sigaction>>);
// SAFETY: written once inside `Once::call_once` before the handler that reads it exists.
unsafe impl Sync for OldAction {}
static OLD_SIGBUS: OldAction = OldAction(UnsafeCell::new(MaybeUninit::zeroed()));
static SIGBUS_ONCE: std::sync::Once = std::sync::Once::new();

fn install_sigbus_handler() {
    SIGBUS_ONCE.call_once(|| {
        // SAFETY: an all-zero sigaction is a valid value; the fields are set below.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_sigbus as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
        // SAFETY: a valid signal set out-pointer.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: valid pointers; OLD_SIGBUS is read (and written) here, once, before ours
        // is installed: no signal can reach the handler before it is whole.
        unsafe {
            libc::sigaction(
                libc::SIGBUS,
                std::ptr::null(),
                (*OLD_SIGBUS.0.get()).as_mut_ptr(),
            );
            libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
        }
    });
}

/// SIGBUS: a fault inside a ledger mapping (the file was cut under it) maps zeroed memory
/// over the mapping and marks the job damaged, and the access is made again; any other
/// fault goes to the handler that was there before, or to the default action.
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // Sent (kill, sigqueue: si_code <= 0): no fault, and no address.
    let sent = code <= 0;
    for m in MAPPED.iter().filter(|_| !sent) {
        let base = m.base.load(Ordering::Acquire);
        if base != 0 && addr >= base && addr < base + FILE_BYTES {
            m.damaged.store(true, Ordering::Release);
            poison(
                m.fd.load(Ordering::Acquire),
                m.dev.load(Ordering::Acquire),
                m.ino.load(Ordering::Acquire),
            );
            // SAFETY: replaces our own mapping, of this exact range, with anonymous
            // memory (mmap is a plain system call, safe in a signal handler).
            let p = unsafe {
                libc::mmap(
                    base as *mut libc::c_void,
                    FILE_BYTES,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                return;
            }
        }
    }
    // SAFETY: OLD_SIGBUS was written before this handler was installed.
    let old = unsafe { (*OLD_SIGBUS.0.get()).assume_init_ref() };
    let handler = old.sa_sigaction;
    if handler == libc::SIG_IGN && sent {
        // Ignored, as before us.
    } else if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // The default action: on the access made again when this returns (a fault), or
        // raised again (a sent signal is not sent again by returning; SIGBUS is blocked
        // in here, so it is taken as this returns).
        // SAFETY: an all-zero sigaction with SIG_DFL (0) is the default action.
        let dfl: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointers; raise is async-signal-safe.
        unsafe {
            libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            if sent {
                libc::raise(libc::SIGBUS);
            }
        }
    } else if old.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous handler, called as it was registered (SA_SIGINFO).
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(handler) };
        f(sig, info, ctx);
    } else {
        // SAFETY: the previous handler, called as it was registered.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
        f(sig);
    }
}

/// Marks the ledger behind `fd` damaged for every member: its magic is zeroed through the
/// descriptor (a plain system call, safe in a signal handler). A member whose mapping
/// was replaced no longer writes the file, so the others must stop trusting it too.
/// Only while `fd` is still the ledger (`dev`, `ino`): the program may have closed it
/// and the number may now be another file, which is left alone.
fn poison(fd: u32, dev: u64, ino: u64) {
    if fd != u32::MAX && is_file(fd, dev, ino) {
        let zero = [0u8; 8];
        // SAFETY: writes 8 bytes from a live buffer to a descriptor we keep open.
        unsafe { libc::pwrite(fd as libc::c_int, zero.as_ptr().cast(), 8, 0) };
    }
}

/// Whether descriptor `fd` is open on the file (`dev`, `ino`) (fstat: a plain system
/// call, safe in a signal handler).
fn is_file(fd: u32, dev: u64, ino: u64) -> bool {
    let mut st = MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: a valid out-pointer to a stat buffer; a bad descriptor only fails.
    if unsafe { libc::fstat(fd as libc::c_int, st.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: fstat succeeded and filled it (and it was zeroed anyway).
    let st = unsafe { st.assume_init() };
    st.st_dev == dev && st.st_ino == ino
}

fn register_mapping(base: *mut u8, dev: u64, ino: u64, fd: u32) -> Option<usize> {
    MAPPED.iter().position(|m| {
        m.base
            .compare_exchange(0, base as usize, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
            && {
                m.damaged.store(false, Ordering::Release);
                m.slot.store(0, Ordering::Release);
                m.dev.store(dev, Ordering::Release);
                m.ino.store(ino, Ordering::Release);
                m.fd.store(fd, Ordering::Release);
                true
            }
    })
}

/// Whether slot `slot` of the ledger (`dev`, `ino`) is used by a Job of this image.
fn ours_in_this_image(dev: u64, ino: u64, slot: usize) -> bool {
    MAPPED.iter().any(|m| {
        m.base.load(Ordering::Acquire) != 0
            && m.slot.load(Ordering::Acquire) == slot + 1
            && m.dev.load(Ordering::Acquire) == dev
            && m.ino.load(Ordering::Acquire) == ino
    })
}

// ---------------------------------------------------------------------------------------
// The job.

/// A job this process has joined: the mapping, its own slot, and the truth of what it
/// holds.
pub struct Job {
    base: *mut u8,
    slot: usize,
    /// Our claim word (pid and generation), start time and descriptor, as in our slot.
    claim: u64,
    start: u64,
    fdno: u32,
    /// Our thread-independent lock tag base (slot + 1 and generation).
    lock_id: u64,
    path: String,
    /// The directory that names the ledger, and the name (to remove it when the last
    /// member leaves).
    dir: Dir,
    name: String,
    dev: u64,
    ino: u64,
    fd: OwnedFd,
    /// Our own open of the ledger that holds our slot's [`liveness`] lock (none where
    /// the file cannot be opened again or has no such locks).
    alive_fd: Option<OwnedFd>,
    /// Index in [`MAPPED`], if the mapping is watched for SIGBUS.
    mapping: Option<usize>,
    /// What this process holds per device: the truth its slot is written from.
    mine: [AtomicU64; DEVICES],
    /// One thread of the process writes the slot at a time.
    writing: Lock<()>,
    /// Set once the job is found damaged (also in [`MAPPED`]).
    damaged: AtomicBool,
    /// Why, for the one line the user gets (taken once by [`Job::damage_news`]).
    damage_said: AtomicBool,
    damage_why: Lock<Option<String>>,
    /// Per slot: since when this process has seen stray bytes in it while free (ms).
    suspects: [AtomicU64; SLOTS],
    /// Per slot: the garbled or tombstone claim this process last saw there, and since
    /// when (ms).
    lingering: [(AtomicU64, AtomicU64); SLOTS],
}

// SAFETY: the mapping is shared memory reached only through atomics.
unsafe impl Send for Job {}
// SAFETY: as above.
unsafe impl Sync for Job {}

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
/// The descriptor holding the joined job's [`liveness`] lock (-1: none), closed in a
/// child of `fork()` so that a child does not keep its parent alive to the job.
static ALIVE_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
/// One join at a time in this process (so that a slot being claimed by one thread is not
/// taken by another for a previous image's).
static JOINING: Lock<()> = Lock::new(());

/// The job this process belongs to, if it joined one.
#[inline]
pub fn joined() -> Option<&'static Job> {
    let p = JOINED.load(Ordering::Acquire);
    // SAFETY: a published Job is leaked (never freed) for the process's life.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// Which job's ledger.
#[derive(Clone, Copy, Debug)]
pub enum Ledger<'a> {
    /// `CUDABUDGET_SCOPE=job:<name>`.
    Named(&'a str),
    /// HAMi's `CUDA_DEVICE_MEMORY_SHARED_CACHE` path.
    Hami(&'a str),
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

/// The places a ledger may be, best first: (directory, file name) or why a place is
/// unusable. The user's own directories are made where missing.
fn places(ledger: Ledger<'_>, roots: &[PathBuf]) -> Vec<Result<(Dir, String), PlaceError>> {
    places_in(ledger, roots, true)
}

/// The places where the job's ledger exists now, best first; nothing is created (a
/// process joins a ledger wherever one exists before making one, so that one job never
/// gets two ledgers).
fn existing(ledger: Ledger<'_>, roots: &[PathBuf]) -> Vec<(Dir, String)> {
    places_in(ledger, roots, false)
        .into_iter()
        .filter_map(Result::ok)
        .filter(|(d, name)| d.stat_at(name).is_ok())
        .collect()
}

/// [`places`], making the user's own directories only when `make` is set.
fn places_in(
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

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
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
                    if let Some(fd) = &job.alive_fd {
                        ALIVE_FD.store(fd.as_raw_fd(), Ordering::Release);
                    }
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

/// Opens the job's ledger: one that exists in any of the places first, else a new one
/// in the first place that works. `None`: no place works (what was in the way is in
/// `in_the_way`); `Err`: the ledger (path) cannot be used (why).
fn open_ledger(
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

enum Failed {
    /// This place cannot hold the ledger: try the next.
    Place(PlaceError),
    /// The ledger is there and cannot be used.
    Refused(String, String),
}

const RW: FileOpen = FileOpen {
    access: Access::ReadWrite,
    create: Create::No,
    mode: 0,
};
const NEW: FileOpen = FileOpen {
    access: Access::ReadWrite,
    create: Create::New,
    mode: 0o600,
};

/// Opens (or makes) the ledger `name` in `dir` and takes a slot in it.
fn open_in(dir: &Dir, name: &str) -> Result<Job, Failed> {
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
fn create(dir: &Dir, name: &str) -> Result<(), PlaceError> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
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
fn publish(dir: &Dir, tmp: &str, name: &str) -> std::io::Result<()> {
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

fn map(fd: libc::c_int) -> std::io::Result<*mut u8> {
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
const REMOVAL_PATIENCE_MS: u64 = 2000;

/// Takes the shared lock every member holds on the ledger for as long as it is a member
/// (on its own open of the file: a child of `fork()` shares its parent's until it joins
/// with its own). A last member removes the ledger only under the exclusive lock, so
/// never under a member ([`Job::leave`]). False only while a remover holds the file for
/// [`REMOVAL_PATIENCE_MS`]; a file system without locks lets everyone in (and the
/// ledger is then never removed while a slot is claimed).
fn hold_shared(fd: &OwnedFd) -> bool {
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
fn attach(fd: OwnedFd, dir: Dir, name: &str, path: String) -> Result<Job, Failed> {
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

/// What `/proc/<pid>/stat` says of a process.
#[derive(Clone, Copy, Debug)]
struct ProcStat {
    /// Field 3: R, S, D, T, Z, X...
    state: u8,
    /// Field 22: clock ticks since boot.
    start: u64,
}

fn proc_stat(pid: u32) -> Option<ProcStat> {
    let bytes = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&bytes)
}

/// Parses `/proc/<pid>/stat` bytes. The command (field 2) may hold spaces, parentheses
/// and bytes that are not UTF-8 (a name cut to 15 bytes inside a character): the fields
/// are counted from the last `)`, and only they are read (as ASCII).
fn parse_stat(bytes: &[u8]) -> Option<ProcStat> {
    let close = bytes.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&bytes[close + 1..]).ok()?;
    let mut fields = rest.split_ascii_whitespace();
    let state = *fields.next()?.as_bytes().first()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some(ProcStat { state, start })
}

/// The start time of `pid` (clock ticks since boot).
#[cfg(test)]
fn start_time(pid: u32) -> Option<u64> {
    proc_stat(pid).map(|s| s.start)
}

impl Job {
    fn word64(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at.is_multiple_of(8) && at + 8 <= FILE_BYTES);
        // SAFETY: an aligned word inside the FILE_BYTES mapping, which lives as long as
        // the Job (shared memory: reached only through atomics).
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    fn device(&self, device: usize) -> &DeviceWord {
        debug_assert!(device < DEVICES);
        // SAFETY: device < DEVICES: the word lies in the header page of the mapping.
        unsafe { &*(self.base.add(layout::device_words_at(device)) as *const DeviceWord) }
    }

    fn waiter(&self, i: usize) -> &Waiter {
        debug_assert!(i < WAITERS);
        // SAFETY: i < WAITERS: the entry lies in the mapping.
        unsafe { &*(self.base.add(layout::WAITERS_AT + i * layout::WAITER_BYTES) as *const Waiter) }
    }

    fn claim_at(&self, i: usize) -> &Claim {
        debug_assert!(i < SLOTS);
        // SAFETY: i < SLOTS: the claim lies in the mapping.
        unsafe { &*(self.base.add(layout::claim_at(i)) as *const Claim) }
    }

    fn share_at(&self, slot: usize, device: usize) -> &Share {
        debug_assert!(slot < SLOTS && device < DEVICES);
        // SAFETY: both in range: the share lies in the mapping.
        unsafe { &*(self.base.add(layout::share_at(slot, device)) as *const Share) }
    }

    /// Where the ledger is, for messages.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// What is wrong with the header now, if anything.
    fn header_problem(&self) -> Option<String> {
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

    fn mark_damaged(&self, why: String) {
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

    /// Who holds slot `i`, by its words.
    fn holder(&self, i: usize) -> Holder {
        let c = self.claim_at(i);
        let claim = c.claim.load(Ordering::Acquire);
        let start = c.start.load(Ordering::Acquire);
        let fd = c.fd.load(Ordering::Acquire);
        if c.seal.load(Ordering::Acquire) != seal(claim, start, fd) {
            Holder::Garbled
        } else if claim & TOMB == TOMB {
            Holder::Tomb(claim as u32)
        } else if claim == 0 {
            Holder::Free
        } else {
            Holder::Member { claim, start, fd }
        }
    }

    /// Takes a free slot for `pid` (started at `start`): its claim and generation.
    fn claim_slot(&self, pid: u32, start: u64) -> Option<(usize, u64)> {
        let fd = self.fd.as_raw_fd() as u32;
        (0..SLOTS).find_map(|i| {
            let c = self.claim_at(i);
            if self.holder(i) != Holder::Free {
                return None;
            }
            // The slot's lock before its claim: a claim whose lock is free is dead.
            let locked = match &self.alive_fd {
                Some(alive) => match liveness::take(alive.as_fd(), i) {
                    liveness::Taken::Yes => true,
                    // Another process is taking this slot (or a child of a dead member
                    // still holds it open): another slot.
                    liveness::Taken::Held => return None,
                    liveness::Taken::Unsupported => false,
                },
                None => false,
            };
            let generation = c
                .generation
                .fetch_add(1, Ordering::AcqRel)
                .wrapping_add(1)
                .max(1);
            let claim = u64::from(pid) | (u64::from(generation) << 32);
            if c.claim
                .compare_exchange(0, claim, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                if let (true, Some(alive)) = (locked, &self.alive_fd) {
                    liveness::release(alive.as_fd(), i);
                }
                return None;
            }
            c.fd.store(fd, Ordering::Release);
            c.start.store(start, Ordering::Release);
            c.seal.store(seal(claim, start, fd), Ordering::Release);
            for d in 0..DEVICES {
                let s = self.share_at(i, d);
                s.used.store(0, Ordering::SeqCst);
                s.inv.store(!0, Ordering::SeqCst);
            }
            Some((i, claim))
        })
    }

    /// Slot `i`'s share on `device`, read conservatively (the larger of its two words).
    fn share_of(&self, i: usize, device: usize) -> u64 {
        let s = self.share_at(i, device);
        layout::share_value(s.used.load(Ordering::SeqCst), s.inv.load(Ordering::SeqCst))
    }

    /// What the job holds on `device`: the sum of the slots' shares.
    pub fn used(&self, device: usize) -> u64 {
        (0..SLOTS)
            .map(|i| self.share_of(i, device))
            .fold(0u64, u64::saturating_add)
    }

    /// What this process holds on `device`, by its own books (asked by the tests).
    #[cfg(test)]
    pub fn own(&self, device: usize) -> u64 {
        self.mine[device].load(Ordering::Acquire)
    }

    /// Changes what this process holds on `device` by `f` and writes it to its slot
    /// (restoring the slot if something else wrote there). Never waits for another
    /// process. Returns (before, after).
    fn update(&self, device: usize, f: impl FnOnce(u64) -> Option<u64>) -> Option<(u64, u64)> {
        let _w = self.writing.lock();
        let old = self.mine[device].load(Ordering::Relaxed);
        let new = f(old)?;
        self.mine[device].store(new, Ordering::Relaxed);
        match self.holder(self.slot) {
            Holder::Member { claim, start, fd }
                if (claim, start, fd) == (self.claim, self.start, self.fdno) => {}
            Holder::Member { .. } | Holder::Tomb(_) => {
                // Another process holds the slot now (or is taking it): our books are
                // gone from the job.
                self.mark_damaged("this process's slot was taken by another".to_string());
                return Some((old, new));
            }
            Holder::Free | Holder::Garbled => {
                // A stray write: our slot is restored, but only from our claim or a free
                // one (compare-exchange): a newcomer's claim being written is not ours.
                let c = self.claim_at(self.slot);
                let now = c.claim.load(Ordering::Acquire);
                let ours = now == self.claim
                    || (now == 0
                        && c.claim
                            .compare_exchange(0, self.claim, Ordering::AcqRel, Ordering::Relaxed)
                            .is_ok());
                if !ours {
                    self.mark_damaged("this process's slot was taken by another".to_string());
                    return Some((old, new));
                }
                c.fd.store(self.fdno, Ordering::Release);
                c.start.store(self.start, Ordering::Release);
                c.seal
                    .store(seal(self.claim, self.start, self.fdno), Ordering::Release);
            }
        }
        let s = self.share_at(self.slot, device);
        s.used.store(new, Ordering::SeqCst);
        s.inv.store(!new, Ordering::SeqCst);
        Some((old, new))
    }

    /// Takes `device`'s admission lock (it only orders admitters; see the module doc).
    fn lock(&self, device: usize) -> AdmitGuard<'_> {
        static TAGS: AtomicU32 = AtomicU32::new(0);
        thread_local! {
            static TAG: u64 = u64::from(TAGS.fetch_add(1, Ordering::Relaxed) & 0xFFFF) << 16;
        }
        let me = self.lock_id | TAG.with(|t| *t);
        let word = &self.device(device).lock;
        let began = Instant::now();
        let mut tries = 0u32;
        loop {
            let held = word.load(Ordering::Acquire);
            if held == 0 {
                if word
                    .compare_exchange(0, me, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    return AdmitGuard { word, me };
                }
                continue;
            }
            let waited = began.elapsed();
            let take = !self.names_a_claim(held)
                || waited >= Duration::from_millis(LOCK_PATIENCE_MS)
                || (waited >= Duration::from_millis(1) && !self.holder_alive(held));
            if take
                && word
                    .compare_exchange(held, me, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                return AdmitGuard { word, me };
            }
            tries = tries.saturating_add(1);
            if tries < 64 {
                std::hint::spin_loop();
            } else if tries < 128 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Whether lock word `held` names a slot's current claim.
    fn names_a_claim(&self, held: u64) -> bool {
        let slot = (held & 0xFFFF) as usize;
        if slot == 0 || slot > SLOTS {
            return false;
        }
        match self.holder(slot - 1) {
            Holder::Member { claim, .. } => claim >> 32 == held >> 32,
            // Being written: given the benefit of the doubt (bounded anyway).
            Holder::Garbled => true,
            Holder::Free | Holder::Tomb(_) => false,
        }
    }

    fn holder_alive(&self, held: u64) -> bool {
        let slot = (held & 0xFFFF) as usize - 1;
        match self.holder(slot) {
            Holder::Member { claim, start, fd } => self.alive(slot, claim as u32, start, fd),
            _ => true,
        }
    }

    /// Admits `bytes` on `device` for this process if the job stays within `budget`;
    /// `Err` is what the job holds (without them).
    pub fn reserve(&self, device: usize, bytes: u64, budget: u64) -> Result<(), u64> {
        if self.is_damaged() {
            return Err(self.used(device));
        }
        self.maybe_reclaim();
        match self.try_reserve(device, bytes, budget) {
            Ok(()) => Ok(()),
            Err(_) => {
                // Before denying: dead processes' shares go back first.
                self.reclaim_dead();
                self.try_reserve(device, bytes, budget)
            }
        }
    }

    fn try_reserve(&self, device: usize, bytes: u64, budget: u64) -> Result<(), u64> {
        let guard = self.lock(device);
        if self.update(device, |own| own.checked_add(bytes)).is_none() {
            return Err(self.used(device));
        }
        let budget = self.budget(device).unwrap_or(budget);
        let sum = self.used(device);
        if sum <= budget && !self.damaged.load(Ordering::Acquire) {
            drop(guard);
            return Ok(());
        }
        self.update(device, |own| Some(own.saturating_sub(bytes)));
        drop(guard);
        self.wake(device);
        Err(sum.saturating_sub(bytes))
    }

    /// The job's budget on `device`, once a member or an operator set it: what every
    /// admission of the job is measured against (`cudabudget limit --job`).
    pub fn budget(&self, device: usize) -> Option<u64> {
        let at = layout::budget_at(device);
        layout::decode_budget(
            self.word64(at).load(Ordering::Acquire),
            self.word64(at + 8).load(Ordering::Acquire),
        )
    }

    /// Makes `mine` the job's budget on `device` unless one is set: the first member's
    /// variables set it. Returns the budget in force.
    pub fn adopt_budget(&self, device: usize, mine: u64) -> u64 {
        let at = layout::budget_at(device);
        let word = layout::encode_budget(mine);
        if self.budget(device).is_none()
            && self
                .word64(at)
                .compare_exchange(0, word, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.word64(at + 8).store(!word, Ordering::Release);
        }
        // Another member may be writing its word's complement: a moment later it agrees.
        for _ in 0..100 {
            if let Some(budget) = self.budget(device) {
                return budget;
            }
            if self.word64(at).load(Ordering::Acquire) == 0 {
                break;
            }
            std::thread::yield_now();
        }
        mine
    }

    /// Bumped at each change of the job's budget, on any device.
    pub fn budget_generation(&self) -> u64 {
        self.word64(layout::BUDGET_GENERATION_AT)
            .load(Ordering::Acquire)
    }

    /// Who made the last change of the job's budget: (uid, pid).
    pub fn budget_changed_by(&self) -> (u32, u32) {
        let by = self.word64(layout::BUDGET_BY_AT).load(Ordering::Acquire);
        ((by >> 32) as u32, by as u32)
    }

    /// Charges `bytes` whatever the budget says (memory the driver already handed out).
    pub fn charge(&self, device: usize, bytes: u64) {
        self.update(device, |own| Some(own.saturating_add(bytes)));
    }

    /// Gives back `bytes` of this process's share (never more than it holds).
    pub fn release(&self, device: usize, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.update(device, |own| Some(own.saturating_sub(bytes)));
        self.wake(device);
    }

    /// Sets what this process holds on `device` to `bytes` (its books were cleared).
    pub fn set_own(&self, device: usize, bytes: u64) {
        if let Some((old, new)) = self.update(device, |_| Some(bytes))
            && new < old
        {
            self.wake(device);
        }
    }

    /// Wakes whoever waits for room on `device` (a futex on the shared word).
    fn wake(&self, device: usize) {
        let word = self.device(device);
        word.wake.fetch_add(1, Ordering::Release);
        if word.waiters.load(Ordering::Acquire) != 0 {
            futex::wake_all(&word.wake);
        }
    }

    /// Looks for dead processes at most once a second (whoever comes first).
    fn maybe_reclaim(&self) {
        let last_scan = self.word64(LAST_SCAN_AT);
        let now = monotonic_ms();
        let last = last_scan.load(Ordering::Relaxed);
        // A time in the future is a stray write: due now.
        if (now.saturating_sub(last) >= SCAN_EVERY_MS || last > now)
            && last_scan
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            self.reclaim_dead();
        }
    }

    /// Gives back the share of every process of the job that is gone; cleans what a
    /// stray write left in free slots and the queue; checks the file's size.
    pub fn reclaim_dead(&self) {
        // Only while the descriptor is still the ledger (the program may have closed it
        // and its number may be another file now).
        if let Ok(st) = place::fstat(std::os::fd::AsFd::as_fd(&self.fd))
            && (st.st_dev, st.st_ino) == (self.dev, self.ino)
            && st.st_size as usize != FILE_BYTES
        {
            self.mark_damaged(format!("it is {} bytes, not {FILE_BYTES}", st.st_size));
        }
        for i in 0..SLOTS {
            if i == self.slot {
                continue;
            }
            let holder = self.holder(i);
            if !matches!(holder, Holder::Tomb(_) | Holder::Garbled) {
                self.lingering[i].1.store(0, Ordering::Relaxed);
            }
            match holder {
                Holder::Free => self.clean_free_slot(i),
                Holder::Tomb(_) => {
                    // Being taken out of use: finish it if whoever started has not
                    // finished it for SUSPECT_MS (gone or stopped; its pid is not asked:
                    // it may name another process in this PID namespace).
                    let claim = self.claim_at(i).claim.load(Ordering::Acquire);
                    if self.lingered(i, claim) {
                        self.free_slot(i, claim);
                    }
                }
                Holder::Member { claim, start, fd } => {
                    if !self.alive(i, claim as u32, start, fd) {
                        self.free_slot(i, claim);
                    }
                }
                // Left counted (fail closed) while its claim's process lives: its owner
                // restores it at its next call. A process that died between its claim
                // and its seal (or a tombstone never finished) is cleaned after
                // SUSPECT_MS.
                Holder::Garbled => {
                    let c = self.claim_at(i);
                    let claim = c.claim.load(Ordering::Acquire);
                    let start = c.start.load(Ordering::Acquire);
                    let gone = claim & TOMB == TOMB
                        || (self.lock_held(i) != Some(true) && {
                            let pid = claim as u32;
                            pid == 0
                                || match proc_stat(pid) {
                                    None => !pid_exists(pid),
                                    Some(st) => {
                                        matches!(st.state, b'Z' | b'X')
                                            || (start != 0 && st.start != start)
                                    }
                                }
                        });
                    if !gone {
                        self.lingering[i].1.store(0, Ordering::Relaxed);
                    } else if self.lingered(i, claim) {
                        self.free_slot(i, claim);
                    }
                }
            }
        }
        for w in 0..WAITERS {
            let e = self.waiter(w);
            let ticket = e.ticket.load(Ordering::Acquire);
            if ticket == 0 {
                continue;
            }
            let slot = e.slot.load(Ordering::Acquire) as usize;
            let claim = e.claim.load(Ordering::Acquire);
            if slot >= SLOTS || self.claim_at(slot).claim.load(Ordering::Acquire) != claim {
                let _ = e
                    .ticket
                    .compare_exchange(ticket, 0, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }

    /// Whether this process has seen claim `claim` linger in slot `i` (garbled, or a
    /// tombstone) for [`SUSPECT_MS`]; starts the count when it is new.
    fn lingered(&self, i: usize, claim: u64) -> bool {
        let (seen, since) = &self.lingering[i];
        let now = monotonic_ms().max(1);
        if seen.swap(claim, Ordering::Relaxed) != claim || since.load(Ordering::Relaxed) == 0 {
            since.store(now, Ordering::Relaxed);
            return false;
        }
        now.saturating_sub(since.load(Ordering::Relaxed)) >= SUSPECT_MS
    }

    /// A free slot must hold (0, !0) on every device; anything else (a stray write)
    /// counts against the job (fail closed). It may also be a live member whose claim a
    /// stray write wiped, which restores its slot at its next call: so it is cleaned only
    /// once this process has seen it so for [`SUSPECT_MS`].
    fn clean_free_slot(&self, i: usize) {
        let garbage = (0..DEVICES).any(|d| {
            let s = self.share_at(i, d);
            (s.used.load(Ordering::SeqCst), s.inv.load(Ordering::SeqCst)) != (0, !0)
        });
        let suspect = &self.suspects[i];
        if !garbage {
            suspect.store(0, Ordering::Relaxed);
            return;
        }
        let now = monotonic_ms().max(1);
        let since = suspect.load(Ordering::Relaxed);
        if since == 0 {
            suspect.store(now, Ordering::Relaxed);
            return;
        }
        if now.saturating_sub(since) < SUSPECT_MS {
            return;
        }
        suspect.store(0, Ordering::Relaxed);
        for d in 0..DEVICES {
            let s = self.share_at(i, d);
            let (used, inv) = (s.used.load(Ordering::SeqCst), s.inv.load(Ordering::SeqCst));
            if (used, inv) != (0, !0) && self.claim_at(i).claim.load(Ordering::SeqCst) == 0 {
                let _ = s
                    .used
                    .compare_exchange(used, 0, Ordering::SeqCst, Ordering::Relaxed);
                let _ = s
                    .inv
                    .compare_exchange(inv, !0, Ordering::SeqCst, Ordering::Relaxed);
                self.wake(d);
            }
        }
    }

    /// Takes slot `i` (claim `claim`) out of use: its shares go back, it is free again.
    /// A tombstone first, so that only one process cleans it and never a new owner's.
    fn free_slot(&self, i: usize, claim: u64) {
        let c = self.claim_at(i);
        let tomb = TOMB | u64::from(std::process::id());
        let (start, fd) = (
            c.start.load(Ordering::Acquire),
            c.fd.load(Ordering::Acquire),
        );
        if c.claim
            .compare_exchange(claim, tomb, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        c.seal.store(seal(tomb, start, fd), Ordering::Release);
        let mut freed = [false; DEVICES];
        for (d, freed) in freed.iter_mut().enumerate() {
            let s = self.share_at(i, d);
            *freed = s.used.load(Ordering::Relaxed) != 0 || s.inv.load(Ordering::Relaxed) != !0;
            s.used.store(0, Ordering::SeqCst);
            s.inv.store(!0, Ordering::SeqCst);
        }
        c.start.store(0, Ordering::Release);
        c.fd.store(0, Ordering::Release);
        c.claim.store(0, Ordering::Release);
        c.seal.store(!0, Ordering::Release);
        for (d, freed) in freed.into_iter().enumerate() {
            if freed {
                self.wake(d);
            }
        }
    }

    /// Whether the member `pid` (started at `start`, keeping the ledger open as `fd`)
    /// is still the process that joined: not gone, not another process with its pid, not
    /// a zombie, and not another program (exec) — it still has the ledger open or mapped.
    fn alive(&self, slot: usize, pid: u32, start: u64, fd: u32) -> bool {
        if pid == 0 {
            return false;
        }
        if self.lock_held(slot) == Some(true) {
            return true;
        }
        let Some(stat) = proc_stat(pid) else {
            // No /proc entry: gone (or /proc hides it: ask the kernel).
            return pid_exists(pid) && std::fs::metadata("/proc/self").is_err();
        };
        if matches!(stat.state, b'Z' | b'X') {
            return false;
        }
        if start == 0 {
            // Joining: its start time is not written yet.
            return true;
        }
        if stat.start != start {
            return false;
        }
        // Exec'd? The descriptor it keeps (close-on-exec) is the ledger...
        if let Ok(m) = std::fs::metadata(format!("/proc/{pid}/fd/{fd}")) {
            use std::os::unix::fs::MetadataExt;
            if m.dev() == self.dev && m.ino() == self.ino {
                return true;
            }
        }
        // ... or, if it closed it, the file is still mapped.
        // (Bytes: a mapped file's name need not be UTF-8.)
        match std::fs::read(format!("/proc/{pid}/maps")) {
            Ok(maps) => maps_ledger(&String::from_utf8_lossy(&maps), self.dev, self.ino),
            // Cannot look (another user's, not dumpable): alive.
            Err(_) => true,
        }
    }

    /// Whether slot `i`'s [`liveness`] lock is held by some open of the ledger other than
    /// our main one (`None`: cannot tell, or our descriptor is no longer the ledger).
    fn lock_held(&self, i: usize) -> Option<bool> {
        if !self.is_still_the_ledger() {
            return None;
        }
        liveness::held(self.fd.as_fd(), i)
    }

    /// A second open of the ledger (its own open file description, close-on-exec), for
    /// our slot's [`liveness`] lock; `None` if the name is no longer this file.
    fn second_open(&self) -> Option<OwnedFd> {
        let file = self.dir.open_file(&self.name, RW).ok()?;
        let st = place::fstat(file.as_fd()).ok()?;
        ((st.st_dev, st.st_ino) == (self.dev, self.ino)).then(|| OwnedFd::from(file))
    }

    /// The process is leaving (exit): its share goes back, its slot is free.
    pub fn leave(&self) {
        let _w = self.writing.lock();
        // Only while the slot holds our claim (leave may run twice, and the slot may be a
        // newcomer's by then, its claim half written).
        if self.claim == 0 || self.claim_at(self.slot).claim.load(Ordering::Acquire) != self.claim {
            return;
        }
        for d in 0..DEVICES {
            if self.mine[d].swap(0, Ordering::AcqRel) != 0 {
                let s = self.share_at(self.slot, d);
                s.used.store(0, Ordering::SeqCst);
                s.inv.store(!0, Ordering::SeqCst);
                self.wake(d);
            }
        }
        // Through a tombstone (compare-exchange from our claim), as any slot is freed;
        // then the slot's lock (a claim without its lock is dead, never the reverse).
        self.free_slot(self.slot, self.claim);
        if let Some(alive) = &self.alive_fd {
            liveness::release(alive.as_fd(), self.slot);
        }
        if let Some(i) = self.mapping {
            MAPPED[i].slot.store(0, Ordering::Release);
        }
        self.remove_if_last();
    }

    /// Removes the ledger when this process was its last member: under the exclusive
    /// lock (no other open of the file holds the members' shared lock), with every slot
    /// free once the dead are cleaned, and only while the name is still this file. A
    /// joiner that opened the file meanwhile waits for the lock, sees the file unlinked
    /// and makes a new one ([`open_in`]). A damaged ledger stays for its operator.
    fn remove_if_last(&self) {
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
    fn is_still_the_ledger(&self) -> bool {
        place::fstat(std::os::fd::AsFd::as_fd(&self.fd))
            .is_ok_and(|st| (st.st_dev, st.st_ino) == (self.dev, self.ino))
    }

    /// The job's largest holders on `device`: up to five `(pid, bytes)`, largest first
    /// (`(0, 0)` past the end). No allocation: for the denial events.
    pub fn top_holders(&self, device: usize) -> [(u32, u64); 5] {
        let mut top = [(0u32, 0u64); 5];
        for i in 0..SLOTS {
            let claim = self.claim_at(i).claim.load(Ordering::Acquire);
            let used = self.share_of(i, device);
            if claim == 0 || claim & TOMB == TOMB || used == 0 || used <= top[4].1 {
                continue;
            }
            top[4] = (claim as u32, used);
            top.sort_by_key(|h| std::cmp::Reverse(h.1));
        }
        top
    }

    /// Processes in the job now (claimed slots), for the tests.
    #[cfg(test)]
    pub fn members(&self) -> usize {
        (0..SLOTS)
            .filter(|&i| {
                let claim = self.claim_at(i).claim.load(Ordering::Acquire);
                layout::is_member(claim)
            })
            .count()
    }

    /// A place in `device`'s queue of waiters, in arrival order; leaving it (drop) lets
    /// the next one go.
    pub fn queue(&self, device: usize) -> Turn<'_> {
        let word = self.device(device);
        let ticket = word
            .next_ticket
            .fetch_add(1, Ordering::AcqRel)
            .wrapping_add(1)
            .max(1);
        let entry = (0..WAITERS).find(|&i| {
            let e = self.waiter(i);
            e.ticket.load(Ordering::Relaxed) == 0
                && e.ticket
                    .compare_exchange(0, ticket, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
        });
        if let Some(i) = entry {
            let e = self.waiter(i);
            e.claim.store(self.claim, Ordering::Release);
            e.device.store(device as u32, Ordering::Release);
            e.slot.store(self.slot as u32, Ordering::Release);
            e.beat.store(monotonic_ms(), Ordering::Release);
        }
        let _ = word
            .waiters
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                Some(n.saturating_add(1))
            });
        Turn {
            job: self,
            device,
            entry,
            ticket,
        }
    }
}

/// Whether `/proc/<pid>/maps` text maps the file (`dev`, `ino`).
fn maps_ledger(maps: &str, dev: u64, ino: u64) -> bool {
    let want_dev = format!("{:02x}:{:02x}", libc::major(dev), libc::minor(dev));
    let want_ino = ino.to_string();
    maps.lines().any(|line| {
        let mut f = line.split_ascii_whitespace();
        f.nth(3) == Some(want_dev.as_str()) && f.next() == Some(want_ino.as_str())
    })
}

fn pid_exists(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// A device's admission lock, held (or taken over from a holder that lost it).
struct AdmitGuard<'a> {
    word: &'a AtomicU64,
    me: u64,
}

impl Drop for AdmitGuard<'_> {
    fn drop(&mut self) {
        // Only if still ours: a holder that was taken over from frees nobody else's.
        let _ = self
            .word
            .compare_exchange(self.me, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// A thread's place in a device's queue of waiters.
pub struct Turn<'a> {
    job: &'a Job,
    device: usize,
    entry: Option<usize>,
    ticket: u64,
}

impl Turn<'_> {
    /// Whether no live waiter with a fresh heartbeat came before this one.
    fn first(&self, now: u64) -> bool {
        let Some(mine) = self.entry else {
            return true;
        };
        let job = self.job;
        (0..WAITERS).all(|i| {
            if i == mine {
                return true;
            }
            let e = job.waiter(i);
            let ticket = e.ticket.load(Ordering::Acquire);
            if ticket == 0 || ticket >= self.ticket {
                return true;
            }
            let beat = e.beat.load(Ordering::Acquire);
            let slot = e.slot.load(Ordering::Acquire) as usize;
            let live = e.device.load(Ordering::Acquire) as usize == self.device
                && beat <= now.saturating_add(1000)
                && now.saturating_sub(beat) <= TURN_STALE_MS
                && slot < SLOTS
                && job.claim_at(slot).claim.load(Ordering::Acquire)
                    == e.claim.load(Ordering::Acquire);
            !live
        })
    }

    /// Waits (until `deadline`) until this waiter is first and the device has room for
    /// `bytes` under `budget`. True: try now.
    pub fn wait_for_room(&self, bytes: u64, budget: u64, deadline: Instant) -> bool {
        let job = self.job;
        let word = job.device(self.device);
        loop {
            if job.is_damaged() {
                return false;
            }
            let seen = word.wake.load(Ordering::Acquire);
            let now_ms = monotonic_ms();
            if let Some(i) = self.entry {
                job.waiter(i).beat.store(now_ms, Ordering::Release);
            }
            let budget = job.budget(self.device).unwrap_or(budget);
            if self.first(now_ms) && job.used(self.device).saturating_add(bytes) <= budget {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            // Woken by any free in the job; at the latest every NAP_MS, to beat and to
            // look for dead processes (their share is given back by whoever finds them).
            let nap = (deadline - now).min(Duration::from_millis(NAP_MS));
            futex::wait(&word.wake, seen, nap);
            job.maybe_reclaim();
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if let Some(i) = self.entry {
            let _ = self.job.waiter(i).ticket.compare_exchange(
                self.ticket,
                0,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
        let _ = self.job.device(self.device).waiters.fetch_update(
            Ordering::AcqRel,
            Ordering::Relaxed,
            |n| Some(n.saturating_sub(1)),
        );
        // The next in line may go now.
        self.job.wake(self.device);
    }
}

/// In the child of `fork()`: the child is not the parent's member of the job.
pub fn after_fork() {
    JOINED.store(std::ptr::null_mut(), Ordering::Release);
    let alive = ALIVE_FD.swap(-1, Ordering::AcqRel);
    if alive >= 0 {
        // SAFETY: the child's copy of the parent's lock descriptor, used by nothing in
        // the child (its Job is the parent's, no longer reachable); close is
        // async-signal-safe. The parent's open keeps its lock.
        unsafe { libc::close(alive) };
    }
}

#[cfg(test)]
mod tests;
