//! THE one place where an allocation is decided. [`admit`] reserves what a request asks
//! for; when it does not fit, makes room (the process's pools and graph memory give back
//! what they hold but do not use, the footprint is read again) and reserves once more;
//! what still does not fit takes the one refusal path, [`refuse`]: the denial is noted
//! and reported, and the call gets `CUDA_ERROR_OUT_OF_MEMORY` — or, with
//! `CUDABUDGET_ON_EXCEED=warn`, the one overrun path instead, [`overrun`]: it is reserved
//! past the budget, and counted and reported. Every kind of allocation
//! asks through it, by what it asks for ([`Ask`]): a synchronous allocation, a module
//! load or a context limit ([`Fixed`], which may wait for room with
//! `CUDABUDGET_ON_EXCEED=wait:…`), `cuMemCreate` (whose driver is asked first whether it
//! would accept the request at all), a growth of a pool the program created or of graph
//! memory ([`Growth`]), a growth of the device's own pools (`flow`'s, under the pool
//! bank).
//!
//! Also here, what making room needs: the pools' charge brought to the driver's figure
//! ([`settle_charge`]) and the growth lock.
//!
//! - `flow`: the allocation and free flows built on [`admit`] (what each hook does).
//! - `after`: what is measured after the fact, charged in one place ([`after::charge_after`]).
//! - `loads`, `image`: module and library loads, and what an image places on the device.
//! - `credit`: the credit a thread keeps for its own stream-ordered allocations.
//! - `footprint`, `pools`, `graphs`, `capture`, `gate`: the driver-side figures and states
//!   the decisions read (the context's footprint, the pools, graph memory, stream
//!   captures, switches of a device's current pool).

pub mod after;
pub mod capture;
pub mod credit;
pub mod flow;
pub mod footprint;
pub mod gate;
pub mod graphs;
pub mod image;
pub mod loads;
pub mod pools;

use std::cell::Cell;
use std::time::Instant;

use crate::books::ledger::{BankGuard, Denial, DeviceLedger, PoolCredit, Reservation, clamp_i64};
use crate::config::OnExceed;
use crate::runtime::DeviceCx;
use crate::sys::driver::{CuResult, MemAllocationProp, real};
use crate::tell::report;
use credit::{PrivateCredit, private};

/// The pools grow in steps of 32 MiB (measured on the H200: a 4 KiB allocation reserves
/// 32 MiB, 100 MiB + 1 B reserves 128 MiB); growth is admitted in the same steps.
pub const POOL_STEP: u64 = 32 << 20;

/// What an allocation asks the budget for.
pub trait Ask {
    /// The bytes to reserve now; `None`: nothing to admit. Asked again once room was
    /// made: a trim lowers the pools' reserves, so a growth may then be larger.
    fn bytes(&mut self) -> Option<u64>;

    /// Before the first try: the device's first context charged if it is still pending
    /// (which may wait, boundedly, for NVML), and the footprint re-read at its routine
    /// interval.
    fn settle(&self, dev: &DeviceCx) {
        footprint::settle_before_admission(dev);
        footprint::maybe_reconcile(dev);
    }

    /// Asked only when the first reservation does not fit, before room is made: the
    /// driver's own refusal of the request whatever its size, if it has one.
    fn rejected(&mut self, _dev: &DeviceCx) -> Option<CuResult> {
        None
    }

    /// Makes room before the last try.
    fn make_room(&mut self, dev: &DeviceCx) {
        make_room(dev, &mut collect_all(dev.ledger));
    }

    /// The bytes a request that does not fit may wait for (`CUDABUDGET_ON_EXCEED=wait:…`);
    /// `None`: refused at once.
    fn waits_for(&self) -> Option<u64> {
        None
    }
}

/// A request of a size the program chose: a synchronous allocation, a module load, a
/// context limit. `wait`: the caller holds nothing another thread needs, so the request
/// may wait for room when the configuration says so.
pub struct Fixed {
    pub bytes: u64,
    pub wait: bool,
}

impl Ask for Fixed {
    fn bytes(&mut self) -> Option<u64> {
        Some(self.bytes)
    }

