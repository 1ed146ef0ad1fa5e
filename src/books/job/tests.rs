use super::file::*;
use super::liveness;
use super::members::*;
use super::sigbus::*;
use super::words::*;

use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::sys::clock::monotonic_ms;
use cudabudget_spec::job_file as layout;
use layout::TOMB;

use cudabudget_spec::place::{self, Dir};

use std::os::unix::fs::FileExt;

/// A pid that no process has now (a child that has exited and been reaped).
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cb-job-unit-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn member_of(dir: &Path) -> Job {
    match open_in(&Dir::open_trusted(dir).unwrap(), "ledger") {
        Ok(job) => job,
        Err(Failed::Place(e)) => panic!("{e}"),
        Err(Failed::Refused(p, why)) => panic!("{p}: {why}"),
    }
}

fn refusal(dir: &Path) -> String {
    match open_in(&Dir::open_trusted(dir).unwrap(), "ledger") {
        Ok(_) => panic!("joined"),
        Err(Failed::Place(e)) => e.to_string(),
        Err(Failed::Refused(_, why)) => why,
    }
}

fn fresh_job(name: &str) -> Job {
    member_of(&scratch(name))
}

/// Makes slot `i` a member `pid` started at `start`, holding `used` on `device`.
fn plant(job: &Job, i: usize, pid: u32, start: u64, device: usize, used: u64) {
    plant_fd(job, i, pid, start, u32::MAX);
    let s = job.share_at(i, device);
    s.used.store(used, Ordering::SeqCst);
    s.inv.store(!used, Ordering::SeqCst);
}

/// Makes slot `i` a member `pid` started at `start` that keeps the ledger open as `fd`.
fn plant_fd(job: &Job, i: usize, pid: u32, start: u64, fd: u32) {
    let c = job.claim_at(i);
    let claim = u64::from(pid) | (7 << 32);
    c.claim.store(claim, Ordering::Release);
    c.start.store(start, Ordering::Release);
    c.fd.store(fd, Ordering::Release);
    c.seal.store(seal(claim, start, fd), Ordering::Release);
}

#[test]
fn a_dead_processs_share_goes_back_before_a_denial_and_a_live_one_stays() {
    let job = fresh_job("reclaim");
    let me = std::process::id();
    plant(&job, 3, dead_pid(), 1, 1, 600);
    plant(&job, 4, me, start_time(me).unwrap(), 1, 300);
    // The live one is this process: it maps the ledger.
    job.claim_at(4)
        .fd
        .store(job.fd.as_raw_fd() as u32, Ordering::Release);
    assert_eq!(job.reserve(1, 500, 1000), Ok(()));
    assert_eq!(job.used(1), 800);
    assert_eq!(job.claim_at(3).claim.load(Ordering::Acquire), 0, "freed");
    assert_eq!(job.reserve(1, 300, 1000), Err(800), "the live share stays");
}

#[test]
fn a_zombie_or_a_process_that_no_longer_maps_the_ledger_is_dead() {
    let job = fresh_job("alive");
    let me = std::process::id();
    let start = start_time(me).unwrap();
    assert!(job.alive(SLOTS - 1, me, start, job.fd.as_raw_fd() as u32));
    assert!(
        job.alive(SLOTS - 1, me, start, u32::MAX),
        "maps it, whatever the descriptor"
    );
    assert!(
        !job.alive(SLOTS - 1, me, start + 1, u32::MAX),
        "same pid, another start time"
    );
    assert!(!job.alive(SLOTS - 1, dead_pid(), 0, 0));
    // Another program (as after exec): neither the descriptor nor a mapping.
    let mut other = std::process::Command::new("sleep")
        .arg("10")
        .spawn()
        .unwrap();
    let pid = other.id();
    std::thread::sleep(Duration::from_millis(50));
    let started = start_time(pid).unwrap();
    assert!(
        !job.alive(SLOTS - 1, pid, started, 0),
        "another program is not the member"
    );
    // A zombie (killed, not reaped).
    // SAFETY: a plain signal to our own child.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(proc_stat(pid).unwrap().state, b'Z');
    assert!(!job.alive(SLOTS - 1, pid, started, 0));
    other.wait().unwrap();
}

#[test]
fn a_slot_of_this_pid_and_start_time_that_no_member_of_this_image_uses_is_freed_at_join() {
    // What a process held before it exec'd is gone: the new image joins without it.
    let dir = scratch("exec");
    let first = member_of(&dir);
    let me = std::process::id();
    plant(&first, 9, me, start_time(me).unwrap(), 0, 800);
    let second = member_of(&dir);
    assert_eq!(second.used(0), 0, "the previous image's share is gone");
    assert_eq!(
        first.claim_at(first.slot).claim.load(Ordering::Acquire),
        first.claim
    );
}

#[test]
fn a_lock_word_naming_no_current_claim_is_taken_over_at_once() {
    let job = fresh_job("stale-lock");
    // Slot 0 + 1 with generation 0 (crafted, or a claim since reused): nobody.
    for held in [
        1u64,
        (job.slot as u64 + 1) | (12345 << 32),
        SLOTS as u64 + 1,
        u64::MAX,
    ] {
        job.device(2).lock.store(held, Ordering::Release);
        let t = Instant::now();
        drop(job.lock(2));
        assert!(
            t.elapsed() < Duration::from_millis(20),
            "{held:x}: {:?}",
            t.elapsed()
        );
        assert_eq!(job.device(2).lock.load(Ordering::Acquire), 0);
    }
}

