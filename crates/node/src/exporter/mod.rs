//! `cudabudget-node exporter`: the figures `status` shows, as Prometheus metrics at
//! `/metrics` (text exposition format 0.0.4), read afresh at every scrape.
//!
//! # Series
//! One series per container, job and device by default: labels `namespace`, `pod`,
//! `container` (the workload's, from its environment; empty outside Kubernetes),
//! `budget_uid` and `budget_job` (the user and job whose budget it is: a job is one
//! user's, so two users' jobs of one name are two series; `budget_job` is empty for
//! processes budgeted on their own), `device_index` and `device_uuid`. Never `job`,
//! which is Prometheus' target label. Pids churn and commands can carry secrets, so the
//! per-process series (`pid`) and `cudabudget_process_info` (`command`) are served only
//! with `--per-process`; the metric names stay the same, so queries that aggregate by
//! the labels above read both.
//!
//! # How the processes of one series add up
//! - used: the sum of what the processes hold;
//! - limit: the budget the series' processes may fill: a job's budget counted once
//!   (its members share it; the largest a member reports, while a change reaches them),
//!   the budgets of processes outside a job summed (each may fill its own);
//! - peak: the sum of the processes' own peaks, an upper bound of the series' peak
//!   (exact for one process; the peaks need not have come at once);
//! - denials, waits and overruns: summed, and kept counting the processes that have exited while
//!   the series lives (counters never go back when a member leaves; a series whose
//!   last process left starts again from its live processes, as a reset).
//!
//! A job whose members run in several containers (one node's pods sharing the job
//! directory) has one series per container, each with the job's whole budget: its
//! fullness is `sum by (budget_uid, budget_job, device_uuid)` of used over
//! `max by (...)` of limit, and the budgets on a device add up with each job's counted
//! once (deploy/grafana's dashboard and alerts do so).

