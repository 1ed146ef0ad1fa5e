//! Reading the records that budgeted processes publish (`src/tell/publish.rs`), as
//! untrusted input.
//!
//! - Places: each runtime directory of the configuration (`CUDABUDGET_RUNTIME_DIR` or
//!   `/dev/shm`, then the user's fallbacks) is opened with [`Dir::open_trusted`], and so
//!   is each pod's own directory in it (`pods/<pod uid>`, where the webhook mounts a
//!   pod's runtime directory; at most [`TENANTS`], none through a link: see
//!   [`tenant_dirs`]); in each, the user's own `cudabudget-<uid>` (as root: every one) is
//!   opened without following a link and accepted only if it belongs to that uid and
//!   nobody else may write it.
//!   Whatever holds a name instead is said in `skipped`, never passed over silently;
//!   the user it displaced publishes in their own places, where root looks too
//!   (`/run/user/<uid>`, `<home>/.cache`).
//! - A record is a claim: it is shown for a pid of this PID namespace only if the
//!   directory's owner owns the process (or is root) and the process's start time is
//!   the record's; from another namespace (where the pid cannot be checked) only while
//!   it is fresh, and always under the directory's owner.
//! - Cost: every file costs one look. A record of a dead process is removed without
//!   being read; a damaged, forged, stale or future-dated one is read once (once more at
//!   once when its checksum fails) and removed when this reader may (the owner or
//!   root). No sleep, no retry loop: 10 000 junk files cost well under a second.

use std::collections::{BTreeSet, HashSet};
use std::ffi::OsString;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cudabudget_spec::config::{self, Config};
use cudabudget_spec::place::{self, Dir, FileOpen, PlaceError};

use cudabudget_spec::record::{self, Record};

/// Where the per-user directories live unless `CUDABUDGET_RUNTIME_DIR` says otherwise
/// (the library's default).
pub const DEFAULT_RUNTIME_DIR: &str = config::DEFAULT_SHARED_DIR;
pub const RUNTIME_DIR_VARIABLE: &str = config::RUNTIME_DIR;

/// A record whose process is in another PID namespace (so its pid cannot be checked
/// here) counts as live while it was rewritten this recently (it is every 5 s)...
const FRESH: Duration = Duration::from_secs(30);
/// ...and is removed once it is this old.
const ABANDONED: Duration = Duration::from_secs(600);
/// How far ahead of this clock a record may be dated (clocks of one machine agree; a
/// record dated further ahead is forged, or from before the clock was set back, and
/// is removed: a live writer publishes again within its heartbeat).
const SLACK: Duration = Duration::from_secs(10);
/// The most names looked at in one directory.
const NAMES: usize = 100_000;
/// Under a runtime root, one directory per pod (`pods/<pod uid>`): the webhook mounts
/// each pod's own at the runtime directory's path in its containers.
pub const PODS: &str = "pods";
/// Under a job root, one directory per namespace (`namespaces/<namespace>`), mounted so
/// in the pods of that namespace that name a job.
pub const NAMESPACES: &str = "namespaces";
/// Read by the node's readers only (`status`, the exporter, `limit`): the device
/// plugin's root (`cudabudget-node device-plugin --runtime-dir`), whose `alloc/<id>/records`
/// are the private runtime directories of the containers it gave units to.
pub const DEVICE_PLUGIN_DIR_VARIABLE: &str = config::DEVICE_PLUGIN_DIR;
/// Under the device plugin's root, one directory per allocation of units.
pub const ALLOCATIONS: &str = "alloc";
/// The most tenant directories (pods, namespaces) read under one root: a node runs a
/// few hundred pods at most.
pub const TENANTS: usize = 4096;

/// The tenant directories `<root>/<group>/*` (`group` is [`PODS`] or [`NAMESPACES`]),
/// with their names, each opened as [`Dir::open_trusted`] opens a place (every directory
/// from `/` root's or this user's, writable by nobody else unless sticky) and accepted
/// only if it is the directory entry itself, not a link, and did not change while it was
/// opened. At most [`TENANTS`]; what is passed over is said in `skipped`.
pub fn tenant_dirs(root: &Dir, group: &str, skipped: &mut Vec<String>) -> Vec<(String, Dir)> {
    let Some(tenants) = child_dir(root, group, skipped) else {
        return Vec::new();
    };
    let names = match tenants.names(TENANTS + 1) {
        Ok(names) => names,
        Err(error) => {
            skipped.push(format!(
                "{}: cannot be read ({error})",
                tenants.path().display()
            ));
            return Vec::new();
        }
    };
    if names.len() > TENANTS {
        skipped.push(format!(
            "{}: more than {TENANTS} directories; only the first are read",
            tenants.path().display()
        ));
    }
    names
        .iter()
        .take(TENANTS)
        .filter_map(|name| {
            let name = name.to_str()?;
            Some((name.to_string(), child_dir(&tenants, name, skipped)?))
        })
        .collect()
}

