//! `cudabudget status`: the budgeted processes of this machine, per job, process and
//! device, with each GPU's physical total and use where NVML can say.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use serde::Serialize;

use crate::gpu::{Nvml, NvmlDevice};
use crate::records;
use crate::tell::{Refusal, usage};

pub const AFTER_HELP: &str = "Shows the processes that run under a budget and publish \
their figures (every budgeted process does, within 0.2 s), for this user, or for every \
user when run as root. Records live in /dev/shm/cudabudget-<uid>/ \
($CUDABUDGET_RUNTIME_DIR instead of /dev/shm when set; $XDG_RUNTIME_DIR or \
$HOME/.cache when another user holds that name). A record is shown only if the user \
whose directory holds it owns the process (or is root) and the process's start time \
matches; text from records is shown escaped (\\e, \\x.., \\u{..}).

--json prints one object:
  {\"processes\": [{\"pid\", \"uid\", \"job\", \"command\", \"namespace\", \"pod\",
   \"container\", \"devices\": [{\"index\", \"uuid\", \"used_bytes\", \"limit_bytes\",
   \"peak_bytes\", \"denials\", \"waits\", \"overruns\", \"physical_total_bytes\",
   \"physical_used_bytes\"}]}],
   \"jobs\": [{\"name\", \"uid\", \"user\", \"processes\", \"used_bytes\",
     \"devices\": [{\"index\", \"used_bytes\", \"limit_bytes\", \"over_budget\"}]}],
   \"gpus\": [{\"index\", \"uuid\", \"name\", \"total_bytes\", \"used_bytes\"}] or null,
   \"skipped\": [\"why a record file was passed over\"]}

Examples:
  cudabudget status
  cudabudget status --json
  cudabudget status --watch 2";

#[derive(Args)]
pub struct StatusArgs {
    /// Print one JSON object (with --watch: one per line, each refresh).
    #[arg(long)]
    json: bool,

    /// Refresh every SECONDS (default 1) until interrupted.
    #[arg(
        long,
        value_name = "SECONDS",
        num_args = 0..=1,
        default_missing_value = "1"
    )]
    watch: Option<f64>,
}

#[derive(Serialize)]
pub struct StatusJson {
    pub processes: Vec<ProcessJson>,
    /// Jobs, each one user's: two users' jobs of one name are two jobs.
    pub jobs: Vec<JobJson>,
    /// Every GPU NVML sees; `null` where NVML is not available.
    pub gpus: Option<Vec<GpuJson>>,
    /// Record files and directories that were passed over (not trusted, not readable),
    /// and why.
    pub skipped: Vec<String>,
}

#[derive(Serialize)]
pub struct ProcessJson {
    pub pid: u32,
    /// The user the process's record speaks for (its directory's owner).
    pub uid: u32,
    pub job: Option<String>,
    pub command: String,
    pub namespace: Option<String>,
    pub pod: Option<String>,
    pub container: Option<String>,
    /// When the process last rewrote its record (milliseconds since the Unix epoch).
    pub updated_ms: u64,
    /// With `pid_namespace`, what tells this process from an earlier one of its pid, or
    /// one of another PID namespace (the exporter's counters follow processes by it).
    #[serde(skip)]
    pub start_time: u64,
    #[serde(skip)]
    pub pid_namespace: u64,
    pub devices: Vec<DeviceJson>,
}

#[derive(Serialize)]
pub struct DeviceJson {
    /// The device ordinal as the process numbers it (after `CUDA_VISIBLE_DEVICES`).
    pub index: u32,
    pub uuid: Option<String>,
    pub used_bytes: u64,
    pub limit_bytes: u64,
    pub peak_bytes: u64,
    pub denials: u64,
    pub waits: u64,
    /// Allocations admitted past the budget (`CUDABUDGET_ON_EXCEED=warn`).
    pub overruns: u64,
    pub physical_total_bytes: Option<u64>,
    pub physical_used_bytes: Option<u64>,
}

#[derive(Serialize)]
pub struct JobJson {
    pub name: String,
    pub uid: u32,
    /// The user's name, where the system knows it.
    pub user: Option<String>,
    pub processes: usize,
    pub used_bytes: u64,
    /// Per device: what the job holds and its budget (as its members publish it), and
    /// whether it holds more (its budget was lowered below its use).
    pub devices: Vec<JobDeviceJson>,
}