mod serve;
mod web_config;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use prometheus::{Encoder, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::figures::{self, ProcessJson, StatusJson};
use crate::gpu::Nvml;
use crate::tell::{Refusal, say, usage};

pub const AFTER_HELP: &str = "Metrics (one series per container, job and device; with \
--per-process, per process and device):
  cudabudget_memory_used_bytes, cudabudget_memory_limit_bytes,
  cudabudget_memory_peak_bytes, cudabudget_denials_total, cudabudget_waits_total,
  cudabudget_overruns_total (allocations admitted past the budget with
  CUDABUDGET_ON_EXCEED=warn)
    labels: namespace, pod, container, budget_uid, budget_job, device_index,
    device_uuid (and pid with --per-process); never job, Prometheus' own
  cudabudget_process_info (1; with --per-process only: the labels above and command)
  cudabudget_processes (live budgeted processes)
  cudabudget_gpu_memory_total_bytes, cudabudget_gpu_memory_used_bytes
    (NVML's physical figures; labels: gpu_index, device_uuid)
  cudabudget_gpu_budgets_bytes (the budgets on the GPU added up, a job's once; above
    the total, the GPU is over-committed; same labels)
Processes of one series add up: used is their sum; limit counts a job's budget once
(its members share it) and sums the budgets of processes outside a job (each may fill
its own); peak is the sum of their own peaks (an upper bound, exact for one process);
denials, waits and overruns are summed and keep the counts of processes that exited
while the series lives. A job spread over several containers has each container's series carry
its whole budget: aggregate with max by (budget_uid, budget_job, device_uuid).
Processes outside Kubernetes have empty namespace, pod and container.
With --hami-names also HAMi's vGPU_device_memory_usage_in_bytes and
vGPU_device_memory_limit_in_bytes (labels: podnamespace, podname, ctrname,
vdeviceid, deviceuuid, zone), per container and device, jobs and users added up.

Under abuse: a request's head must arrive within --read-timeout (also how long an
idle keep-alive connection is kept), in at most 16 KiB and 64 header lines; bodies
are never read; beyond --max-connections-per-client from one client (an IPv4
address, an IPv6 /64), or --max-connections in all (a few more for clients that
hold none), a new connection is closed at once. /healthz answers 200 without
authentication; a client's password checks run one at a time, and credentials
once verified cost no further check.

On a loopback address without basic_auth_users or verified client certificates
(the default 127.0.0.1:9464), a local user's scrape gets only the series of their
own budgets (the owner of the client's socket, as the kernel records it); root's
and the exporter's own user's get every series. Other addresses serve every series.

TLS and basic authentication: --web-config-file FILE, in the format of Prometheus'
exporter-toolkit (tls_server_config: cert_file, key_file, client_auth_type,
client_ca_file, min_version, max_version; basic_auth_users: NAME: BCRYPT-HASH;
http_server_config: headers). A key it does not know refuses the start.

Examples:
  cudabudget-node exporter --listen 127.0.0.1:9464
  cudabudget-node exporter --listen 0.0.0.0:9464 --hami-names
  cudabudget-node exporter --listen 127.0.0.1:9464 --per-process
  cudabudget-node exporter --listen 0.0.0.0:9464 --web-config-file /etc/cudabudget/web.yml";

#[derive(Args)]
pub struct ExporterArgs {
    /// Address and port to serve /metrics on (port 0: any free port, printed at start).
    #[arg(long, value_name = "ADDR:PORT", default_value = "127.0.0.1:9464")]
    listen: String,

    /// One series per process (label pid) instead of per container, and
    /// cudabudget_process_info with each command line: commands can carry secrets, and
    /// pids make a series per process start.
    #[arg(long = "per-process")]
    per_process: bool,

    /// Also export HAMi's metric names, so dashboards made for HAMi keep working.
    #[arg(long = "hami-names")]
    hami_names: bool,

    /// TLS and basic authentication, as Prometheus' exporter-toolkit configures them.
    #[arg(long = "web-config-file", value_name = "FILE")]
    web_config_file: Option<PathBuf>,

    /// Seconds a client has to send a request's head; also how long an idle
    /// keep-alive connection is kept.
    #[arg(long = "read-timeout", value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    read_timeout: u64,

    /// Connections served at once; beyond, a new one is closed at once (lowered to fit
    /// the descriptor limit).
    #[arg(long = "max-connections", value_name = "N", default_value_t = 8192,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections: u64,

    /// Connections served at once from one client (an IPv4 address, an IPv6 /64);
    /// beyond, its new one is closed at once.
    #[arg(long = "max-connections-per-client", value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections_per_client: u64,
}

/// The labels of a series, in the order they are served.
const LABELS: [&str; 7] = [
    "namespace",
    "pod",
    "container",
    "budget_uid",
    "budget_job",
    "device_index",
    "device_uuid",
];
const HAMI_LABELS: [&str; 6] = [
    "podnamespace",
    "podname",
    "ctrname",
    "vdeviceid",
    "deviceuuid",
    "zone",
];
/// A process that left a series is remembered on its own this long (a record that is
/// not fresh for a while can come back), then only in its series' total.
const REMEMBERED: Duration = Duration::from_secs(600);

pub fn exporter(args: ExporterArgs) -> Result<ExitCode, Refusal> {
    let config = match &args.web_config_file {
        Some(path) => web_config::load(path).map_err(usage)?,
        None => web_config::WebConfig::default(),
    };
    let listener = std::net::TcpListener::bind(args.listen.as_str()).map_err(|e| {
        usage(format!(
            "--listen {:?}: cannot listen there ({e}); give ADDR:PORT, e.g. 127.0.0.1:9464",
            args.listen
        ))
    })?;
    let address = listener
        .local_addr()
        .map_or_else(|_| args.listen.clone(), |a| a.to_string());
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    say(format!(
        "exporter listening on {scheme}://{address}/metrics"
    ));
    let shape = Shape {
        per_process: args.per_process,
        hami_names: args.hami_names,
    };
    let gather = serve::gatherer(move || {
        let nvml = Nvml::open().ok();
        let counters = RefCell::new(Counters::default());
        move |viewers: &[serve::Viewer]| {
            views(
                &figures::collect(nvml.as_ref()),
                shape,
                &mut counters.borrow_mut(),
                Instant::now(),
                viewers,
            )
        }
    });
    // A loopback listener without passwords (the default): each local user sees their
    // own series only.
    let per_user = listener.local_addr().is_ok_and(|a| a.ip().is_loopback())
        && config.users.is_empty()
        && !config.verifies_clients;
    // SAFETY: geteuid has no preconditions.
    let own_uid = unsafe { libc::geteuid() };
    let server = crate::http::Server {
        name: "exporter",
        listener,
        tls: match config.tls {
            Some(tls) => crate::http::Tls::Fixed(tls),
            None => crate::http::Tls::Plain,
        },
        limits: crate::http::Limits {
            max_connections: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
            per_client: usize::try_from(args.max_connections_per_client).unwrap_or(usize::MAX),
            read_timeout: Duration::from_secs(args.read_timeout),
            max_body: 0,
        },
        users: config.users,
        headers: config.headers,
    };
    let site = serve::Metrics {
        gather,
        per_user,
        own_uid,
    };
    crate::http::serve(server, site).map_err(|message| Refusal { message, status: 1 })?;
    Ok(ExitCode::SUCCESS)
}

/// What is served besides the metrics every exporter serves.
#[derive(Clone, Copy, Debug, Default)]
pub struct Shape {
    /// A series per process (`pid`), and `cudabudget_process_info` with the command.
    pub per_process: bool,
    /// HAMi's names beside the project's own.
    pub hami_names: bool,
}

/// The labels of one series: a container's processes of one user and job on one device
/// (with `--per-process`, one process's).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Series {
    namespace: String,
    pod: String,
    container: String,
    uid: u32,
    job: Option<String>,
    index: u32,
    uuid: String,
    pid: Option<u32>,
}

impl Series {
    fn of(p: &ProcessJson, d: &figures::DeviceJson, per_process: bool) -> Series {
        let text = |v: &Option<String>| v.clone().unwrap_or_default();
        Series {
            namespace: text(&p.namespace),
            pod: text(&p.pod),
            container: text(&p.container),
            uid: p.uid,
            job: p.job.clone(),
            index: d.index,
            uuid: text(&d.uuid),
            pid: per_process.then_some(p.pid),
        }
    }

