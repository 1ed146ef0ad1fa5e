//! Virtual memory management (`cuMemCreate`, `cuMemMap`, `cuMemUnmap`, `cuMemRelease`):
//! which physical handles the process holds and where they are mapped.
//!
//! Physical memory returns to the device only when its handle has been released *and*
//! every mapping of it is gone; until then it stays charged. Pure bookkeeping behind one
//! lock: these calls cost microseconds in the driver, so a lock here is noise.

use std::collections::BTreeMap;

use crate::sys::lock::{Guard, Lock};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Physical {
    bytes: u64,
    device: usize,
    mappings: u32,
    /// References to the handle: one from `cuMemCreate`, one more for each
    /// `cuMemRetainAllocationHandle`; each `cuMemRelease` drops one.
    refs: u32,
}

/// Handles and mappings.
pub struct Vmm {
    handles: BTreeMap<u64, Physical>,
    /// Mapping start → (length, handle).
    mappings: BTreeMap<u64, (u64, u64)>,
}

/// Memory that went back to a device: `(device, bytes)`.
pub type Returned = Option<(usize, u64)>;

impl Vmm {
    pub const fn new() -> Self {
        Self {
            handles: BTreeMap::new(),
            mappings: BTreeMap::new(),
        }
    }

    pub fn created(&mut self, handle: u64, bytes: u64, device: usize) {
        self.handles.insert(
            handle,
            Physical {
                bytes,
                device,
                mappings: 0,
                refs: 1,
            },
        );
    }

    pub fn mapped(&mut self, start: u64, len: u64, handle: u64) {
        if let Some(p) = self.handles.get_mut(&handle) {
            p.mappings += 1;
            self.mappings.insert(start, (len, handle));
        }
    }

    /// Every mapping that starts inside `[start, start + len)` is gone.
    pub fn unmapped(&mut self, start: u64, len: u64) -> Vec<(usize, u64)> {
        let end = start.saturating_add(len.max(1));
        let gone: Vec<u64> = self.mappings.range(start..end).map(|(&k, _)| k).collect();
        let mut returned = Vec::new();
        for key in gone {
            if let Some((_, handle)) = self.mappings.remove(&key) {
                if let Some(p) = self.handles.get_mut(&handle) {
                    p.mappings = p.mappings.saturating_sub(1);
                }
                returned.extend(self.settle(handle));
            }
        }
        returned
    }

    /// `cuMemRetainAllocationHandle` gave out one more reference to `handle`.
    pub fn retained(&mut self, handle: u64) {
        if let Some(p) = self.handles.get_mut(&handle) {
            p.refs = p.refs.saturating_add(1);
        }
    }

    pub fn released(&mut self, handle: u64) -> Returned {
        let p = self.handles.get_mut(&handle)?;
        p.refs = p.refs.saturating_sub(1);
        self.settle(handle)
    }

    fn settle(&mut self, handle: u64) -> Returned {
        let p = *self.handles.get(&handle)?;
        if p.refs == 0 && p.mappings == 0 {
            self.handles.remove(&handle);
            return Some((p.device, p.bytes));
        }
        None
    }

    /// What the handles of `device` hold (they outlive its contexts).
    pub fn bytes_on(&self, device: usize) -> u64 {
        self.handles
            .values()
            .filter(|p| p.device == device)
            .fold(0u64, |total, p| total.saturating_add(p.bytes))
    }
}

impl Default for Vmm {
    fn default() -> Self {
        Self::new()
    }
}

static VMM: Lock<Vmm> = Lock::new(Vmm::new());

/// The process's handles, locked.
pub fn lock() -> Guard<'static, Vmm> {
    VMM.lock()
}

/// In the child of `fork()`: no handles (they are the parent's), and no lock held.
///
/// # Safety
/// Only from an at-fork child handler.
pub unsafe fn reset_in_child() {
    // SAFETY: the caller's guarantee.
    unsafe { VMM.reset_in_child(Vmm::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_returns_only_when_released_and_unmapped() {
        let mut v = Vmm::new();
        v.created(7, 100, 0);
        v.mapped(0x1000, 100, 7);
        assert_eq!(v.released(7), None);
        assert_eq!(v.unmapped(0x1000, 100), vec![(0, 100)]);
    }

    #[test]
    fn unmapping_first_then_releasing_also_returns_it() {
        let mut v = Vmm::new();
        v.created(7, 100, 1);
        v.mapped(0x1000, 100, 7);
        assert!(v.unmapped(0x1000, 100).is_empty());
        assert_eq!(v.released(7), Some((1, 100)));
    }

    #[test]
    fn a_handle_mapped_twice_needs_both_unmapped() {
        let mut v = Vmm::new();
        v.created(7, 100, 0);
        v.mapped(0x1000, 100, 7);
        v.mapped(0x9000, 100, 7);
        v.released(7);
        assert!(v.unmapped(0x1000, 100).is_empty());
        assert_eq!(v.unmapped(0x9000, 100), vec![(0, 100)]);
    }

    #[test]
    fn one_unmap_can_cover_several_mappings() {
        let mut v = Vmm::new();
        for h in 1..=3u64 {
            v.created(h, 20, 0);
            v.mapped(h * 0x100, 20, h);
            v.released(h);
        }
        assert_eq!(v.unmapped(0x100, 0x300).len(), 3);
    }

    #[test]
    fn a_retained_handle_needs_every_reference_released() {
        let mut v = Vmm::new();
        v.created(7, 100, 0);
        v.mapped(0x1000, 100, 7);
        v.retained(7);
        assert_eq!(v.released(7), None, "the retain's reference is still out");
        assert!(v.unmapped(0x1000, 100).is_empty());
        v.mapped(0x1000, 100, 7);
        assert!(v.unmapped(0x1000, 100).is_empty());
        assert_eq!(v.released(7), Some((0, 100)));
    }

    #[test]
    fn unknown_handles_and_ranges_change_nothing() {
        let mut v = Vmm::new();
        assert_eq!(v.released(42), None);
        v.mapped(0x1000, 10, 42);
        assert!(v.unmapped(0x1000, 10).is_empty());
        v.created(1, 10, 0);
        assert_eq!(v.released(1), Some((0, 10)));
        assert_eq!(v.released(1), None);
    }

    #[test]
    fn each_device_holds_the_bytes_of_its_live_handles() {
        let mut v = Vmm::new();
        v.created(1, 100, 0);
        v.mapped(0x1000, 100, 1);
        v.created(2, 200, 1);
        v.created(3, 50, 0);
        assert_eq!(v.bytes_on(0), 150);
        assert_eq!(v.bytes_on(1), 200);
        assert_eq!(v.released(3), Some((0, 50)));
        assert_eq!(
            v.bytes_on(0),
            100,
            "a released, unmapped handle holds nothing"
        );
        assert_eq!(v.released(1), None, "still mapped");
        assert_eq!(v.bytes_on(0), 100);
        assert_eq!(v.bytes_on(5), 0);
    }
}