#[derive(Serialize)]
pub struct JobDeviceJson {
    pub index: u32,
    pub used_bytes: u64,
    pub limit_bytes: u64,
    pub over_budget: bool,
}

#[derive(Serialize)]
pub struct GpuJson {
    pub index: u32,
    pub uuid: Option<String>,
    pub name: Option<String>,
    pub total_bytes: u64,
    pub used_bytes: u64,
    /// The budgets on the GPU of the processes shown, added up ([`budgets_by_gpu`]).
    pub budgets_bytes: u64,
    /// Whether those budgets add up to more than the GPU has.
    pub overcommitted: bool,
}

/// The budgets on each GPU (by UUID) of `processes`, added up: a job's budget once per
/// job (its members share it: the largest one reports, while a change reaches them),
/// each process's own budget once. A job is one user's in one namespace (a pod's jobs
/// are its namespace's), so two namespaces' jobs of one name are two budgets.
pub fn budgets_by_gpu(processes: &[ProcessJson]) -> BTreeMap<String, u64> {
    let mut jobs: BTreeMap<(&str, u32, Option<&str>, &str), u64> = BTreeMap::new();
    let mut sums: BTreeMap<String, u64> = BTreeMap::new();
    for p in processes {
        for d in &p.devices {
            let Some(uuid) = d.uuid.as_deref() else {
                continue;
            };
            match &p.job {
                Some(job) => {
                    let key = (uuid, p.uid, p.namespace.as_deref(), job.as_str());
                    let budget = jobs.entry(key).or_default();
                    *budget = (*budget).max(d.limit_bytes);
                }
                None => {
                    let sum = sums.entry(uuid.to_string()).or_default();
                    *sum = sum.saturating_add(d.limit_bytes);
                }
            }
        }
    }
    for ((uuid, ..), budget) in jobs {
        let sum = sums.entry(uuid.to_string()).or_default();
        *sum = sum.saturating_add(budget);
    }
    sums
}

/// The figures of every live budgeted process, and of every GPU NVML sees.
pub fn collect(nvml: Option<&Nvml>) -> StatusJson {
    let scan = records::scan(&records::runtime_dirs());
    let gpus = nvml.map(Nvml::devices);
    let physical = |uuid: &Option<String>| -> Option<&NvmlDevice> {
        let uuid = uuid.as_deref()?;
        gpus.as_ref()?
            .iter()
            .find(|g| g.uuid.as_deref() == Some(uuid))
    };
    let processes: Vec<ProcessJson> = scan
        .processes
        .into_iter()
        .map(|records::Shown { uid, record }| ProcessJson {
            pid: record.pid,
            uid,
            job: record.job,
            command: record.command,
            namespace: record.namespace,
            pod: record.pod,
            container: record.container,
            updated_ms: record.updated_ms,
            start_time: record.start_time,
            pid_namespace: record.pid_namespace,
            devices: record
                .devices
                .into_iter()
                .map(|d| {
                    let gpu = physical(&d.uuid);
                    DeviceJson {
                        index: d.ordinal,
                        used_bytes: d.used,
                        limit_bytes: d.budget,
                        peak_bytes: d.peak,
                        denials: d.denials,
                        waits: d.waits,
                        overruns: d.overruns,
                        physical_total_bytes: gpu.map(|g| g.total),
                        physical_used_bytes: gpu.map(|g| g.used),
                        uuid: d.uuid,
                    }
                })
                .collect(),
        })
        .collect();
    let budgets = budgets_by_gpu(&processes);
    StatusJson {
        skipped: scan.skipped,
        jobs: jobs(&processes),
        gpus: gpus.map(|gpus| {
            gpus.into_iter()
                .map(|g| {
                    let budgets_bytes = g
                        .uuid
                        .as_ref()
                        .and_then(|u| budgets.get(u))
                        .copied()
                        .unwrap_or(0);
                    GpuJson {
                        index: g.index,
                        uuid: g.uuid,
                        name: g.name,
                        total_bytes: g.total,
                        used_bytes: g.used,
                        budgets_bytes,
                        overcommitted: budgets_bytes > g.total,
                    }
                })
                .collect()
        }),
        processes,
    }
}