/// The directory `name` in `parent`, opened as a trusted place if it is a directory (not
/// a link) and the one opened is the one seen; `None` (said in `skipped`, unless there is
/// nothing at the name) otherwise.
fn child_dir(parent: &Dir, name: &str, skipped: &mut Vec<String>) -> Option<Dir> {
    let path = parent.path().join(name);
    let st = match parent.stat_at(name) {
        Ok(st) => st,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return None,
        Err(error) => {
            skipped.push(format!("{}: cannot be read ({error})", path.display()));
            return None;
        }
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
        skipped.push(format!("{}: not a directory, not read", path.display()));
        return None;
    }
    let dir = match Dir::open_trusted(&path) {
        Ok(dir) => dir,
        Err(error) => {
            skipped.push(format!("{error}: not read"));
            return None;
        }
    };
    if identity(&dir) != (st.st_dev, st.st_ino) {
        skipped.push(format!(
            "{}: changed while it was opened, not read",
            path.display()
        ));
        return None;
    }
    Some(dir)
}

/// The places records are read from, best first: the configuration's `runtime_dirs`
/// (read from this environment's `CUDABUDGET_RUNTIME_DIR`, `XDG_RUNTIME_DIR` and `HOME`
/// only, so that an unrelated bad variable does not stop `status`).
pub fn runtime_dirs() -> Vec<PathBuf> {
    match runtime_dirs_as_set() {
        Ok(dirs) => dirs,
        // A bad CUDABUDGET_RUNTIME_DIR: the library refuses to run under it, so nothing
        // published there; the default place still holds other processes' records.
        Err(_) => Config::from_vars_os(
            std::env::vars_os().filter(|(name, _)| name == "XDG_RUNTIME_DIR" || name == "HOME"),
        )
        .map(|config| config.runtime_dirs)
        .unwrap_or_else(|_| vec![PathBuf::from(DEFAULT_RUNTIME_DIR)]),
    }
}

/// [`runtime_dirs`] as this environment sets them, or what is wrong with its
/// `CUDABUDGET_RUNTIME_DIR` (the line `run` would refuse it with): a user's command says
/// so, where a node service reads the default places instead.
pub fn runtime_dirs_as_set() -> Result<Vec<PathBuf>, String> {
    let relevant = std::env::vars_os().filter(|(name, _)| {
        name == RUNTIME_DIR_VARIABLE || name == "XDG_RUNTIME_DIR" || name == "HOME"
    });
    Config::from_vars_os(relevant)
        .map(|config| config.runtime_dirs)
        .map_err(|error| error.problem())
}

pub fn euid() -> u32 {
    place::euid()
}

/// The PID namespace this process is in (the inode of `/proc/self/ns/pid`).
pub fn own_pid_namespace() -> Option<u64> {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|link| record::namespace_inode(&link.to_string_lossy()))
}

/// A record that passed every check, and the user it is shown under (its directory's
/// owner).
#[derive(Clone, Debug)]
pub struct Shown {
    pub uid: u32,
    pub record: Record,
}

/// What a scan found.
#[derive(Default)]
pub struct Scan {
    /// Live processes, sorted by user, job, then pid.
    pub processes: Vec<Shown>,
    /// Files and directories that were passed over, and why.
    pub skipped: Vec<String>,
}

