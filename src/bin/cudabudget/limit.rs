//! `cudabudget limit`: shows or changes the budget of a job or a process while it runs.
//!
//! - A job's budget lives in its ledger ([`job_file::BUDGETS_AT`]): this command reads
//!   the ledger as untrusted bytes (its owner may cut it at any moment), maps it only to
//!   write the new budget (the word, then its complement), bumps the budget
//!   generation, names who changed it, wakes the job's waiters and rings the owner's
//!   doorbells ([`Doorbell`]). Every admission of the job reads the budget as it is then; each
//!   member's views and record follow when its background thread wakes to the bell (at
//!   once), or at its next look (every 200 ms) if it published somewhere else.
//! - A process's budget is changed by a request file beside its record
//!   ([`control::LimitRequest`]); the doorbell there wakes its background thread to read
//!   it.
//!
//! Both places are in the owner's private directory (mode 0700): only the owner and root
//! reach them, which is who may change a budget. In Kubernetes a pod sees only its own
//! runtime directory and its namespace's job directory (the webhook's mounts), so
//! `limit` in a pod reaches that pod's processes and that namespace's jobs; root on the
//! node reaches every pod's (`pods/<pod uid>` of the runtime directory) and every
//! namespace's jobs (`namespaces/<namespace>` of the job directory; `--namespace` names
//! one where a job's name is in several).

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use cudabudget_spec::config::Config;
use cudabudget_spec::control::{self, LimitRequest};
use cudabudget_spec::doorbell::Doorbell;
use cudabudget_spec::job_file::{self, Words};
use cudabudget_spec::place::{self, Access, Create, Dir, FileOpen, PlaceError};
use cudabudget_spec::quantity::{Limit, format_bytes, parse_limit};

use cudabudget_cli_common::records;
use cudabudget_cli_common::tell::{Refusal, ZERO_BUDGET, outln, usage};

pub const AFTER_HELP: &str = "Without SIZE, prints the budget in force; with it, changes \
it while the job or process runs. A job's budget is its ledger's (the first member's \
CUDABUDGET_LIMIT until changed here): every member's next admission is measured against \
the new value, and each member's views (cuMemGetInfo, NVML) and record (status, the \
exporter) follow at once (within 200 ms at most). A process's own budget is changed by a \
request its library reads at once. Only the job's or process's owner, or root, may change it.