pub fn status(args: StatusArgs) -> Result<ExitCode, Refusal> {
    let interval = match args.watch {
        None => None,
        Some(seconds) if seconds.is_finite() && seconds >= 0.1 => {
            Some(Duration::from_secs_f64(seconds))
        }
        Some(seconds) => {
            return Err(usage(format!(
                "--watch {seconds}: the interval must be at least 0.1 seconds (e.g. --watch 2)"
            )));
        }
    };
    let nvml = Nvml::open().ok();
    let clear = interval.is_some() && !args.json && std::io::stdout().is_terminal();
    loop {
        let status = collect(nvml.as_ref());
        let mut out = std::io::stdout().lock();
        let text = if args.json {
            let mut line = terminal_safe_json(serde_json::to_string(&status).unwrap_or_default());
            line.push('\n');
            line
        } else {
            table(&status)
        };
        if clear {
            let _ = out.write_all(b"\x1b[H\x1b[2J");
        }
        if out
            .write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .is_err()
        {
            return Ok(ExitCode::SUCCESS); // the reader went away (`| head`)
        }
        drop(out);
        match interval {
            Some(interval) => std::thread::sleep(interval),
            None => return Ok(ExitCode::SUCCESS),
        }
    }
}

/// Bytes as the budgets are written: "8.00 GiB".
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut unit = 0;
    let mut scale = 1024u64;
    while unit + 1 < UNITS.len() && n / scale >= 1024 {
        scale *= 1024;
        unit += 1;
    }
    format!("{:.2} {}", n as f64 / scale as f64, UNITS[unit])
}

fn table(status: &StatusJson) -> String {
    let mut rows: Vec<[String; 9]> = vec![[
        "JOB".into(),
        "PID".into(),
        "DEVICE".into(),
        "USED".into(),
        "PEAK".into(),
        "BUDGET".into(),
        "DENIALS".into(),
        "WAITS".into(),
        "COMMAND".into(),
    ]];
    for p in &status.processes {
        let job = p.job.as_deref().map_or_else(|| "-".into(), escape);
        let mut command = escape(&p.command);
        if let Some(pod) = &p.pod {
            let namespace = p.namespace.as_deref().map_or_else(|| "-".into(), escape);
            command = format!("[{namespace}/{}] {command}", escape(pod));
        }
        let command: String = if command.chars().count() > 60 {
            command.chars().take(59).chain(['…']).collect()
        } else {
            command
        };
        if p.devices.is_empty() {
            rows.push([
                job,
                p.pid.to_string(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                command,
            ]);
            continue;
        }
        for d in &p.devices {
            rows.push([
                job.clone(),
                p.pid.to_string(),
                d.index.to_string(),
                bytes(d.used_bytes),
                bytes(d.peak_bytes),
                if p.job.is_none() && d.used_bytes > d.limit_bytes {
                    format!("{} (over budget)", bytes(d.limit_bytes))
                } else {
                    bytes(d.limit_bytes)
                },
                d.denials.to_string(),
                d.waits.to_string(),
                command.clone(),
            ]);
        }
    }
    // Jobs of more than one process get a total line; the user is named when the table
    // holds more than one user's processes.
    let users: BTreeSet<u32> = status.processes.iter().map(|p| p.uid).collect();
    let mut widths = [0usize; 9];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut text = String::new();
    if status.processes.is_empty() {
        text.push_str("no budgeted processes\n");
    } else {
        for row in &rows {
            let mut line = String::new();
            for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
                if i + 1 == row.len() {
                    line.push_str(cell);
                } else if (1..8).contains(&i) {
                    line.push_str(&format!("{cell:>w$}  "));
                } else {
                    line.push_str(&format!("{cell:<w$}  "));
                }
            }
            text.push_str(line.trim_end());
            text.push('\n');
        }
        let over = |j: &&JobJson| j.devices.iter().any(|d| d.over_budget);
        for job in status.jobs.iter().filter(|j| j.processes > 1 || over(j)) {
            let whose = if users.len() > 1 {
                match &job.user {
                    Some(user) => format!(" ({})", escape(user)),
                    None => format!(" (uid {})", job.uid),
                }
            } else {
                String::new()
            };
            let over: String = job
                .devices
                .iter()
                .filter(|d| d.over_budget)
                .map(|d| {
                    format!(
                        ", over its budget of {} on device {}",
                        bytes(d.limit_bytes),
                        d.index
                    )
                })
                .collect();
            text.push_str(&format!(
                "job {}{whose}: {} processes, {} in use{over}\n",
                escape(&job.name),
                job.processes,
                bytes(job.used_bytes)
            ));
        }
    }
    match &status.gpus {
        None => text.push_str("GPUs: NVML is not available here (no physical figures)\n"),
        Some(gpus) => {
            for g in gpus {
                let name = g
                    .name
                    .as_deref()
                    .map(|n| format!(" {}", escape(n)))
                    .unwrap_or_default();
                let over = if g.overcommitted {
                    format!(
                        "; OVER-COMMITTED: budgets add up to {}, {} more than it has",
                        bytes(g.budgets_bytes),
                        bytes(g.budgets_bytes - g.total_bytes)
                    )
                } else {
                    String::new()
                };
                text.push_str(&format!(
                    "GPU {}{name} {}: {} of {} in use{over}\n",
                    g.index,
                    g.uuid.as_deref().map_or_else(|| "(no UUID)".into(), escape),
                    bytes(g.used_bytes),
                    bytes(g.total_bytes)
                ));
            }
        }
    }
    text
}

