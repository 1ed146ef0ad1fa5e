//! What every allocation hook does: resolve the device, reserve, call the driver, commit
//! or roll back; and on the way back, release what a free gives back.
//!
//! Before any denial the process's stream-ordered pools are trimmed and the footprint is
//! re-read, so memory that is only cached, or an overhead figure that went stale, never
//! causes a refusal.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::admit::pools;
use crate::admit::{capture, footprint, gate, graphs};
use crate::books::ledger::{
    self, BankGuard, Denial, DeviceLedger, Entry, Kind, Reservation, Table,
};
use crate::config::OnExceed;
use crate::runtime::{self, Cx};
use crate::sys::driver::{CuResult, DevicePtr, Handle};
use crate::tell::report;

/// The pools grow in steps of 32 MiB (measured on the H200: a 4 KiB allocation reserves
/// 32 MiB, 100 MiB + 1 B reserves 128 MiB); growth is admitted in the same steps.
pub const POOL_STEP: u64 = 32 << 20;

/// The budgeted device for a call in a budgeted process (`device`, or the calling
/// context's); `None`: the device has no budget, call the driver unchanged.
#[inline(always)]
pub(crate) fn budgeted_device(
    _cx: Cx,
    device: Option<usize>,
) -> Option<(usize, &'static DeviceLedger)> {
    let device = match device {
        Some(d) => d,
        None => runtime::current_device()?,
    };
    runtime::budgeted(device).map(|d| (device, d))
}

/// Reserves `bytes` on `device`; if they do not fit, trims the pools and re-reads the
/// footprint, then tries once more before denying.
pub fn admit<'d>(
    call: &str,
    device: usize,
    d: &'d DeviceLedger,
    bytes: u64,
) -> Result<Reservation<'d>, CuResult> {
    try_admit(device, d, bytes).map_err(|denial| refuse(call, device, d, &denial))
}

fn try_admit(device: usize, d: &DeviceLedger, bytes: u64) -> Result<Reservation<'_>, Denial> {
    footprint::settle_before_admission(device);
    footprint::maybe_reconcile(device, d);
    if let Ok(r) = d.reserve(bytes) {
        return Ok(r);
    }
    make_room(device, d, &mut collect_all(d));
    d.reserve(bytes)
}

#[cold]
fn refuse(call: &str, device: usize, d: &DeviceLedger, denial: &Denial) -> CuResult {
    d.note_denial();
    report::denial(call, device, denial);
    CuResult::OUT_OF_MEMORY
}

/// As [`admit`], for a caller that holds nothing another thread needs: with
/// `CUDABUDGET_ON_EXCEED=wait:<d>`, a request that does not fit waits (in arrival order)
/// until the process — or the job — has room, for at most `d`. Never during a capture.
fn admit_or_wait<'d>(
    call: &str,
    device: usize,
    d: &'d DeviceLedger,
    bytes: u64,
) -> Result<Reservation<'d>, CuResult> {
    let denial = match try_admit(device, d, bytes) {
        Ok(r) => return Ok(r),
        Err(denial) => denial,
    };
    let Some(OnExceed::Wait(patience)) = runtime::config().map(|c| c.on_exceed) else {
        return Err(refuse(call, device, d, &denial));
    };
    if capture::any() || bytes > d.budget() {
        return Err(refuse(call, device, d, &denial));
    }
    let deadline = std::time::Instant::now() + patience;
    let budget = d.budget();
    d.note_wait();
    // A job's waiter keeps its place in the queue until it is admitted or gives up.
    let turn = d.job().map(|(job, index)| job.queue(index));
    loop {
        let woke = match &turn {
            Some(turn) => turn.wait_for_room(bytes, budget, deadline),
            None => crate::sys::wait::wait_for_room(deadline, || {
                d.used().saturating_add(bytes) <= budget
            }),
        };
        match try_admit(device, d, bytes) {
            Ok(r) => return Ok(r),
            Err(denial) if !woke || std::time::Instant::now() >= deadline => {
                return Err(refuse(call, device, d, &denial));
            }
            Err(_) => {}
        }
    }
}

