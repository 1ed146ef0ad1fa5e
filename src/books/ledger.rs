//! The ledger: what each device's budget is, what the process holds on it, and which
//! pointer holds how much.
//!
//! A device's budget is a [`Budget`]: bytes, none, or not worked out yet; which one is
//! the ledger's own encoding and never leaves it. In a job, the device's books are also
//! the job's ([`crate::books::job`]): a reservation must fit the job's budget too.
//!
//! Pure and thread-safe; it never calls the driver. Admission is a reservation taken
//! atomically *before* the real call ([`DeviceLedger::reserve`]): two threads racing for
//! the last bytes can never both pass. The reservation is committed when the driver
//! succeeds and rolled back when it fails. Counters never go below zero: a release of
//! more than is held stops at zero.
//!
//! Stream-ordered allocations are not charged one by one: what they cost the device is
//! the pools' reserve, which the hooks charge through [`PoolCredit`] (see there).
//!
//! The hot paths (an allocation that fits, a free) take no lock and make no system call.
//! A synchronous allocation costs one compare-and-swap on the device's counter (its
//! entry goes to the thread's lane with plain stores, or to the address table with a
//! compare-and-swap), its free one on the entry's slot and one on the counter; a
//! stream-ordered pair that fits in its thread's pool credit costs none while no other
//! thread frees a block of that thread's (see `lanes.rs`).

use std::sync::atomic::{AtomicU64, Ordering};

pub use crate::sys::driver::MAX_DEVICES;

mod addresses;
mod credit;
mod entries;
mod lanes;
mod pointers;

pub use addresses::{AddrTable, Table};
pub use credit::{BankGuard, POOL_SHARDS, PoolCredit, clamp_i64};
pub use entries::{ENTRY_MAX, Entry, Kind, NO_TAG, Packed, direct_tag, pooled_tag};
pub use lanes::{LANES, claim_lane, lane_free, lanes_after_fork, release_lane};
pub use pointers::{OwnRegion, PointerMap};

/// A device's budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budget {
    /// Not worked out yet (a percentage waits for the device's size).
    Unresolved,
    /// The device has no budget: its calls pass through.
    Unbudgeted,
    /// At most this many bytes.
    Bytes(u64),
}

/// How [`DeviceLedger`] keeps a [`Budget`] in one atomic: the two values no budget in
/// bytes takes (a budget is kept below them), each larger than any budget, so that a
/// reservation against either always fits.
const UNBUDGETED: u64 = u64::MAX;
const UNRESOLVED: u64 = u64::MAX - 1;

/// The budget a reservation is measured against, as resolved once for a call
/// ([`DeviceLedger::in_force`], `runtime::Cx::device`): the device's own, or in a job the
/// job's as its ledger says (it may change while the job runs: `cudabudget limit`), with
/// the job's books that the reservation must fit too.
#[derive(Clone, Copy)]
pub struct InForce {
    pub bytes: u64,
    pub job: Option<(&'static crate::books::job::Job, usize)>,
}

/// A refused request, with what the device held and allowed at that moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Denial {
    pub requested: u64,
    pub used: u64,
    pub budget: u64,
}

/// One device's budget and usage. In C's order and aligned to a line, so that what an
/// allocation reads and writes (the budget, the count, the epoch, the job) shares the
/// first cache line (asserted below).
#[repr(C, align(64))]
pub struct DeviceLedger {
    budget: AtomicU64,
    used: AtomicU64,
    /// Which pool credit is good: the high 32 bits count the times the books were
    /// cleared ([`DeviceLedger::clear_after`]: credit from before is void), the next 26 the
    /// times the pools' charge went down ([`DeviceLedger::retire_credit`]: credit a
    /// thread kept from before may be memory the pools no longer hold, so it goes back
    /// to the bank before it is spent), and the lowest [`DEVICE_BITS`] are the device's
    /// index ([`Ledger::new`]), so that no two devices ever share an epoch: credit given
    /// under one is known to be that device's by its epoch alone.
    epoch: AtomicU64,
    /// In a job (`CUDABUDGET_SCOPE=job:…`): the device's index in the job's books
    /// ([`NO_JOB`]: the budget is the process's own).
    job_device: AtomicU64,
    peak: AtomicU64,
    denials: AtomicU64,
    /// Allocations that waited for room (`CUDABUDGET_ON_EXCEED=wait:…`).
    waits: AtomicU64,
    /// Allocations admitted past the budget (`CUDABUDGET_ON_EXCEED=warn`).
    overruns: AtomicU64,
    /// The part of `used` that no hook saw: the context, modules, and whatever the
    /// footprint reconciliation found beyond the tracked allocations.
    overhead: AtomicU64,
    pub pool: PoolCredit,
}

