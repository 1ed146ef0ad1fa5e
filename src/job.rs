//! Job scope: one budget per device for every process of a job
//! (`CUDABUDGET_SCOPE=job:<name>`, or HAMi's `CUDA_DEVICE_MEMORY_SHARED_CACHE`).
//!
//! The job's books are a small file in shared memory, mapped by each process:
//! `$CUDABUDGET_JOB_DIR` (default `/dev/shm`) `/cudabudget-<uid>-job-<name>`, mode 0600,
//! refused when another user owns it or others may write it. Its layout:
//!
//! - a header: magic, layout version, slot and device counts, the file's size and a
//!   checksum of those (the file is untrusted input: all are checked on joining), then
//!   per device the job's total in use, an admission lock word, a wake-up word and a
//!   count of waiters;
//! - 1024 slots, one per process: its pid and start time (so a reused pid is never taken
//!   for the process) and what it holds on each device.
//!
//! Each process writes only its own slot. A device's total is the sum of the slots, kept
//! under the device's admission lock, so two processes racing for the last bytes cannot
//! both pass. The lock word holds its owner's slot: a process that finds it held for more
//! than a millisecond checks that owner, and takes the lock over from a dead one (after
//! which it gives the dead process's share back). No process can keep a lock by dying.
//! Dead processes (SIGKILL, OOM killer, a crash) are found by the next process that
//! looks, at most once a second per job and before every denial, and their share is given
//! back at once.

use std::ffi::CString;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::ledger::MAX_DEVICES;

/// What a job's file starts with: "CBJOB" and the layout's version.
const MAGIC: u64 = u64::from_le_bytes(*b"CBJOBv01");
const VERSION: u32 = 1;
/// Processes a job holds at once.
pub const SLOTS: usize = 1024;
const DEVICES: usize = MAX_DEVICES;

#[repr(C)]
struct DeviceWord {
    /// What the job holds on the device: the sum of the slots' `used`.
    total: AtomicU64,
    /// 0: free; else the holder's slot + 1.
    lock: AtomicU64,
    /// Bumped on every release (a futex word): waiters sleep on it.
    wake: AtomicU32,
    /// Threads (of any process) waiting for room on the device.
    waiters: AtomicU32,
    /// The next ticket of the device's queue of waiters (arrival order).
    next_ticket: AtomicU64,
    _pad: [u64; 4],
}

#[repr(C)]
struct Header {
    magic: u64,
    version: u32,
    slots: u32,
    devices: u32,
    _reserved: u32,
    size: u64,
    /// A checksum of the fields above.
    check: u64,
    /// 0 while the creator writes the header, [`READY`] after.
    state: AtomicU32,
    _pad: u32,
    /// When a process last looked for dead ones (ms, CLOCK_MONOTONIC).
    last_scan_ms: AtomicU64,
    devices_: [DeviceWord; DEVICES],
}

#[repr(C)]
struct Slot {
    /// 0: free.
    pid: AtomicU32,
    _pad: u32,
    /// The process's start time (`/proc/<pid>/stat`, field 22).
    start: AtomicU64,
    /// Per device: the ticket this process waits with (0: none).
    waiting: [AtomicU64; DEVICES],
    used: [AtomicU64; DEVICES],
}

const READY: u32 = 0x0005_EAD1;
const HEADER_BYTES: usize = std::mem::size_of::<Header>().next_multiple_of(4096);
const FILE_BYTES: usize = HEADER_BYTES + SLOTS * std::mem::size_of::<Slot>();

