//! `CUDABUDGET_ON_EXCEED=wait:<duration>` for a process's own budget: a thread whose
//! allocation does not fit sleeps (a futex, no polling) until a free in the process
//! makes room or its time is up; waiters are served in arrival order, so a large
//! request is not overtaken for ever by small ones. (A job's waiters sleep on the job's
//! shared word instead: [`crate::books::job::Turn::wait_for_room`].)

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::sys::lock::Lock;

/// Bumped on every release while someone waits (the futex word).
static ROOM: AtomicU32 = AtomicU32::new(0);
/// Threads waiting now: releases only touch [`ROOM`] while this is not zero.
static WAITERS: AtomicU32 = AtomicU32::new(0);
static NEXT_TICKET: AtomicU64 = AtomicU64::new(1);
/// The tickets of the threads waiting now, oldest first.
static QUEUE: Lock<Vec<u64>> = Lock::new(Vec::new());

/// Memory was given back in this process, or its budget grew: wakes the waiters, if any
/// (one relaxed load otherwise).
#[inline]
pub fn freed() {
    if WAITERS.load(Ordering::Relaxed) != 0 {
        wake();
    }
}

#[cold]
fn wake() {
    ROOM.fetch_add(1, Ordering::Release);
    // SAFETY: a private futex wake of every waiter on a static word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            ROOM.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        );
    }
}

/// Waits until `fits()` holds while this thread is the oldest waiter, or until
/// `deadline`; true when it may try again now.
pub fn wait_for_room(deadline: Instant, fits: impl Fn() -> bool) -> bool {
    let ticket = NEXT_TICKET.fetch_add(1, Ordering::Relaxed);
    QUEUE.lock().push(ticket);
    WAITERS.fetch_add(1, Ordering::AcqRel);
    let result = loop {
        let seen = ROOM.load(Ordering::Acquire);
        let first = QUEUE.lock().first() == Some(&ticket);
        if first && fits() {
            break true;
        }
        let now = Instant::now();
        if now >= deadline {
            break false;
        }
        let nap = (deadline - now).min(Duration::from_millis(100));
        let ts = libc::timespec {
            tv_sec: nap.as_secs() as libc::time_t,
            tv_nsec: nap.subsec_nanos() as libc::c_long,
        };
        // SAFETY: a private futex wait on a static word, with a timeout.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                ROOM.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                seen,
                &ts as *const libc::timespec,
            );
        }
    };
    QUEUE.lock().retain(|&t| t != ticket);
    WAITERS.fetch_sub(1, Ordering::AcqRel);
    // The next in line may go now.
    wake();
    result
}

/// In the child of `fork()`: nobody waits (only the forking thread came along).
///
/// # Safety
/// Only from an at-fork child handler.
pub unsafe fn after_fork() {
    WAITERS.store(0, Ordering::Release);
    // SAFETY: the caller's guarantee.
    unsafe { QUEUE.reset_in_child(Vec::new()) };
}