#[test]
fn a_live_holder_is_waited_for_only_up_to_the_bound_and_frees_never_wait() {
    let dir = scratch("live-lock");
    // The holder is the later member: the slot after its own is free (a lock word is
    // read against its holder's slot, not a neighbour's).
    let (other, holder) = (member_of(&dir), member_of(&dir));
    let held = holder.lock(0);
    let t = Instant::now();
    other.release(0, 10);
    other.charge(0, 10);
    other.release(0, 10);
    assert!(t.elapsed() < Duration::from_millis(5), "{:?}", t.elapsed());
    let t = Instant::now();
    assert_eq!(other.reserve(0, 100, 1000), Ok(()));
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(LOCK_PATIENCE_MS - 5),
        "{waited:?}"
    );
    assert!(
        waited < Duration::from_millis(LOCK_PATIENCE_MS * 4),
        "{waited:?}"
    );
    drop(held);
    assert_eq!(other.own(0), 100);
}

#[test]
fn two_admitters_racing_for_the_last_bytes_never_both_pass() {
    let dir = scratch("race");
    let members: Vec<&'static Job> = (0..4)
        .map(|_| &*Box::leak(Box::new(member_of(&dir))))
        .collect();
    for round in 0..200 {
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
        let got: Vec<bool> = members
            .iter()
            .map(|&m| {
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    m.reserve(0, 600, 1000).is_ok()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert!(
            got.iter().filter(|&&g| g).count() <= 1,
            "round {round}: {got:?}"
        );
        for m in &members {
            m.set_own(0, 0);
        }
    }
}

#[test]
fn a_stray_write_lowering_one_word_of_a_share_does_not_lower_it() {
    let job = fresh_job("share-words");
    job.charge(0, 700);
    let s = job.share_at(job.slot, 0);
    s.used.store(0, Ordering::SeqCst);
    assert_eq!(job.used(0), 700);
    s.used.store(700, Ordering::SeqCst);
    s.inv.store(!0, Ordering::SeqCst);
    assert_eq!(job.used(0), 700);
    // Both words wiped to zero: counts as everything (fail closed) until restored.
    s.inv.store(0, Ordering::SeqCst);
    assert_eq!(job.used(0), u64::MAX);
    job.release(0, 100);
    assert_eq!(
        job.used(0),
        600,
        "the member restores its slot at its next call"
    );
}

#[test]
fn stray_bytes_in_a_free_slot_count_until_a_scan_has_seen_them_for_a_second() {
    let job = fresh_job("free-garbage");
    let s = job.share_at(500, 3);
    s.used.store(123, Ordering::SeqCst);
    assert_eq!(job.used(3), 123);
    job.reclaim_dead();
    assert_eq!(job.used(3), 123, "not at first sight");
    job.suspects[500].store(
        monotonic_ms().saturating_sub(SUSPECT_MS + 1).max(1),
        Ordering::Relaxed,
    );
    job.reclaim_dead();
    assert_eq!(job.used(3), 0);
}

#[test]
fn a_damaged_header_refuses_admissions_once_said_and_frees_go_on() {
    let job = fresh_job("damaged");
    job.charge(0, 300);
    job.word64(0).store(0, Ordering::Release);
    assert!(job.reserve(0, 1, 1 << 30).is_err());
    let news = job.damage_news().unwrap();
    assert!(
        news.contains(&job.path) && news.contains("bad magic"),
        "{news}"
    );
    assert_eq!(job.damage_news(), None, "once");
    job.release(0, 300);
    assert_eq!(job.own(0), 0);
    // Fixed bytes do not undo it: damage is for good in this process.
    job.word64(0).store(layout::MAGIC, Ordering::Release);
    assert!(job.reserve(0, 1, 1 << 30).is_err());
}

#[test]
fn a_ledger_cut_under_its_member_raises_no_sigbus_and_is_damaged() {
    let dir = scratch("cut");
    let job = member_of(&dir);
    job.charge(1, 400);
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("ledger"))
        .unwrap()
        .set_len(0)
        .unwrap();
    job.release(1, 100);
    assert!(job.reserve(1, 1, 1 << 30).is_err());
    assert!(job.damage_news().unwrap().contains("cut short"));
    job.release(1, 300);
    job.leave();
    // The file is not made again while it is there (it may have members).
    assert!(refusal(&dir).contains(" bytes, not "));
    assert!(std::fs::metadata(dir.join("ledger")).unwrap().len() < FILE_BYTES as u64);
}

#[test]
fn a_ledger_grown_under_its_members_is_damaged_at_the_next_scan() {
    let dir = scratch("grown");
    let job = member_of(&dir);
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("ledger"))
        .unwrap()
        .set_len(FILE_BYTES as u64 + 4096)
        .unwrap();
    job.reclaim_dead();
    assert!(job.reserve(0, 1, 1 << 30).is_err());
    // Damaged for every member: its magic is zeroed in the file, not only in our books.
    let bytes = std::fs::read(dir.join("ledger")).unwrap();
    assert_eq!(
        bytes[..8],
        [0u8; 8],
        "the magic is zeroed for the other members"
    );
}

