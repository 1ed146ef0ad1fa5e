//! The gate between stream-ordered allocations and changes of a device's current pool.
//!
//! A stream-ordered allocation decides who pays for it — the default pool's credit, or a
//! pool the program created and made current (`cuDeviceSetMemPool`) — before its driver
//! call. A switch of the current pool between that decision and the call would make the
//! driver allocate from the other pool: one that grows with nothing charged for it.
//!
//! So an allocation is *inside* from before it looks at the current pool until the
//! driver has answered ([`enter`]), and a switch (or the destruction of a pool the
//! program made current) *closes* the gate, waits until nobody is inside, makes its
//! driver call and opens the gate again ([`closed`]). An allocation that finds the gate
//! closed leaves the fast path, or waits (a switch is one driver call).
//!
//! Either the switch sees the allocation inside and waits for it, or the allocation sees
//! the gate closed (a Dekker handshake). The fences it needs are paid by the switches,
//! which are rare: with `membarrier(2)` registered ([`prepare`]), entering is two plain
//! stores and a load on the thread's own cache line, and a switch makes every running
//! thread of the process execute a full barrier before it looks. Where the kernel or a
//! seccomp profile refuses `membarrier`, entering is a locked add (sequentially
//! consistent on both sides).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, compiler_fence};

use crate::books::ledger::{LANES, OwnRegion};
use crate::runtime;

/// One line per lane, each a cache line of its own: lane 0 is shared by the threads that
/// have no lane of their own. The fast paths reach their lane's through one pointer
/// ([`own_line`]): its count, whether it is open, its region of the pointer table.
#[repr(align(128))]
pub struct Inside {
    /// Who is inside: [`FAST`] for the lane's thread on its fast path ([`enter_own`]),
    /// one for each [`Pass`].
    count: AtomicU32,
    /// Whether threads other than the lane's take blocks from its region of the pointer
    /// table ([`open_lane`]): [`SHUT`], [`OPENING`], [`OPEN`].
    open: AtomicU32,
    /// The lane's region of the pointer table, where its thread records its
    /// stream-ordered blocks (lane 0's is nobody's: no thread holds lane 0).
    region: &'static OwnRegion,
}

impl Inside {
    /// The lane's region of the pointer table.
    #[inline(always)]
    pub fn region(&self) -> &'static OwnRegion {
        self.region
    }
}

/// What the fast path counts in its lane's [`Inside::count`]: apart from a [`Pass`]'s
/// one, so that a thread opening the lane waits for the fast path alone (which waits for
/// nothing of ours), never for a full path that may itself be opening a lane.
const FAST: u32 = 1 << 16;

/// [`Inside::open`]: only the lane's thread takes blocks from its region, with plain
/// stores.
const SHUT: u32 = 0;
/// Another thread is opening it ([`open_lane`]).
const OPENING: u32 = 1;
/// Every thread takes from it with a compare-and-swap, the lane's own too.
const OPEN: u32 = 2;

/// Lane `lane`'s own line (1..[`LANES`]), for the thread that holds it; `None` for lane 0
/// (nobody's) or past the table.
pub const fn own_line(lane: usize) -> Option<&'static Inside> {
    if lane >= 1 && lane < LANES {
        Some(&INSIDE[lane])
    } else {
        None
    }
}

static INSIDE: [Inside; LANES] = {
    const fn region(lane: usize) -> &'static OwnRegion {
        match runtime::pointers().region(lane) {
            Some(region) => region,
            None => panic!("every lane has a region"),
        }
    }
    let mut lines = [const {
        Inside {
            count: AtomicU32::new(0),
            open: AtomicU32::new(SHUT),
            region: region(0),
        }
    }; LANES];
    let mut lane = 1;
    while lane < LANES {
        lines[lane].region = region(lane);
        lane += 1;
    }
    lines
};

