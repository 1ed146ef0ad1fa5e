//! Configuration: the process environment turned into a [`Config`], or into the one
//! [`ConfigError`] line that tells the user why CUDA is refused.
//!
//! This module owns the names and meaning of every `CUDABUDGET_*` variable and of the
//! HAMi-core compatibility variables. It is pure (the only environment access is
//! [`Config::from_env`], a thin wrapper) so the CLI can validate the exact
//! environment it is about to hand to a child before anything runs. It never guesses:
//! a value it cannot honour is an error, never a silent fallback to running
//! unbudgeted or with a weaker budget than asked for.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::quantity::{Limit, format_bytes, parse_hami, parse_limit};

/// Budget for every device (`CUDABUDGET_LIMIT`); `_<N>` variants are per device.
pub const LIMIT: &str = "CUDABUDGET_LIMIT";
/// Log verbosity.
pub const LOG: &str = "CUDABUDGET_LOG";
/// Who shares the budget: `process`, later `job:<name>`.
pub const SCOPE: &str = "CUDABUDGET_SCOPE";
/// What an allocation past the budget does: `fail`, `wait:<duration>` or `warn`.
pub const ON_EXCEED: &str = "CUDABUDGET_ON_EXCEED";
/// The library the CLI preloads; the library itself ignores it.
pub const LIB: &str = "CUDABUDGET_LIB";
/// The pod's UID, which the Kubernetes webhook sets from the downward API to name the
/// pod's own runtime directory (its mount's `subPathExpr`); the library ignores it.
pub const POD_UID: &str = "CUDABUDGET_POD_UID";
/// The device plugin's root, for the node's readers (`status`, the exporter, `limit`):
/// its containers' runtime directories are read too; the library ignores it.
pub const DEVICE_PLUGIN_DIR: &str = "CUDABUDGET_DEVICE_PLUGIN_DIR";
/// Where job ledgers live (default `/dev/shm`).
pub const JOB_DIR: &str = "CUDABUDGET_JOB_DIR";
/// A file that gets one JSON line per denial.
pub const EVENTS: &str = "CUDABUDGET_EVENTS";
/// Where processes publish their figures for `status` and the exporter.
pub const RUNTIME_DIR: &str = "CUDABUDGET_RUNTIME_DIR";
/// What a CUDA context costs on the device where NVML cannot measure it (no
/// `libnvidia-ml`): bytes, instead of the library's per-model estimate.
pub const CONTEXT_MEMORY: &str = "CUDABUDGET_CONTEXT_MEMORY";
/// HAMi-core's budget for every device; `_<N>` variants are per device.
pub const HAMI_LIMIT: &str = "CUDA_DEVICE_MEMORY_LIMIT";
/// HAMi's shared cache file: the processes that name the same one share a budget.
pub const HAMI_SHARED_CACHE: &str = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
/// CUDA's own device selection, read (never judged) for the numbering of NVML's devices.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// Where job ledgers and records go unless a variable names another directory.
pub const DEFAULT_SHARED_DIR: &str = "/dev/shm";
/// Highest device ordinal a per-device variable may name: the ledger budgets 64 devices
/// (0..=63), and a budget it could not enforce is refused rather than accepted.
pub const MAX_ORDINAL: u32 = 63;

const PREFIX: &str = "CUDABUDGET_";
const KNOWN_VARIABLES: &str = "CUDABUDGET_LIMIT, CUDABUDGET_LIMIT_<N> (N = 0..63), \
     CUDABUDGET_LOG, CUDABUDGET_SCOPE, CUDABUDGET_ON_EXCEED, CUDABUDGET_LIB, \
     CUDABUDGET_CONTEXT_MEMORY, CUDABUDGET_JOB_DIR, CUDABUDGET_EVENTS, CUDABUDGET_RUNTIME_DIR, \
     CUDABUDGET_POD_UID, CUDABUDGET_DEVICE_PLUGIN_DIR";

/// How much the library writes to stderr. Ordered: a level includes those before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum LogLevel {
    Off,
    Error,
    /// One line per denial (rate-limited).
    #[default]
    Warn,
    /// Plus a summary at exit.
    Info,
    Debug,
}

impl FromStr for LogLevel {
    type Err = String;

    /// "off", "error", "warn", "info", "debug", case-insensitive, surrounding ASCII
    /// whitespace ignored.
    fn from_str(s: &str) -> Result<LogLevel, String> {
        let s = trim(s);
        [
            ("off", LogLevel::Off),
            ("error", LogLevel::Error),
            ("warn", LogLevel::Warn),
            ("info", LogLevel::Info),
            ("debug", LogLevel::Debug),
        ]
        .into_iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(s))
        .map(|(_, level)| level)
        .ok_or_else(|| {
            if s.is_empty() {
                "empty value".to_string()
            } else {
                format!("unknown level {s:?}")
            }
        })
    }
}

/// Which family of variables set the budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// No budget is configured.
    None,
    /// `CUDABUDGET_LIMIT*`.
    Cudabudget,
    /// HAMi-core's `CUDA_DEVICE_MEMORY_LIMIT*` alone.
    Hami,
    /// Both families: on each device the smaller budget wins.
    Both,
}

/// A device's budget before its size is known: the most restrictive of ours
/// (`CUDABUDGET_LIMIT_<N>`, else `CUDABUDGET_LIMIT`) and HAMi's
/// (`CUDA_DEVICE_MEMORY_LIMIT_<N>`, else `CUDA_DEVICE_MEMORY_LIMIT`). At least one is set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceLimit {
    pub ours: Option<Limit>,
    /// HAMi's, in bytes (HAMi has no percentages).
    pub hami: Option<u64>,
}

impl DeviceLimit {
    /// The budget in bytes for a device of `physical` bytes: the smaller of the two.
    pub fn resolve(self, physical: u64) -> u64 {
        let ours = self.ours.map(|limit| limit.resolve(physical));
        match (ours, self.hami) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) => a,
            (None, Some(b)) => b,
            (None, None) => u64::MAX,
        }
    }

    /// The budget in bytes when the device's size is not needed to know it (no
    /// percentage); `None`: resolve it with [`DeviceLimit::resolve`] once the size is known.
    pub fn fixed(self) -> Option<u64> {
        match self.ours {
            Some(Limit::Percent(_)) => None,
            Some(Limit::Bytes(bytes)) => Some(self.hami.map_or(bytes, |hami| hami.min(bytes))),
            None => self.hami,
        }
    }
}