#[test]
fn a_last_scan_time_in_the_future_does_not_stop_the_scans() {
    let job = fresh_job("future-scan");
    plant(&job, 3, dead_pid(), 1, 0, 600);
    job.word64(LAST_SCAN_AT)
        .store(u64::MAX - 5, Ordering::Release);
    job.maybe_reclaim();
    assert_eq!(job.used(0), 0);
}

#[test]
fn processes_creating_one_ledger_at_once_all_join_the_same_one() {
    let dir = scratch("create-race");
    let members: Vec<Job> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8).map(|_| s.spawn(|| member_of(&dir))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    members[0].charge(0, 5);
    for m in &members {
        assert_eq!(m.used(0), 5);
        assert_eq!(m.ino, members[0].ino);
    }
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["ledger"], "no temporary file left");
}

#[test]
fn a_job_holds_1024_members_and_refuses_the_next_one() {
    let dir = scratch("full");
    let job = member_of(&dir);
    let me = std::process::id();
    // Members still joining (no start time yet): alive, and not a previous image's.
    for i in 0..SLOTS {
        if i != job.slot {
            plant(&job, i, me, 0, 0, 0);
        }
    }
    assert_eq!(job.members(), SLOTS);
    let why = refusal(&dir);
    assert!(why.contains("all 1024 process slots"), "{why}");
}

#[test]
fn the_top_holders_are_the_five_largest_largest_first() {
    let job = fresh_job("top");
    let me = std::process::id();
    for (i, used) in [70u64, 0, 60, 50, 40, 30, 5, 20].into_iter().enumerate() {
        plant(&job, 10 + i, me + i as u32, 1, 2, used);
    }
    assert_eq!(
        job.top_holders(2),
        [
            (me, 70),
            (me + 2, 60),
            (me + 3, 50),
            (me + 4, 40),
            (me + 5, 30)
        ]
    );
}

#[test]
fn waiters_go_in_arrival_order_and_a_silent_one_loses_its_turn() {
    let job = fresh_job("turns");
    let now = monotonic_ms();
    let (a, b, c) = (job.queue(1), job.queue(1), job.queue(1));
    assert!(a.first(now) && !b.first(now) && !c.first(now));
    drop(a);
    assert!(b.first(now) && !c.first(now));
    // b stops beating (stopped, or killed): c goes after TURN_STALE_MS.
    job.waiter(b.entry.unwrap())
        .beat
        .store(now.saturating_sub(TURN_STALE_MS + 10), Ordering::Release);
    assert!(c.first(now));
    // A waiter of another device is not in the way.
    let other = job.queue(2);
    assert!(other.first(now));
}

#[test]
fn setting_what_a_member_holds_wakes_the_waiters_only_when_it_makes_room() {
    let job = fresh_job("set-own");
    let wakes = || job.device(0).wake.load(Ordering::Acquire);
    job.set_own(0, 100);
    let before = wakes();
    job.set_own(0, 40);
    assert!(wakes() > before, "less held: the waiters are woken");
    for same_or_more in [40, 90] {
        let before = wakes();
        job.set_own(0, same_or_more);
        assert_eq!(wakes(), before, "{same_or_more}: no room made, no wake");
    }
    assert_eq!((job.used(0), job.own(0)), (90, 90));
}

#[test]
fn maps_text_is_matched_by_device_and_inode() {
    let dev = libc::makedev(0, 0x1a);
    let maps = "7f00-7f10 rw-s 00000000 00:1a 4242 /dev/shm/cudabudget-0/job-x\n";
    assert!(maps_ledger(maps, dev, 4242));
    assert!(!maps_ledger(maps, dev, 424));
    assert!(!maps_ledger(maps, libc::makedev(0, 0x1b), 4242));
}

// ---------------------------------------------------------------------------------------
// The ledger survives any bytes: random writes, truncations and growth of the file while
// members admit and free. Never a crash; never more admitted than the budget (by the
// members' own books, the truth); damage found is damage said.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

const BUDGET: u64 = 1000;

/// One stray change to the file (through its own descriptor, as another process of
/// the user would make it).
fn vandalise(file: &std::fs::File, rng: &mut Rng) {
    let len = file.metadata().unwrap().len();
    match rng.below(10) {
        0 => {
            let to = [0, 40, 4096, rng.below(FILE_BYTES as u64)][rng.below(4) as usize];
            file.set_len(to).unwrap();
        }
        1 => file.set_len(FILE_BYTES as u64 + rng.below(8192)).unwrap(),
        2 => file.set_len(FILE_BYTES as u64).unwrap(),
        _ => {
            // Bytes: random, zeros or ones, anywhere, most often where the books are.
            let at = match rng.below(4) {
                0 => rng.below(layout::CLAIMS_AT as u64),
                1 => layout::CLAIMS_AT as u64 + rng.below(64 * layout::CLAIM_BYTES as u64),
                2 => layout::SHARES_AT as u64 + rng.below(64 * layout::SHARE_BYTES as u64),
                _ => rng.below(len.max(1)),
            };
            let n = 1 + rng.below(32) as usize;
            let fill = rng.below(3);
            if std::env::var_os("CB_JOB_TRACE").is_some() {
                eprintln!("write {n} bytes at {at} fill {fill}");
            }
            let bytes: Vec<u8> = (0..n)
                .map(|_| match fill {
                    0 => 0,
                    1 => 0xff,
                    _ => rng.next() as u8,
                })
                .collect();
            file.write_all_at(&bytes, at).unwrap();
        }
    }
}