/// What every stream-ordered call reads once it is inside: each reason for the full
/// path, counted in one word, on a cache line that nothing written often shares. The
/// fast paths enter and then read this one word; zero (or zero but for
/// [`DEVICES_UNKNOWN`], for a free) lets them through.
#[repr(align(128))]
struct Reasons(AtomicU64);

static REASONS: Reasons = Reasons(AtomicU64::new(NOT_ASYMMETRIC | DEVICES_UNKNOWN));

/// Switches under way (the gate is closed while any is).
const CLOSED: Field = Field {
    one: 1 << 1,
    mask: 0xFFFF << 1,
};
/// Stream captures begun and not yet ended ([`crate::admit::capture`]).
const CAPTURES: Field = Field {
    one: 1 << 17,
    mask: 0xFFFF << 17,
};
/// Other reasons for the full path: a pool the program created made a device's current one.
const DETOURS: Field = Field {
    one: 1 << 33,
    mask: 0xFFFF << 33,
};
/// `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` is not registered for the process (yet,
/// or refused): entering fences on the allocation's side.
const NOT_ASYMMETRIC: u64 = 1 << 62;
/// Not known to see one device: the allocation's fast path (which charges device 0)
/// stays off. The lowest bit, so that a free's question ([`FOR_FREE`], every bit but
/// this) is one test of the word against an immediate.
const DEVICES_UNKNOWN: u64 = 1;

/// A count in [`REASONS`].
#[derive(Clone, Copy)]
struct Field {
    one: u64,
    mask: u64,
}

impl Field {
    fn raise(self) {
        REASONS.0.fetch_add(self.one, Ordering::SeqCst);
    }

    /// One fewer, never below zero (nor into the field beside it).
    fn lower(self) {
        let _ = REASONS
            .0
            .fetch_update(Ordering::SeqCst, Ordering::Relaxed, |n| {
                (n & self.mask != 0).then(|| n - self.one)
            });
    }

    fn any(self, reasons: u64) -> bool {
        reasons & self.mask != 0
    }
}

/// What the fast paths ask of [`REASONS`]: an allocation everything, a free all but the
/// devices (it charges the device its block was charged to).
pub const FOR_ALLOC: u64 = u64::MAX;
pub const FOR_FREE: u64 = !DEVICES_UNKNOWN;

/// A capture began (`true`) or ended.
pub fn capture(on: bool) {
    if on {
        CAPTURES.raise()
    } else {
        CAPTURES.lower()
    }
}

/// A detour began (`true`) or ended.
pub fn detour(on: bool) {
    if on { DETOURS.raise() } else { DETOURS.lower() }
}

/// Whether any capture may be under way: one relaxed load. (A detour is no capture: it
/// only keeps stream-ordered calls off their fast paths, which read the whole word.)
#[inline(always)]
pub fn captures() -> bool {
    CAPTURES.any(REASONS.0.load(Ordering::Relaxed))
}

/// The gate's word is process-wide: unit tests that change or read its counts (here, in
/// capture and in pools) take turns.
#[cfg(test)]
pub fn turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether any detour is under way (what the fast paths see of [`detour`]).
#[cfg(test)]
pub fn detours() -> bool {
    DETOURS.any(REASONS.0.load(Ordering::Relaxed))
}

/// The process is known to see one device: the allocation's fast path may charge device
/// 0. Writes the shared word only the first time.
pub fn one_device() {
    if REASONS.0.load(Ordering::Relaxed) & DEVICES_UNKNOWN != 0 {
        REASONS.0.fetch_and(!DEVICES_UNKNOWN, Ordering::SeqCst);
    }
}

/// In the child of `fork()`: no capture came along.
pub fn captures_after_fork() {
    REASONS
        .0
        .fetch_and(!(CAPTURES.mask | DETOURS.mask), Ordering::SeqCst);
}

fn asymmetric() -> bool {
    REASONS.0.load(Ordering::Acquire) & NOT_ASYMMETRIC == 0
}

