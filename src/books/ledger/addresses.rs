//! The address table: a lock-free map from an address (or handle) to its entry.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use super::entries::*;
use crate::sys::lock::Lock;

/// Slots an entry may lie from its home slot; lookups never look further.
pub(super) const WINDOW: usize = 32;

/// A lock-free map from an address (or handle) to an [`Entry`]: open addressing with a
/// bounded probe window, so a lookup of an address we never saw costs at most `WINDOW`
/// probes. A slot is claimed with a compare-and-swap to `BUSY`, filled, then published;
/// a remove claims it the same way, reads it and gives it back empty (see
/// [`AddrTable::remove`]).
/// When every slot of a window is taken the entry goes to a locked overflow map, which
/// stays empty in practice.
pub struct AddrTable<const N: usize> {
    pub(super) slots: [Slot; N],
    overflow: Lock<BTreeMap<u64, u64>>,
    pub(super) overflow_len: AtomicU64,
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

    pub(super) fn home(key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize & (N - 1)
    }

    /// Records `key`. The caller guarantees `key` is not in the table (the driver never
    /// hands out a live address twice; frees remove before calling the driver).
    #[inline]
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
    /// The slot is claimed with a compare-and-swap (to `BUSY`, which no insert fills and
    /// no other remove matches), read, then given up: of two threads freeing one address
    /// at once (a double free, which the driver refuses once) exactly one gets the entry.
    /// Were both to, the one refused would put back an entry no charge stands behind,
    /// which a later free of a block at that address would give back (the books would
    /// count less than the process holds).
    #[inline]
    pub fn remove(&self, key: u64) -> Option<Entry> {
        if key == EMPTY || key == BUSY {
            return None;
        }
        let home = Self::home(key);
        for i in 0..WINDOW {
            let slot = &self.slots[(home + i) & (N - 1)];
            if let Some(value) = slot.take(key) {
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
    /// Removes `key`, one thread alone getting its entry. Before an entry is taken from
    /// a lane another thread holds, `open(lane)` (see [`super::lanes::LaneTable`]).
    fn remove(&self, key: u64, open: fn(usize)) -> Option<Entry>;
}

impl<const N: usize> Table for AddrTable<N> {
    fn insert(&self, key: u64, entry: Entry) {
        AddrTable::insert(self, key, entry)
    }
    /// No lanes here: `open` is never called.
    fn remove(&self, key: u64, _open: fn(usize)) -> Option<Entry> {
        AddrTable::remove(self, key)
    }
}
