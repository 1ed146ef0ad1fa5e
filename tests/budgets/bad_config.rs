//! A malformed budget refuses CUDA with one line that says why; it never runs unbudgeted.

use crate::util::{budget_run, lib_path};

const MALFORMED: &[(&str, &str)] = &[
    ("CUDABUDGET_LIMIT", ""),
    ("CUDABUDGET_LIMIT", " "),
    ("CUDABUDGET_LIMIT", "10XB"),
    ("CUDABUDGET_LIMIT", "-1G"),
    ("CUDABUDGET_LIMIT", "150%"),
    ("CUDABUDGET_LIMIT", "0%"),
    ("CUDABUDGET_LIMIT", "1.2.3Gi"),
    ("CUDABUDGET_LIMIT", "Gi"),
    ("CUDABUDGET_LIMIT", "12Gig"),
    ("CUDABUDGET_LIMIT", "1e9"),
    ("CUDABUDGET_LIMIT", "0x10"),
    ("CUDABUDGET_LIMIT", "ten"),
    ("CUDABUDGET_LIMIT", "18446744073709551616"),
    ("CUDABUDGET_LIMIT", "17179869184Ti"),
    ("CUDABUDGET_LIMIT", "1,5Gi"),
    ("CUDABUDGET_LIMIT", "5 Gi"),
    ("CUDABUDGET_LIMIT", "100m"),
    ("CUDABUDGET_LIMIT", "8Gb"),
    ("CUDABUDGET_LIMIT", "+1G"),
    ("CUDABUDGET_LIMIT", "%"),
    ("CUDABUDGET_LIMIT", "inf"),
    ("CUDABUDGET_LIMIT", "NaN"),
    ("CUDABUDGET_LIMIT_0", "1Ki1"),
    ("CUDABUDGET_LIMIT_1", "-5%"),
    ("CUDABUDGET_LIMIT_X", "8Gi"),
    // Ordinals the ledger cannot budget (it keeps 64 devices): refused, never ignored.
    ("CUDABUDGET_LIMIT_64", "8Gi"),
    ("CUDABUDGET_LIMIT_1023", "8Gi"),
    ("CUDA_DEVICE_MEMORY_LIMIT_64", "8g"),
    ("CUDABUDGET_LOG", "loud"),
    ("CUDABUDGET_SCOPE", "job:a/b"),
    ("CUDABUDGET_ON_EXCEED", "wait:forever"),
    // A variable this release does not know, with no budget beside it: a typo of the
    // limit must never run unbudgeted.
    ("CUDABUDGET_LIMT", "8Gi"),
    ("CUDABUDGET_FOO", "1"),
    ("CUDA_DEVICE_MEMORY_LIMIT", "8Gi"),
    ("CUDA_DEVICE_MEMORY_LIMIT", "-1"),
];

#[test]
fn every_malformed_value_refuses_cuinit_with_one_line_naming_variable_and_value() {
    assert!(MALFORMED.len() >= 25);
    for &(name, value) in MALFORMED {
        let run = budget_run("gpa", &["alloc:1Gi"], &[(name, value)]);
        assert_eq!(
            run.rc("init", 0),
            800,
            "{name}={value:?} must refuse cuInit\n{run:?}"
        );
        assert!(
            run.line_opt("alloc", 0).is_none(),
            "nothing ran after the refusal"
        );
        let lines: Vec<&str> = run.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{name}={value:?}: {lines:?}");
        let line = lines[0];
        assert!(line.starts_with("cudabudget: "), "{line}");
        assert!(line.contains(name), "{line} names {name}");
        assert!(
            line.contains(&format!("{value:?}")),
            "{line} quotes {value:?}"
        );
    }
}

