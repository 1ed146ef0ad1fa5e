//! `cudabudget status`: the budgeted processes of this machine, per job, process and
//! device, with each GPU's physical total and use where NVML can say.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use serde::Serialize;

use crate::gpu::{Nvml, NvmlDevice};
use crate::record::Record;
use crate::{Refusal, records, usage};

pub const AFTER_HELP: &str = "Shows the processes that run under a budget and publish \
their figures (every budgeted process does, within 0.2 s), for this user, or for every \
user when run as root. Records live in /dev/shm/cudabudget-<uid>/ \
($CUDABUDGET_RUNTIME_DIR instead of /dev/shm when set).

--json prints one object:
  {\"processes\": [{\"pid\", \"job\", \"command\", \"namespace\", \"pod\", \"container\",
   \"devices\": [{\"index\", \"uuid\", \"used_bytes\", \"limit_bytes\", \"peak_bytes\",
   \"denials\", \"waits\", \"physical_total_bytes\", \"physical_used_bytes\"}]}],
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
    /// Every GPU NVML sees; `null` where NVML is not available.
    pub gpus: Option<Vec<GpuJson>>,
    /// Record files and directories that were passed over (not trusted, not readable),
    /// and why.
    pub skipped: Vec<String>,
}

#[derive(Serialize)]
pub struct ProcessJson {
    pub pid: u32,
    pub job: Option<String>,
    pub command: String,
    pub namespace: Option<String>,
    pub pod: Option<String>,
    pub container: Option<String>,
    /// When the process last rewrote its record (milliseconds since the Unix epoch).
    pub updated_ms: u64,
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
    pub physical_total_bytes: Option<u64>,
    pub physical_used_bytes: Option<u64>,
}

#[derive(Serialize)]
pub struct GpuJson {
    pub index: u32,
    pub uuid: Option<String>,
    pub name: Option<String>,
    pub total_bytes: u64,
    pub used_bytes: u64,
}

/// The figures of every live budgeted process, and of every GPU NVML sees.
pub fn collect(nvml: Option<&Nvml>) -> StatusJson {
    let scan = records::scan(&records::runtime_dir());
    let gpus = nvml.map(Nvml::devices);
    let physical = |uuid: &Option<String>| -> Option<&NvmlDevice> {
        let uuid = uuid.as_deref()?;
        gpus.as_ref()?
            .iter()
            .find(|g| g.uuid.as_deref() == Some(uuid))
    };
    let processes = scan
        .processes
        .into_iter()
        .map(|record: Record| ProcessJson {
            pid: record.pid,
            job: record.job,
            command: record.command,
            namespace: record.namespace,
            pod: record.pod,
            container: record.container,
            updated_ms: record.updated_ms,
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
                        physical_total_bytes: gpu.map(|g| g.total),
                        physical_used_bytes: gpu.map(|g| g.used),
                        uuid: d.uuid,
                    }
                })
                .collect(),
        })
        .collect();
    StatusJson {
        skipped: scan.skipped,
        processes,
        gpus: gpus.map(|gpus| {
            gpus.into_iter()
                .map(|g| GpuJson {
                    index: g.index,
                    uuid: g.uuid,
                    name: g.name,
                    total_bytes: g.total,
                    used_bytes: g.used,
                })
                .collect()
        }),
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
            let mut line = serde_json::to_string(&status).unwrap_or_default();
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
        let job = p.job.clone().unwrap_or_else(|| "-".into());
        let mut command = p.command.clone();
        if let Some(pod) = &p.pod {
            let namespace = p.namespace.as_deref().unwrap_or("-");
            command = format!("[{namespace}/{pod}] {command}");
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
                bytes(d.limit_bytes),
                d.denials.to_string(),
                d.waits.to_string(),
                command.clone(),
            ]);
        }
    }
    // Jobs of more than one process get a total line.
    let mut jobs: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for p in &status.processes {
        if let Some(job) = &p.job {
            let entry = jobs.entry(job).or_default();
            entry.0 += 1;
            entry.1 += p.devices.iter().map(|d| d.used_bytes).sum::<u64>();
        }
    }
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
        for (job, (count, used)) in jobs.iter().filter(|(_, (count, _))| *count > 1) {
            text.push_str(&format!(
                "job {job}: {count} processes, {} in use\n",
                bytes(*used)
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
                    .map(|n| format!(" {n}"))
                    .unwrap_or_default();
                text.push_str(&format!(
                    "GPU {}{name} {}: {} of {} in use\n",
                    g.index,
                    g.uuid.as_deref().unwrap_or("(no UUID)"),
                    bytes(g.used_bytes),
                    bytes(g.total_bytes)
                ));
            }
        }
    }
    text
}
