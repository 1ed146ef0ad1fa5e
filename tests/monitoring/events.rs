//! What a denial tells: the stderr line names the process, and `CUDABUDGET_EVENTS`
//! collects one JSON line per denial from every process that appends to it.

use crate::util::cli::{fresh_library, scratch};
use crate::util::client_command;
use serde_json::Value;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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
    assert_eq!(event["outcome"], "denied");
    assert_eq!(event["request_bytes"], 2u64 << 30);
    assert_eq!(event["used_bytes"], 1u64 << 30);
    assert_eq!(event["limit_bytes"], 2u64 << 30);
    assert!(event["time"].as_str().unwrap().ends_with('Z'));
    assert_eq!(lines.len(), race_denied + 2, "nothing else, nothing torn");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn in_warn_mode_every_overrun_is_one_json_line_in_the_events_file_process_and_job_alike() {
    let dir = scratch("events-overrun");
    let events = dir.join("overruns.jsonl");
    let events_arg = events.to_str().unwrap();
    let job = format!("overrun-{}", std::process::id());
    let scope = format!("job:{job}");
    let warn = ("CUDABUDGET_ON_EXCEED", "warn");
    // On its own: 1 GiB fits, 2 GiB more do not and are admitted, 512 MiB more too.
    let (own_pid, own_out, own_err) = run(
        &["alloc:1Gi", "alloc:2Gi", "alloc:512Mi"],
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_EVENTS", events_arg),
            warn,
        ],
    );
    assert_eq!(
        own_out
            .lines()
            .filter(|l| l.starts_with("alloc rc=0 "))
            .count(),
        3,
        "{own_out}"
    );
    let told = format!(
        "cudabudget: pid {own_pid} (client): cuMemAlloc of 2.00 GiB on device 0 admitted past \
         the budget (CUDABUDGET_ON_EXCEED=warn): 1.00 GiB in use, budget 2.00 GiB"
    );
    assert!(
        own_err.lines().any(|l| l == told),
        "no {told:?} in\n{own_err}"
    );
    // In a job: the job's budget is what is crossed.
    let (job_pid, _, job_err) = run(
        &["alloc:3Gi"],
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_SCOPE", &scope),
            ("CUDABUDGET_EVENTS", events_arg),
            warn,
        ],
    );
    let told = format!("cudabudget: pid {job_pid} (client, job {job}): cuMemAlloc of 3.00 GiB");
    assert!(
        job_err.lines().any(|l| l.starts_with(&told)),
        "no {told:?} in\n{job_err}"
    );

    let text = std::fs::read_to_string(&events).expect("the events file exists");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}")))
        .collect();
    assert_eq!(
        lines.len(),
        3,
        "one line per overrun, nothing else:\n{text}"
    );
    for event in &lines {
        assert_eq!(event["outcome"], "overrun", "{event}");
        assert_eq!(event["call"], "cuMemAlloc");
        assert_eq!(event["limit_bytes"], 2u64 << 30);
        assert!(event["time"].as_str().unwrap().ends_with('Z'));
    }
    let own: Vec<&Value> = lines
        .iter()
        .filter(|e| e["pid"].as_u64() == Some(u64::from(own_pid)))
        .collect();
    assert_eq!(own.len(), 2);
    assert_eq!(own[0]["job"], Value::Null);
    assert_eq!(
        (
            own[0]["request_bytes"].as_u64(),
            own[0]["used_bytes"].as_u64()
        ),
        (Some(2 << 30), Some(1 << 30))
    );
    assert_eq!(
        (
            own[1]["request_bytes"].as_u64(),
            own[1]["used_bytes"].as_u64()
        ),
        (Some(512 << 20), Some(3 << 30)),
        "the books hold the first overrun"
    );
    let in_job = lines
        .iter()
        .find(|e| e["pid"].as_u64() == Some(u64::from(job_pid)))
        .expect("the job's overrun");
    assert_eq!(in_job["job"], job.as_str());
    assert_eq!(in_job["request_bytes"], 3u64 << 30);
    assert!(in_job["top_holders"].is_array(), "{in_job}");
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

/// What a run that had to end within a time limit did.
struct Bounded {
    /// False: it was still running at the limit (and was killed).
    finished: bool,
    stdout: String,
    stderr: String,
}

