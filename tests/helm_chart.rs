//! The Helm chart `deploy/helm/cudabudget`, rendered by a real `helm` (4, and 3 where
//! given) with its default values and with every switch turned
//! (`tests/helm_chart/every_switch.yaml`). Every rendered object is validated strictly
//! (unknown fields refused): the Kubernetes kinds by `kubernetes-validate --strict`
//! against the chart's oldest Kubernetes (1.28) and the newest the tool knows;
//! ServiceMonitor and PrometheusRule by `tests/helm_chart/validate_monitoring.mjs`
//! against prometheus-operator's types. Then what operators rely on is read from the
//! objects; a real Prometheus scrapes an exporter-shaped page as the chart's
//! ServiceMonitor has it scraped, and keeps the workloads' labels; the installer's script
//! runs against a directory laid out like a node's; and, as root (CI), a budgeted
//! process of another user in its own PID and mount namespaces (a pod, in its own
//! directory) is seen by `cudabudget status` run as the chart runs the exporter (root
//! with DAC_OVERRIDE only).
//!
//! The tools come from package registries (see `tests/helm_chart/install_tools.sh`):
//! `helm` ($CB_HELM, else on PATH), `helm3` ($CB_HELM3, optional), `kubernetes-validate`
//! ($CB_KUBERNETES_VALIDATE), `node` with $CB_NODE_MODULES holding
//! @kubernetes-models/prometheus-operator, and Debian's `prometheus` and `promtool`
//! ($CB_PROMETHEUS, $CB_PROMTOOL). Without them a test prints one line and passes; with
//! CB_REQUIRE_HELM_TOOLS=1 (CI) a missing tool fails it.

use crate::util;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};
use util::tenants::Tenants;
use yaml_rust2::{Yaml, YamlLoader};

const CLI: &str = env!("CARGO_BIN_EXE_cudabudget");
const NAMESPACE: &str = "gpu-system";
const MONITORING_APIS: [&str; 2] = [
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
];

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn chart() -> PathBuf {
    repo().join("deploy/helm/cudabudget")
}

fn fixture(name: &str) -> PathBuf {
    repo().join("tests/helm_chart").join(name)
}

