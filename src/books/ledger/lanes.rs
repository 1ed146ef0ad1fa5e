//! Lanes: each thread's own buckets of the blocks its fast paths record (stream-ordered,
//! and synchronous), written by it alone.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::entries::*;

/// Lanes of the [`LaneTable`]: lane 0 is nobody's; 1..LANES go to allocating threads.
pub const LANES: usize = 32;
/// Slots of a bucket: one cache line (16-byte slots).
pub(super) const BUCKET: usize = 4;
/// Lanes given to a thread (bit L = lane L); lane 0 is never given.
pub(super) static LANES_TAKEN: AtomicU32 = AtomicU32::new(1);
/// The highest lane ever given: no entry lies in a higher one, so lookups stop there.
/// It never goes down: after a burst of many threads, lookups of blocks freed by another
/// thread (or never recorded) look at that many lanes.
pub(super) static HIGH_LANE: AtomicUsize = AtomicUsize::new(0);

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
pub(super) struct Bucket([Slot; BUCKET]);

/// An address table without a compare-and-swap on insert, for the stream-ordered hot
/// path. Each lane has a region of its own; the thread that holds lane L (see
/// [`claim_lane`]) is the only one that fills an empty slot of region L, so it fills it
/// with plain stores, and threads never write each other's cache lines when the driver
/// hands one address to one thread after another. A key lies in one bucket (one cache
/// line) of a region; when its bucket in the inserting lane is full the caller uses an
/// [`AddrTable`] instead.
///
/// Any thread removes, looking in its own lane first, each entry taken by one thread
/// alone ([`Region::take`]). The lane's own thread may take with plain stores
/// ([`Region::take_own`]) until another thread takes from its region: before it does,
/// that thread has the lane opened (the `open` its caller passes to [`Self::remove`]).
pub struct LaneTable<const BUCKETS_PER_LANE: usize> {
    regions: [Region<BUCKETS_PER_LANE>; LANES],
}

/// One lane's buckets in a [`LaneTable`]: what its thread fills alone.
#[repr(transparent)]
pub struct Region<const B: usize>([Bucket; B]);

impl<const B: usize> LaneTable<B> {
    pub const fn new() -> Self {
        assert!(B.is_power_of_two() && B > 1);
        Self {
            regions: [const {
                Region(
                    [const {
                        Bucket(
                            [const {
                                Slot {
                                    key: AtomicU64::new(EMPTY),
                                    value: AtomicU64::new(0),
                                }
                            }; BUCKET],
                        )
                    }; B],
                )
            }; LANES],
        }
    }

    /// Lane `lane`'s region (0..[`LANES`]; lane 0's is nobody's and stays empty).
    pub const fn region(&self, lane: usize) -> Option<&Region<B>> {
        if lane < LANES {
            Some(&self.regions[lane])
        } else {
            None
        }
    }

    /// Lane `lane`'s region, for the thread that holds it (1..[`LANES`]).
    #[inline]
    pub const fn own_region(&self, lane: usize) -> Option<&Region<B>> {
        if lane >= 1 && lane < LANES {
            Some(&self.regions[lane])
        } else {
            None
        }
    }

    /// Records `key` in `lane`'s region; false when its bucket is full. Only the thread
    /// that holds `lane` may call this.
    #[inline(always)]
    pub fn insert(&self, key: u64, entry: Entry, lane: usize) -> bool {
        self.own_region(lane)
            .is_some_and(|region| region.insert(key, entry))
    }

    /// Removes `key` and returns its entry; `None` for an address not here. `hint` is
    /// the caller's own lane (0: none), where a block is found when its thread frees it.
    /// Before an entry is taken from another lane, `open(lane)` lets the caller take from
    /// it: the lane's thread takes from its region with plain stores until it is open.
    #[inline(always)]
    pub fn remove(&self, key: u64, hint: usize, open: fn(usize)) -> Option<Entry> {
        if key == EMPTY || key == BUSY {
            return None;
        }
        if (1..LANES).contains(&hint)
            && let Some(entry) = self.take(hint, key)
        {
            return Some(entry);
        }
        self.remove_elsewhere(key, hint, open)
    }

