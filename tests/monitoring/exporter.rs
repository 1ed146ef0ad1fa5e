//! `cudabudget-node exporter`: live processes' figures as Prometheus metrics in the text
//! exposition format (read back by a parser of that format), over TLS and behind basic
//! authentication when a web configuration file asks for them.

use crate::util::cli::{Budgeted, cudabudget, node, output, scratch, stderr};
use crate::util::servers::{connect_from, idle_connections};
use crate::util::{GI, MI};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An exporter on a free port of 127.0.0.1, stopped when dropped.
struct Exporter {
    child: Child,
    address: String,
}

impl Exporter {
    fn start(extra: &[&str]) -> Exporter {
        let mut args = vec!["exporter", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let mut child = node(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the exporter");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let address = first
            .strip_prefix("cudabudget: exporter listening on http://")
            .or_else(|| first.strip_prefix("cudabudget: exporter listening on https://"))
            .and_then(|rest| rest.strip_suffix("/metrics"))
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .to_string();
        Exporter { child, address }
    }

    /// (status code, body) of `GET path`.
    fn get(&self, path: &str) -> (u16, String) {
        let (code, head, body) = self.request(path, &[]);
        assert!(
            code != 200
                || !path.starts_with("/metrics")
                || head.contains("text/plain; version=0.0.4"),
            "content type: {head}"
        );
        (code, body)
    }

    /// (status code, head, body) of `GET path` with `headers`, over plain HTTP.
    fn request(&self, path: &str, headers: &[&str]) -> (u16, String, String) {
        self.request_from(Ipv4Addr::LOCALHOST, path, headers)
    }

    /// [`Exporter::request`] from the client at `source`.
    fn request_from(
        &self,
        source: Ipv4Addr,
        path: &str,
        headers: &[&str],
    ) -> (u16, String, String) {
        let mut stream = connect_from(source, &self.address).expect("connect to the exporter");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut response = Vec::new();
        exchange(&mut stream, path, headers, &mut response);
        split_response(&String::from_utf8_lossy(&response))
    }
}

/// Sends `GET path` with `headers` (HTTP/1.0: the server closes after its answer) and
/// reads the answer into `response`.
fn exchange(stream: &mut impl ReadWrite, path: &str, headers: &[&str], response: &mut Vec<u8>) {
    let mut request = format!("GET {path} HTTP/1.0\r\nHost: test\r\n");
    for h in headers {
        request.push_str(h);
        request.push_str("\r\n");
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).unwrap();
    stream.flush().unwrap();
    if let Err(e) = stream.read_to_end(response) {
        // A TLS peer that closes without close_notify: what came is the answer.
        assert!(
            e.kind() == std::io::ErrorKind::UnexpectedEof && !response.is_empty(),
            "reading the answer: {e}"
        );
    }
}

trait ReadWrite: Read + Write {}

impl<T: Read + Write> ReadWrite for T {}

/// (status code, head, body) of an HTTP response.
fn split_response(response: &str) -> (u16, String, String) {
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status code");
    (code, head.to_string(), body.to_string())
}

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One sample as the parser read it.
#[derive(Debug)]
struct Sample {
    family_type: String,
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// The exposition text as a Prometheus text-format parser reads it (the
/// `openmetrics-parser` crate: its grammar checks `# HELP` and `# TYPE` lines, the metric
/// types, that a family's samples follow its descriptors, label names and escapes, and
/// numbers); fails the test if it does not parse.
fn parse(text: &str) -> Vec<Sample> {
    use openmetrics_parser::{PrometheusType, PrometheusValue};
    let exposition = openmetrics_parser::prometheus::parse_prometheus(text)
        .unwrap_or_else(|e| panic!("the exposition does not parse: {e}\n{text}"));
    let mut samples = Vec::new();
    for family in exposition.families.values() {
        let family_type = match family.family_type {
            PrometheusType::Counter => "counter",
            PrometheusType::Gauge => "gauge",
            PrometheusType::Unknown => "unknown",
            // Their samples are several series each (buckets, quantiles, sum, count):
            // the exporter serves none, and this reader would need to name them.
            PrometheusType::Histogram | PrometheusType::Summary => panic!(
                "{} is a {}: teach this test to read it\n{text}",
                family.family_name, family.family_type
            ),
        };
        for sample in family.iter_samples() {
            let value = match &sample.value {
                PrometheusValue::Counter(counter) => counter.value.as_f64(),
                PrometheusValue::Gauge(n) | PrometheusValue::Unknown(n) => n.as_f64(),
                other => panic!("{}: {other:?}", family.family_name),
            };
            let labels = sample
                .get_labelset()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            samples.push(Sample {
                family_type: family_type.to_string(),
                name: family.family_name.clone(),
                labels,
                value,
            });
        }
    }
    samples
}

/// The value of `name` for the sample whose labels include `labels`.
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

/// This user's id, as `budget_uid` carries it.
fn uid() -> String {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }.to_string()
}

/// The labels of a series by default: the workload's, the budget's owner, the device.
const SERIES_LABELS: [&str; 7] = [
    "budget_job",
    "budget_uid",
    "container",
    "device_index",
    "device_uuid",
    "namespace",
    "pod",
];

const UUID: &str = "GPU-faceb00c-0000-0000-0000-000000000000";

#[test]
fn live_processes_are_exported_in_the_prometheus_text_format() {
    let trainer = Budgeted::start(
        &["alloc:1Gi", "alloc:8Gi", "sleep:30000"],
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("POD_NAME", "trainer-0"),
            ("POD_NAMESPACE", "ml"),
            ("CONTAINER_NAME", "main"),
        ],
    );
    let server = Budgeted::start(
        &["alloc:512Mi", "sleep:30000"],
        &[("CUDABUDGET_LIMIT", "1Gi"), ("POD_NAME", "server-0")],
    );
    trainer.wait_for(1, |p| p["devices"][0]["denials"] == 1);
    server.wait_for(1, |p| p["devices"][0]["used_bytes"] == 512 * MI);

    let exporter = Exporter::start(&[]);
    let (code, body) = exporter.get("/metrics");
    assert_eq!(code, 200);
    let samples = parse(&body);

    let uid = uid();
    let trainer_labels = [
        ("namespace", "ml"),
        ("pod", "trainer-0"),
        ("container", "main"),
        ("budget_uid", uid.as_str()),
        ("budget_job", ""),
        ("device_index", "0"),
        ("device_uuid", UUID),
    ];
    let get = |name: &str| value(&samples, name, &trainer_labels);
    assert_eq!(
        get("cudabudget_memory_used_bytes"),
        Some(GI as f64),
        "{body}"
    );
    assert_eq!(get("cudabudget_memory_limit_bytes"), Some(2.0 * GI as f64));
    assert_eq!(get("cudabudget_memory_peak_bytes"), Some(GI as f64));
    assert_eq!(get("cudabudget_denials_total"), Some(1.0));
    assert_eq!(get("cudabudget_waits_total"), Some(0.0));

    // Exactly the series labels: no pid, no command, and never `job`, which is
    // Prometheus' own target label.
    for sample in samples
        .iter()
        .filter(|s| s.name.starts_with("cudabudget_memory_") || s.name.ends_with("_total"))
    {
        let names: Vec<&str> = sample.labels.keys().map(String::as_str).collect();
        assert_eq!(names, SERIES_LABELS, "{}: {:?}", sample.name, sample.labels);
    }
    assert!(
        !samples.iter().any(|s| s.name == "cudabudget_process_info"),
        "commands only with --per-process: {body}"
    );
    assert!(
        !body.contains("pid=") && !body.contains("command="),
        "{body}"
    );

    assert_eq!(
        value(
            &samples,
            "cudabudget_memory_used_bytes",
            &[("pod", "server-0"), ("namespace", ""), ("container", "")]
        ),
        Some(512.0 * MI as f64)
    );
    assert!(value(&samples, "cudabudget_processes", &[]).unwrap() >= 2.0);
    assert_eq!(
        value(
            &samples,
            "cudabudget_gpu_memory_total_bytes",
            &[("device_uuid", UUID)]
        ),
        Some(80.0 * GI as f64)
    );
    let types: Vec<(&str, &str)> = samples
        .iter()
        .map(|s| (s.name.as_str(), s.family_type.as_str()))
        .collect();
    assert!(types.contains(&("cudabudget_denials_total", "counter")));
    assert!(types.contains(&("cudabudget_memory_used_bytes", "gauge")));
    assert!(
        !samples.iter().any(|s| s.name.starts_with("vGPU_")),
        "HAMi's names only when asked"
    );
}

#[test]
fn overruns_in_warn_mode_are_a_counter_and_the_series_shows_use_above_the_budget() {
    let pod = format!("observe-{}", std::process::id());
    let client = Budgeted::start(
        &["alloc:1Gi", "alloc:2Gi", "alloc:1Mi", "sleep:30000"],
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_ON_EXCEED", "warn"),
            ("POD_NAME", pod.as_str()),
        ],
    );
    client.wait_for(1, |p| p["devices"][0]["overruns"] == 2);
    let exporter = Exporter::start(&[]);
    let (code, body) = exporter.get("/metrics");
    assert_eq!(code, 200);
    let samples = parse(&body);
    let labels = [("pod", pod.as_str()), ("device_index", "0")];
    assert_eq!(
        value(&samples, "cudabudget_overruns_total", &labels),
        Some(2.0),
        "{body}"
    );
    assert_eq!(
        value(&samples, "cudabudget_denials_total", &labels),
        Some(0.0)
    );
    assert_eq!(
        value(&samples, "cudabudget_memory_used_bytes", &labels),
        Some((3 * GI + MI) as f64)
    );
    assert_eq!(
        value(&samples, "cudabudget_memory_limit_bytes", &labels),
        Some(2.0 * GI as f64)
    );
    let overruns = samples
        .iter()
        .find(|s| s.name == "cudabudget_overruns_total")
        .unwrap();
    assert_eq!(overruns.family_type, "counter");
    let names: Vec<&str> = overruns.labels.keys().map(String::as_str).collect();
    assert_eq!(names, SERIES_LABELS, "{:?}", overruns.labels);
}