    fn waits_for(&self) -> Option<u64> {
        self.wait.then_some(self.bytes)
    }
}

/// The growth an operation could cause, by the driver's own figures (a created pool's,
/// graph memory's), worked out again after room is made; 0 is nothing to admit. Its
/// caller admits it under the growth lock, having settled the footprint before taking it
/// (settling may wait for NVML).
pub struct Growth<F>(pub F);

impl<F: Fn() -> u64> Ask for Growth<F> {
    fn bytes(&mut self) -> Option<u64> {
        Some((self.0)()).filter(|&growth| growth > 0)
    }

    fn settle(&self, _dev: &DeviceCx) {}
}

/// A `cuMemCreate` request of `size` bytes as `prop` says: its size, and the driver's own
/// answer to the same request at its smallest size ([`driver_rejects`]), asked only when
/// the size does not fit. PyTorch picks its handle type by the error it gets, and a
/// budget OOM must not hide "not supported".
pub struct Create {
    pub size: usize,
    /// Null or valid for the driver (the caller of `cuMemCreate` vouched for it).
    pub prop: *const MemAllocationProp,
    pub flags: u64,
}

impl Ask for Create {
    fn bytes(&mut self) -> Option<u64> {
        Some(self.size as u64)
    }

    fn rejected(&mut self, dev: &DeviceCx) -> Option<CuResult> {
        // SAFETY: the property struct the caller of `cuMemCreate` vouched for.
        unsafe { driver_rejects(dev, self.size, self.prop, self.flags) }
    }
}

/// The driver's error for this request regardless of its size, if it has one. The probe
/// is a real allocation, so it is admitted like one, within the budget (a reservation of
/// its size, released with it); with no room for it, the budget's answer stands.
///
/// # Safety
/// `prop` must be valid for the driver.
unsafe fn driver_rejects(
    dev: &DeviceCx,
    size: usize,
    prop: *const MemAllocationProp,
    flags: u64,
) -> Option<CuResult> {
    let mut granularity = 0usize;
    // SAFETY: valid out-pointer and the caller's property struct (option 0 = minimum).
    let rc = unsafe { real::cuMemGetAllocationGranularity(&mut granularity, prop, 0) };
    if !rc.is_ok() {
        return Some(rc);
    }
    if granularity == 0 || size == 0 || !size.is_multiple_of(granularity) {
        return Some(CuResult::INVALID_VALUE);
    }
    let _room = dev.reserve(granularity as u64).ok()?;
    let mut probe = 0u64;
    // In relaxed mode: the probe is the library's call, and must not break a capture.
    // SAFETY: the smallest allocation of the same kind, released at once.
    let rc = capture::relaxed(|| unsafe {
        let rc = real::cuMemCreate(&mut probe, granularity, prop, flags);
        if rc.is_ok() {
            let _ = real::cuMemRelease(probe);
        }
        rc
    });
    // Accepted, or refused for want of memory: the budget's answer stands.
    (!rc.is_ok() && rc != CuResult::OUT_OF_MEMORY).then_some(rc)
}

/// Decides an allocation on the call's device `dev` for `call`: reserves what `ask` asks
/// for within the budget in force; if it does not fit, makes room and tries once more;
/// then, in observe mode, admits it past the budget ([`overrun`]); for a request that may
/// wait, waits for room; else refuses ([`refuse`]). `Ok(None)`: nothing to admit.
#[inline]
pub fn admit(
    call: &str,
    dev: &DeviceCx,
    ask: &mut impl Ask,
) -> Result<Option<Reservation<'static>>, CuResult> {
    let denial = match try_admit(dev, ask) {
        Ok(admitted) => return Ok(admitted),
        Err(Missed::Rejected(rc)) => return Err(rc),
        Err(Missed::Denied(denial)) => denial,
    };
    if warns(dev) {
        return Ok(Some(overrun(call, dev, &denial)));
    }
    match ask.waits_for() {
        Some(bytes) => wait_for_room(call, dev, ask, bytes, denial),
        None => Err(refuse(call, dev, &denial)),
    }
}