/// A fresh directory for `test`, closed to other users all the way from `/` (the
/// installer's `cudabudget install` refuses anything else), wherever the clone lies.
fn scratch(test: &str) -> PathBuf {
    let dir = util::closed_binary_dir().join(format!(
        "helm-chart-{}",
        test.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A tool named by `variable`, else `name` on PATH.
fn tool(variable: &str, name: &str) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(variable) {
        return Some(PathBuf::from(path)).filter(|p| p.is_file());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

struct Tools {
    helm: PathBuf,
    /// Helm 3 ($CB_HELM3), where given: the chart is rendered and linted by both.
    helm3: Option<PathBuf>,
    validate: PathBuf,
    node: PathBuf,
    node_modules: PathBuf,
}

/// The tools, or `None` after one line saying what is missing (a failure under
/// CB_REQUIRE_HELM_TOOLS=1).
fn tools(test: &str) -> Option<Tools> {
    let helm = tool("CB_HELM", "helm");
    let validate = tool("CB_KUBERNETES_VALIDATE", "kubernetes-validate");
    let node = tool("CB_NODE", "node");
    let node_modules = std::env::var_os("CB_NODE_MODULES")
        .map(PathBuf::from)
        .filter(|dir| dir.join("@kubernetes-models/prometheus-operator").is_dir());
    let mut missing = Vec::new();
    if helm.is_none() {
        missing.push("helm (CB_HELM)");
    }
    if validate.is_none() {
        missing.push("kubernetes-validate (CB_KUBERNETES_VALIDATE)");
    }
    if node.is_none() {
        missing.push("node (CB_NODE)");
    }
    if node_modules.is_none() {
        missing.push("@kubernetes-models/prometheus-operator (CB_NODE_MODULES)");
    }
    if !missing.is_empty() {
        let missing = format!(
            "missing {} (tests/helm_chart/install_tools.sh installs them)",
            missing.join(", ")
        );
        assert!(
            std::env::var_os("CB_REQUIRE_HELM_TOOLS").is_none(),
            "{test}: {missing}, and CB_REQUIRE_HELM_TOOLS is set"
        );
        util::skip(&missing);
        return None;
    }
    Some(Tools {
        helm: helm.unwrap(),
        helm3: tool("CB_HELM3", "helm3"),
        validate: validate.unwrap(),
        node: node.unwrap(),
        node_modules: node_modules.unwrap(),
    })
}

fn text_of(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

impl Tools {
    /// Every helm there is: `helm` (4), then helm 3 where given.
    fn helms(&self) -> Vec<&Path> {
        std::iter::once(self.helm.as_path())
            .chain(self.helm3.as_deref())
            .collect()
    }
}

/// `helm template` of `chart` (a directory or a packaged .tgz) by `helm`; Err is helm's
/// message.
fn try_render_with(helm: &Path, chart: &Path, args: &[&str]) -> Result<Vec<Yaml>, String> {
    let out = Command::new(helm)
        .args([
            "template",
            "cb",
            chart.to_str().unwrap(),
            "--namespace",
            NAMESPACE,
        ])
        .args(args)
        .output()
        .expect("helm runs");
    if !out.status.success() {
        return Err(text_of(&out));
    }
    let manifest = String::from_utf8(out.stdout).expect("UTF-8 manifest");
    let documents = YamlLoader::load_from_str(&manifest)
        .unwrap_or_else(|e| panic!("helm's output is not YAML ({e}):\n{manifest}"));
    Ok(documents.into_iter().filter(|d| !d.is_null()).collect())
}

fn render(tools: &Tools, args: &[&str]) -> Vec<Yaml> {
    render_with(&tools.helm, &chart(), args)
}

fn render_with(helm: &Path, chart: &Path, args: &[&str]) -> Vec<Yaml> {
    try_render_with(helm, chart, args)
        .unwrap_or_else(|e| panic!("{} template {args:?} failed:\n{e}", helm.display()))
}

fn with_monitoring(args: &[&'static str]) -> Vec<&'static str> {
    let mut all = args.to_vec();
    for api in MONITORING_APIS {
        all.extend(["--api-versions", api]);
    }
    all
}

fn json(node: &Yaml) -> Value {
    match node {
        Yaml::Real(r) => serde_json::from_str(r).unwrap_or_else(|_| Value::String(r.clone())),
        Yaml::Integer(i) => Value::from(*i),
        Yaml::String(s) => Value::String(s.clone()),
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Array(items) => Value::Array(items.iter().map(json).collect()),
        Yaml::Hash(hash) => {
            let mut map = Map::new();
            for (key, value) in hash {
                let key = match key {
                    Yaml::String(s) => s.clone(),
                    other => json(other).to_string(),
                };
                map.insert(key, json(value));
            }
            Value::Object(map)
        }
        _ => Value::Null,
    }
}

fn kind(object: &Yaml) -> &str {
    object["kind"].as_str().expect("every object has a kind")
}

fn name(object: &Yaml) -> &str {
    object["metadata"]["name"]
        .as_str()
        .expect("every object has a name")
}

fn is_monitoring(object: &Yaml) -> bool {
    object["apiVersion"].as_str() == Some("monitoring.coreos.com/v1")
}

fn kinds(objects: &[Yaml]) -> BTreeSet<String> {
    objects
        .iter()
        .map(|o| format!("{}/{}", kind(o), name(o)))
        .collect()
}

fn find<'a>(objects: &'a [Yaml], kind_name: &str) -> &'a Yaml {
    objects
        .iter()
        .find(|o| format!("{}/{}", kind(o), name(o)) == kind_name)
        .unwrap_or_else(|| panic!("no {kind_name} in {:?}", kinds(objects)))
}

fn list(node: &Yaml) -> &[Yaml] {
    node.as_vec().map(Vec::as_slice).unwrap_or(&[])
}

/// Validates every object strictly: the Kubernetes kinds with kubernetes-validate at
/// each version, the monitoring kinds with validate_monitoring.mjs. Panics with the
/// tools' words on any failure.
fn validate_strictly(tools: &Tools, objects: &[Yaml], test: &str) {
    let dir = scratch(test);
    let (monitoring, core): (Vec<&Yaml>, Vec<&Yaml>) =
        objects.iter().partition(|o| is_monitoring(o));
    // JSON documents are YAML documents: one file, one document per object.
    let manifest = dir.join("core.yaml");
    let documents: Vec<String> = core.iter().map(|o| json(o).to_string()).collect();
    std::fs::write(&manifest, documents.join("\n---\n")).unwrap();
    for version in ["1.28.0", "1.37.0"] {
        let out = Command::new(&tools.validate)
            .args(["--strict", "-k", version])
            .arg(&manifest)
            .output()
            .expect("kubernetes-validate runs");
        let said = text_of(&out);
        let passed = said
            .lines()
            .filter(|l| l.contains(" passed for resource "))
            .count();
        assert!(
            out.status.success() && passed == core.len() && !said.contains("WARN"),
            "kubernetes-validate --strict -k {version}: {passed} of {} passed:\n{said}",
            core.len()
        );
    }
    let mut child = Command::new(&tools.node)
        .arg(fixture("validate_monitoring.mjs"))
        .arg(&tools.node_modules)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("node runs");
    let input = Value::Array(monitoring.iter().map(|o| json(o)).collect()).to_string();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = text_of(&out);
    let passed = said.lines().filter(|l| l.starts_with("PASS ")).count();
    assert!(
        out.status.success() && passed == monitoring.len(),
        "validate_monitoring.mjs: {passed} of {} passed:\n{said}",
        monitoring.len()
    );
    println!(
        "{test}: {} objects valid ({} by kubernetes-validate --strict at 1.28 and 1.37, {} against prometheus-operator's types)",
        objects.len(),
        core.len(),
        monitoring.len()
    );
}

fn pod_spec(object: &Yaml) -> &Yaml {
    &object["spec"]["template"]["spec"]
}

fn container<'a>(object: &'a Yaml, list_name: &str, container: &str) -> &'a Yaml {
    list(&pod_spec(object)[list_name])
        .iter()
        .find(|c| c["name"].as_str() == Some(container))
        .unwrap_or_else(|| panic!("no {list_name} {container} in {}", name(object)))
}

/// The node path behind `mount_path` of `container` (a hostPath volume).
fn host_path_at(object: &Yaml, container: &Yaml, mount_path: &str) -> String {
    let mount = list(&container["volumeMounts"])
        .iter()
        .find(|m| m["mountPath"].as_str() == Some(mount_path))
        .unwrap_or_else(|| panic!("nothing mounted at {mount_path}"));
    let volume = list(&pod_spec(object)["volumes"])
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mount's volume");
    volume["hostPath"]["path"]
        .as_str()
        .unwrap_or_else(|| panic!("{mount_path} is not a hostPath"))
        .to_string()
}

fn env_value<'a>(container: &'a Yaml, variable: &str) -> Option<&'a str> {
    list(&container["env"])
        .iter()
        .find(|e| e["name"].as_str() == Some(variable))
        .and_then(|e| e["value"].as_str())
}

#[test]
fn the_default_values_render_the_node_components_and_every_object_validates() {
    let Some(tools) = tools("default values") else {
        return;
    };
    for helm in tools.helms() {
        let objects = render_with(helm, &chart(), &[]);
        validate_strictly(&tools, &objects, &format!("default ({})", version_of(helm)));
    }
    let objects = render(&tools, &[]);
    assert_eq!(
        kinds(&objects),
        BTreeSet::from(
            [
                "ConfigMap/cb-cudabudget-dashboard",
                "DaemonSet/cb-cudabudget-exporter",
                "DaemonSet/cb-cudabudget-installer",
                "Service/cb-cudabudget-exporter",
                "Deployment/cb-cudabudget-webhook",
                "Service/cb-cudabudget-webhook",
                "Secret/cb-cudabudget-webhook-tls",
                "PodDisruptionBudget/cb-cudabudget-webhook",
                "MutatingWebhookConfiguration/cb-cudabudget-webhook",
            ]
            .map(String::from)
        ),
        "without the monitoring.coreos.com API there is no ServiceMonitor or PrometheusRule"
    );

    let objects = render(&tools, &with_monitoring(&[]));
    assert!(kinds(&objects).contains("ServiceMonitor/cb-cudabudget-exporter"));
    assert!(kinds(&objects).contains("PrometheusRule/cb-cudabudget-alerts"));
    validate_strictly(&tools, &objects, "default-with-monitoring");
    for object in &objects {
        let labels = &object["metadata"]["labels"];
        for label in [
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/component",
            "app.kubernetes.io/managed-by",
            "helm.sh/chart",
        ] {
            assert!(
                labels[label].as_str().is_some(),
                "{} has no {label}",
                name(object)
            );
        }
    }
}

#[test]
fn every_switch_turned_still_renders_objects_that_validate() {
    let Some(tools) = tools("every switch") else {
        return;
    };
    let values = fixture("every_switch.yaml");
    let args = ["-f", values.to_str().unwrap()];
    for helm in tools.helms() {
        let objects = render_with(helm, &chart(), &args);
        validate_strictly(
            &tools,
            &objects,
            &format!("every switch ({})", version_of(helm)),
        );
    }
    let objects = render(&tools, &args);

    let webhook = find(&objects, "MutatingWebhookConfiguration/budgets-webhook");
    let hook = &webhook["webhooks"][0];
    assert_eq!(hook["failurePolicy"].as_str(), Some("Ignore"));
    assert_eq!(
        json(&hook["namespaceSelector"]),
        serde_json::json!({"matchLabels": {"gpu-budgets": "on"}})
    );
    assert_eq!(
        hook["clientConfig"]["service"]["path"].as_str(),
        Some("/mutate")
    );
    assert_eq!(hook["sideEffects"].as_str(), Some("None"));
    let deployment = find(&objects, "Deployment/budgets-webhook");
    let args: Vec<&str> = list(&container(deployment, "containers", "webhook")["args"])
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    assert_eq!(args[..3], ["webhook", "--listen", "0.0.0.0:8443"]);
    // The paths it writes into pods are those the installer makes on the nodes.
    let values =
        YamlLoader::load_from_str(&std::fs::read_to_string(fixture("every_switch.yaml")).unwrap())
            .unwrap()
            .remove(0);
    let node = &values["node"];
    assert_eq!(
        option_of(&args, "--library-dir"),
        Some(format!("{}/current", node["libraryDir"].as_str().unwrap()).as_str())
    );
    assert_eq!(
        option_of(&args, "--runtime-dir"),
        node["runtimeDir"].as_str()
    );
    assert_eq!(option_of(&args, "--job-dir"), node["jobDir"].as_str());
    // webhook.maxLimit: a cap per namespace, "*" for the others.
    let caps: Vec<(&str, &str)> = args
        .windows(2)
        .filter(|w| w[0].starts_with("--max-limit"))
        .map(|w| (w[0], w[1]))
        .collect();
    assert_eq!(
        caps,
        [("--max-limit-default", "80Gi"), ("--max-limit", "ml=40Gi")],
        "{args:?}"
    );
    // Its own Secret and CA: none made.
    assert!(!kinds(&objects).iter().any(|k| k.starts_with("Secret/")));
    assert_eq!(
        hook["clientConfig"]["caBundle"].as_str(),
        Some("LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==")
    );
    let volumes = list(&pod_spec(deployment)["volumes"]);
    assert_eq!(
        volumes[0]["secret"]["secretName"].as_str(),
        Some("cudabudget-webhook-tls")
    );

    let exporter = find(&objects, "DaemonSet/budgets-exporter");
    let spec = pod_spec(exporter);
    assert_eq!(spec["runtimeClassName"].as_str(), Some("nvidia"));
    assert_eq!(
        spec["priorityClassName"].as_str(),
        Some("system-node-critical")
    );
    let installer = find(&objects, "DaemonSet/budgets-installer");
    assert_eq!(
        json(&installer["spec"]["updateStrategy"]),
        serde_json::json!({"type": "OnDelete"})
    );
    assert_eq!(
        json(&pod_spec(installer)["nodeSelector"]),
        serde_json::json!({"node-role.example.com/gpu": "yes"}),
        "a default key set to null is dropped"
    );
    let image = container(installer, "initContainers", "install")["image"]
        .as_str()
        .unwrap();
    assert!(
        image.starts_with("registry.internal/gpu/cudabudget@sha256:"),
        "{image}"
    );
    let dashboard = find(&objects, "ConfigMap/budgets-dashboard");
    assert_eq!(
        dashboard["metadata"]["namespace"].as_str(),
        Some("monitoring")
    );
}

/// Prometheus keeps a scraped series' own `namespace`, `pod` and `container` only under
/// honor_labels; otherwise they become exported_* and name the exporter's pod.
#[test]
fn the_service_monitor_scrapes_the_exporter_and_keeps_the_workloads_labels() {
    let Some(tools) = tools("service monitor") else {
        return;
    };
    let objects = render(&tools, &with_monitoring(&[]));
    let monitor = find(&objects, "ServiceMonitor/cb-cudabudget-exporter");
    let service = find(&objects, "Service/cb-cudabudget-exporter");
    let exporter = find(&objects, "DaemonSet/cb-cudabudget-exporter");
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!(endpoint["honorLabels"].as_bool(), Some(true));
    for relabel in list(&endpoint["relabelings"]) {
        let target = relabel["targetLabel"].as_str().unwrap_or("");
        assert!(
            !["namespace", "pod", "container", "budget_job", "job"].contains(&target),
            "a relabeling writes {target}, which the exporter's series carry"
        );
    }
    // The monitor selects the Service, which selects the exporter's pods, by port name.
    let selected = &monitor["spec"]["selector"]["matchLabels"];
    for (key, value) in selected.as_hash().unwrap() {
        assert_eq!(&service["metadata"]["labels"][key.as_str().unwrap()], value);
    }
    assert_eq!(
        list(&monitor["spec"]["namespaceSelector"]["matchNames"])[0].as_str(),
        Some(NAMESPACE)
    );
    for (key, value) in service["spec"]["selector"].as_hash().unwrap() {
        assert_eq!(
            &exporter["spec"]["template"]["metadata"]["labels"][key.as_str().unwrap()],
            value
        );
    }
    let port = endpoint["port"].as_str().unwrap();
    assert!(
        list(&service["spec"]["ports"])
            .iter()
            .any(|p| p["name"].as_str() == Some(port))
    );
    let listening = container(exporter, "containers", "exporter");
    assert!(
        list(&listening["ports"])
            .iter()
            .any(|p| p["name"].as_str() == Some(port))
    );
    let args: Vec<&str> = list(&listening["args"])
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    assert_eq!(args, ["exporter", "--listen", "0.0.0.0:9464"]);
    // The node services' binary serves it (the user's CLI carries no server).
    assert_eq!(
        list(&listening["command"])[0].as_str(),
        Some("/opt/cudabudget/cudabudget-node")
    );
}

/// `helm version --short` of `helm`.
fn version_of(helm: &Path) -> String {
    let out = Command::new(helm)
        .args(["version", "--short"])
        .output()
        .expect("helm runs");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn helm_lint_strict_finds_nothing_with_the_default_or_every_switch_values() {
    let Some(tools) = tools("lint") else {
        return;
    };
    let values = fixture("every_switch.yaml");
    for helm in tools.helms() {
        for args in [vec![], vec!["-f", values.to_str().unwrap()]] {
            let out = Command::new(helm)
                .args(["lint", "--strict", chart().to_str().unwrap()])
                .args(&args)
                .output()
                .expect("helm runs");
            let said = text_of(&out);
            assert!(
                out.status.success()
                    && said.contains("0 chart(s) failed")
                    && !said.contains("[WARNING]"),
                "{} lint --strict {args:?}:\n{said}",
                version_of(helm)
            );
        }
    }
}

/// `helm package` stores the files `files/` links to (deploy/grafana's), so the packaged
/// chart renders the same objects as the directory.
#[test]
fn the_packaged_chart_renders_what_the_directory_renders() {
    let Some(tools) = tools("package") else {
        return;
    };
    let dir = scratch("package");
    let out = Command::new(&tools.helm)
        .args(["package", chart().to_str().unwrap(), "--destination"])
        .arg(&dir)
        .output()
        .expect("helm runs");
    assert!(out.status.success(), "helm package: {}", text_of(&out));
    let packaged = dir.join("cudabudget-0.1.0.tgz");
    let listing = Command::new("tar")
        .arg("-tvzf")
        .arg(&packaged)
        .output()
        .expect("tar runs");
    let listing = String::from_utf8_lossy(&listing.stdout).into_owned();
    for file in [
        "cudabudget/files/alerts.yaml",
        "cudabudget/files/cudabudget.json",
    ] {
        let line = listing
            .lines()
            .find(|l| l.ends_with(file))
            .unwrap_or_else(|| panic!("{file} not packaged:\n{listing}"));
        assert!(
            line.starts_with('-'),
            "{file} is packaged as a file, not a link: {line}"
        );
    }
    let args = with_monitoring(&[]);
    let from_package: Vec<Value> = render_with(&tools.helm, &packaged, &args)
        .iter()
        .map(without_generated_certificates)
        .collect();
    let from_directory: Vec<Value> = render(&tools, &args)
        .iter()
        .map(without_generated_certificates)
        .collect();
    assert_eq!(from_package, from_directory);
}

#[test]
fn the_alerts_and_the_dashboard_are_those_of_deploy_grafana() {
    let Some(tools) = tools("alerts and dashboard") else {
        return;
    };
    let objects = render(&tools, &with_monitoring(&[]));
    let rule = find(&objects, "PrometheusRule/cb-cudabudget-alerts");
    let alerts = std::fs::read_to_string(repo().join("deploy/grafana/alerts.yaml")).unwrap();
    let alerts = YamlLoader::load_from_str(&alerts).unwrap().remove(0);
    assert_eq!(json(&rule["spec"]["groups"]), json(&alerts["groups"]));
    let summary = rule["spec"]["groups"][0]["rules"][0]["annotations"]["summary"]
        .as_str()
        .unwrap();
    assert!(
        summary.contains("{{ $labels."),
        "Prometheus' templates left as they are: {summary}"
    );
    // The rules as the PrometheusRule carries them parse as Prometheus parses them
    // (expressions and templates), where promtool is installed.
    if let Some(promtool) = tool("CB_PROMTOOL", "promtool") {
        let file = scratch("promtool").join("rules.yaml");
        let groups = serde_json::json!({"groups": json(&rule["spec"]["groups"])});
        std::fs::write(&file, groups.to_string()).unwrap();
        let out = Command::new(promtool)
            .args(["check", "rules"])
            .arg(&file)
            .output()
            .expect("promtool runs");
        assert!(
            out.status.success(),
            "promtool check rules: {}",
            text_of(&out)
        );
    } else {
        assert!(
            std::env::var_os("CB_REQUIRE_HELM_TOOLS").is_none(),
            "promtool: missing (Debian's package `prometheus`), and CB_REQUIRE_HELM_TOOLS is set"
        );
        util::skip(
            "promtool missing (Debian's package `prometheus`): the alerts' expressions are not parsed",
        );
    }

    let dashboard = find(&objects, "ConfigMap/cb-cudabudget-dashboard");
    assert_eq!(
        dashboard["metadata"]["labels"]["grafana_dashboard"].as_str(),
        Some("1")
    );
    let shipped: Value =
        serde_json::from_str(dashboard["data"]["cudabudget.json"].as_str().unwrap())
            .expect("the ConfigMap holds JSON");
    let file = std::fs::read_to_string(repo().join("deploy/grafana/cudabudget.json")).unwrap();
    assert_eq!(shipped, serde_json::from_str::<Value>(&file).unwrap());
}

#[test]
fn the_exporter_reads_the_node_directory_that_the_installer_shares() {
    let Some(tools) = tools("runtime directory") else {
        return;
    };
    for (args, runtime) in [
        (vec![], "/run/cudabudget/records"),
        (
            vec!["--set", "node.runtimeDir=/var/run/gpu/records"],
            "/var/run/gpu/records",
        ),
    ] {
        let objects = render(&tools, &args);
        let exporter = find(&objects, "DaemonSet/cb-cudabudget-exporter");
        let reader = container(exporter, "containers", "exporter");
        assert_eq!(env_value(reader, "CUDABUDGET_RUNTIME_DIR"), Some(runtime));
        assert_eq!(host_path_at(exporter, reader, runtime), runtime);
        let installer = find(&objects, "DaemonSet/cb-cudabudget-installer");
        let install = container(installer, "initContainers", "install");
        assert_eq!(host_path_at(installer, install, "/host/runtime"), runtime);
        // Root, to read every user's records directory; no other privilege.
        let context = &reader["securityContext"];
        assert_eq!(context["runAsUser"].as_i64(), Some(0));
        assert_eq!(context["allowPrivilegeEscalation"].as_bool(), Some(false));
        assert_eq!(
            json(&context["capabilities"]),
            serde_json::json!({"drop": ["ALL"], "add": ["DAC_OVERRIDE"]})
        );
        assert!(
            pod_spec(exporter)["hostPID"].is_badvalue()
                && pod_spec(exporter)["hostNetwork"].is_badvalue()
        );
    }
}

#[test]
fn values_that_would_put_files_in_the_wrong_place_or_are_misspelt_are_refused() {
    let Some(tools) = tools("bad values") else {
        return;
    };
    for helm in tools.helms() {
        for (set, key) in [
            ("node.runtimeDir=run/cudabudget", "node.runtimeDir"),
            ("node.jobDir=/run/../etc", "node.jobDir"),
            ("node.libraryDir=/opt/cudabudget/", "node.libraryDir"),
            ("installer.version=../../etc", "installer.version"),
            ("image.repository=", "image.repository"),
            ("webhook.failurePolicy=fail", "webhook.failurePolicy"),
            ("webhook.replicas=-1", "webhook.replicas"),
            // A cap is a size, per namespace name (or "*").
            ("webhook.maxLimit.ml=40%", "maxLimit"),
            ("webhook.maxLimit.ML_team=40Gi", "ML_team"),
            // values.schema.json: a key the chart does not know is an error, not ignored.
            ("exporter.hamiName=true", "hamiName"),
            ("serviceMonitor.honorLabel=true", "honorLabel"),
        ] {
            let said = try_render_with(helm, &chart(), &["--set", set])
                .err()
                .unwrap_or_else(|| panic!("{}: --set {set} was rendered", version_of(helm)));
            // Helm 4 names a value by its JSON pointer (/node/jobDir), Helm 3 with dots.
            assert!(
                said.replace('/', ".").contains(key),
                "{}: --set {set}: {said}",
                version_of(helm)
            );
        }
    }
}

/// `object` as JSON, the certificates the chart makes afresh at each render blanked.
fn without_generated_certificates(object: &Yaml) -> Value {
    let mut object = json(object);
    if object["kind"] == "Secret" && object["type"] == "kubernetes.io/tls" {
        object["data"] = Value::Null;
    }
    if let Some(hooks) = object["webhooks"].as_array_mut() {
        for hook in hooks {
            hook["clientConfig"]["caBundle"] = Value::Null;
        }
    }
    object
}

/// The value after `option` in a container's arguments.
fn option_of<'a>(args: &[&'a str], option: &str) -> Option<&'a str> {
    let at = args.iter().position(|a| *a == option)?;
    args.get(at + 1).copied()
}