/// The members' own books: what they hold on device 0, all together.
fn held(members: &[Job]) -> u64 {
    members.iter().map(|m| m.own(0)).sum()
}

fn one_case(seed: u64, dir: &Path) {
    let mut rng = Rng(seed | 1);
    let _ = std::fs::remove_file(dir.join("ledger"));
    let members: Vec<Job> = (0..3).map(|_| member_of(dir)).collect();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("ledger"))
        .unwrap();
    for step in 0..40 {
        let trace = std::env::var_os("CB_JOB_TRACE").is_some();
        if rng.below(4) == 0 {
            vandalise(&file, &mut rng);
            if trace {
                eprintln!(
                    "step {step}: vandalised; len {}",
                    file.metadata().unwrap().len()
                );
            }
        }
        let m = &members[rng.below(3) as usize];
        if trace {
            eprintln!(
                "step {step}: member {} own {:?} used {} damaged {}",
                m.slot,
                members.iter().map(|m| m.own(0)).collect::<Vec<_>>(),
                m.used(0),
                m.damaged.load(Ordering::Relaxed)
            );
        }
        match rng.below(5) {
            0 | 1 => {
                let bytes = 1 + rng.below(BUDGET / 2);
                let before = held(&members);
                if m.reserve(0, bytes, BUDGET).is_ok() {
                    assert!(
                        before + bytes <= BUDGET,
                        "seed {seed} step {step}: {before} + {bytes} admitted under {BUDGET}"
                    );
                }
            }
            2 => m.release(0, rng.below(m.own(0) + 1)),
            3 => m.charge(0, rng.below(50)),
            _ => {
                m.reclaim_dead();
                let _ = m.is_damaged();
            }
        }
        if m.is_damaged() {
            assert!(
                m.reserve(0, 1, BUDGET).is_err(),
                "seed {seed}: admitted while damaged"
            );
        }
    }
    for m in &members {
        m.leave();
    }
}