/// A stream-ordered request of `bytes` that no growth of the device's pools could ever
/// admit (more than the budget lets the pools hold for one block) is refused here, at
/// once, before any credit moves. In observe mode it goes on, and its growth is admitted
/// past the budget.
pub fn within_reach(call: &str, dev: &DeviceCx, bytes: u64) -> Result<(), CuResult> {
    if PoolCredit::may_hold(bytes, dev.budget)
        || warns(dev) && PoolCredit::may_hold(bytes, u64::MAX)
    {
        return Ok(());
    }
    let denial = Denial {
        requested: bytes,
        used: dev.ledger.budget_used(),
        budget: dev.budget,
    };
    Err(refuse(call, dev, &denial))
}

/// A stream-ordered allocation is admitted in advance when it fits in what the device's
/// pools already hold: their growth was admitted when they grew (`flow`'s `PoolGrowth`,
/// through [`admit`]), and the pools' credit is that admission's unspent part, kept in the
/// thread's own credit, in the shards and in the bank ([`credit`]). Spends `bytes` of it
/// on the call's device: the thread's own first, then its shard's. `None`: there is none
/// left, and the pools' growth must be admitted now.
#[inline]
fn prepaid(dev: &DeviceCx, p: Option<&PrivateCredit>, bytes: u64) -> Option<Paid> {
    if p.is_some_and(|p| p.take(dev.ledger, bytes)) {
        Some(Paid::Thread)
    } else if dev.ledger.pool.take(crate::runtime::shard(), bytes) {
        Some(Paid::Shard)
    } else {
        None
    }
}

/// [`prepaid`] on the stream-ordered fast path (`flow`'s `alloc_async_fast`): `bytes` from
/// the thread's own credit for the device whose books `d` are, if it holds that much;
/// nothing else is looked at.
#[inline(always)]
fn prepaid_by_thread(p: &PrivateCredit, d: &DeviceLedger, bytes: u64) -> bool {
    p.take(d, bytes)
}

/// A synchronous allocation of `bytes` on device 0 admitted on the fast path
/// (`flow`'s `alloc_direct_fast`), in a process that sees one device: when the device has
/// a budget of its own in bytes, nothing is due before an admission (the context's
/// charge, the routine re-read: [`footprint::admission_ready`]) and the bytes fit. What
/// this declines, nothing taken, [`admit`] decides on the full path (a job's budget, a
/// wait, a warning, a refusal).
#[inline(always)]
fn admitted_at_once(d: &'static DeviceLedger, bytes: u64) -> Option<Reservation<'static>> {
    if !footprint::admission_ready(0) {
        return None;
    }
    d.reserve_own(bytes)
}

/// Where a stream-ordered allocation's credit came from: an allocation that fails gives
/// it back there, so that a debt left in the shards is never repaid into a thread's own
/// credit (which the fast path spends without looking at the shards or the bank).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Paid {
    Thread,
    Shard,
    /// From the bank, under its lock: the caller repays a failure there itself.
    Bank,
}

/// Why a try did not admit.
enum Missed {
    /// The driver refuses the request whatever its size: its answer stands.
    Rejected(CuResult),
    /// It does not fit the budget.
    Denied(Denial),
}

fn try_admit(dev: &DeviceCx, ask: &mut impl Ask) -> Result<Option<Reservation<'static>>, Missed> {
    ask.settle(dev);
    let Some(first) = ask.bytes() else {
        return Ok(None);
    };
    let margin = footprint::margin(dev.ordinal);
    if margin > 0 {
        // The context is charged its estimate until NVML measures it: admitted at once
        // only with room left for a larger context (`margin`), else decided on its figure.
        if let Ok(r) = dev.less(margin).reserve(first) {
            return Ok(Some(r));
        }
        footprint::settle_now(dev);
    }
    if let Ok(r) = dev.reserve(first) {
        return Ok(Some(r));
    }
    if let Some(rc) = ask.rejected(dev) {
        return Err(Missed::Rejected(rc));
    }
    ask.make_room(dev);
    let Some(again) = ask.bytes() else {
        return Ok(None);
    };
    dev.reserve(again).map(Some).map_err(Missed::Denied)
}