/// Two members of a job and two processes with budgets of their own, all in one
/// container: a series for the job (its budget once) and one for the others (their
/// budgets summed); HAMi's per-container limit adds the two.
#[test]
fn a_container_s_processes_add_up_with_a_job_s_budget_counted_once() {
    let pod = format!("add-up-{}", std::process::id());
    let job = format!("add-up-{}", std::process::id());
    let scope = format!("job:{job}");
    let names = [
        ("POD_NAME", pod.as_str()),
        ("POD_NAMESPACE", "team-a"),
        ("CONTAINER_NAME", "worker"),
    ];
    let with = |extra: &[(&'static str, &'static str)]| -> Vec<(&str, &str)> {
        names.iter().copied().chain(extra.iter().copied()).collect()
    };
    let mut member_envs = with(&[("CUDABUDGET_LIMIT", "4Gi")]);
    member_envs.push(("CUDABUDGET_SCOPE", scope.as_str()));
    let members = [
        Budgeted::start(&["alloc:1Gi", "sleep:30000"], &member_envs),
        Budgeted::start(&["alloc:512Mi", "sleep:30000"], &member_envs),
    ];
    let own_envs = with(&[("CUDABUDGET_LIMIT", "1Gi")]);
    let own = [
        Budgeted::start(&["alloc:256Mi", "sleep:30000"], &own_envs),
        Budgeted::start(&["alloc:256Mi", "sleep:30000"], &own_envs),
    ];
    for process in members.iter().chain(&own) {
        process.wait_for(1, |p| p["devices"][0]["used_bytes"].as_u64() > Some(0));
    }

    let exporter = Exporter::start(&["--hami-names"]);
    let (code, body) = exporter.get("/metrics");
    assert_eq!(code, 200);
    let samples = parse(&body);
    let uid = uid();
    let series = |budget_job: &str, name: &str| {
        let labels = [
            ("namespace", "team-a"),
            ("pod", pod.as_str()),
            ("container", "worker"),
            ("budget_uid", uid.as_str()),
            ("budget_job", budget_job),
            ("device_index", "0"),
        ];
        let found: Vec<f64> = samples
            .iter()
            .filter(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .collect();
        assert_eq!(found.len(), 1, "{name} {labels:?}: {found:?}\n{body}");
        found[0]
    };
    assert_eq!(
        series(&job, "cudabudget_memory_used_bytes"),
        1.5 * GI as f64
    );
    assert_eq!(
        series(&job, "cudabudget_memory_limit_bytes"),
        4.0 * GI as f64
    );
    assert_eq!(
        series("", "cudabudget_memory_used_bytes"),
        512.0 * MI as f64
    );
    assert_eq!(series("", "cudabudget_memory_limit_bytes"), 2.0 * GI as f64);
    let hami = [("podname", pod.as_str()), ("ctrname", "worker")];
    assert_eq!(
        value(&samples, "vGPU_device_memory_usage_in_bytes", &hami),
        Some(2.0 * GI as f64),
        "{body}"
    );
    assert_eq!(
        value(&samples, "vGPU_device_memory_limit_in_bytes", &hami),
        Some(6.0 * GI as f64),
        "{body}"
    );

    // With --per-process: a series per process (pid) and each one's command.
    let exporter = Exporter::start(&["--per-process"]);
    let samples = parse(&exporter.get("/metrics").1);
    for process in members.iter().chain(&own) {
        let pid = process.pid().to_string();
        let labels = [("pod", pod.as_str()), ("pid", pid.as_str())];
        let limit = value(&samples, "cudabudget_memory_limit_bytes", &labels);
        let expected = if members.iter().any(|m| m.pid() == process.pid()) {
            4.0
        } else {
            1.0
        };
        assert_eq!(limit, Some(expected * GI as f64), "pid {pid}");
        let info = samples
            .iter()
            .find(|s| s.name == "cudabudget_process_info" && s.labels["pid"] == pid)
            .unwrap_or_else(|| panic!("no cudabudget_process_info for pid {pid}"));
        assert!(!info.labels["command"].is_empty(), "{:?}", info.labels);
        let mut names: Vec<&str> = info.labels.keys().map(String::as_str).collect();
        names.retain(|n| !["pid", "command"].contains(n));
        assert_eq!(names, SERIES_LABELS);
    }
}

/// A process that exits takes its use and budget out of its container's series, but
/// not its denials: the counter does not go back (Prometheus would read a reset, and
/// count the remaining denials again).
#[test]
fn a_series_denials_do_not_go_back_when_one_of_its_processes_exits() {
    let pod = format!("counters-{}", std::process::id());
    let envs = [("CUDABUDGET_LIMIT", "1Gi"), ("POD_NAME", pod.as_str())];
    let mut leaving = Budgeted::start(&["alloc:512Mi", "alloc:1Gi", "sleep:30000"], &envs);
    let staying = Budgeted::start(
        &["alloc:256Mi", "alloc:1Gi", "alloc:1Gi", "sleep:30000"],
        &envs,
    );
    leaving.wait_for(1, |p| p["devices"][0]["denials"] == 1);
    staying.wait_for(1, |p| p["devices"][0]["denials"] == 2);
    let exporter = Exporter::start(&[]);
    let labels = [("pod", pod.as_str())];
    let scrape = |name: &str| value(&parse(&exporter.get("/metrics").1), name, &labels);
    assert_eq!(scrape("cudabudget_denials_total"), Some(3.0));
    assert_eq!(
        scrape("cudabudget_memory_limit_bytes"),
        Some(2.0 * GI as f64)
    );
    leaving.kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    while scrape("cudabudget_memory_limit_bytes") != Some(GI as f64) {
        assert!(
            Instant::now() < deadline,
            "the exited process is still counted"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        scrape("cudabudget_memory_used_bytes"),
        Some(256.0 * MI as f64)
    );
    assert_eq!(scrape("cudabudget_denials_total"), Some(3.0));
}

#[test]
fn hami_names_are_exported_per_container_when_asked() {
    let client = Budgeted::start(
        &["alloc:1Gi", "sleep:30000"],
        &[
            ("CUDABUDGET_LIMIT", "3Gi"),
            ("POD_NAME", "hami-pod"),
            ("POD_NAMESPACE", "team-a"),
            ("CONTAINER_NAME", "worker"),
        ],
    );
    client.wait_for(1, |p| p["devices"][0]["used_bytes"] == GI);
    let exporter = Exporter::start(&["--hami-names"]);
    let (code, body) = exporter.get("/metrics");
    assert_eq!(code, 200);
    let samples = parse(&body);
    let labels = [
        ("podnamespace", "team-a"),
        ("podname", "hami-pod"),
        ("ctrname", "worker"),
        ("vdeviceid", "0"),
        ("deviceuuid", "GPU-faceb00c-0000-0000-0000-000000000000"),
    ];
    assert_eq!(
        value(&samples, "vGPU_device_memory_usage_in_bytes", &labels),
        Some(GI as f64),
        "{body}"
    );
    assert_eq!(
        value(&samples, "vGPU_device_memory_limit_in_bytes", &labels),
        Some(3.0 * GI as f64)
    );
    // The project's own names are there too.
    assert!(
        value(
            &samples,
            "cudabudget_memory_used_bytes",
            &[("pod", "hami-pod")]
        )
        .is_some()
    );
}

#[test]
fn other_paths_are_not_found_and_a_bad_address_is_a_usage_error() {
    let exporter = Exporter::start(&[]);
    assert_eq!(exporter.get("/nothing").0, 404);
    assert_eq!(exporter.get("/").0, 200);
    let out = output(&mut node(&["exporter", "--listen", "not-an-address"]));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).starts_with("cudabudget: --listen \"not-an-address\""),
        "{}",
        stderr(&out)
    );
}

