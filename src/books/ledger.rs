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
//! A synchronous allocation costs one compare-and-swap on the device's counter and one
//! on a slot of the address table; a stream-ordered pair that fits in its thread's pool
//! credit costs none (see [`LaneTable`]).

use std::collections::BTreeMap;

use crate::sys::lock::{Guard, Lock};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};

pub use crate::sys::driver::MAX_DEVICES;

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

/// A refused request, with what the device held and allowed at that moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Denial {
    pub requested: u64,
    pub used: u64,
    pub budget: u64,
}

/// One device's budget and usage.
pub struct DeviceLedger {
    budget: AtomicU64,
    used: AtomicU64,
    peak: AtomicU64,
    denials: AtomicU64,
    /// Allocations that waited for room (`CUDABUDGET_ON_EXCEED=wait:…`).
    waits: AtomicU64,
    /// Allocations admitted past the budget (`CUDABUDGET_ON_EXCEED=warn`).
    overruns: AtomicU64,
    /// The part of `used` that no hook saw: the context, modules, and whatever the
    /// footprint reconciliation found beyond the tracked allocations.
    overhead: AtomicU64,
    /// Which pool credit is good: the high 32 bits count the times the books were
    /// cleared ([`DeviceLedger::clear`]: credit from before is void), the low 32 bits the
    /// times the pools' charge went down ([`DeviceLedger::retire_credit`]: credit a
    /// thread kept from before may be memory the pools no longer hold, so it goes back
    /// to the bank before it is spent).
    epoch: AtomicU64,
    /// In a job (`CUDABUDGET_SCOPE=job:…`): the device's index in the job's books
    /// ([`NO_JOB`]: the budget is the process's own).
    job_device: AtomicU64,
    pub pool: PoolCredit,
}

const NO_JOB: u64 = u64::MAX;

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
        self.budget.store(raw, Ordering::Relaxed);
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

    /// Reserves `bytes` if they fit in the budget. Dropping the reservation without
    /// [`Reservation::commit`] gives the bytes back.
    pub fn reserve(&self, bytes: u64) -> Result<Reservation<'_>, Denial> {
        // In a job, the job's budget as it is now (it may change while the job runs).
        let job = self.job();
        let budget = match job {
            Some((job, index)) => job.budget(index).unwrap_or_else(|| self.limit()),
            None => self.limit(),
        };
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let after = match used.checked_add(bytes) {
                Some(after) if after <= budget => after,
                _ => {
                    return Err(Denial {
                        requested: bytes,
                        used,
                        budget,
                    });
                }
            };
            match self
                .used
                .compare_exchange_weak(used, after, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    // In a job the job's total decides, for every process at once.
                    if let Some((job, index)) = job
                        && let Err(job_used) = job.reserve(index, bytes, budget)
                    {
                        self.release_own(bytes);
                        return Err(Denial {
                            requested: bytes,
                            used: job_used,
                            budget,
                        });
                    }
                    self.note_peak(after);
                    return Ok(Reservation {
                        device: self,
                        bytes,
                        committed: false,
                        epoch: self.epoch(),
                    });
                }
                Err(now) => used = now,
            }
        }
    }

    /// Reserves `bytes` whatever the budget says (`CUDABUDGET_ON_EXCEED=warn`: a request
    /// that did not fit is admitted anyway): the books, the job's too, then hold more
    /// than the budget. Rolled back on drop unless committed, as [`Self::reserve`].
    pub fn reserve_past_budget(&self, bytes: u64) -> Reservation<'_> {
        self.charge(bytes);
        Reservation {
            device: self,
            bytes,
            committed: false,
            epoch: self.epoch(),
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

    /// Replaces the overhead charge with `bytes`, moving `used` by the difference.
    pub fn set_overhead(&self, bytes: u64) {
        let old = self.overhead.swap(bytes, Ordering::AcqRel);
        if bytes >= old {
            self.charge(bytes - old);
        } else {
            self.release(old - bytes);
        }
    }

    /// Changes whenever the device's books are cleared or its pools' charge goes down:
    /// credit a thread holds is spendable only while this is what it was given under.
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
        // The low half wraps on its own: it never carries into the books' count.
        let _ = self
            .epoch
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |e| {
                Some((e & !0xffff_ffff) | (e.wrapping_add(1) & 0xffff_ffff))
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
    /// with it). The budget and the statistics stay.
    ///
    /// The epoch changes after the books are zeroed: a reservation made under the old
    /// epoch may have been wiped, so its commit charges it again (at worst twice: never
    /// less than held).
    pub fn clear(&self) {
        CLEARING.fetch_add(1, Ordering::SeqCst);
        CLEARS.fetch_add(1, Ordering::SeqCst);
        self.used.store(0, Ordering::Release);
        self.overhead.store(0, Ordering::Release);
        self.pool.clear();
        if let Some((job, index)) = self.job() {
            job.set_own(index, 0);
        }
        self.epoch.fetch_add(1 << 32, Ordering::AcqRel);
        CLEARING.fetch_sub(1, Ordering::SeqCst);
    }

    /// As [`Self::clear`], in the child of `fork()`: takes no lock and never waits, even
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

/// How many times any device's books were cleared, and how many clears are under way.
/// A free that removed an entry before a clear must not release it into the books the
/// clear left (they never held it): [`clears`] before, [`no_clear_since`] after.
static CLEARS: AtomicU64 = AtomicU64::new(0);
static CLEARING: AtomicU64 = AtomicU64::new(0);

/// A mark to pass to [`no_clear_since`].
#[inline(always)]
pub fn clears() -> u64 {
    let done = CLEARS.load(Ordering::SeqCst);
    // A clear under way is as good as one that happened after the mark.
    if CLEARING.load(Ordering::SeqCst) != 0 {
        u64::MAX
    } else {
        done
    }
}

/// Whether no device's books were cleared since `mark` (from [`clears`]).
#[inline(always)]
pub fn no_clear_since(mark: u64) -> bool {
    mark != u64::MAX && CLEARS.load(Ordering::SeqCst) == mark
}

/// Bytes taken from a device's budget, given back on drop unless committed.
#[must_use = "a reservation is rolled back when dropped"]
pub struct Reservation<'a> {
    device: &'a DeviceLedger,
    bytes: u64,
    committed: bool,
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
    pub fn commit(mut self) {
        self.committed = true;
        if !self.device.same_books(self.epoch) {
            self.device.charge(self.bytes);
        }
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        // Books cleared since hold none of it: nothing to give back.
        if !self.committed && self.device.same_books(self.epoch) {
            self.device.release(self.bytes);
        }
    }
}

/// The largest stream-ordered request the credit can record: no budget holds 2^62
/// bytes, and below it no shard can come near overflow.
const TAKE_MAX: u64 = 1 << 62;

/// Shards of pool credit; a thread keeps to one.
pub const POOL_SHARDS: usize = 32;
/// What a shard takes from the bank at a time, so that most allocations touch only the
/// thread's own shard.
const POOL_REFILL: i64 = 64 << 20;

#[repr(align(64))]
struct Shard(AtomicI64);

/// The stream-ordered pools' charge on one device, split so that allocations and frees
/// that fit in what is already charged touch only their thread's shard.
///
/// Invariant: `charge == Σ shards + bank + live (+ what threads keep for themselves)`,
/// where `live` is what the process's stream-ordered allocations hold now. An allocation
/// takes its size from its shard; a free puts it back (the pool keeps the memory, so the
/// charge stays). When a shard runs dry the take leaves nothing owed, and the caller
/// goes to the bank: [`PoolCredit::collect`] gathers every shard into it under the lock,
/// the caller debits its request there, and a negative total is the growth the pools
/// need, which the caller must admit against the budget before the driver grows the pool.
pub struct PoolCredit {
    shards: [Shard; POOL_SHARDS],
    charge: AtomicU64,
    bank: Lock<i64>,
}

impl PoolCredit {
    const fn new() -> Self {
        Self {
            shards: [const { Shard(AtomicI64::new(0)) }; POOL_SHARDS],
            charge: AtomicU64::new(0),
            bank: Lock::new(0),
        }
    }

    /// Whether a stream-ordered request of `bytes` could ever be admitted under
    /// `budget`. Callers refuse the others before [`Self::take`], so every take records
    /// its debt and every refund gives back exactly what was taken.
    pub fn may_hold(bytes: u64, budget: u64) -> bool {
        bytes <= budget && bytes < TAKE_MAX
    }

    /// Takes `bytes` from `shard`; false when the shard had too little, in which case
    /// nothing is owed there and the caller must go through [`Self::collect`] and
    /// [`BankGuard::debit`]. `bytes` must pass [`Self::may_hold`].
    ///
    /// A compare-and-swap that subtracts only what is there: a shard never goes below
    /// zero, and a failed take changes nothing. (A subtraction undone by an addition
    /// left, when a [`Self::collect`] came in between, the request's size in the shard
    /// as credit another thread could spend with no growth admitted for it.)
    pub fn take(&self, shard: usize, bytes: u64) -> bool {
        debug_assert!(bytes < TAKE_MAX);
        let bytes = clamp_i64(bytes.min(TAKE_MAX));
        let shard = &self.shards[shard % POOL_SHARDS].0;
        let mut held = shard.load(Ordering::Acquire);
        loop {
            if held < bytes {
                return false;
            }
            match shard.compare_exchange_weak(
                held,
                held - bytes,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now) => held = now,
            }
        }
    }

    /// Puts `bytes` back into `shard` (a stream-ordered free, or a failed allocation).
    pub fn give(&self, shard: usize, bytes: u64) {
        self.shards[shard % POOL_SHARDS]
            .0
            .fetch_add(clamp_i64(bytes), Ordering::AcqRel);
    }

    /// The pools' bytes charged to the device.
    pub fn charge(&self) -> u64 {
        self.charge.load(Ordering::Acquire)
    }

    /// Locks the bank and gathers every shard into it. The guard's value is the credit
    /// left after every allocation so far; negative: the pools must grow by that much.
    pub fn collect(&self) -> BankGuard<'_> {
        let mut bank = self.bank.lock();
        for shard in &self.shards {
            let value = shard.0.swap(0, Ordering::AcqRel);
            *bank = bank.saturating_add(value);
        }
        BankGuard { credit: self, bank }
    }

    fn clear(&self) {
        let mut bank = self.bank.lock();
        self.zero();
        *bank = 0;
    }

    fn zero(&self) {
        for shard in &self.shards {
            shard.0.store(0, Ordering::Release);
        }
        self.charge.store(0, Ordering::Release);
    }

    /// As [`Self::clear`] in the child of `fork()`: stores only.
    ///
    /// # Safety
    /// As [`Lock::reset_in_child`].
    unsafe fn clear_in_child(&self) {
        self.zero();
        // SAFETY: the caller's guarantee.
        unsafe { self.bank.reset_in_child(0) };
    }
}

