//! Waits: a device's queue of waiting threads, in arrival order, with heartbeats.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::sys::{clock::monotonic_ms, futex};

use super::words::*;

impl Job {
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

/// A thread's place in a device's queue of waiters.
pub struct Turn<'a> {
    job: &'a Job,
    device: usize,
    pub(super) entry: Option<usize>,
    ticket: u64,
}

impl Turn<'_> {
    /// Whether no live waiter with a fresh heartbeat came before this one.
    pub(super) fn first(&self, now: u64) -> bool {
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