/// Members in threads admitting and freeing while another thread writes, cuts and grows
/// the file.
fn concurrent_case(seed: u64, dir: &Path) {
    let _ = std::fs::remove_file(dir.join("ledger"));
    let members: Vec<Job> = (0..3).map(|_| member_of(dir)).collect();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("ledger"))
        .unwrap();
    let over = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    // Admitted bytes, counted before they are freed: never more than the budget.
    let admitted = AtomicU64::new(0);
    std::thread::scope(|s| {
        for (k, m) in members.iter().enumerate() {
            let (admitted, over, stop) = (&admitted, &over, &stop);
            s.spawn(move || {
                let mut rng = Rng(seed ^ ((k as u64 + 1) * 0x9e37_79b9));
                let mut mine = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    if rng.below(2) == 0 || mine.is_empty() {
                        let bytes = 1 + rng.below(BUDGET / 3);
                        if m.reserve(0, bytes, BUDGET).is_ok() {
                            let now = admitted.fetch_add(bytes, Ordering::SeqCst) + bytes;
                            if now > BUDGET {
                                over.fetch_max(now, Ordering::Relaxed);
                            }
                            mine.push(bytes);
                        }
                    } else {
                        let bytes = mine.pop().unwrap();
                        admitted.fetch_sub(bytes, Ordering::SeqCst);
                        m.release(0, bytes);
                    }
                }
                for bytes in mine {
                    admitted.fetch_sub(bytes, Ordering::SeqCst);
                    m.release(0, bytes);
                }
            });
        }
        let mut rng = Rng(seed | 1);
        for _ in 0..20 {
            vandalise(&file, &mut rng);
            std::thread::sleep(Duration::from_micros(200));
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert_eq!(
        over.load(Ordering::Relaxed),
        0,
        "seed {seed}: admitted past the budget"
    );
    for m in &members {
        m.leave();
    }
}

/// `CB_JOB_PROPERTY_CASES` (default 300) cases; `CB_JOB_PROPERTY_SEED` to start from
/// another seed (a failure names its seed).
#[test]
fn the_ledger_survives_any_bytes() {
    let cases: u64 = std::env::var("CB_JOB_PROPERTY_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let first: u64 = std::env::var("CB_JOB_PROPERTY_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x00C0_FFEE);
    let dir = scratch("property");
    let t = Instant::now();
    for case in 0..cases {
        let seed = first.wrapping_add(case.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        if case % 50 == 49 {
            concurrent_case(seed, &dir);
        } else {
            one_case(seed, &dir);
        }
    }
    eprintln!("the ledger survived {cases} cases in {:?}", t.elapsed());
}

/// A child of this process (forked: it keeps the ledger open and mapped) whose command
/// name is `name` (set with PR_SET_NAME); it sleeps until killed.
fn named_child(name: &[u8]) -> libc::pid_t {
    let mut cname = name.to_vec();
    cname.push(0);
    // SAFETY: the child only calls async-signal-safe functions (prctl, pause, _exit).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        // SAFETY: a NUL-terminated name of at most 16 bytes; pause and _exit never return
        // into the test harness.
        unsafe {
            // Not the harness's output: the test must not wait on it.
            libc::close(1);
            libc::close(2);
            libc::prctl(libc::PR_SET_NAME, cname.as_ptr());
            loop {
                libc::pause();
            }
        }
    }
    // Until the child carries the name.
    let want = &name[..name.len().min(15)];
    for _ in 0..1000 {
        if let Ok(comm) = std::fs::read(format!("/proc/{pid}/comm"))
            && comm.starts_with(want)
        {
            return pid;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("the child never took its name");
}

/// A forked child, killed and reaped on drop (also when the test fails).
struct Child(libc::pid_t);

impl Drop for Child {
    fn drop(&mut self) {
        // SAFETY: our own child; reaped here.
        unsafe {
            libc::kill(self.0, libc::SIGKILL);
            libc::waitpid(self.0, std::ptr::null_mut(), 0);
        }
    }
}

#[test]
fn a_member_whose_command_name_is_not_utf8_is_alive_and_its_share_counts() {
    let _forks = forks_apart();
    let job = fresh_job("comm-utf8");
    // `a训练脚本模型` cut to 15 bytes by the kernel: the last character is cut in two.
    let name = "a训练脚本模型".as_bytes();
    assert!(std::str::from_utf8(&name[..15]).is_err());
    let child = Child(named_child(name));
    let pid = child.0 as u32;
    let start = start_time(pid);
    let stat = std::fs::read(format!("/proc/{pid}/stat")).unwrap();
    assert!(
        std::str::from_utf8(&stat).is_err(),
        "the stat line is not UTF-8"
    );
    let start = start.expect("the start time of a process whose name is not UTF-8");
    plant_fd(&job, 5, pid, start, job.fd.as_raw_fd() as u32);
    let s = job.share_at(5, 0);
    s.used.store(700, Ordering::SeqCst);
    s.inv.store(!700, Ordering::SeqCst);
    assert!(job.alive(SLOTS - 1, pid, start, job.fd.as_raw_fd() as u32));
    job.reclaim_dead();
    assert_eq!(
        job.reserve(0, 400, 1000),
        Err(700),
        "the live share stays counted"
    );
    assert_eq!(job.used(0), 700);
}

#[test]
fn a_reused_descriptor_number_is_neither_judged_nor_written() {
    let dir = scratch("fd-reuse");
    let job = member_of(&dir);
    // The program closed the ledger's descriptor and the number went to another file.
    let other_path = dir.join("other");
    std::fs::write(&other_path, [0xAAu8; 100]).unwrap();
    let other = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&other_path)
        .unwrap();
    // SAFETY: both descriptors are open; the Job's number now names the other file.
    assert!(unsafe { libc::dup2(other.as_raw_fd(), job.fd.as_raw_fd()) } >= 0);
    job.reclaim_dead();
    assert!(
        !job.is_damaged(),
        "another file's size says nothing of the ledger"
    );
    job.mark_damaged("a test".to_string());
    assert_eq!(
        std::fs::read(&other_path).unwrap(),
        vec![0xAAu8; 100],
        "left alone"
    );
}

#[test]
fn a_job_joins_its_ledger_wherever_it_is_before_making_one() {
    let base = scratch("split");
    let first = base.join("first");
    let second = base.join("second");
    std::fs::create_dir_all(&second).unwrap();
    let roots = [first.clone(), second.clone()];
    let mut in_the_way = Vec::new();
    // The first root is not usable: the first member makes the ledger in the second.
    let a = open_ledger(Ledger::Named("split"), &roots, &mut in_the_way)
        .unwrap()
        .expect("a place");
    // Now it is: a later member joins the ledger in the second, not a new one.
    std::fs::create_dir_all(&first).unwrap();
    let b = open_ledger(Ledger::Named("split"), &roots, &mut in_the_way)
        .unwrap()
        .expect("a place");
    assert_eq!(
        (a.dev, a.ino),
        (b.dev, b.ino),
        "one ledger: {} and {}",
        a.path,
        b.path
    );
}

#[test]
fn a_ledger_that_keeps_two_links_is_refused_not_passed_over() {
    let dir = scratch("links");
    drop(member_of(&dir));
    std::fs::hard_link(dir.join("ledger"), dir.join("other")).unwrap();
    match open_in(&Dir::open_trusted(&dir).unwrap(), "ledger") {
        Err(Failed::Refused(_, why)) => assert!(why.contains("hard links"), "{why}"),
        Err(Failed::Place(e)) => panic!("passed over: {e}"),
        Ok(_) => panic!("joined"),
    }
}

#[test]
fn leaving_twice_spares_a_newcomers_half_written_claim() {
    let job = fresh_job("leave-twice");
    job.charge(0, 100);
    job.leave();
    assert_eq!(job.used(0), 0);
    // A newcomer has stored its claim, not yet its seal.
    let c = job.claim_at(job.slot);
    let newcomer = u64::from(std::process::id()) | (99 << 32);
    c.claim.store(newcomer, Ordering::Release);
    job.leave();
    assert_eq!(
        c.claim.load(Ordering::Acquire),
        newcomer,
        "the newcomer's claim stays"
    );
}

#[test]
fn restoring_a_slot_spares_a_newcomers_half_written_claim() {
    let job = fresh_job("restore");
    // Our slot was freed (judged dead, say) and a newcomer is writing its claim there.
    let c = job.claim_at(job.slot);
    let newcomer = 1u64 | (99 << 32);
    c.claim.store(newcomer, Ordering::Release);
    job.charge(0, 100);
    assert_eq!(
        c.claim.load(Ordering::Acquire),
        newcomer,
        "the newcomer's claim stays"
    );
    assert!(job.is_damaged(), "our books are gone from the job");
}

#[test]
fn a_garbled_slot_of_a_dead_process_or_an_old_tombstone_is_cleaned_and_a_live_ones_stays() {
    let job = fresh_job("garbled");
    let me = std::process::id();
    // Died between its claim and its seal.
    plant(&job, 3, dead_pid(), 0, 0, 600);
    job.claim_at(3).seal.store(12345, Ordering::Release);
    // A live process's garbled slot.
    plant(&job, 4, me, 0, 0, 100);
    job.claim_at(4).seal.store(12345, Ordering::Release);
    // A tombstone a live process never finished.
    plant(&job, 5, me, 0, 0, 50);
    let c = job.claim_at(5);
    let tomb = TOMB | u64::from(me);
    c.claim.store(tomb, Ordering::Release);
    c.seal.store(seal(tomb, 0, u32::MAX), Ordering::Release);
    // A garbled slot of a process whose pid now names another (a different start time).
    let other_start = start_time(me).unwrap() + 1;
    plant(&job, 6, me, other_start, 0, 20);
    job.claim_at(6).seal.store(12345, Ordering::Release);
    job.reclaim_dead();
    assert_eq!(job.used(0), 770, "not at once");
    std::thread::sleep(Duration::from_millis(SUSPECT_MS + 100));
    job.reclaim_dead();
    assert_eq!(job.used(0), 100, "the live one's share stays");
    assert_eq!(job.claim_at(3).claim.load(Ordering::Acquire), 0);
    assert_eq!(job.claim_at(5).claim.load(Ordering::Acquire), 0);
    assert_eq!(job.claim_at(6).claim.load(Ordering::Acquire), 0);
}

#[test]
fn a_stray_share_in_a_free_slot_is_cleaned_after_a_while_and_counts_until_then() {
    let job = fresh_job("stray-share");
    let s = job.share_at(9, 0);
    s.used.store(500, Ordering::SeqCst);
    s.inv.store(!500, Ordering::SeqCst);
    job.reclaim_dead();
    assert_eq!(
        job.used(0),
        500,
        "not at once: it may be a member's wiped claim"
    );
    std::thread::sleep(Duration::from_millis(SUSPECT_MS + 100));
    job.reclaim_dead();
    assert_eq!(job.used(0), 0);
}

#[test]
fn a_sigbus_sent_by_kill_still_kills_when_nothing_handled_it_before() {
    let _forks = forks_apart();
    // SAFETY: the child only makes system calls and _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: in the (single-threaded) child: the old action is the default one,
        // our handler is installed over it, and SIGBUS is sent by kill.
        unsafe {
            libc::close(1);
            libc::close(2);
            let no_core = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::setrlimit(libc::RLIMIT_CORE, &no_core);
            let dfl: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            (*OLD_SIGBUS.0.get()).write(dfl);
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO;
            libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
            libc::kill(libc::getpid(), libc::SIGBUS);
            libc::_exit(0);
        }
    }
    let mut status = 0;
    // SAFETY: our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(
        libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGBUS,
        "status {status:#x}"
    );
}