#[test]
fn the_webhook_runs_the_subcommand_with_the_installers_paths_and_a_certificate_the_api_server_trusts()
 {
    let Some(tools) = tools("webhook") else {
        return;
    };
    let objects = render(&tools, &[]);
    let deployment = find(&objects, "Deployment/cb-cudabudget-webhook");
    let webhook = container(deployment, "containers", "webhook");
    let args: Vec<&str> = list(&webhook["args"])
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    assert_eq!(
        list(&webhook["command"])[0].as_str(),
        Some("/opt/cudabudget/cudabudget-node")
    );
    assert_eq!(args[0], "webhook");
    assert_eq!(
        option_of(&args, "--library-dir"),
        Some("/opt/cudabudget/current")
    );
    assert_eq!(
        option_of(&args, "--runtime-dir"),
        Some("/run/cudabudget/records")
    );
    assert_eq!(option_of(&args, "--job-dir"), Some("/run/cudabudget/jobs"));
    assert!(
        !args.iter().any(|a| a.starts_with("--max-limit")),
        "no cap by default: {args:?}"
    );
    let configuration = find(
        &objects,
        "MutatingWebhookConfiguration/cb-cudabudget-webhook",
    );
    let hook = &configuration["webhooks"][0];
    assert_eq!(hook["failurePolicy"].as_str(), Some("Fail"));
    assert_eq!(
        hook["clientConfig"]["service"]["name"].as_str(),
        Some("cb-cudabudget-webhook")
    );

    // The Secret the chart made, mounted where the arguments name the files.
    let secret = find(&objects, "Secret/cb-cudabudget-webhook-tls");
    assert_eq!(secret["type"].as_str(), Some("kubernetes.io/tls"));
    let mount = list(&webhook["volumeMounts"])
        .iter()
        .find(|m| m["name"].as_str() == Some("tls"))
        .expect("the TLS mount");
    let dir = mount["mountPath"].as_str().unwrap();
    assert_eq!(
        option_of(&args, "--tls-cert"),
        Some(format!("{dir}/tls.crt").as_str())
    );
    assert_eq!(
        option_of(&args, "--tls-key"),
        Some(format!("{dir}/tls.key").as_str())
    );
    let scratch = scratch("webhook");
    for file in ["tls.crt", "tls.key"] {
        let data = util::base64_decode(secret["data"][file].as_str().unwrap());
        std::fs::write(scratch.join(file), data).unwrap();
    }
    let ca = util::base64_decode(
        hook["clientConfig"]["caBundle"]
            .as_str()
            .expect("a caBundle"),
    );
    assert_eq!(
        ca,
        util::base64_decode(secret["data"]["ca.crt"].as_str().unwrap())
    );

    // The subcommand with the chart's arguments (on a free local port) and files answers
    // a review over TLS, verified as the API server does: the caBundle as the only root,
    // the Service's DNS name as the server's name.
    let mut run_args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let listen = run_args.iter().position(|a| a == "--listen").unwrap() + 1;
    run_args[listen] = "127.0.0.1:0".to_string();
    for (option, file) in [("--tls-cert", "tls.crt"), ("--tls-key", "tls.key")] {
        let at = run_args.iter().position(|a| a == option).unwrap() + 1;
        run_args[at] = scratch.join(file).to_str().unwrap().to_string();
    }
    let mut child = Command::new(util::servers::node_bin())
        .args(&run_args)
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the webhook");
    let mut first = String::new();
    let mut stderr = child.stderr.take().unwrap();
    let mut byte = [0u8; 1];
    while stderr.read(&mut byte).unwrap_or(0) == 1 && byte[0] != b'\n' {
        first.push(byte[0] as char);
    }
    let address = first
        .strip_prefix("cudabudget: webhook listening on https://")
        .and_then(|rest| rest.strip_suffix("/mutate"))
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .to_string();
    let review = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0f4e3c2a-1b6d-4e8f-9a0b-1c2d3e4f5a6b",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "ml",
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "train", "namespace": "ml",
                             "annotations": {"cudabudget.io/limit": "20Gi"}},
                "spec": {"containers": [{"name": "train", "image": "pytorch",
                                         "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
            }
        }
    });
    let body = serde_json::to_vec(&review).unwrap();
    let service = format!("cb-cudabudget-webhook.{NAMESPACE}.svc");
    let answer = post_tls(&address, &ca, &service, "/mutate", &body);
    let _ = child.kill();
    let _ = child.wait();
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let answer: Value = serde_json::from_str(body).unwrap();
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    let patch = util::base64_decode(answer["response"]["patch"].as_str().expect("a patch"));
    let patch = String::from_utf8(patch).unwrap();
    for wanted in [
        "/opt/cudabudget/current",
        "/run/cudabudget/records",
        "/opt/cudabudget/libcudabudget.so",
        "CUDABUDGET_RUNTIME_DIR",
        // The pod's own directory of the installer's runtime directory.
        "\"subPathExpr\":\"pods/$(CUDABUDGET_POD_UID)\"",
    ] {
        assert!(patch.contains(wanted), "{wanted} not in {patch}");
    }
}

