//! The job's ledger cut under its members: a SIGBUS handler that maps zeroed memory
//! over the mapping and marks the job damaged, and the mappings it watches.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::words::*;
use std::cell::UnsafeCell;
use std::mem::MaybeUninit;

// ---------------------------------------------------------------------------------------
// Mappings this process holds, for the SIGBUS handler.

pub(super) struct Mapped {
    pub(super) base: AtomicUsize,
    /// The file mapped (device and inode).
    pub(super) dev: AtomicU64,
    pub(super) ino: AtomicU64,
    pub(super) damaged: AtomicBool,
    /// The slot of the Job using the mapping (+1; 0: none yet).
    pub(super) slot: AtomicUsize,
    /// The descriptor the file is open with (to mark it damaged for every member).
    pub(super) fd: AtomicU32,
}

pub(super) const MAPPINGS: usize = 64;
pub(super) static MAPPED: [Mapped; MAPPINGS] = [const {
    Mapped {
        base: AtomicUsize::new(0),
        dev: AtomicU64::new(0),
        ino: AtomicU64::new(0),
        damaged: AtomicBool::new(false),
        slot: AtomicUsize::new(0),
        fd: AtomicU32::new(u32::MAX),
    }
}; MAPPINGS];

/// The action SIGBUS had before ours (written once, before ours is installed).
pub(super) struct OldAction(pub(super) UnsafeCell<MaybeUninit<libc::sigaction>>);
// SAFETY: written once inside `Once::call_once` before the handler that reads it exists.
unsafe impl Sync for OldAction {}
pub(super) static OLD_SIGBUS: OldAction = OldAction(UnsafeCell::new(MaybeUninit::zeroed()));
pub(super) static SIGBUS_ONCE: std::sync::Once = std::sync::Once::new();

pub(super) fn install_sigbus_handler() {
    SIGBUS_ONCE.call_once(|| {
        // SAFETY: an all-zero sigaction is a valid value; the fields are set below.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_sigbus as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
        // SAFETY: a valid signal set out-pointer.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: valid pointers; OLD_SIGBUS is read (and written) here, once, before ours
        // is installed: no signal can reach the handler before it is whole.
        unsafe {
            libc::sigaction(
                libc::SIGBUS,
                std::ptr::null(),
                (*OLD_SIGBUS.0.get()).as_mut_ptr(),
            );
            libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
        }
    });
}

/// SIGBUS: a fault inside a ledger mapping (the file was cut under it) maps zeroed memory
/// over the mapping and marks the job damaged, and the access is made again; any other
/// fault goes to the handler that was there before, or to the default action.
pub(super) extern "C" fn on_sigbus(
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    ctx: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // Sent (kill, sigqueue: si_code <= 0): no fault, and no address.
    let sent = code <= 0;
    for m in MAPPED.iter().filter(|_| !sent) {
        let base = m.base.load(Ordering::Acquire);
        if base != 0 && addr >= base && addr < base + FILE_BYTES {
            m.damaged.store(true, Ordering::Release);
            poison(
                m.fd.load(Ordering::Acquire),
                m.dev.load(Ordering::Acquire),
                m.ino.load(Ordering::Acquire),
            );
            // SAFETY: replaces our own mapping, of this exact range, with anonymous
            // memory (mmap is a plain system call, safe in a signal handler).
            let p = unsafe {
                libc::mmap(
                    base as *mut libc::c_void,
                    FILE_BYTES,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                return;
            }
        }
    }
    // SAFETY: OLD_SIGBUS was written before this handler was installed.
    let old = unsafe { (*OLD_SIGBUS.0.get()).assume_init_ref() };
    let handler = old.sa_sigaction;
    if handler == libc::SIG_IGN && sent {
        // Ignored, as before us.
    } else if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // The default action: on the access made again when this returns (a fault), or
        // raised again (a sent signal is not sent again by returning; SIGBUS is blocked
        // in here, so it is taken as this returns).
        // SAFETY: an all-zero sigaction with SIG_DFL (0) is the default action.
        let dfl: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointers; raise is async-signal-safe.
        unsafe {
            libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            if sent {
                libc::raise(libc::SIGBUS);
            }
        }
    } else if old.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous handler, called as it was registered (SA_SIGINFO).
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(handler) };
        f(sig, info, ctx);
    } else {
        // SAFETY: the previous handler, called as it was registered.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
        f(sig);
    }
}

/// Marks the ledger behind `fd` damaged for every member: its magic is zeroed through the
/// descriptor (a plain system call, safe in a signal handler). A member whose mapping
/// was replaced no longer writes the file, so the others must stop trusting it too.
/// Only while `fd` is still the ledger (`dev`, `ino`): the program may have closed it
/// and the number may now be another file, which is left alone.
pub(super) fn poison(fd: u32, dev: u64, ino: u64) {
    if fd != u32::MAX && is_file(fd, dev, ino) {
        let zero = [0u8; 8];
        // SAFETY: writes 8 bytes from a live buffer to a descriptor we keep open.
        unsafe { libc::pwrite(fd as libc::c_int, zero.as_ptr().cast(), 8, 0) };
    }
}

/// Whether descriptor `fd` is open on the file (`dev`, `ino`) (fstat: a plain system
/// call, safe in a signal handler).
pub(super) fn is_file(fd: u32, dev: u64, ino: u64) -> bool {
    let mut st = MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: a valid out-pointer to a stat buffer; a bad descriptor only fails.
    if unsafe { libc::fstat(fd as libc::c_int, st.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: fstat succeeded and filled it (and it was zeroed anyway).
    let st = unsafe { st.assume_init() };
    st.st_dev == dev && st.st_ino == ino
}

pub(super) fn register_mapping(base: *mut u8, dev: u64, ino: u64, fd: u32) -> Option<usize> {
    MAPPED.iter().position(|m| {
        m.base
            .compare_exchange(0, base as usize, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
            && {
                m.damaged.store(false, Ordering::Release);
                m.slot.store(0, Ordering::Release);
                m.dev.store(dev, Ordering::Release);
                m.ino.store(ino, Ordering::Release);
                m.fd.store(fd, Ordering::Release);
                true
            }
    })
}

/// Whether slot `slot` of the ledger (`dev`, `ino`) is used by a Job of this image.
pub(super) fn ours_in_this_image(dev: u64, ino: u64, slot: usize) -> bool {
    MAPPED.iter().any(|m| {
        m.base.load(Ordering::Acquire) != 0
            && m.slot.load(Ordering::Acquire) == slot + 1
            && m.dev.load(Ordering::Acquire) == dev
            && m.ino.load(Ordering::Acquire) == ino
    })
}
