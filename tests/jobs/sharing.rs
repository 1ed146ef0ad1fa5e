//! Sharing: the processes of one job (or of one HAMi shared cache) share one budget and
//! never pass it together, however many join at once; two jobs never affect each other.

use super::*;

#[test]
fn processes_of_one_job_share_one_budget() {
    let dir = job_dir("share");
    let e = envs(&dir, "job:train", "1Gi");
    let holder = Holder::start(&["alloc:700Mi"], &e);
    let run = client(&["info", "alloc:500Mi", "alloc:300Mi", "phys"], &e);
    let holder = holder.finish();
    assert_eq!(holder.rc("alloc", 0), 0, "{holder:?}");
    assert_eq!(run.num("info", 0, "free"), GI - 700 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 2, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 0, "{run:?}");
    assert!(run.stderr.contains("700.00 MiB in use"), "{}", run.stderr);
}

#[test]
fn a_denial_event_in_a_job_names_the_top_holders() {
    let dir = job_dir("events");
    let events = format!("{dir}/denials.jsonl");
    let mut e = envs(&dir, "job:ev", "1Gi");
    e.push(("CUDABUDGET_EVENTS", events.as_str()));
    let holder = Holder::start(&["alloc:700Mi"], &e);
    let run = client(&["alloc:100Mi", "alloc:500Mi"], &e);
    let holder = holder.finish();
    assert_eq!(holder.rc("alloc", 0), 0, "{holder:?}");
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
    let text = std::fs::read_to_string(&events).unwrap();
    let line = text.lines().last().unwrap();
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let top = v["top_holders"].as_array().expect(line);
    assert_eq!(top.len(), 2, "{line}");
    assert_eq!(top[0]["used_bytes"], 700 * MI, "{line}");
    assert_eq!(top[1]["used_bytes"], 100 * MI, "{line}");
    assert_eq!(v["job"], "ev", "{line}");
}

#[test]
fn two_jobs_do_not_affect_each_other() {
    let dir = job_dir("two");
    let holder = Holder::start(&["alloc:700Mi"], &envs(&dir, "job:a", "1Gi"));
    let other = client(&["alloc:900Mi"], &envs(&dir, "job:b", "1Gi"));
    let alone = client(&["alloc:900Mi"], &[("CUDABUDGET_LIMIT", "1Gi")]);
    holder.finish();
    assert_eq!(other.rc("alloc", 0), 0, "{other:?}");
    assert_eq!(alone.rc("alloc", 0), 0, "{alone:?}");
}

#[test]
fn racing_processes_never_pass_the_job_budget_together() {
    // Four processes each ask for 64 MiB twenty times; 16 × 64 MiB fill the budget.
    // Each holds what it got until every one has asked (a file the test makes once all
    // have answered twenty times), however slowly a busy machine starts them.
    let dir = job_dir("race");
    let e = envs(&dir, "job:race", "1Gi");
    let done = format!("{dir}/all-asked");
    let wait = format!("waitfile:{done}");
    let mut ops = vec!["alloc:64Mi"; 20];
    ops.push(&wait);
    let mut children: Vec<Child> = (0..4).map(|_| spawn(&ops, &e)).collect();
    let mut granted = 0;
    for child in &mut children {
        for _ in 0..20 {
            if util::wait_for_line(child, "alloc").contains("rc=0") {
                granted += 1;
            }
        }
    }
    std::fs::write(&done, b"").unwrap();
    let runs: Vec<Run> = children.into_iter().map(finish).collect();
    assert_eq!(granted, 16, "{runs:?}");
}