/// Reads every live record this user may see in `roots` (see [`runtime_dirs`]): the
/// user's own directories, and as root every user's.
pub fn scan(roots: &[PathBuf]) -> Scan {
    let mut reader = Reader {
        me: euid(),
        namespace: own_pid_namespace(),
        now_ms: now_ms(),
        seen: HashSet::new(),
        displaced: BTreeSet::new(),
        scan: Scan::default(),
    };
    let mut roots_seen = HashSet::new();
    for (i, root) in roots.iter().enumerate() {
        let dir = match Dir::open_trusted(root) {
            Ok(dir) => dir,
            Err(error) => {
                // The first place is where records are expected: say why it is not
                // read. The fallbacks are often simply not there.
                if i == 0 && !not_found(&error) {
                    reader.scan.skipped.push(format!("{error}: not read"));
                }
                continue;
            }
        };
        if !roots_seen.insert(identity(&dir)) {
            continue;
        }
        reader.runtime_root(&dir);
        // The pods' own directories (the webhook's `pods/<pod uid>`): this reader sees
        // every pod on the node, each pod only itself.
        let mut skipped = Vec::new();
        for (_, pod) in tenant_dirs(&dir, PODS, &mut skipped) {
            if roots_seen.insert(identity(&pod)) {
                reader.runtime_root(&pod);
            }
        }
        reader.scan.skipped.extend(skipped);
    }
    // The device plugin's containers (`alloc/<id>/records`), where this environment
    // names its root: each container sees only its own, the node's reader all.
    if let Some(root) = std::env::var_os(DEVICE_PLUGIN_DIR_VARIABLE)
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
    {
        match Dir::open_trusted(&root) {
            Ok(dir) => {
                let mut skipped = Vec::new();
                for (_, allocation) in tenant_dirs(&dir, ALLOCATIONS, &mut skipped) {
                    if let Some(records) = child_dir(&allocation, "records", &mut skipped)
                        && roots_seen.insert(identity(&records))
                    {
                        reader.runtime_root(&records);
                    }
                }
                reader.scan.skipped.extend(skipped);
            }
            Err(error) if !not_found(&error) => {
                reader.scan.skipped.push(format!("{error}: not read"));
            }
            Err(_) => {}
        }
    }
    // Users whose name in a shared place another user holds publish in their own
    // places instead (`$XDG_RUNTIME_DIR`, `$HOME/.cache`): root looks there too, at
    // the usual ones, so that a planted name does not blind the monitoring.
    for uid in std::mem::take(&mut reader.displaced) {
        let mut places = vec![PathBuf::from(format!("/run/user/{uid}"))];
        if let Some((_, home)) = passwd(uid) {
            places.push(home.join(".cache"));
        }
        for place in places {
            if let Ok(dir) = Dir::open_trusted_for(&place, uid) {
                for name in place::user_dir_names(uid) {
                    reader.user_dir(&dir, &name, uid);
                }
            }
        }
    }
    let mut scan = reader.scan;
    scan.processes.sort_by(|a, b| {
        (a.uid, &a.record.job, a.record.pid).cmp(&(b.uid, &b.record.job, b.record.pid))
    });
    scan
}

fn not_found(error: &PlaceError) -> bool {
    matches!(error, PlaceError::Io { error, .. } if error.kind() == std::io::ErrorKind::NotFound)
}

/// The device and inode of an open directory: one directory reached twice is read once.
fn identity(dir: &Dir) -> (u64, u64) {
    place::fstat(dir.fd()).map_or((0, 0), |st| (st.st_dev, st.st_ino))
}

struct Reader {
    me: u32,
    namespace: Option<u64>,
    now_ms: u64,
    seen: HashSet<(u64, u64)>,
    /// Users whose directory name another user holds (root's scan looks for their
    /// records in their own places).
    displaced: BTreeSet<u32>,
    scan: Scan,
}

/// What /proc says about a pid of this namespace.
struct Process {
    start_time: u64,
    /// Whether `owner` (a records directory's) may speak for the process.
    owned: bool,
}

/// Why a record is not shown.
enum Verdict {
    Show(Record),
    /// Gone, damaged, forged or stale: removed when the reader may.
    Reap(String),
    /// Not shown, not removed (another user's process, a fresh record not yet
    /// checkable...): said in `skipped` when `Some`.
    Pass(Option<String>),
}

impl Reader {
    /// The records directories in one runtime root: this user's, or as root every user's.
    fn runtime_root(&mut self, dir: &Dir) {
        if self.me == 0 {
            // Only our names count toward the limit: another user's junk in the shared
            // directory cannot hide the users' directories from root.
            let ours = |n: &[u8]| {
                std::str::from_utf8(n).is_ok_and(|n| place::uid_of_dir_name(n).is_some())
            };
            let names = dir.names_where(NAMES, ours).unwrap_or_default();
            for name in names {
                let Some(name) = name.to_str() else { continue };
                if let Some(uid) = place::uid_of_dir_name(name) {
                    self.user_dir(dir, name, uid);
                }
            }
        } else {
            let me = self.me;
            for name in place::user_dir_names(me) {
                self.user_dir(dir, &name, me);
            }
        }
    }

