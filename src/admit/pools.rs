//! The process's stream-ordered memory pools: the default pool of each device, the
//! device's current pool, and every pool from `cuMemPoolCreate`. Their reserve is what
//! stream-ordered allocations really cost the device.
//!
//! The device's *default* pool is paid for through the pool credit (see
//! [`crate::books::ledger::PoolCredit`]): its reserve is [`reserve`]. A pool the program created
//! is paid for on its own ([`created`], [`figures`], [`set_charged`]): one pool's free
//! reserve must never pay for another pool's growth, since the driver would grow the
//! other pool regardless.
//!
//! Nothing here is on the hot path except [`place_of`], and that only in a process that
//! sees more than one device or uses host pools.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::books::ledger::{DeviceLedger, MAX_DEVICES};
use crate::sys::driver::{MEMPOOL_ATTR_RESERVED_MEM_CURRENT, MemPool, Opaque, real};

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

/// What pools the program destroyed while blocks of theirs were still in use stay
/// charged, per device: the driver keeps their reserve until those blocks are freed,
/// which the library cannot follow (the pool's handle is gone). That memory is not a
/// context's either: it stays charged across a teardown of the device's contexts.
static RETIRED: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

/// A pool destroyed on `device` with blocks in use keeps its charge `bytes`.
pub fn retire(device: usize, bytes: u64) {
    if let Some(retired) = RETIRED.get(device) {
        retired.fetch_add(bytes, Ordering::AcqRel);
    }
}

/// What destroyed pools keep charged on `device` ([`retire`]).
pub fn retired(device: usize) -> u64 {
    RETIRED.get(device).map_or(0, |r| r.load(Ordering::Acquire))
}

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
pub fn register(pool: MemPool, device: usize) {
    remember(pool, device as u64 + 1);
}

/// Remembers a pool the program created on `device`.
pub fn register_created(pool: MemPool, device: usize) {
    remember(pool, (device as u64 + 1) | CREATED);
}

/// Remembers that `pool` holds host memory.
pub fn register_host(pool: MemPool) {
    if remember(pool, HOST) {
        HOST_POOLS.fetch_add(1, Ordering::AcqRel);
    }
}