/// The pool bank, locked, with every shard gathered in it.
pub struct BankGuard<'a> {
    credit: &'a PoolCredit,
    bank: Guard<'a, i64>,
}

impl BankGuard<'_> {
    /// Credit left (negative: a deficit).
    pub fn credit(&self) -> i64 {
        *self.bank
    }

    /// The pools' charge now equals `reserve` (the driver's figure, or our estimate of
    /// it); returns the change, which the caller applies to the device's `used`.
    pub fn set_charge(&mut self, reserve: u64) -> i64 {
        let old = self.credit.charge.swap(reserve, Ordering::AcqRel);
        let delta = clamp_i64(reserve).saturating_sub(clamp_i64(old));
        *self.bank = self.bank.saturating_add(delta);
        delta
    }

    /// Puts `bytes` back into the bank: an allocation that will not happen after all, or
    /// credit a thread kept from before the pools shrank (not into a shard: it may be
    /// memory the pools no longer hold, and only the bank's total can say so).
    pub fn refund(&mut self, bytes: u64) {
        *self.bank = self.bank.saturating_add(clamp_i64(bytes));
    }

    /// Takes `bytes` out of the bank: a request that found its shard dry, or blocks in
    /// use that the books no longer record (they outlived a context), which the reserve
    /// charged to the pools does not leave free.
    pub fn debit(&mut self, bytes: u64) {
        *self.bank = self.bank.saturating_sub(clamp_i64(bytes));
    }

    /// Hands part of the bank to `shard`, so that its next allocations stay lock-free.
    pub fn lend(&mut self, shard: usize) {
        let amount = (*self.bank).min(POOL_REFILL);
        if amount > 0 {
            *self.bank -= amount;
            self.credit.shards[shard % POOL_SHARDS]
                .0
                .fetch_add(amount, Ordering::AcqRel);
        }
    }
}

/// `v` as an `i64`, clamped (never wrapped) at `i64::MAX`.
pub fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// How an address-table entry was charged, so that its release goes the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `cuMemAlloc`, `cuMemAllocPitch`, `cuMemAllocManaged`, arrays: charged to `used`.
    Direct = 0,
    /// Stream-ordered: taken from the pool credit.
    Pooled = 1,
}

/// What the address table stores for one pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub bytes: u64,
    pub device: usize,
    pub kind: Kind,
}

const SIZE_BITS: u32 = 56;
const SIZE_MASK: u64 = (1 << SIZE_BITS) - 1;

impl Entry {
    fn pack(self) -> u64 {
        let kind = self.kind as u64;
        (self.bytes.min(SIZE_MASK)) | ((self.device as u64 & 0x3f) << SIZE_BITS) | (kind << 62)
    }

    fn unpack(v: u64) -> Self {
        Self {
            bytes: v & SIZE_MASK,
            device: ((v >> SIZE_BITS) & 0x3f) as usize,
            kind: if v >> 62 == 1 {
                Kind::Pooled
            } else {
                Kind::Direct
            },
        }
    }
}

const EMPTY: u64 = 0;
const BUSY: u64 = u64::MAX;
/// Slots an entry may lie from its home slot; lookups never look further.
const WINDOW: usize = 32;

struct Slot {
    key: AtomicU64,
    value: AtomicU64,
}

/// A lock-free map from an address (or handle) to an [`Entry`]: open addressing with a
/// bounded probe window, so a lookup of an address we never saw costs at most `WINDOW`
/// probes. A slot is claimed with a compare-and-swap to `BUSY`, filled, then published;
/// a remove is a plain store back to empty (see [`AddrTable::remove`]).
/// When every slot of a window is taken the entry goes to a locked overflow map, which
/// stays empty in practice.
pub struct AddrTable<const N: usize> {
    slots: [Slot; N],
    overflow: Lock<BTreeMap<u64, u64>>,
    overflow_len: AtomicU64,
}