    fn user_dir(&mut self, parent: &Dir, name: &str, uid: u32) {
        let dir = match parent.open_dir_of(name, uid) {
            Ok(dir) => dir,
            Err(error) if not_found(&error) => return,
            Err(error) => {
                if self.me == 0 && uid != 0 {
                    self.displaced.insert(uid);
                }
                self.scan
                    .skipped
                    .push(format!("{error}: records of uid {uid} there are not read"));
                return;
            }
        };
        if !self.seen.insert(identity(&dir)) {
            return;
        }
        let may_reap = self.me == uid || self.me == 0;
        let names: Vec<OsString> = match dir.names(NAMES) {
            Ok(names) => names,
            Err(error) => {
                self.scan.skipped.push(format!(
                    "{}: cannot be read ({error})",
                    dir.path().display()
                ));
                return;
            }
        };
        if names.len() >= NAMES {
            self.scan.skipped.push(format!(
                "{}: more than {NAMES} names; only the first are read",
                dir.path().display()
            ));
        }
        for name in names {
            let Some(name) = name.to_str() else { continue };
            if let Some((pid, namespace)) = record::parse_file_name(name) {
                match self.judge(&dir, name, pid, namespace, uid) {
                    Verdict::Show(record) => self.scan.processes.push(Shown { uid, record }),
                    Verdict::Reap(why) => {
                        if !may_reap || dir.remove_file(name).is_err() {
                            self.scan
                                .skipped
                                .push(format!("{}: {why}", dir.path().join(name).display()));
                        }
                    }
                    Verdict::Pass(Some(why)) => self
                        .scan
                        .skipped
                        .push(format!("{}: {why}", dir.path().join(name).display())),
                    Verdict::Pass(None) => {}
                }
            } else if let Some((pid, namespace)) = parse_temporary_name(name) {
                // The writer's temporary file, left by a process killed while writing.
                if may_reap && Some(namespace) == self.namespace && self.process(pid, uid).is_none()
                {
                    let _ = dir.remove_file(name);
                }
            }
        }
    }

    fn judge(&self, dir: &Dir, name: &str, pid: u32, namespace: u64, uid: u32) -> Verdict {
        let local = Some(namespace) == self.namespace;
        let process = if local {
            match self.process(pid, uid) {
                // Gone: nobody can be writing it, whatever it holds. Not even read.
                None => return Verdict::Reap("its process is gone".to_string()),
                Some(process) if !process.owned => {
                    return Verdict::Pass(Some(format!(
                        "claims process {pid}, which does not belong to uid {uid}"
                    )));
                }
                Some(process) => Some(process),
            }
        } else {
            None
        };
        let record = match read_record(dir, name, uid) {
            Ok(record) => record,
            Err(Unreadable::Refused(why)) => return Verdict::Pass(Some(why)),
            Err(Unreadable::Invalid(why)) => return Verdict::Reap(why),
        };
        if record.pid != pid || record.pid_namespace != namespace {
            return Verdict::Reap("its contents name another process".to_string());
        }
        if record.updated_ms > self.now_ms.saturating_add(SLACK.as_millis() as u64) {
            return Verdict::Reap("dated in the future".to_string());
        }
        let age = Duration::from_millis(self.now_ms.saturating_sub(record.updated_ms));
        let Some(process) = process else {
            // Another PID namespace: the pid cannot be checked from here.
            return if age <= FRESH {
                Verdict::Show(record)
            } else if age >= ABANDONED {
                Verdict::Reap("not rewritten for 10 minutes".to_string())
            } else {
                Verdict::Pass(None)
            };
        };
        if record.start_time != process.start_time {
            return Verdict::Reap("its pid now belongs to another process".to_string());
        }
        if age <= FRESH || same_program(&record) {
            Verdict::Show(record)
        } else {
            // Still running, but no longer the budgeted program (it `exec`ed).
            Verdict::Reap("its process runs another program now".to_string())
        }
    }