fn closed_now(ordering: Ordering) -> bool {
    CLOSED.any(REASONS.0.load(ordering))
}

const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

/// Registers the process for expedited private memory barriers (once, on the library's
/// background thread: see [`crate::lifecycle`]). Until it has, and where a kernel older
/// than 4.14 or a seccomp profile refuses, the gate fences on the allocation's side;
/// either way is correct at any moment, since a switch uses `membarrier` only once the
/// registration is complete.
pub fn prepare() {
    // SAFETY: membarrier takes two integer arguments and touches no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_membarrier,
            MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED,
            0 as libc::c_long,
        )
    };
    if rc == 0 {
        REASONS.0.fetch_and(!NOT_ASYMMETRIC, Ordering::SeqCst);
    }
    crate::sys::log::line(
        crate::config::LogLevel::Debug,
        format_args!(
            "membarrier: {}",
            if rc == 0 {
                "registered (pool switches pay the fences)".to_string()
            } else {
                format!(
                    "refused ({}); stream-ordered allocations fence themselves",
                    std::io::Error::last_os_error()
                )
            }
        ),
    );
}

/// Makes every running thread of the process execute a full memory barrier; false when
/// the kernel refused.
fn barrier_everywhere() -> bool {
    // SAFETY: as in `prepare`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_membarrier,
            MEMBARRIER_CMD_PRIVATE_EXPEDITED,
            0 as libc::c_long,
        )
    };
    rc == 0
}

