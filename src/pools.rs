//! The process's stream-ordered memory pools: the default pool of each device, the
//! device's current pool, and every pool from `cuMemPoolCreate`. Their reserve is what
//! stream-ordered allocations really cost the device.
//!
//! The device's *default* pool is paid for through the pool credit (see
//! [`crate::ledger::PoolCredit`]): its reserve is [`reserve`]. A pool the program created
//! is paid for on its own ([`created`], [`figures`], [`set_charged`]): one pool's free
//! reserve must never pay for another pool's growth, since the driver would grow the
//! other pool regardless.
//!
//! Nothing here is on the hot path except [`place_of`], and that only in a process that
//! sees more than one device or uses host pools.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::driver::{Handle, MEMPOOL_ATTR_RESERVED_MEM_CURRENT, real};
use crate::ledger::{DeviceLedger, MAX_DEVICES};

const SLOTS: usize = 64;

/// One known pool: its handle (0 = free slot), where it lives (`device + 1`, [`HOST`],
/// with [`CREATED`] set for a pool from `cuMemPoolCreate`) and what it is charged.
struct Slot {
    pool: AtomicU64,
    place: AtomicU64,
    charged: AtomicU64,
}

static POOLS: [Slot; SLOTS] = [const {
    Slot {
        pool: AtomicU64::new(0),
        place: AtomicU64::new(0),
        charged: AtomicU64::new(0),
    }
}; SLOTS];

/// The place stored for a pool whose memory is not device memory.
const HOST: u64 = u64::MAX;
/// Set in the place of a pool the program created.
const CREATED: u64 = 1 << 40;
/// Pools registered with [`HOST`]: while there are none, a single-device process needs
/// no lookup at all.
static HOST_POOLS: AtomicU64 = AtomicU64::new(0);

/// The pool the program made current on each device (`cuDeviceSetMemPool`), when it is
/// one it created (0 otherwise): `cuMemAllocAsync` then allocates from that pool.
static CURRENT_CREATED: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

/// Where a pool's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    Device(usize),
    /// Host memory (`CU_MEM_LOCATION_TYPE_HOST*`): not ours to budget.
    Host,
    /// A pool we never saw created (the current device's, then).
    Unknown,
}

/// Remembers that `pool` (a device's default or current pool) lives on `device`.
pub fn register(pool: Handle, device: usize) {
    remember(pool, device as u64 + 1);
}

/// Remembers a pool the program created on `device`.
pub fn register_created(pool: Handle, device: usize) {
    remember(pool, (device as u64 + 1) | CREATED);
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
    for slot in &POOLS {
        if slot
            .pool
            .compare_exchange(0, key, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            slot.charged.store(0, Ordering::Release);
            slot.place.store(place, Ordering::Release);
            return true;
        }
    }
    false
}