impl fmt::Display for DeviceLimit {
    /// `8.00 GiB`, `40.00% of the device`, or `the smaller of 40.00% of the device and
    /// 1.00 GiB (HAMi)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ours = |f: &mut fmt::Formatter<'_>, limit: Limit| match limit {
            Limit::Bytes(b) => f.write_str(&format_bytes(b)),
            Limit::Percent(h) => write!(f, "{}.{:02}% of the device", h / 100, h % 100),
        };
        match (self.ours, self.hami) {
            (Some(limit), None) => ours(f, limit),
            (None, Some(b)) => write!(f, "{} (HAMi)", format_bytes(b)),
            (Some(limit), Some(b)) => match self.fixed() {
                Some(bytes) => f.write_str(&format_bytes(bytes)),
                None => {
                    f.write_str("the smaller of ")?;
                    ours(f, limit)?;
                    write!(f, " and {} (HAMi)", format_bytes(b))
                }
            },
            (None, None) => f.write_str("no budget"),
        }
    }
}

/// The variables that name a process's pod ([`PodNames`]).
const POD_VARIABLES: [&str; 5] = [
    "POD_NAME",
    "POD_NAMESPACE",
    "CONTAINER_NAME",
    "KUBERNETES_SERVICE_HOST",
    "HOSTNAME",
];

/// What the environment asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Our budget for every device: `CUDABUDGET_LIMIT`.
    pub default_limit: Option<Limit>,
    /// `CUDABUDGET_LIMIT_<N>`, sorted by ordinal, one per ordinal.
    pub device_limits: Vec<(u32, Limit)>,
    /// HAMi's budget for every device: `CUDA_DEVICE_MEMORY_LIMIT` (0: none).
    pub hami_default_limit: Option<u64>,
    /// HAMi's `CUDA_DEVICE_MEMORY_LIMIT_<N>`, sorted by ordinal (a 0 is left out: HAMi
    /// then falls back to its default).
    pub hami_device_limits: Vec<(u32, u64)>,
    pub log: LogLevel,
    pub source: Source,
    /// `CUDABUDGET_CONTEXT_MEMORY`: a context's cost where NVML cannot measure it.
    pub context_memory: Option<u64>,
    pub scope: Scope,
    pub on_exceed: OnExceed,
    /// HAMi's `CUDA_DEVICE_MEMORY_SHARED_CACHE`, when HAMi's variables set a budget (alone
    /// or with ours): the processes that name the same file share one budget.
    pub hami_shared_cache: Option<String>,
    /// Where job ledgers live: `CUDABUDGET_JOB_DIR` (trimmed, absolute) or `/dev/shm`,
    /// alone (the user's directory there takes its next name when another user holds
    /// one: [`crate::place::user_dir_names`]).
    pub job_dirs: Vec<PathBuf>,
    /// Where the per-process records go, best first: `CUDABUDGET_RUNTIME_DIR` or
    /// `/dev/shm`, then the user's own places.
    pub runtime_dirs: Vec<PathBuf>,
    /// `CUDABUDGET_EVENTS` (trimmed): the file that gets one JSON line per event.
    pub events: Option<PathBuf>,
    /// `CUDA_VISIBLE_DEVICES` as the process had it: how CUDA will number the devices
    /// NVML lists, for a view asked before CUDA is initialised.
    pub cuda_visible_devices: Option<String>,
    /// `CUDABUDGET_*` names this release does not know (a newer release's, or a typo),
    /// sorted, beside a valid budget: they are ignored, and [`Config::unknown_warning`]
    /// says so. Without a budget they are an error instead.
    pub unknown: Vec<String>,
    /// The names Kubernetes gives the process, as its environment says them (the one
    /// place the library reads them: the records name the pod from here).
    pub pod: PodNames,
}

/// What the environment says of the pod a process runs in: the downward-API variables
/// `POD_NAME`, `POD_NAMESPACE` and `CONTAINER_NAME` (Kubernetes sets none of them by
/// itself), whether the process is in a pod at all (`KUBERNETES_SERVICE_HOST` is set),
/// and its `HOSTNAME` (in a pod, the pod's name). Values as found, untrimmed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodNames {
    pub pod_name: Option<String>,
    pub pod_namespace: Option<String>,
    pub container_name: Option<String>,
    pub in_kubernetes: bool,
    pub hostname: Option<String>,
}

/// A variable whose value cannot be honoured. `Display` renders the single line the
/// user sees; `variable` and `value` are exactly as found in the environment.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigError {
    pub variable: String,
    pub value: String,
    pub reason: String,
}

/// What a variable name means.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Variable {
    Limit,
    DeviceLimit(u32),
    Log,
    Scope,
    OnExceed,
    Lib,
    /// Known, and set for others than the library (the webhook's pod UID, the node
    /// readers' device plugin root): never a warning, never read here.
    Ignored,
    JobDir,
    Events,
    RuntimeDir,
    ContextMemory,
    HamiLimit,
    HamiDeviceLimit(u32),
    /// Has our prefix but is not a variable this release knows: ignored beside a valid
    /// budget (a newer release may know it), refused alone (a typo, `CUDABUDGET_LIMT`,
    /// would otherwise leave the job silently unbudgeted).
    Unknown,
}

impl Variable {
    /// `Ok(None)`: not ours. `Err(reason)`: one of ours that cannot be honoured whatever
    /// else is set (a per-device budget for an ordinal that cannot be budgeted).
    fn classify(name: &str) -> Result<Option<Variable>, String> {
        if let Some(rest) = name.strip_prefix(PREFIX) {
            return match rest {
                "LIMIT" => Ok(Some(Variable::Limit)),
                "LOG" => Ok(Some(Variable::Log)),
                "SCOPE" => Ok(Some(Variable::Scope)),
                "ON_EXCEED" => Ok(Some(Variable::OnExceed)),
                "LIB" => Ok(Some(Variable::Lib)),
                "POD_UID" | "DEVICE_PLUGIN_DIR" => Ok(Some(Variable::Ignored)),
                "CONTEXT_MEMORY" => Ok(Some(Variable::ContextMemory)),
                "JOB_DIR" => Ok(Some(Variable::JobDir)),
                "EVENTS" => Ok(Some(Variable::Events)),
                "RUNTIME_DIR" => Ok(Some(Variable::RuntimeDir)),
                _ => match rest.strip_prefix("LIMIT_") {
                    Some(ordinal) => parse_ordinal(ordinal)
                        .map(|n| Some(Variable::DeviceLimit(n)))
                        .ok_or_else(|| {
                            format!(
                                "{ordinal:?} is not a device ordinal: use a decimal number \
                                 0..={MAX_ORDINAL} without leading zeros, e.g. {LIMIT}_1"
                            )
                        }),
                    None => Ok(Some(Variable::Unknown)),
                },
            };
        }
        if name == HAMI_LIMIT {
            return Ok(Some(Variable::HamiLimit));
        }
        // HAMi's namespace is not ours to police: names that are not `_<ordinal>` are
        // ignored, as HAMi-core itself ignores them. An ordinal we cannot budget is
        // refused, as for our own variables.
        let Some(rest) = name
            .strip_prefix(HAMI_LIMIT)
            .and_then(|r| r.strip_prefix('_'))
        else {
            return Ok(None);
        };
        match parse_ordinal(rest) {
            Some(n) => Ok(Some(Variable::HamiDeviceLimit(n))),
            None if !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()) => Err(format!(
                "device {rest} cannot be budgeted: ordinals 0..={MAX_ORDINAL} only"
            )),
            None => Ok(None),
        }
    }

    fn is_budget(self) -> bool {
        matches!(self, Variable::Limit | Variable::DeviceLimit(_))
    }

    fn is_hami(self) -> bool {
        matches!(self, Variable::HamiLimit | Variable::HamiDeviceLimit(_))
    }
}