/// The answer to a POST over TLS to `address`, trusting only `ca_pem` for `server_name`.
fn post_tls(address: &str, ca_pem: &[u8], server_name: &str, path: &str, body: &[u8]) -> String {
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
    let connection = rustls::ClientConnection::new(
        Arc::new(config),
        ServerName::try_from(server_name.to_string()).unwrap(),
    )
    .unwrap();
    let tcp = TcpStream::connect(address).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut stream = rustls::StreamOwned::new(connection, tcp);
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {server_name}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body).unwrap();
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    String::from_utf8_lossy(&response).into_owned()
}

/// The installer's script as rendered, with the container's paths moved under `root`
/// (the image's /opt/cudabudget and the node's three directories), run by `sh`.
fn run_installer(script: &str, root: &Path) -> Output {
    let mut script = script
        .replace("/opt/cudabudget/", &format!("{}/image/", root.display()))
        .replace("/host/", &format!("{}/node/", root.display()));
    let me = std::fs::metadata(root).unwrap().uid();
    if me != 0 {
        // The node's directories must be root's; here they are this user's.
        script = script.replace("\" != 0 ]", &format!("\" != {me} ]"));
    }
    Command::new("sh")
        .args(["-c", &script])
        .env_remove("LD_PRELOAD")
        .env_remove("CUDABUDGET_LIB")
        .output()
        .expect("sh runs")
}