    /// The label values, in the order of [`LABELS`] (then `pid`).
    fn values(&self) -> Vec<String> {
        let mut values = vec![
            self.namespace.clone(),
            self.pod.clone(),
            self.container.clone(),
            self.uid.to_string(),
            self.job.clone().unwrap_or_default(),
            self.index.to_string(),
            self.uuid.clone(),
        ];
        values.extend(self.pid.map(|pid| pid.to_string()));
        values
    }
}

/// A series' figures, its processes added up as the module's docs say.
#[derive(Debug, Default)]
struct Figures {
    used: u64,
    peak: u64,
    /// The budgets of processes outside a job, summed.
    own_budgets: u64,
    /// The job's budget (once).
    job_budget: u64,
    denials: u64,
    waits: u64,
    overruns: u64,
}

impl Figures {
    /// A series holds either a job's members or processes outside any job.
    fn limit(&self) -> u64 {
        self.own_budgets.saturating_add(self.job_budget)
    }

    fn add(&mut self, job: bool, d: &figures::DeviceJson) {
        self.used = self.used.saturating_add(d.used_bytes);
        self.peak = self.peak.saturating_add(d.peak_bytes);
        if job {
            self.job_budget = self.job_budget.max(d.limit_bytes);
        } else {
            self.own_budgets = self.own_budgets.saturating_add(d.limit_bytes);
        }
        self.denials = self.denials.saturating_add(d.denials);
        self.waits = self.waits.saturating_add(d.waits);
        self.overruns = self.overruns.saturating_add(d.overruns);
    }
}

/// One process on one device for as long as it lives: its pid alone names nothing (pids
/// are reused, and every PID namespace has its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Member {
    uid: u32,
    pid_namespace: u64,
    pid: u32,
    start_time: u64,
    index: u32,
}

