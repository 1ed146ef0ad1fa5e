//! `cudabudget exporter`: the figures `status` shows, as Prometheus metrics at
//! `/metrics` (text exposition format 0.0.4), read afresh at every scrape.

mod serve;
mod web_config;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use prometheus::{Encoder, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::gpu::Nvml;
use crate::status::{self, StatusJson};
use crate::{Refusal, say, usage};

pub const AFTER_HELP: &str = "Metrics (one series per process and device):
  cudabudget_memory_used_bytes, cudabudget_memory_limit_bytes,
  cudabudget_memory_peak_bytes, cudabudget_denials_total, cudabudget_waits_total
    labels: pid, job, device_index, device_uuid, namespace, pod, container
  cudabudget_process_info (1; labels as above with command)
  cudabudget_processes (live budgeted processes)
  cudabudget_gpu_memory_total_bytes, cudabudget_gpu_memory_used_bytes
    (NVML's physical figures; labels: gpu_index, device_uuid)
With --hami-names also HAMi's vGPU_device_memory_usage_in_bytes and
vGPU_device_memory_limit_in_bytes (labels: podnamespace, podname, ctrname,
vdeviceid, deviceuuid, zone), per container and device.

Under abuse: a request's head must arrive within --read-timeout (also how long an
idle keep-alive connection is kept), in at most 16 KiB and 64 header lines; bodies
are never read; beyond --max-connections a new connection is closed at once.

TLS and basic authentication: --web-config-file FILE, in the format of Prometheus'
exporter-toolkit (tls_server_config: cert_file, key_file, client_auth_type,
client_ca_file, min_version, max_version; basic_auth_users: NAME: BCRYPT-HASH;
http_server_config: headers). A key it does not know refuses the start.

Examples:
  cudabudget exporter --listen 127.0.0.1:9464
  cudabudget exporter --listen 0.0.0.0:9464 --hami-names
  cudabudget exporter --listen 0.0.0.0:9464 --web-config-file /etc/cudabudget/web.yml";

#[derive(Args)]
pub struct ExporterArgs {
    /// Address and port to serve /metrics on (port 0: any free port, printed at start).
    #[arg(long, value_name = "ADDR:PORT", default_value = "127.0.0.1:9464")]
    listen: String,

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
}

const LABELS: [&str; 7] = [
    "pid",
    "job",
    "device_index",
    "device_uuid",
    "namespace",
    "pod",
    "container",
];
const HAMI_LABELS: [&str; 6] = [
    "podnamespace",
    "podname",
    "ctrname",
    "vdeviceid",
    "deviceuuid",
    "zone",
];

pub fn exporter(args: ExporterArgs) -> Result<ExitCode, Refusal> {
    let config = match &args.web_config_file {
        Some(path) => web_config::load(path).map_err(usage)?,
        None => web_config::WebConfig {
            tls: None,
            users: BTreeMap::new(),
            headers: Vec::new(),
        },
    };
    let listener = std::net::TcpListener::bind(args.listen.as_str()).map_err(|e| {
        usage(format!(
            "--listen {:?}: cannot listen there ({e}); give ADDR:PORT, e.g. 127.0.0.1:9464",
            args.listen
        ))
    })?;
    let descriptors = serve::raise_descriptor_limit();
    let max_connections = serve::connection_cap(
        usize::try_from(args.max_connections).unwrap_or(usize::MAX),
        descriptors,
    );
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
    if (max_connections as u64) < args.max_connections {
        say(format!(
            "exporter: at most {max_connections} connections (the descriptor limit is \
             {descriptors})"
        ));
    }
    let hami_names = args.hami_names;
    let gather = serve::gatherer(move || {
        let nvml = Nvml::open().ok();
        move || metrics(&status::collect(nvml.as_ref()), hami_names)
    });
    let limits = serve::Limits {
        max_connections,
        read_timeout: Duration::from_secs(args.read_timeout),
    };
    serve::serve(listener, config, limits, gather)
        .map_err(|message| Refusal { message, status: 1 })?;
    Ok(ExitCode::SUCCESS)
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

/// The exposition text of `status`.
pub fn metrics(status: &StatusJson, hami_names: bool) -> Vec<u8> {
    let registry = Registry::new();
    let used = gauge(
        &registry,
        "cudabudget_memory_used_bytes",
        "Device memory the process holds, as its budget counts it.",
        &LABELS,
    );
    let limit = gauge(
        &registry,
        "cudabudget_memory_limit_bytes",
        "The process's budget on the device.",
        &LABELS,
    );
    let peak = gauge(
        &registry,
        "cudabudget_memory_peak_bytes",
        "The most the process has held on the device.",
        &LABELS,
    );
    let denials = counter(
        &registry,
        "cudabudget_denials_total",
        "Allocations refused because they would have crossed the budget.",
        &LABELS,
    );
    let waits = counter(
        &registry,
        "cudabudget_waits_total",
        "Allocations that waited for room in the budget.",
        &LABELS,
    );
    let mut info_labels = LABELS.to_vec();
    info_labels.push("command");
    let info = gauge(
        &registry,
        "cudabudget_process_info",
        "A budgeted process (always 1), with its command.",
        &info_labels,
    );
    let processes = gauge(
        &registry,
        "cudabudget_processes",
        "Live processes that run under a budget.",
        &[],
    );
    processes
        .with_label_values::<&str>(&[])
        .set(status.processes.len() as i64);
    for p in &status.processes {
        let pid = p.pid.to_string();
        let text = |v: &Option<String>| v.clone().unwrap_or_default();
        let (job, namespace, pod, container) = (
            text(&p.job),
            text(&p.namespace),
            text(&p.pod),
            text(&p.container),
        );
        for d in &p.devices {
            let index = d.index.to_string();
            let uuid = text(&d.uuid);
            let values = [
                pid.as_str(),
                job.as_str(),
                index.as_str(),
                uuid.as_str(),
                namespace.as_str(),
                pod.as_str(),
                container.as_str(),
            ];
            used.with_label_values(&values).set(clamp(d.used_bytes));
            limit.with_label_values(&values).set(clamp(d.limit_bytes));
            peak.with_label_values(&values).set(clamp(d.peak_bytes));
            denials.with_label_values(&values).inc_by(d.denials);
            waits.with_label_values(&values).inc_by(d.waits);
            let mut with_command = values.to_vec();
            with_command.push(p.command.as_str());
            info.with_label_values(&with_command).set(1);
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
        for g in gpus {
            let index = g.index.to_string();
            let uuid = g.uuid.clone().unwrap_or_default();
            let values = [index.as_str(), uuid.as_str()];
            total.with_label_values(&values).set(clamp(g.total_bytes));
            in_use.with_label_values(&values).set(clamp(g.used_bytes));
        }
    }
    if hami_names {
        hami(&registry, status);
    }
    let mut body = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut body)
        .expect("text encoding cannot fail");
    body
}

/// HAMi's per-container figures: processes of one container and device added up, as
/// HAMi reports them. Budgets add up too (each process of the container has its own),
/// except within a job, whose processes share one budget.
fn hami(registry: &Registry, status: &StatusJson) {
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
    type Key = (String, String, String, String, String);
    let mut used: BTreeMap<Key, u64> = BTreeMap::new();
    let mut budgets: BTreeMap<Key, BTreeMap<Option<String>, u64>> = BTreeMap::new();
    for p in &status.processes {
        for d in &p.devices {
            let key = (
                p.namespace.clone().unwrap_or_default(),
                p.pod.clone().unwrap_or_default(),
                p.container.clone().unwrap_or_default(),
                d.index.to_string(),
                d.uuid.clone().unwrap_or_default(),
            );
            *used.entry(key.clone()).or_default() += d.used_bytes;
            let per_job = budgets.entry(key).or_default();
            match &p.job {
                // A job's processes share one budget.
                Some(job) => {
                    let b = per_job.entry(Some(job.clone())).or_default();
                    *b = (*b).max(d.limit_bytes);
                }
                None => *per_job.entry(None).or_default() += d.limit_bytes,
            }
        }
    }
    for (key, bytes) in used {
        let values = [
            key.0.as_str(),
            key.1.as_str(),
            key.2.as_str(),
            key.3.as_str(),
            key.4.as_str(),
            "vGPU",
        ];
        usage.with_label_values(&values).set(clamp(bytes));
        let budget = budgets
            .get(&key)
            .map(|b| b.values().fold(0u64, |a, v| a.saturating_add(*v)))
            .unwrap_or(0);
        limit.with_label_values(&values).set(clamp(budget));
    }
}