    /// The process `pid` of this namespace, if it runs; whether `owner` may speak for it:
    /// root may, and so may the owner of `/proc/<pid>` or its real or effective user
    /// (a process that made itself undumpable shows `/proc/<pid>` as root's).
    fn process(&self, pid: u32, owner: u32) -> Option<Process> {
        let proc_dir = format!("/proc/{pid}");
        let meta = std::fs::symlink_metadata(&proc_dir).ok()?;
        let stat = std::fs::read(format!("{proc_dir}/stat")).ok()?;
        let start_time = record::start_time_from_stat(&stat)?;
        let owned = owner == 0
            || meta.uid() == owner
            || std::fs::read(format!("{proc_dir}/status"))
                .ok()
                .and_then(|status| {
                    // The Name: line may not be UTF-8; the Uid: line always is.
                    let status = String::from_utf8_lossy(&status);
                    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
                    let ids: Vec<u32> = line
                        .split_whitespace()
                        .take(2)
                        .filter_map(|n| n.parse().ok())
                        .collect();
                    Some(ids.contains(&owner))
                })
                .unwrap_or(false);
        Some(Process { start_time, owned })
    }
}

/// User `uid`'s name and home directory, where the system knows them.
pub fn passwd(uid: u32) -> Option<(String, PathBuf)> {
    use std::os::unix::ffi::OsStrExt;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: an all-zero `passwd` is a valid value of a plain C struct.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: valid out-pointers and a buffer of the length given; getpwuid_r writes
    // only inside them.
    let rc = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut result) };
    if rc != 0 || result.is_null() || pwd.pw_name.is_null() || pwd.pw_dir.is_null() {
        return None;
    }
    // SAFETY: both point into `buf`, NUL-terminated, alive until `buf` is dropped.
    let (name, home) = unsafe {
        (
            std::ffi::CStr::from_ptr(pwd.pw_name),
            std::ffi::CStr::from_ptr(pwd.pw_dir),
        )
    };
    Some((
        name.to_string_lossy().into_owned(),
        PathBuf::from(std::ffi::OsStr::from_bytes(home.to_bytes())),
    ))
}

fn parse_temporary_name(name: &str) -> Option<(u32, u64)> {
    let inner = name.strip_prefix('.')?.strip_suffix(".tmp")?;
    record::parse_file_name(&format!("{inner}.rec"))
}

enum Unreadable {
    /// Not a file this owner alone controls (a link, another user's file, a FIFO): left
    /// alone, named.
    Refused(String),
    /// Its bytes are not a record.
    Invalid(String),
}

/// Reads and checks one record file of `owner` in `dir`: opened without following a
/// link and without blocking, checked on the descriptor, read once. A checksum that
/// fails is looked at once more, at once, only if the file was written in the last
/// second (an older library rewrote its record in place; today's renames a whole one
/// over it): a damaged file costs one read.
fn read_record(dir: &Dir, name: &str, owner: u32) -> Result<Record, Unreadable> {
    let mut last = record::Invalid::Checksum;
    for attempt in 0..2 {
        let mut file = dir
            .open_file_of(name, FileOpen::READ, owner)
            .map_err(|e| Unreadable::Refused(e.to_string()))?;
        let mut bytes = Vec::with_capacity(record::SIZE + 1);
        file.by_ref()
            .take(record::SIZE as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| Unreadable::Refused(e.to_string()))?;
        match Record::decode(&bytes) {
            Ok(record) => return Ok(record),
            Err(record::Invalid::Checksum) if attempt == 0 && just_written(&file) => {
                last = record::Invalid::Checksum;
            }
            Err(invalid) => return Err(Unreadable::Invalid(invalid.to_string())),
        }
    }
    Err(Unreadable::Invalid(last.to_string()))
}

