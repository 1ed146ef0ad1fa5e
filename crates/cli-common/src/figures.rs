//! The figures of the budgeted processes of this machine (what `cudabudget status`
//! shows and `cudabudget-node exporter` serves): per process and device from their
//! records, per job, and each GPU's physical total and use where NVML can say.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::gpu::{Nvml, NvmlDevice};
use crate::records;

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