/// Refuses `bytes` on `device` at once: a request that can never fit.
#[cold]
fn deny(call: &str, device: usize, d: &DeviceLedger, bytes: u64) -> CuResult {
    d.note_denial();
    report::denial(
        call,
        device,
        &ledger::Denial {
            requested: bytes,
            used: d.budget_used(),
            budget: d.budget(),
        },
    );
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
struct Growth {
    _guard: crate::sys::lock::Guard<'static, ()>,
}

impl Drop for Growth {
    fn drop(&mut self) {
        let _ = HOLDS_GROWTH.try_with(|h| h.set(false));
    }
}

fn growth_lock() -> Growth {
    let guard = GROWTH.lock();
    let _ = HOLDS_GROWTH.try_with(|h| h.set(true));
    Growth { _guard: guard }
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

/// An upload or launch (`launch`) of an executable graph. One whose memory nodes could
/// make the device's graph memory grow is admitted first (by the growth it could cause:
/// what the graphs use now plus its footprint, less what is reserved), and the driver's
/// figure replaces the estimate after. Natively it would succeed; past the budget it
/// returns `CUDA_ERROR_OUT_OF_MEMORY` and runs nothing, as under MPS with a memory limit.
/// A launch that succeeds frees the outside blocks of the graph's free nodes.
pub fn launch_graph(
    _cx: Cx,
    call: &str,
    launch: bool,
    exec: Handle,
    stream: Handle,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    let Some(graphs::ExecMemory { footprint, frees }) = graphs::memory(exec) else {
        return real();
    };
    // No capture of the stream starts between the look at it and the driver's answer
    // (crate::admit::capture::begin): launched into one, nothing would run, yet the blocks of
    // the graph's free nodes would be given back.
    let _pass = gate::wait_enter(private().map_or(0, PrivateCredit::lane_held));
    if let Some(_recorded) = capture::recording(stream) {
        // Launched into a capture: a node of that graph, nothing runs now (no capture
        // ends while the guard is held, so it cannot run for real instead).
        return real();
    }
    // One at a time, as for pools the program created: two launches that each see room
    // in the graph reserve would otherwise both pass.
    let _one_at_a_time = growth_lock();
    let mut admitted = Vec::new();
    for (device, bytes) in footprint {
        let Some(d) = runtime::budgeted(device) else {
            continue;
        };
        footprint::settle_before_admission(device);
        match admit_graph(call, device, d, bytes) {
            Ok(Some(reservation)) => admitted.push((device, d, reservation)),
            Ok(None) => {}
            // What was admitted on other devices is rolled back with `admitted`.
            Err(rc) => return rc,
        }
    }
    // The blocks the graph's free nodes name leave the table before the driver's call:
    // once the launch has freed one, the driver may give its address to another
    // thread's allocation, whose record must not be the one taken out after.
    let pointers = runtime::pointers();
    let taken: Vec<(DevicePtr, Entry)> = if launch {
        frees
            .into_iter()
            .filter_map(|ptr| pointers.remove(ptr).map(|entry| (ptr, entry)))
            .collect()
    } else {
        Vec::new()
    };
    let rc = real();
    for (device, d, reservation) in admitted {
        // The driver's figure first, then the estimate goes; when the driver cannot
        // say, the estimate stays charged.
        if graphs::settle(device, d) || !rc.is_ok() {
            drop(reservation);
        } else {
            reservation.commit();
        }
    }
    for (ptr, entry) in taken {
        if rc.is_ok() {
            // Freed by the launch, with no free call the library saw.
            release(entry);
        } else {
            restore(pointers, ptr, entry);
        }
    }
    rc
}

/// A stream-ordered allocation from a pool the program created: the growth it could
/// cause the pool (what the pool uses plus `bytes`, less its reserve, in the driver's
/// 32 MiB steps) is admitted first, and the pool's own reserve is charged after.
#[cold]
fn alloc_from_created(
    call: &str,
    device: usize,
    d: &DeviceLedger,
    pool: Handle,
    bytes: u64,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    footprint::settle_before_admission(device);
    // One at a time: two allocations that each see room for one in the pool's reserve
    // would otherwise both pass, and the driver grow the pool for the second.
    let _one_at_a_time = growth_lock();
    let growth = || {
        let Some((reserved, used)) = pools::figures(pool) else {
            // The driver cannot say: the worst case.
            return bytes.div_ceil(POOL_STEP).saturating_mul(POOL_STEP);
        };
        let growth = used.saturating_add(bytes).saturating_sub(reserved);
        growth.div_ceil(POOL_STEP).saturating_mul(POOL_STEP)
    };
    let admitted = match admit_by(call, device, d, growth) {
        Ok(admitted) => admitted,
        Err(rc) => return rc,
    };
    let rc = real();
    pools::settle_created(pool, d);
    drop(admitted);
    rc
}

/// `cuMemPoolDestroy` (`real`) of a pool the program created: what it still holds
/// (blocks not yet freed keep its reserve with the driver) stays charged; a pool with
/// nothing in use gives it all back. Under [`GROWTH`], so that no allocation from the
/// pool comes between the look at what it uses and its end.
pub fn created_pool_destroyed(pool: Handle, real: impl FnOnce() -> CuResult) -> CuResult {
    with_growth(|| {
        let live = pools::figures(pool).map(|(_, used)| used);
        let rc = real();
        if rc.is_ok()
            && let Some((device, charged)) = pools::unregister(pool)
            && let Some(d) = runtime::budgeted(device)
        {
            if live == Some(0) {
                d.release(charged);
            } else {
                pools::retire(device, charged);
            }
        }
        rc
    })
}

/// Admits the growth `growth()` says an operation could cause; before a denial the pools
/// and the graph memory are trimmed and the growth worked out again (the trim lowers the
/// reserves, so the growth may be larger than before). `None`: nothing to admit.
fn admit_by<'d>(
    call: &str,
    device: usize,
    d: &'d DeviceLedger,
    growth: impl Fn() -> u64,
) -> Result<Option<Reservation<'d>>, CuResult> {
    let first = growth();
    if first == 0 {
        return Ok(None);
    }
    if let Ok(r) = d.reserve(first) {
        return Ok(Some(r));
    }
    make_room(device, d, &mut collect_all(d));
    let again = growth();
    if again == 0 {
        return Ok(None);
    }
    d.reserve(again).map(Some).map_err(|denial| {
        d.note_denial();
        report::denial(call, device, &denial);
        CuResult::OUT_OF_MEMORY
    })
}

/// The growth of the device's graph memory that a launch of `bytes` of memory nodes
/// could cause, in the driver's 32 MiB steps: what the graphs use plus `bytes`, less
/// what is reserved; all of `bytes` when the driver cannot say.
fn graph_growth(device: usize, bytes: u64) -> u64 {
    let growth = match graphs::read(device) {
        Some((used, reserved)) => used.saturating_add(bytes).saturating_sub(reserved),
        None => bytes,
    };
    growth.div_ceil(POOL_STEP).saturating_mul(POOL_STEP)
}

/// Admits the graph-memory growth a launch of `bytes` of memory nodes could cause.
fn admit_graph<'d>(
    call: &str,
    device: usize,
    d: &'d DeviceLedger,
    bytes: u64,
) -> Result<Option<Reservation<'d>>, CuResult> {
    admit_by(call, device, d, || graph_growth(device, bytes))
}

/// The program trimmed a device's graph memory: charge what is left.
pub fn graph_memory_changed(device: usize) {
    if let Some(d) = runtime::budgeted(device) {
        graphs::settle(device, d);
    }
}

/// A synchronous allocation of `bytes` whose address (or handle) the driver writes to
/// `out`: `cuMemAlloc`, `cuMemAllocManaged`, arrays.
pub fn alloc_direct(
    cx: Cx,
    call: &str,
    bytes: u64,
    device: Option<usize>,
    out: *mut u64,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    alloc_into(cx, runtime::pointers(), call, bytes, device, out, real)
}