/// Forgets a destroyed pool; for a pool the program created, returns its device and
/// what it was charged.
pub fn unregister(pool: Handle) -> Option<(usize, u64)> {
    let slot = slot_of(pool as u64)?;
    let place = slot.place.swap(0, Ordering::AcqRel);
    let charged = slot.charged.swap(0, Ordering::AcqRel);
    slot.pool.store(0, Ordering::Release);
    if place == HOST {
        HOST_POOLS.fetch_sub(1, Ordering::AcqRel);
        return None;
    }
    for current in &CURRENT_CREATED {
        let _ = current.compare_exchange(pool as u64, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
    (place & CREATED != 0).then(|| (((place & !CREATED) - 1) as usize, charged))
}

fn slot_of(key: u64) -> Option<&'static Slot> {
    if key == 0 {
        return None;
    }
    POOLS
        .iter()
        .find(|s| s.pool.load(Ordering::Acquire) == key && s.place.load(Ordering::Acquire) != 0)
}

fn find(key: u64) -> Option<u64> {
    slot_of(key).map(|s| s.place.load(Ordering::Acquire))
}

/// Where `pool` allocates.
#[inline]
pub fn place_of(pool: Handle) -> Place {
    let single = crate::runtime::single_device();
    if single && HOST_POOLS.load(Ordering::Acquire) == 0 {
        return Place::Device(0);
    }
    let placed = |place: u64| match place {
        HOST => Place::Host,
        place => Place::Device(((place & !CREATED) - 1) as usize),
    };
    if let Some(place) = find(pool as u64) {
        return placed(place);
    }
    if single {
        return Place::Device(0);
    }
    // A device's default or current pool that we have not met yet: ask each device.
    for device in 0..crate::runtime::visible_devices().min(MAX_DEVICES) {
        let _ = credit_pools_of(device);
    }
    find(pool as u64).map_or(Place::Unknown, placed)
}

/// The device of `pool` when the program created it.
pub fn created(pool: Handle) -> Option<usize> {
    find(pool as u64)
        .filter(|&place| place != HOST && place & CREATED != 0)
        .map(|place| ((place & !CREATED) - 1) as usize)
}

/// The program made `pool` the current pool of `device`.
pub fn made_current(device: usize, pool: Handle) {
    let Some(current) = CURRENT_CREATED.get(device) else {
        return;
    };
    let mine = created(pool).is_some_and(|d| d == device);
    let was = current.swap(if mine { pool as u64 } else { 0 }, Ordering::AcqRel);
    // While any device's current pool is one the program created, stream-ordered calls
    // take the full path (which looks at it).
    match (was != 0, mine) {
        (false, true) => crate::capture::detour(true),
        (true, false) => crate::capture::detour(false),
        _ => {}
    }
}

/// The pool `cuMemAllocAsync` allocates from on `device` when it is one the program
/// created.
pub fn current_created(device: usize) -> Option<Handle> {
    let pool = CURRENT_CREATED.get(device)?.load(Ordering::Acquire);
    (pool != 0).then_some(pool as Handle)
}

/// The pools the program created on `device`.
pub fn created_of(device: usize) -> Vec<Handle> {
    POOLS
        .iter()
        .filter(|s| s.place.load(Ordering::Acquire) == (device as u64 + 1) | CREATED)
        .map(|s| s.pool.load(Ordering::Acquire) as Handle)
        .filter(|p| !p.is_null())
        .collect()
}

/// Sets what a created pool is charged; returns what it was.
pub fn set_charged(pool: Handle, bytes: u64) -> u64 {
    slot_of(pool as u64).map_or(0, |s| s.charged.swap(bytes, Ordering::AcqRel))
}

/// Charges a pool the program created what it holds now, by the driver's figure.
pub fn settle_created(pool: Handle, d: &DeviceLedger) {
    if let Some((reserved, _)) = figures(pool) {
        let before = set_charged(pool, reserved);
        if reserved >= before {
            d.charge(reserved - before);
        } else {
            d.release(before - reserved);
        }
    }
}

/// A pool's reserve and the part of it in use, by the driver: `(reserved, used)`.
pub fn figures(pool: Handle) -> Option<(u64, u64)> {
    let attribute = |attr| {
        let mut bytes = 0u64;
        // SAFETY: both attributes are a cuuint64_t written to `bytes`.
        let rc =
            unsafe { real::cuMemPoolGetAttribute(pool, attr, (&mut bytes as *mut u64).cast()) };
        rc.is_ok().then_some(bytes)
    };
    crate::capture::relaxed(|| {
        Some((
            attribute(MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            attribute(MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        ))
    })
}

/// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`.
const MEMPOOL_ATTR_USED_MEM_CURRENT: std::ffi::c_int = 7;

/// The pools of `device` paid for through the pool credit: the default pool, and the
/// current pool when it is not one the program created.
fn credit_pools_of(device: usize) -> Vec<Handle> {
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
        && created(current).is_none()
    {
        register(current, device);
        pools.push(current);
    }
    pools
}

/// What the device's credit-paid pools hold from the device, by the driver's count;
/// `None` when the driver cannot say.
pub fn reserve(device: usize) -> Option<u64> {
    crate::capture::relaxed(|| {
        let mut total = 0u64;
        for pool in credit_pools_of(device) {
            total = total.saturating_add(figures(pool)?.0);
        }
        Some(total)
    })
}

/// What the device's credit-paid pools have in use (blocks not freed), by the driver.
pub fn in_use(device: usize) -> Option<u64> {
    crate::capture::relaxed(|| {
        let mut total = 0u64;
        for pool in credit_pools_of(device) {
            total = total.saturating_add(figures(pool)?.1);
        }
        Some(total)
    })
}

/// Asks the pools of `device` paid through the pool credit (the default pool, a current
/// pool the program did not create) to give back what they hold but do not use.
pub fn trim_credit_pools(device: usize) {
    crate::capture::relaxed(|| trim_each(credit_pools_of(device)));
}

/// Asks the pools the program created on `device` to give back what they do not use.
pub fn trim_created(device: usize) {
    crate::capture::relaxed(|| trim_each(created_of(device)));
}

fn trim_each(pools: Vec<Handle>) {
    for pool in pools {
        // SAFETY: a pool handle the driver gave out.
        let _ = unsafe { real::cuMemPoolTrimTo(pool, 0) };
    }
}

/// In the child of `fork()`: the parent's pools are not the child's.
pub fn after_fork() {
    for slot in &POOLS {
        slot.pool.store(0, Ordering::Release);
        slot.place.store(0, Ordering::Release);
        slot.charged.store(0, Ordering::Release);
    }
    HOST_POOLS.store(0, Ordering::Release);
    for current in &CURRENT_CREATED {
        current.store(0, Ordering::Release);
    }
}