fn checksum(magic: u64, version: u32, slots: u32, devices: u32, size: u64) -> u64 {
    // FNV-1a over the fields: enough to tell a foreign or damaged file from ours.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in magic
        .to_le_bytes()
        .into_iter()
        .chain(version.to_le_bytes())
        .chain(slots.to_le_bytes())
        .chain(devices.to_le_bytes())
        .chain(size.to_le_bytes())
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A job this process has joined: the mapping and its own slot.
pub struct Job {
    base: *mut u8,
    slot: usize,
    path: String,
}

// SAFETY: the mapping is shared memory reached only through atomics.
unsafe impl Send for Job {}
// SAFETY: as above.
unsafe impl Sync for Job {}

/// The job the process joined (null until then, and in a child of `fork()`).
static JOINED: std::sync::atomic::AtomicPtr<Job> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// The job this process belongs to, if it joined one.
#[inline]
pub fn joined() -> Option<&'static Job> {
    let p = JOINED.load(Ordering::Acquire);
    // SAFETY: a published Job is leaked (never freed) for the process's life.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// Where a job's file lives: `$CUDABUDGET_JOB_DIR` (default `/dev/shm`), as the
/// configuration read it (trimmed).
pub fn path_for(name: &str) -> String {
    let dir = crate::runtime::config()
        .and_then(|config| config.job_dirs.first())
        .map_or_else(
            || crate::config::DEFAULT_SHARED_DIR.to_string(),
            |dir| dir.to_string_lossy().into_owned(),
        );
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    format!("{}/cudabudget-{uid}-job-{name}", dir.trim_end_matches('/'))
}

/// Our own file for the processes that share HAMi's `CUDA_DEVICE_MEMORY_SHARED_CACHE`
/// file: beside it (HAMi's own format is HAMi's).
pub fn path_for_hami(cache: &str) -> String {
    format!("{cache}.cudabudget")
}

/// Joins the job whose file is `path` (creating it if no process has): maps it, checks
/// it, and takes a slot. `Err` is the reason, for the one line the user gets.
pub fn join(path: &str) -> Result<&'static Job, String> {
    if let Some(job) = joined() {
        return Ok(job);
    }
    let job = open(path)?;
    let job = Box::into_raw(Box::new(job));
    match JOINED.compare_exchange(
        std::ptr::null_mut(),
        job,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        Ok(_) => {
            // SAFETY: just published, never freed.
            Ok(unsafe { &*job })
        }
        Err(first) => {
            // Another thread joined first: give this slot back and use that one.
            // SAFETY: our own Box, never published.
            let mine = unsafe { Box::from_raw(job) };
            mine.slot().pid.store(0, Ordering::Release);
            // SAFETY: `first` is published and never freed.
            Ok(unsafe { &*first })
        }
    }
}

fn open(path: &str) -> Result<Job, String> {
    let cpath = CString::new(path).map_err(|_| "the path holds a NUL byte".to_string())?;
    // SAFETY: a NUL-terminated path; flags and mode are plain integers.
    let fd = unsafe {
        libc::open(
            cpath.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o600 as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(format!(
            "cannot open it: {}",
            std::io::Error::last_os_error()
        ));
    }
    let result = map_checked(fd);
    // SAFETY: our own descriptor; the mapping stays valid without it.
    unsafe { libc::close(fd) };
    let base = result?;
    let pid = std::process::id();
    let start = start_time(pid).unwrap_or(0);
    let job = Job {
        base,
        slot: usize::MAX,
        path: path.to_string(),
    };
    let slot = job
        .claim_slot(pid, start)
        .or_else(|| {
            job.reclaim_dead();
            job.claim_slot(pid, start)
        })
        .ok_or_else(|| format!("all {SLOTS} process slots of the job are taken"))?;
    Ok(Job { slot, ..job })
}

/// Checks the file behind `fd` and maps it; initialises it when it is new.
fn map_checked(fd: libc::c_int) -> Result<*mut u8, String> {
    let stat = fstat(fd)?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if stat.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err("it is not a regular file".to_string());
    }
    if stat.st_uid != me {
        return Err(format!(
            "it belongs to uid {}, not to this user (uid {me})",
            stat.st_uid
        ));
    }
    if stat.st_mode & 0o022 != 0 {
        return Err(format!(
            "others may write it (mode {:o}); it must be 0600",
            stat.st_mode & 0o777
        ));
    }
    if stat.st_size == 0 {
        // New, or another process is creating it: whoever holds the file lock makes it.
        // SAFETY: our descriptor.
        unsafe { libc::flock(fd, libc::LOCK_EX) };
        let stat = fstat(fd)?;
        if stat.st_size == 0 {
            // SAFETY: our descriptor; the size is the layout's.
            if unsafe { libc::ftruncate(fd, FILE_BYTES as libc::off_t) } != 0 {
                let e = std::io::Error::last_os_error();
                // SAFETY: our descriptor.
                unsafe { libc::flock(fd, libc::LOCK_UN) };
                return Err(format!("cannot size it: {e}"));
            }
            let base = map(fd)?;
            // SAFETY: a fresh mapping of FILE_BYTES zeroed bytes, ours alone until READY.
            unsafe {
                let h = &mut *(base as *mut Header);
                h.magic = MAGIC;
                h.version = VERSION;
                h.slots = SLOTS as u32;
                h.devices = DEVICES as u32;
                h.size = FILE_BYTES as u64;
                h.check = checksum(
                    MAGIC,
                    VERSION,
                    SLOTS as u32,
                    DEVICES as u32,
                    FILE_BYTES as u64,
                );
                h.state.store(READY, Ordering::Release);
            }
            // SAFETY: our descriptor.
            unsafe { libc::flock(fd, libc::LOCK_UN) };
            return Ok(base);
        }
        // SAFETY: our descriptor.
        unsafe { libc::flock(fd, libc::LOCK_UN) };
        return validate(fd, stat.st_size);
    }
    validate(fd, stat.st_size)
}