const NO_JOB: u64 = u64::MAX;

/// The low bits of an epoch that name its device.
const DEVICE_BITS: u32 = 6;
const _: () = assert!(MAX_DEVICES <= 1 << DEVICE_BITS);
const _: () = assert!(
    std::mem::offset_of!(DeviceLedger, job_device) + 8 <= 64
        && std::mem::offset_of!(DeviceLedger, epoch) < 64
        && std::mem::offset_of!(DeviceLedger, used) < 64
);

impl DeviceLedger {
    const fn new() -> Self {
        Self {
            budget: AtomicU64::new(UNRESOLVED),
            used: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            denials: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            overruns: AtomicU64::new(0),
            overhead: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            job_device: AtomicU64::new(NO_JOB),
            pool: PoolCredit::new(),
        }
    }

    /// The budget is the job's, on the job's device `index` (the process's ordinal).
    /// Joined before the budget is stored ([`Self::own_budget`]).
    pub fn join_job(&self, index: usize) {
        self.job_device.store(index as u64, Ordering::Release);
    }

    /// The job this device's budget belongs to, with the device's index there.
    #[inline]
    pub fn job(&self) -> Option<(&'static crate::books::job::Job, usize)> {
        let index = self.job_device.load(Ordering::Relaxed);
        if index == NO_JOB {
            return None;
        }
        crate::books::job::joined().map(|job| (job, index as usize))
    }

    /// What counts against the budget: the job's use in a job, else the process's.
    pub fn budget_used(&self) -> u64 {
        match self.job() {
            Some((job, index)) => job.used(index),
            None => self.used(),
        }
    }

    /// The device's budget.
    pub fn budget(&self) -> Budget {
        match self.limit() {
            UNBUDGETED => Budget::Unbudgeted,
            UNRESOLVED => Budget::Unresolved,
            bytes => Budget::Bytes(bytes),
        }
    }

    /// The budget in bytes a request is measured against: for a device without a budget
    /// in bytes ([`Budget::Unbudgeted`], [`Budget::Unresolved`]) more than any request.
    pub fn limit(&self) -> u64 {
        self.budget.load(Ordering::Relaxed)
    }

    pub fn set_budget(&self, budget: Budget) {
        let raw = match budget {
            Budget::Unbudgeted => UNBUDGETED,
            Budget::Unresolved => UNRESOLVED,
            Budget::Bytes(bytes) => bytes.min(UNRESOLVED - 1),
        };
        // Released: whoever sees the budget sees the job the device joined before it
        // ([`Self::own_budget`]).
        self.budget.store(raw, Ordering::Release);
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    pub fn denials(&self) -> u64 {
        self.denials.load(Ordering::Relaxed)
    }

    pub fn overhead(&self) -> u64 {
        self.overhead.load(Ordering::Relaxed)
    }

    /// The budget in force now: in a job, the job's budget as its ledger holds it (it may
    /// change while the job runs), else the device's.
    #[inline]
    pub fn in_force(&self) -> InForce {
        let job = self.job();
        let bytes = match job {
            Some((job, index)) => job.budget(index).unwrap_or_else(|| self.limit()),
            None => self.limit(),
        };
        InForce { bytes, job }
    }

    /// Reserves `bytes` if they fit in `budget` (this device's budget in force, resolved
    /// by the caller: [`Self::in_force`]). Dropping the reservation without
    /// [`Reservation::commit`] gives the bytes back.
    pub fn reserve(&self, bytes: u64, budget: InForce) -> Result<Reservation<'_>, Denial> {
        let InForce { bytes: budget, job } = budget;
        let denial = |used| Denial {
            requested: bytes,
            used,
            budget,
        };
        // The epoch before the bytes: a clear between the two leaves the reservation
        // older than the books, so that it is charged again (never lost) when committed.
        let epoch = self.epoch();
        let after = self.take_within(bytes, budget).map_err(denial)?;
        // In a job the job's total decides, for every process at once.
        if let Some((job, index)) = job
            && let Err(job_used) = job.reserve(index, bytes, budget)
        {
            self.release_own(bytes);
            return Err(denial(job_used));
        }
        Ok(self.reserved(bytes, after, epoch))
    }

