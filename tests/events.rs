//! What a denial tells: the stderr line names the process, and `CUDABUDGET_EVENTS`
//! collects one JSON line per denial from every process that appends to it.

mod util;

use std::process::Stdio;

use serde_json::Value;
use util::cli::{fresh_library, scratch};
use util::client_command;

/// Runs the client under the library; (pid, stdout, stderr).
fn run(ops: &[&str], envs: &[(&str, &str)]) -> (u32, String, String) {
    let library = fresh_library();
    let child = client_command("gpa", ops, envs, Some(&library))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the client");
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (
        pid,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_denial_line_and_the_exit_summary_name_the_process() {
    let (pid, _, stderr) = run(
        &["alloc:1Gi", "alloc:4Gi"],
        &[("CUDABUDGET_LIMIT", "2Gi"), ("CUDABUDGET_LOG", "info")],
    );
    let denial = format!(
        "cudabudget: pid {pid} (client): denied cuMemAlloc of 4.00 GiB on device 0: \
         1.00 GiB in use, budget 2.00 GiB"
    );
    assert!(
        stderr.lines().any(|l| l == denial),
        "no {denial:?} in\n{stderr}"
    );
    let summary = format!("cudabudget: pid {pid} (client): device 0: peak 1.00 GiB of budget");
    assert!(stderr.contains(&summary), "no {summary:?} in\n{stderr}");
}

#[test]
fn every_denial_of_every_process_is_one_json_line_in_the_events_file() {
    let dir = scratch("events");
    let events = dir.join("denials.jsonl");
    let events_arg = events.to_str().unwrap();
    // Two processes at once, one of them with eight threads racing for the budget.
    let racing = std::thread::spawn({
        let events = events_arg.to_string();
        move || {
            run(
                &["race:8:50:1Gi"],
                &[
                    ("CUDABUDGET_LIMIT", "3Gi"),
                    ("CUDABUDGET_LOG", "off"),
                    ("CUDABUDGET_EVENTS", &events),
                ],
            )
        }
    });
    let (single_pid, single_out, single_err) = run(
        &["alloc:1Gi", "alloc:2Gi", "alloc:2Gi"],
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_EVENTS", events_arg),
        ],
    );
    assert!(
        !single_err.contains("not a known variable"),
        "src/config.rs must accept CUDABUDGET_EVENTS (DESIGN.md names it): {single_err}"
    );
    let (race_pid, race_out, _) = racing.join().unwrap();
    let race_denied: usize = race_out
        .lines()
        .find_map(|l| l.strip_prefix("race "))
        .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("denied=")))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no race line in {race_out}"));
    assert!(race_denied > 0, "{race_out}");
    assert_eq!(single_out.lines().filter(|l| *l == "alloc rc=2").count(), 2);

    let text = std::fs::read_to_string(&events).expect("the events file exists");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}")))
        .collect();
    let of = |pid: u32| {
        lines
            .iter()
            .filter(|e| e["pid"].as_u64() == Some(u64::from(pid)))
            .collect::<Vec<_>>()
    };
    assert_eq!(of(race_pid).len(), race_denied, "one line per denial");
    let single = of(single_pid);
    assert_eq!(single.len(), 2);
    let event = single[0];
    assert_eq!(event["command"], "client");
    assert_eq!(event["job"], Value::Null);
    assert_eq!(event["device"], 0);
    assert_eq!(event["call"], "cuMemAlloc");
    assert_eq!(event["request_bytes"], 2u64 << 30);
    assert_eq!(event["used_bytes"], 1u64 << 30);
    assert_eq!(event["limit_bytes"], 2u64 << 30);
    assert!(event["time"].as_str().unwrap().ends_with('Z'));
    assert_eq!(lines.len(), race_denied + 2, "nothing else, nothing torn");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_denial_in_a_job_names_the_job() {
    let job = format!("events-{}", std::process::id());
    let scope = format!("job:{job}");
    let (pid, _, stderr) = run(
        &["alloc:4Gi"],
        &[("CUDABUDGET_LIMIT", "2Gi"), ("CUDABUDGET_SCOPE", &scope)],
    );
    let start = format!("cudabudget: pid {pid} (client, job {job}): denied cuMemAlloc of 4.00 GiB");
    assert!(
        stderr.lines().any(|l| l.starts_with(&start)),
        "no {start:?} in\n{stderr}"
    );
}