/// (denials, waits, overruns)
type Counts = (u64, u64, u64);

fn add_counts(a: &mut Counts, b: Counts) {
    a.0 = a.0.saturating_add(b.0);
    a.1 = a.1.saturating_add(b.1);
    a.2 = a.2.saturating_add(b.2);
}

/// What keeps a series' counters from going back when one of its processes exits: the
/// last counts of the processes that left it, for as long as the series lives.
#[derive(Default)]
pub struct Counters {
    /// The members of the last gathering, their series and counts.
    live: HashMap<Member, (Series, Counts)>,
    /// Members gone from the records since the instant given: a record that was not
    /// rewritten for a while may come back (then it counts live again).
    departed: HashMap<Member, (Series, Instant, Counts)>,
    /// The counts of members gone for longer than [`REMEMBERED`] (their records are
    /// reaped by then: they cannot come back), per series.
    folded: HashMap<Series, Counts>,
}

impl Counters {
    /// Takes this gathering's members; returns what the departed add to each series.
    fn update(
        &mut self,
        members: HashMap<Member, (Series, Counts)>,
        now: Instant,
    ) -> HashMap<Series, Counts> {
        for (member, (series, counts)) in self.live.drain() {
            if !members.contains_key(&member) {
                self.departed.insert(member, (series, now, counts));
            }
        }
        self.departed
            .retain(|member, _| !members.contains_key(member));
        // A series none of whose processes lives is no longer served: when it comes
        // back, its counters start again (a reset, which Prometheus expects).
        let served: std::collections::HashSet<&Series> =
            members.values().map(|(series, _)| series).collect();
        self.departed
            .retain(|_, (series, _, _)| served.contains(series));
        self.folded.retain(|series, _| served.contains(series));
        let old: Vec<Member> = self
            .departed
            .iter()
            .filter(|(_, (_, since, _))| now.saturating_duration_since(*since) >= REMEMBERED)
            .map(|(member, _)| *member)
            .collect();
        for member in old {
            if let Some((series, _, counts)) = self.departed.remove(&member) {
                add_counts(self.folded.entry(series).or_default(), counts);
            }
        }
        let mut extra = self.folded.clone();
        for (series, _, counts) in self.departed.values() {
            add_counts(extra.entry(series.clone()).or_default(), *counts);
        }
        self.live = members;
        extra
    }
}

/// Every series of `status`, its processes added up; with `counters`, the counts of
/// processes that left a series still served stay in it.
fn series(
    status: &StatusJson,
    per_process: bool,
    counters: Option<(&mut Counters, Instant)>,
) -> BTreeMap<Series, Figures> {
    let mut all: BTreeMap<Series, Figures> = BTreeMap::new();
    let mut members = HashMap::new();
    for p in &status.processes {
        for d in &p.devices {
            let key = Series::of(p, d, per_process);
            all.entry(key.clone()).or_default().add(p.job.is_some(), d);
            let member = Member {
                uid: p.uid,
                pid_namespace: p.pid_namespace,
                pid: p.pid,
                start_time: p.start_time,
                index: d.index,
            };
            members.insert(member, (key, (d.denials, d.waits, d.overruns)));
        }
    }
    if let Some((counters, now)) = counters {
        for (key, (denials, waits, overruns)) in counters.update(members, now) {
            if let Some(figures) = all.get_mut(&key) {
                figures.denials = figures.denials.saturating_add(denials);
                figures.waits = figures.waits.saturating_add(waits);
                figures.overruns = figures.overruns.saturating_add(overruns);
            }
        }
    }
    all
}

