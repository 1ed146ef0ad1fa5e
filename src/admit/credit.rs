//! The credit a thread keeps for its own stream-ordered allocations ([`PrivateCredit`]),
//! and the lane of the address table it claims: what keeps the stream-ordered fast path
//! (`flow::alloc_async_fast`, `flow::free_async_fast`) off shared cache lines.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use super::gate;
use crate::books::ledger::{self, DeviceLedger, Packed};
use crate::runtime;

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
#[repr(C)]
pub(super) struct PrivateCredit {
    /// The thread's lane in the address table ([`ledger::claim_lane`]): [`NO_LANE_YET`]
    /// before the first claim, 0 when none was free, [`EXITED`] once [`thread_exit`] ran.
    pub(super) lane: Cell<usize>,
    /// The device the credit is for, as the top byte of its stream-ordered blocks'
    /// entries ([`ledger::pooled_tag`]), so that a free's entry is matched and its size
    /// read in one subtraction; [`ledger::NO_TAG`] before the first credit.
    tag: Cell<u64>,
    /// The device's epoch when the credit was given: credit from before its books were
    /// cleared (the context went away) is void.
    epoch: Cell<u64>,
    /// At most [`PRIVATE_MAX`], so 32 bits: a size the credit covers is then known (to
    /// the compiler too) to fit an address-table entry as it is. The word's other half
    /// is padding.
    bytes: Cell<u32>,
    /// What the thread writes alone for its lane (its line in the gate: the count, the
    /// region of the pointer table), as [`PrivateCredit::hold_lane`] set it with the
    /// lane: one pointer the fast paths follow instead of working it out from the lane.
    /// `None` without a lane of its own.
    pub(super) own: Cell<Option<&'static gate::Inside>>,
    /// The books of the device the credit is for (whose epoch it was given in); `None`
    /// before the first credit.
    books: Cell<Option<&'static DeviceLedger>>,
}

const PRIVATE_MAX: u64 = 8 << 20;
const _: () = assert!(PRIVATE_MAX <= u32::MAX as u64);

const NO_LANE_YET: usize = usize::MAX;
/// The thread's [`thread_exit`] has run: it keeps no lane and no credit any more.
const EXITED: usize = usize::MAX - 1;

impl PrivateCredit {
    /// The thread's lane as it is, without claiming one (gate::enter takes any value).
    pub(super) fn lane_held(&self) -> usize {
        self.lane.get()
    }

    /// The thread's lane, claiming one on first use (0: none).
    #[inline]
    pub(super) fn lane(&self) -> usize {
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
            self.hold_lane(EXITED);
            return 0;
        }
        let lane = ledger::claim_lane();
        self.hold_lane(lane);
        lane
    }

    /// Holds `lane`, with its line in the gate (its count, its region of the pointer
    /// table; none for a value that is no lane of its own); returns the lane held before.
    fn hold_lane(&self, lane: usize) -> usize {
        self.own.set(gate::own_line(lane));
        self.lane.replace(lane)
    }

    /// Whether the thread may keep credit (its exit guard will give it back).
    fn keeps_credit(&self) -> bool {
        let lane = self.lane.get();
        lane != NO_LANE_YET && lane != EXITED
    }

    /// Takes `bytes` from the thread's credit for the device whose books `d` are, if it
    /// holds that much.
    #[inline(always)]
    pub(super) fn take(&self, d: &DeviceLedger, bytes: u64) -> bool {
        let held = self.held();
        // No two devices share an epoch: the credit's names its device.
        let ok = held >= bytes && self.epoch.get() == d.epoch();
        if ok {
            self.keep(held - bytes);
        }
        ok
    }

    /// The fast path's credit for a freed block: the thread's own device and epoch, and
    /// room below [`PRIVATE_MAX`]; false leaves everything as it was.
    #[inline(always)]
    pub(super) fn give_fast(&self, entry: Packed) -> bool {
        let Some(bytes) = entry.bytes_if(self.tag.get(), PRIVATE_MAX) else {
            return false;
        };
        // No overflow: at most twice PRIVATE_MAX.
        let held = self.held() + bytes;
        let ok = held <= PRIVATE_MAX
            && self
                .books
                .get()
                .is_some_and(|d| d.epoch() == self.epoch.get());
        if ok {
            self.keep(held);
        }
        ok
    }

    /// The bytes held.
    #[inline(always)]
    pub(super) fn held(&self) -> u64 {
        u64::from(self.bytes.get())
    }

    /// Holds `bytes`, at most [`PRIVATE_MAX`].
    #[inline(always)]
    fn keep(&self, bytes: u64) {
        // Every caller's figure is within the bound: what was held less a size, or a
        // sum it compared with the bound.
        debug_assert!(bytes <= PRIVATE_MAX);
        self.bytes.set(bytes as u32);
    }

    pub(super) fn give(&self, device: usize, d: &'static DeviceLedger, bytes: u64) {
        if !self.keeps_credit() {
            d.pool.give(runtime::shard(), bytes);
            return;
        }
        if self.tag.get() != ledger::pooled_tag(device) || self.epoch.get() != d.epoch() {
            self.flush();
            self.tag.set(ledger::pooled_tag(device));
            self.books.set(Some(d));
            self.epoch.set(d.epoch());
        }
        let held = self.held().saturating_add(bytes);
        if held > PRIVATE_MAX {
            let keep = PRIVATE_MAX / 2;
            d.pool.give(runtime::shard(), held - keep);
            self.keep(keep);
        } else {
            self.keep(held);
        }
    }

    /// Gives everything the thread kept back: to its shard while the credit is current,
    /// to the bank when the pools have shrunk since it was given (the bank's total then
    /// shows whether the pools must grow again before it is spent), nowhere when the
    /// device's books were cleared since.
    pub(super) fn flush(&self) {
        let held = u64::from(self.bytes.replace(0));
        let Some(d) = self.books.get() else {
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

/// What a thread's credit is before its first use (the `.tdata` image below spells the
/// same words: lane, tag, epoch, bytes, no lane of its own and no books).
#[cfg_attr(
    all(target_arch = "x86_64", target_os = "linux", not(test)),
    expect(dead_code, reason = "the TLS image's twin, compared in a test")
)]
const fn private_init() -> PrivateCredit {
    PrivateCredit {
        lane: Cell::new(NO_LANE_YET),
        tag: Cell::new(ledger::NO_TAG),
        epoch: Cell::new(0),
        bytes: Cell::new(0),
        own: Cell::new(None),
        books: Cell::new(None),
    }
}