/// Whether `file` was modified within the last second (or is dated ahead).
fn just_written(file: &std::fs::File) -> bool {
    use std::os::fd::AsFd;
    let Ok(st) = place::fstat(file.as_fd()) else {
        return false;
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    st.st_mtime >= now - 1
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Whether the record's process still runs the program that wrote it (a process that
/// `exec`ed something unbudgeted stops publishing but keeps its pid and start time).
fn same_program(record: &Record) -> bool {
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", record.pid)).unwrap_or_default();
    let command = record::command_line(&cmdline);
    let capacity = record::FIELDS[1].1;
    record::truncate(&command, capacity) == record.command
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// splitmix64.
    fn next(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn cases(default: u64) -> u64 {
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(default)
    }

    /// A runtime directory with this user's records directory in it.
    fn runtime(test: &str) -> (PathBuf, PathBuf) {
        let base = std::env::temp_dir().join(format!("cb-records-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).unwrap();
        let dir = base.join(place::user_dir_name(euid()));
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        (base, dir)
    }

    /// This process's own record: what the reader must show.
    fn own() -> Record {
        let stat = std::fs::read("/proc/self/stat").unwrap();
        let cmdline = std::fs::read("/proc/self/cmdline").unwrap();
        let command = record::command_line(&cmdline);
        Record {
            pid: std::process::id(),
            start_time: record::start_time_from_stat(&stat).unwrap(),
            pid_namespace: own_pid_namespace().unwrap(),
            updated_ms: now_ms(),
            command: record::truncate(&command, record::FIELDS[1].1).to_string(),
            job: Some("train".into()),
            devices: vec![record::DeviceFigures {
                ordinal: 0,
                budget: 1 << 30,
                used: 1 << 20,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    /// Whether the reader may show `bytes` as this process's record: the oracle, written
    /// apart from the reader. `None`: a date within a second of a bound (the reader's
    /// clock is read a moment later).
    fn showable(bytes: &[u8], me: &Record) -> Option<bool> {
        let Ok(r) = Record::decode(bytes) else {
            return Some(false);
        };
        let now = now_ms();
        let near = |bound: u64| r.updated_ms.abs_diff(bound) < 1000;
        let (ahead, fresh) = (
            now + SLACK.as_millis() as u64,
            now.saturating_sub(FRESH.as_millis() as u64),
        );
        if near(ahead) || (near(fresh) && r.command != me.command) {
            return None;
        }
        Some(
            r.pid == me.pid
                && r.pid_namespace == me.pid_namespace
                && r.start_time == me.start_time
                && r.updated_ms <= ahead
                && (r.updated_ms >= fresh || r.command == me.command),
        )
    }

    /// Random bytes, truncations and a forger's resealed edits of this process's record,
    /// read by the reader as `status` reads them: never a panic, and a record is shown
    /// exactly when it passes every check (`PROPTEST_CASES`, default 3000).
    #[test]
    fn the_reader_shows_a_record_only_when_it_passes_every_check() {
        let (base, dir) = runtime("property");
        let me = own();
        let path = dir.join(record::file_name(me.pid, me.pid_namespace));
        let mut good = [0u8; record::SIZE];
        me.encode(&mut good);
        // Offsets worth a forger's edit: header, identity, dates, lengths, figures.
        let fields = [
            8, 12, 24, 28, 32, 40, 48, 56, 64, 66, 68, 1760, 1764, 1768, 1776, 1784,
        ];
        let mut state = 2025;
        let mut shown = 0;
        for case in 0..cases(3000) {
            let mut bytes = good.to_vec();
            match case % 5 {
                0 => bytes.iter_mut().for_each(|b| *b = next(&mut state) as u8),
                1 => bytes.truncate((next(&mut state) % (record::SIZE as u64 + 2)) as usize),
                _ => {
                    for _ in 0..1 + next(&mut state) % 3 {
                        let at = if next(&mut state).is_multiple_of(4) {
                            (next(&mut state) % (record::SIZE as u64 - 8)) as usize
                        } else {
                            fields[(next(&mut state) % fields.len() as u64) as usize]
                        };
                        let value = match next(&mut state) % 6 {
                            0 => u64::MAX,
                            1 => 0,
                            2 => now_ms() + next(&mut state) % 100_000_000,
                            3 => now_ms() - next(&mut state) % 10_000_000,
                            4 => next(&mut state) % 70,
                            _ => next(&mut state),
                        };
                        let width = if (64..96).contains(&at) { 2 } else { 8 };
                        bytes[at..at + width].copy_from_slice(&value.to_le_bytes()[..width]);
                    }
                    if case % 5 != 4 {
                        bytes[16..24].fill(0);
                        let sum = record::fnv1a(&bytes);
                        bytes[16..24].copy_from_slice(&sum.to_le_bytes());
                    }
                }
            }
            std::fs::write(&path, &bytes).unwrap();
            let scan = scan(std::slice::from_ref(&base));
            let Some(expected) = showable(&bytes, &me) else {
                continue;
            };
            let mine: Vec<&Shown> = scan
                .processes
                .iter()
                .filter(|p| p.record.pid == me.pid)
                .collect();
            assert_eq!(
                mine.len(),
                usize::from(expected),
                "case {case}: {:?}",
                Record::decode(&bytes)
            );
            if let Some(p) = mine.first() {
                assert_eq!(Ok(&p.record), Record::decode(&bytes).as_ref());
                shown += 1;
            }
            if !expected {
                // Refused: and removed (this user's own directory), but never shown.
                assert!(!path.exists(), "case {case}: a refused record is reaped");
            }
        }
        assert!(shown > 0, "some edits keep a valid record");
        let _ = std::fs::remove_dir_all(&base);
    }

    /// A node's runtime directory with pods' own directories in `pods/`: the reader shows
    /// a record in a pod's directory, and passes over (saying so) a link or a file
    /// planted there instead of a directory; a record reached only through such a link
    /// is not shown.
    #[test]
    fn the_pods_own_directories_are_read_and_links_among_them_are_not_followed() {
        let (base, _) = runtime("pods");
        let me = own();
        let pods = base.join(PODS);
        std::fs::create_dir(&pods).unwrap();
        std::fs::set_permissions(&pods, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (elsewhere, _) = runtime("pods-elsewhere");
        for (dir, pid) in [(pods.join("pod-a"), me.pid), (elsewhere.clone(), me.pid)] {
            let user = dir.join(place::user_dir_name(euid()));
            std::fs::create_dir_all(&user).unwrap();
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
            std::fs::set_permissions(&user, std::fs::Permissions::from_mode(0o700)).unwrap();
            let mut bytes = [0u8; record::SIZE];
            me.encode(&mut bytes);
            std::fs::write(user.join(record::file_name(pid, me.pid_namespace)), bytes).unwrap();
        }
        std::os::unix::fs::symlink(&elsewhere, pods.join("pod-link")).unwrap();
        std::fs::write(pods.join("pod-file"), b"").unwrap();
        let scan = scan(std::slice::from_ref(&base));
        assert_eq!(scan.processes.len(), 1, "{:?}", scan.processes);
        assert_eq!(scan.processes[0].record.pid, me.pid);
        for planted in ["pod-link", "pod-file"] {
            assert!(
                scan.skipped
                    .iter()
                    .any(|s| s.contains(planted) && s.contains("not a directory")),
                "{planted}: {:?}",
                scan.skipped
            );
        }
        // The record reached through the link is the same process: it would be shown
        // twice if the link were followed, and it is not removed either.
        assert!(
            elsewhere
                .join(place::user_dir_name(euid()))
                .join(record::file_name(me.pid, me.pid_namespace))
                .exists()
        );
        let _ = std::fs::remove_dir_all(&base);
        let _ = std::fs::remove_dir_all(&elsewhere);
    }

    /// Records replaced whole (today's writer) or rewritten in place (an older one)
    /// while the reader reads: what it shows is always one of the records written.
    #[test]
    fn records_written_while_they_are_read_are_shown_whole_or_not_at_all() {
        use std::os::unix::fs::FileExt;
        let (base, dir) = runtime("concurrent");
        let me = own();
        let name = record::file_name(me.pid, me.pid_namespace);
        let versions: Vec<[u8; record::SIZE]> = (0..4u64)
            .map(|i| {
                let mut r = me.clone();
                r.sequence = i;
                r.devices[0].used = i << 20;
                r.command = me.command.clone();
                let mut buf = [0u8; record::SIZE];
                r.encode(&mut buf);
                buf
            })
            .collect();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (dir, name, versions, stop) =
                (dir.clone(), name.clone(), versions.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0usize;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let buf = &versions[i % versions.len()];
                    if i.is_multiple_of(2) {
                        let temporary = dir.join(".tmp-test");
                        std::fs::write(&temporary, buf).unwrap();
                        std::fs::rename(&temporary, dir.join(&name)).unwrap();
                    } else if let Ok(file) = std::fs::OpenOptions::new()
                        .write(true)
                        .create(true)
                        .truncate(false)
                        .open(dir.join(&name))
                    {
                        // Two halves: a reader in between sees a torn record.
                        let _ = file.write_all_at(&buf[..4096], 0);
                        let _ = file.write_all_at(&buf[4096..], 4096);
                    }
                    i += 1;
                }
            })
        };
        let decoded: Vec<Record> = versions
            .iter()
            .map(|b| Record::decode(b).unwrap())
            .collect();
        for _ in 0..cases(3000) / 10 {
            for p in scan(std::slice::from_ref(&base)).processes {
                assert!(decoded.contains(&p.record), "{:?}", p.record);
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.join().unwrap();
        let _ = std::fs::remove_dir_all(&base);
    }
}