fn gauge(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let gauge = IntGaugeVec::new(Opts::new(name, help), labels).expect("a valid metric");
    registry
        .register(Box::new(gauge.clone()))
        .expect("registered once");
    gauge
}

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let counter = IntCounterVec::new(Opts::new(name, help), labels).expect("a valid metric");
    registry
        .register(Box::new(counter.clone()))
        .expect("registered once");
    counter
}

fn clamp(n: u64) -> i64 {
    n.min(i64::MAX as u64) as i64
}

/// The exposition text of `status`; `counters` carries what leaving processes leave in
/// their series from one gathering to the next.
#[cfg(test)]
pub fn metrics(
    status: &StatusJson,
    shape: Shape,
    counters: &mut Counters,
    now: Instant,
) -> Vec<u8> {
    views(status, shape, counters, now, &[None])
        .pop()
        .unwrap_or_default()
}

/// The exposition text of `status` for each viewer: `None` sees every series, `Some(uid)`
/// only those of that user's budgets (and the cards' own figures). The counters move
/// once, with every series.
pub fn views(
    status: &StatusJson,
    shape: Shape,
    counters: &mut Counters,
    now: Instant,
    viewers: &[Option<u32>],
) -> Vec<Vec<u8>> {
    let all = series(status, shape.per_process, Some((counters, now)));
    viewers
        .iter()
        .map(|&viewer| render(status, shape, &all, viewer))
        .collect()
}

/// The exposition text of the series in `all` (the figures of `status`) that `viewer`
/// may see.
fn render(
    status: &StatusJson,
    shape: Shape,
    all: &BTreeMap<Series, Figures>,
    viewer: Option<u32>,
) -> Vec<u8> {
    let seen = |uid: u32| viewer.is_none_or(|v| v == uid);
    let registry = Registry::new();
    let mut labels = LABELS.to_vec();
    if shape.per_process {
        labels.push("pid");
    }
    let used = gauge(
        &registry,
        "cudabudget_memory_used_bytes",
        "Device memory the series' processes hold, as their budgets count it (summed).",
        &labels,
    );
    let limit = gauge(
        &registry,
        "cudabudget_memory_limit_bytes",
        "The budget on the device: a job's once, those of processes outside a job summed.",
        &labels,
    );
    let peak = gauge(
        &registry,
        "cudabudget_memory_peak_bytes",
        "The sum of the processes' own peaks on the device (exact for one process).",
        &labels,
    );
    let denials = counter(
        &registry,
        "cudabudget_denials_total",
        "Allocations refused because they would have crossed the budget.",
        &labels,
    );
    let waits = counter(
        &registry,
        "cudabudget_waits_total",
        "Allocations that waited for room in the budget.",
        &labels,
    );
    let overruns = counter(
        &registry,
        "cudabudget_overruns_total",
        "Allocations admitted past the budget (CUDABUDGET_ON_EXCEED=warn).",
        &labels,
    );
    let processes = gauge(
        &registry,
        "cudabudget_processes",
        "Live processes that run under a budget.",
        &[],
    );
    let shown = || status.processes.iter().filter(|p| seen(p.uid));
    processes
        .with_label_values::<&str>(&[])
        .set(shown().count() as i64);
    for (key, figures) in all.iter().filter(|(key, _)| seen(key.uid)) {
        let values = key.values();
        used.with_label_values(&values).set(clamp(figures.used));
        limit.with_label_values(&values).set(clamp(figures.limit()));
        peak.with_label_values(&values).set(clamp(figures.peak));
        denials.with_label_values(&values).inc_by(figures.denials);
        waits.with_label_values(&values).inc_by(figures.waits);
        overruns.with_label_values(&values).inc_by(figures.overruns);
    }
    if shape.per_process {
        let mut info_labels = labels.clone();
        info_labels.push("command");
        let info = gauge(
            &registry,
            "cudabudget_process_info",
            "A budgeted process (always 1), with its command.",
            &info_labels,
        );
        for p in shown() {
            for d in &p.devices {
                let mut values = Series::of(p, d, true).values();
                values.push(p.command.clone());
                info.with_label_values(&values).set(1);
            }
        }
    }
    if let Some(gpus) = &status.gpus {
        let labels = ["gpu_index", "device_uuid"];
        let total = gauge(
            &registry,
            "cudabudget_gpu_memory_total_bytes",
            "The GPU's physical memory (NVML).",
            &labels,
        );
        let in_use = gauge(
            &registry,
            "cudabudget_gpu_memory_used_bytes",
            "Physical memory in use on the GPU by every process (NVML).",
            &labels,
        );
        // Every user's budgets added up: for a viewer who sees them all.
        let budgets = viewer.is_none().then(|| {
            gauge(
                &registry,
                "cudabudget_gpu_budgets_bytes",
                "The budgets on the GPU added up (a job's once): above \
                 cudabudget_gpu_memory_total_bytes, the GPU is over-committed.",
                &labels,
            )
        });
        for g in gpus {
            let index = g.index.to_string();
            let uuid = g.uuid.clone().unwrap_or_default();
            let values = [index.as_str(), uuid.as_str()];
            total.with_label_values(&values).set(clamp(g.total_bytes));
            in_use.with_label_values(&values).set(clamp(g.used_bytes));
            if let Some(budgets) = &budgets {
                budgets
                    .with_label_values(&values)
                    .set(clamp(g.budgets_bytes));
            }
        }
    }
    if shape.hami_names {
        hami(&registry, status, viewer);
    }
    let mut body = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut body)
        .expect("text encoding cannot fail");
    body
}