/// With `CUDABUDGET_ON_EXCEED=wait:<d>`, a request of `bytes` that did not fit waits (in
/// arrival order) until the process — or the job — has room, for at most `d`. Never
/// during a capture, nor for more than the budget.
#[cold]
fn wait_for_room(
    call: &str,
    dev: &DeviceCx,
    ask: &mut impl Ask,
    bytes: u64,
    denial: Denial,
) -> Result<Option<Reservation<'static>>, CuResult> {
    let OnExceed::Wait(patience) = dev.config().on_exceed else {
        return Err(refuse(call, dev, &denial));
    };
    if capture::any() || bytes > dev.budget {
        return Err(refuse(call, dev, &denial));
    }
    let deadline = Instant::now() + patience;
    let d = dev.ledger;
    d.note_wait();
    // A job's waiter keeps its place in the queue until it is admitted or gives up.
    let turn = dev.job().map(|(job, index)| job.queue(index));
    loop {
        // The budget as it is at each look: it may grow while this waits.
        let woke = match &turn {
            Some(turn) => turn.wait_for_room(bytes, d.limit(), deadline),
            None => crate::sys::wait::wait_for_room(deadline, || {
                d.used().saturating_add(bytes) <= d.limit()
            }),
        };
        let dev = dev.looked_again();
        match try_admit(&dev, ask) {
            Ok(admitted) => return Ok(admitted),
            Err(Missed::Rejected(rc)) => return Err(rc),
            Err(Missed::Denied(denial)) if !woke || Instant::now() >= deadline => {
                return Err(refuse(call, &dev, &denial));
            }
            Err(Missed::Denied(_)) => {}
        }
    }
}

/// Whether a request that does not fit is admitted anyway (`CUDABUDGET_ON_EXCEED=warn`).
/// Asked only once a request did not fit: the allocations that fit never read it.
#[cold]
fn warns(dev: &DeviceCx) -> bool {
    dev.config().on_exceed == OnExceed::Warn
}

/// The one overrun (`CUDABUDGET_ON_EXCEED=warn`): what `denial` asked for is reserved
/// past the budget, the overrun is counted, and reported (a line, rate-limited, and the
/// event).
#[cold]
fn overrun(call: &str, dev: &DeviceCx, denial: &Denial) -> Reservation<'static> {
    let admitted = dev.ledger.reserve_past_budget(denial.requested);
    dev.ledger.note_overrun();
    report::overrun(dev.config(), call, dev.ordinal, denial);
    admitted
}

/// The one refusal: the denial is noted and reported, and the call gets
/// `CUDA_ERROR_OUT_OF_MEMORY`.
#[cold]
fn refuse(call: &str, dev: &DeviceCx, denial: &Denial) -> CuResult {
    dev.ledger.note_denial();
    report::denial(dev.config(), call, dev.ordinal, denial);
    CuResult::OUT_OF_MEMORY
}

/// Held while a growth that the driver's own figures decide (a created pool's, graph
/// memory's) is admitted, made and charged, and while those figures are lowered (a
/// trim): a trim between a growth's admission and the driver's call would make the
/// driver grow by more than was admitted.
static GROWTH: crate::sys::lock::Lock<()> = crate::sys::lock::Lock::new(());

thread_local! {
    /// Whether this thread holds [`GROWTH`] (it is not re-entrant).
    static HOLDS_GROWTH: Cell<bool> = const { Cell::new(false) };
}

/// [`GROWTH`], held.
struct GrowthGuard {
    _guard: crate::sys::lock::Guard<'static, ()>,
}

impl Drop for GrowthGuard {
    fn drop(&mut self) {
        let _ = HOLDS_GROWTH.try_with(|h| h.set(false));
    }
}

fn growth_lock() -> GrowthGuard {
    let guard = GROWTH.lock();
    let _ = HOLDS_GROWTH.try_with(|h| h.set(true));
    GrowthGuard { _guard: guard }
}

