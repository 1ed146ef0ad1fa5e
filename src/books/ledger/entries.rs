//! What the address tables store: an entry (bytes, device, how it was charged) packed
//! in one word, and the slot that holds it.

use std::sync::atomic::AtomicU64;

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

pub(super) const EMPTY: u64 = 0;
pub(super) const BUSY: u64 = u64::MAX;

pub(super) struct Slot {
    pub(super) key: AtomicU64,
    pub(super) value: AtomicU64,
}