fn remember(pool: MemPool, place: u64) -> bool {
    let key = key(pool);
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
pub fn unregister(pool: MemPool) -> Option<(usize, u64)> {
    let slot = slot_of(key(pool))?;
    let place = slot.place.swap(0, Ordering::AcqRel);
    let charged = slot.charged.swap(0, Ordering::AcqRel);
    slot.pool.store(0, Ordering::Release);
    if place == HOST {
        HOST_POOLS.fetch_sub(1, Ordering::AcqRel);
        return None;
    }
    for current in &CURRENT_CREATED {
        if current
            .compare_exchange(key(pool), 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            // It was a device's current pool: the detour `made_current` began ends.
            crate::admit::capture::detour(false);
        }
    }
    (place & CREATED != 0).then(|| (((place & !CREATED) - 1) as usize, charged))
}

/// The table's key of `pool`: its address.
#[inline(always)]
fn key(pool: MemPool) -> u64 {
    pool.key() as u64
}

/// The pool whose key is `key`.
fn pool_at(key: u64) -> MemPool {
    MemPool::from_raw(key as usize as *mut std::ffi::c_void)
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
pub fn place_of(pool: MemPool) -> Place {
    let single = crate::runtime::single_device();
    if single && HOST_POOLS.load(Ordering::Acquire) == 0 {
        return Place::Device(0);
    }
    let placed = |place: u64| match place {
        HOST => Place::Host,
        place => Place::Device(((place & !CREATED) - 1) as usize),
    };
    if let Some(place) = find(key(pool)) {
        return placed(place);
    }
    if single {
        return Place::Device(0);
    }
    // A device's default or current pool that we have not met yet: ask each device.
    for device in 0..crate::runtime::visible_devices().min(MAX_DEVICES) {
        let _ = credit_pools_of(device);
    }
    find(key(pool)).map_or(Place::Unknown, placed)
}

/// The device of `pool` when the program created it.
pub fn created(pool: MemPool) -> Option<usize> {
    find(key(pool))
        .filter(|&place| place != HOST && place & CREATED != 0)
        .map(|place| ((place & !CREATED) - 1) as usize)
}

/// The program made `pool` the current pool of `device`.
pub fn made_current(device: usize, pool: MemPool) {
    let Some(current) = CURRENT_CREATED.get(device) else {
        return;
    };
    let mine = created(pool).is_some_and(|d| d == device);
    let was = current.swap(if mine { key(pool) } else { 0 }, Ordering::AcqRel);
    // While any device's current pool is one the program created, stream-ordered calls
    // take the full path (which looks at it).
    match (was != 0, mine) {
        (false, true) => crate::admit::capture::detour(true),
        (true, false) => crate::admit::capture::detour(false),
        _ => {}
    }
}

/// The pool `cuMemAllocAsync` allocates from on `device` when it is one the program
/// created.
pub fn current_created(device: usize) -> Option<MemPool> {
    let pool = CURRENT_CREATED.get(device)?.load(Ordering::Acquire);
    (pool != 0).then_some(pool_at(pool))
}

/// The pools the program created on `device`.
pub fn created_of(device: usize) -> Vec<MemPool> {
    POOLS
        .iter()
        .filter(|s| s.place.load(Ordering::Acquire) == (device as u64 + 1) | CREATED)
        .map(|s| pool_at(s.pool.load(Ordering::Acquire)))
        .filter(|p| !p.is_null())
        .collect()
}

/// Sets what a created pool is charged; returns what it was.
pub fn set_charged(pool: MemPool, bytes: u64) -> u64 {
    slot_of(key(pool)).map_or(0, |s| s.charged.swap(bytes, Ordering::AcqRel))
}

/// Charges a pool the program created what it holds now, by the driver's figure.
pub fn settle_created(pool: MemPool, d: &DeviceLedger) {
    if let Some((reserved, _)) = figures(pool) {
        let before = set_charged(pool, reserved);
        super::after::charge_after(d, before, reserved);
    }
}

/// A pool's reserve and the part of it in use, by the driver: `(reserved, used)`.
pub fn figures(pool: MemPool) -> Option<(u64, u64)> {
    let attribute = |attr| {
        let mut bytes = 0u64;
        // SAFETY: both attributes are a cuuint64_t written to `bytes`.
        let rc =
            unsafe { real::cuMemPoolGetAttribute(pool, attr, (&mut bytes as *mut u64).cast()) };
        rc.is_ok().then_some(bytes)
    };
    crate::admit::capture::relaxed(|| {
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
fn credit_pools_of(device: usize) -> Vec<MemPool> {
    let mut pools = Vec::new();
    let mut pool = MemPool::NULL;
    // SAFETY: a valid out-pointer; the device ordinal is the device handle.
    if unsafe { real::cuDeviceGetDefaultMemPool(&mut pool, device as i32) }.is_ok() {
        register(pool, device);
        pools.push(pool);
    }
    let mut current = MemPool::NULL;
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
    crate::admit::capture::relaxed(|| {
        let mut total = 0u64;
        for pool in credit_pools_of(device) {
            total = total.saturating_add(figures(pool)?.0);
        }
        Some(total)
    })
}

/// What the device's credit-paid pools have in use (blocks not freed), by the driver.
pub fn in_use(device: usize) -> Option<u64> {
    crate::admit::capture::relaxed(|| {
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
    crate::admit::capture::relaxed(|| trim_each(credit_pools_of(device)));
}

/// Asks the pools the program created on `device` to give back what they do not use.
pub fn trim_created(device: usize) {
    crate::admit::capture::relaxed(|| trim_each(created_of(device)));
}

fn trim_each(pools: Vec<MemPool>) {
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
    for retired in &RETIRED {
        retired.store(0, Ordering::Release);
    }
    for current in &CURRENT_CREATED {
        current.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The pools are process-wide: each test uses handles and devices of its own, and the
    // tests that make pools current (which moves the gate's detours) also take the
    // gate's turn (after their own).

    fn handle(n: u64) -> MemPool {
        pool_at(n)
    }

    /// The tests take turns: one of them forgets every pool, as a forked child does.
    fn serial() -> std::sync::MutexGuard<'static, ()> {
        static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
        TURN.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    #[test]
    fn a_device_pool_is_found_on_its_device_and_is_not_a_created_one() {
        let _turn = serial();
        let (default, created_pool) = (handle(0x1_0001), handle(0x1_0002));
        register(default, 3);
        register_created(created_pool, 4);
        assert_eq!(find(key(default)), Some(4), "device 3 is stored as 4");
        assert_eq!(find(key(created_pool)), Some(5 | CREATED));
        assert_eq!(
            created(default),
            None,
            "a default pool is not the program's"
        );
        assert_eq!(created(created_pool), Some(4));
        assert_eq!(created(handle(0x1_0003)), None, "never registered");
        assert_eq!(
            unregister(default),
            None,
            "a default pool owes nothing back"
        );
        assert_eq!(find(key(default)), None, "forgotten");
        assert_eq!(unregister(created_pool).map(|(d, _)| d), Some(4));
        assert_eq!(unregister(created_pool), None, "only once");
    }

    #[test]
    fn a_destroyed_created_pool_gives_back_its_device_and_charge() {
        let _turn = serial();
        let pool = handle(0x2_0001);
        register_created(pool, 2);
        assert_eq!(set_charged(pool, 123), 0, "a new pool is charged nothing");
        assert_eq!(set_charged(pool, 456), 123, "returns what it was");
        assert_eq!(unregister(pool), Some((2, 456)));
        assert_eq!(set_charged(pool, 1), 0, "an unknown pool has no charge");
        assert_eq!(created(pool), None);
    }

    #[test]
    fn a_pool_is_remembered_once_and_never_the_null_handle() {
        let _turn = serial();
        let pool = handle(0x3_0001);
        assert!(remember(pool, 9), "a new pool");
        assert!(!remember(pool, 10), "already known");
        assert_eq!(find(key(pool)), Some(9), "the first place stands");
        assert!(!remember(handle(0), 9), "the null handle is no pool");
        assert_eq!(find(0), None);
        assert_eq!(unregister(handle(0)), None);
        unregister(pool);
    }

    #[test]
    fn each_pool_is_found_in_its_own_slot() {
        let _turn = serial();
        let pools = [handle(0x4_0001), handle(0x4_0002), handle(0x4_0003)];
        for (i, &p) in pools.iter().enumerate() {
            register(p, 20 + i);
        }
        for (i, &p) in pools.iter().enumerate() {
            assert_eq!(find(key(p)), Some(21 + i as u64), "pool #{i}");
        }
        for p in pools {
            unregister(p);
        }
        for p in pools {
            assert_eq!(find(key(p)), None);
        }
    }

    #[test]
    fn host_pools_are_counted_once_and_are_no_devices() {
        let _turn = serial();
        // The only test with host pools.
        let pool = handle(0x5_0001);
        let (device_pool, created_pool) = (handle(0x5_0002), handle(0x5_0003));
        register(device_pool, 5);
        register_created(created_pool, 6);
        // Without a driver (a unit test) the process does not see a single device: the
        // pools are looked up.
        assert_eq!(place_of(device_pool), Place::Device(5));
        assert_eq!(place_of(created_pool), Place::Device(6));
        assert_eq!(place_of(handle(0x5_0004)), Place::Unknown, "never met");
        let before = HOST_POOLS.load(Ordering::Acquire);
        register_host(pool);
        assert_eq!(place_of(pool), Place::Host);
        assert_eq!(place_of(device_pool), Place::Device(5));
        assert_eq!(HOST_POOLS.load(Ordering::Acquire), before + 1);
        register_host(pool);
        assert_eq!(
            HOST_POOLS.load(Ordering::Acquire),
            before + 1,
            "known already"
        );
        assert_eq!(find(key(pool)), Some(HOST));
        assert_eq!(
            created(pool),
            None,
            "host memory is not the program's device pool"
        );
        assert_eq!(unregister(pool), None);
        assert_eq!(HOST_POOLS.load(Ordering::Acquire), before);
        unregister(device_pool);
        unregister(created_pool);
    }

    #[test]
    fn created_of_lists_only_the_pools_the_program_created_on_that_device() {
        let _turn = serial();
        let (mine, other_device, default) = (handle(0x6_0001), handle(0x6_0002), handle(0x6_0003));
        register_created(mine, 31);
        register_created(other_device, 30);
        register(default, 31);
        assert_eq!(created_of(31), vec![mine]);
        assert_eq!(created_of(30), vec![other_device]);
        assert_eq!(created_of(32), Vec::<MemPool>::new());
        for p in [mine, other_device, default] {
            unregister(p);
        }
        assert_eq!(created_of(31), Vec::<MemPool>::new());
    }

    #[test]
    fn a_created_pool_made_current_is_the_one_async_allocations_use() {
        let _turn = serial();
        let _gate = crate::admit::gate::turn();
        let (mine, elsewhere, default) = (handle(0x7_0001), handle(0x7_0002), handle(0x7_0003));
        register_created(mine, 40);
        register_created(elsewhere, 41);
        register(default, 40);
        assert_eq!(current_created(40), None);
        assert!(!crate::admit::gate::detours());
        made_current(40, mine);
        assert_eq!(current_created(40), Some(mine));
        assert!(
            crate::admit::gate::detours(),
            "async calls take the full path"
        );
        made_current(40, mine);
        made_current(40, default);
        assert_eq!(
            current_created(40),
            None,
            "the default pool is current again"
        );
        assert!(
            !crate::admit::gate::detours(),
            "the detour is off again (once)"
        );
        made_current(40, elsewhere);
        assert_eq!(current_created(40), None, "a pool of another device");
        assert!(!crate::admit::gate::detours());
        made_current(40, mine);
        assert!(crate::admit::gate::detours());
        assert_eq!(unregister(mine).map(|(d, _)| d), Some(40));
        assert_eq!(
            current_created(40),
            None,
            "a destroyed pool is current nowhere"
        );
        // `unregister` leaves the detour on (stream-ordered calls keep the full path: a
        // cost, not a hole); this test's own share is taken back here.
        crate::admit::capture::detour(false);
        unregister(elsewhere);
        unregister(default);
    }

    #[test]
    fn a_forked_child_knows_none_of_its_parents_pools() {
        let _turn = serial();
        let _gate = crate::admit::gate::turn();
        let (created_pool, host) = (handle(0x8_0001), handle(0x8_0002));
        register_created(created_pool, 50);
        set_charged(created_pool, 77);
        register_host(host);
        made_current(50, created_pool);
        after_fork();
        assert_eq!(find(key(created_pool)), None);
        assert_eq!(created(created_pool), None);
        assert_eq!(set_charged(created_pool, 1), 0, "no charge carried over");
        assert_eq!(find(key(host)), None);
        assert_eq!(HOST_POOLS.load(Ordering::Acquire), 0);
        assert_eq!(current_created(50), None);
        assert_eq!(created_of(50), Vec::<MemPool>::new());
        // The detour the parent's current pool turned on is the capture module's to
        // reset in a child; this test's share is taken back here.
        crate::admit::capture::detour(false);
    }
}