/// The metric names `text` refers to (`cudabudget_…`).
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("cudabudget_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

#[test]
fn the_dashboard_and_alerts_use_only_metrics_the_exporter_serves() {
    let client = Budgeted::start(
        &["alloc:1Mi", "sleep:30000"],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    client.wait_for(1, |_| true);
    let exporter = Exporter::start(&[]);
    let served: std::collections::BTreeSet<String> = parse(&exporter.get("/metrics").1)
        .into_iter()
        .map(|s| s.name)
        .collect();
    let root = env!("CARGO_MANIFEST_DIR");
    let dashboard =
        std::fs::read_to_string(format!("{root}/deploy/grafana/cudabudget.json")).unwrap();
    let parsed: Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    assert_eq!(parsed["uid"], "cudabudget");
    assert!(!parsed["panels"].as_array().unwrap().is_empty());
    let alerts = std::fs::read_to_string(format!("{root}/deploy/grafana/alerts.yaml")).unwrap();
    for (file, text) in [("cudabudget.json", &dashboard), ("alerts.yaml", &alerts)] {
        let used = metric_names(text);
        assert!(!used.is_empty());
        for name in used {
            assert!(
                served.contains(&name),
                "{file} uses {name}, which is not served: {served:?}"
            );
        }
        // The series' labels: no pid (not served by default), and the job is budget_job
        // (`job` is the scrape job's).
        for label in [
            "pid",
            "{{job}}",
            "$labels.job",
            "by (job",
            "on (job",
            ", job)",
            ", job,",
            "{job=",
            ",job=",
            " job=",
            "\"job\"",
        ] {
            let found = text.replace("budget_job", "budget_");
            assert!(!found.contains(label), "{file} uses {label:?}");
        }
    }
}

/// A self-signed certificate for `localhost` and 127.0.0.1 in `dir` (cert.pem, key.pem):
/// an ECDSA P-256 key, not a certificate authority.
fn self_signed(dir: &std::path::Path) -> Vec<u8> {
    let mut params =
        rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "localhost");
    params.is_ca = rcgen::IsCa::ExplicitNoCa;
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let cert = params.self_signed(&key).unwrap();
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
    std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
    cert.pem().into_bytes()
}

/// (status code, head, body) of `GET path` over TLS, trusting only `ca_pem`.
fn get_tls(address: &str, ca_pem: &[u8], path: &str) -> (u16, String, String) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connection =
        rustls::ClientConnection::new(Arc::new(config), ServerName::try_from("localhost").unwrap())
            .unwrap();
    let tcp = TcpStream::connect(address).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut stream = rustls::StreamOwned::new(connection, tcp);
    let mut response = Vec::new();
    exchange(&mut stream, path, &[], &mut response);
    split_response(&String::from_utf8_lossy(&response))
}