Lowering a budget below what is in use frees nothing: new allocations are refused (or \
wait, under CUDABUDGET_ON_EXCEED=wait:<duration>) until the use drops below it, and \
status shows the job or process over its budget. Raising it wakes waiters at once. Each \
change is an event (\"outcome\":\"budget_changed\") in every member's CUDABUDGET_EVENTS.

On a Kubernetes node, root reaches the jobs of every namespace in the job directory \
(CUDABUDGET_JOB_DIR=/run/cudabudget/jobs): name the namespace with --namespace where \
two namespaces have a job of that name.

Examples:
  cudabudget limit --job train 20Gi
  cudabudget limit --job train --namespace ml 20Gi
  cudabudget limit --job train --device 1 8Gi
  cudabudget limit --job train
  cudabudget limit --pid 4242 40Gi";

#[derive(Args)]
#[command(group(clap::ArgGroup::new("whose").required(true).args(["job", "pid"])))]
pub struct LimitArgs {
    /// The job (CUDABUDGET_SCOPE=job:NAME) whose budget to show or change.
    #[arg(long, value_name = "NAME")]
    job: Option<String>,

    /// The budgeted process (not a job's member) whose budget to show or change.
    #[arg(long, value_name = "PID")]
    pid: Option<u32>,

    /// Only this device (the ordinal the processes use); default: every budgeted one.
    #[arg(long, value_name = "N")]
    device: Option<u32>,

    /// As root: whose job it is (default: the one user with a job of that name).
    #[arg(long, value_name = "UID", conflicts_with = "pid")]
    uid: Option<u32>,

    /// The Kubernetes namespace whose job it is: its directory in the job directory
    /// (`namespaces/NAMESPACE`, the webhook's mount for the namespace's pods).
    #[arg(long, value_name = "NAMESPACE", conflicts_with = "pid")]
    namespace: Option<String>,

    /// The new budget: a size such as 20Gi or 512Mi (not 0, nor a percentage).
    size: Option<String>,
}

/// A refusal that is not a usage error: the change was not made.
fn refused(message: impl Into<String>) -> Refusal {
    Refusal {
        message: message.into(),
        status: 1,
    }
}

pub fn limit(args: LimitArgs) -> Result<ExitCode, Refusal> {
    // A bad CUDABUDGET_RUNTIME_DIR is said, not passed over for the default places.
    records::runtime_dirs_as_set().map_err(usage)?;
    if args.device.is_some_and(|d| d as usize >= job_file::DEVICES) {
        return Err(usage(format!(
            "--device {}: devices are numbered 0 to {}",
            args.device.unwrap_or(0),
            job_file::DEVICES - 1
        )));
    }
    let size = match args.size.as_deref() {
        None => None,
        Some(text) => match parse_limit(text) {
            Ok(Limit::Bytes(0)) => {
                return Err(usage(format!(
                    "{text:?}: {ZERO_BUDGET}; give a size such as 8Gi (one under what is in \
                     use already refuses every new allocation until the use drops below it)"
                )));
            }
            Ok(Limit::Bytes(bytes)) => Some(bytes),
            Ok(Limit::Percent(_)) => {
                return Err(usage(format!(
                    "{text}: give a size (20Gi, 512Mi); a percentage of a running job's \
                     devices is not accepted here"
                )));
            }
            Err(error) => return Err(usage(format!("{text:?} is not a size: {error}"))),
        },
    };
    match (&args.job, args.pid) {
        (Some(job), _) => job_limit(job, args.uid, args.namespace.as_deref(), args.device, size),
        (None, Some(pid)) => process_limit(pid, args.device, size),
        (None, None) => Err(usage("name a --job or a --pid")),
    }
}

// ---- a job ----

/// A job's ledger, open. Its owner can shrink or grow the file at any moment, so it is
/// read as untrusted bytes: `pread` into a buffer ([`Ledger::read`]), never through a
/// mapping, which would raise SIGBUS at a page past the new end. A change needs the
/// shared mapping (the budget words are stored, the generation bumped and the waiters
/// woken atomically, where the members read them): [`Ledger::write`] maps it for those
/// few stores only, under [`cut_guard::Guard`], which catches a SIGBUS in that mapping
/// and reports the ledger cut instead of dying.
struct Ledger {
    file: std::fs::File,
    path: PathBuf,
}

/// The ledger's bytes, read at one moment: figures to show. A word a member changes
/// during the read may be seen mid-change; each figure has its complement beside it, so
/// a budget read that way shows as not set and a share as the larger of its two words.
struct Snapshot(Vec<u8>);

impl job_file::Words for Snapshot {
    fn word64(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.0[at..at + 8].try_into().expect("8 bytes"))
    }
}