/// Whether `dir` names a ledger now, and which file.
fn named(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(dir.join("ledger"))
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

#[test]
fn the_last_member_to_leave_removes_the_ledger_and_an_earlier_one_does_not() {
    let dir = scratch("removed");
    let first = member_of(&dir);
    let second = member_of(&dir);
    assert_eq!(
        (first.dev, first.ino),
        (second.dev, second.ino),
        "one ledger"
    );
    first.leave();
    assert!(named(&dir).is_some(), "a member remains");
    second.leave();
    assert_eq!(named(&dir), None, "the last member removed it");
    // The next member of the job makes a fresh one, with nothing held.
    let next = member_of(&dir);
    assert_eq!(named(&dir), Some((next.dev, next.ino)));
    assert_eq!(next.used(0), 0);
}

#[test]
fn a_ledger_with_a_claimed_slot_but_no_other_open_is_not_removed() {
    // A live member of a library that takes no lock (an older release) holds a slot:
    // the last locked member leaves the ledger in place.
    let dir = scratch("unlocked-member");
    let job = member_of(&dir);
    let me = std::process::id();
    plant_fd(
        &job,
        9,
        me,
        start_time(me).unwrap(),
        job.fd.as_raw_fd() as u32,
    );
    job.leave();
    assert!(named(&dir).is_some(), "the slot's member is alive");
}

#[test]
fn a_damaged_ledger_stays_when_its_last_member_leaves() {
    let dir = scratch("damaged-stays");
    let job = member_of(&dir);
    job.mark_damaged("a test".to_string());
    job.leave();
    assert!(named(&dir).is_some(), "left for its operator");
}

#[test]
fn a_process_joining_while_the_last_member_leaves_is_in_the_ledger_that_the_name_keeps() {
    // Joins racing the last member's leave end either in the ledger that stays named or
    // in a new one: never in a removed file that a later member could not find.
    let dir = scratch("join-leave-race");
    for round in 0..300 {
        let leaver = member_of(&dir);
        let joiner = std::thread::scope(|s| {
            let joining = s.spawn(|| member_of(&dir));
            leaver.leave();
            joining.join().unwrap()
        });
        assert_eq!(
            named(&dir),
            Some((joiner.dev, joiner.ino)),
            "round {round}: the joiner's ledger is the one named"
        );
        joiner.leave();
        assert_eq!(
            named(&dir),
            None,
            "round {round}: removed by its last member"
        );
    }
}

/// Sets the job's budget on `device` as `cudabudget limit --job` does: the budget's
/// words, then the generation.
fn change_budget(job: &Job, device: usize, bytes: u64) {
    let at = layout::budget_at(device);
    let word = layout::encode_budget(bytes);
    job.word64(at).store(word, Ordering::SeqCst);
    job.word64(at + 8).store(!word, Ordering::SeqCst);
    job.word64(layout::BUDGET_GENERATION_AT)
        .fetch_add(1, Ordering::SeqCst);
}

#[test]
fn admissions_racing_budget_changes_never_pass_the_budget_in_force_during_them() {
    // Four threads admit and release random sizes while a fifth moves the job's budget
    // among 300, 600 and 1000 bytes. Each admitted request, counted with every other
    // one still held, stays within the largest budget in force at some moment between
    // the start of its admission and its count (generation g's value is written before
    // the generation becomes g).
    let job = fresh_job("budget-race");
    let values = [1000u64, 600, 300];
    change_budget(&job, 0, values[0]);
    let log: Vec<AtomicU64> = (0..100_000).map(|_| AtomicU64::new(0)).collect();
    log[1].store(values[0], Ordering::SeqCst);
    let held = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let admitted = AtomicU64::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut rng = Rng(0x5eed);
            while !stop.load(Ordering::Relaxed) {
                let next = job.budget_generation() as usize + 1;
                if next >= log.len() {
                    break;
                }
                let value = values[(rng.next() % 3) as usize];
                log[next].store(value, Ordering::SeqCst);
                change_budget(&job, 0, value);
                std::thread::yield_now();
            }
        });
        let admitters: Vec<_> = (0..4u64)
            .map(|t| {
                let (job, log, held, admitted) = (&job, &log, &held, &admitted);
                s.spawn(move || {
                    let mut rng = Rng(t + 1);
                    for _ in 0..5000 {
                        let bytes = 1 + rng.next() % 200;
                        let g0 = job.budget_generation() as usize;
                        if job.reserve(0, bytes, u64::MAX).is_err() {
                            continue;
                        }
                        let counted = held.fetch_add(bytes, Ordering::SeqCst) + bytes;
                        let g1 = job.budget_generation() as usize;
                        let allowed = (g0..=g1 + 1)
                            .map(|g| log[g.min(log.len() - 1)].load(Ordering::SeqCst))
                            .max()
                            .unwrap();
                        let allowed = if allowed == 0 { 1000 } else { allowed };
                        assert!(
                            counted <= allowed,
                            "{counted} held past {allowed} (generations {g0}..={g1})"
                        );
                        admitted.fetch_add(1, Ordering::Relaxed);
                        held.fetch_sub(bytes, Ordering::SeqCst);
                        job.release(0, bytes);
                    }
                })
            })
            .collect();
        for admitter in admitters {
            admitter.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(
        admitted.load(Ordering::Relaxed) >= 1000,
        "few admissions: a test of nothing"
    );
}

