//! Shares: what each member holds, admission against the job's budget (Dekker's order
//! under a lock that only orders admitters), and the job's budget words.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudabudget_spec::job_file as layout;

use crate::sys::futex;

use super::words::*;

impl Job {
    /// Slot `i`'s share on `device`, read conservatively (the larger of its two words).
    pub(super) fn share_of(&self, i: usize, device: usize) -> u64 {
        layout::Words::share(self, i, device)
    }

    /// What the job holds on `device`: the sum of the slots' shares.
    pub fn used(&self, device: usize) -> u64 {
        layout::Words::used(self, device)
    }

    /// What this process holds on `device`, by its own books (asked by the tests).
    #[cfg(test)]
    pub fn own(&self, device: usize) -> u64 {
        self.mine[device].load(Ordering::Acquire)
    }

    /// Changes what this process holds on `device` by `f` and writes it to its slot
    /// (restoring the slot if something else wrote there). Never waits for another
    /// process. Returns (before, after).
    pub(super) fn update(
        &self,
        device: usize,
        f: impl FnOnce(u64) -> Option<u64>,
    ) -> Option<(u64, u64)> {
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
    pub(super) fn lock(&self, device: usize) -> AdmitGuard<'_> {
        static TAGS: AtomicU32 = AtomicU32::new(0);
        thread_local! {
            static TAG: u64 = u64::from(TAGS.fetch_add(1, Ordering::Relaxed) & 0xFFFF) << 16;
        }
        let me = self.lock_id | TAG.with(|t| *t);
        let word = &self.device(device).lock;
        let began = Instant::now();
        let mut backoff = crate::sys::lock::Backoff::default();
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
            backoff.pause();
        }
    }

    /// Whether lock word `held` names a slot's current claim.
    pub(super) fn names_a_claim(&self, held: u64) -> bool {
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

    pub(super) fn holder_alive(&self, held: u64) -> bool {
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

    pub(super) fn try_reserve(&self, device: usize, bytes: u64, budget: u64) -> Result<(), u64> {
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
        layout::Words::budget(self, device)
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
    pub(super) fn wake(&self, device: usize) {
        let word = self.device(device);
        word.wake.fetch_add(1, Ordering::Release);
        if word.waiters.load(Ordering::Acquire) != 0 {
            futex::wake_all(&word.wake);
        }
    }
}

/// A device's admission lock, held (or taken over from a holder that lost it).
pub(super) struct AdmitGuard<'a> {
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

/// The ledger's words through the mapping, read sequentially consistent (an admission
/// sums the shares after adding its own: Dekker's order, see the module's docs).
impl layout::Words for Job {
    fn word64(&self, at: usize) -> u64 {
        Job::word64(self, at).load(Ordering::SeqCst)
    }
}
