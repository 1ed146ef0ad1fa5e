//! The per-process record that `cudabudget status` and the exporter read.
//!
//! A budgeted process publishes its figures (per device: budget, in use, peak, denials,
//! waits; its pid, job, command and Kubernetes names) in one small file of its own,
//! `<runtime dir>/cudabudget-<uid>/<pid>-<pid namespace>.rec` (layout in [`record`]). The hooks are not
//! involved: a background thread started once the process is budgeted reads the ledger's
//! counters (relaxed loads) every [`INTERVAL`] and rewrites the record only when a figure
//! changed, or every [`HEARTBEAT`] so readers in another PID namespace can tell it is
//! alive. The record is therefore at most [`INTERVAL`] behind the books.
//!
//! The directory is our own private one ([`place::first_private`] over the
//! configuration's `runtime_dirs`: `CUDABUDGET_RUNTIME_DIR` or `/dev/shm`, then the
//! user's `$XDG_RUNTIME_DIR` and `$HOME/.cache`), mode 0700: only we can create, replace
//! or rename anything in it, and it shows nobody else our command lines. Readers are the
//! user's own `cudabudget status` and root's (the exporter runs as root and reads any
//! mode). When another user holds the name in the shared directory, the record goes to
//! the next place and one `info` line says where, and what was in the way.
//!
//! Every write goes through the directory's descriptor: a temporary file created new
//! (`O_EXCL`, no link followed), written whole, then renamed over the record
//! (`renameat`), so that readers never see half a record and nothing is ever reached
//! by a path resolved again.
//!
//! Everything this thread does is best effort: a directory it cannot trust or write, a
//! thread that cannot start, or anything else that fails leaves the process unpublished
//! (said at `info`), never disturbed. The record is removed at exit; records of processes
//! that died without exiting (`kill -9`) are cleaned by their readers.

use cudabudget_spec::doorbell::Doorbell;
pub use cudabudget_spec::{control, record};

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cudabudget_spec::place::{self, Access, Create, Dir, FileOpen};

use crate::books::ledger::Budget;
use crate::config::{Config, LogLevel, PodNames};
use control::LimitRequest;
use record::{DeviceFigures, Record};

/// How often the thread looks at the books.
pub const INTERVAL: Duration = Duration::from_millis(200);
/// How often the record is rewritten when nothing changed.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// The mode of our records directory: ours alone (see the module's comment).
const DIR_MODE: u32 = 0o700;

/// The process whose record [`RECORD`] is: a child of `fork()` is not its owner and must
/// not remove it at its exit.
static OWNER: AtomicU32 = AtomicU32::new(0);
/// The record's directory (held open for the process's life), its device and inode, and
/// the record's file name.
static RECORD: OnceLock<(Dir, (u64, u64), CString)> = OnceLock::new();

/// Whether `dir`'s descriptor still is the directory it was opened as. A program may
/// close descriptors it did not open (a daemon closes them all) and open others under
/// the same number: then nothing more is written or removed through it.
fn still_ours(dir: &Dir, identity: (u64, u64)) -> bool {
    place::fstat(dir.fd()).is_ok_and(|st| (st.st_dev, st.st_ino) == identity)
}

/// Publishes this process's figures until it ends, and calls `tick` every [`INTERVAL`]
/// and whenever the records directory's [`Doorbell`] rings: the body of the library's
/// background thread ([`crate::lifecycle`] starts it, once). `tick` follows the budgets
/// (`cudabudget limit`); true when one changed, which publishes the figures at once.
/// Without a record (none could be made, or it was lost) the budgets are still
/// followed, every [`INTERVAL`].
pub fn run(config: &Config, tick: fn() -> bool) {
    let _ = std::panic::catch_unwind(|| publish(config, tick));
    while std::panic::catch_unwind(tick).is_ok() {
        std::thread::sleep(INTERVAL);
    }
}

/// The name of this process's budget-change request ([`control`]), beside its record.
static CONTROL: OnceLock<CString> = OnceLock::new();