#[test]
fn the_installer_writes_each_version_whole_and_switches_current_by_rename() {
    let Some(tools) = tools("installer") else {
        return;
    };
    let root = scratch("installer");
    let image = root.join("image");
    std::fs::create_dir_all(&image).unwrap();
    std::fs::copy(CLI, image.join("cudabudget")).unwrap();
    std::fs::copy(crate::util::lib_path(), image.join("libcudabudget.so")).unwrap();
    std::fs::copy(
        repo().join("deploy/docker/entrypoint.sh"),
        image.join("entrypoint.sh"),
    )
    .unwrap();
    for dir in ["library", "runtime", "jobs"] {
        std::fs::create_dir_all(root.join("node").join(dir)).unwrap();
    }
    let library = root.join("node/library");
    let script_for = |version: &str| {
        let objects = render(&tools, &["--set", &format!("installer.version={version}")]);
        let installer = find(&objects, "DaemonSet/cb-cudabudget-installer");
        container(installer, "initContainers", "install")["args"][0]
            .as_str()
            .unwrap()
            .to_string()
    };

    let first = script_for("0.1.0");
    for round in 0..2 {
        let out = run_installer(&first, &root);
        assert!(out.status.success(), "round {round}: {}", text_of(&out));
        assert!(
            text_of(&out).contains("current -> 0.1.0"),
            "{}",
            text_of(&out)
        );
    }
    assert_eq!(
        std::fs::read_link(library.join("current")).unwrap(),
        Path::new("0.1.0")
    );
    for file in ["libcudabudget.so", "cudabudget", "entrypoint.sh"] {
        let path = library.join("0.1.0").join(file);
        let mode = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .mode();
        assert_eq!(mode & 0o022, 0, "{} is writable by others", path.display());
    }
    for dir in ["runtime", "jobs"] {
        let mode = std::fs::metadata(root.join("node").join(dir))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o7777,
            0o1777,
            "{dir}: sticky and writable by every user, as /dev/shm"
        );
    }
    // The webhook mounts a pod's own runtime/pods/<pod uid> and its namespace's
    // jobs/namespaces/<namespace>: their parents are the installer's alone.
    let me = std::fs::metadata(&root).unwrap().uid();
    for dir in ["runtime/pods", "jobs/namespaces"] {
        let meta = std::fs::symlink_metadata(root.join("node").join(dir)).unwrap();
        assert!(meta.is_dir(), "{dir}");
        assert_eq!(meta.uid(), me, "{dir}");
        assert_eq!(meta.permissions().mode() & 0o7777, 0o755, "{dir}");
    }

    // A link planted at one of them (the runtime directory is writable by every user)
    // is refused, not followed.
    let pods = root.join("node/runtime/pods");
    std::fs::remove_dir(&pods).unwrap();
    std::os::unix::fs::symlink(root.join("image"), &pods).unwrap();
    let out = run_installer(&first, &root);
    assert!(!out.status.success(), "{}", text_of(&out));
    assert!(
        text_of(&out).contains("runtime/pods (on the node) is not a directory of root's"),
        "{}",
        text_of(&out)
    );
    std::fs::remove_file(&pods).unwrap();

    let out = run_installer(&script_for("0.2.0"), &root);
    assert!(out.status.success(), "{}", text_of(&out));
    assert_eq!(
        std::fs::read_link(library.join("current")).unwrap(),
        Path::new("0.2.0")
    );
    assert!(
        library.join("0.1.0/libcudabudget.so").is_file(),
        "the old version stays for the pods that use it"
    );
    let names: BTreeSet<String> = std::fs::read_dir(&library)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        BTreeSet::from(["0.1.0", "0.2.0", "current"].map(String::from)),
        "no temporary left"
    );

    // A version left half-written (a node that lost power) is not where `current`
    // can point, and the next run writes it whole.
    std::fs::create_dir_all(library.join(".0.3.0.partial")).unwrap();
    std::fs::write(library.join(".0.3.0.partial/libcudabudget.so"), b"half").unwrap();
    let out = run_installer(&script_for("0.3.0"), &root);
    assert!(out.status.success(), "{}", text_of(&out));
    assert_eq!(
        std::fs::read(library.join("0.3.0/libcudabudget.so")).unwrap(),
        std::fs::read(crate::util::lib_path()).unwrap()
    );
    assert!(!library.join(".0.3.0.partial").exists());
}