/// After a store the fast paths must see: makes every running thread fence, so that
/// each either saw the store or had made its own entry visible first.
fn barrier_or_wait() {
    // Whether or not this thread has seen the registration yet: a fast path that
    // entered the cheap way saw it complete, so the barrier is not refused then.
    if !barrier_everywhere() && asymmetric() {
        // Registered, yet refused: not a case Linux has; wait out a scheduling quantum,
        // after which any store a fast path made is visible.
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Held by an allocation inside the gate; leaving is dropping it.
pub struct Pass(usize);

impl Drop for Pass {
    #[inline(always)]
    fn drop(&mut self) {
        let inside = &INSIDE[self.0].count;
        if self.0 != 0 {
            // The thread's own lane: nobody else writes it.
            inside.store(inside.load(Ordering::Relaxed) - 1, Ordering::Release);
        } else {
            inside.fetch_sub(1, Ordering::Release);
        }
    }
}

#[inline(always)]
fn slot(lane: usize) -> usize {
    if lane < LANES { lane } else { 0 }
}

/// The fast path's way in: [`enter`] for the thread's own lane (its counter, from
/// [`own_line`]), with no guard, and with no reason for the full path among `asked`
/// ([`FOR_ALLOC`], [`FOR_FREE`]); the caller [`leave_own`]s once the driver has answered,
/// whatever it did. False, and nothing entered, when the gate is closed or another reason
/// asked about is raised.
///
/// Without membarrier registered, `FENCED` enters with the fences that then need
/// (out of the caller's way); with `FENCED` false the missing membarrier declines too,
/// so that the caller calls nothing else ([`only_fences_missing`] then says whether
/// entering fenced would have got in).
#[inline(always)]
pub fn enter_own<const FENCED: bool>(own: &Inside, asked: u64) -> bool {
    let inside = &own.count;
    // Only this thread writes its own lane: a plain store. With membarrier registered,
    // a switch's barrier orders it before the load below; without, the cold path
    // fences.
    inside.store(
        inside.load(Ordering::Relaxed).wrapping_add(FAST),
        Ordering::Relaxed,
    );
    compiler_fence(Ordering::SeqCst);
    if REASONS.0.load(Ordering::Relaxed) & asked == 0 {
        return true;
    }
    if FENCED {
        return enter_own_otherwise(own, asked);
    }
    leave_own(own);
    false
}

/// Whether the one reason raised among `asked` is the missing membarrier: entering with
/// the fences ([`enter_own`]) would get in where the quick way declined.
#[inline]
pub fn only_fences_missing(asked: u64) -> bool {
    REASONS.0.load(Ordering::Relaxed) & asked == NOT_ASYMMETRIC & asked
}

/// [`enter_own`] when a reason was raised: in only when the one reason is the missing
/// membarrier, after the fences it then needs.
#[cold]
#[inline(never)]
fn enter_own_otherwise(own: &Inside, asked: u64) -> bool {
    // The increment made sequentially consistent (as entering is without membarrier),
    // then the reasons read again.
    own.count.fetch_add(0, Ordering::SeqCst);
    if REASONS.0.load(Ordering::SeqCst) & asked == NOT_ASYMMETRIC & asked {
        return true;
    }
    leave_own(own);
    false
}

/// Leaves the gate [`enter_own`] entered.
#[inline(always)]
pub fn leave_own(own: &Inside) {
    let inside = &own.count;
    inside.store(
        inside.load(Ordering::Relaxed).wrapping_sub(FAST),
        Ordering::Release,
    );
}

/// Whether other threads take blocks from the lane's region (or are about to): asked by
/// the lane's thread once it is inside ([`enter_own`]), before it takes a block of its
/// own. While it is not, that thread alone takes from the region, with plain stores.
#[inline(always)]
pub fn lane_open(own: &Inside) -> bool {
    // Sequentially consistent for the fenced way in (on x86 the plain load it always is).
    own.open.load(Ordering::SeqCst) != SHUT
}

/// Lets the calling thread take a block from `lane`'s region, which another thread
/// holds: from then on every thread takes from it with a compare-and-swap, so that two
/// frees of one block never both take its entry (the one the driver refuses would put
/// back an entry no charge stands behind). Once per lane, the first time: the lane's
/// thread takes with plain stores until it sees the lane open, so the opener makes every
/// running thread fence (membarrier, as a switch does) and waits for the lane's fast path
/// to leave, which waits for nothing. Threads that come while it does wait for it.
#[cold]
pub fn open_lane(lane: usize) {
    let Some(line) = INSIDE.get(lane) else {
        return;
    };
    match line
        .open
        .compare_exchange(SHUT, OPENING, Ordering::SeqCst, Ordering::SeqCst)
    {
        Ok(_) => {
            barrier_or_wait();
            while line.count.load(Ordering::SeqCst) >= FAST {
                std::thread::yield_now();
            }
            line.open.store(OPEN, Ordering::SeqCst);
        }
        Err(_) => {
            while line.open.load(Ordering::SeqCst) != OPEN {
                std::thread::yield_now();
            }
        }
    }
}

/// Enters the gate for the calling thread (its `lane`, 0 when it has none), or `None`
/// when a switch has closed it.
#[inline(always)]
pub fn enter(lane: usize) -> Option<Pass> {
    let lane = slot(lane);
    let inside = &INSIDE[lane].count;
    // Acquire: the loads below come after the registration that made it true.
    if lane != 0 && asymmetric() {
        // Only this thread writes its own lane: a plain store, and the switch's
        // membarrier orders it before the load below.
        inside.store(inside.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        compiler_fence(Ordering::SeqCst);
        if !closed_now(Ordering::Relaxed) {
            return Some(Pass(lane));
        }
    } else {
        inside.fetch_add(1, Ordering::SeqCst);
        if !closed_now(Ordering::SeqCst) {
            return Some(Pass(lane));
        }
    }
    inside.fetch_sub(1, Ordering::Release);
    None
}

/// Enters the gate, waiting while a switch has it closed.
pub fn wait_enter(lane: usize) -> Pass {
    loop {
        if let Some(pass) = enter(lane) {
            return pass;
        }
        while closed_now(Ordering::SeqCst) {
            std::thread::yield_now();
        }
    }
}

/// Runs `switch` (a change of which pool a device's stream-ordered allocations come
/// from) with the gate closed and nobody inside.
pub fn closed<R>(switch: impl FnOnce() -> R) -> R {
    /// Opens the gate again, a panic in `switch` included.
    struct Open;
    impl Drop for Open {
        fn drop(&mut self) {
            CLOSED.lower();
        }
    }
    CLOSED.raise();
    let _open = Open;
    barrier_or_wait();
    while INSIDE.iter().any(|i| i.count.load(Ordering::SeqCst) != 0) {
        std::thread::yield_now();
    }
    switch()
}

/// In the child of `fork()`: only the forking thread came along, and it was in no
/// hook.
pub fn after_fork() {
    for i in &INSIDE {
        i.count.store(0, Ordering::Release);
        // A thread that was opening a lane did not come along: open it (taking with a
        // compare-and-swap is right whatever the lane's state).
        if i.open.load(Ordering::Relaxed) == OPENING {
            i.open.store(OPEN, Ordering::Release);
        }
    }
    REASONS.0.fetch_and(!CLOSED.mask, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    /// Sets whether membarrier counts as registered; gives what it was.
    fn set_asymmetric(on: bool) -> bool {
        let was = if on {
            REASONS.0.fetch_and(!NOT_ASYMMETRIC, Ordering::SeqCst)
        } else {
            REASONS.0.fetch_or(NOT_ASYMMETRIC, Ordering::SeqCst)
        };
        was & NOT_ASYMMETRIC == 0
    }

    /// The gate is process-wide: its tests take turns.
    fn serial() -> std::sync::MutexGuard<'static, ()> {
        turn()
    }

    #[test]
    fn a_switch_waits_for_an_allocation_inside_and_closes_the_gate_to_new_ones() {
        let _turn = serial();
        let pass = enter(3).expect("open");
        let switched = Arc::new(AtomicBool::new(false));
        let inside_seen = Arc::new(AtomicBool::new(false));
        let barrier = Arc::new(Barrier::new(2));
        let t = {
            let (switched, inside_seen, barrier) =
                (switched.clone(), inside_seen.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                closed(|| {
                    // The allocation inside left before the switch was made.
                    inside_seen.store(
                        INSIDE[3].count.load(Ordering::SeqCst) != 0,
                        Ordering::SeqCst,
                    );
                    switched.store(true, Ordering::SeqCst);
                });
            })
        };
        barrier.wait();
        while !closed_now(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        std::thread::sleep(Duration::from_millis(20));
        assert!(!switched.load(Ordering::SeqCst), "the switch waited");
        assert!(enter(5).is_none(), "a new allocation finds the gate closed");
        assert!(enter(0).is_none(), "lane 0 too");
        drop(pass);
        t.join().unwrap();
        assert!(switched.load(Ordering::SeqCst));
        assert!(!inside_seen.load(Ordering::SeqCst));
        assert!(enter(5).is_some(), "open again");
        assert!(INSIDE.iter().all(|i| i.count.load(Ordering::SeqCst) == 0));
    }

    /// The fast path's way in, in both fence modes: inside while the gate is open (its
    /// own lane counts it until it leaves), turned away and not counted while a switch
    /// has it closed, and never for a thread without a lane of its own.
    #[test]
    fn enter_own_gets_in_while_open_and_is_turned_away_while_closed() {
        let _turn = serial();
        let was = asymmetric();
        for asymmetric in [false, true] {
            set_asymmetric(asymmetric);
            let own = own_line(4).unwrap();
            assert!(
                enter_own::<true>(own, FOR_FREE),
                "open: in (asymmetric {asymmetric})"
            );
            assert_eq!(INSIDE[4].count.load(Ordering::SeqCst), FAST);
            leave_own(own);
            assert_eq!(INSIDE[4].count.load(Ordering::SeqCst), 0);
            // The quick way (no call out of the fast path) gets in only with membarrier,
            // and says so when fencing would have.
            let quick = enter_own::<false>(own, FOR_FREE);
            if quick {
                leave_own(own);
            }
            assert_eq!(quick, asymmetric, "quick, asymmetric {asymmetric}");
            assert_eq!(only_fences_missing(FOR_FREE), !asymmetric);
            assert_eq!(INSIDE[4].count.load(Ordering::SeqCst), 0);
            CLOSED.raise();
            let got_in = enter_own::<true>(own, FOR_FREE);
            let quick = enter_own::<false>(own, FOR_FREE);
            let fences_would = only_fences_missing(FOR_FREE);
            let counted = INSIDE[4].count.load(Ordering::SeqCst);
            CLOSED.lower();
            assert!(!got_in, "closed: turned away (asymmetric {asymmetric})");
            assert!(!quick, "closed: turned away the quick way too");
            assert!(!fences_would, "closed: fences would not get in either");
            assert_eq!(counted, 0, "and not counted");
            assert!(std::ptr::eq(
                own_line(LANES - 1).unwrap(),
                &INSIDE[LANES - 1]
            ));
            assert!(own_line(0).is_none() && own_line(LANES).is_none());
        }
        set_asymmetric(was);
    }

    #[test]
    fn threads_without_a_lane_share_lane_zero_and_a_lane_past_the_table_is_zero() {
        let _turn = serial();
        let a = enter(0).unwrap();
        let b = enter(LANES + 7).unwrap();
        assert_eq!(INSIDE[0].count.load(Ordering::SeqCst), 2);
        drop(a);
        assert_eq!(INSIDE[0].count.load(Ordering::SeqCst), 1);
        drop(b);
        assert_eq!(INSIDE[0].count.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn wait_enter_gets_in_once_the_switch_is_over() {
        let _turn = serial();
        let barrier = Arc::new(Barrier::new(2));
        let done = Arc::new(AtomicBool::new(false));
        let t = {
            let (barrier, done) = (barrier.clone(), done.clone());
            std::thread::spawn(move || {
                closed(|| {
                    barrier.wait();
                    std::thread::sleep(Duration::from_millis(30));
                    done.store(true, Ordering::SeqCst);
                });
            })
        };
        barrier.wait();
        let pass = wait_enter(2);
        assert!(done.load(Ordering::SeqCst), "entered only after the switch");
        drop(pass);
        t.join().unwrap();
    }

    /// Threads inside the gate see the same "current pool" on entering and on leaving,
    /// while another thread switches it as fast as it can.
    fn no_switch_lands_inside() {
        use std::sync::atomic::AtomicU64;
        static CURRENT: AtomicU64 = AtomicU64::new(0);
        let stop = Arc::new(AtomicBool::new(false));
        // Readers that have been inside once: the switches start when all have (on a
        // loaded machine they could otherwise all be over before a reader ran).
        let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let readers: Vec<_> = (10..14)
            .map(|lane| {
                let (stop, started) = (stop.clone(), started.clone());
                std::thread::spawn(move || {
                    let (mut inside, mut torn) = (0u64, 0u64);
                    while !stop.load(Ordering::Relaxed) {
                        if let Some(pass) = enter(lane) {
                            if inside == 0 {
                                started.fetch_add(1, Ordering::SeqCst);
                            }
                            let seen = CURRENT.load(Ordering::Relaxed);
                            for _ in 0..50 {
                                std::hint::spin_loop();
                            }
                            torn += u64::from(CURRENT.load(Ordering::Relaxed) != seen);
                            drop(pass);
                            inside += 1;
                        }
                    }
                    (inside, torn)
                })
            })
            .collect();
        while started.load(Ordering::SeqCst) < 4 {
            std::thread::yield_now();
        }
        for _ in 0..1000 {
            closed(|| CURRENT.fetch_add(1, Ordering::Relaxed));
            // Open a while between switches, as between a program's pool switches.
            for _ in 0..2000 {
                std::hint::spin_loop();
            }
        }
        stop.store(true, Ordering::Relaxed);
        let (inside, torn) = readers
            .into_iter()
            .map(|r| r.join().unwrap())
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
        assert!(inside > 0, "the readers got in");
        assert_eq!(torn, 0, "switches landed inside {torn} of {inside} passes");
    }

    #[test]
    fn no_switch_lands_inside_with_fences_on_both_sides() {
        // Whichever test ran first, this one runs the mode without membarrier (fences on
        // both sides, as a process where it is missing does) and puts the mode back.
        let _turn = serial();
        let was = set_asymmetric(false);
        no_switch_lands_inside();
        set_asymmetric(was);
    }

    #[test]
    fn no_switch_lands_inside_with_membarrier() {
        let _turn = serial();
        prepare();
        assert!(asymmetric(), "membarrier registered (Linux ≥ 4.14)");
        no_switch_lands_inside();
    }

    /// With membarrier registered a switch pays one barrier, not a nap: a program that
    /// switches its current pool often (one `cuDeviceSetMemPool` per phase) is not slowed
    /// by 10 ms a switch.
    #[test]
    fn a_switch_with_membarrier_takes_no_nap() {
        let _turn = serial();
        prepare();
        assert!(asymmetric(), "membarrier registered");
        let t = std::time::Instant::now();
        for i in 0..200 {
            assert_eq!(closed(|| i), i);
        }
        // 200 naps of 10 ms would take 2 s; 200 barriers take well under a second
        // even on a loaded machine.
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }

    /// Threads without a lane of their own (more threads than lanes) share lane 0, with
    /// membarrier registered too: however they interleave, none of their entries is lost,
    /// so once they have all left a switch finds nobody inside and does not wait for ever.
    #[test]
    fn threads_sharing_lane_zero_leave_the_gate_empty() {
        let _turn = serial();
        prepare();
        assert!(asymmetric(), "membarrier registered");
        let start = Arc::new(Barrier::new(4));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let start = start.clone();
                std::thread::spawn(move || {
                    start.wait();
                    let t = std::time::Instant::now();
                    while t.elapsed() < Duration::from_millis(300) {
                        for _ in 0..1000 {
                            let pass = enter(0).expect("open");
                            std::hint::black_box(&pass);
                            drop(pass);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(
            INSIDE[0].count.load(Ordering::SeqCst),
            0,
            "nobody is inside"
        );
        assert_eq!(closed(|| 1), 1);
    }

    /// A thread with a lane of its own enters on that lane (its own cache line: with
    /// membarrier, plain stores), not on the lane that the threads without one share.
    #[test]
    fn a_thread_with_a_lane_enters_on_its_own_lane() {
        let _turn = serial();
        for lane in [1, 3, LANES - 1] {
            let pass = enter(lane).expect("open");
            assert_eq!(INSIDE[lane].count.load(Ordering::SeqCst), 1, "lane {lane}");
            assert_eq!(INSIDE[0].count.load(Ordering::SeqCst), 0, "lane {lane}");
            drop(pass);
            assert_eq!(INSIDE[lane].count.load(Ordering::SeqCst), 0, "lane {lane}");
        }
        // Past the table, from its very end on, threads count on lane 0.
        for lane in [LANES, LANES + 1] {
            let pass = enter(lane).expect("open");
            assert_eq!(INSIDE[0].count.load(Ordering::SeqCst), 1, "lane {lane}");
            drop(pass);
            assert_eq!(INSIDE[0].count.load(Ordering::SeqCst), 0, "lane {lane}");
        }
    }

    /// The allocation's way in stays shut until the process is known to see one device
    /// (its fast path charges device 0); the free's does not wait for that.
    #[test]
    fn the_allocations_way_in_opens_once_one_device_is_known() {
        let _turn = serial();
        REASONS.0.fetch_or(DEVICES_UNKNOWN, Ordering::SeqCst);
        let own = own_line(4).unwrap();
        assert!(
            !enter_own::<true>(own, FOR_ALLOC),
            "devices not known: no way in"
        );
        assert_eq!(INSIDE[4].count.load(Ordering::SeqCst), 0, "and not counted");
        assert!(enter_own::<true>(own, FOR_FREE), "a free gets in");
        leave_own(own);
        one_device();
        assert!(enter_own::<true>(own, FOR_ALLOC), "one device: in");
        leave_own(own);
        one_device();
        assert!(enter_own::<true>(own, FOR_ALLOC), "said twice, still in");
        leave_own(own);
        assert_eq!(INSIDE[4].count.load(Ordering::SeqCst), 0);
    }

    /// A forked child has no capture under way and no detour (a created pool made current
    /// is made current again by the program's own calls there), whatever the parent had;
    /// the other reasons stay as they were.
    #[test]
    fn a_forked_child_forgets_the_captures_and_detours_and_keeps_the_rest() {
        let _turn = serial();
        let devices = REASONS.0.load(Ordering::SeqCst) & DEVICES_UNKNOWN;
        capture(true);
        detour(true);
        assert!(captures() && detours());
        captures_after_fork();
        assert!(!captures(), "no capture");
        assert!(!detours(), "no detour");
        assert_eq!(
            REASONS.0.load(Ordering::SeqCst) & DEVICES_UNKNOWN,
            devices,
            "the devices bit as it was"
        );
    }

    /// Opening a lane waits for its thread's fast path to leave (which took with plain
    /// stores), never for a full path's pass (which may itself be opening a lane), and the
    /// lane's thread sees it open from the start of the opening on.
    #[test]
    fn opening_a_lane_waits_for_its_fast_path_and_not_for_a_pass() {
        let _turn = serial();
        let lane = LANES - 2;
        let own = own_line(lane).unwrap();
        assert!(!lane_open(own), "shut until a thread opens it");
        assert!(enter_own::<true>(own, FOR_FREE));
        let opened = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                open_lane(lane);
                opened.store(true, Ordering::SeqCst);
            });
            while own.open.load(Ordering::SeqCst) == SHUT {
                std::thread::yield_now();
            }
            assert!(
                lane_open(own),
                "opening: the lane's thread takes as from an open one"
            );
            std::thread::sleep(Duration::from_millis(20));
            assert!(
                !opened.load(Ordering::SeqCst),
                "the opener waits for the fast path"
            );
            leave_own(own);
        });
        assert!(opened.load(Ordering::SeqCst));
        assert_eq!(own.open.load(Ordering::SeqCst), OPEN);
        // Open once: a second opening waits for nothing.
        assert!(enter_own::<true>(own, FOR_FREE));
        open_lane(lane);
        leave_own(own);
        // A pass on a lane does not hold its opening up.
        let lane = LANES - 3;
        let pass = enter(lane).expect("open");
        open_lane(lane);
        assert!(lane_open(own_line(lane).unwrap()));
        drop(pass);
        open_lane(LANES + 3); // no lane: nothing to open, no panic
    }

    #[test]
    fn a_forked_child_starts_with_the_gate_open_and_nobody_inside() {
        let _turn = serial();
        let pass = enter(4).unwrap();
        CLOSED.raise();
        // A lane another thread was opening (that thread did not come along).
        let opening = &INSIDE[LANES - 4].open;
        opening.store(OPENING, Ordering::SeqCst);
        after_fork();
        assert_eq!(opening.load(Ordering::SeqCst), OPEN, "open in the child");
        assert!(INSIDE.iter().all(|i| i.count.load(Ordering::SeqCst) == 0));
        assert!(!closed_now(Ordering::SeqCst));
        std::mem::forget(pass);
        assert_eq!(closed(|| 7), 7, "a switch in the child does not wait");
    }
}