impl<const N: usize> AddrTable<N> {
    pub const fn new() -> Self {
        assert!(N.is_power_of_two() && N >= WINDOW);
        Self {
            slots: [const {
                Slot {
                    key: AtomicU64::new(EMPTY),
                    value: AtomicU64::new(0),
                }
            }; N],
            overflow: Lock::new(BTreeMap::new()),
            overflow_len: AtomicU64::new(0),
        }
    }

    fn home(key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize & (N - 1)
    }

    /// Records `key`. The caller guarantees `key` is not in the table (the driver never
    /// hands out a live address twice; frees remove before calling the driver).
    pub fn insert(&self, key: u64, entry: Entry) {
        if key == EMPTY || key == BUSY {
            return;
        }
        let home = Self::home(key);
        for i in 0..WINDOW {
            let slot = &self.slots[(home + i) & (N - 1)];
            // Claimed as BUSY, filled, then published: whoever sees the key sees
            // its value.
            if slot.key.load(Ordering::Relaxed) == EMPTY
                && slot
                    .key
                    .compare_exchange(EMPTY, BUSY, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                slot.value.store(entry.pack(), Ordering::Relaxed);
                slot.key.store(key, Ordering::Release);
                return;
            }
        }
        let mut overflow = self.overflow.lock();
        overflow.insert(key, entry.pack());
        self.overflow_len
            .store(overflow.len() as u64, Ordering::Release);
    }

    /// Removes `key` and returns its entry; `None` for an address never recorded.
    ///
    /// While a slot holds a live address, the only thread that writes it is the one
    /// freeing that address (inserts claim empty slots only), so the slot is given up
    /// with a plain store. Only a program that frees one address on two threads at once
    /// (a double free, which the driver refuses) could see the entry twice; the books
    /// then over-count, never under-count.
    pub fn remove(&self, key: u64) -> Option<Entry> {
        if key == EMPTY || key == BUSY {
            return None;
        }
        let home = Self::home(key);
        for i in 0..WINDOW {
            let slot = &self.slots[(home + i) & (N - 1)];
            if slot.key.load(Ordering::Acquire) == key {
                // Read before the slot is given up. No other thread writes a slot that
                // holds a live key except to free that same address, so giving it up
                // is a plain store, not a compare-and-swap.
                let value = slot.value.load(Ordering::Relaxed);
                slot.key.store(EMPTY, Ordering::Release);
                return Some(Entry::unpack(value));
            }
        }
        if self.overflow_len.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut overflow = self.overflow.lock();
        let value = overflow.remove(&key);
        self.overflow_len
            .store(overflow.len() as u64, Ordering::Release);
        value.map(Entry::unpack)
    }

    /// In the child of `fork()`: the overflow map's lock is free again (its entries, of
    /// the parent's allocations, are forgotten). The slots are left alone: writing them
    /// would copy every page of the table into the child.
    ///
    /// # Safety
    /// Only from an at-fork child handler (see [`Lock::reset_in_child`]).
    pub unsafe fn reset_in_child(&self) {
        // SAFETY: the caller's guarantee.
        unsafe { self.overflow.reset_in_child(BTreeMap::new()) };
        self.overflow_len.store(0, Ordering::Release);
    }

