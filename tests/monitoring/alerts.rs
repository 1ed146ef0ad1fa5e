//! deploy/grafana's alerts and the dashboard's budget queries, evaluated by Prometheus'
//! own rule tester (`promtool test rules`) on series shaped as the exporter serves them:
//! a job whose members run in two containers counts its budget once, not once per
//! member.

use crate::util::cli::{output, scratch, stderr, stdout};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;

/// promtool ($CB_PROMTOOL, else on PATH; Debian's package `prometheus`), or `None`
/// after one line saying so (a failure under CB_REQUIRE_HELM_TOOLS).
fn promtool() -> Option<PathBuf> {
    let found = match std::env::var_os("CB_PROMTOOL") {
        Some(path) => Some(PathBuf::from(path)),
        None => std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|dir| dir.join("promtool"))
            .find(|p| p.is_file()),
    };
    if found.is_none() {
        assert!(
            std::env::var_os("CB_REQUIRE_HELM_TOOLS").is_none(),
            "promtool: missing (Debian's package `prometheus`), and CB_REQUIRE_HELM_TOOLS is set"
        );
        crate::util::skip(
            "promtool missing (Debian's package `prometheus`): the rules are not evaluated",
        );
    }
    found
}

fn repo_file(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// A series of the exporter's default shape (a container's processes of one job, or
/// outside any job, on one device), constant for the test's 30 minutes.
fn series(metric: &str, labels: [&str; 6], value: &str) -> Value {
    let [
        namespace,
        pod,
        container,
        budget_job,
        device_index,
        device_uuid,
    ] = labels;
    json!({
        "series": format!(
            "{metric}{{namespace=\"{namespace}\",pod=\"{pod}\",container=\"{container}\",\
             budget_uid=\"1000\",budget_job=\"{budget_job}\",device_index=\"{device_index}\",\
             device_uuid=\"{device_uuid}\",instance=\"gpu-node-1:9464\"}}"
        ),
        "values": value,
    })
}

/// The dashboard's expression of the target `ref_id` of the panel titled `title`, its
/// variables set to "all".
fn dashboard_expr(title: &str, ref_id: &str) -> String {
    let text = std::fs::read_to_string(repo_file("deploy/grafana/cudabudget.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let panel = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["title"] == title)
        .unwrap_or_else(|| panic!("no panel {title:?}"));
    let target = panel["targets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["refId"] == ref_id)
        .unwrap_or_else(|| panic!("{title:?} has no target {ref_id}"));
    target["expr"]
        .as_str()
        .unwrap()
        .replace("$namespace", ".*")
        .replace("$pod", ".*")
}

#[test]
fn the_alerts_and_the_dashboard_count_a_jobs_budget_once() {
    let Some(promtool) = promtool() else {
        return;
    };
    // GPU-1 (16 units): job "train" with members in pods a and b (8 units, shared: each
    // series carries it), 7.75 in use together (97 %, though each pod alone holds less
    // than 65 %); pod c outside any job, 1 of 4. Budgets: 8 + 4 = 12, not 20.
    // GPU-2 (16 units): pod d outside any job, 31 of 32: nearly full, and more than the
    // card.
    let train_a = ["ml", "a", "main", "train", "0", "GPU-1"];
    let train_b = ["ml", "b", "main", "train", "0", "GPU-1"];
    let web_c = ["web", "c", "srv", "", "0", "GPU-1"];
    let web_d = ["web", "d", "srv", "", "1", "GPU-2"];
    let input = vec![
        series("cudabudget_memory_used_bytes", train_a, "5x30"),
        series("cudabudget_memory_limit_bytes", train_a, "8x30"),
        series("cudabudget_memory_used_bytes", train_b, "2.75x30"),
        series("cudabudget_memory_limit_bytes", train_b, "8x30"),
        series("cudabudget_memory_used_bytes", web_c, "1x30"),
        series("cudabudget_memory_limit_bytes", web_c, "4x30"),
        series("cudabudget_memory_used_bytes", web_d, "31x30"),
        series("cudabudget_memory_limit_bytes", web_d, "32x30"),
        // Two denials in pod b at minute 12.
        series("cudabudget_denials_total", train_b, "0x11 2x18"),
        json!({"series": "cudabudget_gpu_memory_total_bytes{gpu_index=\"0\",device_uuid=\"GPU-1\",instance=\"gpu-node-1:9464\"}", "values": "16x30"}),
        json!({"series": "cudabudget_gpu_memory_total_bytes{gpu_index=\"1\",device_uuid=\"GPU-2\",instance=\"gpu-node-1:9464\"}", "values": "16x30"}),
    ];
    let alert = |name: &str, labels: Value, summary: &str| {
        let annotations = |name: &str| -> Value {
            let text = std::fs::read_to_string(repo_file("deploy/grafana/alerts.yaml")).unwrap();
            let start = text.find(&format!("alert: {name}\n")).unwrap();
            let rest = &text[start..];
            let line = rest
                .lines()
                .find_map(|l| l.trim().strip_prefix("description: "))
                .unwrap();
            Value::String(serde_json::from_str::<String>(line).unwrap())
        };
        json!({"exp_labels": labels, "exp_annotations": {
            "summary": summary, "description": annotations(name)}})
    };
    let tests = json!({
        "rule_files": [repo_file("deploy/grafana/alerts.yaml")],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": input,
            "alert_rule_test": [
                {"eval_time": "15m", "alertname": "CudabudgetJobBudgetNearlyFull", "exp_alerts": [
                    alert("CudabudgetJobBudgetNearlyFull",
                        json!({"severity": "warning", "budget_uid": "1000", "budget_job": "train", "device_uuid": "GPU-1"}),
                        "job train of uid 1000 holds 96.88% of its GPU budget on GPU-1"),
                ]},
                {"eval_time": "15m", "alertname": "CudabudgetBudgetNearlyFull", "exp_alerts": [
                    alert("CudabudgetBudgetNearlyFull",
                        // An empty label is no label to Prometheus.
                        json!({"severity": "warning", "namespace": "web", "pod": "d", "container": "srv",
                               "budget_uid": "1000", "device_index": "1",
                               "device_uuid": "GPU-2", "instance": "gpu-node-1:9464"}),
                        "web/d container srv holds 96.88% of its GPU budget on device 1"),
                ]},
                {"eval_time": "15m", "alertname": "CudabudgetBudgetsExceedTheCard", "exp_alerts": [
                    alert("CudabudgetBudgetsExceedTheCard",
                        json!({"severity": "info", "device_uuid": "GPU-2"}),
                        "the budgets on GPU GPU-2 add up to more than the card has"),
                ]},
                {"eval_time": "14m", "alertname": "CudabudgetDenials", "exp_alerts": [
                    alert("CudabudgetDenials",
                        json!({"severity": "warning", "namespace": "ml", "pod": "b", "container": "main",
                               "budget_uid": "1000", "budget_job": "train", "device_index": "0",
                               "device_uuid": "GPU-1"}),
                        "ml/b container main (job train) was refused GPU memory 2 times in 5 minutes on device 0"),
                ]},
            ],
            "promql_expr_test": [
                {"expr": dashboard_expr("Budgets promised / GPU memory", "A"), "eval_time": "15m",
                 "exp_samples": [
                    {"labels": "{device_uuid=\"GPU-1\"}", "value": 0.75},
                    {"labels": "{device_uuid=\"GPU-2\"}", "value": 2},
                 ]},
                {"expr": dashboard_expr("Budget used (highest first)", "A"), "eval_time": "15m",
                 "exp_samples": [
                    {"labels": "{budget_uid=\"1000\",budget_job=\"train\",device_uuid=\"GPU-1\"}", "value": 0.96875},
                 ]},
                {"expr": dashboard_expr("Headroom (budget \u{2212} used)", "A"), "eval_time": "15m",
                 "exp_samples": [
                    {"labels": "{budget_uid=\"1000\",budget_job=\"train\",device_uuid=\"GPU-1\"}", "value": 0.25},
                 ]},
            ],
        }],
    });
    let file = scratch("alerts").join("tests.yaml");
    std::fs::write(&file, serde_json::to_string_pretty(&tests).unwrap()).unwrap();
    let out = output(Command::new(promtool).args(["test", "rules"]).arg(&file));
    assert!(
        out.status.success(),
        "promtool test rules:\n{}{}",
        stdout(&out),
        stderr(&out)
    );
}