#[test]
fn a_thousand_and_twenty_four_processes_join_one_job() {
    let dir = job_dir("many");
    let e = envs(&dir, "job:many", "64Gi");
    let t = Instant::now();
    let mut failures = Vec::new();
    for wave in 0..16 {
        let children: Vec<Child> = (0..64)
            .map(|_| spawn(&["alloc:1Mi", "sleep:50"], &e))
            .collect();
        for run in children.into_iter().map(finish) {
            if run.rc("alloc", 0) != 0 {
                failures.push((wave, run));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
    // They all left: the job holds nothing.
    let after = client(&["info"], &e);
    assert_eq!(
        after.num("info", 0, "free"),
        64 * GI,
        "{after:?} after {:?}",
        t.elapsed()
    );
}

#[test]
fn processes_naming_one_hami_shared_cache_share_one_budget() {
    let dir = job_dir("hami");
    let cache = format!("{dir}/vgpu.cache");
    let e = [
        ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
        ("CUDA_DEVICE_MEMORY_SHARED_CACHE", cache.as_str()),
        ("FAKE_NVML_PID_OFFSET", "100000"),
    ];
    let holder = Holder::start(&["alloc:700Mi"], &e);
    let run = client(&["alloc:500Mi", "alloc:300Mi"], &e);
    let ledger = format!("{cache}.cudabudget");
    assert!(std::path::Path::new(&ledger).exists(), "beside the cache");
    holder.finish();
    assert_eq!(run.rc("alloc", 0), 2, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 0, "{run:?}");
    assert!(
        !std::path::Path::new(&ledger).exists(),
        "removed by its last member"
    );
}

#[test]
fn sixty_four_processes_started_at_once_all_join() {
    // Informational figure for the README (not a timed assertion): the join, from the
    // library's debug line, for 64 processes started at once.
    let dir = job_dir("joins");
    let mut e = envs(&dir, "job:joins", "8Gi");
    e.push(("CUDABUDGET_LOG", "debug"));
    let children: Vec<Child> = (0..64).map(|_| spawn(&["alloc:1Mi"], &e)).collect();
    let mut micros: Vec<f64> = children
        .into_iter()
        .map(finish)
        .filter_map(|r| {
            let line = r.stderr.lines().find(|l| l.contains("joined job ledger"))?;
            line.split(" in ")
                .nth(1)?
                .trim_end_matches(" µs")
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(micros.len(), 64, "every process joined");
    micros.sort_by(f64::total_cmp);
    println!(
        "join: median {:.1} µs, max {:.1} µs (64 processes at once)",
        micros[32], micros[63]
    );
}

#[test]
fn the_debug_log_names_the_job_ledger_joined() {
    // Where a job's books are, for whoever troubleshoots it: CUDABUDGET_LOG=debug says.
    let dir = job_dir("logpath");
    let mut e = envs(&dir, "job:named", "1Gi");
    e.push(("CUDABUDGET_LOG", "debug"));
    let run = client(&["alloc:1Mi"], &e);
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    let path = format!("{dir}/cudabudget-{}/job-named", unsafe_uid());
    assert!(
        run.stderr
            .contains(&format!("joined job ledger {path} in ")),
        "{}",
        run.stderr
    );
}

#[test]
fn a_process_started_with_its_standard_input_closed_joins_its_job() {
    // A daemon may start with descriptor 0 closed: the ledger's file may then be opened
    // as descriptor 0, which is a descriptor like any other.
    use std::os::unix::process::CommandExt;
    let dir = job_dir("nostdin");
    let e = envs(&dir, "job:nostdin", "1Gi");
    let mut cmd = command(&["alloc:1Mi"], &e);
    // SAFETY: close(2) is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::close(0);
            Ok(())
        });
    }
    let run = crate::util::run(cmd);
    assert_eq!(run.rc("init", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
}

#[test]
fn each_members_context_counts_against_the_jobs_budget() {
    // Where nothing measures a context, each member's is charged the estimate (at its
    // first view or allocation), to the job's books as well as its own.
    let dir = job_dir("contexts");
    let mut e = envs(&dir, "job:ctx", "1Gi");
    e.push(("FAKE_NVML_ABSENT", "1"));
    e.push(("CUDABUDGET_CONTEXT_MEMORY", "300Mi"));
    let holder = Holder::start(&["info"], &e);
    let view = client(&["info", "alloc:425Mi"], &e);
    holder.finish();
    assert_eq!(view.num("info", 0, "free"), GI - 600 * MI, "{view:?}");
    assert_eq!(view.rc("alloc", 0), 2, "{view:?}");
}

#[test]
fn a_member_whose_limit_differs_uses_the_jobs_budget_and_says_so_in_one_line() {
    // The first member's variables set the job's budget; a later member started with
    // another value is held to the job's, and told.
    let dir = job_dir("disagree");
    let holder = Holder::start(&["alloc:100Mi"], &envs(&dir, "job:d", "1Gi"));
    let other = client(&["info", "alloc:1200Mi"], &envs(&dir, "job:d", "4Gi"));
    holder.finish();
    assert_eq!(other.num("info", 0, "total"), GI, "{other:?}");
    assert_eq!(
        other.rc("alloc", 0),
        2,
        "held to the job's 1 GiB: {other:?}"
    );
    let said: Vec<&str> = other
        .stderr
        .lines()
        .filter(|l| l.contains("budget is the job's"))
        .collect();
    assert_eq!(said.len(), 1, "{}", other.stderr);
    assert!(
        said[0].contains("1.00 GiB") && said[0].contains("4.00 GiB"),
        "{}",
        said[0]
    );
}

/// A job over two devices (the fake's two): its budget holds on each device apart, so a
/// member on device 1 is not refused for what another holds on device 0, and is refused
/// on device 0 for it. (The same on two GPUs: `scripts/gpu/cases/two_gpu.py --case job`.)
#[test]
fn a_jobs_members_on_two_devices_are_held_to_its_budget_on_each() {
    let dir = job_dir("two-devices");
    let mut e = envs(&dir, "job:two", "1Gi");
    e.push(("FAKE_CUDA_DEVICES", "2"));
    let on_device_0 = Holder::start(&["alloc:768Mi"], &e);
    let run = client(
        &[
            "ctx:1",
            "alloc:768Mi",
            "ctx:0",
            "alloc:768Mi",
            "alloc:256Mi",
            "info",
        ],
        &e,
    );
    let on_device_0 = on_device_0.finish();
    assert_eq!(on_device_0.rc("alloc", 0), 0, "{on_device_0:?}");
    assert_eq!(
        run.rc("alloc", 0),
        0,
        "device 1 is the job's own too\n{run:?}"
    );
    assert_eq!(
        run.rc("alloc", 1),
        2,
        "device 0 has 768 MiB of the job's 1 GiB taken\n{run:?}"
    );
    assert_eq!(
        run.rc("alloc", 2),
        0,
        "what is left there is granted\n{run:?}"
    );
    assert_eq!(run.num("info", 0, "free"), 0, "{run:?}");
}
