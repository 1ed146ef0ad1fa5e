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

    #[cfg(test)]
    pub fn bytes(self) -> u64 {
        self.0 & SIZE_MASK
    }

    /// Its bytes, when it is an entry of the kind and device `tag` stands for
    /// ([`pooled_tag`], [`direct_tag`]) and holds at most `max` (below 2^56); `None`
    /// otherwise. One subtraction and one comparison: an entry of another kind or device
    /// differs in its top byte, so what is left is at least 2^56 (or wraps past it, since
    /// no tag is above [`NO_TAG`]).
    #[inline(always)]
    pub fn bytes_if(self, tag: u64, max: u64) -> Option<u64> {
        debug_assert!(max <= SIZE_MASK && tag & SIZE_MASK == 0);
        let bytes = self.0.wrapping_sub(tag);
        (bytes <= max).then_some(bytes)
    }
}

/// The top byte, in place, of an entry of `kind` on `device`: what [`Packed::bytes_if`]
/// matches; [`NO_TAG`] for a device no entry names.
pub const fn tag(kind: Kind, device: usize) -> u64 {
    if device < 64 {
        ((kind as u64) << 6 | device as u64) << SIZE_BITS
    } else {
        NO_TAG
    }
}

/// The tag of `device`'s stream-ordered blocks ([`tag`]).
pub const fn pooled_tag(device: usize) -> u64 {
    tag(Kind::Pooled, device)
}

/// The tag of `device`'s synchronous blocks ([`tag`]).
pub const fn direct_tag(device: usize) -> u64 {
    tag(Kind::Direct, device)
}

/// A tag no entry has: its kind bits are neither kind's.
pub const NO_TAG: u64 = 0xFF << SIZE_BITS;

/// The most bytes an entry holds as it is.
pub const ENTRY_MAX: u64 = SIZE_MASK;

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
