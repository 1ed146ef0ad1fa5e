//! `cudabudget status`: live budgeted processes publish their figures, and status reads
//! them — and only trustworthy records of live processes.

use crate::util::cli::{
    Budgeted, cudabudget, find_process, output, record_of, scratch, status_json, stderr, stdout,
};
use crate::util::{GI, MI};
use cudabudget_spec::record;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

#[test]
fn status_shows_a_budgeted_process_with_its_figures_and_the_gpu() {
    let client = Budgeted::start(
        &["alloc:1Gi", "alloc:4Gi", "sleep:20000"],
        &[("CUDABUDGET_LIMIT", "2Gi")],
    );
    let process = client.wait_for(1, |p| p["devices"][0]["denials"] == 1);
    assert_eq!(process["job"], serde_json::Value::Null);
    assert!(
        process["command"]
            .as_str()
            .unwrap()
            .contains("client gpa alloc:1Gi"),
        "{process}"
    );
    let device = &process["devices"][0];
    assert_eq!(device["index"], 0);
    assert_eq!(device["uuid"], "GPU-faceb00c-0000-0000-0000-000000000000");
    assert_eq!(device["used_bytes"], GI);
    assert_eq!(device["limit_bytes"], 2 * GI);
    assert_eq!(device["peak_bytes"], GI);
    assert_eq!(device["waits"], 0);
    // The fake NVML's card: 80 GiB.
    assert_eq!(device["physical_total_bytes"], 80 * GI);

    let status = status_json(&[]);
    let gpu = &status["gpus"][0];
    assert_eq!(gpu["uuid"], "GPU-faceb00c-0000-0000-0000-000000000000");
    assert_eq!(gpu["total_bytes"], 80 * GI);

    let out = output(&mut cudabudget(&["status"]));
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    let row = table
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(&client.pid().to_string()))
        .unwrap_or_else(|| panic!("no row for {}:\n{table}", client.pid()));
    for cell in ["1.00 GiB", "2.00 GiB", " 1 "] {
        assert!(row.contains(cell), "{cell:?} not in {row:?}");
    }
    // The program by its file name and its arguments, not the start of a long path.
    assert!(
        row.ends_with("  client gpa alloc:1Gi alloc:4Gi sleep:20000"),
        "{row:?}"
    );
    assert!(table.contains("GPU 0 GPU-faceb00c"), "{table}");
}

#[test]
fn figures_follow_the_process_while_it_runs() {
    let client = Budgeted::start(
        &["alloc:256Mi", "sleep:600", "alloc:512Mi", "sleep:20000"],
        &[("CUDABUDGET_LIMIT", "4Gi")],
    );
    client.wait_for(1, |p| {
        p["devices"][0]["used_bytes"] == 256 * crate::util::MI
    });
    client.wait_for(1, |p| {
        p["devices"][0]["used_bytes"] == 768 * crate::util::MI
    });
}

#[test]
fn kubernetes_names_come_from_the_environment() {
    let client = Budgeted::start(
        &["alloc:1Mi", "sleep:20000"],
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("POD_NAME", "trainer-0"),
            ("POD_NAMESPACE", "ml"),
            ("CONTAINER_NAME", "main"),
        ],
    );
    let process = client.wait_for(1, |_| true);
    assert_eq!(process["pod"], "trainer-0");
    assert_eq!(process["namespace"], "ml");
    assert_eq!(process["container"], "main");
}

#[test]
fn a_process_killed_without_exiting_disappears_and_its_record_is_removed() {
    let mut client = Budgeted::start(
        &["alloc:1Mi", "sleep:20000"],
        &[("CUDABUDGET_LIMIT", "1Gi")],
    );
    client.wait_for(1, |_| true);
    let pid = client.pid();
    let record = record_of(pid).expect("a record while it runs");
    client.kill(); // SIGKILL: no exit handler runs
    assert!(record.exists(), "nothing else removes it");
    let status = status_json(&[]);
    assert!(find_process(&status, pid).is_none(), "{status}");
    assert!(!record.exists(), "status cleaned the dead process's record");
}

