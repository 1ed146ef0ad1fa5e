//! `cudabudget limit`: shows or changes the budget of a job or a process while it runs.
//!
//! - A job's budget lives in its ledger ([`job_file::BUDGETS_AT`]): this command maps the
//!   ledger, writes the new budget (the word, then its complement), bumps the budget
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
use cudabudget_spec::job_file;
use cudabudget_spec::place::{self, Access, Create, Dir, FileOpen, PlaceError};
use cudabudget_spec::quantity::{Limit, format_bytes, parse_limit};

use crate::{Refusal, records, usage};

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
pub struct LimitArgs {
    /// The job (CUDABUDGET_SCOPE=job:NAME) whose budget to show or change.
    #[arg(long, value_name = "NAME", required_unless_present = "pid")]
    job: Option<String>,

    /// The budgeted process (not a job's member) whose budget to show or change.
    #[arg(long, value_name = "PID", conflicts_with = "job")]
    pid: Option<u32>,

    /// Only this device (the ordinal the processes use); default: every budgeted one.
    #[arg(long, value_name = "N")]
    device: Option<u32>,

    /// As root: whose job it is (default: the one user with a job of that name).
    #[arg(long, value_name = "UID", requires = "job")]
    uid: Option<u32>,

    /// The Kubernetes namespace whose job it is: its directory in the job directory
    /// (`namespaces/NAMESPACE`, the webhook's mount for the namespace's pods).
    #[arg(long, value_name = "NAMESPACE", requires = "job")]
    namespace: Option<String>,