    /// [`Self::reserve`] against the device's own budget in bytes, when it has one and
    /// no job shares it (the synchronous fast path: `admit::admitted_at_once`); `None`,
    /// nothing taken, for a device without such a budget or bytes that do not fit.
    #[inline(always)]
    pub fn reserve_own(&self, bytes: u64) -> Option<Reservation<'_>> {
        let budget = self.own_budget()?;
        let epoch = self.epoch();
        let after = self.take_within(bytes, budget).ok()?;
        Some(self.reserved(bytes, after, epoch))
    }

    /// The device's budget in bytes when it is its own: worked out, and no job's
    /// ([`Self::reserve_own`]). Read before the job: a device joins its job before its
    /// budget is stored ([`Self::join_job`], [`Self::set_budget`]).
    #[inline(always)]
    pub fn own_budget(&self) -> Option<u64> {
        let budget = self.budget.load(Ordering::Acquire);
        (budget < UNRESOLVED && self.job_device.load(Ordering::Relaxed) == NO_JOB).then_some(budget)
    }

    /// Adds `bytes` to `used` if the sum stays within `budget`: the sum, or what `used`
    /// was when it did not fit.
    #[inline(always)]
    fn take_within(&self, bytes: u64, budget: u64) -> Result<u64, u64> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let after = match used.checked_add(bytes) {
                Some(after) if after <= budget => after,
                _ => return Err(used),
            };
            match self
                .used
                .compare_exchange_weak(used, after, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Ok(after),
                Err(now) => used = now,
            }
        }
    }

    /// The reservation of `bytes` just taken, which brought `used` to `after`; `epoch`
    /// was read before they were.
    #[inline(always)]
    fn reserved(&self, bytes: u64, after: u64, epoch: u64) -> Reservation<'_> {
        self.note_peak(after);
        Reservation {
            device: self,
            bytes,
            epoch,
        }
    }

    /// Reserves `bytes` whatever the budget says (`CUDABUDGET_ON_EXCEED=warn`: a request
    /// that did not fit is admitted anyway): the books, the job's too, then hold more
    /// than the budget. Rolled back on drop unless committed, as [`Self::reserve`].
    pub fn reserve_past_budget(&self, bytes: u64) -> Reservation<'_> {
        // As in `reserve`: the epoch before the bytes.
        let epoch = self.epoch();
        self.charge(bytes);
        Reservation {
            device: self,
            bytes,
            epoch,
        }
    }

    /// Charges `bytes` whatever the budget says: memory the driver already handed out.
    pub fn charge(&self, bytes: u64) {
        let after = self
            .used
            .fetch_add(bytes, Ordering::AcqRel)
            .saturating_add(bytes);
        self.note_peak(after);
        if let Some((job, index)) = self.job() {
            job.charge(index, bytes);
        }
    }

    /// [`Self::charge`], for a reservation the books lost while the driver allocated
    /// ([`Reservation::commit`]).
    #[cold]
    #[inline(never)]
    fn charge_again(&self, bytes: u64) {
        self.charge(bytes);
    }

    /// Raises the peak; a plain load first, so that threads allocating below the peak
    /// do not all write its cache line.
    fn note_peak(&self, used: u64) {
        if used > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(used, Ordering::Relaxed);
        }
    }

    /// Gives back `bytes`, stopping at zero.
    pub fn release(&self, bytes: u64) {
        let given = self.release_own(bytes);
        if let Some((job, index)) = self.job() {
            job.release(index, given);
        }
        crate::sys::wait::freed();
    }

    /// [`Self::release`] when no job shares the device's books (the synchronous fast
    /// path); false, nothing given, in a job.
    #[inline(always)]
    pub fn release_alone(&self, bytes: u64) -> bool {
        if self.job_device.load(Ordering::Relaxed) != NO_JOB {
            return false;
        }
        self.release_own(bytes);
        crate::sys::wait::freed();
        true
    }

    /// Gives back `bytes` of the process's own use, stopping at zero; returns how much.
    fn release_own(&self, bytes: u64) -> u64 {
        let before = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |u| {
                Some(u.saturating_sub(bytes))
            })
            .unwrap_or(0);
        before.min(bytes)
    }

    /// Records `bytes` as the overhead (the part of `used` no hook saw) and returns what it
    /// was; `used` is not moved: the caller charges the difference
    /// (`admit::after::charge_after`).
    pub fn swap_overhead(&self, bytes: u64) -> u64 {
        self.overhead.swap(bytes, Ordering::AcqRel)
    }

    /// Replaces the overhead charge with `bytes`, moving `used` by the difference.
    #[cfg(test)]
    pub fn set_overhead(&self, bytes: u64) {
        let old = self.swap_overhead(bytes);
        if bytes >= old {
            self.charge(bytes - old);
        } else {
            self.release(old - bytes);
        }
    }

    /// Changes whenever the device's books are cleared or its pools' charge goes down:
    /// credit a thread holds is spendable only while this is what it was given under.
    /// No other device's ever equals it.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Changes only when the device's books are cleared.
    pub fn books_epoch(&self) -> u64 {
        self.epoch() >> 32
    }

    /// Whether credit given under `epoch` belongs to the device's current books (the
    /// pools may have shrunk since; the books were not cleared).
    pub fn same_books(&self, epoch: u64) -> bool {
        epoch >> 32 == self.books_epoch()
    }

    /// The pools' charge went down (a trim, or the driver's figure was lower than ours):
    /// credit that threads kept for themselves stops being spendable as it is.
    pub fn retire_credit(&self) {
        // The low half wraps on its own: it never carries into the books' count, nor
        // touches the device's index below the retirements.
        let _ = self
            .epoch
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |e| {
                Some((e & !0xffff_ffff) | (e.wrapping_add(1 << DEVICE_BITS) & 0xffff_ffff))
            });
    }

    pub fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    pub fn note_wait(&self) {
        self.waits.fetch_add(1, Ordering::Relaxed);
    }

    pub fn note_denial(&self) -> u64 {
        self.denials.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn overruns(&self) -> u64 {
        self.overruns.load(Ordering::Relaxed)
    }

    pub fn note_overrun(&self) {
        self.overruns.fetch_add(1, Ordering::Relaxed);
    }

    /// Forgets everything the device held (its last context is gone, and its memory
    /// with it), once `first` (the work that belongs to the clear: the tables' purge)
    /// has run with the clear under way: a mark taken before or meanwhile never passes
    /// [`no_clear_since`], so a free that took its entry out before the purge and is
    /// refused by the driver puts nothing back. The budget and the statistics stay.
    ///
    /// The epoch changes after the books are zeroed: a reservation made under the old
    /// epoch may have been wiped, so its commit charges it again (at worst twice: never
    /// less than held).
    ///
    /// Not generic: code compiled elsewhere with a reference to the clears' counter
    /// (a generic or exported function) made the fast paths reach it through the global
    /// offset table (+5 instructions on a stream-ordered free).
    pub fn clear_after(&self, first: &mut dyn FnMut()) {
        CLEARS.fetch_add(CLEAR_STARTED | CLEAR_UNDER_WAY, Ordering::SeqCst);
        // Whatever `first` does, the clear ends: one left under way would void every
        // free's release from then on.
        let first = std::panic::catch_unwind(std::panic::AssertUnwindSafe(first));
        self.used.store(0, Ordering::Release);
        self.overhead.store(0, Ordering::Release);
        self.pool.clear();
        if let Some((job, index)) = self.job() {
            job.set_own(index, 0);
        }
        self.epoch.fetch_add(1 << 32, Ordering::AcqRel);
        CLEARS.fetch_sub(CLEAR_UNDER_WAY, Ordering::SeqCst);
        if let Err(panic) = first {
            std::panic::resume_unwind(panic);
        }
    }

    /// [`Self::clear_after`] with nothing first.
    #[cfg(test)]
    pub fn clear(&self) {
        self.clear_after(&mut || ());
    }

    /// As [`Self::clear_after`], in the child of `fork()`: takes no lock and never waits, even
    /// when a thread of the parent held the pool's lock at the fork.
    ///
    /// # Safety
    /// Only from an at-fork child handler (see [`Lock::reset_in_child`]).
    pub unsafe fn clear_in_child(&self) {
        self.epoch.fetch_add(1 << 32, Ordering::AcqRel);
        self.used.store(0, Ordering::Release);
        self.overhead.store(0, Ordering::Release);
        // SAFETY: the caller's guarantee.
        unsafe { self.pool.clear_in_child() };
    }
}

