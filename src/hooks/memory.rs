//! The allocation and free entry points of device memory, synchronous and
//! stream-ordered, one per driver variant. Each enters once and hands the call to
//! [`crate::admit::flow`]: resolve → admit → real call → commit or roll back.

use super::guard;
use crate::admit::flow::{self, AllocLeft, DirectLeft, Fast, FreeLeft};
use crate::admit::gate;
use crate::books::ledger::Packed;
use crate::sys::driver::{CuResult, DevicePtr, MemPool, Stream, real};

/// # Safety
/// As the driver's `cuMemAlloc_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevicePtr, bytes: usize) -> CuResult {
    // SAFETY: the caller's arguments.
    let real = move || unsafe { real::cuMemAlloc_v2(dptr, bytes) };
    // As the stream-ordered fast path, before the guard: it neither indexes nor unwraps.
    match flow::alloc_direct_fast(bytes as u64, dptr, real) {
        Fast::Done(rc) => rc,
        Fast::Settle(left) => settle_direct(left),
        Fast::Declined(_) => alloc_full(dptr, bytes),
    }
}

/// `cuMemAlloc` past the fast path, out of its way.
#[inline(never)]
fn alloc_full(dptr: *mut DevicePtr, bytes: usize) -> CuResult {
    guard("cuMemAlloc", || {
        // SAFETY: the caller's arguments.
        let alloc = move || unsafe { real::cuMemAlloc_v2(dptr, bytes) };
        let cx = enter!(alloc);
        flow::alloc_plain(cx, bytes as u64, dptr, alloc)
    })
}

/// The books the synchronous fast path left of an allocation, under the guard.
#[cold]
#[inline(never)]
fn settle_direct(left: DirectLeft) -> CuResult {
    guard("cuMemAlloc", || {
        left.settle();
        CuResult::SUCCESS
    })
}

/// # Safety
/// As the driver's `cuMemAllocPitch_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut DevicePtr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: u32,
) -> CuResult {
    guard("cuMemAllocPitch", || {
        // SAFETY: the caller's arguments.
        let alloc = move || unsafe { real::cuMemAllocPitch_v2(dptr, pitch, width, height, elem) };
        let cx = enter!(alloc);
        flow::alloc_pitch(cx, width, height, dptr, pitch, alloc)
    })
}

/// Managed memory is counted in full: it may all come to live on the device.
///
/// # Safety
/// As the driver's `cuMemAllocManaged`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut DevicePtr,
    bytes: usize,
    flags: u32,
) -> CuResult {
    guard("cuMemAllocManaged", || {
        // SAFETY: the caller's arguments.
        let alloc = move || unsafe { real::cuMemAllocManaged(dptr, bytes, flags) };
        let cx = enter!(alloc);
        flow::alloc_direct(cx, "cuMemAllocManaged", bytes as u64, None, dptr, alloc)
    })
}

/// # Safety
/// As the driver's `cuMemFree_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemFree_v2(dptr: DevicePtr) -> CuResult {
    // SAFETY: the caller's argument.
    let real = move || unsafe { real::cuMemFree_v2(dptr) };
    // As `cuMemAlloc_v2`'s.
    match flow::free_direct_fast(dptr, real) {
        Fast::Done(rc) => rc,
        Fast::Settle(left) => settle_direct_free(left),
        Fast::Declined(_) => free_full(dptr),
    }
}

/// `cuMemFree` past the fast path, out of its way.
#[inline(never)]
fn free_full(dptr: DevicePtr) -> CuResult {
    guard("cuMemFree", || {
        // SAFETY: the caller's argument.
        let free = move || unsafe { real::cuMemFree_v2(dptr) };
        let cx = enter!(free);
        flow::free(cx, dptr, free)
    })
}

with_ptsz! {
    cuMemAllocAsync, driver,
    fn(
        dptr: *mut DevicePtr,
        bytes: usize,
        stream: Stream,
    ) {
        // SAFETY: the caller's arguments.
        let real = move || unsafe { driver(dptr, bytes, stream) };
        // The fast path neither indexes nor unwraps: it runs before the guard. Nor does
        // it call out of this function but to the driver: what it declines, the
        // missing membarrier included, goes to the full path with the arguments as
        // they came.
        match flow::alloc_async_fast::<false, _>(bytes as u64, dptr, real) {
            Fast::Done(rc) => rc,
            Fast::Settle(left) => settle_alloc(left.rc, left.dptr, left.bytes),
            Fast::Declined(_) => alloc_async_full(dptr, bytes, stream, driver),
        }
    }
}