#[test]
fn with_a_web_config_file_the_metrics_are_served_over_tls_and_plain_http_is_refused() {
    let dir = scratch("exporter-tls");
    let cert = self_signed(&dir);
    // Relative names: relative to the configuration file, as exporter-toolkit has it.
    let config = dir.join("web.yml");
    std::fs::write(
        &config,
        "tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  min_version: TLS12\n",
    )
    .unwrap();
    let exporter = Exporter::start(&["--web-config-file", config.to_str().unwrap()]);
    let (code, head, body) = get_tls(&exporter.address, &cert, "/metrics");
    assert_eq!(code, 200, "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    assert!(body.contains("cudabudget_processes "), "{body}");

    // Plain HTTP on the TLS port: refused, nothing served.
    let (code, _, body) = exporter.request("/metrics", &[]);
    assert_eq!(code, 400);
    assert!(!body.contains("cudabudget_"), "{body}");
    // Still serving.
    assert_eq!(get_tls(&exporter.address, &cert, "/metrics").0, 200);
}

/// `Authorization: Basic …` for `user:password`.
fn basic(user: &str, password: &str) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes = format!("{user}:{password}").into_bytes();
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    format!("Authorization: Basic {out}")
}

#[test]
fn with_basic_auth_users_only_the_right_credentials_get_the_metrics() {
    let dir = scratch("exporter-auth");
    let hash = bcrypt::hash("s3cret pass", 4).unwrap();
    let config = dir.join("web.yml");
    std::fs::write(
        &config,
        format!(
            "basic_auth_users:\n  prometheus: '{hash}'\nhttp_server_config:\n  headers:\n    \
             X-Frame-Options: deny\n"
        ),
    )
    .unwrap();
    let exporter = Exporter::start(&["--web-config-file", config.to_str().unwrap()]);
    for headers in [
        vec![],
        vec![basic("prometheus", "wrong")],
        vec![basic("nobody", "s3cret pass")],
        vec!["Authorization: Basic !!!".to_string()],
        vec!["Authorization: Bearer s3cret".to_string()],
    ] {
        let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
        let (code, head, body) = exporter.request("/metrics", &headers);
        assert_eq!(code, 401, "{headers:?}: {head}");
        assert!(head.contains("www-authenticate: Basic"), "{head}");
        assert!(!body.contains("cudabudget_"), "{body}");
    }
    // The health check asks for no credentials.
    assert_eq!(exporter.get("/healthz"), (200, "ok\n".to_string()));
    let right = basic("prometheus", "s3cret pass");
    for _ in 0..2 {
        let (code, head, body) = exporter.request("/metrics", &[right.as_str()]);
        assert_eq!(code, 200, "{head}");
        assert!(head.contains("x-frame-options: deny"), "{head}");
        assert!(body.contains("cudabudget_processes "), "{body}");
    }
}

