//! A job's budget, changed while its members run (`cudabudget limit --job`).

use super::*;
use crate::util::{GI, MI};

fn envs<'a>(limit: &'a str, job: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("CUDABUDGET_LIMIT", limit),
        ("CUDABUDGET_SCOPE", job),
        ("FAKE_NVML_PID_OFFSET", "100000"),
    ]
}

#[test]
fn a_job_budget_raised_then_lowered_holds_every_member_at_once() {
    let raised = Step::new("job-raise", "raised");
    let lowered = Step::new("job-lower", "lowered");
    let holder = spawn(
        &["alloc:600Mi", &lowered.op(), "alloc:100Mi"],
        &envs("1Gi", "job:live"),
    );
    until_shown(holder.id(), |p| p["devices"][0]["used_bytes"] == 600 * MI);
    let events = util::cli::scratch("job-events").join("events.jsonl");
    let events_text = events.display().to_string();
    let mut other_envs = envs("1Gi", "job:live");
    other_envs.push(("CUDABUDGET_EVENTS", &events_text));
    let other = spawn(
        &[&raised.op(), "sleep:200", "info", "nvml:0", "alloc:1200Mi"],
        &other_envs,
    );
    until_shown(other.id(), |_| true);
    let said = limit_ok(&["--job", "live", "2Gi"]);
    assert!(said.contains("budget 1.00 GiB -> 2.00 GiB"), "{said}");
    raised.go();
    let other = finish(other);
    assert_eq!(
        other.num("info", 0, "total"),
        2 * GI,
        "the view follows: {other:?}"
    );
    assert_eq!(
        other.num("nvml", 0, "total"),
        2 * GI,
        "NVML's too: {other:?}"
    );
    // The member that saw the change wrote it as an event, naming who made it.
    let seen = changes(&events);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0]["job"], "live");
    assert_eq!(seen[0]["previous_limit_bytes"], GI);
    assert_eq!(seen[0]["limit_bytes"], 2 * GI);
    assert_eq!(seen[0]["changed_by"]["uid"], my_uid());
    assert!(
        seen[0]["changed_by"]["pid"].as_u64().unwrap() > 0,
        "{seen:?}"
    );
    assert_eq!(
        other.rc("alloc", 0),
        0,
        "600 MiB + 1200 MiB within 2 GiB: {other:?}"
    );
    let shown = limit_ok(&["--job", "live"]);
    assert!(
        shown.contains("device 0: budget 2.00 GiB, 600.00 MiB in use"),
        "{shown}"
    );
    limit_ok(&["--job", "live", "512Mi"]);
    let shown = limit_ok(&["--job", "live"]);
    assert!(shown.contains("(over its budget)"), "{shown}");
    // Status follows the job's budget too (each member publishes the budget in force).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = stdout(&output(&mut cudabudget(&["status"])));
        if text.contains("over its budget of 512.00 MiB on device 0") {
            break;
        }
        assert!(Instant::now() < deadline, "{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
    lowered.go();
    let holder = finish(holder);
    assert_eq!(
        holder.rc("alloc", 1),
        2,
        "600 MiB held, 512 MiB in force: {holder:?}"
    );
}

#[test]
fn a_waiting_member_goes_through_as_soon_as_the_job_budget_grows() {
    let holder =
        util::cli::Budgeted::start(&["alloc:900Mi", "sleep:30000"], &envs("1Gi", "job:grow"));
    holder.wait_for(1, |p| p["devices"][0]["used_bytes"] == 900 * MI);
    let mut e = envs("1Gi", "job:grow");
    e.push(("CUDABUDGET_ON_EXCEED", "wait:30s"));
    let waiter = spawn(&["alloc:500Mi"], &e);
    until_shown(waiter.id(), |p| p["devices"][0]["waits"] == 1);
    let raised = Instant::now();
    limit_ok(&["--job", "grow", "2Gi"]);
    let run = finish(waiter);
    let after = raised.elapsed();
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert!(
        after < Duration::from_secs(5),
        "waited {after:?} after the raise"
    );
}