/// As [`alloc_direct`], for array handles.
pub fn alloc_array(
    cx: Cx,
    call: &str,
    bytes: u64,
    out: *mut Handle,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    alloc_into(cx, runtime::arrays(), call, bytes, None, out.cast(), real)
}

fn alloc_into(
    cx: Cx,
    table: &impl Table,
    call: &str,
    bytes: u64,
    device: Option<usize>,
    out: *mut u64,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    let Some((device, d)) = budgeted_device(cx, device) else {
        return real();
    };
    let reservation = match admit_or_wait(call, device, d, bytes) {
        Ok(r) => r,
        Err(rc) => return rc,
    };
    let rc = real();
    if rc.is_ok() && !out.is_null() {
        // SAFETY: the driver succeeded, so it wrote the new address through `out`.
        let key = unsafe { *out };
        table.insert(
            key,
            Entry {
                bytes,
                device,
                kind: Kind::Direct,
            },
        );
        reservation.commit();
    }
    rc
}

/// `cuMemAllocPitch`: the pitch is the driver's choice, so the reservation is for the
/// widest pitch it uses (512-byte alignment) and is trimmed to the real figure after.
pub fn alloc_pitch(
    cx: Cx,
    width: usize,
    height: usize,
    dptr: *mut DevicePtr,
    pitch: *mut usize,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    let estimate = (width as u64)
        .div_ceil(512)
        .saturating_mul(512)
        .saturating_mul(height as u64);
    let rc = alloc_direct(cx, "cuMemAllocPitch", estimate, None, dptr, real);
    if rc.is_ok() && !pitch.is_null() && !dptr.is_null() {
        // SAFETY: the driver succeeded and wrote both out-parameters.
        let (ptr, actual) = unsafe { (*dptr, (*pitch as u64).saturating_mul(height as u64)) };
        if actual != estimate {
            let table = runtime::pointers();
            if let Some(mut entry) = table.remove(ptr) {
                if let Some(d) = runtime::ledger().device(entry.device) {
                    if actual > estimate {
                        d.charge(actual - estimate);
                    } else {
                        d.release(estimate - actual);
                    }
                }
                entry.bytes = actual;
                table.insert(ptr, entry);
            }
        }
    }
    rc
}

/// A free of a device pointer, synchronous or stream-ordered. A pointer the ledger never
/// saw passes through and moves nothing.
pub fn free(cx: Cx, ptr: DevicePtr, real: impl FnOnce() -> CuResult) -> CuResult {
    free_from(cx, runtime::pointers(), ptr, real)
}

/// As [`free`], for `cuMemFreeAsync`: the block is most likely a stream-ordered one,
/// freed by the thread that allocated it, found in that thread's lane and credited to
/// that thread ([`free_async_fast`]); anything else takes [`free_async_slow`].
#[inline(always)]
pub fn free_async(
    cx: Cx,
    ptr: DevicePtr,
    stream: Handle,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    free_async_fast(ptr, real).unwrap_or_else(|real| free_async_slow(cx, ptr, stream, real))
}

/// The common free: a few loads and stores and the driver's call. `Err` hands `real`
/// back untouched.
#[inline(always)]
fn free_async_fast<F: FnOnce() -> CuResult>(ptr: DevicePtr, real: F) -> Result<CuResult, F> {
    let Some(p) = private() else {
        return Err(real);
    };
    let lane = p.lane.get();
    // Inside the gate from before the look at the captures until the driver's answer:
    // a capture of the stream starts before the look or after the free (crate::admit::capture).
    if !gate::enter_own(lane) {
        return Err(real);
    }
    if capture::any() {
        gate::leave_own(lane);
        return Err(real);
    }
    let mark = ledger::clears();
    let Some(entry) = runtime::pointers().remove_own(ptr, lane) else {
        gate::leave_own(lane);
        return Err(real);
    };
    let rc = real();
    gate::leave_own(lane);
    // A clear that starts after this check moves the device's epoch when it ends, which
    // voids credit given under the old one.
    if rc.is_ok() && ledger::no_clear_since(mark) && p.give_fast(&entry) {
        return Ok(rc);
    }
    Ok(free_async_rest(p, ptr, entry, rc, mark))
}

/// A stream-ordered free that is not [`free_async_fast`]'s: a block of another thread or
/// of no lane, the thread's locals gone, a capture under way.
fn free_async_slow(
    cx: Cx,
    ptr: DevicePtr,
    stream: Handle,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    // No capture of the stream starts (crate::admit::capture::begin) nor ends
    // (crate::admit::capture::end) between the look at it and the driver's answer. A thread
    // that only frees claims no lane (it would keep credit it has no exit to give back).
    let _pass = gate::wait_enter(private().map_or(0, PrivateCredit::lane_held));
    if let Some(_recorded) = capture::recording(stream) {
        // Recorded into a graph: nothing is freed until the graph runs, so the block
        // stays charged (and recorded, for a free of it outside the graph).
        return real();
    }
    let pointers = runtime::pointers();
    let Some(p) = private() else {
        // The thread's locals are gone (it is exiting): the plain path.
        return free_from(cx, pointers, ptr, real);
    };
    let mark = ledger::clears();
    let Some(entry) = pointers.remove_pooled(ptr, p.lane.get()) else {
        return real();
    };
    let rc = real();
    free_async_rest(p, ptr, entry, rc, mark)
}

/// The books after the driver's answer to a stream-ordered free whose entry was removed
/// after `mark` (see [`settle_free`]).
#[inline(never)]
fn free_async_rest(
    p: &PrivateCredit,
    ptr: DevicePtr,
    entry: Entry,
    rc: CuResult,
    mark: u64,
) -> CuResult {
    settle_free(runtime::pointers(), ptr, entry, rc, mark, |entry| {
        match (entry.kind, runtime::ledger().device(entry.device)) {
            (Kind::Pooled, Some(d)) => p.give(entry.device, d, entry.bytes),
            _ => release(entry),
        }
    });
    rc
}