/// How many times any device's books began to be cleared (high half, a count that may
/// wrap) and how many clears are under way (low half), in one word so that a fast path
/// reads both at once. A free that removed an entry before a clear must not release it
/// into the books the clear left (they never held it): [`clears`] before,
/// [`no_clear_since`] after.
static CLEARS: AtomicU64 = AtomicU64::new(0);
const CLEAR_STARTED: u64 = 1 << 32;
const CLEAR_UNDER_WAY: u64 = 1;

/// A mark to pass to [`no_clear_since`].
#[inline(always)]
pub fn clears() -> u64 {
    CLEARS.load(Ordering::SeqCst)
}

/// Whether no device's books were cleared since `mark` (from [`clears`]): none was
/// under way at the mark, and none began since.
#[inline(always)]
pub fn no_clear_since(mark: u64) -> bool {
    // A clear under way at the mark is as good as one that began after it.
    mark as u32 == 0 && CLEARS.load(Ordering::SeqCst) == mark
}

/// Bytes taken from a device's budget, given back on drop unless committed
/// ([`Reservation::commit`] keeps them).
#[must_use = "a reservation is rolled back when dropped"]
pub struct Reservation<'a> {
    device: &'a DeviceLedger,
    bytes: u64,
    /// The device's epoch when the bytes were taken.
    epoch: u64,
}