/// A page shaped like the exporter's: one series per container and device, with the
/// workload's labels.
const EXPOSITION: &str = "# HELP cudabudget_memory_used_bytes Device memory the budgeted processes hold.
# TYPE cudabudget_memory_used_bytes gauge
cudabudget_memory_used_bytes{namespace=\"ml-team\",pod=\"trainer-0\",container=\"trainer\",budget_job=\"train\",device_index=\"0\",device_uuid=\"GPU-5a1c\"} 1073741824
";

/// Serves EXPOSITION on a loopback port until `stop` is set (or a minute has passed).
fn serve_exposition(stop: Arc<AtomicBool>) -> (u16, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let handle = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            let Ok((mut stream, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && head.len() < 16 << 10 {
                match stream.read(&mut byte) {
                    Ok(1) => head.push(byte[0]),
                    _ => break,
                }
            }
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{EXPOSITION}",
                EXPOSITION.len()
            );
        }
    });
    (port, handle)
}

/// GET `path` from 127.0.0.1:`port`; the body, if the answer was 200.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// A relabeling of a ServiceMonitor as Prometheus' configuration writes it.
fn relabel_config(relabeling: &Value) -> Value {
    let mut config = Map::new();
    for (key, value) in relabeling.as_object().expect("a relabeling is a mapping") {
        let key = match key.as_str() {
            "sourceLabels" => "source_labels",
            "targetLabel" => "target_label",
            other => other,
        };
        let value = match (key, value) {
            ("action", Value::String(action)) => Value::String(action.to_lowercase()),
            _ => value.clone(),
        };
        config.insert(key.to_string(), value);
    }
    Value::Object(config)
}

