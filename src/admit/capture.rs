//! Stream capture: what the library must not do while a capture is under way, and how
//! it tells a captured call from a real one.
//!
//! During a capture in global mode the driver refuses "potentially unsafe" calls from
//! every thread that is not in relaxed mode — `cuMemPoolGetAttribute`,
//! `cuMemPoolTrimTo`, `cuMemCreate`, ... — and the refusal invalidates the capture
//! (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` at its end). So while any capture is active,
//! the library makes its own driver calls in relaxed mode ([`relaxed`]).
//!
//! A stream-ordered allocation on a capturing stream is not memory yet: it becomes a
//! memory node of the graph, whose memory is charged when the graph's memory is
//! reserved (at upload or launch, [`crate::admit::graphs`]). A stream-ordered free on a
//! capturing stream frees nothing until the graph runs, so the block stays charged.
//!
//! The library counts the captures it saw begin and not yet end ([`any`]): while there
//! are none, which is almost always, the fast paths ask the driver nothing more.

use std::ffi::c_int;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::admit::gate;
use crate::sys::driver::{
    CuResult, STREAM_CAPTURE_MODE_RELAXED, STREAM_CAPTURE_STATUS_NONE, Stream, real,
};

/// Whether any capture may be active: one relaxed load. The count lives in the gate's
/// word of reasons ([`crate::admit::gate`]), which the fast paths read once they are
/// inside, [`detour`]s with it. A detour is not counted here: limits, module loads and
/// waits under a created pool made current are budgeted as any others.
#[inline(always)]
pub fn any() -> bool {
    gate::captures()
}

/// Calls on a capturing stream between the check that it is capturing and the driver's
/// answer ([`recording`]), and ends of captures waiting for them ([`end`]): a capture
/// that ended in between would make the call run for real, uncharged.
static RECORDING: AtomicU32 = AtomicU32::new(0);
static ENDING: AtomicU32 = AtomicU32::new(0);

/// Held while a call that [`recording`] found recorded into a capture is made.
pub struct Recording(());

impl Drop for Recording {
    fn drop(&mut self) {
        RECORDING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// When `stream` is being captured: a guard under which no capture ends, so that a call
/// made while it is held is recorded into the graph, not run. `None`: not capturing.
pub fn recording(stream: Stream) -> Option<Recording> {
    if !any() {
        return None;
    }
    loop {
        RECORDING.fetch_add(1, Ordering::SeqCst);
        if ENDING.load(Ordering::SeqCst) == 0 {
            break;
        }
        // An end is waiting for the calls already recording: this one waits for it.
        RECORDING.fetch_sub(1, Ordering::SeqCst);
        while ENDING.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
    }
    let guard = Recording(());
    capturing(stream).then_some(guard)
}

/// `cuStreamEndCapture`: made once no call is between its check and its recording.
pub fn end(real: impl FnOnce() -> CuResult) -> CuResult {
    ENDING.fetch_add(1, Ordering::SeqCst);
    while RECORDING.load(Ordering::SeqCst) != 0 {
        std::thread::yield_now();
    }
    let rc = real();
    ENDING.fetch_sub(1, Ordering::SeqCst);
    ended(rc)
}

/// `cuStreamBeginCapture*`: counted as active before the driver starts it, so that no
/// thread makes a call of its own outside relaxed mode while the capture is on (one that
/// came between the driver's start and the count would be refused and break it); not
/// counted when the driver refuses it.
///
/// The driver starts it with the gate closed and nobody inside ([`crate::admit::gate`]): a
/// stream-ordered call that found no capture under way reaches the driver before the
/// capture starts, or waits and looks again. Otherwise a free that found none, made on
/// the stream just as its capture started, would become a node of the graph (nothing
/// freed) with the block's charge given back.
pub fn begin(real: impl FnOnce() -> CuResult) -> CuResult {
    gate::capture(true);
    let rc = gate::closed(real);
    if !rc.is_ok() {
        gate::capture(false);
    }
    rc
}

/// `cuStreamEndCapture` answered `rc` ([`end`]): the capture is over when it succeeded or when it
/// reports the capture invalidated (which ends it too).
fn ended(rc: CuResult) -> CuResult {
    if rc.is_ok() || rc == CuResult::STREAM_CAPTURE_INVALIDATED {
        gate::capture(false);
    }
    rc
}

/// Something else that must send stream-ordered calls down the full path began
/// (`true`) or ended: a pool the program created was made a device's current pool.
pub fn detour(on: bool) {
    gate::detour(on);
}

/// In the child of `fork()`: no capture came along.
pub fn after_fork() {
    gate::captures_after_fork();
    RECORDING.store(0, Ordering::Release);
    ENDING.store(0, Ordering::Release);
}

/// Whether `stream` is being captured (a call on it is recorded, not run). Asked only
/// while [`any`] capture is active; asked in relaxed mode, so the question itself is
/// never the unsafe call that breaks another thread's capture.
pub fn capturing(stream: Stream) -> bool {
    if !any() {
        return false;
    }
    let mut status: c_int = STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a valid out-pointer; the caller's stream handle.
    let rc = relaxed(|| unsafe { real::cuStreamIsCapturing(stream, &mut status) });
    // A stream the driver cannot answer for is not capturing anything we could charge.
    rc.is_ok() && status != STREAM_CAPTURE_STATUS_NONE
}

/// Runs `f` (the library's own driver calls) with the calling thread in relaxed capture
/// mode while any capture is active, and restores the thread's mode after.
pub fn relaxed<R>(f: impl FnOnce() -> R) -> R {
    if !any() {
        return f();
    }
    /// Puts the thread's own mode back, a panic in `f` included.
    struct Restore(c_int);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: a valid in/out pointer holding the thread's own mode.
            let _ = unsafe { real::cuThreadExchangeStreamCaptureMode(&mut self.0) };
        }
    }
    let mut mode: c_int = STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: a valid in/out pointer; the call swaps the thread's mode with `mode`.
    let swapped = unsafe { real::cuThreadExchangeStreamCaptureMode(&mut mode) }.is_ok();
    let _restore = swapped.then_some(Restore(mode));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A capture stops counting when the driver ends it, or reports it invalidated (which
    /// ends it too), and not when it refuses the end for another reason: the capture is
    /// still on, and calls of the library's own must stay relaxed.
    #[test]
    fn a_capture_ends_when_the_driver_ends_it_or_reports_it_invalidated_and_not_otherwise() {
        let _turn = gate::turn();
        for (rc, ends) in [
            (CuResult::SUCCESS, true),
            (CuResult::STREAM_CAPTURE_INVALIDATED, true),
            (CuResult::INVALID_VALUE, false),
        ] {
            gate::capture(true);
            assert!(any(), "{rc:?}: counted");
            assert_eq!(ended(rc), rc, "the driver's answer is the caller's");
            assert_eq!(any(), !ends, "{rc:?}");
            if !ends {
                gate::capture(false);
            }
            assert!(!any());
        }
    }
}
