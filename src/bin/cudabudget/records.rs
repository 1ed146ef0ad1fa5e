//! Reading the records that budgeted processes publish (`src/publish.rs`), as untrusted
//! input: only directories and files of the user they claim to belong to, nobody else
//! able to write them, every record checked (see `record.rs`), and only live processes
//! kept. Records of processes that are gone are removed.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::record::{self, Record};

/// Where the per-user directories live unless `CUDABUDGET_RUNTIME_DIR` says otherwise
/// (the library's default, `src/publish.rs`).
pub const DEFAULT_RUNTIME_DIR: &str = "/dev/shm";
pub const RUNTIME_DIR_VARIABLE: &str = "CUDABUDGET_RUNTIME_DIR";

/// A record whose process is in another PID namespace (so its pid cannot be checked
/// here) counts as live while it was rewritten this recently (it is every 5 s)...
const FRESH: Duration = Duration::from_secs(30);
/// ...and is removed once it is this old.
const ABANDONED: Duration = Duration::from_secs(600);

/// The runtime directory: `$CUDABUDGET_RUNTIME_DIR`, else `/dev/shm`.
pub fn runtime_dir() -> PathBuf {
    std::env::var_os(RUNTIME_DIR_VARIABLE)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_RUNTIME_DIR))
}

pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// The PID namespace this process is in (the inode of `/proc/self/ns/pid`).
pub fn own_pid_namespace() -> Option<u64> {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|link| record::namespace_inode(&link.to_string_lossy()))
}

/// What a scan found.
#[derive(Default)]
pub struct Scan {
    /// Live processes, sorted by job, then pid.
    pub processes: Vec<Record>,
    /// Files and directories that were passed over, and why.
    pub skipped: Vec<String>,
}

/// Reads every live record this user may see: the user's own directory, and as root
/// every user's.
pub fn scan(runtime_dir: &Path) -> Scan {
    let mut scan = Scan::default();
    let uid = euid();
    let dirs: Vec<(PathBuf, u32)> = if uid == 0 {
        std::fs::read_dir(runtime_dir)
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter_map(|e| {
                        let owner = record::uid_of_dir_name(&e.file_name().to_string_lossy())?;
                        Some((e.path(), owner))
                    })
                    .collect()
            })
            .unwrap_or_default()
    } else {
        vec![(runtime_dir.join(record::user_dir_name(uid)), uid)]
    };
    let namespace = own_pid_namespace();
    for (dir, owner) in dirs {
        read_dir(&dir, owner, uid, namespace, &mut scan);
    }
    scan.processes
        .sort_by(|a, b| (&a.job, a.pid).cmp(&(&b.job, b.pid)));
    scan
}

fn read_dir(dir: &Path, owner: u32, reader: u32, namespace: Option<u64>, scan: &mut Scan) {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(meta) => meta,
        Err(_) => return, // nobody published here yet
    };
    if !meta.is_dir() || meta.uid() != owner || meta.mode() & 0o022 != 0 {
        scan.skipped.push(format!(
            "{}: not a directory of uid {owner} that only it can write",
            dir.display()
        ));
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        scan.skipped
            .push(format!("{}: cannot be read", dir.display()));
        return;
    };
    let may_clean = reader == owner || reader == 0;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((pid, file_namespace)) = record::parse_file_name(&name) else {
            continue;
        };
        let path = entry.path();
        let record = match read_record(&path, owner) {
            Ok(record) => record,
            Err(reason) => {
                // A process that is gone cannot be writing it: a torn or foreign file.
                if may_clean && !process_exists(pid, file_namespace, namespace) {
                    let _ = std::fs::remove_file(&path);
                } else {
                    scan.skipped.push(format!("{}: {reason}", path.display()));
                }
                continue;
            }
        };
        if record.pid != pid || record.pid_namespace != file_namespace {
            scan.skipped
                .push(format!("{}: names another process", path.display()));
            continue;
        }
        match liveness(&record, namespace) {
            Liveness::Live => scan.processes.push(record),
            Liveness::Unsure => {}
            Liveness::Gone => {
                if may_clean {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
    }
}

/// Reads and checks one record file; a record caught while it is being rewritten (its
/// checksum fails) is read again.
pub fn read_record(path: &Path, owner: u32) -> Result<Record, String> {
    let mut last = String::new();
    for attempt in 0..5 {
        if attempt > 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| e.to_string())?;
        let meta = file.metadata().map_err(|e| e.to_string())?;
        if !meta.is_file() || meta.uid() != owner || meta.mode() & 0o022 != 0 {
            return Err(format!("not a file of uid {owner} that only it can write"));
        }
        let mut bytes = Vec::with_capacity(record::SIZE);
        file.by_ref()
            .take(record::SIZE as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| e.to_string())?;
        match Record::decode(&bytes) {
            Ok(record) => return Ok(record),
            Err(record::Invalid::Checksum) => last = record::Invalid::Checksum.to_string(),
            Err(invalid) => return Err(invalid.to_string()),
        }
    }
    Err(last)
}

enum Liveness {
    Live,
    /// In another PID namespace and not rewritten lately: not shown, not removed yet.
    Unsure,
    Gone,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn process_exists(pid: u32, record_namespace: u64, namespace: Option<u64>) -> bool {
    if namespace != Some(record_namespace) {
        return true; // cannot tell from here
    }
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether the record's process is still the one that wrote it: the pid alive with the
/// same start time (a reused pid is another process) and, unless the record is fresh,
/// still the same program (a process that `exec`ed something unbudgeted stops
/// publishing but keeps its pid and start time).
fn liveness(record: &Record, namespace: Option<u64>) -> Liveness {
    let age = Duration::from_millis(now_ms().saturating_sub(record.updated_ms));
    if namespace.is_none() || namespace != Some(record.pid_namespace) {
        return if age <= FRESH {
            Liveness::Live
        } else if age >= ABANDONED {
            Liveness::Gone
        } else {
            Liveness::Unsure
        };
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", record.pid)) else {
        return Liveness::Gone;
    };
    if record::start_time_from_stat(&stat) != Some(record.start_time) {
        return Liveness::Gone;
    }
    if age <= FRESH {
        return Liveness::Live;
    }
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", record.pid)).unwrap_or_default();
    let command = cmdline
        .split(|&b| b == 0)
        .filter(|arg| !arg.is_empty())
        .map(String::from_utf8_lossy)
        .collect::<Vec<_>>()
        .join(" ");
    let capacity = record::FIELDS[1].1;
    if record::truncate(&command, capacity) == record.command {
        Liveness::Live // stopped, or slow: still the budgeted program
    } else {
        Liveness::Gone
    }
}