/// Runs `trim` (of created pools or graph memory) under [`GROWTH`], or not at all while
/// another thread holds it: a trim before a denial is only an attempt to make room, and
/// waiting here could deadlock (the caller may hold the pool bank, which a growth takes).
fn trim_quietly(trim: impl FnOnce()) {
    if HOLDS_GROWTH.try_with(Cell::get).unwrap_or(false) {
        trim();
    } else if let Some(_guard) = GROWTH.try_lock() {
        let _ = HOLDS_GROWTH.try_with(|h| h.set(true));
        trim();
        let _ = HOLDS_GROWTH.try_with(|h| h.set(false));
    }
}

/// Runs `f` (which settles a created pool's charge by the driver's figure) under
/// [`GROWTH`], taken here unless this thread holds it: a settlement that read the
/// figure before another thread's growth and wrote it after that growth's own
/// settlement would leave the growth uncharged.
fn with_growth<R>(f: impl FnOnce() -> R) -> R {
    if HOLDS_GROWTH.try_with(Cell::get).unwrap_or(false) {
        return f();
    }
    let _growth = growth_lock();
    f()
}

/// A trim the program asked for (`cuMemPoolTrimTo` of a pool it created,
/// `cuDeviceGraphMemTrim`): made between growths, never during one.
pub fn program_trim(real: impl FnOnce() -> CuResult) -> CuResult {
    if HOLDS_GROWTH.try_with(Cell::get).unwrap_or(true) {
        return real();
    }
    let _growth = growth_lock();
    real()
}

/// In the child of `fork()`: the growth lock is free again.
///
/// # Safety
/// Only from an at-fork child handler.
pub unsafe fn reset_in_child() {
    // SAFETY: the caller's guarantee.
    unsafe { GROWTH.reset_in_child(()) };
}

/// Before a denial: the pools and the graph memory give back what they hold but do not
/// use, and the footprint is read again.
fn make_room(dev: &DeviceCx, bank: &mut BankGuard<'_>) {
    trim_pools(dev.ordinal, dev.ledger, bank);
    trim_quietly(|| graphs::trim(dev.ordinal, dev.ledger));
    footprint::reconcile_now(dev);
}

/// Gives back what the process's pools hold but do not use, and charges the device the
/// reserve that is left.
pub fn trim_pools(device: usize, d: &DeviceLedger, bank: &mut BankGuard<'_>) {
    if d.pool.charge() != 0 {
        pools::trim_credit_pools(device);
        if let Some(reserve) = pools::reserve(device) {
            settle_charge(d, bank, reserve);
        }
    }
    let created = pools::created_of(device);
    if !created.is_empty() {
        trim_quietly(|| {
            pools::trim_created(device);
            for pool in created {
                pools::settle_created(pool, d);
            }
        });
    }
}

/// The pools' charge becomes the driver's figure `reserve`, or more: a bank that would
/// then be in deficit means the books hold more in use than the pools reserve — another
/// thread's allocation that took its credit before a trim and has yet to reach the
/// driver (which will grow the pool for it), or credit threads kept for themselves. That
/// part stays charged, in the driver's 32 MiB steps, until the next settlement, so that
/// no growth ever happens uncharged. When the charge goes down, the credit threads kept
/// may stand for memory the pools gave back: it is retired, and goes through the bank
/// before it is spent.
fn settle_charge(d: &DeviceLedger, bank: &mut BankGuard<'_>, reserve: u64) {
    let change = clamp_i64(reserve).saturating_sub(clamp_i64(d.pool.charge()));
    let credit = bank.credit().saturating_add(change);
    let cover = if credit < 0 {
        credit
            .unsigned_abs()
            .div_ceil(POOL_STEP)
            .saturating_mul(POOL_STEP)
    } else {
        0
    };
    let delta = bank.set_charge(reserve.saturating_add(cover));
    if delta < 0 {
        d.retire_credit();
    }
    apply(d, delta);
}

/// Locks `d`'s pool bank with everything gathered in it, this thread's own credit too.
fn collect_all(d: &DeviceLedger) -> BankGuard<'_> {
    if let Some(p) = private() {
        p.flush();
    }
    d.pool.collect()
}