// The thread's credit in the static TLS block, reached with the initial-exec model: two
// instructions (the thread pointer plus an offset the loader wrote once), where Rust's
// `thread_local!` in a shared object calls `__tls_get_addr` on every access. A library
// with initial-exec TLS must be loaded at start-up (LD_PRELOAD, as ours is) or fit the
// static TLS surplus glibc keeps for `dlopen` (these 48 bytes do). Aligned to a cache
// line, so that they are one line in every program: where the block lands depends on the
// TLS of the program and the libraries before ours, and at 32 bytes' alignment it could
// straddle two (one more line for every call to miss).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
std::arch::global_asm!(
    ".pushsection .tdata.cudabudget_private,\"awT\",@progbits",
    ".p2align 6",
    ".globl cudabudget_private_credit",
    ".hidden cudabudget_private_credit",
    ".type cudabudget_private_credit, @object",
    ".size cudabudget_private_credit, 48",
    "cudabudget_private_credit:",
    ".quad -1, 0xff00000000000000, 0, 0, 0, 0",
    ".popsection",
);

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
const _: () = {
    // The image above is private_init()'s words, in PrivateCredit's order.
    assert!(std::mem::size_of::<PrivateCredit>() == 48);
    assert!(std::mem::offset_of!(PrivateCredit, lane) == 0);
    assert!(std::mem::offset_of!(PrivateCredit, tag) == 8);
    assert!(ledger::NO_TAG == 0xff00_0000_0000_0000);
    assert!(std::mem::offset_of!(PrivateCredit, epoch) == 16);
    assert!(std::mem::offset_of!(PrivateCredit, bytes) == 24);
    // `None` of an `Option<&T>` is the null pointer: the image's zeros.
    assert!(std::mem::offset_of!(PrivateCredit, own) == 32);
    assert!(std::mem::offset_of!(PrivateCredit, books) == 40);
    assert!(NO_LANE_YET == usize::MAX);
};

/// This thread's [`PrivateCredit`].
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[inline(always)]
pub(super) fn private() -> Option<&'static PrivateCredit> {
    let p: *const PrivateCredit;
    // SAFETY: reads the thread pointer (%fs:0, the TCB's pointer to itself) and the GOT
    // word the loader filled with our block's offset from it; the sum is this thread's
    // copy of `cudabudget_private_credit`, 48 bytes of the static TLS block.
    unsafe {
        std::arch::asm!(
            "mov {p}, qword ptr fs:[0]",
            "add {p}, qword ptr [rip + cudabudget_private_credit@GOTTPOFF]",
            p = out(reg) p,
            options(pure, readonly, nostack),
        );
    }
    // SAFETY: the block lives as long as the thread and is initialised from the image
    // (private_init()'s words); PrivateCredit holds Cells, so the reference is neither Send
    // nor Sync and every use of it is on this thread.
    Some(unsafe { &*p })
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
thread_local! {
    static PRIVATE: PrivateCredit = const { private_init() };
}

