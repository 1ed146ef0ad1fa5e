//! What every allocation hook does: resolve the device, ask [`crate::admit::admit`], call
//! the driver, commit or roll back; and on the way back, release what a free gives back.
//! The stream-ordered fast paths ([`alloc_async_fast`], [`free_async_fast`]) spend and
//! give the thread's own credit ([`crate::admit::credit`]) and decide nothing else; the
//! synchronous ones ([`alloc_direct_fast`], [`free_direct_fast`]) take what `admit` grants
//! at once ([`super::admitted_at_once`]) and record the block in the thread's lane.

use std::sync::atomic::{AtomicU64, Ordering};

use super::credit::{PrivateCredit, give_pooled, private};
use super::{
    Ask, Fixed, Growth, POOL_STEP, Paid, admit, admitted_at_once, collect_all, growth_lock,
    make_room, prepaid_by_thread, settle_charge, trim_quietly, with_growth,
};
use crate::admit::{capture, footprint, gate, graphs, pools};
use crate::books::ledger::{
    self, BankGuard, DeviceLedger, Entry, Kind, Packed, Reservation, Table,
};
use crate::books::vmm;
use crate::runtime::{self, Cx, DeviceCx};
use crate::sys::driver::{
    CuResult, DevicePtr, GraphExec, MemAllocationProp, MemPool, Opaque, Stream,
};
use crate::tell::report;

/// The budgeted device for a call (`device`, or the calling context's), resolved once;
/// `None`: the device has no budget, call the driver unchanged.
#[inline(always)]
fn budgeted_device(cx: Cx, device: Option<usize>) -> Option<DeviceCx> {
    match device {
        Some(device) => cx.device(device),
        None => cx.current_device(),
    }
}