#[test]
fn a_process_that_exits_removes_its_own_record() {
    let mut client = Budgeted::start(&["alloc:1Mi", "sleep:700"], &[("CUDABUDGET_LIMIT", "1Gi")]);
    client.wait_for(1, |_| true);
    let pid = client.pid();
    let status = client.child.wait().unwrap();
    assert!(status.success());
    assert!(
        record_of(pid).is_none(),
        "the record of {pid} is left behind"
    );
}

#[test]
fn an_unbudgeted_process_publishes_nothing() {
    let client = Budgeted::start(&["alloc:1Mi", "sleep:1500"], &[]);
    std::thread::sleep(Duration::from_millis(700));
    assert!(record_of(client.pid()).is_none());
}

/// A record as a process would write it, for a scratch runtime directory.
fn write_record(dir: &std::path::Path, record: &record::Record) -> std::path::PathBuf {
    let mut buf = [0u8; record::SIZE];
    record.encode(&mut buf);
    let path = dir.join(record::file_name(record.pid, record.pid_namespace));
    std::fs::write(&path, buf).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn own_identity() -> (u64, u64) {
    let stat = std::fs::read("/proc/self/stat").unwrap();
    let link = std::fs::read_link("/proc/self/ns/pid").unwrap();
    (
        record::start_time_from_stat(&stat).unwrap(),
        record::namespace_inode(&link.to_string_lossy()).unwrap(),
    )
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A runtime directory of its own (CUDABUDGET_RUNTIME_DIR, read by the CLI) with this
/// user's records directory in it.
fn runtime(test: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let base = scratch(test);
    // SAFETY: geteuid cannot fail.
    let uid = unsafe { libc::geteuid() };
    let dir = base.join(cudabudget_spec::place::user_dir_name(uid));
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    (base, dir)
}

#[test]
fn a_reused_pid_is_not_taken_for_the_process_that_wrote_the_record() {
    let (base, dir) = runtime("reused-pid");
    let (start, namespace) = own_identity();
    let live = record::Record {
        pid: std::process::id(),
        start_time: start,
        pid_namespace: namespace,
        updated_ms: now_ms(),
        command: "live".into(),
        ..Default::default()
    };
    let live_path = write_record(&dir, &live);
    let env = [("CUDABUDGET_RUNTIME_DIR", base.to_str().unwrap())];
    let status = status_json(&env);
    assert!(
        find_process(&status, std::process::id()).is_some(),
        "{status}"
    );

    // The same pid, but started at another time: another process.
    let reused = record::Record {
        start_time: start + 1,
        ..live
    };
    write_record(&dir, &reused);
    let status = status_json(&env);
    assert!(
        find_process(&status, std::process::id()).is_none(),
        "{status}"
    );
    assert!(!live_path.exists(), "the stale record is removed");
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn records_from_another_pid_namespace_count_while_they_are_fresh() {
    let (base, dir) = runtime("other-namespace");
    let fresh = record::Record {
        pid: 7,
        start_time: 1,
        pid_namespace: 1, // not ours: the pid cannot be checked from here
        updated_ms: now_ms(),
        command: "in a container".into(),
        ..Default::default()
    };
    write_record(&dir, &fresh);
    let abandoned = record::Record {
        pid: 8,
        updated_ms: now_ms() - 3_600_000,
        ..fresh.clone()
    };
    let abandoned_path = write_record(&dir, &abandoned);
    let status = status_json(&[("CUDABUDGET_RUNTIME_DIR", base.to_str().unwrap())]);
    assert!(find_process(&status, 7).is_some(), "{status}");
    assert!(find_process(&status, 8).is_none(), "{status}");
    assert!(!abandoned_path.exists());
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn untrusted_records_are_passed_over_without_harm() {
    let (base, dir) = runtime("untrusted");
    let (start, namespace) = own_identity();
    let pid = std::process::id();
    let name = record::file_name(pid, namespace);
    // Garbage of the right size, under a live pid's name.
    std::fs::write(dir.join(&name), vec![0xA5u8; record::SIZE]).unwrap();
    // A record whose checksum does not match its contents.
    let good = record::Record {
        pid: 1,
        start_time: 0,
        pid_namespace: namespace,
        updated_ms: now_ms(),
        command: "x".into(),
        ..Default::default()
    };
    let mut buf = [0u8; record::SIZE];
    good.encode(&mut buf);
    buf[2000] ^= 1;
    std::fs::write(dir.join(record::file_name(1, namespace)), buf).unwrap();
    // A symbolic link to someone else's file, and a file of the wrong size.
    std::os::unix::fs::symlink("/etc/passwd", dir.join(record::file_name(2, namespace))).unwrap();
    std::fs::write(dir.join(record::file_name(3, namespace)), b"short").unwrap();
    let env = [("CUDABUDGET_RUNTIME_DIR", base.to_str().unwrap())];
    let status = status_json(&env);
    assert_eq!(status["processes"], serde_json::json!([]), "{status}");
    // Not a record, or a damaged one: removed (the process writes a whole new one at
    // its next heartbeat). A link is named, and left alone.
    assert!(!dir.join(&name).exists(), "{status}");
    assert!(!dir.join(record::file_name(1, namespace)).exists());
    let skipped = status["skipped"].to_string();
    assert!(
        skipped.contains(&record::file_name(2, namespace)) && skipped.contains("symbolic link"),
        "{status}"
    );

    // A record that is fine, but in a directory others may write: not trusted.
    let trusted = record::Record {
        pid,
        start_time: start,
        ..good
    };
    write_record(&dir, &trusted);
    assert!(find_process(&status_json(&env), pid).is_some());
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let status = status_json(&env);
    assert!(find_process(&status, pid).is_none(), "{status}");
    assert!(
        status["skipped"]
            .to_string()
            .contains("others may write it"),
        "{status}"
    );
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn watch_prints_a_fresh_object_at_every_interval() {
    let mut child = cudabudget(&["status", "--json", "--watch", "0.2"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Three objects read as they come (one a line), however slowly: then it is stopped
    // (or after a minute without them, so that a watch that stops printing fails).
    use std::io::BufRead;
    let (done, stop) = std::sync::mpsc::channel::<()>();
    let pid = child.id() as libc::pid_t;
    let watchdog = std::thread::spawn(move || {
        if stop.recv_timeout(Duration::from_secs(60)).is_err() {
            // SAFETY: a plain signal to our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut text = String::new();
    let mut objects = 0;
    while objects < 3 {
        let Some(Ok(line)) = lines.next() else { break };
        if line.starts_with("{\"processes\"") {
            objects += 1;
        }
        text += &line;
        text += "\n";
    }
    let _ = done.send(());
    watchdog.join().unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(objects, 3, "{text}");
}

#[test]
fn a_watch_interval_too_short_is_a_usage_error() {
    let out = output(&mut cudabudget(&["status", "--watch", "0"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).starts_with("cudabudget: --watch"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn cudabudget_runtime_dir_moves_the_records_for_the_library_and_the_cli_alike() {
    let base = scratch("runtime-dir");
    let base_arg = base.to_str().unwrap();
    let client = Budgeted::start(
        &["alloc:1Mi", "sleep:20000"],
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_RUNTIME_DIR", base_arg),
        ],
    );
    let env = [("CUDABUDGET_RUNTIME_DIR", base_arg)];
    let deadline = Instant::now() + Duration::from_secs(10);
    while find_process(&status_json(&env), client.pid()).is_none() {
        assert!(
            Instant::now() < deadline,
            "never published under {base_arg} (src/config.rs must accept CUDABUDGET_RUNTIME_DIR)"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        record_of(client.pid()).is_none(),
        "nothing in the default runtime directory"
    );
    drop(client);
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_job_s_processes_are_shown_under_its_name() {
    let job = format!("status-{}", std::process::id());
    let scope = format!("job:{job}");
    let envs = [
        ("CUDABUDGET_LIMIT", "3Gi"),
        ("CUDABUDGET_SCOPE", scope.as_str()),
    ];
    let first = Budgeted::start(&["alloc:1Gi", "sleep:20000"], &envs);
    let second = Budgeted::start(&["alloc:512Mi", "sleep:20000"], &envs);
    let a = first.wait_for(1, |p| p["devices"][0]["used_bytes"].as_u64() > Some(0));
    let b = second.wait_for(1, |p| p["devices"][0]["used_bytes"].as_u64() > Some(0));
    assert_eq!(a["job"], job.as_str());
    assert_eq!(b["job"], job.as_str());
    assert_eq!(a["devices"][0]["limit_bytes"], 3 * GI);
    let out = output(&mut cudabudget(&["status"]));
    let table = stdout(&out);
    assert!(
        table.contains(&format!("job {job}: 2 processes")),
        "{table}\n{a}\n{b}"
    );
}

#[test]
fn status_counts_the_allocations_that_waited() {
    // With CUDABUDGET_ON_EXCEED=wait:…, a request that does not fit waits (here in
    // vain: nothing is freed) and status counts it among the waits, as well as the
    // denial it ends in.
    let client = Budgeted::start(
        &["alloc:1Gi", "alloc:1536Mi", "sleep:20000"],
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_ON_EXCEED", "wait:200ms"),
        ],
    );
    let process = client.wait_for(1, |p| p["devices"][0]["denials"] == 1);
    assert_eq!(process["devices"][0]["waits"], 1, "{process}");
}

#[test]
fn in_warn_mode_status_shows_a_process_and_a_job_above_their_budgets_with_their_overruns() {
    let warn = ("CUDABUDGET_ON_EXCEED", "warn");
    let client = Budgeted::start(
        &["alloc:1Gi", "alloc:2Gi", "sleep:20000"],
        &[("CUDABUDGET_LIMIT", "2Gi"), warn],
    );
    let process = client.wait_for(1, |p| p["devices"][0]["overruns"] == 1);
    let device = &process["devices"][0];
    assert_eq!(device["used_bytes"], 3 * GI, "{process}");
    assert_eq!(device["limit_bytes"], 2 * GI, "{process}");
    assert_eq!(device["denials"], 0, "{process}");

    let job = format!("over-{}", std::process::id());
    let scope = format!("job:{job}");
    let envs = [
        ("CUDABUDGET_LIMIT", "2Gi"),
        ("CUDABUDGET_SCOPE", scope.as_str()),
        warn,
    ];
    let first = Budgeted::start(&["alloc:1536Mi", "sleep:20000"], &envs);
    first.wait_for(1, |p| p["devices"][0]["used_bytes"] == 1536 * MI);
    let second = Budgeted::start(&["alloc:1Gi", "sleep:20000"], &envs);
    let b = second.wait_for(1, |p| p["devices"][0]["overruns"] == 1);
    assert_eq!(b["devices"][0]["used_bytes"], GI, "{b}");
    let status = status_json(&[]);
    let total = status["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["name"] == job.as_str())
        .unwrap_or_else(|| panic!("no job {job}: {status:#}"));
    assert_eq!(
        total["used_bytes"],
        2560 * MI,
        "above the job's 2 GiB: {total}"
    );
    let out = output(&mut cudabudget(&["status"]));
    let table = stdout(&out);
    assert!(
        table.contains(&format!("job {job}: 2 processes, 2.50 GiB in use")),
        "{table}"
    );
}

/// A record of this test's own process (root's directory: it may claim any pid), with
/// `change` applied, the checksum sealed again.
fn own_record(change: impl FnOnce(&mut record::Record)) -> record::Record {
    let (start, namespace) = own_identity();
    let mut r = record::Record {
        pid: std::process::id(),
        start_time: start,
        pid_namespace: namespace,
        updated_ms: now_ms(),
        command: "own".into(),
        ..Default::default()
    };
    change(&mut r);
    r
}

/// `count` files under record names of processes in another PID namespace (their pids
/// cannot be checked from here, so only their contents say they are junk): full-size
/// records with one byte changed (the checksum fails), random bytes, short files.
fn junk(dir: &std::path::Path, count: u32, kinds: &[&str]) {
    let mut good = [0u8; record::SIZE];
    record::Record {
        pid: 1,
        pid_namespace: 1,
        updated_ms: now_ms(),
        command: "junk".into(),
        ..Default::default()
    }
    .encode(&mut good);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..count {
        let pid = 100_000 + i;
        let name = record::file_name(pid, 1);
        let bytes: Vec<u8> = match kinds[i as usize % kinds.len()] {
            "checksum" => {
                let mut bad = good;
                bad[24..28].copy_from_slice(&pid.to_le_bytes());
                bad[3000] ^= 1;
                bad.to_vec()
            }
            "random" => (0..record::SIZE)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect(),
            _ => b"short".to_vec(),
        };
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

#[test]
fn two_thousand_bad_checksum_records_cost_status_one_look_each_and_are_removed() {
    let (base, dir) = runtime("bad-checksums");
    write_record(&dir, &own_record(|_| {}));
    junk(&dir, 2000, &["checksum"]);
    let env = [("CUDABUDGET_RUNTIME_DIR", base.to_str().unwrap())];
    let status = status_json(&env);
    assert!(
        find_process(&status, std::process::id()).is_some(),
        "{status}"
    );
    let left = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(left, 1, "the bad records are reaped, the good one stays");
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn ten_thousand_junk_files_neither_hide_a_process_nor_stay_as_records() {
    let (base, dir) = runtime("junk");
    write_record(&dir, &own_record(|_| {}));
    junk(&dir, 10_000, &["checksum", "random", "short", "random"]);
    // Names that are not records at all cost only their name.
    for i in 0..2000 {
        std::fs::write(dir.join(format!("junk-{i}")), b"x").unwrap();
    }
    let env = [("CUDABUDGET_RUNTIME_DIR", base.to_str().unwrap())];
    let status = status_json(&env);
    assert!(
        find_process(&status, std::process::id()).is_some(),
        "{status}"
    );
    // The bad records were reaped at the first look (only the good record and the
    // names that are no records stay): the next status reads no junk again.
    let left = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(left, 1 + 2000, "the bad records are reaped");
    let again = status_json(&env);
    assert!(
        find_process(&again, std::process::id()).is_some(),
        "{again}"
    );
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_record_dated_in_the_future_is_neither_shown_nor_kept() {
    let (base, dir) = runtime("future");
    let year_ms = 365 * 24 * 3_600_000;
    // In another PID namespace (its pid cannot be checked): only its date speaks for it.
    let elsewhere = write_record(
        &dir,
        &record::Record {
            pid: 7,
            start_time: 1,
            pid_namespace: 1,
            updated_ms: now_ms() + year_ms,
            command: "from the future".into(),
            ..Default::default()
        },
    );
    // This process's own record, dated ahead.
    let own = write_record(&dir, &own_record(|r| r.updated_ms = now_ms() + year_ms));
    let env = [("CUDABUDGET_RUNTIME_DIR", base.to_str().unwrap())];
    let status = status_json(&env);
    assert!(find_process(&status, 7).is_none(), "{status}");
    assert!(
        find_process(&status, std::process::id()).is_none(),
        "{status}"
    );
    assert!(!elsewhere.exists(), "a future-dated record is reaped");
    assert!(!own.exists(), "a future-dated record is reaped");
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn figures_no_card_can_hold_are_not_shown() {
    let (base, dir) = runtime("huge");
    let path = write_record(
        &dir,
        &own_record(|r| {
            r.devices = vec![record::DeviceFigures {
                ordinal: 0,
                budget: 8 * GI,
                denials: 4242,
                ..Default::default()
            }]
        }),
    );
    // What a forger writes (the library never does): `used` of the first device (at
    // 1760 + 16) far past any card, the checksum sealed again.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[1776..1784].copy_from_slice(&9_223_372_036_854_775_807u64.to_le_bytes());
    bytes[16..24].fill(0);
    let sum = record::fnv1a(&bytes);
    bytes[16..24].copy_from_slice(&sum.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    let env = [("CUDABUDGET_RUNTIME_DIR", base.to_str().unwrap())];
    let status = status_json(&env);
    assert!(
        find_process(&status, std::process::id()).is_none(),
        "{status}"
    );
    assert!(
        !status.to_string().contains("9223372036854775807"),
        "{status}"
    );
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn terminal_escapes_in_a_command_line_are_shown_escaped() {
    // `exec -a` sets any argv[0]: here one that retitles the terminal, and text that
    // reverses what follows it.
    let title = "\x1b]0;pwned\x07";
    let base = scratch("escapes");
    let base_arg = base.to_str().unwrap();
    let library = crate::util::cli::fresh_library();
    let mut command = crate::util::fixture_command(
        "bash",
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_RUNTIME_DIR", base_arg),
            ("POD_NAME", "pod\u{202e}evil\x1b[2J"),
        ],
        Some(&library),
    );
    command
        .args(["-c", "exec -a \"$0\" \"$@\""])
        .arg(format!("{title}train\u{9b}31m"))
        .args([
            crate::util::client_bin("gpa"),
            "gpa",
            "alloc:1Mi",
            "sleep:20000",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut child = command.spawn().unwrap();
    let env = [("CUDABUDGET_RUNTIME_DIR", base_arg)];
    let deadline = Instant::now() + Duration::from_secs(10);
    while find_process(&status_json(&env), child.id()).is_none() {
        assert!(Instant::now() < deadline, "never published");
        std::thread::sleep(Duration::from_millis(50));
    }
    let table = output(cudabudget(&["status"]).envs(env));
    let json = output(cudabudget(&["status", "--json"]).envs(env));
    let _ = child.kill();
    let _ = child.wait();
    for out in [&table, &json] {
        let text = stdout(out);
        for raw in ['\x1b', '\x07', '\u{9b}', '\u{202e}'] {
            assert!(
                !text.contains(raw),
                "{raw:?} reaches the terminal raw:\n{text:?}"
            );
        }
    }
    let text = stdout(&table);
    assert!(text.contains(r"\e]0;pwned\atrain"), "{text}");
    assert!(text.contains(r"pod\u{202e}evil\e[2J"), "{text}");
    // JSON keeps the exact text, escaped as JSON.
    let status: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let process = find_process(&status, child.id()).expect("shown");
    assert!(
        process["command"].as_str().unwrap().starts_with(title),
        "{process}"
    );
    assert_eq!(process["pod"], "pod\u{202e}evil\x1b[2J");
    let _ = std::fs::remove_dir_all(&base);
}

/// A program's name (`/proc/<pid>/stat`'s second field) is 15 bytes of its file name,
/// cut wherever they end: here in the middle of a character, so it is not UTF-8.
#[test]
fn a_process_whose_name_is_not_utf8_is_shown_not_reaped() {
    let dir = crate::util::cli::scratch("name-not-utf8");
    // "a" and five 3-byte characters: the 15-byte name ends inside the fifth.
    let program = dir.join("a训练脚本模型");
    std::fs::copy(crate::util::client_bin("gpa"), &program).unwrap();
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
    let library = crate::util::cli::fresh_library();
    let mut command = crate::util::fixture_command(
        program.to_str().unwrap(),
        &[("CUDABUDGET_LIMIT", "2Gi")],
        Some(&library),
    );
    command
        .args(["gpa", "alloc:1Gi", "sleep:20000"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let client = crate::util::cli::Budgeted {
        child: command.spawn().unwrap(),
    };
    let stat = std::fs::read(format!("/proc/{}/stat", client.pid())).unwrap();
    assert!(
        std::str::from_utf8(&stat).is_err(),
        "the name is UTF-8 after all"
    );
    let process = client.wait_for(1, |p| p["devices"][0]["used_bytes"] == GI);
    assert_eq!(process["pid"], client.pid());
    // Shown again a moment later: the first look did not take it for dead and reap it.
    std::thread::sleep(Duration::from_millis(300));
    let status = status_json(&[]);
    assert!(find_process(&status, client.pid()).is_some(), "{status:#}");
}

#[test]
fn budgets_that_add_up_past_the_gpu_show_it_over_committed_in_status_and_doctor() {
    // On the fake's 80 GiB card: a job of two members at 30 GiB (its budget counted
    // once) and a process of its own at 60 GiB add up to 90 GiB.
    let places = scratch("overcommit");
    let places = places.to_str().unwrap();
    let env = [
        ("CUDABUDGET_RUNTIME_DIR", places),
        ("CUDABUDGET_JOB_DIR", places),
    ];
    let with = |more: &[(&'static str, &'static str)]| {
        let mut all: Vec<(&str, &str)> = env.to_vec();
        all.extend_from_slice(more);
        all
    };
    let job = with(&[
        ("CUDABUDGET_SCOPE", "job:shared"),
        ("CUDABUDGET_LIMIT", "30Gi"),
    ]);
    let members = [
        Budgeted::start(&["alloc:1Gi", "sleep:20000"], &job),
        Budgeted::start(&["alloc:1Gi", "sleep:20000"], &job),
    ];
    let mut own = Budgeted::start(
        &["alloc:1Gi", "sleep:20000"],
        &with(&[("CUDABUDGET_LIMIT", "60Gi")]),
    );
    let gpu_when = |want: u64| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let status = status_json(&env);
            if status["gpus"][0]["budgets_bytes"] == want {
                return status["gpus"][0].clone();
            }
            assert!(Instant::now() < deadline, "{status:#}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let gpu = gpu_when(90 * GI);
    assert_eq!(gpu["overcommitted"], true, "{gpu}");
    let out = output(cudabudget(&["status"]).envs(env));
    let table = stdout(&out);
    assert!(
        table.contains("OVER-COMMITTED: budgets add up to 90.00 GiB, 10.00 GiB more"),
        "{table}"
    );
    let out = output(
        cudabudget(&["doctor", "--json"])
            .envs(env)
            .env("CUDABUDGET_LIMIT", "1Gi"),
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let check = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "budgets")
        .cloned()
        .unwrap();
    assert_eq!(check["status"], "warn", "{check:#}");
    assert!(
        check["summary"]
            .as_str()
            .unwrap()
            .contains("budgets add up to 90.00 GiB of its 80.00 GiB"),
        "{check:#}"
    );
    // The process of its own gone: the job's 30 GiB fit.
    own.kill();
    let gpu = gpu_when(30 * GI);
    assert_eq!(gpu["overcommitted"], false, "{gpu}");
    drop(members);
}

#[test]
fn status_reads_the_device_plugins_containers_where_its_root_is_named() {
    // The device plugin gives each container `<root>/alloc/<id>/records` as its runtime
    // directory; the node's readers find them through CUDABUDGET_DEVICE_PLUGIN_DIR.
    let root = scratch("device-plugin-root");
    let records = root.join("alloc/0123456789abcdef/records");
    std::fs::create_dir_all(&records).unwrap();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::set_permissions(&records, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let elsewhere = scratch("device-plugin-node-runtime");
    let client = Budgeted::start(
        &["alloc:1Gi", "sleep:20000"],
        &[
            ("CUDABUDGET_LIMIT", "20Gi"),
            ("CUDABUDGET_RUNTIME_DIR", records.to_str().unwrap()),
        ],
    );
    let node = [
        ("CUDABUDGET_RUNTIME_DIR", elsewhere.to_str().unwrap()),
        ("CUDABUDGET_DEVICE_PLUGIN_DIR", root.to_str().unwrap()),
    ];
    let deadline = Instant::now() + Duration::from_secs(10);
    let process = loop {
        let status = status_json(&node);
        if let Some(p) = find_process(&status, client.pid()) {
            break p;
        }
        assert!(Instant::now() < deadline, "{status:#}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(process["devices"][0]["limit_bytes"], 20 * GI, "{process}");
    let without = status_json(&node[..1]);
    assert!(find_process(&without, client.pid()).is_none(), "{without}");
}

#[test]
fn a_runtime_directory_that_cannot_be_used_is_said_by_status_and_limit() {
    // As `run` and `doctor` say it, rather than showing the default places instead.
    for args in [
        &["status"][..],
        &["status", "--json"],
        &["limit", "--job", "j"],
    ] {
        let out = output(cudabudget(args).env("CUDABUDGET_RUNTIME_DIR", "relative"));
        let said = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {said}");
        assert!(
            said.starts_with("cudabudget: CUDABUDGET_RUNTIME_DIR=\"relative\" cannot be used"),
            "{args:?}: {said}"
        );
        assert!(stdout(&out).is_empty(), "{args:?}: {}", stdout(&out));
    }
}