/// Kills and reaps the Prometheus this test started.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What Prometheus keeps of a series' own labels behind the chart's ServiceMonitor. A
/// real Prometheus (Debian's `prometheus`, or $CB_PROMETHEUS) scrapes a page shaped like
/// the exporter's with the configuration the Prometheus operator makes from the monitor:
/// the target labels it always sets (namespace, service, pod, container, endpoint, job:
/// those of the exporter's pod), then the monitor's own relabelings, and the monitor's
/// honorLabels. Beside it, the same target with honor_labels off, as a default
/// ServiceMonitor would scrape it: there the workload's labels become exported_*.
#[test]
fn behind_the_service_monitor_prometheus_keeps_the_workloads_labels() {
    let Some(tools) = tools("prometheus") else {
        return;
    };
    let Some(prometheus) = tool("CB_PROMETHEUS", "prometheus") else {
        assert!(
            std::env::var_os("CB_REQUIRE_HELM_TOOLS").is_none(),
            "prometheus: missing (Debian's package `prometheus`), and CB_REQUIRE_HELM_TOOLS is set"
        );
        util::skip("missing prometheus (Debian's package `prometheus`)");
        return;
    };
    let objects = render(&tools, &with_monitoring(&[]));
    let monitor = json(find(&objects, "ServiceMonitor/cb-cudabudget-exporter"));
    let endpoint = &monitor["spec"]["endpoints"][0];
    let relabelings: Vec<Value> = endpoint["relabelings"]
        .as_array()
        .map(|all| all.iter().map(relabel_config).collect())
        .unwrap_or_default();

    let stop = Arc::new(AtomicBool::new(false));
    let (exporter_port, server) = serve_exposition(stop.clone());
    let target = |endpoint_label: &str| {
        serde_json::json!({
            "targets": [format!("127.0.0.1:{exporter_port}")],
            "labels": {
                "namespace": NAMESPACE,
                "service": "cb-cudabudget-exporter",
                "pod": "cb-cudabudget-exporter-x7k2p",
                "container": "exporter",
                "endpoint": endpoint_label,
                "job": "cb-cudabudget-exporter",
                "__meta_kubernetes_pod_node_name": "gpu-node-1",
            }
        })
    };
    let config = serde_json::json!({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "serviceMonitor/gpu-system/cb-cudabudget-exporter/0",
                "honor_labels": endpoint["honorLabels"].as_bool().unwrap_or(false),
                "metrics_path": endpoint["path"].as_str().unwrap_or("/metrics"),
                "static_configs": [target("metrics")],
                "relabel_configs": relabelings,
            },
            {
                "job_name": "without-honor-labels",
                "honor_labels": false,
                "static_configs": [target("without-honor-labels")],
                "relabel_configs": relabelings,
            }
        ]
    });
    let dir = scratch("prometheus");
    // JSON is YAML: Prometheus reads it as its configuration.
    std::fs::write(dir.join("prometheus.yml"), config.to_string()).unwrap();
    let web_port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let child = Command::new(&prometheus)
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{web_port}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("prometheus starts");
    let _prometheus = Reaped(child);

    let deadline = Instant::now() + Duration::from_secs(45);
    let series = loop {
        let found = http_get(web_port, "/api/v1/query?query=cudabudget_memory_used_bytes")
            .and_then(|body| serde_json::from_str::<Value>(&body).ok())
            .and_then(|answer| answer["data"]["result"].as_array().cloned())
            .unwrap_or_default();
        if found.len() == 2 || Instant::now() > deadline {
            break found;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    stop.store(true, Ordering::Relaxed);
    server.join().unwrap();
    let said = std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default();
    assert_eq!(
        series.len(),
        2,
        "Prometheus stored {series:?}; its log:\n{said}"
    );
    let labels_of = |endpoint_label: &str| {
        series
            .iter()
            .map(|s| s["metric"].clone())
            .find(|m| m["endpoint"] == endpoint_label)
            .unwrap_or_else(|| panic!("no series scraped as {endpoint_label}: {series:?}"))
    };

    let kept = labels_of("metrics");
    for (label, value) in [
        ("namespace", "ml-team"),
        ("pod", "trainer-0"),
        ("container", "trainer"),
        ("budget_job", "train"),
        ("device_index", "0"),
        ("node", "gpu-node-1"),
        ("job", "cb-cudabudget-exporter"),
    ] {
        assert_eq!(
            kept[label], value,
            "{label} behind the chart's monitor: {kept}"
        );
    }
    assert!(
        kept.as_object()
            .unwrap()
            .keys()
            .all(|k| !k.starts_with("exported_")),
        "{kept}"
    );
    let renamed = labels_of("without-honor-labels");
    assert_eq!(renamed["exported_namespace"], "ml-team", "{renamed}");
    assert_eq!(renamed["namespace"], NAMESPACE, "{renamed}");
    assert_eq!(renamed["exported_pod"], "trainer-0", "{renamed}");
    println!("behind the chart's ServiceMonitor: {kept}\nwithout honorLabels: {renamed}");
}

/// A budgeted process of another user in its own PID namespace, as in a pod, killed when
/// dropped.
struct Workload(std::process::Child);

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `cudabudget status --json` as the chart runs the exporter: root, with no capability
/// but those named (the container's `drop: [ALL]`, `add: [...]`), the runtime directory
/// from the environment the DaemonSet sets.
fn status_as_the_exporter(cli: &Path, env: &[(String, String)], capabilities: &str) -> Value {
    let mut command = Command::new("setpriv");
    command
        .arg(format!("--bounding-set=-all{capabilities}"))
        .arg(format!("--inh-caps=-all{capabilities}"))
        .arg("--")
        .arg(cli)
        .args(["status", "--json"])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .envs(env.iter().map(|(k, v)| (k, v)));
    let out = util::cli::output(&mut command);
    assert!(out.status.success(), "status: {}", text_of(&out));
    serde_json::from_slice(&out.stdout).expect("status --json")
}

/// The node as the chart lays it out: the runtime directory root's and 1777 as the
/// installer leaves it; a workload of an unprivileged user in its own PID and mount
/// namespaces (a pod) publishes in its pod's own directory there; `cudabudget status`
/// run as the exporter container runs (root, every capability dropped but DAC_OVERRIDE,
/// the DaemonSet's environment) shows the process with its pod's labels. Without DAC_OVERRIDE it cannot read the user's
/// directory: the capability the chart adds is the one it needs.
#[test]
fn the_exporter_as_the_chart_runs_it_sees_a_pods_budgeted_process() {
    let Some(tools) = tools("node") else {
        return;
    };
    let Some(t) = Tenants::get() else {
        return;
    };
    let probe = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .output();
    if !probe.is_ok_and(|out| out.status.success()) {
        util::skip("this machine cannot create a PID namespace (unshare --pid)");
        return;
    }
    let runtime = t.sticky_dir("helm-chart-records");
    let objects = render(
        &tools,
        &["--set", &format!("node.runtimeDir={}", runtime.display())],
    );
    let exporter = find(&objects, "DaemonSet/cb-cudabudget-exporter");
    let reader = container(exporter, "containers", "exporter");
    let env: Vec<(String, String)> = list(&reader["env"])
        .iter()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?.to_string(),
                e["value"].as_str()?.to_string(),
            ))
        })
        .collect();
    let added: Vec<&str> = list(&reader["securityContext"]["capabilities"]["add"])
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    let capabilities: String = added
        .iter()
        .map(|c| format!(",+{}", c.to_lowercase()))
        .collect();

    let client = t.share(Path::new(util::client_bin("gpa")));
    let library = t.share(&util::cli::fresh_library());
    let fake = t.share_dir(Path::new(util::fake_dir()));
    let cli = t.share(Path::new(util::cli::BIN));
    let alice = &t.alice;
    // The pod's own directory as the installer and the kubelet make it (pods/ root's
    // 0755, pods/<pod uid> with the runtime directory's mode), mounted over the runtime
    // directory's path in the pod as the webhook's subPathExpr mount is.
    let own = runtime.join("pods/0b1c2d3e-pod");
    std::fs::create_dir_all(&own).unwrap();
    std::fs::set_permissions(runtime.join("pods"), PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&own, PermissionsExt::from_mode(0o1777)).unwrap();
    let mount = format!(
        "mount --bind '{}' '{}' && exec \"$@\"",
        own.display(),
        runtime.display()
    );
    let mut pod = Command::new("unshare");
    pod.args([
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        &mount,
        "sh",
        "setpriv",
    ])
    .arg(format!("--reuid={}", alice.uid))
    .arg(format!("--regid={}", alice.gid))
    .args(["--clear-groups", "--"])
    .arg(&client)
    .args(["gpa", "alloc:64Mi", "sleep:20000"])
    .env_clear()
    .env("PATH", "/usr/bin:/bin")
    .env("LD_PRELOAD", &library)
    .env("LD_LIBRARY_PATH", &fake)
    .env("CUDABUDGET_LIMIT", "1Gi")
    .env("CUDABUDGET_RUNTIME_DIR", &runtime)
    .env("POD_NAME", "trainer-0")
    .env("POD_NAMESPACE", "ml-team")
    .env("CONTAINER_NAME", "trainer")
    .current_dir(&t.shared)
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let _pod = Workload(pod.spawn().expect("the pod's process starts"));

    let deadline = Instant::now() + Duration::from_secs(15);
    let shown = loop {
        let status = status_as_the_exporter(&cli, &env, &capabilities);
        let found = status["processes"].as_array().and_then(|all| {
            all.iter()
                .find(|p| {
                    // Its record is first written before its allocation: wait for the
                    // one that shows it.
                    p["pod"] == "trainer-0"
                        && p["uid"].as_u64() == Some(u64::from(alice.uid))
                        && p["devices"][0]["used_bytes"].as_u64() > Some(0)
                })
                .cloned()
        });
        if let Some(found) = found {
            break found;
        }
        assert!(
            Instant::now() < deadline,
            "the exporter (capabilities {added:?}) never showed the pod's process: {status}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(shown["namespace"], "ml-team", "{shown}");
    assert_eq!(shown["container"], "trainer", "{shown}");
    assert_eq!(shown["devices"][0]["used_bytes"], 64 << 20, "{shown}");

    let status = status_as_the_exporter(&cli, &env, "");
    let hidden = status["processes"]
        .as_array()
        .is_some_and(|all| all.iter().all(|p| p["pod"] != "trainer-0"));
    assert!(
        hidden,
        "without DAC_OVERRIDE root still read the user's directory: {status}"
    );
    println!("node: the exporter's view of the pod's process: {shown}");
}

fn args_of(container: &Yaml) -> Vec<&str> {
    list(&container["args"])
        .iter()
        .filter_map(Yaml::as_str)
        .collect()
}

#[test]
fn the_device_plugin_is_off_by_default_and_on_runs_on_the_kubelets_directory_with_the_installers_library()
 {
    let Some(tools) = tools("device plugin") else {
        return;
    };
    let objects = render(&tools, &[]);
    assert!(
        !kinds(&objects)
            .iter()
            .any(|k| k.contains("device-plugin") || k.starts_with("ResourceQuota/")),
        "off by default: {:?}",
        kinds(&objects)
    );

    let on = [
        "--set",
        "devicePlugin.enabled=true",
        "--set",
        "devicePlugin.quotas[0].namespace=ml",
        "--set",
        "devicePlugin.quotas[0].units=100",
    ];
    for helm in tools.helms() {
        let objects = render_with(helm, &chart(), &on);
        validate_strictly(
            &tools,
            &objects,
            &format!("device plugin ({})", version_of(helm)),
        );
    }
    let objects = render(&tools, &on);
    // The exporter reads the device plugin's containers too (their own directories).
    let exporter = find(&objects, "DaemonSet/cb-cudabudget-exporter");
    let reader = container(exporter, "containers", "exporter");
    assert_eq!(
        env_value(reader, "CUDABUDGET_DEVICE_PLUGIN_DIR"),
        Some("/run/cudabudget/device-plugin")
    );
    assert!(
        list(&reader["volumeMounts"])
            .iter()
            .any(|m| m["mountPath"].as_str() == Some("/run/cudabudget/device-plugin")),
        "{reader:?}"
    );
    let daemonset = find(&objects, "DaemonSet/cb-cudabudget-device-plugin");
    let plugin = container(daemonset, "containers", "device-plugin");
    assert_eq!(
        plugin["command"][0].as_str(),
        Some("/usr/local/bin/cudabudget-node")
    );
    let args = args_of(plugin);
    assert_eq!(args[0], "device-plugin");
    assert_eq!(option_of(&args, "--resource"), Some("cudabudget.io/memory"));
    assert_eq!(option_of(&args, "--unit"), Some("1Gi"));
    assert_eq!(option_of(&args, "--reserve"), Some("2Gi"));
    // The library the kubelet mounts into pods is the one the installer keeps current.
    assert_eq!(
        option_of(&args, "--library-dir"),
        Some("/opt/cudabudget/current")
    );
    let kubelet_dir = "/var/lib/kubelet/device-plugins";
    assert_eq!(option_of(&args, "--kubelet-dir"), Some(kubelet_dir));
    assert_eq!(host_path_at(daemonset, plugin, kubelet_dir), kubelet_dir);
    let runtime_dir = option_of(&args, "--runtime-dir").expect("a runtime root");
    assert_eq!(host_path_at(daemonset, plugin, runtime_dir), runtime_dir);
    let security = &plugin["securityContext"];
    assert_eq!(
        json(&security["capabilities"]["drop"]),
        serde_json::json!(["ALL"])
    );
    assert_eq!(
        json(&security["capabilities"]["add"]),
        serde_json::json!(["DAC_OVERRIDE"]),
        "only to empty what a pod's users left"
    );
    assert_eq!(security["allowPrivilegeEscalation"].as_bool(), Some(false));
    assert_eq!(
        env_value(plugin, "NVIDIA_DRIVER_CAPABILITIES"),
        Some("utility"),
        "NVML through the NVIDIA runtime"
    );
    let quota = find(&objects, "ResourceQuota/cb-cudabudget-memory");
    assert_eq!(quota["metadata"]["namespace"].as_str(), Some("ml"));
    assert_eq!(
        json(&quota["spec"]["hard"]),
        serde_json::json!({"requests.cudabudget.io/memory": "100"})
    );

    // Every switch (tests/helm_chart/every_switch.yaml, validated by the test above).
    let values = fixture("every_switch.yaml");
    let objects = render(&tools, &["-f", values.to_str().unwrap()]);
    let daemonset = find(&objects, "DaemonSet/budgets-device-plugin");
    let plugin = container(daemonset, "containers", "device-plugin");
    let image = plugin["image"].as_str().unwrap();
    assert!(
        image.starts_with("registry.internal/gpu/cudabudget-node@sha256:fedc"),
        "{image}"
    );
    let args = args_of(plugin);
    assert_eq!(
        option_of(&args, "--resource"),
        Some("example.com/gpu-memory")
    );
    assert_eq!(option_of(&args, "--unit"), Some("512Mi"));
    assert_eq!(
        option_of(&args, "--library-dir"),
        Some("/var/lib/cudabudget/current")
    );
    let kubelet_dir = "/var/lib/k0s/kubelet/device-plugins";
    assert_eq!(host_path_at(daemonset, plugin, kubelet_dir), kubelet_dir);
    assert_eq!(
        pod_spec(daemonset)["runtimeClassName"].as_str(),
        Some("nvidia")
    );
    let quotas: Vec<&Yaml> = objects
        .iter()
        .filter(|o| kind(o) == "ResourceQuota")
        .collect();
    assert_eq!(quotas.len(), 2);
    assert_eq!(
        json(&quotas[0]["spec"]["hard"]),
        serde_json::json!({"requests.example.com/gpu-memory": "160"})
    );

    // A value that is not a quantity is refused by the schema, before anything renders.
    let refused = try_render_with(
        &tools.helm,
        &chart(),
        &[
            "--set",
            "devicePlugin.enabled=true",
            "--set",
            "devicePlugin.unit=one",
        ],
    )
    .expect_err("refused");
    assert!(
        refused.contains("devicePlugin") && refused.contains("unit"),
        "{refused}"
    );
}
