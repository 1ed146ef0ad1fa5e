//! The library's one kind of lock: a small spin-then-sleep lock that the child of
//! `fork()` can take back without waiting.
//!
//! A `std::sync::Mutex` held by another thread at the moment of `fork()` stays locked
//! in the child for ever (only the forking thread comes along), so a child handler that
//! takes one hangs — even a child that only calls `_exit`. [`Lock::reset_in_child`]
//! instead *stores* a fresh value and an unlocked state: no wait, no lock, no drop of
//! whatever half-updated value the parent's thread left behind (it is leaked).
//!
//! The locks guard rare paths (the pool bank when a thread's credit runs dry, the
//! address table's overflow, `cuMemCreate` handles, context books), held for a few
//! driver calls at most, so spinning briefly and then sleeping is enough.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

/// How a thread waits for something another thread (or process) will soon let go of: it
/// spins a little, then yields, then sleeps in 50 µs steps. The library's locks (this
/// one, and a job's admission lock, held by another process) wait so.
#[derive(Default)]
pub struct Backoff {
    tries: u32,
}

impl Backoff {
    /// Waits once, a little longer each time.
    pub fn pause(&mut self) {
        self.tries = self.tries.saturating_add(1);
        if self.tries < 64 {
            std::hint::spin_loop();
        } else if self.tries < 128 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
}

pub struct Lock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through a guard, and a guard exists on one thread at
// a time (the `locked` flag is taken with acquire and released with release ordering).
unsafe impl<T: Send> Sync for Lock<T> {}
// SAFETY: moving the lock moves the value; `T: Send` is what that needs.
unsafe impl<T: Send> Send for Lock<T> {}

impl<T> Lock<T> {
    pub const fn new(value: T) -> Self {
        Self {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock: spins a little, then yields, then sleeps in short steps.
    pub fn lock(&self) -> Guard<'_, T> {
        let mut backoff = Backoff::default();
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            backoff.pause();
        }
        Guard { lock: self }
    }

    /// Takes the lock if it is free now; never waits.
    pub fn try_lock(&self) -> Option<Guard<'_, T>> {
        // A guard is made only once the lock is ours: a guard made and dropped on a
        // failed attempt (as `bool::then_some`'s eager argument would be) would release
        // the lock another thread holds.
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
            .then(|| Guard { lock: self })
    }

    /// In the child of `fork()`: the lock is free and holds `fresh`, whatever a thread
    /// of the parent was doing with it. Only stores: the old value is neither read nor
    /// dropped (it may be half-updated; what it owns is leaked).
    ///
    /// # Safety
    /// Only in a child of `fork()` before any other thread exists there (an at-fork child
    /// handler), when no guard of this lock can be alive on the calling thread.
    pub unsafe fn reset_in_child(&self, fresh: T) {
        // SAFETY: the caller guarantees no guard is alive in this process (the threads
        // that held one did not come along), so nothing else reaches the value.
        unsafe { std::ptr::write(self.value.get(), fresh) };
        self.locked.store(false, Ordering::Release);
    }
}

/// Access to the locked value; the lock is released on drop (a panic included).
pub struct Guard<'a, T> {
    lock: &'a Lock<T>,
}

impl<T> Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard holds the lock, and `&mut self` makes the access unique.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn threads_take_turns() {
        let lock = Arc::new(Lock::new(0u64));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let lock = Arc::clone(&lock);
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        *lock.lock() += 1;
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(*lock.lock(), 40_000);
    }

    #[test]
    fn a_failed_try_lock_leaves_the_lock_with_its_holder() {
        let lock = Lock::new(0u32);
        let held = lock.lock();
        assert!(lock.try_lock().is_none(), "held: not taken");
        // The failed attempt must not have released the holder's lock (it once did: the
        // guard it made and dropped unlocked it, and a second thread walked in).
        assert!(
            lock.try_lock().is_none(),
            "still held after a failed attempt"
        );
        assert!(lock.locked.load(Ordering::Acquire));
        drop(held);
        let again = lock.try_lock();
        assert!(again.is_some(), "free once the holder let go");
        assert!(lock.try_lock().is_none(), "and held by the new holder");
    }

    #[test]
    fn threads_that_only_try_never_hold_the_lock_together() {
        // Several threads take the lock with try_lock, others with lock; inside, each
        // checks that it is alone.
        let lock = Arc::new(Lock::new(()));
        let inside = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let overlaps = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let (lock, inside, overlaps) = (
                    Arc::clone(&lock),
                    Arc::clone(&inside),
                    Arc::clone(&overlaps),
                );
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let guard = if i % 2 == 0 {
                            lock.try_lock()
                        } else {
                            Some(lock.lock())
                        };
                        if let Some(_guard) = guard {
                            if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                                overlaps.fetch_add(1, Ordering::SeqCst);
                            }
                            std::hint::spin_loop();
                            inside.fetch_sub(1, Ordering::SeqCst);
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(overlaps.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_lock_held_elsewhere_is_taken_back_without_waiting() {
        let lock = Lock::new(vec![1, 2, 3]);
        let held = lock.lock();
        // What a child of fork() sees: the holder is gone.
        std::mem::forget(held);
        // SAFETY: no guard is alive (the one above was forgotten, as a parent's thread's
        // guard is in the child).
        unsafe { lock.reset_in_child(Vec::new()) };
        assert!(lock.lock().is_empty());
    }
}