fn validate(fd: libc::c_int, size: libc::off_t) -> Result<*mut u8, String> {
    if size as u64 != FILE_BYTES as u64 {
        return Err(format!(
            "it is {size} bytes, not the {FILE_BYTES} of this build's layout (another \
             version's, or damaged)"
        ));
    }
    let base = map(fd)?;
    // SAFETY: the mapping is FILE_BYTES long; the header's plain fields are read once.
    let h = unsafe { &*(base as *const Header) };
    let ready = (0..2000).any(|_| {
        if h.state.load(Ordering::Acquire) == READY {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
        false
    });
    let (magic, version, slots, devices, fsize, check) =
        (h.magic, h.version, h.slots, h.devices, h.size, h.check);
    let why = if magic != MAGIC {
        Some("it is not a cudabudget job ledger (bad magic)".to_string())
    } else if version != VERSION {
        Some(format!(
            "it has layout version {version}, this build reads {VERSION}"
        ))
    } else if slots as usize != SLOTS || devices as usize != DEVICES || fsize != FILE_BYTES as u64 {
        Some("its header does not match this build's layout".to_string())
    } else if check != checksum(magic, version, slots, devices, fsize) {
        Some("its header checksum is wrong (damaged)".to_string())
    } else if !ready {
        Some("it was never finished by the process that created it".to_string())
    } else {
        None
    };
    if let Some(why) = why {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(base.cast(), FILE_BYTES) };
        return Err(why);
    }
    Ok(base)
}

fn fstat(fd: libc::c_int) -> Result<libc::stat, String> {
    // SAFETY: an all-zero stat is a valid out-value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: our descriptor and a valid out-pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(format!(
            "cannot stat it: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(st)
}

fn map(fd: libc::c_int) -> Result<*mut u8, String> {
    // SAFETY: a shared read-write mapping of FILE_BYTES of our descriptor.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            FILE_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!(
            "cannot map it: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(p.cast())
}

/// The start time of `pid` (clock ticks since boot, `/proc/<pid>/stat` field 22): with
/// the pid, what tells a process from a later one that got the same pid.
fn start_time(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command (field 2) may hold spaces and parentheses: count from the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// Whether the process in a slot (`pid`, started at `start`) is still the one running.
fn alive(pid: u32, start: u64) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let exists = unsafe { libc::kill(pid as libc::pid_t, 0) } == 0
        || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists && (start == 0 || start_time(pid).is_none_or(|s| s == start))
}

fn monotonic_ms() -> u64 {
    crate::report::monotonic_ms()
}