impl Reservation<'_> {
    /// The bytes reserved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The allocation happened: the bytes stay charged. When the device's books were
    /// cleared meanwhile (its last context went away while the driver allocated), they
    /// were wiped with them and are charged again.
    #[inline(always)]
    pub fn commit(self) {
        let (device, bytes, epoch) = (self.device, self.bytes, self.epoch);
        // Kept: nothing goes back on drop.
        std::mem::forget(self);
        if !device.same_books(epoch) {
            device.charge_again(bytes);
        }
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        // Books cleared since hold none of it: nothing to give back.
        if self.device.same_books(self.epoch) {
            self.device.release(self.bytes);
        }
    }
}

/// The process's ledger: one [`DeviceLedger`] per device. (The address tables are a
/// static of their own, [`PointerMap`]: all zeros, they cost the library file nothing.)
pub struct Ledger {
    devices: [DeviceLedger; MAX_DEVICES],
}

impl Ledger {
    pub const fn new() -> Self {
        let mut devices = [const { DeviceLedger::new() }; MAX_DEVICES];
        // Each device's epochs carry its index (see `DeviceLedger::epoch`).
        let mut device = 0;
        while device < MAX_DEVICES {
            devices[device].epoch = AtomicU64::new(device as u64);
            device += 1;
        }
        Self { devices }
    }

    /// The ledger of `device`, or `None` past [`MAX_DEVICES`].
    pub fn device(&self, device: usize) -> Option<&DeviceLedger> {
        self.devices.get(device)
    }

    pub fn devices(&self) -> impl Iterator<Item = (usize, &DeviceLedger)> {
        self.devices.iter().enumerate()
    }
}

impl Default for Ledger {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests;