#[test]
fn each_device_of_a_job_keeps_a_budget_of_its_own() {
    let job = fresh_job("per-device-budget");
    assert_eq!(job.budget(1), None, "none set yet");
    assert_eq!(job.adopt_budget(1, 500), 500, "the first member sets it");
    assert_eq!(job.budget(0), None, "device 0 is another device");
    assert_eq!(job.adopt_budget(0, 700), 700);
    assert_eq!(
        job.adopt_budget(1, 900),
        500,
        "a later member is held to the job's"
    );
    change_budget(&job, 1, 300);
    assert_eq!((job.budget(0), job.budget(1)), (Some(700), Some(300)));
    assert_eq!(
        job.reserve(1, 301, u64::MAX),
        Err(0),
        "device 1's budget holds"
    );
    assert_eq!(job.reserve(0, 301, u64::MAX), Ok(()));
}

#[test]
fn who_changed_the_budget_reads_back_as_the_command_line_writes_it() {
    let job = fresh_job("changed-by");
    job.word64(layout::BUDGET_BY_AT)
        .store((1234u64 << 32) | 5678, Ordering::SeqCst);
    assert_eq!(job.budget_changed_by(), (1234, 5678));
}

/// Held by the tests that fork a child of this process and by those that close an open
/// and then expect its lock gone: a child forked meanwhile (by another test, on another
/// thread) would keep a copy of that open, and its lock, for as long as it lives.
fn forks_apart() -> std::sync::MutexGuard<'static, ()> {
    static FORKS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    FORKS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// An open of `dir`'s ledger, as a member of another pod keeps it, holding slot `slot`'s