/// After a free the driver refused: the block is still allocated, so its entry goes
/// back, whatever the error (`INVALID_VALUE` too: a stream-ordered block given to
/// `cuMemFree`, an array given to the wrong destroy call). A second free of an address
/// never finds an entry to restore: the first free removed it.
fn restore(table: &impl Table, key: u64, entry: Entry) {
    table.insert(key, entry);
}

/// `cuArrayDestroy`, `cuMipmappedArrayDestroy`.
pub fn free_array(cx: Cx, array: Handle, real: impl FnOnce() -> CuResult) -> CuResult {
    free_from(cx, runtime::arrays(), array as u64, real)
}

fn free_from(_cx: Cx, table: &impl Table, key: u64, real: impl FnOnce() -> CuResult) -> CuResult {
    // Removed before the driver frees it: once freed, the driver may hand the same
    // address to another thread, whose insert must not find ours.
    let mark = ledger::clears();
    let Some(entry) = table.remove(key) else {
        return real();
    };
    let rc = real();
    settle_free(table, key, entry, rc, mark, release);
    rc
}

/// The books after the driver's answer to a free whose entry was removed after `mark`:
/// `give` gives the charge back when the free succeeded, the entry goes back when the
/// driver refused it — unless a device's books were cleared meanwhile, which took the
/// entry's charge with them (the books then keep at most more than the process holds).
#[inline(never)]
fn settle_free(
    table: &impl Table,
    key: u64,
    entry: Entry,
    rc: CuResult,
    mark: u64,
    give: impl FnOnce(Entry),
) {
    if !ledger::no_clear_since(mark) {
        return;
    }
    if rc.is_ok() {
        give(entry);
    } else {
        restore(table, key, entry);
    }
}

fn release(entry: Entry) {
    let Some(d) = runtime::ledger().device(entry.device) else {
        return;
    };
    match entry.kind {
        Kind::Direct => d.release(entry.bytes),
        Kind::Pooled => give_pooled(entry.device, d, entry.bytes),
    }
}

/// Most of what a thread has freed to the pools, kept for its own next stream-ordered
/// allocations: a thread that allocates and frees (PyTorch's, CuPy's) then touches no
/// shared cache line on its fast path. At most [`PRIVATE_MAX`] stays here; the rest goes
/// back to the shards, and all of it when the thread exits ([`thread_exit`]) or takes
/// the slow path. So the credit that other threads cannot see is bounded by
/// `PRIVATE_MAX` a thread, the most a denial can be early by.
///
/// It has no destructor, so that reaching it is one thread-local address and nothing
/// else (a destructor would add a state check to every access); [`thread_exit`], set up
/// when the thread first claims a lane, gives everything back at the thread's end.
struct PrivateCredit {
    /// The thread's lane in the address table ([`ledger::claim_lane`]): [`NO_LANE_YET`]
    /// before the first claim, 0 when none was free, [`EXITED`] once [`thread_exit`] ran.
    lane: Cell<usize>,
    device: Cell<usize>,
    /// The device's epoch when the credit was given: credit from before its books were
    /// cleared (the context went away) is void.
    epoch: Cell<u64>,
    bytes: Cell<u64>,
}

const PRIVATE_MAX: u64 = 8 << 20;

const NO_LANE_YET: usize = usize::MAX;
/// The thread's [`thread_exit`] has run: it keeps no lane and no credit any more.
const EXITED: usize = usize::MAX - 1;

impl PrivateCredit {
    /// The thread's lane as it is, without claiming one (gate::enter takes any value).
    fn lane_held(&self) -> usize {
        self.lane.get()
    }

    /// The thread's lane, claiming one on first use (0: none).
    #[inline]
    fn lane(&self) -> usize {
        let lane = self.lane.get();
        if (1..ledger::LANES).contains(&lane) {
            return lane;
        }
        self.claim()
    }

    #[cold]
    fn claim(&self) -> usize {
        let lane = self.lane.get();
        if lane == EXITED || (lane == 0 && !ledger::lane_free()) {
            return 0;
        }
        // The lane and the credit go back when the thread ends: that needs its exit
        // handler. Without one the thread keeps neither.
        if !arm_thread_exit() {
            self.lane.set(EXITED);
            return 0;
        }
        let lane = ledger::claim_lane();
        self.lane.set(lane);
        lane
    }

    /// Whether the thread may keep credit (its exit guard will give it back).
    fn keeps_credit(&self) -> bool {
        let lane = self.lane.get();
        lane != NO_LANE_YET && lane != EXITED
    }

    /// Takes `bytes` from the thread's credit for `device`, if it holds that much.
    #[inline(always)]
    fn take(&self, device: usize, d: &DeviceLedger, bytes: u64) -> bool {
        let held = self.bytes.get();
        let ok = self.device.get() == device && held >= bytes && self.epoch.get() == d.epoch();
        if ok {
            self.bytes.set(held - bytes);
        }
        ok
    }

    /// The fast path's credit for a freed block: the thread's own device and epoch, and
    /// room below [`PRIVATE_MAX`]; false leaves everything as it was.
    #[inline(always)]
    fn give_fast(&self, entry: &Entry) -> bool {
        let held = self.bytes.get().saturating_add(entry.bytes);
        let ok = entry.kind == Kind::Pooled
            && entry.device == self.device.get()
            && held <= PRIVATE_MAX
            && runtime::ledger()
                .device(entry.device)
                .is_some_and(|d| d.epoch() == self.epoch.get());
        if ok {
            self.bytes.set(held);
        }
        ok
    }

    fn give(&self, device: usize, d: &DeviceLedger, bytes: u64) {
        if !self.keeps_credit() {
            d.pool.give(runtime::shard(), bytes);
            return;
        }
        if self.device.get() != device || self.epoch.get() != d.epoch() {
            self.flush();
            self.device.set(device);
            self.epoch.set(d.epoch());
        }
        let held = self.bytes.get().saturating_add(bytes);
        if held > PRIVATE_MAX {
            let keep = PRIVATE_MAX / 2;
            d.pool.give(runtime::shard(), held - keep);
            self.bytes.set(keep);
        } else {
            self.bytes.set(held);
        }
    }