impl Ledger {
    /// The ledger's bytes now, checked to be a ledger of this layout. A file cut or
    /// grown meanwhile is a refusal that names it and ends with `then` (what became of
    /// the change).
    fn read(&self, then: &str) -> Result<Snapshot, Refusal> {
        let mut bytes = vec![0u8; job_file::FILE_BYTES];
        let mut got = 0;
        while got < bytes.len() {
            match self.file.read_at(&mut bytes[got..], got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(refused(format!(
                        "job ledger {}: cannot read it: {e}; {then}",
                        self.path.display()
                    )));
                }
            }
        }
        let len = if got < bytes.len() {
            got as u64
        } else {
            self.file.metadata().map_or(got as u64, |m| m.len())
        };
        if let Some(problem) = job_file::problem(&bytes[..got], len) {
            return Err(refused(format!(
                "job ledger {}: {problem}; {then}",
                self.path.display()
            )));
        }
        Ok(Snapshot(bytes))
    }

    /// Sets the budget of `devices` to `bytes`, names `by` (uid << 32 | pid) as who did
    /// it, bumps the budget generation and wakes each device's waiters, through the
    /// shared mapping. A ledger cut meanwhile is a refusal: the change may be lost.
    fn write(&self, devices: &[usize], bytes: u64, by: u64) -> Result<(), Refusal> {
        // SAFETY: a new shared mapping of FILE_BYTES of our descriptor; nothing else in
        // this process refers to it. The file may be shorter by now: every access
        // below happens under the guard, which turns SIGBUS into a report.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                job_file::FILE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(refused(format!(
                "job ledger {}: cannot map it: {}; nothing changed",
                self.path.display(),
                std::io::Error::last_os_error()
            )));
        }
        let guard = cut_guard::Guard::new(base.cast(), job_file::FILE_BYTES);
        let word64 = |at: usize| {
            assert!(at.is_multiple_of(8) && at + 8 <= job_file::FILE_BYTES);
            // SAFETY: an aligned word inside the mapping, which lives until the munmap
            // below (shared memory: reached only through atomics).
            unsafe { &*(base.cast::<u8>().add(at) as *const AtomicU64) }
        };
        for &d in devices {
            let at = job_file::budget_at(d);
            let word = job_file::encode_budget(bytes);
            word64(at).store(word, Ordering::SeqCst);
            word64(at + 8).store(!word, Ordering::SeqCst);
        }
        word64(job_file::BUDGET_BY_AT).store(by, Ordering::SeqCst);
        word64(job_file::BUDGET_GENERATION_AT).fetch_add(1, Ordering::SeqCst);
        for &d in devices {
            let at = job_file::device_words_at(d) + job_file::WAKE_IN_DEVICE_WORD;
            assert!(at.is_multiple_of(4) && at + 4 <= job_file::FILE_BYTES);
            // SAFETY: as for word64.
            let word = unsafe { &*(base.cast::<u8>().add(at) as *const AtomicU32) };
            word.fetch_add(1, Ordering::Release);
            // The waiters wait on the same file's word, shared, not privately.
            cudabudget_spec::futex::wake_all(word);
        }
        let cut = guard.cut();
        drop(guard);
        // SAFETY: our own mapping of FILE_BYTES (or the private pages the guard put in
        // its place), not used after this.
        unsafe { libc::munmap(base, job_file::FILE_BYTES) };
        if cut {
            return Err(refused(format!(
                "job ledger {}: it was cut (truncated) while the budget was written; the \
                 change may be lost: look with `cudabudget limit --job` and try again",
                self.path.display()
            )));
        }
        Ok(())
    }
}

