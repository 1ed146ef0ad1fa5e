//! What the address tables store: an entry (bytes, device, how it was charged) packed
//! in one word, and the slot that holds it.

use std::sync::atomic::{AtomicU64, Ordering};

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

pub(super) const SIZE_BITS: u32 = 56;
pub(super) const SIZE_MASK: u64 = (1 << SIZE_BITS) - 1;

impl Entry {
    /// The entry as a table's slot holds it.
    #[cfg(test)]
    pub fn packed(self) -> Packed {
        Packed(self.pack())
    }

    pub(super) fn pack(self) -> u64 {
        let kind = self.kind as u64;
        (self.bytes.min(SIZE_MASK)) | ((self.device as u64 & 0x3f) << SIZE_BITS) | (kind << 62)
    }

    pub(super) fn unpack(v: u64) -> Self {
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

/// An entry as the tables hold it, one word: what the stream-ordered fast path reads
/// without unpacking it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packed(pub(super) u64);

impl Packed {
    pub fn entry(self) -> Entry {
        Entry::unpack(self.0)
    }

    pub fn bytes(self) -> u64 {
        self.0 & SIZE_MASK
    }

    /// Whether it is a stream-ordered block of `device`: one comparison of its top byte.
    #[inline(always)]
    pub fn is_pooled_on(self, device: usize) -> bool {
        device < 64 && self.0 >> SIZE_BITS == (Kind::Pooled as u64) << 6 | device as u64
    }
}

pub(super) const EMPTY: u64 = 0;
pub(super) const BUSY: u64 = u64::MAX;

pub(super) struct Slot {
    pub(super) key: AtomicU64,
    pub(super) value: AtomicU64,
}

impl Slot {
    /// The slot's value, when it holds `key` (not `EMPTY` nor `BUSY`), and the slot given
    /// up: claimed with a compare-and-swap to `BUSY` (which no insert fills and no other
    /// taker matches), read, then emptied. Of two threads taking one key at once exactly
    /// one gets it.
    #[inline(always)]
    pub(super) fn take(&self, key: u64) -> Option<u64> {
        if self.key.load(Ordering::Relaxed) == key
            && self
                .key
                .compare_exchange(key, BUSY, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        {
            let value = self.value.load(Ordering::Relaxed);
            self.key.store(EMPTY, Ordering::Release);
            return Some(value);
        }
        None
    }
}
