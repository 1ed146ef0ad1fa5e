//! The pointer map: the blocks the fast paths record (stream-ordered ones, and
//! `cuMemAlloc`'s past a thread's first) in their threads' lanes, the rest in the address
//! table.

use super::addresses::*;
use super::entries::*;
use super::lanes::*;

/// Buckets of a lane's region in the [`PointerMap`].
const LANE_BUCKETS: usize = 4096;
/// A lane's region of the [`PointerMap`].
pub type OwnRegion = Region<LANE_BUCKETS>;

/// Device pointers from every allocation path: what the fast paths record (stream-ordered
/// blocks, synchronous ones) of threads with a lane in the [`LaneTable`], everything else
/// in the [`AddrTable`].
pub struct PointerMap {
    /// 4096 buckets of 4 slots a lane: 16 384 blocks a thread (16 MiB of address space,
    /// touched only where used).
    lanes: LaneTable<LANE_BUCKETS>,
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

    /// The region of the calling thread's own `lane` (1..[`LANES`]), where it records its
    /// stream-ordered blocks itself ([`OwnRegion::insert`]) and finds them again
    /// ([`OwnRegion::take`]); `None` for no lane. A block not found there may still be
    /// elsewhere ([`PointerMap::remove_pooled`]).
    #[cfg(test)]
    pub const fn own_region(&self, lane: usize) -> Option<&OwnRegion> {
        self.lanes.own_region(lane)
    }

    /// Lane `lane`'s region (0..[`LANES`]), whoever holds it: what the gate's line of
    /// the lane points to. Lane 0's is nobody's and stays empty.
    pub const fn region(&self, lane: usize) -> Option<&OwnRegion> {
        self.lanes.region(lane)
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
    pub fn remove_pooled(&self, key: u64, hint: usize, open: fn(usize)) -> Option<Entry> {
        match self.lanes.remove(key, hint, open) {
            Some(entry) => Some(entry),
            None => self.shared.remove(key),
        }
    }
}

impl Table for PointerMap {
    #[inline]
    fn insert(&self, key: u64, entry: Entry) {
        self.shared.insert(key, entry);
    }

    #[inline]
    fn remove(&self, key: u64, open: fn(usize)) -> Option<Entry> {
        match self.shared.remove(key) {
            Some(entry) => Some(entry),
            None => self.lanes.remove_elsewhere(key, 0, open),
        }
    }
}

impl Default for PointerMap {
    fn default() -> Self {
        Self::new()
    }
}