impl Job {
    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with the header and lives as long as the process.
        unsafe { &*(self.base as *const Header) }
    }

    fn slot_at(&self, i: usize) -> &Slot {
        debug_assert!(i < SLOTS);
        // SAFETY: i < SLOTS, so the slot lies within the FILE_BYTES mapping.
        unsafe {
            &*(self
                .base
                .add(HEADER_BYTES + i * std::mem::size_of::<Slot>()) as *const Slot)
        }
    }

    fn slot(&self) -> &Slot {
        self.slot_at(self.slot)
    }

    fn device(&self, device: usize) -> &DeviceWord {
        &self.header().devices_[device]
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    fn claim_slot(&self, pid: u32, start: u64) -> Option<usize> {
        (0..SLOTS).find(|&i| {
            let s = self.slot_at(i);
            s.pid.load(Ordering::Relaxed) == 0
                && s.pid
                    .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                && {
                    s.start.store(start, Ordering::Release);
                    for d in 0..DEVICES {
                        s.used[d].store(0, Ordering::Relaxed);
                        s.waiting[d].store(0, Ordering::Relaxed);
                    }
                    true
                }
        })
    }

    /// What the job holds on `device`.
    pub fn used(&self, device: usize) -> u64 {
        self.device(device).total.load(Ordering::Acquire)
    }

    /// What this process holds on `device`, by the job's books.
    pub fn own(&self, device: usize) -> u64 {
        self.slot().used[device].load(Ordering::Acquire)
    }

    /// Takes `device`'s admission lock; takes it over from a dead holder.
    fn lock(&self, device: usize) -> DeviceGuard<'_> {
        let word = &self.device(device).lock;
        let me = self.slot as u64 + 1;
        let mut spins = 0u32;
        let mut since = None;
        loop {
            let held = word.load(Ordering::Relaxed);
            if held == 0 {
                if word
                    .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
                {
                    return DeviceGuard { job: self, device };
                }
                continue;
            }
            spins = spins.saturating_add(1);
            if spins < 64 {
                std::hint::spin_loop();
                continue;
            }
            std::thread::yield_now();
            let began = *since.get_or_insert_with(monotonic_ms);
            if monotonic_ms().saturating_sub(began) >= 1 {
                // Held for a millisecond: is its holder still there?
                let holder = (held - 1) as usize;
                let dead = holder >= SLOTS || {
                    let s = self.slot_at(holder);
                    let pid = s.pid.load(Ordering::Acquire);
                    pid == 0 || !alive(pid, s.start.load(Ordering::Acquire))
                };
                if dead
                    && word
                        .compare_exchange(held, me, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
                {
                    let guard = DeviceGuard { job: self, device };
                    if holder < SLOTS {
                        guard.drop_slot(holder);
                    }
                    // It may have died between its two stores: the total is derived
                    // again from the slots.
                    guard.recount();
                    return guard;
                }
                since = Some(monotonic_ms());
            }
        }
    }

    /// Admits `bytes` on `device` for this process if the job stays within `budget`;
    /// `Err` is what the job holds.
    pub fn reserve(&self, device: usize, bytes: u64, budget: u64) -> Result<(), u64> {
        match self.try_reserve(device, bytes, budget) {
            Ok(()) => Ok(()),
            Err(_) => {
                // Before denying: dead processes' shares go back first.
                self.reclaim_dead();
                self.try_reserve(device, bytes, budget)
            }
        }
    }

    fn try_reserve(&self, device: usize, bytes: u64, budget: u64) -> Result<(), u64> {
        self.maybe_reclaim();
        let g = self.lock(device);
        let word = self.device(device);
        let total = word.total.load(Ordering::Relaxed);
        match total.checked_add(bytes) {
            Some(after) if after <= budget => {
                word.total.store(after, Ordering::Relaxed);
                let own = &self.slot().used[device];
                own.store(
                    own.load(Ordering::Relaxed).saturating_add(bytes),
                    Ordering::Relaxed,
                );
                drop(g);
                Ok(())
            }
            _ => Err(total),
        }
    }

    /// Charges `bytes` whatever the budget says (memory the driver already handed out).
    pub fn charge(&self, device: usize, bytes: u64) {
        let g = self.lock(device);
        let word = self.device(device);
        word.total.store(
            word.total.load(Ordering::Relaxed).saturating_add(bytes),
            Ordering::Relaxed,
        );
        let own = &self.slot().used[device];
        own.store(
            own.load(Ordering::Relaxed).saturating_add(bytes),
            Ordering::Relaxed,
        );
        drop(g);
    }

    /// Gives back `bytes` of this process's share (never more than it holds).
    pub fn release(&self, device: usize, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let g = self.lock(device);
        let own = &self.slot().used[device];
        let give = bytes.min(own.load(Ordering::Relaxed));
        own.store(own.load(Ordering::Relaxed) - give, Ordering::Relaxed);
        let word = self.device(device);
        word.total.store(
            word.total.load(Ordering::Relaxed).saturating_sub(give),
            Ordering::Relaxed,
        );
        drop(g);
        self.wake(device);
    }

    /// Wakes whoever waits for room on `device` (a futex on the shared word).
    fn wake(&self, device: usize) {
        let word = self.device(device);
        word.wake.fetch_add(1, Ordering::Release);
        if word.waiters.load(Ordering::Acquire) != 0 {
            futex_wake(&word.wake);
        }
    }

    /// Looks for dead processes at most once a second (whoever comes first).
    fn maybe_reclaim(&self) {
        let h = self.header();
        let now = monotonic_ms();
        let last = h.last_scan_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 1000
            && h.last_scan_ms
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            self.reclaim_dead();
        }
    }

    /// Gives back the share of every process of the job that is gone.
    pub fn reclaim_dead(&self) {
        for i in 0..SLOTS {
            if i == self.slot {
                continue;
            }
            let s = self.slot_at(i);
            let pid = s.pid.load(Ordering::Acquire);
            if pid != 0 && !alive(pid, s.start.load(Ordering::Acquire)) {
                self.free_slot(i, pid);
            }
        }
    }

    /// Gives back slot `i`'s share on every device and frees it (if it still holds `pid`).
    fn free_slot(&self, i: usize, pid: u32) {
        let s = self.slot_at(i);
        for device in 0..DEVICES {
            if s.used[device].load(Ordering::Acquire) != 0 {
                self.lock(device).drop_slot(i);
                self.wake(device);
            }
            s.waiting[device].store(0, Ordering::Release);
        }
        let _ = s
            .pid
            .compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// The process is leaving (exit): its share goes back, its slot is free.
    pub fn leave(&self) {
        let pid = self.slot().pid.load(Ordering::Acquire);
        self.free_slot(self.slot, pid);
    }

    /// Sets what this process holds on `device` to `bytes` (its books were cleared).
    pub fn set_own(&self, device: usize, bytes: u64) {
        let g = self.lock(device);
        let own = &self.slot().used[device];
        let old = own.swap(bytes, Ordering::Relaxed);
        let word = self.device(device);
        let total = word.total.load(Ordering::Relaxed);
        word.total.store(
            total.saturating_sub(old).saturating_add(bytes),
            Ordering::Relaxed,
        );
        drop(g);
        if bytes < old {
            self.wake(device);
        }
    }

    /// The job's largest holders on `device`: up to five `(pid, bytes)`, largest first
    /// (`(0, 0)` past the end). No allocation: for the denial events.
    pub fn top_holders(&self, device: usize) -> [(u32, u64); 5] {
        let mut top = [(0u32, 0u64); 5];
        for i in 0..SLOTS {
            let s = self.slot_at(i);
            let pid = s.pid.load(Ordering::Acquire);
            let used = s.used[device].load(Ordering::Acquire);
            if pid == 0 || used == 0 || used <= top[4].1 {
                continue;
            }
            top[4] = (pid, used);
            top.sort_by_key(|h| std::cmp::Reverse(h.1));
        }
        top
    }

    /// Processes in the job now (live slots), for the tests and `status`.
    pub fn members(&self) -> usize {
        (0..SLOTS)
            .filter(|&i| self.slot_at(i).pid.load(Ordering::Acquire) != 0)
            .count()
    }

    /// Waits (at most `timeout`) until `device` may have room for `bytes` under
    /// `budget`, in arrival order with the job's other waiters. True: try again now.
    pub fn wait_for_room(
        &self,
        device: usize,
        bytes: u64,
        budget: u64,
        deadline: std::time::Instant,
    ) -> bool {
        let word = self.device(device);
        let ticket = word.next_ticket.fetch_add(1, Ordering::AcqRel) + 1;
        let mine = &self.slot().waiting[device];
        mine.store(ticket, Ordering::Release);
        word.waiters.fetch_add(1, Ordering::AcqRel);
        let result = loop {
            let seen = word.wake.load(Ordering::Acquire);
            let first = self.first_waiter(device) == Some(ticket);
            if first && self.used(device).saturating_add(bytes) <= budget {
                break true;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                break false;
            }
            // Woken by any release in the job; at the latest every 100 ms, to look for
            // dead processes (their share is given back by whoever finds them).
            let nap = (deadline - now).min(std::time::Duration::from_millis(100));
            futex_wait(&word.wake, seen, nap);
            self.maybe_reclaim();
        };
        mine.store(0, Ordering::Release);
        word.waiters.fetch_sub(1, Ordering::AcqRel);
        // The next in line may go now.
        self.wake(device);
        result
    }

    /// The smallest ticket among the job's live waiters on `device`.
    fn first_waiter(&self, device: usize) -> Option<u64> {
        (0..SLOTS)
            .filter_map(|i| {
                let s = self.slot_at(i);
                let t = s.waiting[device].load(Ordering::Acquire);
                (t != 0 && s.pid.load(Ordering::Relaxed) != 0).then_some(t)
            })
            .min()
    }
}