fn apply(d: &DeviceLedger, delta: i64) {
    if delta >= 0 {
        d.charge(delta as u64);
    } else {
        d.release(delta.unsigned_abs());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A context for device `ordinal` with a budget of `budget` bytes, in a process whose
    /// configuration fails a request that does not fit.
    fn device(ordinal: usize, budget: u64) -> DeviceCx {
        let config = crate::config::Config::from_vars([("CUDABUDGET_LIMIT", "1Ti")]);
        crate::runtime::set_config(config.expect("a valid configuration"));
        let d = crate::runtime::ledger().device(ordinal).unwrap();
        d.set_budget(crate::books::ledger::Budget::Bytes(budget));
        crate::runtime::Cx::budgeted().device(ordinal).unwrap()
    }

    #[test]
    fn a_stream_ordered_request_no_pool_growth_could_admit_is_refused_before_any_credit_moves() {
        let dev = device(58, 64 * MIB);
        assert_eq!(within_reach("cuMemAllocAsync", &dev, 64 * MIB), Ok(()));
        assert_eq!(
            within_reach("cuMemAllocAsync", &dev, 64 * MIB + 1),
            Err(CuResult::OUT_OF_MEMORY)
        );
        assert_eq!(dev.ledger.denials(), 1, "the one refusal path counts it");
        assert_eq!(dev.ledger.used(), 0);
    }

    #[test]
    fn credit_the_pools_hold_is_an_admission_paid_in_advance_shared_credit_when_the_thread_has_none()
     {
        let dev = device(59, 1 << 40);
        assert!(
            prepaid(&dev, None, MIB).is_none(),
            "no credit: the pools must grow"
        );
        dev.ledger.pool.give(crate::runtime::shard(), 2 * MIB);
        assert!(prepaid(&dev, None, MIB) == Some(Paid::Shard));
        assert!(prepaid(&dev, None, 2 * MIB).is_none(), "only 1 MiB is left");
        assert_eq!(dev.ledger.used(), 0, "spending credit charges nothing more");
    }

    #[test]
    fn the_growth_guard_marks_its_thread_only_while_held() {
        {
            let _g = growth_lock();
            assert!(HOLDS_GROWTH.with(Cell::get));
        }
        assert!(!HOLDS_GROWTH.with(Cell::get));
    }

    #[test]
    fn sizes_past_i64_are_clamped_not_wrapped() {
        assert_eq!(clamp_i64(5), 5);
        assert_eq!(clamp_i64(i64::MAX as u64), i64::MAX);
        assert_eq!(clamp_i64(u64::MAX), i64::MAX);
    }

    #[test]
    fn a_settlement_keeps_a_deficit_charged_in_pool_steps() {
        let d = crate::runtime::ledger().device(55).unwrap();
        d.set_budget(crate::books::ledger::Budget::Bytes(1 << 40));
        // 200 MiB reserved, then the driver says 100 MiB while the books hold 140 MiB in
        // use: the 40 MiB the pool has yet to grow by stay charged, as two 32 MiB steps.
        let mut bank = d.pool.collect();
        let epoch = d.epoch();
        settle_charge(d, &mut bank, 200 * MIB);
        assert_eq!((d.pool.charge(), d.used()), (200 * MIB, 200 * MIB));
        assert_eq!(d.epoch(), epoch, "a rise retires nothing");
        bank.debit(140 * MIB);
        settle_charge(d, &mut bank, 100 * MIB);
        assert_eq!(d.pool.charge(), 100 * MIB + 2 * POOL_STEP);
        assert_eq!(d.used(), 100 * MIB + 2 * POOL_STEP);
        assert!(
            d.epoch() != epoch,
            "the charge went down: kept credit is retired"
        );
        let epoch = d.epoch();
        settle_charge(d, &mut bank, 100 * MIB);
        assert_eq!(d.pool.charge(), 100 * MIB + 2 * POOL_STEP, "unchanged");
        assert_eq!(d.epoch(), epoch, "no change retires nothing");
        bank.refund(140 * MIB);
        settle_charge(d, &mut bank, 200 * MIB);
        assert_eq!(d.pool.charge(), 200 * MIB);
        assert_eq!(d.epoch(), epoch, "a rise retires nothing");
    }
}