/// Catches the SIGBUS of a store into a shared mapping whose file was cut.
///
/// Why a handler rather than another design: the budget change must be atomic stores
/// and a futex wake on the words the members map (`pwrite` is neither atomic per word
/// nor able to bump a counter or wake a waiter), and nothing stops the owner from
/// truncating the file while root writes. So the stores go through the mapping, and a
/// fault in it is repaired in place: the handler maps private zero pages over the whole
/// mapping (the faulting store then lands where nobody reads it) and records that the
/// ledger was cut, which the command reports. A SIGBUS anywhere else keeps its default
/// action. One guard lives at a time in the process (a second waits for the first to
/// go), since the handler and its range are the process's.
mod cut_guard {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Mutex, MutexGuard};

    /// Held for a guard's life: the disposition and the range are one per process.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    static BASE: AtomicUsize = AtomicUsize::new(0);
    static LEN: AtomicUsize = AtomicUsize::new(0);
    static CUT: AtomicBool = AtomicBool::new(false);

    /// While it lives, a SIGBUS in `[base, base + len)` replaces that mapping with
    /// private zero pages and is remembered ([`Guard::cut`]).
    pub struct Guard {
        previous: libc::sigaction,
        _alone: MutexGuard<'static, ()>,
    }

    impl Guard {
        pub fn new(base: *mut u8, len: usize) -> Guard {
            let alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
            CUT.store(false, Ordering::SeqCst);
            LEN.store(len, Ordering::SeqCst);
            BASE.store(base as usize, Ordering::SeqCst);
            // SAFETY: all-zero sigaction structs are valid plain C values; the handler
            // is an extern "C" function of the signature SA_SIGINFO asks for.
            let previous = unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
                action.sa_flags = libc::SA_SIGINFO;
                libc::sigemptyset(&mut action.sa_mask);
                let mut previous: libc::sigaction = std::mem::zeroed();
                libc::sigaction(libc::SIGBUS, &action, &mut previous);
                previous
            };
            Guard {
                previous,
                _alone: alone,
            }
        }

        /// Whether the mapping faulted (its file was cut) since the guard was made.
        pub fn cut(&self) -> bool {
            CUT.load(Ordering::SeqCst)
        }
    }

    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: puts back the disposition saved in `new`.
            unsafe { libc::sigaction(libc::SIGBUS, &self.previous, std::ptr::null_mut()) };
            BASE.store(0, Ordering::SeqCst);
        }
    }

    extern "C" fn on_sigbus(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
        // SAFETY: the kernel passes a valid siginfo_t with SA_SIGINFO; si_addr is the
        // faulting address for SIGBUS.
        let addr = unsafe { (*info).si_addr() } as usize;
        let (base, len) = (BASE.load(Ordering::SeqCst), LEN.load(Ordering::SeqCst));
        if base != 0 && (base..base + len).contains(&addr) {
            // SAFETY: replaces our own mapping (the guard's range, which nothing else
            // in this process uses) with private anonymous pages at the same address;
            // mmap is a plain system call, safe in a signal handler.
            let placed = unsafe {
                libc::mmap(
                    base as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if placed != libc::MAP_FAILED {
                CUT.store(true, Ordering::SeqCst);
                return;
            }
        }
        // Not ours: the default action, once this handler returns.
        // SAFETY: signal and raise are async-signal-safe.
        unsafe {
            libc::signal(libc::SIGBUS, libc::SIG_DFL);
            libc::raise(libc::SIGBUS);
        }
    }
}

/// The places job ledgers may be, from this environment.
fn job_roots() -> Vec<PathBuf> {
    let relevant = std::env::vars_os().filter(|(name, _)| {
        name == cudabudget_spec::config::JOB_DIR || name == "XDG_RUNTIME_DIR" || name == "HOME"
    });
    Config::from_vars_os(relevant)
        .map(|config| config.job_dirs)
        .unwrap_or_else(|_| vec![PathBuf::from(cudabudget_spec::config::DEFAULT_SHARED_DIR)])
}

/// The namespaces' job directories (`namespaces/*` of each root, the webhook's), with
/// their names; only `namespace`'s when one is named.
fn namespace_roots(roots: &[PathBuf], namespace: Option<&str>) -> Vec<(String, PathBuf)> {
    let mut found = Vec::new();
    for root in roots {
        let Ok(dir) = Dir::open_trusted(root) else {
            continue;
        };
        let mut skipped = Vec::new();
        for (name, space) in records::tenant_dirs(&dir, records::NAMESPACES, &mut skipped) {
            if namespace.is_none_or(|wanted| wanted == name) {
                found.push((name, space.path().to_path_buf()));
            }
        }
    }
    found
}

/// Each (root, user) whose directory holds a ledger of `job` (as root: every user's).
fn places_of(job: &str, roots: &[PathBuf]) -> Vec<(PathBuf, u32)> {
    let name = format!("job-{job}");
    let me = place::euid();
    let mut places = Vec::new();
    for root in roots {
        let Ok(dir) = Dir::open_trusted(root) else {
            continue;
        };
        let ours =
            |n: &[u8]| std::str::from_utf8(n).is_ok_and(|n| place::uid_of_dir_name(n).is_some());
        for entry in dir.names_where(100_000, ours).unwrap_or_default() {
            let Some(uid) = entry.to_str().and_then(place::uid_of_dir_name) else {
                continue;
            };
            if (me == 0 || uid == me)
                && let Ok(user) = dir.open_dir_of(entry.to_str().unwrap_or_default(), uid)
                && user.stat_at(&name).is_ok()
                && !places.contains(&(root.clone(), uid))
            {
                places.push((root.clone(), uid));
            }
        }
    }
    places
}

fn open_job(job: &str, uid: u32, roots: &[PathBuf], write: bool) -> Result<Ledger, Refusal> {
    let name = format!("job-{job}");
    let open = FileOpen {
        access: if write {
            Access::ReadWrite
        } else {
            Access::Read
        },
        create: Create::No,
        mode: 0,
    };
    for root in roots {
        let Ok(dir) = Dir::open_trusted(root) else {
            continue;
        };
        let Some((user, file)) = place::user_dirs_of(&dir, uid)
            .into_iter()
            .map(|user| {
                let file = user.open_file_of(&name, open, uid);
                (user, file)
            })
            .find(|(_, file)| {
                !matches!(file, Err(PlaceError::Io { error, .. })
                    if error.kind() == std::io::ErrorKind::NotFound)
            })
        else {
            continue;
        };
        let file = file.map_err(|error| refused(format!("job {job}: {error}")))?;
        let path = user.path().join(&name);
        return Ok(Ledger { file, path });
    }
    Err(refused(if place::euid() == 0 || uid == place::euid() {
        format!("no job {job} here (no member has run since its last one ended)")
    } else {
        format!("no job {job} of uid {uid} that you may see")
    }))
}

fn job_limit(
    job: &str,
    uid: Option<u32>,
    namespace: Option<&str>,
    device: Option<u32>,
    size: Option<u64>,
) -> Result<ExitCode, Refusal> {
    let mut roots = job_roots();
    let spaces = namespace_roots(&roots, namespace);
    match namespace {
        Some(name) if spaces.is_empty() => {
            return Err(refused(format!(
                "no namespace {name} in the job directory ({}): its pods have run no job here",
                roots.first().map_or(String::new(), |r| r
                    .join(records::NAMESPACES)
                    .display()
                    .to_string())
            )));
        }
        Some(_) => roots = spaces.iter().map(|(_, path)| path.clone()).collect(),
        None => roots.extend(spaces.iter().map(|(_, path)| path.clone())),
    }
    let found = places_of(job, &roots);
    let me = place::euid();
    let uid = match uid {
        Some(uid) if uid != me && me != 0 => {
            return Err(refused(format!(
                "job {job} of uid {uid}: only its owner or root may see or change its budget"
            )));
        }
        Some(uid) => uid,
        None if me != 0 => me,
        None => {
            let mut uids: Vec<u32> = found.iter().map(|(_, uid)| *uid).collect();
            uids.sort_unstable();
            uids.dedup();
            match uids.as_slice() {
                [] => me,
                [one] => *one,
                many => {
                    return Err(usage(format!(
                        "job {job} exists for uids {}: name one with --uid",
                        many.iter()
                            .map(u32::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
            }
        }
    };
    // One name in two namespaces is two jobs: never changed together, never one chosen
    // silently.
    let in_spaces: Vec<&str> = spaces
        .iter()
        .filter(|(_, path)| found.contains(&(path.clone(), uid)))
        .map(|(name, _)| name.as_str())
        .collect();
    let places = found.iter().filter(|(_, u)| *u == uid).count();
    if !in_spaces.is_empty() && places > 1 {
        return Err(usage(format!(
            "job {job} of uid {uid} is in the job directories of several namespaces ({}{}): \
             name one with --namespace",
            in_spaces.join(", "),
            if places > in_spaces.len() {
                ", and the node's own"
            } else {
                ""
            }
        )));
    }
    let roots = with_fallbacks_of(uid, roots);
    let ledger = open_job(job, uid, &roots, size.is_some())?;
    let seen = ledger.read("nothing changed")?;
    let devices: Vec<usize> = match device {
        Some(d) => vec![d as usize],
        None => (0..job_file::DEVICES)
            .filter(|&d| seen.budget(d).is_some())
            .collect(),
    };
    let Some(bytes) = size else {
        let mut shown = 0;
        for d in devices {
            let used = seen.used(d);
            match seen.budget(d) {
                Some(budget) => {
                    shown += 1;
                    outln(format_args!(
                        "job {job} device {d}: budget {}, {} in use{}",
                        format_bytes(budget),
                        format_bytes(used),
                        if used > budget {
                            " (over its budget)"
                        } else {
                            ""
                        }
                    ))?;
                }
                None => outln(format_args!("job {job} device {d}: no budget set yet"))?,
            }
        }
        if shown == 0 && device.is_none() {
            outln(format_args!(
                "job {job}: no budget set yet (its members have not allocated)"
            ))?;
        }
        outln(format_args!(
            "job {job}: {} members; ledger {}",
            seen.members(),
            ledger.path.display()
        ))?;
        return Ok(ExitCode::SUCCESS);
    };
    // With no device named and none set yet: every device.
    let devices = if devices.is_empty() {
        (0..job_file::DEVICES).collect()
    } else {
        devices
    };
    let before: Vec<Option<u64>> = devices.iter().map(|&d| seen.budget(d)).collect();
    ledger.write(
        &devices,
        bytes,
        (u64::from(me) << 32) | u64::from(std::process::id()),
    )?;
    ring_doorbells(uid);
    let now = ledger.read("the new budget was written before it changed")?;
    for (&d, previous) in devices.iter().zip(before) {
        if previous.is_none() && device.is_none() {
            continue;
        }
        let used = now.used(d);
        outln(format_args!(
            "job {job} device {d}: budget {} -> {}, {} in use{}",
            previous.map_or_else(|| "none".to_string(), format_bytes),
            format_bytes(bytes),
            format_bytes(used),
            if used > bytes {
                ": over it, new allocations are refused until the use drops below it"
            } else {
                ""
            }
        ))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `roots` and, for another user, that user's own fallbacks (where its processes, which
/// saw its environment, may have put their files).
fn with_fallbacks_of(uid: u32, mut roots: Vec<PathBuf>) -> Vec<PathBuf> {
    if uid != place::euid()
        && let Some((_, home)) = records::passwd(uid)
    {
        roots.push(PathBuf::from(format!("/run/user/{uid}")));
        roots.push(home.join(".cache"));
    }
    roots
}

/// Rings the doorbell ([`Doorbell`]) of every records directory of `uid`'s: its processes look at
/// their budgets at once instead of at their next look.
fn ring_doorbells(uid: u32) {
    for root in with_fallbacks_of(uid, records::runtime_dirs()) {
        let Ok(dir) = Dir::open_trusted(&root) else {
            continue;
        };
        let mut skipped = Vec::new();
        let pods = records::tenant_dirs(&dir, records::PODS, &mut skipped);
        for dir in std::iter::once(dir).chain(pods.into_iter().map(|(_, pod)| pod)) {
            for user in place::user_dirs_of(&dir, uid) {
                ring(&user, uid);
            }
        }
    }
}

/// Rings the doorbell of `dir`, a records directory of `owner`'s, if it has one (a
/// process that has none looks at its next look).
fn ring(dir: &Dir, owner: u32) {
    if let Ok(bell) = Doorbell::open(dir, owner, false) {
        let _ = bell.ring();
    }
}

// ---- a process ----

/// The owner of process `pid` (its real uid), if it exists.
fn owner_of(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Process `pid` of this PID namespace as its record names it: its pid in its own
/// (innermost) PID namespace and that namespace's inode. A pod's process, seen from the
/// node, has another pid inside the pod. Why not, in words: gone, or its namespace
/// cannot be read (`/proc/PID/ns` asks for the right to trace the process).
fn record_identity(pid: u32) -> Result<(u32, u64), String> {
    let gone = |e: std::io::Error| format!("no process {pid} ({e})");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(gone)?;
    let inner = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
        .unwrap_or(pid);
    let path = format!("/proc/{pid}/ns/pid");
    let link = std::fs::read_link(&path)
        .map_err(|e| format!("process {pid}: cannot read its PID namespace ({path}: {e})"))?;
    let namespace = cudabudget_spec::record::namespace_inode(&link.to_string_lossy())
        .ok_or_else(|| format!("process {pid}: {path} is not a PID namespace"))?;
    Ok((inner, namespace))
}

/// Whether process `pid` runs (exists and is not a zombie).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|status| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("State:"))
            .is_some_and(|state| {
                !matches!(state.trim_start().as_bytes().first(), Some(b'Z' | b'X'))
            })
    })
}

fn process_limit(pid: u32, device: Option<u32>, size: Option<u64>) -> Result<ExitCode, Refusal> {
    let me = place::euid();
    let Some(owner) = owner_of(pid) else {
        return Err(refused(format!("no process {pid}")));
    };
    if owner != me && me != 0 {
        return Err(refused(format!(
            "process {pid} belongs to uid {owner}: only its owner or root may see or change \
             its budget"
        )));
    }
    let roots = records::runtime_dirs();
    let (inner, namespace) = record_identity(pid).map_err(refused)?;
    let find = || {
        records::scan(&roots).processes.into_iter().find(|shown| {
            shown.record.pid == inner
                && shown.record.pid_namespace == namespace
                && shown.uid == owner
        })
    };
    let Some(shown) = find() else {
        return Err(refused(format!(
            "process {pid} is not budgeted (it publishes no cudabudget record)"
        )));
    };
    if let Some(job) = &shown.record.job {
        return Err(refused(format!(
            "process {pid} is a member of job {job}: its budget is the job's (cudabudget \
             limit --job {job})"
        )));
    }
    let on = |d: &&cudabudget_spec::record::DeviceFigures| {
        device.is_none_or(|wanted| d.ordinal == wanted)
    };
    let Some(bytes) = size else {
        for d in shown.record.devices.iter().filter(on) {
            outln(format_args!(
                "pid {pid} device {}: budget {}, {} in use{}",
                d.ordinal,
                format_bytes(d.budget),
                format_bytes(d.used),
                if d.used > d.budget {
                    " (over its budget)"
                } else {
                    ""
                }
            ))?;
        }
        return Ok(ExitCode::SUCCESS);
    };
    if let Some(wanted) = device
        && !shown.record.devices.iter().any(|d| d.ordinal == wanted)
    {
        return Err(refused(format!(
            "process {pid} has no budget on device {wanted} (not budgeted there, or not used yet)"
        )));
    }
    let request = LimitRequest {
        device,
        bytes,
        by_uid: me,
        by_pid: std::process::id(),
    };
    write_request(
        &roots,
        owner,
        shown.record.pid,
        shown.record.pid_namespace,
        &request,
    )?;
    // Confirmed by the process's record (rewritten as soon as its budget changed).
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let now = find();
        if now.is_none() && !running(pid) {
            outln(format_args!("pid {pid} ended"))?;
            return Ok(ExitCode::SUCCESS);
        }
        let done = now.as_ref().is_some_and(|s| {
            s.record
                .devices
                .iter()
                .filter(on)
                .all(|d| d.budget == bytes)
        });
        if done || Instant::now() >= deadline {
            let shown = now.unwrap_or(shown);
            for d in shown.record.devices.iter().filter(on) {
                outln(format_args!(
                    "pid {pid} device {}: budget {}{}, {} in use{}",
                    d.ordinal,
                    format_bytes(d.budget),
                    if d.budget == bytes {
                        String::new()
                    } else {
                        format!(" (asked {}: not applied yet)", format_bytes(bytes))
                    },
                    format_bytes(d.used),
                    if d.used > d.budget {
                        ": over it, new allocations are refused until the use drops below it"
                    } else {
                        ""
                    }
                ))?;
            }
            return Ok(if done {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes `request` beside the record of `pid` (in its owner's directory): a new file
/// under a temporary name, then renamed over the request's name.
fn write_request(
    roots: &[PathBuf],
    owner: u32,
    pid: u32,
    namespace: u64,
    request: &LimitRequest,
) -> Result<(), Refusal> {
    let record = cudabudget_spec::record::file_name(pid, namespace);
    let name = control::file_name(pid, namespace);
    let temporary = format!(".{name}.{}.new", std::process::id());
    // The record is in a runtime root, or in a pod's own directory in one.
    let dirs = roots
        .iter()
        .filter_map(|root| Dir::open_trusted(root).ok())
        .flat_map(|dir| {
            let mut skipped = Vec::new();
            let pods = records::tenant_dirs(&dir, records::PODS, &mut skipped);
            std::iter::once(dir).chain(pods.into_iter().map(|(_, pod)| pod))
        });
    for dir in dirs {
        let Some(user) = place::user_dirs_of(&dir, owner)
            .into_iter()
            .find(|user| user.stat_at(&record).is_ok())
        else {
            continue;
        };
        let new = FileOpen {
            access: Access::ReadWrite,
            create: Create::New,
            mode: 0o600,
        };
        let written = user
            .open_file(&temporary, new)
            .map_err(|e| e.to_string())
            .and_then(|file| {
                // Root's request is given to the process's owner, who may read only its
                // own files (0600) there.
                // SAFETY: fchown of a descriptor we hold; -1 keeps the group.
                if place::euid() != owner
                    && unsafe { libc::fchown(file.as_raw_fd(), owner, u32::MAX) } != 0
                {
                    return Err(std::io::Error::last_os_error().to_string());
                }
                file.write_all_at(request.encode().as_bytes(), 0)
                    .map_err(|e| e.to_string())
            })
            .and_then(|()| user.rename(&temporary, &name).map_err(|e| e.to_string()));
        return match written {
            Ok(()) => {
                ring(&user, owner);
                Ok(())
            }
            Err(why) => {
                let _ = user.remove_file(&temporary);
                Err(refused(format!("cannot ask process {pid}: {why}")))
            }
        };
    }
    Err(refused(format!(
        "process {pid}'s record is gone (it ended?)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    /// A ledger of this layout in a file of its own, open to read and write.
    fn ledger(name: &str) -> Ledger {
        let path =
            std::env::temp_dir().join(format!("cb-limit-unit-{}-{name}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(job_file::FILE_BYTES as u64).unwrap();
        file.write_all_at(&job_file::header(), 0).unwrap();
        let _ = std::fs::remove_file(&path);
        Ledger { file, path }
    }

    #[test]
    fn a_budget_written_reads_back() {
        let ledger = ledger("whole");
        assert!(ledger.write(&[0, 3], 5 << 30, 7).is_ok());
        let Ok(seen) = ledger.read("nothing changed") else {
            panic!("a whole ledger reads");
        };
        assert_eq!(seen.budget(0), Some(5 << 30));
        assert_eq!(seen.budget(3), Some(5 << 30));
        assert_eq!(seen.budget(1), None);
        assert_eq!(seen.word64(job_file::BUDGET_BY_AT), 7);
        assert_eq!(seen.word64(job_file::BUDGET_GENERATION_AT), 1);
    }

    #[test]
    fn a_ledger_cut_before_the_write_is_reported_not_a_sigbus() {
        let ledger = ledger("cut");
        ledger.file.set_len(0).unwrap();
        let Err(refusal) = ledger.write(&[0], 1 << 30, 7) else {
            panic!("a cut ledger is written without a word");
        };
        assert!(
            refusal
                .message
                .contains("was cut (truncated) while the budget was written")
                && refusal.message.contains(ledger.path.to_str().unwrap()),
            "{}",
            refusal.message
        );
        let Err(refusal) = ledger.read("nothing changed") else {
            panic!("a cut ledger reads");
        };
        assert!(
            refusal.message.contains("0 bytes") && refusal.message.ends_with("nothing changed"),
            "{}",
            refusal.message
        );
        // The guard is gone with its write: the next one on a whole file works.
        let whole = self::ledger("after");
        assert!(whole.write(&[0], 1 << 30, 7).is_ok());
    }
}
