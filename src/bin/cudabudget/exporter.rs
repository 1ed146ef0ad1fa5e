//! `cudabudget exporter`: the figures `status` shows, as Prometheus metrics at
//! `/metrics` (text exposition format 0.0.4), read afresh at every scrape.

use std::collections::BTreeMap;
use std::process::ExitCode;

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

Examples:
  cudabudget exporter --listen 127.0.0.1:9464
  cudabudget exporter --listen 0.0.0.0:9464 --hami-names";

#[derive(Args)]
pub struct ExporterArgs {
    /// Address and port to serve /metrics on (port 0: any free port, printed at start).
    #[arg(long, value_name = "ADDR:PORT", default_value = "127.0.0.1:9464")]
    listen: String,

    /// Also export HAMi's metric names, so dashboards made for HAMi keep working.
    #[arg(long = "hami-names")]
    hami_names: bool,
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
    let server = tiny_http::Server::http(args.listen.as_str()).map_err(|e| {
        usage(format!(
            "--listen {:?}: cannot listen there ({e}); give ADDR:PORT, e.g. 127.0.0.1:9464",
            args.listen
        ))
    })?;
    let address = server
        .server_addr()
        .to_ip()
        .map_or_else(|| args.listen.clone(), |a| a.to_string());
    say(format!("exporter listening on http://{address}/metrics"));
    let nvml = Nvml::open().ok();
    for request in server.incoming_requests() {
        let path = request.url().split('?').next().unwrap_or("");
        let response = match path {
            "/metrics" => {
                let body = metrics(&status::collect(nvml.as_ref()), args.hami_names);
                tiny_http::Response::from_data(body).with_header(header(
                    "Content-Type",
                    "text/plain; version=0.0.4; charset=utf-8",
                ))
            }
            "/" => tiny_http::Response::from_data(
                b"<html><body><a href=\"/metrics\">cudabudget metrics</a></body></html>\n".to_vec(),
            )
            .with_header(header("Content-Type", "text/html; charset=utf-8")),
            _ => {
                tiny_http::Response::from_data(b"not found; the metrics are at /metrics\n".to_vec())
                    .with_status_code(404)
            }
        };
        let _ = request.respond(response);
    }
    Ok(ExitCode::SUCCESS)
}

fn header(name: &str, value: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("a valid ASCII header")
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
