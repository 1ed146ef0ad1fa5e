//! Pool credit: what the pools' reserve paid for, in shards a thread takes from
//! without a lock, and the bank they refill from.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use crate::sys::lock::{Guard, Lock};

/// The largest stream-ordered request the credit can record: no budget holds 2^62
/// bytes, and below it no shard can come near overflow.
pub(super) const TAKE_MAX: u64 = 1 << 62;

/// Shards of pool credit; a thread keeps to one.
pub const POOL_SHARDS: usize = 32;
/// What a shard takes from the bank at a time, so that most allocations touch only the
/// thread's own shard.
pub(super) const POOL_REFILL: i64 = 64 << 20;

#[repr(align(64))]
pub(super) struct Shard(AtomicI64);

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
    pub(super) const fn new() -> Self {
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

    pub(super) fn clear(&self) {
        let mut bank = self.bank.lock();
        self.zero();
        *bank = 0;
    }

    pub(super) fn zero(&self) {
        for shard in &self.shards {
            shard.0.store(0, Ordering::Release);
        }
        self.charge.store(0, Ordering::Release);
    }

    /// As [`Self::clear`] in the child of `fork()`: stores only.
    ///
    /// # Safety
    /// As [`Lock::reset_in_child`].
    pub(super) unsafe fn clear_in_child(&self) {
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
