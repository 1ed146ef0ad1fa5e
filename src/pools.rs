//! The process's stream-ordered memory pools: the default pool of each device, the
//! device's current pool, and every pool from `cuMemPoolCreate`. Their reserve is what
//! stream-ordered allocations really cost the device.
//!
//! Nothing here is on the hot path except [`device_of`], and that only in a process that
//! sees more than one device.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::driver::{Handle, MEMPOOL_ATTR_RESERVED_MEM_CURRENT, real};

const SLOTS: usize = 64;

/// Pools and their devices: `(pool, device + 1)`, 0 = free slot.
static POOLS: [(AtomicU64, AtomicU64); SLOTS] =
    [const { (AtomicU64::new(0), AtomicU64::new(0)) }; SLOTS];

/// The place stored for a pool whose memory is not device memory.
const HOST: u64 = u64::MAX;
/// Pools registered with [`HOST`]: while there are none, a single-device process needs
/// no lookup at all.
static HOST_POOLS: AtomicU64 = AtomicU64::new(0);

/// Where a pool's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    Device(usize),
    /// Host memory (`CU_MEM_LOCATION_TYPE_HOST*`): not ours to budget.
    Host,
    /// A pool we never saw created (the current device's, then).
    Unknown,
}

/// Remembers that `pool` lives on `device`.
pub fn register(pool: Handle, device: usize) {
    remember(pool, device as u64 + 1);
}

/// Remembers that `pool` holds host memory.
pub fn register_host(pool: Handle) {
    if remember(pool, HOST) {
        HOST_POOLS.fetch_add(1, Ordering::AcqRel);
    }
}

fn remember(pool: Handle, place: u64) -> bool {
    let key = pool as u64;
    if key == 0 || find(key).is_some() {
        return false;
    }
    for (p, d) in &POOLS {
        if p.compare_exchange(0, key, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            d.store(place, Ordering::Release);
            return true;
        }
    }
    false
}

/// Forgets a destroyed pool.
pub fn unregister(pool: Handle) {
    let key = pool as u64;
    for (p, d) in &POOLS {
        if p.load(Ordering::Acquire) == key && key != 0 {
            if d.swap(0, Ordering::AcqRel) == HOST {
                HOST_POOLS.fetch_sub(1, Ordering::AcqRel);
            }
            p.store(0, Ordering::Release);
        }
    }
}

fn find(key: u64) -> Option<u64> {
    POOLS.iter().find_map(|(p, d)| {
        (p.load(Ordering::Acquire) == key)
            .then(|| d.load(Ordering::Acquire))
            .filter(|&d| d != 0)
    })
}

/// Where `pool` allocates.
#[inline]
pub fn place_of(pool: Handle) -> Place {
    let single = crate::runtime::single_device();
    if single && HOST_POOLS.load(Ordering::Acquire) == 0 {
        return Place::Device(0);
    }
    match find(pool as u64) {
        Some(HOST) => Place::Host,
        Some(d) => Place::Device(d as usize - 1),
        None if single => Place::Device(0),
        None => Place::Unknown,
    }
}

/// Every pool of `device` we know of, the default and current ones included.
fn pools_of(device: usize) -> Vec<Handle> {
    let mut pools = Vec::new();
    let mut pool: Handle = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the device ordinal is the device handle.
    if unsafe { real::cuDeviceGetDefaultMemPool(&mut pool, device as i32) }.is_ok() {
        register(pool, device);
        pools.push(pool);
    }
    let mut current: Handle = std::ptr::null_mut();
    // SAFETY: as above.
    if unsafe { real::cuDeviceGetMemPool(&mut current, device as i32) }.is_ok()
        && !pools.contains(&current)
    {
        register(current, device);
        pools.push(current);
    }
    for (p, d) in &POOLS {
        let key = p.load(Ordering::Acquire);
        if key != 0 && d.load(Ordering::Acquire) == device as u64 + 1 {
            let handle = key as Handle;
            if !pools.contains(&handle) {
                pools.push(handle);
            }
        }
    }
    pools
}

/// What the device's pools hold from the device, by the driver's count; `None` when the
/// driver cannot say.
pub fn reserve(device: usize) -> Option<u64> {
    crate::capture::relaxed(|| reserve_now(device))
}

fn reserve_now(device: usize) -> Option<u64> {
    let mut total = 0u64;
    for pool in pools_of(device) {
        let mut bytes = 0u64;
        // SAFETY: RESERVED_MEM_CURRENT is a cuuint64_t written to `bytes`.
        let rc = unsafe {
            real::cuMemPoolGetAttribute(
                pool,
                MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                (&mut bytes as *mut u64).cast(),
            )
        };
        if !rc.is_ok() {
            return None;
        }
        total = total.saturating_add(bytes);
    }
    Some(total)
}

/// Asks every pool of `device` to give back what it holds but does not use.
pub fn trim(device: usize) {
    crate::capture::relaxed(|| {
        for pool in pools_of(device) {
            // SAFETY: a pool handle the driver gave out.
            let _ = unsafe { real::cuMemPoolTrimTo(pool, 0) };
        }
    });
}