#[test]
fn an_unknown_variable_beside_a_budget_is_one_warning_and_the_budget_holds() {
    let run = budget_run(
        "gpa",
        &["alloc:1Gi", "alloc:2Gi"],
        &[
            ("CUDABUDGET_LIMIT", "2Gi"),
            ("CUDABUDGET_NEW_KNOB", "on"),
            ("CUDABUDGET_LOG", "error"),
        ],
    );
    assert_eq!(run.rc("init", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 2, "the budget holds\n{run:?}");
    // At `error` the warning is not shown, and nothing else is either.
    assert_eq!(run.stderr, "", "{run:?}");

    let run = budget_run(
        "gpa",
        &["alloc:1Gi", "alloc:2Gi", "alloc:2Gi"],
        &[("CUDABUDGET_LIMIT", "2Gi"), ("CUDABUDGET_NEW_KNOB", "on")],
    );
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
    let warnings: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.contains("CUDABUDGET_NEW_KNOB"))
        .collect();
    assert_eq!(warnings.len(), 1, "one line, once:\n{}", run.stderr);
    let line = warnings[0];
    assert!(line.starts_with("cudabudget: pid "), "{line}");
    assert!(
        line.contains("CUDABUDGET_NEW_KNOB is not a known variable"),
        "{line}"
    );
    assert!(
        line.contains("known variables: CUDABUDGET_LIMIT, "),
        "{line}"
    );
}

#[test]
fn the_refusal_holds_on_every_resolution_path() {
    for mode in ["gpa", "gpa-legacy", "dlsym", "linked"] {
        let run = budget_run(mode, &["alloc:1Gi"], &[("CUDABUDGET_LIMIT", "10XB")]);
        assert_eq!(run.rc("init", 0), 800, "{mode}\n{run:?}");
    }
}

#[test]
fn the_message_gives_valid_examples() {
    let run = budget_run("gpa", &[], &[("CUDABUDGET_LIMIT", "10XB")]);
    assert!(run.stderr.contains("20Gi"), "{}", run.stderr);
    assert!(run.stderr.contains("40%"), "{}", run.stderr);
}

#[test]
fn a_process_that_never_calls_cuda_is_not_told_anything() {
    let out = crate::util::isolate(&mut std::process::Command::new("sh"))
        .args(["-c", "echo fine"])
        .env("LD_PRELOAD", lib_path())
        .env("CUDABUDGET_LIMIT", "10XB")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "fine\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
}

/// `CUDABUDGET_JOB_DIR=" /dir"` passes the check (surrounding
/// whitespace is ignored) and must then be the same directory everywhere: two processes
/// of one job, one started directly and one by `cudabudget run --scope`, share one
/// budget there.
#[test]
fn a_job_directory_written_with_a_leading_space_is_the_trimmed_directory() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    let dir = crate::util::cli::scratch("spaced-job-dir");
    let spaced = format!(" {}", dir.display());
    let job = format!("job:spaced-{}", std::process::id());
    let envs = [
        ("CUDABUDGET_JOB_DIR", spaced.as_str()),
        ("CUDABUDGET_SCOPE", job.as_str()),
        ("CUDABUDGET_LIMIT", "1Gi"),
        // NVML lists the process under another pid: only the hooks charge.
        ("FAKE_NVML_PID_OFFSET", "100000"),
    ];
    let mut holder = crate::util::client_command(
        "gpa",
        &["alloc:700Mi", "sleep:5000"],
        &envs,
        Some(&lib_path()),
    )
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("start the holder");
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    let first = loop {
        match lines.next() {
            Some(Ok(line)) if line.starts_with("alloc ") => break line,
            Some(Ok(_)) => {}
            _ => break String::new(),
        }
    };
    if !first.starts_with("alloc rc=0") {
        let _ = holder.kill();
        let out = holder.wait_with_output().unwrap();
        panic!(
            "the holder was refused: {first:?}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let client = crate::util::client_bin("gpa");
    let out = crate::util::cli::output(
        crate::util::cli::cudabudget(&[
            "run",
            "--scope",
            &job,
            "--limit",
            "1Gi",
            "--",
            client,
            "gpa",
            "alloc:500Mi",
            "alloc:300Mi",
        ])
        .env("CUDABUDGET_JOB_DIR", &spaced)
        .env("FAKE_NVML_PID_OFFSET", "100000"),
    );
    let _ = holder.kill();
    let _ = holder.wait();
    let stdout = crate::util::cli::stdout(&out);
    let stderr = crate::util::cli::stderr(&out);
    assert!(out.status.success(), "run refused it: {stderr}");
    let rcs: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("alloc "))
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    assert_eq!(
        rcs,
        ["rc=2", "rc=0"],
        "700 MiB of the job's 1 GiB are the holder's\n{stdout}\n{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