/// liveness lock until it is dropped.
fn another_pod_holding(dir: &Path, slot: usize) -> std::fs::File {
    let pod = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("ledger"))
        .unwrap();
    assert_eq!(liveness::take(pod.as_fd(), slot), liveness::Taken::Yes);
    pod
}

#[test]
fn a_member_whose_pid_names_nobody_here_lives_while_it_holds_its_slots_lock() {
    let _forks = forks_apart();
    // A member of another PID namespace: its pid means nothing here, its lock does.
    let dir = scratch("pod");
    let job = member_of(&dir);
    plant(&job, 9, dead_pid(), 1, 0, 600);
    let pod = another_pod_holding(&dir, 9);
    job.reclaim_dead();
    assert_eq!(job.used(0), 600, "alive while its lock is held");
    assert_eq!(job.reserve(0, 500, 1000), Err(600));
    drop(pod);
    assert_eq!(
        job.reserve(0, 500, 1000),
        Ok(()),
        "dead once its open is closed"
    );
    assert_eq!(job.used(0), 500);
}

#[test]
fn a_joining_process_holds_its_slots_lock_and_gives_it_back_when_it_leaves() {
    let _forks = forks_apart();
    let dir = scratch("own-lock");
    let job = member_of(&dir);
    let reader = std::fs::File::open(dir.join("ledger")).unwrap();
    assert_eq!(liveness::held(reader.as_fd(), job.slot), Some(true));
    let slot = job.slot;
    job.leave();
    assert_eq!(liveness::held(reader.as_fd(), slot), Some(false));
}

#[test]
fn a_member_whose_program_reused_its_descriptor_still_asks_the_kernel_through_its_lock() {
    let _forks = forks_apart();
    // The program closed our main descriptor and reused the number: the other members'
    // locks are asked through our own lock's open, never judged by pid (another pod's
    // pid names nothing here).
    let dir = scratch("reused-main");
    let job = member_of(&dir);
    plant(&job, 9, dead_pid(), 1, 0, 600);
    let pod = another_pod_holding(&dir, 9);
    let other = std::fs::File::open("/dev/null").unwrap();
    // SAFETY: replaces the number our Job keeps with /dev/null, as a program might.
    assert!(unsafe { libc::dup2(other.as_raw_fd(), job.fd.as_raw_fd()) } >= 0);
    job.reclaim_dead();
    assert_eq!(job.used(0), 600, "alive while its lock is held");
    drop(pod);
    job.reclaim_dead();
    assert_eq!(job.used(0), 0, "dead once its open is closed");
}

#[test]
fn a_ledger_made_in_a_better_place_meanwhile_is_the_jobs_and_the_next_join_takes_it() {
    // Another user plants the first name, a member makes the ledger under the next one,
    // the planted name goes and a second member makes one under the first name: the
    // first name's is the job's (every member moves there before it allocates).
    if place::euid() != 0 {
        eprintln!("skipped: needs root to give a directory to another user");
        return;
    }
    let root = scratch("better-place");
    std::fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o1777)).unwrap();
    let planted = root.join(place::user_dir_name(0));
    std::fs::create_dir(&planted).unwrap();
    std::os::unix::fs::chown(&planted, Some(54321), Some(54321)).unwrap();
    let roots = vec![root.clone()];
    let ledger = Ledger::Named("better");
    let mut said = Vec::new();
    let first = open_ledger(ledger, &roots, &mut said).unwrap().unwrap();
    assert!(first.path().contains("cudabudget-0.1/"), "{}", first.path());
    assert!(!better_ledger_exists(ledger, &roots, &first));

    std::fs::remove_dir(&planted).unwrap();
    let mine = Dir::open_trusted(&root)
        .unwrap()
        .private(&place::user_dir_name(0), 0o700)
        .unwrap();
    let Ok(second) = open_in(&mine, "job-better") else {
        panic!("a ledger under the first name");
    };
    assert!(better_ledger_exists(ledger, &roots, &first));
    assert!(!better_ledger_exists(ledger, &roots, &second));
    let third = open_ledger(ledger, &roots, &mut said).unwrap().unwrap();
    assert_eq!((third.dev, third.ino), (second.dev, second.ino));
}