    /// Drops every entry of `device` (its context was destroyed with all its memory).
    pub fn purge_device(&self, device: usize) {
        for slot in &self.slots {
            let key = slot.key.load(Ordering::Acquire);
            if key == EMPTY || key == BUSY {
                continue;
            }
            if Entry::unpack(slot.value.load(Ordering::Relaxed)).device == device {
                let _ = slot
                    .key
                    .compare_exchange(key, EMPTY, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
        let mut overflow = self.overflow.lock();
        overflow.retain(|_, v| Entry::unpack(*v).device != device);
        self.overflow_len
            .store(overflow.len() as u64, Ordering::Release);
    }
}

impl<const N: usize> Default for AddrTable<N> {
    fn default() -> Self {
        Self::new()
    }
}

/// Where the address tables' users find them: [`AddrTable`] and [`PointerMap`].
pub trait Table {
    fn insert(&self, key: u64, entry: Entry);
    fn remove(&self, key: u64) -> Option<Entry>;
}

impl<const N: usize> Table for AddrTable<N> {
    fn insert(&self, key: u64, entry: Entry) {
        AddrTable::insert(self, key, entry)
    }
    fn remove(&self, key: u64) -> Option<Entry> {
        AddrTable::remove(self, key)
    }
}

/// Lanes of the [`LaneTable`]: lane 0 is nobody's; 1..LANES go to allocating threads.
pub const LANES: usize = 32;
/// Slots of a bucket: one cache line (16-byte slots).
const BUCKET: usize = 4;
/// Lanes given to a thread (bit L = lane L); lane 0 is never given.
static LANES_TAKEN: AtomicU32 = AtomicU32::new(1);
/// The highest lane ever given: no entry lies in a higher one, so lookups stop there.
/// It never goes down: after a burst of many threads, lookups of blocks freed by another
/// thread (or never recorded) look at that many lanes.
static HIGH_LANE: AtomicUsize = AtomicUsize::new(0);

/// A free lane for the calling thread, or 0 when all are taken.
pub fn claim_lane() -> usize {
    let mut taken = LANES_TAKEN.load(Ordering::Relaxed);
    while taken != u32::MAX {
        let lane = (!taken).trailing_zeros();
        match LANES_TAKEN.compare_exchange_weak(
            taken,
            taken | 1 << lane,
            Ordering::AcqRel,
            Ordering::Relaxed,
        ) {
            Ok(_) => {
                HIGH_LANE.fetch_max(lane as usize, Ordering::AcqRel);
                return lane as usize;
            }
            Err(now) => taken = now,
        }
    }
    0
}

/// Whether [`claim_lane`] could give a lane now.
pub fn lane_free() -> bool {
    LANES_TAKEN.load(Ordering::Relaxed) != u32::MAX
}

/// Gives back a lane from [`claim_lane`] (its thread will insert no more).
pub fn release_lane(lane: usize) {
    if (1..LANES).contains(&lane) {
        LANES_TAKEN.fetch_and(!(1 << lane), Ordering::AcqRel);
    }
}

/// In the child of `fork()`: only the forking thread came along; the others' lanes are
/// free again (their entries stay where they are, found as before).
pub fn lanes_after_fork(own: usize) {
    let own_bit = if (1..LANES).contains(&own) {
        1 << own
    } else {
        0
    };
    LANES_TAKEN.store(1 | own_bit, Ordering::Release);
}

/// One cache line of slots.
#[repr(C, align(64))]
struct Bucket([Slot; BUCKET]);

/// An address table without a compare-and-swap on insert, for the stream-ordered hot
/// path. Each lane has a region of its own; the thread that holds lane L (see
/// [`claim_lane`]) is the only one that fills an empty slot of region L, so it fills it
/// with plain stores, and threads never write each other's cache lines when the driver
/// hands one address to one thread after another. A key lies in one bucket (one cache
/// line) of a region; when its bucket in the inserting lane is full the caller uses an
/// [`AddrTable`] instead. Any thread removes (as in [`AddrTable::remove`]), looking in
/// its own lane first.
pub struct LaneTable<const BUCKETS_PER_LANE: usize> {
    regions: [[Bucket; BUCKETS_PER_LANE]; LANES],
}

impl<const B: usize> LaneTable<B> {
    pub const fn new() -> Self {
        assert!(B.is_power_of_two());
        Self {
            regions: [const {
                [const {
                    Bucket(
                        [const {
                            Slot {
                                key: AtomicU64::new(EMPTY),
                                value: AtomicU64::new(0),
                            }
                        }; BUCKET],
                    )
                }; B]
            }; LANES],
        }
    }

    fn bucket_index(key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize & (B - 1)
    }

    #[inline]
    fn bucket(&self, lane: usize, key: u64) -> &Bucket {
        &self.regions[lane][Self::bucket_index(key)]
    }

    /// Records `key` in `lane`'s region; false when its bucket is full. Only the thread
    /// that holds `lane` may call this.
    #[inline(always)]
    pub fn insert(&self, key: u64, entry: Entry, lane: usize) -> bool {
        if key == EMPTY || key == BUSY || !(1..LANES).contains(&lane) {
            return false;
        }
        for slot in &self.bucket(lane, key).0 {
            if slot.key.load(Ordering::Acquire) == EMPTY {
                slot.value.store(entry.pack(), Ordering::Relaxed);
                slot.key.store(key, Ordering::Release);
                return true;
            }
        }
        false
    }

    /// Removes `key` and returns its entry; `None` for an address not here. `hint` is
    /// the caller's own lane (0: none), where a block is found when its thread frees it.
    #[inline(always)]
    pub fn remove(&self, key: u64, hint: usize) -> Option<Entry> {
        if key == EMPTY || key == BUSY {
            return None;
        }
        if (1..LANES).contains(&hint)
            && let Some(entry) = self.take(hint, key)
        {
            return Some(entry);
        }
        // The address reached this thread through the program after its insert, and
        // with it the inserting thread's lane: HIGH_LANE is at least that lane here.
        let high = HIGH_LANE.load(Ordering::Acquire).min(LANES - 1);
        (1..=high)
            .filter(|&lane| lane != hint)
            .find_map(|lane| self.take(lane, key))
    }

    /// Removes `key` from `lane`'s region; `None` when it is not there (or `lane` is
    /// no lane).
    #[inline]
    fn take(&self, lane: usize, key: u64) -> Option<Entry> {
        let bucket = self.regions.get(lane)?.get(Self::bucket_index(key))?;
        for slot in &bucket.0 {
            if slot.key.load(Ordering::Acquire) == key {
                let value = slot.value.load(Ordering::Relaxed);
                slot.key.store(EMPTY, Ordering::Release);
                return Some(Entry::unpack(value));
            }
        }
        None
    }

    /// Drops every entry of `device`.
    pub fn purge_device(&self, device: usize) {
        let slots = self
            .regions
            .iter()
            .flat_map(|region| region.iter())
            .flat_map(|bucket| bucket.0.iter());
        for slot in slots {
            let key = slot.key.load(Ordering::Acquire);
            if key != EMPTY && Entry::unpack(slot.value.load(Ordering::Relaxed)).device == device {
                let _ = slot
                    .key
                    .compare_exchange(key, EMPTY, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }
}

impl<const B: usize> Default for LaneTable<B> {
    fn default() -> Self {
        Self::new()
    }
}

/// Device pointers from every allocation path: stream-ordered blocks of threads with a
/// lane in the [`LaneTable`], everything else in the [`AddrTable`].
pub struct PointerMap {
    /// 4096 buckets of 4 slots a lane: 16 384 blocks a thread (16 MiB of address space,
    /// touched only where used).
    lanes: LaneTable<4096>,
    shared: AddrTable<{ 1 << 18 }>,
}

impl PointerMap {
    pub const fn new() -> Self {
        Self {
            lanes: LaneTable::new(),
            shared: AddrTable::new(),
        }
    }

    /// Records a block allocated by the thread that holds `lane` (0: none).
    #[inline]
    pub fn insert_in_lane(&self, key: u64, entry: Entry, lane: usize) {
        if !self.lanes.insert(key, entry, lane) {
            self.shared.insert(key, entry);
        }
    }

    /// Records a block in the calling thread's own `lane` (1..[`LANES`]); false when its
    /// bucket there is full (or `lane` is no lane), and nothing was recorded.
    #[inline(always)]
    pub fn insert_own(&self, key: u64, entry: Entry, lane: usize) -> bool {
        self.lanes.insert(key, entry, lane)
    }

    /// Removes `key` if it lies in `lane` (the caller's own); `None` otherwise, when it
    /// may still be elsewhere ([`PointerMap::remove_pooled`]).
    #[inline(always)]
    pub fn remove_own(&self, key: u64, lane: usize) -> Option<Entry> {
        if key == EMPTY || key == BUSY {
            return None;
        }
        self.lanes.take(lane, key)
    }

    pub fn purge_device(&self, device: usize) {
        self.lanes.purge_device(device);
        self.shared.purge_device(device);
    }

    /// See [`AddrTable::reset_in_child`].
    ///
    /// # Safety
    /// Only from an at-fork child handler.
    pub unsafe fn reset_in_child(&self) {
        // SAFETY: the caller's guarantee.
        unsafe { self.shared.reset_in_child() };
    }
}

impl PointerMap {
    /// As [`Table::remove`], looking where a stream-ordered block would be first:
    /// in the lane `hint` of the calling thread (0: none), then the others.
    #[inline(always)]
    pub fn remove_pooled(&self, key: u64, hint: usize) -> Option<Entry> {
        self.lanes
            .remove(key, hint)
            .or_else(|| self.shared.remove(key))
    }
}

impl Table for PointerMap {
    fn insert(&self, key: u64, entry: Entry) {
        self.shared.insert(key, entry);
    }

    fn remove(&self, key: u64) -> Option<Entry> {
        self.shared
            .remove(key)
            .or_else(|| self.lanes.remove(key, 0))
    }
}

impl Default for PointerMap {
    fn default() -> Self {
        Self::new()
    }
}

/// The process's ledger: one [`DeviceLedger`] per device. (The address tables are a
/// static of their own, [`PointerMap`]: all zeros, they cost the library file nothing.)
pub struct Ledger {
    devices: [DeviceLedger; MAX_DEVICES],
}

impl Ledger {
    pub const fn new() -> Self {
        Self {
            devices: [const { DeviceLedger::new() }; MAX_DEVICES],
        }
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
mod tests {
    use super::*;
    use std::sync::Arc;

    fn device(budget: u64) -> DeviceLedger {
        let d = DeviceLedger::new();
        d.set_budget(Budget::Bytes(budget));
        d
    }

    #[test]
    fn a_reservation_that_fits_is_charged_and_one_that_does_not_is_refused() {
        let d = device(100);
        d.reserve(60).unwrap().commit();
        assert_eq!(d.used(), 60);
        let denial = d.reserve(41).err().unwrap();
        assert_eq!(
            denial,
            Denial {
                requested: 41,
                used: 60,
                budget: 100
            }
        );
        d.reserve(40).unwrap().commit();
        assert_eq!(d.used(), 100);
        assert_eq!(d.peak(), 100);
    }

    #[test]
    fn a_reservation_past_the_budget_is_charged_and_rolled_back_like_any_other() {
        let d = device(100);
        d.reserve(60).unwrap().commit();
        d.reserve_past_budget(70).commit();
        assert_eq!((d.used(), d.peak()), (130, 130));
        assert!(
            d.reserve(1).is_err(),
            "above the budget, what fits is still decided"
        );
        drop(d.reserve_past_budget(50));
        assert_eq!(d.used(), 130, "not committed: given back");
        d.note_overrun();
        assert_eq!(d.overruns(), 1);
    }

    #[test]
    fn a_dropped_reservation_is_rolled_back() {
        let d = device(100);
        {
            let _r = d.reserve(70).unwrap();
            assert_eq!(d.used(), 70);
        }
        assert_eq!(d.used(), 0);
    }

    #[test]
    fn releases_never_take_the_counter_below_zero() {
        let d = device(100);
        d.reserve(10).unwrap().commit();
        d.release(1 << 60);
        assert_eq!(d.used(), 0);
        d.release(5);
        assert_eq!(d.used(), 0);
    }

    #[test]
    fn a_request_that_overflows_is_refused() {
        let d = device(u64::MAX);
        d.reserve(10).unwrap().commit();
        assert!(d.reserve(u64::MAX).is_err());
    }

    #[test]
    fn racing_threads_never_pass_the_budget_together() {
        let d = Arc::new(device(1000));
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let d = Arc::clone(&d);
                std::thread::spawn(move || {
                    let mut held = 0;
                    while let Ok(r) = d.reserve(7) {
                        r.commit();
                        held += 7;
                    }
                    held
                })
            })
            .collect();
        let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert!(total <= 1000);
        assert!(total > 1000 - 7);
        assert_eq!(d.used(), total);
        assert_eq!(d.peak(), total);
    }

    #[test]
    fn overhead_moves_used_by_the_difference() {
        let d = device(1000);
        d.reserve(100).unwrap().commit();
        d.set_overhead(300);
        assert_eq!(d.used(), 400);
        d.set_overhead(50);
        assert_eq!(d.used(), 150);
        assert_eq!(d.overhead(), 50);
    }

    #[test]
    fn the_table_finds_what_was_inserted_and_nothing_else() {
        let t: AddrTable<1024> = AddrTable::new();
        let e = Entry {
            bytes: 4096,
            device: 3,
            kind: Kind::Pooled,
        };
        t.insert(0x7f00_0000_0000, e);
        assert_eq!(t.remove(0x7f00_0020_0000), None);
        assert_eq!(t.remove(0x7f00_0000_0000), Some(e));
        assert_eq!(t.remove(0x7f00_0000_0000), None);
    }

    #[test]
    fn the_table_spills_to_overflow_when_a_window_is_full() {
        let t: AddrTable<64> = AddrTable::new();
        let keys: Vec<u64> = (1..=200u64).map(|k| k << 21).collect();
        for (i, &k) in keys.iter().enumerate() {
            t.insert(
                k,
                Entry {
                    bytes: i as u64 + 1,
                    device: 0,
                    kind: Kind::Direct,
                },
            );
        }
        // 64 slots for 200 keys: at least the rest went to the overflow map.
        assert!(t.overflow_len.load(Ordering::Relaxed) >= 200 - 64);
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(t.remove(k).map(|e| e.bytes), Some(i as u64 + 1));
        }
        assert_eq!(t.overflow_len.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn purging_a_device_drops_only_its_entries() {
        let t: AddrTable<1024> = AddrTable::new();
        for (k, dev) in [(1u64 << 21, 0), (2 << 21, 1), (3 << 21, 0)] {
            t.insert(
                k,
                Entry {
                    bytes: 1,
                    device: dev,
                    kind: Kind::Direct,
                },
            );
        }
        t.purge_device(0);
        assert_eq!(t.remove(1 << 21), None);
        assert_eq!(t.remove(3 << 21), None);
        assert!(t.remove(2 << 21).is_some());
    }

    fn pooled(bytes: u64) -> Entry {
        Entry {
            bytes,
            device: 0,
            kind: Kind::Pooled,
        }
    }

    /// Lanes are process-wide: the tests that claim them take turns.
    static LANE_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn lanes_are_given_once_lowest_first_and_come_back() {
        let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let a = claim_lane();
        let b = claim_lane();
        assert!((1..LANES).contains(&a) && (1..LANES).contains(&b) && a != b);
        release_lane(a);
        let c = claim_lane();
        assert_eq!(c, a, "the lowest free lane is given first");
        release_lane(b);
        release_lane(c);
        // Lane 0 is nobody's: releasing it changes nothing.
        release_lane(0);
        assert_eq!(LANES_TAKEN.load(Ordering::Relaxed) & 1, 1);
    }

    #[test]
    fn a_lane_holds_a_bucket_of_entries_and_the_map_takes_the_rest() {
        let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let lane = claim_lane();
        let other = claim_lane();
        static T: LaneTable<64> = LaneTable::new();
        // Keys of one bucket: a lane has room for BUCKET of them.
        let bucket = LaneTable::<64>::bucket_index(1 << 21);
        let same: Vec<u64> = (1..100_000u64)
            .map(|k| k << 12)
            .filter(|&k| LaneTable::<64>::bucket_index(k) == bucket)
            .take(BUCKET + 1)
            .collect();
        for (i, &k) in same[..BUCKET].iter().enumerate() {
            assert!(T.insert(k, pooled(i as u64), lane));
        }
        assert!(
            !T.insert(same[BUCKET], pooled(9), lane),
            "the bucket is full"
        );
        assert!(
            !T.insert(same[BUCKET], pooled(9), 0),
            "lane 0 never fills a slot"
        );
        assert!(
            T.insert(same[BUCKET], pooled(9), other),
            "another lane has room"
        );
        // Found from any lane's point of view, once.
        assert_eq!(T.remove(same[1], lane), Some(pooled(1)));
        assert_eq!(T.remove(same[1], lane), None);
        assert_eq!(T.remove(same[2], other), Some(pooled(2)));
        assert_eq!(T.remove(same[BUCKET], 0), Some(pooled(9)));
        assert!(T.insert(same[BUCKET], pooled(7), lane));
        assert_eq!(T.remove(same[BUCKET], other), Some(pooled(7)));

        static M: PointerMap = PointerMap::new();
        let keys: Vec<u64> = (1..100_000u64)
            .map(|k| k << 12)
            .filter(|&k| LaneTable::<4096>::bucket_index(k) == 0)
            .take(BUCKET + 2)
            .collect();
        for (i, &k) in keys.iter().enumerate() {
            M.insert_in_lane(k, pooled(i as u64), lane);
        }
        M.insert_in_lane(0x7000_0000, pooled(99), 0);
        for (i, &k) in keys.iter().enumerate().rev() {
            assert_eq!(M.remove_pooled(k, other), Some(pooled(i as u64)));
        }
        assert_eq!(Table::remove(&M, 0x7000_0000), Some(pooled(99)));
        assert_eq!(Table::remove(&M, 0x7000_0000), None);
        release_lane(lane);
        release_lane(other);
    }

    #[test]
    fn a_lane_given_again_keeps_its_old_threads_blocks() {
        let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        static M: PointerMap = PointerMap::new();
        // A thread allocates, then exits with its blocks still live.
        let first = std::thread::spawn(|| {
            let lane = claim_lane();
            for k in 1..=1000u64 {
                M.insert_in_lane(k << 16, pooled(k), lane);
            }
            release_lane(lane);
            lane
        })
        .join()
        .unwrap();
        // The next thread gets the same lane and fills it too.
        let second = std::thread::spawn(|| {
            let lane = claim_lane();
            for k in 1001..=2000u64 {
                M.insert_in_lane(k << 16, pooled(k), lane);
            }
            lane
        })
        .join()
        .unwrap();
        assert_eq!(first, second);
        for k in 1..=2000u64 {
            assert_eq!(M.remove_pooled(k << 16, 0), Some(pooled(k)), "{k}");
        }
        release_lane(second);
    }

    #[test]
    fn blocks_freed_by_other_threads_are_found_once_each() {
        // Eight threads allocate with their own lanes; each block is freed by the next
        // thread, as PyTorch's autograd thread frees what the forward pass allocated.
        let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        // (A static: the map is too large for a test thread's stack.)
        static M: PointerMap = PointerMap::new();
        const PER: u64 = 20_000;
        let (tx, rx): (Vec<_>, Vec<_>) = (0..8).map(|_| std::sync::mpsc::channel()).unzip();
        let mut rx: Vec<Option<std::sync::mpsc::Receiver<u64>>> =
            rx.into_iter().map(Some).collect();
        let handles: Vec<_> = (0..8usize)
            .map(|t| {
                let m = &M;
                let to_next = tx[(t + 1) % 8].clone();
                let mine = rx[t].take().unwrap();
                std::thread::spawn(move || {
                    let lane = claim_lane();
                    let mut found = 0u64;
                    for i in 0..PER {
                        let key = ((t as u64) << 40) | ((i + 1) << 8);
                        m.insert_in_lane(key, pooled(key & 0xffff_ffff), lane);
                        to_next.send(key).unwrap();
                        while let Ok(k) = mine.try_recv() {
                            assert_eq!(m.remove_pooled(k, lane), Some(pooled(k & 0xffff_ffff)));
                            found += 1;
                        }
                    }
                    drop(to_next);
                    release_lane(lane);
                    (found, mine)
                })
            })
            .collect();
        drop(tx);
        let mut total = 0;
        for h in handles {
            let (found, mine) = h.join().unwrap();
            total += found;
            for k in mine.iter() {
                assert_eq!(M.remove_pooled(k, 0), Some(pooled(k & 0xffff_ffff)));
                total += 1;
            }
        }
        assert_eq!(total, 8 * PER);
    }

    #[test]
    fn sizes_up_to_64_pib_and_every_device_survive_packing() {
        for (bytes, device) in [(0, 0), (1, 63), (SIZE_MASK, 17)] {
            for kind in [Kind::Direct, Kind::Pooled] {
                let e = Entry {
                    bytes,
                    device,
                    kind,
                };
                assert_eq!(Entry::unpack(e.pack()), e);
            }
        }
    }

    #[test]
    fn pool_credit_is_taken_from_the_shard_and_a_dry_shard_owes_nothing() {
        let p = PoolCredit::new();
        // Nothing charged yet: the first allocation finds no credit, and owes nothing
        // until it debits the bank itself.
        assert!(!p.take(0, 100));
        let mut bank = p.collect();
        assert_eq!(bank.credit(), 0);
        bank.debit(100);
        assert_eq!(bank.credit(), -100);
        // The caller grows the pool by 32 units and charges them.
        assert_eq!(bank.set_charge(132), 132);
        assert_eq!(bank.credit(), 32);
        bank.lend(0);
        drop(bank);
        assert!(p.take(0, 30));
        assert!(!p.take(0, 30)); // 2 left, nothing owed
        let bank = p.collect();
        assert_eq!(bank.credit(), 2);
    }

    /// Runs `f` while another thread keeps trying to take 1 GiB from `shard` of `p`, which
    /// holds nothing: every one of those takes must fail.
    fn while_large_takes_fail<R>(p: &Arc<PoolCredit>, shard: usize, f: impl FnOnce() -> R) -> R {
        let stop = Arc::new(AtomicU64::new(0));
        let big = {
            let (p, stop) = (p.clone(), stop.clone());
            std::thread::spawn(move || {
                while stop.load(Ordering::Relaxed) == 0 {
                    assert!(!p.take(shard, 1 << 30));
                }
            })
        };
        let result = f();
        stop.store(1, Ordering::Relaxed);
        big.join().unwrap();
        result
    }

    #[test]
    fn a_failed_take_never_leaves_credit_another_thread_can_spend() {
        // Nothing is charged, so no take may ever succeed. One thread keeps failing a
        // large take, one gathers the shards (as every growth, trim and denial does), one
        // tries small takes on the same shard. A take that subtracted and then added
        // back, with a gathering in between, left its request's size in the shard as
        // credit the small takes could spend: an allocation no growth was admitted for.
        let p = Arc::new(PoolCredit::new());
        let spent = while_large_takes_fail(&p, 3, || {
            let stop = Arc::new(AtomicU64::new(0));
            let gather = {
                let (p, stop) = (p.clone(), stop.clone());
                std::thread::spawn(move || {
                    while stop.load(Ordering::Relaxed) == 0 {
                        drop(p.collect());
                    }
                })
            };
            let mut spent = 0u64;
            for _ in 0..200_000 {
                if p.take(3, 4096) {
                    spent += 1;
                    p.give(3, 4096);
                }
            }
            stop.store(1, Ordering::Relaxed);
            gather.join().unwrap();
            spent
        });
        assert_eq!(spent, 0, "takes paid with credit nobody charged");
        assert_eq!(p.collect().credit(), 0);
    }

    #[test]
    fn a_gathering_never_sees_a_failed_take_as_a_debt() {
        // Nothing is charged and nothing is taken, so every gathering must find the
        // shards empty. A deficit found there is settled as an allocation on its way to
        // the driver and charged (flow::settle_charge), with no admission against
        // the budget: a failed 1020 MiB take that a gathering caught, between its
        // subtraction and its undo, was once charged that way, and its own request then
        // spent the charge (docs/soaks/2026-12-02 at 258b938, 884 MiB over a 1 GiB budget).
        let p = Arc::new(PoolCredit::new());
        let debts = while_large_takes_fail(&p, 5, || {
            (0..200_000).filter(|_| p.collect().credit() != 0).count()
        });
        assert_eq!(debts, 0, "gatherings that saw a failed take as a debt");
    }

    #[test]
    fn frees_return_credit_to_the_freeing_thread_and_collect_finds_it() {
        let p = PoolCredit::new();
        {
            let mut bank = p.collect();
            bank.set_charge(1000);
        }
        // One thread allocates everything, another frees it.
        assert!(!p.take(1, 1000));
        {
            let mut bank = p.collect();
            bank.debit(1000);
            assert_eq!(bank.credit(), 0);
            bank.lend(1);
        }
        p.give(2, 1000);
        let bank = p.collect();
        assert_eq!(bank.credit(), 1000);
    }

    #[test]
    fn racing_pool_allocations_keep_the_books_balanced() {
        let p = Arc::new(PoolCredit::new());
        {
            let mut bank = p.collect();
            bank.set_charge(10_000);
        }
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let p = Arc::clone(&p);
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        if !p.take(t, 10) {
                            let mut bank = p.collect();
                            bank.debit(10);
                            if bank.credit() < 0 {
                                bank.refund(10);
                                continue;
                            }
                            bank.lend(t);
                        }
                        p.give(t, 10);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let bank = p.collect();
        assert_eq!(bank.credit(), 10_000);
    }

    #[test]
    fn every_ordinal_up_to_the_highest_has_books_and_none_beyond() {
        static L: Ledger = Ledger::new();
        let top = crate::config::MAX_ORDINAL as usize;
        assert!(L.device(top).is_some());
        assert!(L.device(top + 1).is_none());
        assert_eq!(L.devices().count(), top + 1);
    }

    #[test]
    fn denials_count_from_zero_and_each_note_returns_the_new_count() {
        let d = device(100);
        assert_eq!(d.denials(), 0);
        assert_eq!(d.note_denial(), 1);
        assert_eq!(d.note_denial(), 2);
        assert_eq!(d.denials(), 2);
    }

    #[test]
    fn a_growing_overhead_charges_only_its_growth() {
        let d = device(1000);
        d.set_overhead(100);
        d.set_overhead(300);
        assert_eq!(d.used(), 300);
        assert_eq!(d.peak(), 300);
        assert_eq!(d.overhead(), 300);
    }

    #[test]
    fn only_clearing_the_books_starts_new_books() {
        let d = device(1000);
        let first = d.epoch();
        assert_eq!(d.books_epoch(), 0);
        assert!(d.same_books(first));
        // The pools shrank: kept credit must be checked, but the books are the same.
        d.retire_credit();
        let retired = d.epoch();
        assert_ne!(retired, first);
        assert_eq!(d.books_epoch(), 0);
        assert!(d.same_books(first));
        assert!(d.same_books(retired));
        // The device's memory went with its context: credit from before is void.
        d.clear();
        assert_ne!(d.epoch(), retired);
        assert_eq!(d.books_epoch(), 1);
        assert!(!d.same_books(first));
        assert!(!d.same_books(retired));
        assert!(d.same_books(d.epoch()));
        d.retire_credit();
        assert!(d.same_books(d.epoch()));
        d.clear();
        assert_eq!(d.books_epoch(), 2);
    }

    #[test]
    fn a_reservation_the_clear_wiped_is_charged_again_when_committed() {
        let d = device(1000);
        let r = d.reserve(100).unwrap();
        // The device's last context went away while the driver allocated in another.
        d.clear();
        assert_eq!(d.used(), 0);
        r.commit();
        assert_eq!(d.used(), 100, "the allocation is held: it is charged");
    }

    #[test]
    fn a_reservation_dropped_after_a_clear_gives_back_nothing_of_the_new_books() {
        let d = device(1000);
        let r = d.reserve(100).unwrap();
        d.clear();
        d.reserve(50).unwrap().commit();
        drop(r);
        assert_eq!(d.used(), 50, "the 50 charged after the clear stay");
    }

    #[test]
    fn a_free_that_straddles_a_clear_is_told_so() {
        let d = device(1000);
        let mark = clears();
        d.clear();
        assert!(!no_clear_since(mark));
        assert!(
            !no_clear_since(u64::MAX),
            "a mark taken during a clear never passes"
        );
    }

    #[test]
    fn clearing_forgets_what_the_device_held_but_keeps_budget_and_statistics() {
        let d = device(1000);
        d.reserve(100).unwrap().commit();
        d.set_overhead(50);
        {
            let mut bank = d.pool.collect();
            bank.set_charge(300);
            bank.lend(3);
        }
        d.note_denial();
        d.clear();
        assert_eq!(d.used(), 0);
        assert_eq!(d.overhead(), 0);
        assert_eq!(d.pool.charge(), 0);
        assert!(!d.pool.take(3, 1), "credit lent before the clear is void");
        assert_eq!(d.pool.collect().credit(), 0, "and so is the bank's");
        assert_eq!(d.budget(), Budget::Bytes(1000));
        assert_eq!(d.peak(), 150);
        assert_eq!(d.denials(), 1);
    }

    #[test]
    fn a_stream_ordered_request_may_be_held_only_within_the_budget_and_below_take_max() {
        assert!(PoolCredit::may_hold(0, 0));
        assert!(PoolCredit::may_hold(100, 100));
        assert!(!PoolCredit::may_hold(101, 100));
        assert!(PoolCredit::may_hold(TAKE_MAX - 1, u64::MAX));
        assert!(!PoolCredit::may_hold(TAKE_MAX, u64::MAX));
        assert!(!PoolCredit::may_hold(u64::MAX, u64::MAX));
    }

    #[test]
    fn each_shard_spends_and_gets_back_its_own_credit() {
        for s in 0..POOL_SHARDS {
            let other = (s + 1) % POOL_SHARDS;
            let p = PoolCredit::new();
            {
                let mut bank = p.collect();
                bank.set_charge(1000);
                bank.lend(s);
                assert_eq!(bank.credit(), 0, "all of it lent");
            }
            assert!(p.take(s, 600), "shard {s} spends what was lent to it");
            p.give(s, 600);
            assert!(p.take(s, 1000), "shard {s} got its free back");
            assert!(!p.take(other, 1), "shard {other} has none of it");
            assert_eq!(p.collect().credit(), 0, "and owes nothing for trying");
        }
    }

    #[test]
    fn a_refund_puts_the_bytes_back_into_the_bank() {
        let p = PoolCredit::new();
        assert!(!p.take(0, 100));
        {
            let mut bank = p.collect();
            bank.debit(100);
            assert_eq!(bank.credit(), -100);
            // The driver refused the allocation: its debt is paid back.
            bank.refund(100);
            assert_eq!(bank.credit(), 0);
        }
        assert_eq!(p.collect().credit(), 0);
    }

    /// 1000 addresses as allocators hand them out: 2 MiB segments, 512-byte blocks in
    /// them, and a few large strides.
    fn spread_keys() -> Vec<u64> {
        let segments = (0..400u64).map(|i| 0x7f3a_0000_0000 + (i << 21));
        let blocks = (0..400u64).map(|i| 0x7f40_0020_0000 + (i << 9));
        let large = (0..200u64).map(|i| 0x7e00_0000_0000 + i * 0x1234_5000);
        segments.chain(blocks).chain(large).collect()
    }

    #[test]
    fn addresses_spread_over_the_table_and_never_need_the_overflow() {
        let t: AddrTable<4096> = AddrTable::new();
        let keys = spread_keys();
        for (i, &k) in keys.iter().enumerate() {
            t.insert(
                k,
                Entry {
                    bytes: i as u64,
                    device: 2,
                    kind: Kind::Direct,
                },
            );
        }
        assert_eq!(
            t.overflow_len.load(Ordering::Relaxed),
            0,
            "every address found a slot in its window"
        );
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(t.remove(k).map(|e| e.bytes), Some(i as u64));
        }
    }

    #[test]
    fn addresses_zero_and_all_ones_are_never_recorded_and_take_no_slot() {
        let t: AddrTable<WINDOW> = AddrTable::new();
        let e = |bytes| Entry {
            bytes,
            device: 0,
            kind: Kind::Direct,
        };
        t.insert(EMPTY, e(1));
        t.insert(BUSY, e(2));
        assert_eq!(t.remove(EMPTY), None);
        assert_eq!(t.remove(BUSY), None);
        // Every slot is still free: a table's worth of addresses fits in the slots.
        for k in 1..=WINDOW as u64 {
            t.insert(k << 21, e(k));
        }
        assert_eq!(t.overflow_len.load(Ordering::Relaxed), 0);
        for k in 1..=WINDOW as u64 {
            assert_eq!(t.remove(k << 21), Some(e(k)));
        }
    }

    #[test]
    fn a_purge_leaves_a_slot_being_filled_to_its_inserter() {
        let t: AddrTable<WINDOW> = AddrTable::new();
        let e = |bytes, device| Entry {
            bytes,
            device,
            kind: Kind::Direct,
        };
        // Another device's blocks fill every slot but one.
        for k in 1..WINDOW as u64 {
            t.insert(k << 21, e(k, 1));
        }
        // A thread has claimed the last slot for a block of device 0 and written its
        // value, but not yet its key.
        let slot = t
            .slots
            .iter()
            .find(|s| s.key.load(Ordering::Relaxed) == EMPTY)
            .unwrap();
        slot.key.store(BUSY, Ordering::Relaxed);
        slot.value.store(e(7, 0).pack(), Ordering::Relaxed);
        t.purge_device(0);
        // Meanwhile nobody else may take that slot.
        t.insert(0x40 << 21, e(99, 1));
        assert_eq!(
            t.overflow_len.load(Ordering::Relaxed),
            1,
            "the slot being filled was not given away"
        );
        // The inserter publishes its key: its block is found.
        slot.key.store(0x41 << 21, Ordering::Release);
        assert_eq!(t.remove(0x41 << 21), Some(e(7, 0)));
        assert_eq!(t.remove(0x40 << 21), Some(e(99, 1)));
        for k in 1..WINDOW as u64 {
            assert_eq!(t.remove(k << 21), Some(e(k, 1)));
        }
    }

    #[test]
    fn purging_a_device_drops_its_entries_in_the_overflow_too() {
        let t: AddrTable<WINDOW> = AddrTable::new();
        let keys: Vec<u64> = (1..=3 * WINDOW as u64).map(|k| k << 21).collect();
        let e = |k: u64, i: usize| Entry {
            bytes: k,
            device: i % 2,
            kind: Kind::Direct,
        };
        for (i, &k) in keys.iter().enumerate() {
            t.insert(k, e(k, i));
        }
        assert!(t.overflow_len.load(Ordering::Relaxed) > 0);
        t.purge_device(0);
        for (i, &k) in keys.iter().enumerate() {
            let want = (i % 2 == 1).then_some(e(k, i));
            assert_eq!(t.remove(k), want, "{k:#x}");
        }
        assert_eq!(t.overflow_len.load(Ordering::Relaxed), 0);
    }

    /// Puts the lanes back as they were, even when the test fails.
    struct LanesAsBefore(u32);

    impl Drop for LanesAsBefore {
        fn drop(&mut self) {
            LANES_TAKEN.store(self.0, Ordering::Release);
        }
    }

    #[test]
    fn after_a_fork_every_lane_but_the_forking_threads_is_free() {
        let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let _restore = LanesAsBefore(LANES_TAKEN.load(Ordering::Acquire));
        let held: Vec<usize> = (0..3).map(|_| claim_lane()).collect();
        let own = held[1];
        // The child has only the forking thread: the others' lanes are free again.
        lanes_after_fork(own);
        assert!(lane_free());
        let given: Vec<usize> = std::iter::from_fn(|| Some(claim_lane()))
            .take_while(|&lane| lane != 0)
            .collect();
        let expected: Vec<usize> = (1..LANES).filter(|&lane| lane != own).collect();
        assert_eq!(given, expected, "lowest first, never the forking thread's");
        assert!(!lane_free(), "every lane is taken");
        release_lane(given[0]);
        assert!(lane_free());
        assert_eq!(claim_lane(), given[0]);
        // A thread without a lane forks: every lane is free in the child.
        for own in [0, LANES] {
            lanes_after_fork(own);
            assert_eq!(claim_lane(), 1);
            assert_eq!(claim_lane(), 2);
        }
    }

    #[test]
    fn a_threads_lane_holds_a_thousand_spread_blocks() {
        let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        static T: LaneTable<4096> = LaneTable::new();
        let lane = claim_lane();
        let keys = spread_keys();
        for (i, &k) in keys.iter().enumerate() {
            assert!(T.insert(k, pooled(i as u64), lane), "no room for {k:#x}");
        }
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(T.remove(k, lane), Some(pooled(i as u64)));
        }
        release_lane(lane);
    }

    #[test]
    fn lanes_never_record_or_find_addresses_zero_and_all_ones() {
        let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        static T: LaneTable<64> = LaneTable::new();
        static M: PointerMap = PointerMap::new();
        let lane = claim_lane();
        for key in [EMPTY, BUSY] {
            assert!(!T.insert(key, pooled(1), lane));
            assert_eq!(T.remove(key, lane), None);
            assert_eq!(T.remove(key, 0), None);
            assert!(!M.insert_own(key, pooled(1), lane));
            assert_eq!(M.remove_own(key, lane), None);
            assert_eq!(M.remove_pooled(key, lane), None);
            assert_eq!(Table::remove(&M, key), None);
        }
        release_lane(lane);
    }

    #[test]
    fn a_block_recorded_in_its_threads_lane_is_found_there() {
        let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        static M: PointerMap = PointerMap::new();
        let lane = claim_lane();
        let other = claim_lane();
        let key = 0x7f00_0000_0000;
        assert!(M.insert_own(key, pooled(5), lane));
        assert_eq!(M.remove_own(key, other), None, "not in another lane");
        assert_eq!(M.remove_own(key, lane), Some(pooled(5)));
        assert_eq!(M.remove_own(key, lane), None);
        assert!(!M.insert_own(key, pooled(5), 0), "lane 0 is no lane");
        // A block left in the lane by its thread is found by another's.
        assert!(M.insert_own(key, pooled(6), lane));
        assert_eq!(M.remove_pooled(key, other), Some(pooled(6)));
        release_lane(lane);
        release_lane(other);
    }

    #[test]
    fn purging_a_device_drops_its_blocks_from_the_lanes_and_the_shared_table() {
        let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        static M: PointerMap = PointerMap::new();
        let lane = claim_lane();
        let e = |device| Entry {
            bytes: 64,
            device,
            kind: Kind::Pooled,
        };
        let device_of = |k: u64| 4 + (k % 2) as usize;
        let shared = |k: u64| (k << 21) | 0x1000_0000_0000;
        for k in 1..=40u64 {
            M.insert_in_lane(k << 21, e(device_of(k)), lane);
            Table::insert(&M, shared(k), e(device_of(k)));
        }
        M.purge_device(4);
        for k in 1..=40u64 {
            let want = (device_of(k) == 5).then_some(e(5));
            assert_eq!(M.remove_pooled(k << 21, lane), want, "lane, {k}");
            assert_eq!(Table::remove(&M, shared(k)), want, "shared, {k}");
        }
        release_lane(lane);
    }

    #[test]
    fn retiring_credit_never_carries_into_the_books_epoch() {
        let d = device(100);
        d.epoch.store((7 << 32) | 0xffff_ffff, Ordering::Relaxed);
        let before = d.epoch();
        d.retire_credit();
        assert_eq!(d.books_epoch(), 7);
        assert!(d.same_books(before));
        assert_ne!(d.epoch(), before, "the credit given before is retired");
    }
}