    /// [`Self::remove`] past the caller's own lane `hint`: the other lanes.
    #[inline(never)]
    pub fn remove_elsewhere(&self, key: u64, hint: usize, open: fn(usize)) -> Option<Entry> {
        if key == EMPTY || key == BUSY {
            return None;
        }
        // The address reached this thread through the program after its insert, and
        // with it the inserting thread's lane: HIGH_LANE is at least that lane here.
        let high = HIGH_LANE.load(Ordering::Acquire).min(LANES - 1);
        (1..=high)
            .filter(|&lane| lane != hint && self.regions[lane].holds(key))
            .find_map(|lane| {
                open(lane);
                self.take(lane, key)
            })
    }

    /// Removes `key` from `lane`'s region; `None` when it is not there (or `lane` is
    /// no lane).
    #[inline]
    pub(super) fn take(&self, lane: usize, key: u64) -> Option<Entry> {
        self.regions.get(lane)?.take(key).map(Packed::entry)
    }

    /// Drops every entry of `device`.
    pub fn purge_device(&self, device: usize) {
        let slots = self
            .regions
            .iter()
            .flat_map(|region| region.0.iter())
            .flat_map(|bucket| bucket.0.iter());
        for slot in slots {
            let key = slot.key.load(Ordering::Acquire);
            // A slot being taken (BUSY) is its taker's: emptied by it.
            if key != EMPTY
                && key != BUSY
                && Entry::unpack(slot.value.load(Ordering::Relaxed)).device == device
            {
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

impl<const B: usize> Region<B> {
    /// Fibonacci hashing: the product's top bits, as many as `B` needs.
    pub(super) fn bucket_index(key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - B.trailing_zeros())) as usize
    }

    /// Records `key` here; false when its bucket is full (or `key` is no address). Only
    /// the thread that holds this region's lane may call this: it fills an empty slot
    /// with plain stores.
    #[inline(always)]
    pub fn insert(&self, key: u64, entry: Entry) -> bool {
        if key == EMPTY || key == BUSY {
            return false;
        }
        for slot in &self.0[Self::bucket_index(key)].0 {
            if slot.key.load(Ordering::Acquire) == EMPTY {
                slot.value.store(entry.pack(), Ordering::Relaxed);
                slot.key.store(key, Ordering::Release);
                return true;
            }
        }
        false
    }

    /// Removes `key` and returns its entry as the slot held it; `None` when it is not
    /// here. Any thread may: the slot is claimed with a compare-and-swap (to `BUSY`,
    /// which no insert fills and no other taker matches), so of two threads freeing one
    /// block at once exactly one gets its entry.
    #[inline(always)]
    pub fn take(&self, key: u64) -> Option<Packed> {
        // A key never recorded: 0 would match an empty slot, BUSY one being taken.
        if key == EMPTY || key == BUSY {
            return None;
        }
        for slot in &self.0[Self::bucket_index(key)].0 {
            if let Some(value) = slot.take(key) {
                return Some(Packed(value));
            }
        }
        None
    }

    /// [`Self::take`] with plain stores, for the thread that holds this region's lane
    /// while no other thread takes from it (the lane is not open: `gate::lane_open`).
    #[inline(always)]
    pub fn take_own(&self, key: u64) -> Option<Packed> {
        if key == EMPTY {
            return None;
        }
        for slot in &self.0[Self::bucket_index(key)].0 {
            if slot.key.load(Ordering::Acquire) == key {
                let value = slot.value.load(Ordering::Relaxed);
                slot.key.store(EMPTY, Ordering::Release);
                return Some(Packed(value));
            }
        }
        None
    }

    /// Whether `key` is here now (a look, nothing taken).
    fn holds(&self, key: u64) -> bool {
        self.0[Self::bucket_index(key)]
            .0
            .iter()
            .any(|slot| slot.key.load(Ordering::Relaxed) == key)
    }
}
