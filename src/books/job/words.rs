//! The words of a job's ledger as this process maps them (the layout is
//! [`cudabudget_spec::job_file`]'s), and the [`Job`] that holds the mapping.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};

use cudabudget_spec::job_file as layout;
use cudabudget_spec::place::Dir;

use crate::sys::lock::Lock;

/// Processes a job holds at once.
pub const SLOTS: usize = layout::SLOTS;
pub(super) const DEVICES: usize = layout::DEVICES;
pub(super) const WAITERS: usize = layout::WAITERS;
pub(super) const FILE_BYTES: usize = layout::FILE_BYTES;

/// How long an admitter waits for a live holder of a device's admission lock.
pub const LOCK_PATIENCE_MS: u64 = 50;
/// A waiter whose heartbeat is older than this has lost its turn.
pub const TURN_STALE_MS: u64 = 100;
/// The longest a waiter sleeps between heartbeats.
pub const NAP_MS: u64 = 40;
/// How often (at most) a member looks for dead ones.
pub(super) const SCAN_EVERY_MS: u64 = 1000;
/// How long a free slot must hold what a free slot never holds before it is cleaned.
pub(super) const SUSPECT_MS: u64 = 1000;

#[repr(C)]
pub(super) struct DeviceWord {
    /// 0: free; else the holder: slot + 1 (low 16 bits), a thread tag (next 16), the
    /// holder's claim generation (high 32).
    pub(super) lock: AtomicU64,
    /// The next ticket of the device's queue of waiters.
    pub(super) next_ticket: AtomicU64,
    /// Bumped on every free (a futex word): waiters sleep on it.
    pub(super) wake: AtomicU32,
    /// Threads waiting for room on the device (a hint: wakes are skipped while 0).
    pub(super) waiters: AtomicU32,
    pub(super) _pad: u64,
}

const _: () = assert!(std::mem::offset_of!(DeviceWord, wake) == layout::WAKE_IN_DEVICE_WORD);

#[repr(C)]
pub(super) struct Waiter {
    /// 0: a free entry.
    pub(super) ticket: AtomicU64,
    /// The claim of the waiting thread's slot.
    pub(super) claim: AtomicU64,
    pub(super) device: AtomicU32,
    pub(super) slot: AtomicU32,
    /// When the waiter last showed it is there (ms, CLOCK_MONOTONIC).
    pub(super) beat: AtomicU64,
}

#[repr(C)]
pub(super) struct Claim {
    /// 0: free; pid (low 32 bits) and generation (high 32); or a tombstone.
    pub(super) claim: AtomicU64,
    /// The process's start time (`/proc/<pid>/stat` field 22); 0 while it joins.
    pub(super) start: AtomicU64,
    /// The descriptor the process keeps the ledger open with (close-on-exec).
    pub(super) fd: AtomicU32,
    /// Bumped at each claim: the generation the next claim gets.
    pub(super) generation: AtomicU32,
    /// [`seal`] of the claim, start time and descriptor: a slot whose seal does not match
    /// was written by something else, and is neither free nor judged dead.
    pub(super) seal: AtomicU64,
}

/// The seal of a slot's claim, start time and descriptor (a free slot: all zero, seal
/// `!0`).
pub(super) fn seal(claim: u64, start: u64, fd: u32) -> u64 {
    !(claim ^ start.rotate_left(17) ^ u64::from(fd))
}

/// Who holds a slot, by its words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Holder {
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
pub(super) struct Share {
    pub(super) used: AtomicU64,
    /// `!used`.
    pub(super) inv: AtomicU64,
}

const _: () = {
    assert!(std::mem::size_of::<DeviceWord>() == layout::DEVICE_WORD_BYTES);
    assert!(std::mem::size_of::<Waiter>() == layout::WAITER_BYTES);
    assert!(std::mem::size_of::<Claim>() == layout::CLAIM_BYTES);
    assert!(std::mem::size_of::<Share>() == layout::SHARE_BYTES);
};

pub(super) const LAST_SCAN_AT: usize = 64;

// ---------------------------------------------------------------------------------------
// The job.

/// A job this process has joined: the mapping, its own slot, and the truth of what it
/// holds.
pub struct Job {
    pub(super) base: *mut u8,
    pub(super) slot: usize,
    /// Our claim word (pid and generation), start time and descriptor, as in our slot.
    pub(super) claim: u64,
    pub(super) start: u64,
    pub(super) fdno: u32,
    /// Our thread-independent lock tag base (slot + 1 and generation).
    pub(super) lock_id: u64,
    pub(super) path: String,
    /// The directory that names the ledger, and the name (to remove it when the last
    /// member leaves).
    pub(super) dir: Dir,
    pub(super) name: String,
    pub(super) dev: u64,
    pub(super) ino: u64,
    pub(super) fd: OwnedFd,
    /// Our own open of the ledger that holds our slot's [`liveness`] lock (none where
    /// the file cannot be opened again or has no such locks).
    pub(super) alive_fd: Option<OwnedFd>,
    /// Index in [`MAPPED`], if the mapping is watched for SIGBUS.
    pub(super) mapping: Option<usize>,
    /// What this process holds per device: the truth its slot is written from.
    pub(super) mine: [AtomicU64; DEVICES],
    /// One thread of the process writes the slot at a time.
    pub(super) writing: Lock<()>,
    /// Set once the job is found damaged (also in [`MAPPED`]).
    pub(super) damaged: AtomicBool,
    /// Why, for the one line the user gets (taken once by [`Job::damage_news`]).
    pub(super) damage_said: AtomicBool,
    pub(super) damage_why: Lock<Option<String>>,
    /// Per slot: since when this process has seen stray bytes in it while free (ms).
    pub(super) suspects: [AtomicU64; SLOTS],
    /// Per slot: the garbled or tombstone claim this process last saw there, and since
    /// when (ms).
    pub(super) lingering: [(AtomicU64, AtomicU64); SLOTS],
}

// SAFETY: the mapping is shared memory reached only through atomics.
unsafe impl Send for Job {}
// SAFETY: as above.
unsafe impl Sync for Job {}

impl Job {
    pub(super) fn word64(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at.is_multiple_of(8) && at + 8 <= FILE_BYTES);
        // SAFETY: an aligned word inside the FILE_BYTES mapping, which lives as long as
        // the Job (shared memory: reached only through atomics).
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    pub(super) fn device(&self, device: usize) -> &DeviceWord {
        debug_assert!(device < DEVICES);
        // SAFETY: device < DEVICES: the word lies in the header page of the mapping.
        unsafe { &*(self.base.add(layout::device_words_at(device)) as *const DeviceWord) }
    }

    pub(super) fn waiter(&self, i: usize) -> &Waiter {
        debug_assert!(i < WAITERS);
        // SAFETY: i < WAITERS: the entry lies in the mapping.
        unsafe { &*(self.base.add(layout::WAITERS_AT + i * layout::WAITER_BYTES) as *const Waiter) }
    }

    pub(super) fn claim_at(&self, i: usize) -> &Claim {
        debug_assert!(i < SLOTS);
        // SAFETY: i < SLOTS: the claim lies in the mapping.
        unsafe { &*(self.base.add(layout::claim_at(i)) as *const Claim) }
    }

    pub(super) fn share_at(&self, slot: usize, device: usize) -> &Share {
        debug_assert!(slot < SLOTS && device < DEVICES);
        // SAFETY: both in range: the share lies in the mapping.
        unsafe { &*(self.base.add(layout::share_at(slot, device)) as *const Share) }
    }

    /// Where the ledger is, for messages.
    pub fn path(&self) -> &str {
        &self.path
    }
}