with_ptsz! {
    cuMemAllocFromPoolAsync, driver,
    fn(
        dptr: *mut DevicePtr,
        bytes: usize,
        pool: MemPool,
        stream: Stream,
    ) {
        guard("cuMemAllocFromPoolAsync", || {
            // SAFETY: the caller's arguments.
            let alloc = move || unsafe { driver(dptr, bytes, pool, stream) };
            let cx = enter!(alloc);
            let bytes = bytes as u64;
            flow::alloc_pooled(
                cx,
                "cuMemAllocFromPoolAsync",
                bytes,
                Some(pool),
                stream,
                dptr,
                alloc,
            )
        })
    }
}

with_ptsz! {
    cuMemFreeAsync, driver, fn(dptr: DevicePtr, stream: Stream) {
        // SAFETY: the caller's arguments.
        let real = move || unsafe { driver(dptr, stream) };
        // As `cuMemAllocAsync`'s.
        match flow::free_async_fast::<false, _>(dptr, real) {
            Fast::Done(rc) => rc,
            Fast::Settle(left) => settle_free(left.ptr, left.entry, left.rc, left.mark),
            Fast::Declined(_) => free_async_full(dptr, stream, driver),
        }
    }
}

/// The books the stream-ordered fast path left of an allocation, under the guard; its
/// figures in registers.
#[cold]
#[inline(never)]
fn settle_alloc(rc: CuResult, dptr: *mut DevicePtr, bytes: u64) -> CuResult {
    guard("cuMemAllocAsync", || AllocLeft { rc, dptr, bytes }.settle())
}

/// As [`settle_alloc`], for a free.
#[cold]
#[inline(never)]
fn settle_free(ptr: DevicePtr, entry: Packed, rc: CuResult, mark: u64) -> CuResult {
    guard("cuMemFreeAsync", || {
        FreeLeft {
            ptr,
            entry,
            rc,
            mark,
        }
        .settle()
    })
}

/// As [`settle_free`], for a synchronous free.
#[cold]
#[inline(never)]
fn settle_direct_free(left: FreeLeft) -> CuResult {
    guard("cuMemFree", || left.settle())
}

/// `cuMemAllocAsync` past the fast path, out of its way: the arguments in registers,
/// the driver's variant as a pointer, so that the fast path keeps no frame for them.
#[inline(never)]
fn alloc_async_full(
    dptr: *mut DevicePtr,
    bytes: usize,
    stream: Stream,
    driver: unsafe fn(*mut DevicePtr, usize, Stream) -> CuResult,
) -> CuResult {
    // SAFETY: the caller's arguments, for the variant it was called as.
    let real = move || unsafe { driver(dptr, bytes, stream) };
    // Where the one reason was the missing membarrier: the fast path, fencing.
    let real = if gate::only_fences_missing(gate::FOR_ALLOC) {
        match flow::alloc_async_fast::<true, _>(bytes as u64, dptr, real) {
            Fast::Done(rc) => return rc,
            Fast::Settle(left) => return settle_alloc(left.rc, left.dptr, left.bytes),
            Fast::Declined(real) => real,
        }
    } else {
        real
    };
    guard("cuMemAllocAsync", || {
        let cx = enter!(real);
        flow::alloc_async(cx, bytes as u64, stream, dptr, real)
    })
}

/// `cuMemFreeAsync` past the fast path, out of its way (as [`alloc_async_full`]).
#[inline(never)]
fn free_async_full(
    dptr: DevicePtr,
    stream: Stream,
    driver: unsafe fn(DevicePtr, Stream) -> CuResult,
) -> CuResult {
    // SAFETY: the caller's arguments, for the variant it was called as.
    let real = move || unsafe { driver(dptr, stream) };
    // As `alloc_async_full`'s.
    let real = if gate::only_fences_missing(gate::FOR_FREE) {
        match flow::free_async_fast::<true, _>(dptr, real) {
            Fast::Done(rc) => return rc,
            Fast::Settle(left) => return settle_free(left.ptr, left.entry, left.rc, left.mark),
            Fast::Declined(real) => real,
        }
    } else {
        real
    };
    guard("cuMemFreeAsync", || {
        let cx = enter!(real);
        flow::free_async(cx, dptr, stream, real)
    })
}