/// A budget-change request for this process (`cudabudget limit --pid`), when a new one
/// was written since the last call (each request is a new file), or why the file there
/// is not one. Only a file of ours counts (the directory is ours alone; root gives its
/// requests to us).
pub fn new_limit_request() -> Option<Result<LimitRequest, String>> {
    static SEEN: crate::sys::lock::Lock<Option<(u64, u64, i64, i64)>> =
        crate::sys::lock::Lock::new(None);
    let (dir, identity, _) = RECORD.get()?;
    let name = CONTROL.get()?.to_str().ok()?;
    if !still_ours(dir, *identity) {
        return None;
    }
    let st = dir.stat_at(name).ok()?;
    let key = (st.st_dev, st.st_ino, st.st_mtime, st.st_mtime_nsec);
    {
        let mut seen = SEEN.lock();
        if *seen == Some(key) {
            return None;
        }
        *seen = Some(key);
    }
    let open = FileOpen::READ;
    let file = dir.open_file_of(name, open, place::euid());
    let mut text = vec![0u8; 1024];
    let read = file
        .map_err(|e| e.to_string())
        .and_then(|f| f.read_at(&mut text, 0).map_err(|e| e.to_string()));
    Some(read.and_then(|n| {
        let text = std::str::from_utf8(&text[..n]).map_err(|_| "it is not text".to_string())?;
        LimitRequest::parse(text)
    }))
}

/// What the process is, read once from `/proc/self` and the configuration (the one
/// reader of the environment, at initialisation: never `environ` again, which the
/// program may be changing on another thread).
struct Identity {
    pid: u32,
    start_time: u64,
    pid_namespace: u64,
    command: String,
    labels: Labels,
}

/// The names a process is shown under besides its pid and command.
#[derive(Debug, Default, PartialEq, Eq)]
struct Labels {
    job: Option<String>,
    pod: Option<String>,
    namespace: Option<String>,
    container: Option<String>,
}

/// Where a pod's service account mount names the pod's namespace.
const SERVICE_ACCOUNT_NAMESPACE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

impl Labels {
    /// The job from the configuration ([`crate::config::Config::job`]); the Kubernetes
    /// names from its [`PodNames`]: the downward-API variables first and, inside a pod,
    /// the hostname (the pod's name) and the service account's namespace file
    /// (`namespace_file`).
    fn from_config(config: &Config, namespace_file: impl FnOnce() -> Option<String>) -> Labels {
        let names: &PodNames = &config.pod;
        let in_kubernetes = names.in_kubernetes;
        let pod = non_empty(names.pod_name.as_deref()).or_else(|| {
            in_kubernetes
                .then(|| non_empty(names.hostname.as_deref()))
                .flatten()
        });
        let namespace = non_empty(names.pod_namespace.as_deref()).or_else(|| {
            in_kubernetes
                .then(namespace_file)
                .flatten()
                .and_then(|n| non_empty(Some(&n)))
        });
        Labels {
            job: config.job().map(str::to_string),
            pod,
            namespace,
            container: non_empty(names.container_name.as_deref()),
        }
    }
}

fn non_empty(value: Option<&str>) -> Option<String> {
    value
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_string)
}

impl Identity {
    fn read(config: &Config) -> Identity {
        let cmdline = std::fs::read("/proc/self/cmdline").unwrap_or_default();
        let command = record::command_line(&cmdline);
        let start_time = std::fs::read("/proc/self/stat")
            .ok()
            .and_then(|stat| record::start_time_from_stat(&stat))
            .unwrap_or(0);
        let pid_namespace = std::fs::read_link("/proc/self/ns/pid")
            .ok()
            .and_then(|link| record::namespace_inode(&link.to_string_lossy()))
            .unwrap_or(0);
        let labels = Labels::from_config(config, || {
            std::fs::read_to_string(SERVICE_ACCOUNT_NAMESPACE).ok()
        });
        Identity {
            pid: std::process::id(),
            start_time,
            pid_namespace,
            command,
            labels,
        }
    }
}

/// Our records directory: the first of `roots` that gives one. When none does and a
/// fallback root is missing (a fresh `$HOME/.cache`), it is made (0700) and the roots
/// are tried again. Returns the directory and the one line that says what was in the
/// way before it, if anything was.
pub(crate) fn records_dir(roots: &[PathBuf]) -> (Option<Dir>, Option<String>) {
    let (mut dir, mut in_the_way) = place::first_private(roots, DIR_MODE);
    if dir.is_none() && roots.iter().skip(1).any(|root| !root.exists()) {
        for root in roots.iter().skip(1).filter(|root| !root.exists()) {
            use std::os::unix::fs::DirBuilderExt;
            let _ = std::fs::DirBuilder::new().mode(0o700).create(root);
        }
        (dir, in_the_way) = place::first_private(roots, DIR_MODE);
    }
    let why = (!in_the_way.is_empty()).then(|| {
        in_the_way
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    });
    (dir, why)
}