    /// The new budget: a size such as 20Gi or 512Mi (a percentage is not accepted here).
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

/// A job's ledger, mapped.
struct Ledger {
    base: *mut u8,
    path: PathBuf,
}

impl Drop for Ledger {
    fn drop(&mut self) {
        // SAFETY: our own mapping of FILE_BYTES, not used after this.
        unsafe { libc::munmap(self.base.cast(), job_file::FILE_BYTES) };
    }
}

impl Ledger {
    fn word64(&self, at: usize) -> &AtomicU64 {
        assert!(at.is_multiple_of(8) && at + 8 <= job_file::FILE_BYTES);
        // SAFETY: an aligned word inside the mapping, which lives as long as `self`
        // (shared memory: reached only through atomics).
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    fn word32(&self, at: usize) -> &AtomicU32 {
        assert!(at.is_multiple_of(4) && at + 4 <= job_file::FILE_BYTES);
        // SAFETY: as in word64.
        unsafe { &*(self.base.add(at) as *const AtomicU32) }
    }

    fn budget(&self, device: usize) -> Option<u64> {
        let at = job_file::budget_at(device);
        job_file::decode_budget(
            self.word64(at).load(Ordering::Acquire),
            self.word64(at + 8).load(Ordering::Acquire),
        )
    }

    /// What the job holds on `device`: each slot's share read as the library reads it
    /// (the larger of its two words).
    fn used(&self, device: usize) -> u64 {
        (0..job_file::SLOTS)
            .map(|slot| {
                let at = job_file::share_at(slot, device);
                job_file::share_value(
                    self.word64(at).load(Ordering::Acquire),
                    self.word64(at + 8).load(Ordering::Acquire),
                )
            })
            .fold(0u64, u64::saturating_add)
    }

    /// Processes that hold a slot.
    fn members(&self) -> usize {
        (0..job_file::SLOTS)
            .filter(|&slot| {
                job_file::is_member(
                    self.word64(job_file::claim_at(slot))
                        .load(Ordering::Acquire),
                )
            })
            .count()
    }

    fn set_budget(&self, device: usize, bytes: u64) {
        let at = job_file::budget_at(device);
        let word = job_file::encode_budget(bytes);
        self.word64(at).store(word, Ordering::SeqCst);
        self.word64(at + 8).store(!word, Ordering::SeqCst);
    }

    /// Wakes the job's waiters on `device`, as a free does.
    fn wake(&self, device: usize) {
        let word = self.word32(job_file::device_words_at(device) + job_file::WAKE_IN_DEVICE_WORD);
        word.fetch_add(1, Ordering::Release);
        // The waiters wait on the same file's word, shared, not privately.
        cudabudget_spec::futex::wake_all(word);
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
        for entry in dir.names(100_000).unwrap_or_default() {
            let Some(uid) = entry
                .to_str()
                .and_then(cudabudget_spec::record::uid_of_dir_name)
            else {
                continue;
            };
            if (me == 0 || uid == me)
                && let Ok(user) = dir.open_dir_of(&place::user_dir_name(uid), uid)
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
        let Ok(user) = dir.open_dir_of(&place::user_dir_name(uid), uid) else {
            continue;
        };
        let file = match user.open_file_of(&name, open, uid) {
            Ok(file) => file,
            Err(PlaceError::Io { error, .. }) if error.kind() == std::io::ErrorKind::NotFound => {
                continue;
            }
            Err(error) => return Err(refused(format!("job {job}: {error}"))),
        };
        let path = user.path().join(&name);
        let mut head = [0u8; job_file::HEADER_BYTES];
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let n = file.read_at(&mut head, 0).unwrap_or(0);
        if let Some(problem) = job_file::problem(&head[..n], len) {
            return Err(refused(format!(
                "job ledger {}: {problem}; nothing changed",
                path.display()
            )));
        }
        let prot = if write {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a shared mapping of FILE_BYTES of a file checked to be that long.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                job_file::FILE_BYTES,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(refused(format!(
                "job ledger {}: cannot map it: {}",
                path.display(),
                std::io::Error::last_os_error()
            )));
        }
        return Ok(Ledger {
            base: base.cast(),
            path,
        });
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
    let devices: Vec<usize> = match device {
        Some(d) => vec![d as usize],
        None => (0..job_file::DEVICES)
            .filter(|&d| ledger.budget(d).is_some())
            .collect(),
    };
    let Some(bytes) = size else {
        let mut shown = 0;
        for d in devices {
            let used = ledger.used(d);
            match ledger.budget(d) {
                Some(budget) => {
                    shown += 1;
                    println!(
                        "job {job} device {d}: budget {}, {} in use{}",
                        format_bytes(budget),
                        format_bytes(used),
                        if used > budget {
                            " (over its budget)"
                        } else {
                            ""
                        }
                    );
                }
                None => println!("job {job} device {d}: no budget set yet"),
            }
        }
        if shown == 0 && device.is_none() {
            println!("job {job}: no budget set yet (its members have not allocated)");
        }
        println!(
            "job {job}: {} members; ledger {}",
            ledger.members(),
            ledger.path.display()
        );
        return Ok(ExitCode::SUCCESS);
    };
    // With no device named and none set yet: every device.
    let devices = if devices.is_empty() {
        (0..job_file::DEVICES).collect()
    } else {
        devices
    };
    let before: Vec<Option<u64>> = devices.iter().map(|&d| ledger.budget(d)).collect();
    for &d in &devices {
        ledger.set_budget(d, bytes);
    }
    ledger.word64(job_file::BUDGET_BY_AT).store(
        (u64::from(me) << 32) | u64::from(std::process::id()),
        Ordering::SeqCst,
    );
    ledger
        .word64(job_file::BUDGET_GENERATION_AT)
        .fetch_add(1, Ordering::SeqCst);
    for &d in &devices {
        ledger.wake(d);
    }
    ring_doorbells(uid);
    for (&d, previous) in devices.iter().zip(before) {
        if previous.is_none() && device.is_none() {
            continue;
        }
        let used = ledger.used(d);
        println!(
            "job {job} device {d}: budget {} -> {}, {} in use{}",
            previous.map_or_else(|| "none".to_string(), format_bytes),
            format_bytes(bytes),
            format_bytes(used),
            if used > bytes {
                ": over it, new allocations are refused until the use drops below it"
            } else {
                ""
            }
        );
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
            if let Ok(user) = dir.open_dir_of(&place::user_dir_name(uid), uid) {
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
/// node, has another pid inside the pod.
fn record_identity(pid: u32) -> Option<(u32, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let inner = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
        .unwrap_or(pid);
    let link = std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok()?;
    let namespace = cudabudget_spec::record::namespace_inode(&link.to_string_lossy())?;
    Some((inner, namespace))
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
    let Some((inner, namespace)) = record_identity(pid) else {
        return Err(refused(format!("no process {pid}")));
    };
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
            println!(
                "pid {pid} device {}: budget {}, {} in use{}",
                d.ordinal,
                format_bytes(d.budget),
                format_bytes(d.used),
                if d.used > d.budget {
                    " (over its budget)"
                } else {
                    ""
                }
            );
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
            println!("pid {pid} ended");
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
                println!(
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
                );
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
        let Ok(user) = dir.open_dir_of(&place::user_dir_name(owner), owner) else {
            continue;
        };
        if user.stat_at(&record).is_err() {
            continue;
        }
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