    /// Gives everything the thread kept back: to its shard while the credit is current,
    /// to the bank when the pools have shrunk since it was given (the bank's total then
    /// shows whether the pools must grow again before it is spent), nowhere when the
    /// device's books were cleared since.
    fn flush(&self) {
        let held = self.bytes.replace(0);
        let Some(d) = runtime::ledger().device(self.device.get()) else {
            return;
        };
        let given = self.epoch.get();
        if held == 0 {
            return;
        }
        if given == d.epoch() {
            d.pool.give(runtime::shard(), held);
        } else if d.same_books(given) {
            d.pool.collect().refund(held);
        }
    }
}

thread_local! {
    static PRIVATE: PrivateCredit = const {
        PrivateCredit {
            lane: Cell::new(NO_LANE_YET),
            device: Cell::new(usize::MAX),
            epoch: Cell::new(0),
            bytes: Cell::new(0),
        }
    };
}

/// This thread's [`PrivateCredit`].
#[inline(always)]
fn private() -> Option<&'static PrivateCredit> {
    // SAFETY: PRIVATE has no destructor, so its storage lives as long as the thread,
    // and every use of the reference is on this thread (PrivateCredit holds Cells, so
    // the reference is neither Send nor Sync).
    PRIVATE
        .try_with(|p| unsafe { &*std::ptr::from_ref(p) })
        .ok()
}

/// The pthread key whose destructor is [`thread_exit`] (`UNMADE` until the first claim).
static EXIT_KEY: AtomicU64 = AtomicU64::new(UNMADE);
const UNMADE: u64 = u64::MAX;

/// Makes [`thread_exit`] run when the calling thread ends; false if it cannot.
///
/// A pthread key, not a thread-local with a destructor: glibc runs key destructors after
/// the thread-locals' (C++ `thread_local`, Rust's), and again for a key set while they
/// run, so a thread whose last CUDA calls come from any exit handler, its first claim
/// included, still gives everything back.
#[cold]
fn arm_thread_exit() -> bool {
    let mut key = EXIT_KEY.load(Ordering::Acquire);
    if key == UNMADE {
        let mut made: libc::pthread_key_t = 0;
        // SAFETY: a valid out-pointer and an extern "C" destructor that never unwinds.
        if unsafe { libc::pthread_key_create(&mut made, Some(thread_exit)) } != 0 {
            return false;
        }
        key = match EXIT_KEY.compare_exchange(
            UNMADE,
            u64::from(made),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => u64::from(made),
            Err(first) => {
                // Another thread made one first: use that one.
                // SAFETY: `made` is our own key, set on no thread.
                unsafe { libc::pthread_key_delete(made) };
                first
            }
        };
    }
    // Any non-null value makes the destructor run; it is never read.
    // SAFETY: `key` is a live key (keys of the library are never deleted once published).
    unsafe { libc::pthread_setspecific(key as libc::pthread_key_t, std::ptr::dangling()) == 0 }
}

/// The thread is going: its credit goes back to the shards, its blocks stay in the table
/// for whoever frees them, and its lane goes to the next thread.
extern "C" fn thread_exit(_: *mut libc::c_void) {
    let _ = std::panic::catch_unwind(|| {
        if let Some(p) = private() {
            p.flush();
            let lane = p.lane.replace(EXITED);
            ledger::release_lane(lane);
        }
    });
}

/// In the child of `fork()`: only the calling thread came along.
pub fn after_fork() {
    let own = private().map_or(0, |p| p.lane.get());
    ledger::lanes_after_fork(own);
}

/// Credit back from a stream-ordered free (or an allocation that failed).
fn give_pooled(device: usize, d: &DeviceLedger, bytes: u64) {
    match private() {
        Some(p) => p.give(device, d, bytes),
        None => d.pool.give(runtime::shard(), bytes),
    }
}

/// `cuMemAllocAsync`: [`alloc_async_fast`] when it can, else [`alloc_pooled`].
#[inline(always)]
pub fn alloc_async(
    cx: Cx,
    bytes: u64,
    stream: Handle,
    dptr: *mut DevicePtr,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    alloc_async_fast(bytes, dptr, real)
        .unwrap_or_else(|real| alloc_async_slow(cx, bytes, stream, dptr, real))
}

/// The stream-ordered allocation the fast path declined, out of line: inlined, the full
/// path made the hook too large for the driver's call in the fast path to be inlined.
#[inline(never)]
fn alloc_async_slow(
    cx: Cx,
    bytes: u64,
    stream: Handle,
    dptr: *mut DevicePtr,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    alloc_pooled(cx, "cuMemAllocAsync", bytes, None, stream, dptr, real)
}

/// A stream-ordered allocation in a process that sees one device, from the thread's own
/// credit, into the thread's own lane: a few loads and stores and the driver's call.
/// `Err` hands `real` back untouched.
#[inline(always)]
fn alloc_async_fast<F: FnOnce() -> CuResult>(
    bytes: u64,
    dptr: *mut DevicePtr,
    real: F,
) -> Result<CuResult, F> {
    // Credit for a device is only ever given in a budgeted process, for a budgeted
    // device, so holding some answers both questions.
    let Some(p) = private() else {
        return Err(real);
    };
    let lane = p.lane.get();
    // Inside the gate before the detour is looked at: a switch of the device's current
    // pool waits for this call to reach the driver, or turns the detour on first.
    if !gate::enter_own(lane) {
        return Err(real);
    }
    let d0 = runtime::ledger().device(0);
    if !(runtime::known_single_device()
        && !capture::any()
        && d0.is_some_and(|d| p.take(0, d, bytes)))
    {
        gate::leave_own(lane);
        return Err(real);
    }
    let rc = real();
    gate::leave_own(lane);
    let entry = Entry {
        bytes,
        device: 0,
        kind: Kind::Pooled,
    };
    if rc.is_ok()
        && !dptr.is_null()
        // SAFETY: the driver succeeded, so it wrote the new address through `dptr`.
        && runtime::pointers().insert_own(unsafe { *dptr }, entry, lane)
    {
        return Ok(rc);
    }
    Ok(alloc_async_rest(rc, dptr, bytes, lane))
}