/// Runs `command` (output piped), killing it if it runs past `limit`.
fn run_within(mut command: Command, limit: Duration) -> Bounded {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the client");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let finished = loop {
        if child.try_wait().unwrap().is_some() {
            break true;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break false;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Bounded {
        finished,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// Denied, then admitted, then denied: the process stays budgeted.
const DENIED_ADMITTED_DENIED: &[&str] = &["alloc:4Gi", "alloc:1Gi", "alloc:2Gi"];

fn assert_still_budgeted(run: &Bounded) {
    let rcs: Vec<&str> = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("alloc "))
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    assert_eq!(
        rcs,
        ["rc=2", "rc=0", "rc=2"],
        "stdout:\n{}\nstderr:\n{}",
        run.stdout,
        run.stderr
    );
}

fn mkfifo(path: &std::path::Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
}

#[test]
fn a_fifo_at_the_events_path_moves_the_events_with_one_line_and_never_holds_up_the_process() {
    let dir = scratch("events-fifo");
    let fifo = dir.join("events.jsonl");
    mkfifo(&fifo);
    let library = fresh_library();
    let command = client_command(
        "gpa",
        DENIED_ADMITTED_DENIED,
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_EVENTS", fifo.to_str().unwrap()),
        ],
        Some(&library),
    );
    let run = run_within(command, Duration::from_secs(10));
    assert!(
        run.finished,
        "the client was still running after 10 s (a FIFO held it)\nstdout:\n{}",
        run.stdout
    );
    assert_still_budgeted(&run);
    let warned = assert_moved_with_one_line(&run, &fifo);
    assert!(warned.contains("FIFO"), "{warned}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where the library moves the events when the path named `named` cannot be used: the
/// same file name in `events/` of the user's records directory.
fn moved_events(named: &std::path::Path) -> std::path::PathBuf {
    crate::util::cli::records_dir()
        .join("events")
        .join(named.file_name().unwrap())
}

/// Asserts that the two denials of [`DENIED_ADMITTED_DENIED`] went to the moved events
/// file, and that one line said why and where; returns that line.
fn assert_moved_with_one_line(run: &Bounded, named: &std::path::Path) -> String {
    let moved = moved_events(named);
    let warned: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.contains("cannot append denial events"))
        .collect();
    assert_eq!(warned.len(), 1, "one line says why: {}", run.stderr);
    assert!(
        warned[0].contains(named.to_str().unwrap())
            && warned[0].contains(&format!("they go to {} instead", moved.display())),
        "the line names both places: {}",
        warned[0]
    );
    let text = std::fs::read_to_string(&moved)
        .unwrap_or_else(|e| panic!("{}: {e}\n{}", moved.display(), run.stderr));
    let outcomes: Vec<String> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["outcome"].to_string())
        .collect();
    assert_eq!(outcomes, ["\"denied\"", "\"denied\""], "{text}");
    warned[0].to_string()
}

#[test]
fn a_symbolic_link_at_the_events_path_is_not_followed_and_moves_the_events_with_one_line() {
    let dir = scratch("events-link");
    let precious = dir.join("precious");
    std::fs::write(&precious, "precious\n").unwrap();
    let link = dir.join("events.jsonl");
    std::os::unix::fs::symlink(&precious, &link).unwrap();
    let library = fresh_library();
    let command = client_command(
        "gpa",
        DENIED_ADMITTED_DENIED,
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_EVENTS", link.to_str().unwrap()),
        ],
        Some(&library),
    );
    let run = run_within(command, Duration::from_secs(30));
    assert!(run.finished);
    assert_still_budgeted(&run);
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "precious\n");
    let warned = assert_moved_with_one_line(&run, &link);
    assert!(warned.contains("symbolic link"), "{warned}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_directory_at_the_events_path_moves_the_events_with_one_line() {
    let dir = scratch("events-dir");
    let named = dir.join("events.jsonl");
    std::fs::create_dir(&named).unwrap();
    let library = fresh_library();
    let command = client_command(
        "gpa",
        DENIED_ADMITTED_DENIED,
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_EVENTS", named.to_str().unwrap()),
        ],
        Some(&library),
    );
    let run = run_within(command, Duration::from_secs(30));
    assert!(run.finished);
    assert_still_budgeted(&run);
    let warned = assert_moved_with_one_line(&run, &named);
    assert!(warned.contains("a directory"), "{warned}");
    assert_eq!(std::fs::read_dir(&named).unwrap().count(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_short_write_leaves_no_half_line_in_the_events_file() {
    let dir = scratch("events-short");
    let events = dir.join("events.jsonl");
    // A file that already holds whole lines, and a file-size limit that lets the next
    // line in only part of the way (write(2) then returns short, as on a full disk).
    let before = "{\"earlier\":true}\n".repeat(1024);
    std::fs::write(&events, &before).unwrap();
    std::fs::set_permissions(&events, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let limit = before.len() as u64 + 60;
    let library = fresh_library();
    let mut command = client_command(
        "gpa",
        DENIED_ADMITTED_DENIED,
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_EVENTS", events.to_str().unwrap()),
        ],
        Some(&library),
    );
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        command.pre_exec(move || {
            let rlimit = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            libc::setrlimit(libc::RLIMIT_FSIZE, &rlimit);
            // Past the limit the kernel sends SIGXFSZ; ignored, write(2) returns short.
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let run = run_within(command, Duration::from_secs(30));
    assert!(run.finished);
    assert_still_budgeted(&run);
    let after = std::fs::read_to_string(&events).unwrap();
    assert!(
        after.ends_with('\n'),
        "a half line was left: {:?}",
        &after[before.len()..]
    );
    for line in after.lines() {
        serde_json::from_str::<Value>(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"));
    }
    assert_eq!(after, before, "no denial line fits under the limit");
    assert!(
        run.stderr.contains("cannot append denial events"),
        "{}",
        run.stderr
    );
    let _ = std::fs::remove_dir_all(&dir);
}