/// The exit status and stderr of `cudabudget-node args`, killed if still running after 10 s.
fn run_briefly(args: &[&str]) -> (Option<i32>, String) {
    crate::util::servers::run_briefly(&mut node(args))
}

#[test]
fn a_bad_web_config_file_refuses_the_start_with_one_line() {
    let dir = scratch("exporter-bad-web-config");
    let cert = dir.join("cert.pem");
    std::fs::write(&cert, "not a certificate\n").unwrap();
    let cases = [
        ("unknown-top.yml", "tls_config:\n  cert_file: a\n"),
        (
            "unknown-tls.yml",
            "tls_server_config:\n  cert_file: cert.pem\n  key_file: cert.pem\n  ciphers: [a]\n",
        ),
        ("not-yaml.yml", "basic_auth_users: [unclosed\n"),
        (
            "plain-password.yml",
            "basic_auth_users:\n  prometheus: secret\n",
        ),
        ("no-key.yml", "tls_server_config:\n  cert_file: cert.pem\n"),
        (
            "bad-cert.yml",
            "tls_server_config:\n  cert_file: cert.pem\n  key_file: missing.pem\n",
        ),
        (
            "header.yml",
            "http_server_config:\n  headers:\n    Authorization: x\n",
        ),
        ("list.yml", "- basic_auth_users\n"),
    ];
    let mut paths: Vec<String> = cases
        .iter()
        .map(|(name, text)| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path.to_str().unwrap().to_string()
        })
        .collect();
    paths.push(dir.join("missing.yml").to_str().unwrap().to_string());
    for path in &paths {
        let (status, text) = run_briefly(&[
            "exporter",
            "--listen",
            "127.0.0.1:0",
            "--web-config-file",
            path,
        ]);
        assert_eq!(status, Some(2), "{path}: {text}");
        assert!(
            text.starts_with(&format!("cudabudget: --web-config-file {path}: ")),
            "{path}: {text}"
        );
        assert_eq!(text.lines().count(), 1, "{path}: {text}");
    }
}