/// The temporary name a record is written under before it is renamed into place.
fn temporary_name(pid: u32, namespace: u64) -> String {
    format!(".{pid}-{namespace}.tmp")
}

/// Writes `buf` as the record `name`: a new temporary file, written whole, renamed over
/// the record. A temporary file left by an earlier process with our pid is ours (the
/// directory is) and replaced.
fn write_record(dir: &Dir, temporary: &str, name: &str, buf: &[u8]) -> io::Result<()> {
    const NEW: FileOpen = FileOpen {
        access: Access::ReadWrite,
        create: Create::New,
        mode: 0o600,
    };
    let file = match dir.open_file(temporary, NEW) {
        Ok(file) => file,
        Err(_) => {
            let _ = dir.remove_file(temporary);
            dir.open_file(temporary, NEW).map_err(io::Error::other)?
        }
    };
    let written = file.write_all_at(buf, 0);
    drop(file);
    match written.and_then(|()| dir.rename(temporary, name)) {
        Ok(()) => Ok(()),
        Err(error) => {
            let _ = dir.remove_file(temporary);
            Err(error)
        }
    }
}

extern "C" fn remove_record() {
    // SAFETY: getpid touches no memory.
    let pid = unsafe { libc::getpid() } as u32;
    if OWNER.load(Ordering::Relaxed) != pid {
        return;
    }
    if let Some((dir, identity, name)) = RECORD.get() {
        if !still_ours(dir, *identity) {
            return;
        }
        // SAFETY: a live directory descriptor (held for the process's life) and
        // NUL-terminated names that live as long as the process.
        unsafe {
            libc::unlinkat(dir.fd().as_raw_fd(), name.as_ptr(), 0);
            if let Some(control) = CONTROL.get() {
                libc::unlinkat(dir.fd().as_raw_fd(), control.as_ptr(), 0);
            }
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The budgeted devices' figures, with the UUIDs found so far.
fn snapshot(uuids: &[Option<String>]) -> Vec<DeviceFigures> {
    crate::runtime::ledger()
        .devices()
        .filter_map(|(ordinal, d)| match d.budget() {
            Budget::Bytes(budget) => Some((ordinal, d, budget)),
            Budget::Unbudgeted | Budget::Unresolved => None,
        })
        .map(|(ordinal, d, budget)| DeviceFigures {
            ordinal: ordinal as u32,
            uuid: uuids.get(ordinal).cloned().flatten(),
            budget,
            used: d.used(),
            peak: d.peak(),
            denials: d.denials(),
            waits: d.waits(),
            overruns: d.overruns(),
        })
        .collect()
}

fn publish(config: &Config, tick: fn() -> bool) {
    let identity = Identity::read(config);
    let (dir, in_the_way) = records_dir(&config.runtime_dirs);
    let Some(dir) = dir else {
        crate::sys::log::line(
            LogLevel::Info,
            format_args!(
                "cannot publish this process's figures ({}); `cudabudget status` will not show it",
                in_the_way.as_deref().unwrap_or("no runtime directory")
            ),
        );
        return;
    };
    let name = record::file_name(identity.pid, identity.pid_namespace);
    let temporary = temporary_name(identity.pid, identity.pid_namespace);
    match &in_the_way {
        Some(why) => crate::sys::log::line(
            LogLevel::Info,
            format_args!(
                "this process's figures are published in {} ({why})",
                dir.path().display()
            ),
        ),
        None => crate::sys::log::line(
            LogLevel::Debug,
            format_args!("publishing figures in {}", dir.path().join(&name).display()),
        ),
    }
    let Ok(c_name) = CString::new(name.as_str()) else {
        return;
    };
    let Ok(st) = place::fstat(dir.fd()) else {
        return;
    };
    if let Ok(control) = CString::new(control::file_name(identity.pid, identity.pid_namespace)) {
        let _ = CONTROL.set(control);
    }
    if RECORD.set((dir, (st.st_dev, st.st_ino), c_name)).is_err() {
        return;
    }
    let Some((dir, dir_identity, _)) = RECORD.get() else {
        return;
    };
    OWNER.store(identity.pid, Ordering::Relaxed);
    let bell = match Doorbell::open(dir, place::euid(), true) {
        Ok(bell) => Some(bell),
        Err(error) => {
            crate::sys::log::line(
                LogLevel::Info,
                format_args!(
                    "budget changes reach this process within {} ms, not at once ({error})",
                    INTERVAL.as_millis()
                ),
            );
            None
        }
    };
    // SAFETY: registers a plain extern "C" function.
    unsafe {
        libc::atexit(remove_record);
    }

    let mut record = Record {
        pid: identity.pid,
        start_time: identity.start_time,
        pid_namespace: identity.pid_namespace,
        job: identity.labels.job,
        command: identity.command,
        pod: identity.labels.pod,
        namespace: identity.labels.namespace,
        container: identity.labels.container,
        ..Record::default()
    };
    let mut uuids: Vec<Option<String>> = vec![None; record::MAX_DEVICES];
    let mut last_uuid_try = None::<Instant>;
    let mut last_write = None::<Instant>;
    let mut buf = [0u8; record::SIZE];
    loop {
        let mut devices = snapshot(&uuids);
        let missing = devices.iter().any(|d| d.uuid.is_none());
        if missing && last_uuid_try.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            // The driver answers once the program has initialised CUDA.
            last_uuid_try = Some(Instant::now());
            for d in devices.iter_mut().filter(|d| d.uuid.is_none()) {
                let uuid = crate::sys::nvml::cuda_uuid(d.ordinal as usize);
                uuids[d.ordinal as usize].clone_from(&uuid);
                d.uuid = uuid;
            }
        }
        let due = last_write.is_none_or(|t| t.elapsed() >= HEARTBEAT);
        if due || devices != record.devices {
            record.devices = devices;
            record.sequence += 1;
            record.updated_ms = now_ms();
            record.encode(&mut buf);
            if !still_ours(dir, *dir_identity) {
                crate::sys::log::line(
                    LogLevel::Info,
                    format_args!(
                        "the program closed the descriptor of {}; this process's figures are no longer published",
                        dir.path().display()
                    ),
                );
                return;
            }
            if let Err(error) = write_record(dir, &temporary, &name, &buf) {
                crate::sys::log::line(
                    LogLevel::Info,
                    format_args!(
                        "cannot publish this process's figures in {} any more ({error}); `cudabudget status` will not show it",
                        dir.path().display()
                    ),
                );
                return;
            }
            last_write = Some(Instant::now());
        }
        // Until the next look at the books, follow the budgets whenever the bell rings
        // (the counter is read before `tick` looks, so a ring meanwhile is not slept
        // through), and once at the end.
        let next = Instant::now() + INTERVAL;
        loop {
            let seen = bell.as_ref().and_then(Doorbell::count);
            if tick() {
                break;
            }
            let left = next.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match (&bell, seen) {
                (Some(bell), Some(seen)) => bell.wait(seen, left),
                _ => std::thread::sleep(left),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(vars: &[(&str, &str)], namespace_file: Option<&str>) -> Labels {
        let config = Config::from_vars(vars.iter().copied()).expect("a valid configuration");
        Labels::from_config(&config, || namespace_file.map(str::to_string))
    }

    #[test]
    fn the_job_is_the_configurations() {
        let vars = [
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_SCOPE", "job:train"),
        ];
        assert_eq!(labels(&vars, None).job.as_deref(), Some("train"));
        assert_eq!(labels(&[], None), Labels::default());
    }

    #[test]
    fn kubernetes_names_come_from_the_downward_api_variables_first() {
        let vars = [
            ("POD_NAME", "trainer-0"),
            ("POD_NAMESPACE", "ml"),
            ("CONTAINER_NAME", "main"),
            ("KUBERNETES_SERVICE_HOST", "10.0.0.1"),
            ("HOSTNAME", "ignored"),
        ];
        let l = labels(&vars, Some("ignored-too"));
        assert_eq!(l.pod.as_deref(), Some("trainer-0"));
        assert_eq!(l.namespace.as_deref(), Some("ml"));
        assert_eq!(l.container.as_deref(), Some("main"));
    }

    #[test]
    fn inside_a_pod_the_hostname_and_service_account_name_the_pod() {
        let vars = [
            ("KUBERNETES_SERVICE_HOST", "10.0.0.1"),
            ("HOSTNAME", "web-7f9c"),
        ];
        let l = labels(&vars, Some("prod\n"));
        assert_eq!(l.pod.as_deref(), Some("web-7f9c"));
        assert_eq!(l.namespace.as_deref(), Some("prod"));
        assert_eq!(l.container, None);
        // Outside Kubernetes the hostname is just a hostname.
        assert_eq!(
            labels(&[("HOSTNAME", "laptop")], Some("x")),
            Labels::default()
        );
    }
}