/// This thread's [`PrivateCredit`].
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
#[inline(always)]
pub(super) fn private() -> Option<&'static PrivateCredit> {
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
            let lane = p.hold_lane(EXITED);
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
pub(super) fn give_pooled(device: usize, d: &'static DeviceLedger, bytes: u64) {
    match private() {
        Some(p) => p.give(device, d, bytes),
        None => d.pool.give(runtime::shard(), bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::books::ledger::{Entry, Kind};

    // The thread's own credit (`PrivateCredit`) is what keeps the stream-ordered fast path
    // off shared cache lines (BENCHMARKS.md: the async pair, 16 threads). Its contract:
    // credit is kept only by a thread with a lane, only for one device and epoch, only up
    // to PRIVATE_MAX; what does not fit goes to the shards. Each test uses a device
    // ledger of its own (high ordinals nothing else touches).

    const MIB: u64 = 1 << 20;

    fn fresh(lane: usize) -> PrivateCredit {
        let p = private_init();
        p.hold_lane(lane);
        p
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
        assert_eq!(p.held(), 3 * MIB, "kept by the thread");
        assert_eq!(shared_credit(d), 0, "nothing went to the shards");
        assert!(!p.take(runtime::ledger().device(51).unwrap(), MIB));
        assert!(!p.take(d, 4 * MIB), "more than it holds");
        assert!(p.take(d, 2 * MIB));
        assert_eq!(p.held(), MIB);
        d.retire_credit();
        assert!(!p.take(d, MIB), "credit of an older epoch is not spent");
        assert_eq!(p.held(), MIB);
    }

    #[test]
    fn a_thread_without_a_lane_or_that_has_exited_keeps_nothing() {
        let (device, d) = (52, runtime::ledger().device(52).unwrap());
        for lane in [NO_LANE_YET, EXITED] {
            let p = fresh(lane);
            assert!(!p.keeps_credit());
            p.give(device, d, MIB);
            assert_eq!(p.held(), 0);
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
        assert_eq!(p.held(), PRIVATE_MAX, "exactly the bound is kept");
        assert_eq!(shared_credit(d), 0);
        p.give(device, d, MIB);
        assert_eq!(p.held(), PRIVATE_MAX / 2, "over it, half the bound stays");
        assert_eq!(shared_credit(d), (PRIVATE_MAX / 2 + MIB) as i64);
    }

    #[test]
    fn the_fast_free_keeps_pooled_credit_of_the_threads_device_up_to_the_bound() {
        let (device, d) = (54, runtime::ledger().device(54).unwrap());
        let p = fresh(5);
        p.give(device, d, MIB);
        assert!(p.give_fast(pooled(device, 2 * MIB).packed()));
        assert_eq!(p.held(), 3 * MIB);
        assert!(
            !p.give_fast(pooled(device + 1, MIB).packed()),
            "another device"
        );
        let direct = Entry {
            kind: Kind::Direct,
            ..pooled(device, MIB)
        };
        assert!(!p.give_fast(direct.packed()), "not stream-ordered");
        assert!(
            !p.give_fast(pooled(device, PRIVATE_MAX).packed()),
            "past the bound"
        );
        assert_eq!(p.held(), 3 * MIB, "a refused fast free changes nothing");
        d.retire_credit();
        assert!(!p.give_fast(pooled(device, MIB).packed()), "an older epoch");
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

    /// A thread reaches its lane's counter in the gate and region of the pointer table
    /// exactly while it holds a lane of its own, and those of that lane.
    #[test]
    fn a_lane_of_its_own_comes_with_its_counter_and_region_and_nothing_else_does() {
        for lane in [0, ledger::LANES, NO_LANE_YET, EXITED] {
            assert!(fresh(lane).own.get().is_none(), "lane {lane}");
        }
        for lane in [1, 7, ledger::LANES - 1] {
            let own = fresh(lane).own.get().expect("a lane of its own");
            assert!(
                std::ptr::eq(own, gate::own_line(lane).unwrap()),
                "lane {lane}"
            );
            let region = runtime::pointers().own_region(lane).unwrap();
            assert!(std::ptr::eq(own.region(), region), "lane {lane}");
        }
        let p = fresh(3);
        assert_eq!(p.hold_lane(EXITED), 3);
        assert!(p.own.get().is_none(), "an exited thread holds none");
    }

    #[test]
    fn a_new_threads_credit_starts_as_its_image_says_and_is_its_own() {
        let here = private().map(std::ptr::from_ref);
        let seen = std::thread::spawn(|| {
            let p = private().expect("every thread has one");
            let words = (
                p.lane.get(),
                p.tag.get(),
                p.epoch.get(),
                p.held(),
                p.own.get().is_none() && p.books.get().is_none(),
            );
            p.bytes.set(12345);
            (words, std::ptr::from_ref(p) as usize, p.held())
        })
        .join()
        .unwrap();
        let init = private_init();
        let init = (
            init.lane.get(),
            init.tag.get(),
            init.epoch.get(),
            init.held(),
            true,
        );
        assert_eq!(seen.0, init);
        assert_eq!(seen.2, 12345, "the thread writes its own copy");
        assert_ne!(
            here.map(|p| p as usize),
            Some(seen.1),
            "another thread's copy"
        );
        assert_ne!(private().map(|p| p.held()), Some(12345));
    }

    #[test]
    fn every_thread_has_its_private_credit_and_an_exit_handler() {
        assert!(private().is_some());
        assert!(arm_thread_exit());
        assert!(arm_thread_exit(), "armed again with the same key");
        assert_ne!(EXIT_KEY.load(Ordering::Acquire), UNMADE);
    }
}