#[test]
fn a_budget_changed_with_limit_is_the_budget_the_exporter_serves() {
    let pod = format!("limited-{}", std::process::id());
    let client = Budgeted::start(
        &["alloc:1Gi", "sleep:30000"],
        &[("CUDABUDGET_LIMIT", "2Gi"), ("POD_NAME", pod.as_str())],
    );
    client.wait_for(1, |p| p["devices"][0]["used_bytes"] == GI);
    let pid = client.pid().to_string();
    let out = output(&mut cudabudget(&["limit", "--pid", &pid, "3Gi"]));
    assert!(out.status.success(), "{}", stderr(&out));
    let exporter = Exporter::start(&[]);
    let (code, body) = exporter.get("/metrics");
    assert_eq!(code, 200);
    let labels = [("pod", pod.as_str()), ("device_index", "0")];
    assert_eq!(
        value(&parse(&body), "cudabudget_memory_limit_bytes", &labels),
        Some(3.0 * GI as f64),
        "{body}"
    );
}

/// 127.0.0.2: the client that floods; 127.0.0.3: another client.
const FLOODER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);

#[test]
fn one_client_holding_idle_connections_cannot_keep_another_from_the_metrics_or_the_health_check() {
    let exporter = Exporter::start(&[
        "--max-connections",
        "16",
        "--max-connections-per-client",
        "4",
        "--read-timeout",
        "600",
    ]);
    // More idle connections than the whole cap, from one client.
    let (_held, open) = idle_connections(FLOODER, &exporter.address, 40);
    assert_eq!(open, 4, "connections of one client held open");

    let (code, _, body) = exporter.request_from(OTHER, "/healthz", &[]);
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    let (code, _, body) = exporter.request_from(OTHER, "/metrics", &[]);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("cudabudget_processes "), "{body}");
}