/// HAMi's per-container figures: the series of one container and device added up over
/// users and jobs (each job's budget once, as in the series), as HAMi reports them.
fn hami(registry: &Registry, status: &StatusJson, viewer: Option<u32>) {
    let usage = gauge(
        registry,
        "vGPU_device_memory_usage_in_bytes",
        "vGPU device usage (HAMi's name for cudabudget_memory_used_bytes, per container)",
        &HAMI_LABELS,
    );
    let limit = gauge(
        registry,
        "vGPU_device_memory_limit_in_bytes",
        "vGPU device limit (HAMi's name for cudabudget_memory_limit_bytes, per container)",
        &HAMI_LABELS,
    );
    type Container = (String, String, String, u32, String);
    let mut containers: BTreeMap<Container, (u64, u64)> = BTreeMap::new();
    for (key, figures) in series(status, false, None) {
        if viewer.is_some_and(|v| v != key.uid) {
            continue;
        }
        let entry = containers
            .entry((key.namespace, key.pod, key.container, key.index, key.uuid))
            .or_default();
        entry.0 = entry.0.saturating_add(figures.used);
        entry.1 = entry.1.saturating_add(figures.limit());
    }
    for ((namespace, pod, container, index, uuid), (used, budget)) in containers {
        let index = index.to_string();
        let values = [
            namespace.as_str(),
            pod.as_str(),
            container.as_str(),
            index.as_str(),
            uuid.as_str(),
            "vGPU",
        ];
        usage.with_label_values(&values).set(clamp(used));
        limit.with_label_values(&values).set(clamp(budget));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::figures::DeviceJson;

    fn process(pid: u32, job: Option<&str>, container: &str, figures: [u64; 4]) -> ProcessJson {
        let [used, limit, peak, denials] = figures;
        ProcessJson {
            pid,
            uid: 1000,
            job: job.map(str::to_string),
            command: format!("python worker.py --token=secret-{pid}"),
            namespace: Some("ml".into()),
            pod: Some("trainer-0".into()),
            container: Some(container.into()),
            updated_ms: 0,
            start_time: u64::from(pid) * 7,
            pid_namespace: 4026531836,
            devices: vec![DeviceJson {
                index: 0,
                uuid: Some("GPU-1".into()),
                used_bytes: used,
                limit_bytes: limit,
                peak_bytes: peak,
                denials,
                waits: 0,
                overruns: 0,
                physical_total_bytes: None,
                physical_used_bytes: None,
            }],
        }
    }

    fn status(processes: Vec<ProcessJson>) -> StatusJson {
        StatusJson {
            processes,
            jobs: Vec::new(),
            gpus: None,
            skipped: Vec::new(),
        }
    }

    /// The value of the one line of `text` that starts with `series` (labels as the
    /// encoder writes them: sorted by name).
    fn line<'a>(text: &'a str, series: &str) -> Option<&'a str> {
        let mut found = text.lines().filter(|l| l.starts_with(series));
        let value = found.next().map(|l| l.rsplit(' ').next().unwrap());
        assert!(found.next().is_none(), "{series} twice in\n{text}");
        value
    }

    #[test]
    fn the_budgets_on_a_gpu_add_up_a_jobs_once_and_only_the_full_view_shows_them() {
        let mut status = status(vec![
            process(10, Some("train"), "main", [0, 60, 0, 0]),
            process(11, Some("train"), "main", [0, 60, 0, 0]),
            process(12, None, "main", [0, 30, 0, 0]),
        ]);
        let budgets = crate::figures::budgets_by_gpu(&status.processes)["GPU-1"];
        assert_eq!(budgets, 90, "the job's 60 once, the process's 30");
        status.gpus = Some(vec![crate::figures::GpuJson {
            index: 0,
            uuid: Some("GPU-1".into()),
            name: None,
            total_bytes: 80,
            used_bytes: 0,
            budgets_bytes: budgets,
            overcommitted: budgets > 80,
        }]);
        let views = views(
            &status,
            Shape::default(),
            &mut Counters::default(),
            Instant::now(),
            &[None, Some(1000)],
        );
        let all = String::from_utf8(views[0].clone()).unwrap();
        let series = r#"cudabudget_gpu_budgets_bytes{device_uuid="GPU-1",gpu_index="0"}"#;
        assert_eq!(line(&all, series), Some("90"), "{all}");
        let one_user = String::from_utf8(views[1].clone()).unwrap();
        assert_eq!(line(&one_user, series), None, "{one_user}");
    }

    #[test]
    fn a_series_counts_a_jobs_budget_once_and_sums_process_budgets() {
        let status = status(vec![
            process(10, Some("train"), "main", [3, 100, 4, 1]),
            process(11, Some("train"), "main", [5, 100, 6, 2]),
            process(12, None, "main", [1, 10, 1, 0]),
            process(13, None, "main", [2, 20, 2, 0]),
        ]);
        let text = String::from_utf8(metrics(
            &status,
            Shape::default(),
            &mut Counters::default(),
            Instant::now(),
        ))
        .unwrap();
        let job = r#"{budget_job="train",budget_uid="1000",container="main",device_index="0",device_uuid="GPU-1",namespace="ml",pod="trainer-0"}"#;
        let own = r#"{budget_job="",budget_uid="1000",container="main",device_index="0",device_uuid="GPU-1",namespace="ml",pod="trainer-0"}"#;
        for (metric, at_job, at_own) in [
            ("cudabudget_memory_used_bytes", "8", "3"),
            ("cudabudget_memory_limit_bytes", "100", "30"),
            ("cudabudget_memory_peak_bytes", "10", "3"),
            ("cudabudget_denials_total", "3", "0"),
        ] {
            assert_eq!(
                line(&text, &format!("{metric}{job}")),
                Some(at_job),
                "{text}"
            );
            assert_eq!(
                line(&text, &format!("{metric}{own}")),
                Some(at_own),
                "{text}"
            );
        }
        assert!(!text.contains("pid="), "{text}");
        assert!(!text.contains("secret"), "{text}");
        assert!(!text.contains("{job=") && !text.contains(",job="), "{text}");
    }

    #[test]
    fn a_series_counters_do_not_go_back_when_a_process_leaves() {
        let mut counters = Counters::default();
        let start = Instant::now();
        let denials_of = |text: Vec<u8>| {
            let text = String::from_utf8(text).unwrap();
            line(&text, "cudabudget_denials_total{").map(str::to_string)
        };
        let both = status(vec![
            process(10, None, "main", [0, 10, 0, 5]),
            process(11, None, "main", [0, 10, 0, 3]),
        ]);
        let shape = Shape::default();
        assert_eq!(
            denials_of(metrics(&both, shape, &mut counters, start)).as_deref(),
            Some("8")
        );
        let one = status(vec![process(11, None, "main", [0, 10, 0, 4])]);
        let later = start + Duration::from_secs(5);
        assert_eq!(
            denials_of(metrics(&one, shape, &mut counters, later)).as_deref(),
            Some("9")
        );
        // Past REMEMBERED, folded into the series: the same total.
        let much_later = start + REMEMBERED + Duration::from_secs(10);
        assert_eq!(
            denials_of(metrics(&one, shape, &mut counters, much_later)).as_deref(),
            Some("9")
        );
        // A process that comes back (its record fresh again) is not counted twice.
        let mut counters = Counters::default();
        metrics(&both, shape, &mut counters, start);
        metrics(&one, shape, &mut counters, later);
        assert_eq!(
            denials_of(metrics(&both, shape, &mut counters, later)).as_deref(),
            Some("8")
        );
        // The series gone, then back: it starts from its live processes.
        let mut counters = Counters::default();
        metrics(&both, shape, &mut counters, start);
        metrics(&status(Vec::new()), shape, &mut counters, later);
        assert_eq!(
            denials_of(metrics(&one, shape, &mut counters, later)).as_deref(),
            Some("4")
        );
    }

    #[test]
    fn overruns_are_summed_per_series_and_kept_when_a_process_leaves() {
        let with_overruns = |pid, n| {
            let mut p = process(pid, Some("train"), "main", [0, 10, 0, 0]);
            p.devices[0].overruns = n;
            p
        };
        let overruns_of = |text: Vec<u8>| {
            let text = String::from_utf8(text).unwrap();
            line(&text, "cudabudget_overruns_total{").map(str::to_string)
        };
        let (shape, start) = (Shape::default(), Instant::now());
        let mut counters = Counters::default();
        let both = status(vec![with_overruns(10, 7), with_overruns(11, 5)]);
        assert_eq!(
            overruns_of(metrics(&both, shape, &mut counters, start)).as_deref(),
            Some("12")
        );
        let one = status(vec![with_overruns(11, 6)]);
        let later = start + Duration::from_secs(5);
        assert_eq!(
            overruns_of(metrics(&one, shape, &mut counters, later)).as_deref(),
            Some("13")
        );
    }

    #[test]
    fn per_process_series_carry_the_pid_and_the_info_the_command() {
        let status = status(vec![
            process(10, Some("train"), "main", [3, 100, 4, 1]),
            process(11, Some("train"), "main", [5, 100, 6, 2]),
        ]);
        let shape = Shape {
            per_process: true,
            hami_names: false,
        };
        let text = String::from_utf8(metrics(
            &status,
            shape,
            &mut Counters::default(),
            Instant::now(),
        ))
        .unwrap();
        let labels = r#"{budget_job="train",budget_uid="1000",container="main",device_index="0",device_uuid="GPU-1",namespace="ml",pid="11",pod="trainer-0"}"#;
        assert_eq!(
            line(&text, &format!("cudabudget_memory_used_bytes{labels}")),
            Some("5")
        );
        assert_eq!(
            line(&text, &format!("cudabudget_memory_limit_bytes{labels}")),
            Some("100")
        );
        let info = r#"cudabudget_process_info{budget_job="train",budget_uid="1000",command="python worker.py --token=secret-10",container="main",device_index="0",device_uuid="GPU-1",namespace="ml",pid="10",pod="trainer-0"}"#;
        assert_eq!(line(&text, info), Some("1"), "{text}");
    }
}