/// An upload or launch (`launch`) of an executable graph. One whose memory nodes could
/// make the device's graph memory grow is admitted first (by the growth it could cause:
/// what the graphs use now plus its footprint, less what is reserved), and the driver's
/// figure replaces the estimate after. Natively it would succeed; past the budget it
/// returns `CUDA_ERROR_OUT_OF_MEMORY` and runs nothing, as under MPS with a memory limit.
/// A launch that succeeds frees the outside blocks of the graph's free nodes.
pub fn launch_graph(
    cx: Cx,
    call: &str,
    launch: bool,
    exec: GraphExec,
    stream: Stream,
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
        let Some(dev) = cx.device(device) else {
            continue;
        };
        footprint::settle_before_admission(&dev);
        match admit(call, &dev, &mut Growth(|| graph_growth(device, bytes))) {
            Ok(Some(reservation)) => admitted.push((dev, reservation)),
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
            .filter_map(|ptr| {
                pointers
                    .remove(ptr, gate::open_lane)
                    .map(|entry| (ptr, entry))
            })
            .collect()
    } else {
        Vec::new()
    };
    let rc = real();
    for (dev, reservation) in admitted {
        // The driver's figure first, then the estimate goes; when the driver cannot
        // say, the estimate stays charged.
        if graphs::settle(dev.ordinal, dev.ledger) || !rc.is_ok() {
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
    dev: &DeviceCx,
    pool: MemPool,
    bytes: u64,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    footprint::settle_before_admission(dev);
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
    let admitted = match admit(call, dev, &mut Growth(growth)) {
        Ok(admitted) => admitted,
        Err(rc) => return rc,
    };
    let rc = real();
    pools::settle_created(pool, dev.ledger);
    drop(admitted);
    rc
}

/// `cuMemPoolDestroy` (`real`) of a pool the program created: what it still holds
/// (blocks not yet freed keep its reserve with the driver) stays charged; a pool with
/// nothing in use gives it all back. Under [`super::GROWTH`], so that no allocation from the
/// pool comes between the look at what it uses and its end.
pub fn created_pool_destroyed(cx: Cx, pool: MemPool, real: impl FnOnce() -> CuResult) -> CuResult {
    with_growth(|| {
        let live = pools::figures(pool).map(|(_, used)| used);
        let rc = real();
        if rc.is_ok()
            && let Some((device, charged)) = pools::unregister(pool)
            && let Some(dev) = cx.device(device)
        {
            if live == Some(0) {
                dev.ledger.release(charged);
            } else {
                pools::retire(device, charged);
            }
        }
        rc
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

/// The program trimmed a device's graph memory: charge what is left.
pub fn graph_memory_changed(cx: Cx, device: usize) {
    if let Some(dev) = cx.device(device) {
        graphs::settle(dev.ordinal, dev.ledger);
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
    let Some(dev) = budgeted_device(cx, device) else {
        return real();
    };
    alloc_into(&dev, runtime::pointers(), call, bytes, out, real)
}

/// The calling thread's credit and its lane's line in the gate (its count, whether it is
/// open, its region of the pointer table): what every fast path starts from. `None` for
/// a thread without a lane, which only a budgeted process gives (so no mode is asked).
#[inline(always)]
fn with_lane() -> Option<(&'static PrivateCredit, &'static gate::Inside)> {
    let p = private()?;
    Some((p, p.own.get()?))
}

/// Device 0's books in a process known to see one device: the one device the
/// synchronous fast path admits on.
#[inline(always)]
fn only_device() -> Option<&'static DeviceLedger> {
    if runtime::known_single_device() {
        runtime::ledger().device(0)
    } else {
        None
    }
}

/// `cuMemAlloc` where [`alloc_direct_fast`] declined it: [`alloc_direct`], then the
/// calling thread holds a lane (if one is free) where its next allocation may take the
/// fast path: in a process that sees one device whose budget is its own. (Elsewhere a
/// lane would serve nothing, and there are 31.)
pub fn alloc_plain(cx: Cx, bytes: u64, out: *mut u64, real: impl FnOnce() -> CuResult) -> CuResult {
    let rc = alloc_direct(cx, "cuMemAlloc", bytes, None, out, real);
    if rc.is_ok()
        && only_device().is_some_and(|d| d.own_budget().is_some())
        && let Some(p) = private()
    {
        p.lane();
    }
    rc
}

/// A synchronous allocation (`cuMemAlloc`) in a process that sees one device, admitted
/// at once against the device's own budget ([`super::admitted_at_once`]) and recorded in
/// the thread's own lane: one compare-and-swap on the device's counter, a few loads and
/// stores, and the driver's call. Declines whatever else, `real` untouched; the full
/// path ([`alloc_direct`]) then decides and gives the thread a lane.
///
/// Its entry is taken back as the full path's are, by exactly one thread (a
/// compare-and-swap on its slot: [`free_direct_fast`], or another thread's free through
/// the pointer map, which opens the lane first).
#[inline(always)]
pub fn alloc_direct_fast<F: FnOnce() -> CuResult>(
    bytes: u64,
    dptr: *mut DevicePtr,
    real: F,
) -> Fast<F, DirectLeft> {
    let Some((_, own)) = with_lane() else {
        return Fast::Declined(real);
    };
    // A null `dptr` the driver refuses: the full path passes it on.
    if dptr.is_null() {
        return Fast::Declined(real);
    }
    let Some(reservation) = only_device().and_then(|d| admitted_at_once(d, bytes)) else {
        return Fast::Declined(real);
    };
    let rc = real();
    if !rc.is_ok() {
        // Dropped: the reservation goes back.
        return Fast::Done(rc);
    }
    // SAFETY: the driver succeeded, so it wrote the new address through `dptr` (not
    // null, looked at above).
    let key = unsafe { *dptr };
    let entry = Entry {
        bytes,
        device: 0,
        kind: Kind::Direct,
    };
    if !own.region().insert(key, entry) {
        return Fast::Settle(DirectLeft {
            key,
            entry,
            reservation,
        });
    }
    reservation.commit();
    Fast::Done(rc)
}

/// The books of a synchronous allocation that [`alloc_direct_fast`] left: the driver
/// succeeded, and the block's bucket in the thread's lane was full.
pub struct DirectLeft {
    key: DevicePtr,
    entry: Entry,
    reservation: Reservation<'static>,
}

impl DirectLeft {
    /// Records the block in the shared table and keeps what was reserved for it.
    pub fn settle(self) {
        runtime::pointers().insert(self.key, self.entry);
        self.reservation.commit();
    }
}

/// A synchronous free (`cuMemFree`) of a block the calling thread's lane holds, on the
/// device whose books no job shares: the entry taken (a compare-and-swap on its slot,
/// so that of two frees of one block one alone gets it), the driver's call, the bytes
/// given back. Declines a block the lane does not hold, `real` untouched, for the full
/// path ([`free`]); what the driver refused or a clear came between goes to
/// [`FreeLeft::settle`].
#[inline(always)]
pub fn free_direct_fast<F: FnOnce() -> CuResult>(ptr: DevicePtr, real: F) -> Fast<F, FreeLeft> {
    let Some((_, own)) = with_lane() else {
        return Fast::Declined(real);
    };
    let mark = ledger::clears();
    let Some(entry) = own.region().take(ptr) else {
        return Fast::Declined(real);
    };
    let rc = real();
    if rc.is_ok()
        && ledger::no_clear_since(mark)
        && let Some(bytes) = entry.bytes_if(ledger::direct_tag(0), ledger::ENTRY_MAX)
        && runtime::ledger()
            .device(0)
            .is_some_and(|d| d.release_alone(bytes))
    {
        return Fast::Done(rc);
    }
    FreeLeft::left(ptr, entry, rc, mark)
}

/// As [`alloc_direct`], for array handles ([`Array`], [`MipmappedArray`]).
///
/// [`Array`]: crate::sys::driver::Array
/// [`MipmappedArray`]: crate::sys::driver::MipmappedArray
pub fn alloc_array(
    cx: Cx,
    call: &str,
    bytes: u64,
    out: *mut impl Opaque,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    let Some(dev) = cx.current_device() else {
        return real();
    };
    alloc_into(&dev, runtime::arrays(), call, bytes, out.cast(), real)
}

/// A synchronous allocation of `bytes` on the call's device, recorded in `table` under
/// what the driver writes to `out`.
///
/// Its entry goes to the shared table, whose removal is a compare-and-swap: of two
/// threads freeing one block at once, one alone takes the entry (the other's refused
/// free then restores nothing), so no free gives the same bytes back twice.
fn alloc_into(
    dev: &DeviceCx,
    table: &impl Table,
    call: &str,
    bytes: u64,
    out: *mut u64,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    let reservation = match admit(call, dev, &mut Fixed { bytes, wait: true }) {
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
                device: dev.ordinal,
                kind: Kind::Direct,
            },
        );
        if let Some(reservation) = reservation {
            reservation.commit();
        }
    }
    rc
}

/// `cuMemCreate` (`real`) of `size` bytes as `prop` says, whose handle the driver writes
/// to `handle`. Before refusing, the driver is asked whether it would accept the request
/// at all, with the smallest allocation of the same kind ([`super::Create`]).
///
/// # Safety
/// `prop` must be null or valid for the driver, `handle` as the driver's.
pub unsafe fn alloc_vmm(
    cx: Cx,
    handle: *mut u64,
    size: usize,
    prop: *const MemAllocationProp,
    flags: u64,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    if prop.is_null() {
        return real();
    }
    // SAFETY: checked non-null; the caller passes a valid property struct.
    let location = unsafe { (*prop).location };
    if location.kind != crate::sys::driver::MEM_LOCATION_TYPE_DEVICE || location.id < 0 {
        return real();
    }
    let Some(dev) = cx.device(location.id as usize) else {
        return real();
    };
    let bytes = size as u64;
    let mut ask = super::Create { size, prop, flags };
    let reservation = match admit("cuMemCreate", &dev, &mut ask) {
        Ok(r) => r,
        Err(rc) => return rc,
    };
    let rc = real();
    if rc.is_ok() {
        // SAFETY: the driver wrote the handle.
        vmm::lock().created(unsafe { *handle }, bytes, dev.ordinal);
        if let Some(reservation) = reservation {
            reservation.commit();
        }
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
    let Some(dev) = cx.current_device() else {
        return real();
    };
    let table = runtime::pointers();
    let rc = alloc_into(&dev, table, "cuMemAllocPitch", estimate, dptr, real);
    if rc.is_ok() && !pitch.is_null() && !dptr.is_null() {
        // SAFETY: the driver succeeded and wrote both out-parameters.
        let (ptr, actual) = unsafe { (*dptr, (*pitch as u64).saturating_mul(height as u64)) };
        if actual != estimate
            && let Some(mut entry) = table.remove(ptr, gate::open_lane)
        {
            super::after::charge_after(dev.ledger, estimate, actual);
            entry.bytes = actual;
            table.insert(ptr, entry);
        }
    }
    rc
}

/// A free of a device pointer, synchronous or stream-ordered. A pointer the ledger never
/// saw passes through and moves nothing.
pub fn free(cx: Cx, ptr: DevicePtr, real: impl FnOnce() -> CuResult) -> CuResult {
    free_from(cx, runtime::pointers(), ptr, real)
}

/// What the stream-ordered fast paths ([`alloc_async_fast`], [`free_async_fast`]) did
/// with a call. They index nothing and unwrap nothing, so that the hook can run them
/// before its panic guard; what follows them runs inside it.
pub enum Fast<F, S> {
    /// The driver answered and the books are kept.
    Done(CuResult),
    /// The driver answered; the books of its answer are still to be kept
    /// ([`AllocLeft::settle`], [`FreeLeft::settle`]).
    Settle(S),
    /// Not for the fast path: `real` untouched, for the full path.
    Declined(F),
}

/// The books of an allocation the fast path left: the driver refused it, or its bucket
/// was full.
pub struct AllocLeft {
    pub rc: CuResult,
    pub dptr: *mut DevicePtr,
    pub bytes: u64,
}

impl AllocLeft {
    /// Keeps the books of the driver's answer and returns that answer.
    pub fn settle(self) -> CuResult {
        alloc_async_rest(self.rc, self.dptr, self.bytes)
    }
}

/// The books of a free a fast path left: the driver refused it, a clear came between,
/// the credit is past what a thread keeps, or the block is not of the kind the path
/// gives back itself (a job's, another device's).
pub struct FreeLeft {
    pub ptr: DevicePtr,
    pub entry: Packed,
    pub rc: CuResult,
    pub mark: u64,
}

impl FreeLeft {
    /// What a fast path leaves to [`Self::settle`].
    #[inline(always)]
    fn left<F>(ptr: DevicePtr, entry: Packed, rc: CuResult, mark: u64) -> Fast<F, Self> {
        Fast::Settle(FreeLeft {
            ptr,
            entry,
            rc,
            mark,
        })
    }

    /// Keeps the books of the driver's answer and returns that answer.
    pub fn settle(self) -> CuResult {
        free_async_rest(self.ptr, self.entry.entry(), self.rc, self.mark)
    }
}

/// `cuMemFreeAsync` where [`free_async_fast`] declined it: the block is most likely a
/// stream-ordered one of another thread, or of no lane ([`free_async_slow`]).
pub fn free_async(
    cx: Cx,
    ptr: DevicePtr,
    stream: Stream,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    free_async_slow(cx, ptr, stream, real)
}

/// The common free: a block freed by the thread that allocated it, found in that
/// thread's lane and credited to that thread — a few loads and stores and the driver's
/// call. Declines whatever else, `real` untouched.
#[inline(always)]
pub fn free_async_fast<const FENCED: bool, F: FnOnce() -> CuResult>(
    ptr: DevicePtr,
    real: F,
) -> Fast<F, FreeLeft> {
    let Some((p, own)) = with_lane() else {
        return Fast::Declined(real);
    };
    // Inside the gate from before the look at the captures (the gate's word of reasons,
    // read as it is entered) until the driver's answer: a capture of the stream starts
    // before the look or after the free (crate::admit::capture).
    if !gate::enter_own::<FENCED>(own, gate::FOR_FREE) {
        return Fast::Declined(real);
    }
    let mark = ledger::clears();
    // Plain stores while the thread alone takes from its region; once another thread
    // has freed a block of it (the lane is open), a compare-and-swap, so that two frees
    // of one block never both take its entry.
    let taken = if gate::lane_open(own) {
        own.region().take(ptr)
    } else {
        own.region().take_own(ptr)
    };
    let Some(entry) = taken else {
        gate::leave_own(own);
        return Fast::Declined(real);
    };
    let rc = real();
    gate::leave_own(own);
    // A clear that starts after this check moves the device's epoch when it ends, which
    // voids credit given under the old one.
    if rc.is_ok() && ledger::no_clear_since(mark) && p.give_fast(entry) {
        return Fast::Done(rc);
    }
    FreeLeft::left(ptr, entry, rc, mark)
}

/// A stream-ordered free that is not [`free_async_fast`]'s: a block of another thread or
/// of no lane, the thread's locals gone, a capture under way.
fn free_async_slow(
    cx: Cx,
    ptr: DevicePtr,
    stream: Stream,
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
    let Some(entry) = pointers.remove_pooled(ptr, p.lane.get(), gate::open_lane) else {
        return real();
    };
    let rc = real();
    free_async_rest(ptr, entry, rc, mark)
}

/// The books after the driver's answer to a free whose entry was removed after `mark`
/// (see [`settle_free`]): a stream-ordered one, or a fast path's ([`FreeLeft`]). A
/// stream-ordered block's credit goes to the freeing thread, a synchronous block's bytes
/// back to its device.
#[inline(never)]
fn free_async_rest(ptr: DevicePtr, entry: Entry, rc: CuResult, mark: u64) -> CuResult {
    settle_free(runtime::pointers(), ptr, entry, rc, mark, |entry| {
        match (
            entry.kind,
            runtime::ledger().device(entry.device),
            private(),
        ) {
            (Kind::Pooled, Some(d), Some(p)) => p.give(entry.device, d, entry.bytes),
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
pub fn free_array(cx: Cx, array: impl Opaque, real: impl FnOnce() -> CuResult) -> CuResult {
    free_from(cx, runtime::arrays(), array.key() as u64, real)
}

fn free_from(_cx: Cx, table: &impl Table, key: u64, real: impl FnOnce() -> CuResult) -> CuResult {
    // Removed before the driver frees it: once freed, the driver may hand the same
    // address to another thread, whose insert must not find ours.
    let mark = ledger::clears();
    let Some(entry) = table.remove(key, gate::open_lane) else {
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

#[inline]
fn release(entry: Entry) {
    let Some(d) = runtime::ledger().device(entry.device) else {
        return;
    };
    match entry.kind {
        Kind::Direct => d.release(entry.bytes),
        Kind::Pooled => give_pooled(entry.device, d, entry.bytes),
    }
}

/// `cuMemAllocAsync` where [`alloc_async_fast`] declined it: [`alloc_pooled`].
pub fn alloc_async(
    cx: Cx,
    bytes: u64,
    stream: Stream,
    dptr: *mut DevicePtr,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    alloc_pooled(cx, "cuMemAllocAsync", bytes, None, stream, dptr, real)
}

/// A stream-ordered allocation in a process that sees one device, from the thread's own
/// credit, into the thread's own lane: a few loads and stores and the driver's call.
/// Declines whatever else, `real` untouched.
#[inline(always)]
pub fn alloc_async_fast<const FENCED: bool, F: FnOnce() -> CuResult>(
    bytes: u64,
    dptr: *mut DevicePtr,
    real: F,
) -> Fast<F, AllocLeft> {
    // Credit for a device is only ever given in a budgeted process, for a budgeted
    // device, and a lane claimed only there, so holding both answers both questions.
    let Some((p, own)) = with_lane() else {
        return Fast::Declined(real);
    };
    // A null `dptr` the driver refuses: the full path passes it on.
    if dptr.is_null() {
        return Fast::Declined(real);
    }
    // Inside the gate before the reasons for the full path are looked at (one word: a
    // capture, a detour, more than one device): a switch of the device's current pool
    // waits for this call to reach the driver, or turns the detour on first.
    if !gate::enter_own::<FENCED>(own, gate::FOR_ALLOC) {
        return Fast::Declined(real);
    }
    let d0 = runtime::ledger().device(0);
    if !d0.is_some_and(|d| prepaid_by_thread(p, d, bytes)) {
        gate::leave_own(own);
        return Fast::Declined(real);
    }
    let rc = real();
    gate::leave_own(own);
    let entry = Entry {
        bytes,
        device: 0,
        kind: Kind::Pooled,
    };
    if rc.is_ok()
        // SAFETY: the driver succeeded, so it wrote the new address through `dptr` (not
        // null, looked at above).
        && own.region().insert(unsafe { *dptr }, entry)
    {
        return Fast::Done(rc);
    }
    Fast::Settle(AllocLeft { rc, dptr, bytes })
}

/// The fast path's allocation when the driver refused it or its bucket was full.
fn alloc_async_rest(rc: CuResult, dptr: *mut DevicePtr, bytes: u64) -> CuResult {
    // The calling thread's lane, as the fast path found it.
    let lane = private().map_or(0, PrivateCredit::lane_held);
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
    pool: Option<MemPool>,
    stream: Stream,
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
    let Some(dev) = device.and_then(|device| cx.device(device)) else {
        return real();
    };
    let (device, d) = (dev.ordinal, dev.ledger);
    if runtime::known_single_device() {
        // The stream-ordered fast path charges device 0: it may run (said once).
        gate::one_device();
    }
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
        return alloc_from_created(call, &dev, pool, bytes, real);
    }
    // Refused before any credit moves, so a failure cannot give back credit that was
    // never taken.
    if let Err(refusal) = super::within_reach(call, &dev, bytes) {
        return refusal;
    }
    let p = private();
    let lane = p.map_or(0, PrivateCredit::lane);
    let Some(paid) = super::prepaid(&dev, p, bytes) else {
        return grow_pools(call, &dev, bytes, dptr, lane, real);
    };
    let rc = real();
    record_pooled(rc, dptr, bytes, device, d, lane, paid);
    rc
}

#[inline]
fn record_pooled(
    rc: CuResult,
    dptr: *mut DevicePtr,
    bytes: u64,
    device: usize,
    d: &'static DeviceLedger,
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

/// The growth of the device's own pools that a stream-ordered allocation of `bytes`
/// (whose debt is in `bank`) needs: the bank's deficit, in the driver's 32 MiB steps.
/// Admitted under the bank, which its caller took after settling the footprint.
struct PoolGrowth<'b, 'd> {
    bank: &'b mut BankGuard<'d>,
    bytes: u64,
}

impl Ask for PoolGrowth<'_, '_> {
    fn bytes(&mut self) -> Option<u64> {
        let credit = self.bank.credit();
        (credit < 0).then(|| credit.unsigned_abs().div_ceil(POOL_STEP) * POOL_STEP)
    }

    fn settle(&self, _dev: &DeviceCx) {}

    /// The trim covers only others' deficits: this request is not taken out of the pools
    /// while they are trimmed, and is admitted after like any growth.
    fn make_room(&mut self, dev: &DeviceCx) {
        self.bank.refund(self.bytes);
        make_room(dev, self.bank);
        self.bank.debit(self.bytes);
    }
}

#[cold]
#[inline(never)]
fn grow_pools(
    call: &str,
    dev: &DeviceCx,
    bytes: u64,
    dptr: *mut DevicePtr,
    lane: usize,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    let (device, d) = (dev.ordinal, dev.ledger);
    footprint::settle_before_admission(dev);
    let shard = runtime::shard();
    let mut bank = collect_all(d);
    // The request's shard was dry: it is debited here, under the lock.
    bank.debit(bytes);
    let charge_before = d.pool.charge();
    // The pools must grow by the deficit, if there is one: admit that first.
    let mut growth = PoolGrowth {
        bank: &mut bank,
        bytes,
    };
    match admit(call, dev, &mut growth) {
        Ok(Some(r)) => {
            // Charged to the pools: only this thread, under the bank, moves their charge.
            let (growth, charge) = (r.bytes(), d.pool.charge());
            r.commit();
            bank.set_charge(charge + growth);
        }
        Ok(None) => {}
        Err(rc) => {
            bank.refund(bytes);
            return rc;
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

/// A context on `device` is gone. When it was the device's last, the books are cleared
/// ([`footprint::context_gone`], after `forget`) and what survives it by the driver's
/// figures is charged again: the pools the program created, the device's own pools
/// (whose blocks still in use are no credit) and its graph memory.
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
    super::after::charge_after(d, 0, pools::retired(device));
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
pub fn pool_trimmed(cx: Cx, device: usize, pool: MemPool) {
    let Some(d) = cx.device(device).map(|dev| dev.ledger) else {
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

/// When the pools' charge was last brought to the driver's figures, per device.
static REFRESHED_MS: [AtomicU64; ledger::MAX_DEVICES] =
    [const { AtomicU64::new(0) }; ledger::MAX_DEVICES];

/// From the views (at most once a second per device): the pools' charge follows what the
/// driver reserves now. The driver gives pool memory back on its own (a synchronize
/// below the release threshold), and a view that still counted it would show less free
/// memory than there is — which a framework sizing its pool from it (XLA) would believe.
pub fn refresh_pools(dev: &DeviceCx) {
    let (device, d) = (dev.ordinal, dev.ledger);
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
}