#[test]
fn wrong_passwords_from_one_client_do_not_hold_up_a_right_one_from_another() {
    let dir = scratch("exporter-auth-flood");
    // Slow enough that fifty checks queued before the right one would outlast the
    // client's patience (30 s) when checked in one queue.
    let hash = bcrypt::hash("right", 11).unwrap();
    let config = dir.join("web.yml");
    std::fs::write(
        &config,
        format!("basic_auth_users:\n  prometheus: '{hash}'\n"),
    )
    .unwrap();
    let exporter = Exporter::start(&["--web-config-file", config.to_str().unwrap()]);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sent = Arc::new(std::sync::Barrier::new(51));
    let wrong = basic("prometheus", "wrong");
    let flood: Vec<_> = (0..50)
        .map(|_| {
            let (address, stop, sent, wrong) = (
                exporter.address.clone(),
                stop.clone(),
                sent.clone(),
                wrong.clone(),
            );
            std::thread::spawn(move || {
                let request = format!("GET /metrics HTTP/1.0\r\nHost: test\r\n{wrong}\r\n\r\n");
                let mut first = true;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let Ok(mut stream) = connect_from(FLOODER, &address) else {
                        break;
                    };
                    let _ = stream.write_all(request.as_bytes());
                    if first {
                        sent.wait();
                        first = false;
                    }
                    let mut answer = Vec::new();
                    let _ = stream.read_to_end(&mut answer);
                }
            })
        })
        .collect();
    // Every flooder has its request in before the right one.
    sent.wait();
    let right = basic("prometheus", "right");
    for _ in 0..2 {
        let (code, head, body) = exporter.request_from(OTHER, "/metrics", &[right.as_str()]);
        assert_eq!(code, 200, "{head}");
        assert!(body.contains("cudabudget_processes "), "{body}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    // The flooders' connections end with the exporter.
    drop(exporter);
    for thread in flood {
        thread.join().unwrap();
    }
}

#[test]
fn a_certificate_or_configuration_that_is_not_a_regular_file_refuses_the_start_naming_it() {
    let dir = scratch("exporter-not-regular");
    self_signed(&dir);
    let fifo = dir.join("fifo");
    let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let fifo = fifo.to_str().unwrap();
    let cases = [
        (
            "zero.yml",
            "/dev/zero",
            "cert_file /dev/zero: not a regular file",
        ),
        ("fifo-cert.yml", fifo, "cert_file"),
        ("dir-cert.yml", "/", "cert_file /: not a regular file"),
    ];
    for (name, cert, said) in cases {
        let config = dir.join(name);
        std::fs::write(
            &config,
            format!("tls_server_config:\n  cert_file: {cert}\n  key_file: key.pem\n"),
        )
        .unwrap();
        let config = config.to_str().unwrap();
        let (status, text) = run_briefly(&[
            "exporter",
            "--listen",
            "127.0.0.1:0",
            "--web-config-file",
            config,
        ]);
        assert_eq!(status, Some(2), "{name}: {text}");
        assert!(text.contains(said), "{name}: {text}");
        assert!(text.contains("not a regular file"), "{name}: {text}");
        assert_eq!(text.lines().count(), 1, "{name}: {text}");
    }
    // The configuration itself.
    let (status, text) = run_briefly(&[
        "exporter",
        "--listen",
        "127.0.0.1:0",
        "--web-config-file",
        fifo,
    ]);
    assert_eq!(status, Some(2), "{text}");
    assert_eq!(
        text.trim_end(),
        format!("cudabudget: --web-config-file {fifo}: not a regular file")
    );
}