fn trim(s: &str) -> &str {
    s.trim_matches(|c: char| c.is_ascii_whitespace())
}

/// A device ordinal in canonical decimal form ("0", "7", "63"; not "01", "+1", " 1"),
/// no higher than [`MAX_ORDINAL`].
pub fn parse_ordinal(s: &str) -> Option<u32> {
    let canonical = !s.is_empty()
        && s.len() <= 4
        && s.bytes().all(|b| b.is_ascii_digit())
        && (s == "0" || !s.starts_with('0'));
    if !canonical {
        return None;
    }
    s.parse().ok().filter(|&n| n <= MAX_ORDINAL)
}

/// Who shares a budget.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Scope {
    /// Each process its own (the default).
    #[default]
    Process,
    /// Every process of the user that names this job.
    Job(String),
}

/// What an allocation past the budget does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnExceed {
    /// `CUDA_ERROR_OUT_OF_MEMORY` at once (the default).
    #[default]
    Fail,
    /// Wait up to this long for room, then fail.
    Wait(std::time::Duration),
    /// Admit it anyway, and tell (a line, a counted overrun, an event): observe mode, to
    /// measure what budgets would refuse before enforcing them.
    Warn,
}

/// Reads `CUDABUDGET_SCOPE`: `process` or `job:<name>` (1 to 64 of `A-Z a-z 0-9 . _ -`,
/// not starting with a dot: the name is part of a file name).
pub fn parse_scope(value: &str) -> Result<Scope, String> {
    let value = trim(value);
    if value == "process" {
        return Ok(Scope::Process);
    }
    if value.is_empty() {
        return Err("empty value".to_string());
    }
    let Some(name) = value.strip_prefix("job:") else {
        return Err(format!(
            "unknown scope {value:?}; expected \"process\" or \"job:<name>\""
        ));
    };
    let valid = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if valid {
        Ok(Scope::Job(name.to_string()))
    } else {
        Err(format!(
            "job name {name:?}: use 1 to 64 letters, digits, '.', '_' or '-', not starting with '.'"
        ))
    }
}

/// Accepts what `CUDABUDGET_SCOPE` may hold; `Err` is the reason.
pub fn validate_scope(value: &str) -> Result<(), String> {
    parse_scope(value).map(|_| ())
}

/// Reads `CUDABUDGET_ON_EXCEED`: `fail`, `warn` or `wait:<duration>` (`30s`, `500ms`,
/// `2m`, `1h`, or plain seconds; at most a day).
pub fn parse_on_exceed(value: &str) -> Result<OnExceed, String> {
    let value = trim(value);
    match value {
        "fail" => return Ok(OnExceed::Fail),
        "warn" => return Ok(OnExceed::Warn),
        _ => {}
    }
    if value.is_empty() {
        return Err("empty value".to_string());
    }
    let Some(duration) = value.strip_prefix("wait:") else {
        return Err(format!(
            "unknown policy {value:?}; expected \"fail\", \"warn\" or \"wait:<duration>\""
        ));
    };
    parse_duration(duration).map(OnExceed::Wait)
}

/// Accepts what `CUDABUDGET_ON_EXCEED` may hold; `Err` is the reason.
pub fn validate_on_exceed(value: &str) -> Result<(), String> {
    parse_on_exceed(value).map(|_| ())
}

fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale = match unit {
        "ms" => 1e-3,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => {
            return Err(format!(
                "duration {text:?}: unknown unit {unit:?}; use ms, s, m or h"
            ));
        }
    };
    let n: f64 = number
        .parse()
        .ok()
        .filter(|n: &f64| {
            n.is_finite() && number.bytes().next().is_some_and(|b| b.is_ascii_digit())
        })
        .ok_or_else(|| format!("duration {text:?}: not a number, e.g. wait:30s"))?;
    let secs = n * scale;
    if secs > 86_400.0 {
        return Err(format!("duration {text:?}: at most a day"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

impl Config {
    /// The job this process belongs to, as the events, the report and the published
    /// record name it: the name of `CUDABUDGET_SCOPE=job:<name>`, or, for the processes
    /// that share HAMi's budget through its shared cache, that file.
    pub fn job(&self) -> Option<&str> {
        match &self.scope {
            Scope::Job(name) => Some(name),
            Scope::Process => self.hami_shared_cache.as_deref(),
        }
    }

    /// Reads the process environment. A non-UTF-8 value of a variable this crate reads
    /// is an error; everything else in the environment is ignored.
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::from_vars_os(std::env::vars_os())
    }

    /// [`Config::from_vars`] for raw environment pairs (what `from_env` and the CLI have).
    pub fn from_vars_os(
        vars: impl IntoIterator<Item = (OsString, OsString)>,
    ) -> Result<Config, ConfigError> {
        // Lossy conversion is safe for validation: U+FFFD is rejected by every grammar
        // we read, and values we ignore (CUDABUDGET_LIB, shadowed HAMi) never matter.
        let vars: Vec<(String, String, bool)> = vars
            .into_iter()
            .map(|(name, value)| {
                let utf8 = value.to_str().is_some();
                (
                    name.to_string_lossy().into_owned(),
                    value.to_string_lossy().into_owned(),
                    utf8,
                )
            })
            .collect();
        Config::from_vars(vars.iter().map(|(n, v, _)| (n.as_str(), v.as_str()))).map_err(
            |mut error| {
                let raw = vars.iter().find(|(n, _, _)| *n == error.variable);
                if raw.is_some_and(|(_, _, utf8)| !utf8) {
                    error.reason = "the value is not valid UTF-8".to_string();
                }
                error
            },
        )
    }

    /// The pure core: `vars` are (name, value) pairs as in the environment. When a
    /// name repeats, the first wins, as with `getenv`.
    pub fn from_vars<'a>(
        vars: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Config, ConfigError> {
        let mut ours: BTreeMap<&str, (Variable, &str)> = BTreeMap::new();
        let mut hami_cache: Option<&str> = None;
        let mut places: BTreeMap<&str, &str> = BTreeMap::new();
        let mut visible: Option<&str> = None;
        let mut unknown: BTreeMap<&str, &str> = BTreeMap::new();
        let mut pod: BTreeMap<&str, &str> = BTreeMap::new();
        for (name, value) in vars {
            if POD_VARIABLES.contains(&name) {
                pod.entry(name).or_insert(value);
                continue;
            }
            if name == HAMI_SHARED_CACHE {
                hami_cache.get_or_insert(value);
                continue;
            }
            if name == CUDA_VISIBLE_DEVICES {
                visible.get_or_insert(value);
                continue;
            }
            if name == "XDG_RUNTIME_DIR" || name == "HOME" {
                places.entry(name).or_insert(value);
                continue;
            }
            if ours.contains_key(name) {
                continue;
            }
            match Variable::classify(name) {
                Ok(Some(Variable::Unknown)) => {
                    unknown.entry(name).or_insert(value);
                }
                Ok(Some(variable)) => {
                    ours.insert(name, (variable, value));
                }
                Ok(None) => {}
                Err(reason) => return Err(error(name, value, reason)),
            }
        }
        let mut config = Config {
            default_limit: None,
            device_limits: Vec::new(),
            hami_default_limit: None,
            hami_device_limits: Vec::new(),
            log: LogLevel::default(),
            source: Source::None,
            context_memory: None,
            scope: Scope::Process,
            on_exceed: OnExceed::Fail,
            hami_shared_cache: None,
            job_dirs: Vec::new(),
            runtime_dirs: Vec::new(),
            events: None,
            cuda_visible_devices: None,
            unknown: Vec::new(),
            pod: PodNames::default(),
        };
        let fallbacks = crate::place::fallback_roots(|name| places.get(name).copied());
        let mut job_dir = PathBuf::from(DEFAULT_SHARED_DIR);
        let mut runtime_dir = PathBuf::from(DEFAULT_SHARED_DIR);
        let mut device_limits = BTreeMap::new();
        let mut hami_device_limits = BTreeMap::new();
        for (&name, &(variable, value)) in &ours {
            let fail = |reason: String| error(name, value, reason);
            match variable {
                Variable::Limit => {
                    config.default_limit = Some(parse_limit(value).map_err(|e| fail(e.reason))?);
                }
                Variable::DeviceLimit(n) => {
                    device_limits.insert(n, parse_limit(value).map_err(|e| fail(e.reason))?);
                }
                Variable::Log => config.log = value.parse().map_err(fail)?,
                Variable::Scope => config.scope = parse_scope(value).map_err(fail)?,
                Variable::OnExceed => config.on_exceed = parse_on_exceed(value).map_err(fail)?,
                Variable::Lib | Variable::Ignored | Variable::Unknown => {}
                Variable::JobDir | Variable::RuntimeDir => {
                    if !trim(value).starts_with('/') {
                        return Err(fail("use an absolute directory, e.g. /dev/shm".to_string()));
                    }
                    let dir = PathBuf::from(trim(value));
                    if variable == Variable::JobDir {
                        job_dir = dir;
                    } else {
                        runtime_dir = dir;
                    }
                }
                Variable::Events => {
                    if trim(value).is_empty() {
                        return Err(fail("empty value; use a file path".to_string()));
                    }
                    config.events = Some(PathBuf::from(trim(value)));
                }
                Variable::ContextMemory => {
                    config.context_memory = match parse_limit(value).map_err(|e| fail(e.reason))? {
                        Limit::Bytes(bytes) => Some(bytes),
                        Limit::Percent(_) => {
                            return Err(fail("a size in bytes, not a percentage".to_string()));
                        }
                    };
                }
                // HAMi's variables are read whether or not ours are set: a platform that
                // forces HAMi's budget is not undone by a user adding one of ours.
                Variable::HamiLimit => {
                    config.hami_default_limit = parse_hami(value).map_err(|e| fail(e.reason))?;
                }
                // HAMi-core: a per-device 0 falls back to the default, not to "no limit".
                Variable::HamiDeviceLimit(n) => {
                    if let Some(bytes) = parse_hami(value).map_err(|e| fail(e.reason))? {
                        hami_device_limits.insert(n, bytes);
                    }
                }
            }
        }
        config.device_limits = device_limits.into_iter().collect();
        config.hami_device_limits = hami_device_limits.into_iter().collect();
        let has_ours = config.default_limit.is_some() || !config.device_limits.is_empty();
        let has_hami = config.hami_default_limit.is_some() || !config.hami_device_limits.is_empty();
        // A job's ledger has no fallback outside its directory: a place that depends on
        // a member's own environment ($HOME, $XDG_RUNTIME_DIR) could differ between
        // members and split the job (the names in the directory itself are tried first).
        config.job_dirs = vec![job_dir];
        config.runtime_dirs = std::iter::once(runtime_dir).chain(fallbacks).collect();
        if has_hami {
            config.hami_shared_cache = hami_cache
                .filter(|v| !trim(v).is_empty())
                .map(str::to_string);
        }
        config.cuda_visible_devices = visible.map(str::to_string);
        let named = |name: &str| pod.get(name).map(|v| v.to_string());
        config.pod = PodNames {
            pod_name: named("POD_NAME"),
            pod_namespace: named("POD_NAMESPACE"),
            container_name: named("CONTAINER_NAME"),
            in_kubernetes: pod.contains_key("KUBERNETES_SERVICE_HOST"),
            hostname: named("HOSTNAME"),
        };
        config.source = match (has_ours, has_hami) {
            (false, false) => Source::None,
            (true, false) => Source::Cudabudget,
            (false, true) => Source::Hami,
            (true, true) => Source::Both,
        };
        // A name this release does not know is a newer release's, or a typo. Beside a
        // valid budget the process is budgeted whatever it meant, and runs; alone it may
        // be the budget itself misspelt, and a budget must never be silently dropped.
        if let Some((&name, &value)) = unknown.iter().next()
            && config.is_unbudgeted()
        {
            return Err(error(name, value, "no budget is set beside it".to_string()));
        }
        config.unknown = unknown.into_keys().map(str::to_string).collect();
        Ok(config)
    }

    /// The budget for device ordinal `dev`, the most restrictive of what is given: ours
    /// (its own variable, else the default) and HAMi's (likewise), the smaller winning
    /// once the device's size is known. `None`: unbudgeted.
    pub fn limit_for(&self, dev: u32) -> Option<DeviceLimit> {
        let ours = self
            .device_limits
            .iter()
            .find(|(n, _)| *n == dev)
            .map(|(_, limit)| *limit)
            .or(self.default_limit);
        let hami = self
            .hami_device_limits
            .iter()
            .find(|(n, _)| *n == dev)
            .map(|(_, bytes)| *bytes)
            .or(self.hami_default_limit);
        (ours.is_some() || hami.is_some()).then_some(DeviceLimit { ours, hami })
    }

    /// The budget of a device that no per-device variable names. `None`: such a device
    /// is unbudgeted.
    pub fn limit_for_others(&self) -> Option<DeviceLimit> {
        let (ours, hami) = (self.default_limit, self.hami_default_limit);
        (ours.is_some() || hami.is_some()).then_some(DeviceLimit { ours, hami })
    }

    /// The one line that names the `CUDABUDGET_*` variables this release does not know
    /// and ignored (beside a valid budget), with the known ones; `None` when there are
    /// none. Without the `cudabudget: ` that starts every line (the caller's to add);
    /// control characters escaped.
    pub fn unknown_warning(&self) -> Option<String> {
        let (first, rest) = self.unknown.split_first()?;
        let mut names = first.escape_debug().to_string();
        for name in rest {
            names.push_str(", ");
            names.push_str(&name.escape_debug().to_string());
        }
        let (what, ignored) = if rest.is_empty() {
            ("is not a known variable", "is ignored")
        } else {
            ("are not known variables", "are ignored")
        };
        Some(format!(
            "{names} {what} (a newer release's, or a typo) and {ignored}; the \
             budget set here applies; known variables: {KNOWN_VARIABLES}"
        ))
    }

    /// True when no budget at all is configured: the library then passes everything
    /// through.
    pub fn is_unbudgeted(&self) -> bool {
        self.default_limit.is_none()
            && self.device_limits.is_empty()
            && self.hami_default_limit.is_none()
            && self.hami_device_limits.is_empty()
    }
}

fn error(variable: &str, value: &str, reason: String) -> ConfigError {
    ConfigError {
        variable: variable.to_string(),
        value: value.to_string(),
        reason,
    }
}

impl ConfigError {
    /// The middle of the message, without the "cudabudget: " prefix and without saying
    /// what happens next, so the CLI can end it with its own consequence.
    pub fn problem(&self) -> String {
        let variable = self.variable.escape_debug();
        let value = &self.value;
        let reason = &self.reason;
        let (what, remedy) = match Variable::classify(&self.variable) {
            Err(_) | Ok(None) | Ok(Some(Variable::Unknown)) => (
                "is not a known variable",
                format!("known variables: {KNOWN_VARIABLES}"),
            ),
            Ok(Some(variable)) if variable.is_budget() => (
                "is not a valid budget",
                "use bytes or a quantity such as 20Gi, 512Mi, 8GB or 40%".to_string(),
            ),
            Ok(Some(variable)) if variable.is_hami() => (
                "is not a valid budget",
                "use a whole number of bytes with an optional k, m or g suffix, such as 8192m or 8g"
                    .to_string(),
            ),
            Ok(Some(Variable::Log)) => (
                "is not a valid log level",
                "use off, error, warn, info or debug".to_string(),
            ),
            Ok(Some(Variable::Scope)) => (
                "is not a valid scope",
                "use process or job:<name>".to_string(),
            ),
            Ok(Some(Variable::OnExceed)) => (
                "is not a valid policy",
                "use fail, warn or wait:<duration>, e.g. wait:30s".to_string(),
            ),
            Ok(Some(_)) => ("cannot be used", format!("unset {variable}")),
        };
        format!("{variable}={value:?} {what} ({reason}); {remedy}")
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cudabudget: {}; CUDA is disabled for this process",
            self.problem()
        )
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: u64 = 1 << 30;

    fn config(vars: &[(&str, &str)]) -> Config {
        match Config::from_vars(vars.iter().copied()) {
            Ok(config) => config,
            Err(e) => panic!("{vars:?} refused: {e}"),
        }
    }

    #[test]
    fn the_pods_names_are_read_with_the_configuration_first_value_standing() {
        let c = config(&[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("POD_NAME", "trainer-0"),
            ("POD_NAME", "shadowed"),
            ("POD_NAMESPACE", "ml"),
            ("KUBERNETES_SERVICE_HOST", "10.0.0.1"),
            ("HOSTNAME", "trainer-0-host"),
        ]);
        assert_eq!(c.pod.pod_name.as_deref(), Some("trainer-0"));
        assert_eq!(c.pod.pod_namespace.as_deref(), Some("ml"));
        assert_eq!(c.pod.container_name, None);
        assert!(c.pod.in_kubernetes);
        assert_eq!(c.pod.hostname.as_deref(), Some("trainer-0-host"));
        assert_eq!(config(&[]).pod, PodNames::default());
    }

    fn refused(vars: &[(&str, &str)]) -> ConfigError {
        match Config::from_vars(vars.iter().copied()) {
            Ok(config) => panic!("{vars:?} accepted as {config:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn an_empty_environment_is_unbudgeted_with_default_logging() {
        let c = config(&[("PATH", "/bin"), ("HOME", "/root")]);
        assert!(c.is_unbudgeted());
        assert_eq!(c.source, Source::None);
        assert_eq!(c.log, LogLevel::Warn);
        assert_eq!(c.limit_for(0), None);
    }

    fn ours(limit: Limit) -> Option<DeviceLimit> {
        Some(DeviceLimit {
            ours: Some(limit),
            hami: None,
        })
    }

    fn hami(bytes: u64) -> Option<DeviceLimit> {
        Some(DeviceLimit {
            ours: None,
            hami: Some(bytes),
        })
    }

    #[test]
    fn the_default_budget_applies_to_every_device() {
        let c = config(&[("CUDABUDGET_LIMIT", "20Gi")]);
        assert_eq!(c.source, Source::Cudabudget);
        assert_eq!(c.limit_for(0), ours(Limit::Bytes(20 * GI)));
        assert_eq!(c.limit_for(1023), ours(Limit::Bytes(20 * GI)));
        assert!(!c.is_unbudgeted());
    }

    #[test]
    fn a_per_device_budget_overrides_the_default() {
        let c = config(&[
            ("CUDABUDGET_LIMIT_3", "40%"),
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("CUDABUDGET_LIMIT_1", "4Gi"),
        ]);
        assert_eq!(c.limit_for(1), ours(Limit::Bytes(4 * GI)));
        assert_eq!(c.limit_for(3), ours(Limit::Percent(4000)));
        assert_eq!(c.limit_for(0), ours(Limit::Bytes(8 * GI)));
        assert_eq!(
            c.device_limits,
            vec![(1, Limit::Bytes(4 * GI)), (3, Limit::Percent(4000))]
        );
    }

    #[test]
    fn a_per_device_budget_alone_leaves_other_devices_unbudgeted() {
        let c = config(&[("CUDABUDGET_LIMIT_0", "0")]);
        assert_eq!(c.limit_for(0), ours(Limit::Bytes(0)));
        assert_eq!(c.limit_for(1), None);
        assert_eq!(c.limit_for_others(), None);
        assert!(!c.is_unbudgeted());
        assert_eq!(c.source, Source::Cudabudget);
    }

    #[test]
    fn the_first_of_repeated_names_wins_like_getenv() {
        let c = config(&[("CUDABUDGET_LIMIT", "1Gi"), ("CUDABUDGET_LIMIT", "2Gi")]);
        assert_eq!(c.default_limit, Some(Limit::Bytes(GI)));
    }

    #[test]
    fn hami_variables_alone_set_the_budget() {
        let c = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "8192m"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "2g"),
        ]);
        assert_eq!(c.source, Source::Hami);
        assert_eq!(c.limit_for(0), hami(8 * GI));
        assert_eq!(c.limit_for(1), hami(2 * GI));
        assert_eq!(c.limit_for(1).unwrap().fixed(), Some(2 * GI));
        assert_eq!(c.limit_for_others(), hami(8 * GI));
    }

    #[test]
    fn hamis_default_budgets_every_device_none_of_ours_names() {
        // The reproduction of issue 25, item 9: ours names device 0 only.
        for ours_var in [("CUDABUDGET_LIMIT_0", "4Gi"), ("CUDABUDGET_LIMIT_2", "4Gi")] {
            let c = config(&[("CUDA_DEVICE_MEMORY_LIMIT", "1g"), ours_var]);
            assert_eq!(c.source, Source::Both);
            for dev in [0, 1, 2, 63] {
                let limit = c.limit_for(dev).expect("every device has a budget");
                assert_eq!(limit.resolve(80 * GI), GI, "device {dev}: {ours_var:?}");
            }
            assert_eq!(c.limit_for_others().unwrap().fixed(), Some(GI));
        }
    }

    #[test]
    fn where_both_name_a_device_the_smaller_budget_wins() {
        let c = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "2g"),
            ("CUDABUDGET_LIMIT_1", "3Gi"),
            ("CUDA_DEVICE_MEMORY_LIMIT_2", "8g"),
            ("CUDABUDGET_LIMIT_2", "3Gi"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "6g"),
            ("CUDABUDGET_LIMIT", "5Gi"),
        ]);
        assert_eq!(c.limit_for(1).unwrap().fixed(), Some(2 * GI));
        assert_eq!(c.limit_for(2).unwrap().fixed(), Some(3 * GI));
        // Ours per device against HAMi's default, and the two defaults.
        assert_eq!(c.limit_for(0).unwrap().fixed(), Some(5 * GI));
        let c = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("CUDABUDGET_LIMIT_0", "6Gi"),
        ]);
        assert_eq!(c.limit_for(0).unwrap().fixed(), Some(4 * GI));
        // HAMi's per-device budget against our default.
        let c = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"),
            ("CUDABUDGET_LIMIT", "6Gi"),
        ]);
        assert_eq!(c.limit_for(0).unwrap().fixed(), Some(GI));
        assert_eq!(c.limit_for(1).unwrap().fixed(), Some(6 * GI));
    }

    #[test]
    fn a_percentage_against_hamis_bytes_is_resolved_with_the_device_s_size() {
        let c = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "10g"),
            ("CUDABUDGET_LIMIT", "10%"),
        ]);
        let limit = c.limit_for(0).unwrap();
        assert_eq!(limit.fixed(), None, "the size decides which is smaller");
        assert_eq!(limit.resolve(80 * GI), 8 * GI);
        assert_eq!(limit.resolve(200 * GI), 10 * GI);
        assert_eq!(
            limit.to_string(),
            "the smaller of 10.00% of the device and 10.00 GiB (HAMi)"
        );
        assert_eq!(c.limit_for_others(), Some(limit));
    }

    #[test]
    fn ours_alone_ignores_nothing_and_adds_nothing() {
        let c = config(&[
            ("CUDABUDGET_LIMIT", "6Gi"),
            ("CUDA_DEVICE_MEMORY_LIMIT_X", "whatever"),
        ]);
        assert_eq!(c.source, Source::Cudabudget);
        assert_eq!(c.limit_for(5), ours(Limit::Bytes(6 * GI)));
        assert_eq!(c.limit_for(5).unwrap().to_string(), "6.00 GiB");
    }

    #[test]
    fn a_malformed_hami_value_is_refused_even_beside_ours() {
        for ours_var in [("CUDABUDGET_LIMIT", "1Gi"), ("CUDABUDGET_LIMIT_2", "1Gi")] {
            let e = refused(&[("CUDA_DEVICE_MEMORY_LIMIT", "not even valid"), ours_var]);
            assert_eq!(e.variable, "CUDA_DEVICE_MEMORY_LIMIT");
        }
    }

    #[test]
    fn hami_zero_means_no_limit() {
        let c = config(&[("CUDA_DEVICE_MEMORY_LIMIT", "0")]);
        assert!(c.is_unbudgeted());
        assert_eq!(c.source, Source::None);
        // A per-device 0 falls back to the default, as in HAMi-core.
        let c = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "0"),
        ]);
        assert_eq!(c.limit_for(1), hami(GI));
        let c = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "0"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "1g"),
        ]);
        assert_eq!(c.limit_for(0), None);
        assert_eq!(c.limit_for(1), hami(GI));
        // HAMi's 0 leaves ours as it is.
        let c = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "0"),
            ("CUDABUDGET_LIMIT_1", "1Gi"),
        ]);
        assert_eq!(c.source, Source::Cudabudget);
        assert_eq!(c.limit_for(0), None);
    }

    #[test]
    fn places_are_carried_trimmed() {
        let c = config(&[
            ("CUDABUDGET_JOB_DIR", " /dev/shm\t"),
            ("CUDABUDGET_RUNTIME_DIR", "\n/run/cb "),
            ("CUDABUDGET_EVENTS", " /var/log/cb/events.jsonl "),
            ("HOME", "/home/alice"),
        ]);
        assert_eq!(c.job_dirs[0], PathBuf::from("/dev/shm"));
        assert_eq!(c.runtime_dirs[0], PathBuf::from("/run/cb"));
        assert_eq!(c.events, Some(PathBuf::from("/var/log/cb/events.jsonl")));
        assert_eq!(c.job_dirs.len(), 1, "a job's place never depends on $HOME");
        assert_eq!(c.runtime_dirs[1], PathBuf::from("/home/alice/.cache"));
        refused(&[("CUDABUDGET_JOB_DIR", " dev/shm")]);
        refused(&[("CUDABUDGET_EVENTS", "  ")]);
    }

    #[test]
    fn malformed_hami_values_are_refused() {
        let e = refused(&[("CUDA_DEVICE_MEMORY_LIMIT", "8Gi")]);
        assert_eq!(e.variable, "CUDA_DEVICE_MEMORY_LIMIT");
        assert!(e.to_string().contains("8192m"), "{e}");
        refused(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "")]);
        // Names that are not `_<ordinal>` belong to HAMi, not to us.
        config(&[("CUDA_DEVICE_MEMORY_LIMIT_X", "whatever")]);
    }

    #[test]
    fn log_levels_parse_case_insensitively() {
        for (text, level) in [
            ("off", LogLevel::Off),
            ("ERROR", LogLevel::Error),
            ("Warn", LogLevel::Warn),
            ("info", LogLevel::Info),
            (" debug\n", LogLevel::Debug),
        ] {
            assert_eq!(config(&[("CUDABUDGET_LOG", text)]).log, level);
        }
        assert!(LogLevel::Off < LogLevel::Error && LogLevel::Info < LogLevel::Debug);
    }

    #[test]
    fn a_bad_log_level_is_refused() {
        for bad in ["loud", "", "warning", "3"] {
            let e = refused(&[("CUDABUDGET_LOG", bad)]);
            assert_eq!(e.variable, "CUDABUDGET_LOG");
            assert!(e.to_string().contains("off, error, warn, info or debug"));
        }
    }

    #[test]
    fn a_job_scope_names_a_job_and_bad_names_are_refused() {
        let c = config(&[("CUDABUDGET_SCOPE", "process"), ("CUDABUDGET_LIMIT", "1Gi")]);
        assert_eq!(c.scope, Scope::Process);
        let c = config(&[
            ("CUDABUDGET_SCOPE", "job:train-1.a_b"),
            ("CUDABUDGET_LIMIT", "1Gi"),
        ]);
        assert_eq!(c.scope, Scope::Job("train-1.a_b".to_string()));
        for bad in [
            "",
            "node",
            "job:",
            "job:a/b",
            "job:.hidden",
            "job:a b",
            &format!("job:{}", "x".repeat(65)),
        ] {
            refused(&[("CUDABUDGET_SCOPE", bad)]);
        }
    }

    #[test]
    fn the_wait_policy_takes_a_duration() {
        assert_eq!(
            config(&[("CUDABUDGET_ON_EXCEED", "fail")]).on_exceed,
            OnExceed::Fail
        );
        let wait = |v| config(&[("CUDABUDGET_ON_EXCEED", v)]).on_exceed;
        assert_eq!(
            wait("wait:30s"),
            OnExceed::Wait(std::time::Duration::from_secs(30))
        );
        assert_eq!(
            wait("wait:1h"),
            OnExceed::Wait(std::time::Duration::from_secs(3600))
        );
        assert_eq!(
            wait("wait:24h"),
            OnExceed::Wait(std::time::Duration::from_secs(86_400))
        );
        assert_eq!(
            wait("wait:250ms"),
            OnExceed::Wait(std::time::Duration::from_millis(250))
        );
        assert_eq!(
            wait("wait:2m"),
            OnExceed::Wait(std::time::Duration::from_secs(120))
        );
        assert_eq!(
            wait("wait:1.5"),
            OnExceed::Wait(std::time::Duration::from_millis(1500))
        );
        for bad in [
            "retry", " ", "wait:", "wait:-1s", "wait:10d", "wait:25h", "wait:x", "wait:.5",
            "warn:1s", "Warn",
        ] {
            let e = refused(&[("CUDABUDGET_ON_EXCEED", bad)]);
            assert!(
                e.to_string().contains("use fail, warn or wait:<duration>"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_warn_policy_admits_past_the_budget() {
        assert_eq!(
            config(&[("CUDABUDGET_ON_EXCEED", " warn\n")]).on_exceed,
            OnExceed::Warn
        );
        assert_eq!(parse_on_exceed("warn"), Ok(OnExceed::Warn));
    }

    #[test]
    fn hamis_shared_cache_is_read_only_with_hamis_budget() {
        let c = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/vgpu/x.cache"),
        ]);
        assert_eq!(c.hami_shared_cache.as_deref(), Some("/tmp/vgpu/x.cache"));
        // Beside ours, HAMi's budget still holds, and so does its sharing.
        let c = config(&[
            ("CUDABUDGET_LIMIT_1", "4Gi"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/vgpu/x.cache"),
        ]);
        assert_eq!(c.hami_shared_cache.as_deref(), Some("/tmp/vgpu/x.cache"));
        let c = config(&[
            ("CUDABUDGET_LIMIT", "4Gi"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/vgpu/x.cache"),
        ]);
        assert_eq!(c.hami_shared_cache, None);
    }

    #[test]
    fn the_job_is_the_scope_s_name_or_hamis_shared_cache() {
        let job = |vars: &[(&str, &str)]| config(vars).job().map(str::to_string);
        assert_eq!(
            job(&[("CUDABUDGET_SCOPE", "job:train")]).as_deref(),
            Some("train")
        );
        assert_eq!(job(&[("CUDABUDGET_SCOPE", "process")]), None);
        assert_eq!(job(&[]), None);
        let hami = [
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/vgpu/x.cache"),
        ];
        assert_eq!(job(&hami).as_deref(), Some("/tmp/vgpu/x.cache"));
    }

    #[test]
    fn cuda_visible_devices_is_kept_as_found() {
        let c = config(&[
            ("CUDA_VISIBLE_DEVICES", "1,GPU-ab"),
            ("CUDA_VISIBLE_DEVICES", "0"),
        ]);
        assert_eq!(c.cuda_visible_devices.as_deref(), Some("1,GPU-ab"));
        assert_eq!(config(&[]).cuda_visible_devices, None);
    }

    #[test]
    fn an_unknown_cudabudget_variable_without_a_budget_is_refused_listing_the_known_ones() {
        // A typo of the limit, alone: the job must not run unbudgeted.
        let e = refused(&[("CUDABUDGET_LIMT", "8Gi")]);
        assert_eq!(e.variable, "CUDABUDGET_LIMT");
        let line = e.to_string();
        assert!(line.contains("is not a known variable"), "{line}");
        assert!(line.contains("CUDABUDGET_LIMIT_<N>"), "{line}");
        assert!(line.contains("CUDABUDGET_ON_EXCEED"), "{line}");
        assert!(
            line.ends_with("CUDA is disabled for this process"),
            "{line}"
        );
        refused(&[("CUDABUDGET_FOO", "1")]);
        refused(&[("CUDABUDGET_", "1")]);
        // Other variables set are not a budget.
        refused(&[("CUDABUDGET_LIMT", "8Gi"), ("CUDABUDGET_LOG", "info")]);
        refused(&[("CUDABUDGET_LIMT", "8Gi"), ("CUDABUDGET_ON_EXCEED", "warn")]);
        // Nor is HAMi's 0, which means no limit.
        refused(&[
            ("CUDABUDGET_LIMT", "8Gi"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "0"),
        ]);
    }

    #[test]
    fn an_unknown_cudabudget_variable_beside_a_valid_budget_is_a_warning_and_the_budget_holds() {
        let c = config(&[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("CUDABUDGET_PRIORITY", "high"),
            ("CUDABUDGET_LIMT", "4Gi"),
        ]);
        assert_eq!(c.limit_for(0), ours(Limit::Bytes(8 * GI)));
        assert_eq!(c.unknown, ["CUDABUDGET_LIMT", "CUDABUDGET_PRIORITY"]);
        let line = c.unknown_warning().expect("a warning");
        assert!(
            line.starts_with("CUDABUDGET_LIMT, CUDABUDGET_PRIORITY are not known variables"),
            "{line}"
        );
        assert!(line.contains("are ignored"), "{line}");
        assert!(
            line.contains("known variables: CUDABUDGET_LIMIT,"),
            "{line}"
        );
        // One name, and any budget: a per-device one, HAMi's.
        for budget in [
            ("CUDABUDGET_LIMIT_1", "2Gi"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "2g"),
        ] {
            let c = config(&[("CUDABUDGET_NEW_KNOB", "1"), budget]);
            let line = c.unknown_warning().expect("a warning");
            assert!(
                line.starts_with("CUDABUDGET_NEW_KNOB is not a known variable"),
                "{line}"
            );
            assert!(line.contains("is ignored"), "{line}");
        }
        // The line stays one line whatever the name.
        let c = config(&[("CUDABUDGET_X\nY", "1"), ("CUDABUDGET_LIMIT", "1Gi")]);
        let line = c.unknown_warning().unwrap();
        assert!(!line.chars().any(char::is_control), "{line:?}");
        // Known variables only: no warning (the webhook sets CUDABUDGET_POD_UID in every
        // budgeted container).
        assert_eq!(
            config(&[("CUDABUDGET_LIMIT", "1Gi")]).unknown_warning(),
            None
        );
        assert_eq!(
            config(&[("CUDABUDGET_LIMIT", "1Gi"), (POD_UID, "0b1c-pod")]).unknown_warning(),
            None
        );
    }

    #[test]
    fn a_bad_value_is_refused_even_beside_an_unknown_variable_and_a_budget() {
        let e = refused(&[
            ("CUDABUDGET_FOO", "1"),
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_LOG", "loud"),
        ]);
        assert_eq!(e.variable, "CUDABUDGET_LOG");
        // A per-device budget for a device that cannot be budgeted is never ignored.
        let e = refused(&[("CUDABUDGET_LIMIT_01", "1Gi"), ("CUDABUDGET_LIMIT", "1Gi")]);
        assert_eq!(e.variable, "CUDABUDGET_LIMIT_01");
    }

    #[test]
    fn per_device_variables_need_a_canonical_ordinal() {
        for name in [
            "CUDABUDGET_LIMIT_01",
            "CUDABUDGET_LIMIT_X",
            "CUDABUDGET_LIMIT_",
            "CUDABUDGET_LIMIT_+1",
            "CUDABUDGET_LIMIT_64",
            "CUDABUDGET_LIMIT_1023",
            "CUDABUDGET_LIMIT_1024",
            "CUDABUDGET_LIMIT_-1",
            "CUDABUDGET_LIMIT_99999999999",
        ] {
            let e = refused(&[(name, "1Gi")]);
            assert_eq!(e.variable, name);
        }
        assert_eq!(
            config(&[("CUDABUDGET_LIMIT_63", "1")]).limit_for(63),
            ours(Limit::Bytes(1))
        );
        // HAMi's variables for a device we cannot budget are refused too.
        let e = refused(&[("CUDA_DEVICE_MEMORY_LIMIT_64", "1g")]);
        assert_eq!(e.variable, "CUDA_DEVICE_MEMORY_LIMIT_64");
        config(&[("CUDA_DEVICE_MEMORY_LIMIT_63", "1g")]);
    }

    #[test]
    fn empty_values_are_refused() {
        for name in ["CUDABUDGET_LIMIT", "CUDABUDGET_LIMIT_0", "CUDABUDGET_LOG"] {
            let e = refused(&[(name, "")]);
            assert!(e.reason.contains("empty"), "{name}: {}", e.reason);
        }
    }

    #[test]
    fn the_library_path_is_left_to_the_cli() {
        let c = config(&[("CUDABUDGET_LIB", "")]);
        assert!(c.is_unbudgeted());
    }

    #[test]
    fn malformed_budgets_are_refused_with_the_variable_named() {
        for bad in ["10XB", "-1G", "150%", "", "18446744073709551616"] {
            let e = refused(&[("CUDABUDGET_LIMIT", bad)]);
            assert_eq!(
                (e.variable.as_str(), e.value.as_str()),
                ("CUDABUDGET_LIMIT", bad)
            );
        }
    }

    #[test]
    fn the_error_line_names_variable_value_reason_and_examples() {
        let e = refused(&[("CUDABUDGET_LIMIT", "10XB")]);
        assert_eq!(
            e.to_string(),
            "cudabudget: CUDABUDGET_LIMIT=\"10XB\" is not a valid budget (unknown unit \"XB\"); \
             use bytes or a quantity such as 20Gi, 512Mi, 8GB or 40%; \
             CUDA is disabled for this process"
        );
    }

    #[test]
    fn the_error_line_stays_one_line_whatever_the_value() {
        let cases: &[(&str, &str)] = &[
            ("CUDABUDGET_LIMIT_2", "8Gi\nrm -rf /"),
            ("CUDABUDGET_LOG", "\u{1b}[31mred"),
            ("CUDABUDGET_X\nY", "1"),
            ("CUDABUDGET_SCOPE", "job:\n"),
        ];
        for (name, value) in cases {
            let line = refused(&[(name, value)]).to_string();
            assert!(line.starts_with("cudabudget: "), "{line}");
            assert!(!line.chars().any(char::is_control), "{line:?}");
        }
    }

    #[test]
    fn non_utf8_values_of_our_variables_are_refused() {
        use std::os::unix::ffi::OsStringExt;
        let raw =
            |name: &str, value: &[u8]| (OsString::from(name), OsString::from_vec(value.to_vec()));
        let e = Config::from_vars_os([raw("CUDABUDGET_LIMIT", b"8G\xffi")]).unwrap_err();
        assert_eq!(e.reason, "the value is not valid UTF-8");
        assert!(e.to_string().contains("CUDABUDGET_LIMIT="));
        // Others' variables, and the CLI's library path, may hold any bytes.
        let c = Config::from_vars_os([
            raw("SOMETHING", b"\xff"),
            raw("CUDABUDGET_LIB", b"/opt/\xff/lib.so"),
            raw("CUDABUDGET_LIMIT", b"1Gi"),
        ])
        .unwrap();
        assert_eq!(c.default_limit, Some(Limit::Bytes(GI)));
    }
}