/// The fast path's allocation when the driver refused it or its bucket was full.
#[cold]
#[inline(never)]
fn alloc_async_rest(rc: CuResult, dptr: *mut DevicePtr, bytes: u64, lane: usize) -> CuResult {
    if let Some(d) = runtime::ledger().device(0) {
        record_pooled(rc, dptr, bytes, 0, d, lane, Paid::Thread);
    }
    rc
}

/// A stream-ordered allocation (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`).
///
/// The device pays for the pools' reserve, not for each block: an allocation that fits
/// in what the pools already hold takes credit from its thread's shard and nothing else.
/// Only when the pools must grow is the growth admitted against the budget.
#[inline]
pub fn alloc_pooled(
    cx: Cx,
    call: &str,
    bytes: u64,
    pool: Option<Handle>,
    stream: Handle,
    dptr: *mut DevicePtr,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    // The memory lives on the pool's device, or for the device's current pool on the
    // stream's device (not the calling context's).
    let device = match pool.map(pools::place_of) {
        Some(pools::Place::Host) => return real(),
        Some(pools::Place::Device(device)) => Some(device),
        Some(pools::Place::Unknown) | None => runtime::stream_device(stream),
    };
    let Some((device, d)) = budgeted_device(cx, device) else {
        return real();
    };
    // The device's current pool is looked at, and allocated from, with no switch of it
    // in between, and no capture of the stream starts between the look at it and the
    // driver's answer (crate::admit::gate).
    let _pass = gate::wait_enter(private().map_or(0, PrivateCredit::lane));
    if let Some(_recorded) = capture::recording(stream) {
        // A memory node of the graph being captured, not memory yet: charged when the
        // graph's memory is reserved (crate::admit::graphs), neither charged nor refused here.
        // No capture ends while the guard is held, so it cannot be allocated instead.
        return real();
    }
    // A pool the program created pays for itself, never from the credit of another.
    let created = match pool {
        Some(pool) => pools::created(pool).map(|_| pool),
        None => pools::current_created(device),
    };
    if let Some(pool) = created {
        return alloc_from_created(call, device, d, pool, bytes, real);
    }
    if !ledger::PoolCredit::may_hold(bytes, d.budget()) {
        // No pool growth could ever admit it: refused before any credit moves, so a
        // failure cannot give back credit that was never taken.
        return deny(call, device, d, bytes);
    }
    let (private, lane) = private().map_or((false, 0), |p| (p.take(device, d, bytes), p.lane()));
    if !private && !d.pool.take(runtime::shard(), bytes) {
        return grow_pools(call, device, d, bytes, dptr, lane, real);
    }
    let rc = real();
    let paid = if private { Paid::Thread } else { Paid::Shard };
    record_pooled(rc, dptr, bytes, device, d, lane, paid);
    rc
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

#[inline]
fn record_pooled(
    rc: CuResult,
    dptr: *mut DevicePtr,
    bytes: u64,
    device: usize,
    d: &DeviceLedger,
    lane: usize,
    paid: Paid,
) {
    if rc.is_ok() && !dptr.is_null() {
        // SAFETY: the driver succeeded and wrote the address.
        let ptr = unsafe { *dptr };
        let entry = Entry {
            bytes,
            device,
            kind: Kind::Pooled,
        };
        runtime::pointers().insert_in_lane(ptr, entry, lane);
    } else {
        match paid {
            Paid::Thread => give_pooled(device, d, bytes),
            Paid::Shard => d.pool.give(runtime::shard(), bytes),
            Paid::Bank => {}
        }
    }
}

#[cold]
#[inline(never)]
fn grow_pools(
    call: &str,
    device: usize,
    d: &DeviceLedger,
    bytes: u64,
    dptr: *mut DevicePtr,
    lane: usize,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    footprint::settle_before_admission(device);
    let shard = runtime::shard();
    let mut bank = collect_all(d);
    // The request's shard was dry: it is debited here, under the lock.
    bank.debit(bytes);
    let charge_before = d.pool.charge();
    if bank.credit() < 0 {
        // The pools must grow by the deficit: admit that first.
        let growth = bank.credit().unsigned_abs().div_ceil(POOL_STEP) * POOL_STEP;
        match admit_growth(call, device, d, &mut bank, bytes, growth) {
            Ok(()) => {}
            Err(rc) => {
                bank.refund(bytes);
                return rc;
            }
        }
    }
    let rc = real();
    if !rc.is_ok() {
        // The debt was gathered into the bank: it is repaid there.
        bank.refund(bytes);
    }
    // The driver's own figure replaces our estimate of the reserve. When the driver
    // cannot say and refused the allocation, the pools did not grow: the growth admitted
    // for it goes.
    match pools::reserve(device) {
        Some(reserve) => settle_charge(d, &mut bank, reserve),
        None if !rc.is_ok() => settle_charge(d, &mut bank, charge_before),
        None => {}
    }
    // Lent only now: from a bank that the driver's figure has corrected.
    bank.lend(shard);
    drop(bank);
    record_pooled(rc, dptr, bytes, device, d, lane, Paid::Bank);
    rc
}

/// Charges `growth` of pool reserve to `d` for a request of `bytes` (whose debt is in
/// `bank`), trimming and re-reading before a denial.
fn admit_growth(
    call: &str,
    device: usize,
    d: &DeviceLedger,
    bank: &mut BankGuard<'_>,
    bytes: u64,
    growth: u64,
) -> Result<(), CuResult> {
    let charge = d.pool.charge();
    if let Ok(r) = d.reserve(growth) {
        r.commit();
        bank.set_charge(charge + growth);
        return Ok(());
    }
    // The trim covers only others' deficits: this request is not taken out of the
    // pools while they are trimmed, and is admitted below like any growth.
    bank.refund(bytes);
    make_room(device, d, bank);
    bank.debit(bytes);
    if bank.credit() >= 0 {
        return Ok(());
    }
    let growth = bank.credit().unsigned_abs().div_ceil(POOL_STEP) * POOL_STEP;
    let charge = d.pool.charge();
    match d.reserve(growth) {
        Ok(r) => {
            r.commit();
            bank.set_charge(charge + growth);
            Ok(())
        }
        Err(denial) => {
            d.note_denial();
            report::denial(call, device, &denial);
            Err(CuResult::OUT_OF_MEMORY)
        }
    }
}

/// A context on `device` is gone. When it was the device's last, the books are cleared
/// ([`footprint::context_gone`], after `forget`) and what survives it by the driver's figures is charged
/// again: the pools the program created, the device's own pools (whose blocks still in
/// use are no credit) and its graph memory.
pub fn context_gone(device: usize, forget: impl FnOnce()) {
    if !footprint::context_gone(device, forget) {
        return;
    }
    let Some(d) = runtime::ledger().device(device) else {
        return;
    };
    with_growth(|| {
        for pool in pools::created_of(device) {
            pools::set_charged(pool, 0);
            pools::settle_created(pool, d);
        }
    });
    d.charge(pools::retired(device));
    let mut bank = d.pool.collect();
    if let Some(reserve) = pools::reserve(device) {
        settle_charge(d, &mut bank, reserve);
        bank.debit(pools::in_use(device).unwrap_or(reserve));
    }
    drop(bank);
    graphs::settle(device, d);
}

/// The program trimmed `pool`, one of the device's pools (`cuMemPoolTrimTo`): its
/// charge becomes the driver's figure.
pub fn pool_trimmed(device: usize, pool: Handle) {
    let Some(d) = runtime::budgeted(device) else {
        return;
    };
    if pools::created(pool).is_some() {
        with_growth(|| pools::settle_created(pool, d));
        return;
    }
    let mut bank = collect_all(d);
    if let Some(reserve) = pools::reserve(device) {
        settle_charge(d, &mut bank, reserve);
    }
}

/// Before a denial: the pools and the graph memory give back what they hold but do not
/// use, and the footprint is read again.
fn make_room(device: usize, d: &DeviceLedger, bank: &mut BankGuard<'_>) {
    trim_pools(device, d, bank);
    trim_quietly(|| graphs::trim(device, d));
    footprint::reconcile_now(device, d);
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

/// When the pools' charge was last brought to the driver's figures, per device.
static REFRESHED_MS: [AtomicU64; ledger::MAX_DEVICES] =
    [const { AtomicU64::new(0) }; ledger::MAX_DEVICES];

/// From the views (at most once a second per device): the pools' charge follows what the
/// driver reserves now. The driver gives pool memory back on its own (a synchronize
/// below the release threshold), and a view that still counted it would show less free
/// memory than there is — which a framework sizing its pool from it (XLA) would believe.
pub fn refresh_pools(device: usize, d: &DeviceLedger) {
    // The rate limit first: between refreshes a view costs two loads, no allocation.
    let Some(last) = REFRESHED_MS.get(device) else {
        return;
    };
    let now = report::monotonic_ms();
    let seen = last.load(Ordering::Relaxed);
    if now.saturating_sub(seen) < 1000 || capture::any() {
        return;
    }
    let created = pools::created_of(device);
    if (d.pool.charge() == 0 && created.is_empty())
        || last
            .compare_exchange(seen, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
    {
        return;
    }
    if d.pool.charge() != 0 {
        let mut bank = collect_all(d);
        if let Some(reserve) = pools::reserve(device) {
            settle_charge(d, &mut bank, reserve);
        }
    }
    if !created.is_empty() {
        trim_quietly(|| {
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

fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
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

/// Bytes an array of this shape holds: width × height × depth × element size ×
/// channels, each level of a mipmap in turn.
pub fn array_bytes(
    width: usize,
    height: usize,
    depth: usize,
    format: i32,
    channels: u32,
    levels: u32,
) -> u64 {
    let element = element_bytes(format) * channels.max(1) as u64;
    let mut total = 0u64;
    for level in 0..levels.max(1) {
        let dim = |n: usize| ((n as u64) >> level).max(1);
        total = total.saturating_add(
            dim(width)
                .saturating_mul(dim(height))
                .saturating_mul(dim(depth))
                .saturating_mul(element),
        );
        if dim(width) == 1 && dim(height) == 1 && dim(depth) == 1 {
            break;
        }
    }
    total
}

/// Bytes per channel of a `CUarray_format`; formats we do not know count 16 bytes, which
/// over-charges rather than lets an array slip past the budget.
fn element_bytes(format: i32) -> u64 {
    match format {
        0x01 | 0x08 => 1,        // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // (UN)SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // (UN)SIGNED_INT32, FLOAT
        _ => 16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_are_sized_from_their_descriptor() {
        assert_eq!(array_bytes(1024, 768, 0, 0x20, 4, 1), 1024 * 768 * 16);
        assert_eq!(array_bytes(100, 0, 0, 0x01, 1, 1), 100);
        assert_eq!(array_bytes(64, 64, 64, 0x10, 2, 1), 64 * 64 * 64 * 4);
    }

    #[test]
    fn mipmaps_count_every_level_down_to_one_texel() {
        // 8x8 floats: 64 + 16 + 4 + 1 texels.
        assert_eq!(array_bytes(8, 8, 0, 0x20, 1, 10), (64 + 16 + 4 + 1) * 4);
        assert_eq!(array_bytes(8, 8, 0, 0x20, 1, 2), (64 + 16) * 4);
        // One side reaches a texel first: the levels go on until every side has.
        assert_eq!(array_bytes(8, 1, 0, 0x20, 1, 10), (8 + 4 + 2 + 1) * 4);
        assert_eq!(array_bytes(1, 8, 0, 0x20, 1, 10), (8 + 4 + 2 + 1) * 4);
        assert_eq!(array_bytes(4, 4, 2, 0x20, 1, 10), (32 + 4 + 1) * 4);
    }

    #[test]
    fn unknown_formats_are_charged_generously() {
        assert_eq!(array_bytes(10, 1, 1, 0x91, 1, 1), 160);
    }

    // The thread's own credit (`PrivateCredit`) is what keeps the stream-ordered fast path
    // off shared cache lines (BENCHMARKS.md: the async pair, 16 threads). Its contract:
    // credit is kept only by a thread with a lane, only for one device and epoch, only up
    // to PRIVATE_MAX; what does not fit goes to the shards. Each test uses a device
    // ledger of its own (high ordinals nothing else touches).

    const MIB: u64 = 1 << 20;

    fn fresh(lane: usize) -> PrivateCredit {
        PrivateCredit {
            lane: Cell::new(lane),
            device: Cell::new(usize::MAX),
            epoch: Cell::new(0),
            bytes: Cell::new(0),
        }
    }

    fn pooled(device: usize, bytes: u64) -> Entry {
        Entry {
            bytes,
            device,
            kind: Kind::Pooled,
        }
    }

    /// What the device's shards and bank hold, gathered.
    fn shared_credit(d: &DeviceLedger) -> i64 {
        d.pool.collect().credit()
    }

    #[test]
    fn a_thread_with_a_lane_keeps_what_it_frees_and_spends_it_on_its_own_device() {
        let (device, d) = (50, runtime::ledger().device(50).unwrap());
        let p = fresh(3);
        p.give(device, d, 3 * MIB);
        assert_eq!(p.bytes.get(), 3 * MIB, "kept by the thread");
        assert_eq!(shared_credit(d), 0, "nothing went to the shards");
        assert!(!p.take(device + 1, runtime::ledger().device(51).unwrap(), MIB));
        assert!(!p.take(device, d, 4 * MIB), "more than it holds");
        assert!(p.take(device, d, 2 * MIB));
        assert_eq!(p.bytes.get(), MIB);
        d.retire_credit();
        assert!(
            !p.take(device, d, MIB),
            "credit of an older epoch is not spent"
        );
        assert_eq!(p.bytes.get(), MIB);
    }

    #[test]
    fn a_thread_without_a_lane_or_that_has_exited_keeps_nothing() {
        let (device, d) = (52, runtime::ledger().device(52).unwrap());
        for lane in [NO_LANE_YET, EXITED] {
            let p = fresh(lane);
            assert!(!p.keeps_credit());
            p.give(device, d, MIB);
            assert_eq!(p.bytes.get(), 0);
            assert_eq!(shared_credit(d), MIB as i64, "it went to the shards");
            d.pool.collect().debit(MIB);
        }
        assert!(fresh(0).keeps_credit() && fresh(7).keeps_credit());
    }

    #[test]
    fn a_thread_keeps_at_most_private_max_and_hands_on_the_rest() {
        let (device, d) = (53, runtime::ledger().device(53).unwrap());
        assert_eq!(PRIVATE_MAX, 8 * MIB);
        let p = fresh(4);
        p.give(device, d, PRIVATE_MAX);
        assert_eq!(p.bytes.get(), PRIVATE_MAX, "exactly the bound is kept");
        assert_eq!(shared_credit(d), 0);
        p.give(device, d, MIB);
        assert_eq!(
            p.bytes.get(),
            PRIVATE_MAX / 2,
            "over it, half the bound stays"
        );
        assert_eq!(shared_credit(d), (PRIVATE_MAX / 2 + MIB) as i64);
    }

    #[test]
    fn the_fast_free_keeps_pooled_credit_of_the_threads_device_up_to_the_bound() {
        let (device, d) = (54, runtime::ledger().device(54).unwrap());
        let p = fresh(5);
        p.give(device, d, MIB);
        assert!(p.give_fast(&pooled(device, 2 * MIB)));
        assert_eq!(p.bytes.get(), 3 * MIB);
        assert!(!p.give_fast(&pooled(device + 1, MIB)), "another device");
        let direct = Entry {
            kind: Kind::Direct,
            ..pooled(device, MIB)
        };
        assert!(!p.give_fast(&direct), "not stream-ordered");
        assert!(!p.give_fast(&pooled(device, PRIVATE_MAX)), "past the bound");
        assert_eq!(
            p.bytes.get(),
            3 * MIB,
            "a refused fast free changes nothing"
        );
        d.retire_credit();
        assert!(!p.give_fast(&pooled(device, MIB)), "an older epoch");
    }

    #[test]
    fn a_thread_claims_a_lane_once_and_an_exited_thread_claims_none() {
        let p = fresh(NO_LANE_YET);
        let lane = p.lane();
        assert!((1..ledger::LANES).contains(&lane), "lane {lane}");
        assert_eq!(p.lane.get(), lane);
        assert_eq!(p.lane(), lane, "the same lane again");
        assert!(p.keeps_credit());
        ledger::release_lane(lane);

        // Lane 0 (none was free): tried again while lanes are free.
        let p = fresh(0);
        let lane = p.lane();
        assert!((1..ledger::LANES).contains(&lane), "lane {lane}");
        ledger::release_lane(lane);

        let p = fresh(EXITED);
        assert_eq!(p.lane(), 0);
        assert_eq!(p.lane.get(), EXITED);
    }

    #[test]
    fn every_thread_has_its_private_credit_and_an_exit_handler() {
        assert!(private().is_some());
        assert!(arm_thread_exit());
        assert!(arm_thread_exit(), "armed again with the same key");
        assert_ne!(EXIT_KEY.load(Ordering::Acquire), UNMADE);
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
        let d = runtime::ledger().device(55).unwrap();
        d.set_budget(1 << 40);
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
