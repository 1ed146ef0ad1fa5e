//! A process's own budget, changed while it runs (`cudabudget limit --pid`).

use super::*;
use crate::util::{GI, MI};

#[test]
fn a_process_budget_lowered_then_raised_is_what_its_next_allocations_and_views_see() {
    let lower = Step::new("process-lower", "lower");
    let raise = Step::new("process-raise", "raise");
    let events = util::cli::scratch("process-events").join("events.jsonl");
    let events_text = events.display().to_string();
    let child = spawn(
        &[
            "alloc:600Mi",
            &lower.op(),
            "info",
            "alloc:300Mi",
            "alloc:100Mi",
            &raise.op(),
            "info",
            "alloc:1Gi",
        ],
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_EVENTS", &events_text),
        ],
    );
    let pid = child.id();
    until_shown(pid, |p| p["devices"][0]["used_bytes"] == 600 * MI);
    let said = limit_ok(&["--pid", &pid.to_string(), "800Mi"]);
    assert!(said.contains("budget 800.00 MiB"), "{said}");
    let shown = limit_ok(&["--pid", &pid.to_string()]);
    assert!(
        shown.contains("device 0: budget 800.00 MiB, 600.00 MiB in use"),
        "{shown}"
    );
    lower.go();
    until_shown(pid, |p| p["devices"][0]["used_bytes"] == 700 * MI);
    limit_ok(&["--pid", &pid.to_string(), "2Gi"]);
    raise.go();
    let run = finish(child);
    assert_eq!(run.num("info", 0, "total"), 800 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 2, "600 + 300 MiB past 800 MiB: {run:?}");
    assert_eq!(run.rc("alloc", 2), 0, "600 + 100 MiB within it: {run:?}");
    assert_eq!(run.num("info", 1, "total"), 2 * GI, "{run:?}");
    assert_eq!(
        run.rc("alloc", 3),
        0,
        "700 MiB + 1 GiB within 2 GiB: {run:?}"
    );
    let changes = changes(&events);
    assert_eq!(changes.len(), 2, "{changes:?}");
    assert_eq!(changes[0]["previous_limit_bytes"], GI);
    assert_eq!(changes[0]["limit_bytes"], 800 * MI);
    assert_eq!(changes[0]["used_bytes"], 600 * MI);
    assert_eq!(changes[1]["limit_bytes"], 2 * GI);
    assert_eq!(changes[0]["changed_by"]["uid"], my_uid());
}

#[test]
fn a_budget_lowered_below_the_use_frees_nothing_and_refuses_until_the_use_drops() {
    let step = Step::new("process-shrink", "shrink");
    let child = spawn(
        &[
            "alloc:600Mi",
            &step.op(),
            "alloc:1Mi",
            "free:0",
            "alloc:200Mi",
        ],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    let pid = child.id();
    until_shown(pid, |p| p["devices"][0]["used_bytes"] == 600 * MI);
    let said = limit_ok(&["--pid", &pid.to_string(), "256Mi"]);
    assert!(said.contains("over it"), "{said}");
    let p = until_shown(pid, |p| p["devices"][0]["limit_bytes"] == 256 * MI);
    assert_eq!(p["devices"][0]["used_bytes"], 600 * MI, "nothing was freed");
    let table = stdout(&output(&mut cudabudget(&["status"])));
    let row = table
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(&pid.to_string()))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(row.contains("over budget"), "{row}");
    step.go();
    let run = finish(child);
    assert_eq!(run.rc("alloc", 1), 2, "refused while over: {run:?}");
    assert_eq!(run.rc("free", 0), 0, "{run:?}");
    assert_eq!(
        run.rc("alloc", 2),
        0,
        "admitted once the use dropped: {run:?}"
    );
}

#[test]
fn a_waiting_allocation_goes_through_as_soon_as_the_process_budget_grows() {
    let child = spawn(
        &["alloc:900Mi", "alloc:500Mi"],
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_ON_EXCEED", "wait:30s"),
        ],
    );
    let pid = child.id();
    until_shown(pid, |p| p["devices"][0]["waits"] == 1);
    let raised = Instant::now();
    limit_ok(&["--pid", &pid.to_string(), "2Gi"]);
    let run = finish(child);
    let after = raised.elapsed();
    assert_eq!(run.rc("alloc", 1), 0, "{run:?}");
    assert!(
        after < Duration::from_secs(5),
        "waited {after:?} after the raise"
    );
}

#[test]
fn a_process_that_is_not_budgeted_or_belongs_to_a_job_is_refused_with_one_line() {
    let mut plain = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let out = limit(&["--pid", &plain.id().to_string(), "1Gi"]);
    let _ = plain.kill();
    let _ = plain.wait();
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stderr(&out).contains("is not budgeted"), "{}", stderr(&out));

    let member = util::cli::Budgeted::start(
        &["alloc:1Mi", "sleep:20000"],
        &[("CUDABUDGET_LIMIT", "1Gi"), ("CUDABUDGET_SCOPE", "job:j")],
    );
    member.wait_for(1, |_| true);
    let out = limit(&["--pid", &member.pid().to_string(), "2Gi"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stderr(&out).contains("limit --job j"), "{}", stderr(&out));

    let out = limit(&["--pid", "1", "20%"]);
    assert_eq!(out.status.code(), Some(2), "a percentage: {}", stderr(&out));
}

#[test]
fn limit_asks_for_a_job_or_a_pid_and_takes_a_jobs_owner_only_with_a_job() {
    for args in [&[][..], &["20Gi"]] {
        let out = limit(args);
        let said = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {said}");
        assert!(
            said.contains("<--job <NAME>|--pid <PID>>"),
            "{args:?}: {said}"
        );
    }
    for owner in [&["--uid", "0"][..], &["--namespace", "team-a"]] {
        let mut args = vec!["--pid", "1"];
        args.extend_from_slice(owner);
        let out = limit(&args);
        let said = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {said}");
        assert!(said.contains("cannot be used with"), "{args:?}: {said}");
    }
}