/// A device's admission lock, held.
struct DeviceGuard<'a> {
    job: &'a Job,
    device: usize,
}

impl DeviceGuard<'_> {
    /// Takes slot `i`'s share on the device out of the total (it is gone).
    fn drop_slot(&self, i: usize) {
        let used = self.job.slot_at(i).used[self.device].swap(0, Ordering::AcqRel);
        let word = self.job.device(self.device);
        word.total.store(
            word.total.load(Ordering::Relaxed).saturating_sub(used),
            Ordering::Relaxed,
        );
    }
}

impl DeviceGuard<'_> {
    /// The device's total, as the sum of the slots' shares (under the lock, exact).
    fn recount(&self) {
        let sum = (0..SLOTS)
            .map(|i| self.job.slot_at(i).used[self.device].load(Ordering::Acquire))
            .fold(0u64, u64::saturating_add);
        self.job
            .device(self.device)
            .total
            .store(sum, Ordering::Relaxed);
    }
}

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        self.job
            .device(self.device)
            .lock
            .store(0, Ordering::Release);
    }
}

fn futex_wait(word: &AtomicU32, seen: u32, timeout: std::time::Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a shared (not private) futex wait on a word of the mapping, with a timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: a shared futex wake of every waiter on a word of the mapping.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// In the child of `fork()`: the child is not the parent's member of the job.
pub fn after_fork() {
    JOINED.store(std::ptr::null_mut(), Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid that no process has now (a child that has exited and been reaped).
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    fn fresh_job(name: &str) -> Job {
        let dir = std::env::temp_dir().join(format!("cb-job-unit-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        open(dir.join("ledger").to_str().unwrap()).unwrap()
    }

    #[test]
    fn a_lock_left_by_a_dead_process_is_taken_over_and_the_total_recounted() {
        let job = fresh_job("steal");
        // Slot 7 died holding device 0's lock, between raising the total and its share.
        let dead = job.slot_at(7);
        dead.pid.store(dead_pid(), Ordering::Release);
        dead.used[0].store(100, Ordering::Release);
        job.device(0).total.store(100 + 50, Ordering::Release);
        job.device(0).lock.store(7 + 1, Ordering::Release);
        assert_eq!(job.reserve(0, 10, 1000), Ok(()));
        assert_eq!(
            job.used(0),
            10,
            "the dead share and the half-made change are gone"
        );
        assert_eq!(job.own(0), 10);
        assert_eq!(job.device(0).lock.load(Ordering::Acquire), 0);
        assert_eq!(dead.used[0].load(Ordering::Acquire), 0);
    }

    /// The same takeover on the way to a charge (memory the driver already handed out,
    /// which looks for no dead members first): the dead holder's share leaves the books
    /// with its lock.
    #[test]
    fn a_charge_takes_a_dead_members_lock_over_and_drops_its_share() {
        let job = fresh_job("steal-charge");
        let dead = job.slot_at(7);
        dead.pid.store(dead_pid(), Ordering::Release);
        dead.used[0].store(100, Ordering::Release);
        job.device(0).total.store(100 + 50, Ordering::Release);
        job.device(0).lock.store(7 + 1, Ordering::Release);
        job.charge(0, 10);
        assert_eq!(job.used(0), 10);
        assert_eq!(job.own(0), 10);
        assert_eq!(dead.used[0].load(Ordering::Acquire), 0);
        assert_eq!(job.device(0).lock.load(Ordering::Acquire), 0);
    }

    /// A lock word that names no slot (a damaged ledger) holds nobody: it is taken over
    /// and the total derived again from the slots.
    #[test]
    fn a_lock_word_naming_no_slot_is_taken_over() {
        let job = fresh_job("steal-noslot");
        job.device(3).total.store(50, Ordering::Release);
        job.device(3)
            .lock
            .store(SLOTS as u64 + 1, Ordering::Release);
        job.charge(3, 10);
        assert_eq!(job.used(3), 10);
        assert_eq!(job.device(3).lock.load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_dead_processs_share_goes_back_before_a_denial_and_a_live_one_stays() {
        let job = fresh_job("reclaim");
        let (dead, live) = (job.slot_at(3), job.slot_at(4));
        dead.pid.store(dead_pid(), Ordering::Release);
        dead.used[1].store(600, Ordering::Release);
        live.pid.store(std::process::id(), Ordering::Release);
        live.start
            .store(start_time(std::process::id()).unwrap(), Ordering::Release);
        live.used[1].store(300, Ordering::Release);
        job.device(1).total.store(900, Ordering::Release);
        assert_eq!(job.reserve(1, 500, 1000), Ok(()));
        assert_eq!(job.used(1), 800);
        assert_eq!(
            dead.pid.load(Ordering::Acquire),
            0,
            "the dead slot is free again"
        );
        assert_eq!(job.reserve(1, 300, 1000), Err(800), "the live share stays");
        live.pid.store(0, Ordering::Release);
    }

    #[test]
    fn a_job_holds_1024_live_processes_and_refuses_the_next_one() {
        let dir = std::env::temp_dir().join(format!("cb-job-unit-{}-full", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ledger");
        let job = open(path.to_str().unwrap()).unwrap();
        // 1023 more live members (this process's pid and start time: alive).
        let (me, start) = (std::process::id(), start_time(std::process::id()).unwrap());
        for i in 0..SLOTS {
            let s = job.slot_at(i);
            if s.pid.load(Ordering::Acquire) == 0 {
                s.start.store(start, Ordering::Release);
                s.pid.store(me, Ordering::Release);
            }
        }
        assert_eq!(job.members(), SLOTS);
        let refused = open(path.to_str().unwrap()).err().unwrap();
        assert!(refused.contains("all 1024 process slots"), "{refused}");
    }

    /// FNV-1a (64-bit) as its authors define it, for the check below.
    fn fnv1a(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    /// The header checksum is part of layout version 1: FNV-1a over the little-endian
    /// magic, version, slot count, device count and size. Every build of version 1 must
    /// compute it alike, or processes of a job running two builds would refuse each
    /// other's ledger as damaged.
    #[test]
    fn the_header_checksum_is_fnv1a_over_the_layout_fields() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(
            fnv1a(b"a"),
            0xaf63_dc4c_8601_ec8c,
            "FNV-1a's published test vector"
        );
        for (magic, version, slots, devices, size) in [
            (
                MAGIC,
                VERSION,
                SLOTS as u32,
                DEVICES as u32,
                FILE_BYTES as u64,
            ),
            (1, 2, 3, 4, 5),
            (u64::MAX, u32::MAX, 0, u32::MAX, u64::MAX),
        ] {
            let mut bytes = Vec::new();
            bytes.extend_from_slice(&magic.to_le_bytes());
            bytes.extend_from_slice(&version.to_le_bytes());
            bytes.extend_from_slice(&slots.to_le_bytes());
            bytes.extend_from_slice(&devices.to_le_bytes());
            bytes.extend_from_slice(&size.to_le_bytes());
            assert_eq!(
                checksum(magic, version, slots, devices, size),
                fnv1a(&bytes)
            );
        }
    }

    /// The ledger lives in /dev/shm, which is memory: it is the header and 1024 slots,
    /// about a megabyte, never more than 2 MiB.
    #[test]
    fn a_jobs_ledger_takes_less_than_two_mib() {
        let job = fresh_job("size");
        let len = std::fs::metadata(job.path()).unwrap().len();
        assert!(len > (SLOTS * 64 * 8) as u64, "{len}");
        assert!(len < 2 << 20, "{len}");
    }

    /// A ledger of another layout whose header is consistent (its own checksum right, the
    /// file of this build's size) is refused, naming the layout, whichever of the slot
    /// count, the device count or the recorded size differs.
    #[test]
    fn a_self_consistent_header_of_another_layout_is_refused() {
        for field in ["slots", "devices", "size"] {
            let job = fresh_job(&format!("layout-{field}"));
            // SAFETY: the test's own mapping of a header nobody else uses.
            let h = unsafe { &mut *(job.base as *mut Header) };
            match field {
                "slots" => h.slots = 2 * SLOTS as u32,
                "devices" => h.devices = 8,
                _ => h.size = 2 * FILE_BYTES as u64,
            }
            h.check = checksum(h.magic, h.version, h.slots, h.devices, h.size);
            let why = open(job.path()).err().expect(field);
            assert!(
                why.contains("does not match this build's layout"),
                "{field}: {why}"
            );
        }
    }

    /// A symbolic link where the ledger should be is refused, not followed: the
    /// ledger's checks (owner, mode) are of the file at that name, and whoever could
    /// plant a link would choose where the job's books go.
    #[test]
    fn a_symbolic_link_in_place_of_the_ledger_is_refused() {
        let job = fresh_job("symlink");
        let link = format!("{}.link", job.path());
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(job.path(), &link).unwrap();
        let why = open(&link).err().expect("a link is refused");
        assert!(why.starts_with("cannot open it: "), "{why}");
    }

    /// A directory that does not exist: the reason is the open's, in words.
    #[test]
    fn a_ledger_that_cannot_be_opened_says_why() {
        let why = open("/nonexistent-cudabudget-dir/ledger").err().unwrap();
        assert!(
            why.starts_with("cannot open it: No such file or directory"),
            "{why}"
        );
    }

    /// A device's admission lock excludes every other member while a live member holds
    /// it, whichever slot the holder has (slot 0 included), and whoever is in the slot
    /// after it: the others wait, and get it once it is let go.
    #[test]
    fn a_live_members_lock_keeps_the_others_waiting() {
        for holder_slot in [0usize, 1] {
            let dir = std::env::temp_dir().join(format!(
                "cb-job-unit-{}-lock{holder_slot}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("ledger");
            let path = path.to_str().unwrap();
            let (first, second) = (open(path).unwrap(), open(path).unwrap());
            assert_eq!((first.slot, second.slot), (0, 1));
            let (holder, waiter) = if holder_slot == 0 {
                (first, second)
            } else {
                (second, first)
            };
            let waiter: &'static Job = Box::leak(Box::new(waiter));
            let held = holder.lock(2);
            let done = std::sync::Arc::new(AtomicU32::new(0));
            let t = {
                let done = done.clone();
                std::thread::spawn(move || {
                    waiter.charge(2, 100);
                    done.store(1, Ordering::SeqCst);
                })
            };
            std::thread::sleep(std::time::Duration::from_millis(100));
            assert_eq!(
                done.load(Ordering::SeqCst),
                0,
                "slot {holder_slot}: the lock of a live member was taken"
            );
            drop(held);
            t.join().unwrap();
            assert_eq!(done.load(Ordering::SeqCst), 1);
            assert_eq!(holder.used(2), 100);
        }
    }

    /// A member that holds a device's lock is waited for while it lives, however long;
    /// once it dies (here: killed while it sleeps with the lock), a waiter takes the lock
    /// over, whenever the death comes.
    #[test]
    fn a_lock_whose_holder_dies_after_a_while_is_taken_over() {
        let job: &'static Job = Box::leak(Box::new(fresh_job("steal-later")));
        let mut holder = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let slot = job.slot_at(5);
        slot.start
            .store(start_time(holder.id()).unwrap(), Ordering::Release);
        slot.pid.store(holder.id(), Ordering::Release);
        job.device(1).lock.store(5 + 1, Ordering::Release);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            job.charge(1, 10);
            let _ = tx.send(());
        });
        // Long past the first millisecond's look at the holder, which is alive.
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(200))
                .is_err(),
            "the lock of a live member was taken"
        );
        holder.kill().unwrap();
        holder.wait().unwrap();
        assert!(
            rx.recv_timeout(std::time::Duration::from_secs(20)).is_ok(),
            "the lock of a member that died is never taken over"
        );
        assert_eq!(job.used(1), 10);
        assert_eq!(job.device(1).lock.load(Ordering::Acquire), 0);
    }

    /// Setting what this process holds (its books cleared) wakes the job's waiters when
    /// it makes room, and only then.
    #[test]
    fn setting_what_a_member_holds_wakes_the_waiters_only_when_it_makes_room() {
        let job = fresh_job("set-own");
        let wakes = || job.device(0).wake.load(Ordering::Acquire);
        job.set_own(0, 100);
        let before = wakes();
        job.set_own(0, 40);
        assert!(wakes() > before, "less held: the waiters are woken");
        assert_eq!(job.used(0), 40);
        for same_or_more in [40, 90] {
            let before = wakes();
            job.set_own(0, same_or_more);
            assert_eq!(wakes(), before, "{same_or_more}: no room made, no wake");
        }
        assert_eq!((job.used(0), job.own(0)), (90, 90));
    }

    /// The denial events name the job's five largest holders, largest first, whatever
    /// the order of their slots; members that hold nothing are not named.
    #[test]
    fn the_top_holders_are_the_five_largest_largest_first() {
        let job = fresh_job("top");
        let me = std::process::id();
        for (i, used) in [70u64, 0, 60, 50, 40, 30, 5, 20].into_iter().enumerate() {
            let s = job.slot_at(10 + i);
            s.pid.store(me + i as u32, Ordering::Release);
            s.used[2].store(used, Ordering::Release);
        }
        let top = job.top_holders(2);
        assert_eq!(
            top,
            [
                (me, 70),
                (me + 2, 60),
                (me + 3, 50),
                (me + 4, 40),
                (me + 5, 30)
            ]
        );
        let few = fresh_job("top-few");
        few.slot_at(3).pid.store(me, Ordering::Release);
        few.slot_at(3).used[0].store(9, Ordering::Release);
        assert_eq!(
            few.top_holders(0),
            [(me, 9), (0, 0), (0, 0), (0, 0), (0, 0)]
        );
        // A free slot (no pid) is nobody, whatever bytes a damaged ledger left in it.
        few.slot_at(7).used[0].store(500, Ordering::Release);
        assert_eq!(
            few.top_holders(0),
            [(me, 9), (0, 0), (0, 0), (0, 0), (0, 0)]
        );
    }

    /// A process's start time is what tells it from a later process with the same pid:
    /// later processes have later start times (clock ticks since boot).
    #[test]
    fn a_later_process_has_a_later_start_time() {
        let me = start_time(std::process::id()).unwrap();
        assert!(start_time(1).unwrap() <= me);
        std::thread::sleep(std::time::Duration::from_millis(50));
        let mut child = std::process::Command::new("sleep")
            .arg("1")
            .spawn()
            .unwrap();
        let later = start_time(child.id()).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(later > me, "{later} after {me}");
    }

    #[test]
    fn a_reused_pid_is_not_taken_for_the_process_that_had_it() {
        let me = std::process::id();
        let start = start_time(me).unwrap();
        assert!(alive(me, start));
        assert!(!alive(me, start + 1), "same pid, another start time");
        assert!(!alive(dead_pid(), 0));
    }
}