/// The jobs of `processes`, keyed by user and name.
fn jobs(processes: &[ProcessJson]) -> Vec<JobJson> {
    type Devices = BTreeMap<u32, (u64, u64)>;
    let mut jobs: BTreeMap<(u32, &str), (usize, u64, Devices)> = BTreeMap::new();
    for p in processes {
        if let Some(job) = &p.job {
            let entry = jobs.entry((p.uid, job)).or_default();
            entry.0 += 1;
            entry.1 = entry
                .1
                .saturating_add(p.devices.iter().map(|d| d.used_bytes).sum::<u64>());
            for d in &p.devices {
                let device = entry.2.entry(d.index).or_default();
                device.0 = device.0.saturating_add(d.used_bytes);
                device.1 = device.1.max(d.limit_bytes);
            }
        }
    }
    jobs.into_iter()
        .map(|((uid, name), (processes, used_bytes, devices))| JobJson {
            name: name.to_string(),
            uid,
            user: records::passwd(uid).map(|(name, _)| name),
            processes,
            used_bytes,
            devices: devices
                .into_iter()
                .map(|(index, (used_bytes, limit_bytes))| JobDeviceJson {
                    index,
                    used_bytes,
                    limit_bytes,
                    over_budget: used_bytes > limit_bytes,
                })
                .collect(),
        })
        .collect()
}

/// Characters that must not reach a terminal as they are: C0 controls, DEL and C1
/// controls (escape sequences; U+009B is a CSI on its own), and the invisible marks
/// that reorder text (bidi overrides, embeddings, isolates, marks).
fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

/// `text` fit for a terminal: every unsafe character written out (`\e`, `\a`, `\t`,
/// `\n`, `\r`, `\x7f`, `\u{202e}`...), everything else as it is.
pub fn escape(text: &str) -> String {
    if !text.chars().any(is_unsafe) {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\x1b' => out.push_str("\\e"),
            '\x07' => out.push_str("\\a"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x80 && is_unsafe(c) => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if is_unsafe(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// JSON as serde writes it (C0 controls escaped) with DEL, C1 controls and the bidi
/// marks escaped too (`\u007f`, `\u009b`, `\u202e`): the same values, and nothing a
/// terminal acts on. They can only be inside strings: JSON's own syntax is ASCII.
fn terminal_safe_json(json: String) -> String {
    if !json.chars().any(is_unsafe) {
        return json;
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if is_unsafe(c) {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_for_a_terminal_and_json_keeps_its_values() {
        let text = "\x1b]0;pwned\x07 a\tb \u{7f}\u{9b}31m \u{202e}txt.exe é";
        assert_eq!(
            escape(text),
            "\\e]0;pwned\\a a\\tb \\x7f\\u{9b}31m \\u{202e}txt.exe é"
        );
        assert_eq!(escape("plain"), "plain");
        let json = terminal_safe_json(serde_json::to_string(&[text]).unwrap());
        assert!(!json.chars().any(is_unsafe), "{json}");
        let back: Vec<String> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, [text]);
    }
}