#[test]
fn a_member_that_joins_after_a_change_is_held_to_the_changed_budget() {
    let holder =
        util::cli::Budgeted::start(&["alloc:100Mi", "sleep:30000"], &envs("1Gi", "job:late"));
    holder.wait_for(1, |_| true);
    limit_ok(&["--job", "late", "3Gi"]);
    let late = finish(spawn(&["info", "alloc:2Gi"], &envs("1Gi", "job:late")));
    assert_eq!(late.num("info", 0, "total"), 3 * GI, "{late:?}");
    assert_eq!(late.rc("alloc", 0), 0, "{late:?}");
    assert!(
        late.stderr.contains("budget is the job's 3.00 GiB"),
        "{}",
        late.stderr
    );
}

#[test]
fn a_budget_of_zero_is_refused_and_the_jobs_budget_stays() {
    // An operator used to HAMi, whose 0 means no budget, would stop the job instead.
    let done = Step::new("job-zero", "done");
    let member = spawn(&["alloc:100Mi", &done.op()], &envs("1Gi", "job:zero"));
    until_shown(member.id(), |p| p["devices"][0]["used_bytes"] == 100 * MI);
    for zero in ["0", "0Gi"] {
        let out = limit(&["--job", "zero", zero]);
        let said = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{said}");
        assert_eq!(said.lines().count(), 1, "{said}");
        assert!(
            said.contains("0 bytes would refuse every allocation (HAMi's 0 means no budget)"),
            "{said}"
        );
    }
    for device in [&[][..], &["--device", "0"]] {
        let mut args = vec!["--job", "zero"];
        args.extend_from_slice(device);
        let shown = limit_ok(&args);
        assert!(shown.contains("device 0: budget 1.00 GiB"), "{shown}");
        // A budget shown is one set: no word of none.
        assert!(!shown.contains("no budget set yet"), "{shown}");
    }
    done.go();
    let member = finish(member);
    assert_eq!(member.rc("alloc", 0), 0, "{member:?}");
}

#[test]
fn a_job_that_is_not_there_is_refused_with_one_line() {
    let out = limit(&["--job", "nobody-runs-this", "1Gi"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("no job nobody-runs-this"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn limit_never_dies_reading_or_writing_a_ledger_its_owner_cuts_meanwhile() {
    use cudabudget_spec::job_file;
    use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
    use std::os::unix::process::ExitStatusExt;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    // The ledger of job `cut`, laid out as its first member would (no member runs).
    let dir = util::test_dir()
        .join("jobs")
        .join(format!("cudabudget-{}", my_uid()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let path = std::fs::canonicalize(&dir).unwrap().join("job-cut");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .unwrap();
    let header = job_file::header();
    file.set_len(job_file::FILE_BYTES as u64).unwrap();
    file.write_all_at(&header, 0).unwrap();

    // The owner cuts the file to nothing and makes it whole again, over and over, while
    // `limit` reads it and writes it.
    let stop = Arc::new(AtomicBool::new(false));
    let cutter = std::thread::spawn({
        let stop = Arc::clone(&stop);
        move || {
            let mut cuts = 0u64;
            while !stop.load(Ordering::Relaxed) {
                file.set_len(0).unwrap();
                file.set_len(job_file::FILE_BYTES as u64).unwrap();
                file.write_all_at(&header, 0).unwrap();
                cuts += 1;
            }
            cuts
        }
    });
    let (mut succeeded, mut refused) = (0, 0);
    let mut failures = Vec::new();
    for round in 0..300 {
        let args: &[&str] = if round % 2 == 0 {
            &["--job", "cut"]
        } else {
            &["--job", "cut", "1Gi"]
        };
        let out = limit(args);
        let said = stderr(&out);
        if let Some(signal) = out.status.signal() {
            failures.push(format!("limit {args:?} died of signal {signal}: {said}"));
        } else if out.status.success() {
            succeeded += 1;
        } else if out.status.code() == Some(1)
            && said.contains(&format!("job ledger {}: ", path.display()))
            && said.trim_end().lines().count() == 1
        {
            refused += 1;
        } else {
            failures.push(format!("limit {args:?}: {:?}: {said}", out.status));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let cuts = cutter.join().unwrap();
    assert!(
        failures.is_empty(),
        "{} of 300 runs ({succeeded} succeeded, {refused} refused naming the ledger, \
         {cuts} cuts):\n{}",
        failures.len(),
        failures.join("\n")
    );
}
