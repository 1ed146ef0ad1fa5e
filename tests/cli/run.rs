//! `cudabudget run`: what the child sees when options are good, and that nothing runs
//! when they are not.

use crate::util::cli as util_cli;
use crate::util::cli::RUN_PRINTING_PRELOAD;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_cudabudget");

/// The CLI at `bin` with an environment free of anything that would change its answer
/// (the developer's own budget variables or preloads).
fn cli(bin: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(bin);
    for (name, _) in std::env::vars_os() {
        let name_text = name.to_string_lossy();
        if name_text.starts_with("CUDABUDGET_")
            || name_text.starts_with("CUDA_DEVICE_MEMORY_LIMIT")
            || name_text == "LD_PRELOAD"
        {
            command.env_remove(&name);
        }
    }
    crate::util::isolate(&mut command).args(args);
    command
}

/// The CLI cargo built, told where this run's library is: `cargo test` builds it into
/// deps/ only (the lookup next to the binary has tests of its own).
fn cudabudget(args: &[&str]) -> Command {
    let mut command = cli(Path::new(BIN), args);
    command.env("CUDABUDGET_LIB", fresh_library());
    command
}

fn output(mut command: impl std::borrow::BorrowMut<Command>) -> Output {
    // A binary a test just copied may still be open for writing in a child that another
    // test thread forked meanwhile (it holds the descriptor until its exec): the exec
    // then fails with ETXTBSY for a moment. Try again for up to a few seconds.
    let mut tries = 0;
    loop {
        match command.borrow_mut().output() {
            Ok(output) => return output,
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 200 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("cannot run {BIN}: {e}"),
        }
    }
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The library cargo built for this test run (a copy where the build lies under a
/// directory others may write: `run` refuses a library there).
fn fresh_library() -> PathBuf {
    util_cli::fresh_library()
}

/// Asserts `path` is absolute and is the library built for this run (possibly the
/// hard-linked copy next to the CLI).
fn assert_is_fresh_library(path: &str) {
    use std::os::unix::fs::MetadataExt;
    assert!(path.starts_with('/'), "{path:?} is not absolute");
    assert!(path.ends_with("/libcudabudget.so"), "{path:?}");
    let meta = |p: &Path| std::fs::metadata(p).unwrap_or_else(|e| panic!("{p:?}: {e}"));
    let (ours, fresh) = (meta(Path::new(path)), meta(&fresh_library()));
    assert_eq!(
        (ours.dev(), ours.ino()),
        (fresh.dev(), fresh.ino()),
        "{path:?} is not the library cargo just built"
    );
}

/// A path no other test uses, not yet created.
fn marker(test: &str) -> PathBuf {
    let path = crate::util::test_dir().join(format!("marker-{test}"));
    let _ = std::fs::remove_file(&path);
    path
}

/// `run`'s own failures, usage errors included (as `docker run`): the command's own
/// status is never one of them unless it chose it.
const RUN_FAILED: i32 = 125;

/// Runs `cudabudget run <options> -- touch <marker>` and asserts it was refused with
/// exit 125, a one-line explanation, and without running the command.
fn assert_refused_before_running(test: &str, options: &[&str], envs: &[(&str, &str)]) -> String {
    let marker = marker(test);
    let marker_arg = marker.to_str().expect("temp dir is UTF-8");
    let mut args = vec!["run"];
    args.extend_from_slice(options);
    args.extend_from_slice(&["--", "touch", marker_arg]);
    let out = output(cudabudget(&args).envs(envs.iter().copied()));
    let message = stderr(&out);
    assert_eq!(out.status.code(), Some(RUN_FAILED), "stderr: {message}");
    assert!(!marker.exists(), "the command ran despite: {message}");
    assert!(message.starts_with("cudabudget: "), "{message}");
    assert_eq!(message.trim_end().lines().count(), 1, "{message}");
    message
}

#[test]
fn run_preloads_the_library_beside_the_binary_and_passes_the_limit() {
    // An install: the binary and the library side by side, no CUDABUDGET_LIB.
    let dir = crate::util::closed_test_dir().join("install");
    std::fs::create_dir_all(&dir).unwrap();
    let (bin, lib) = (dir.join("cudabudget"), dir.join("libcudabudget.so"));
    std::fs::copy(BIN, &bin).unwrap();
    std::fs::copy(fresh_library(), &lib).unwrap();
    let out = output(cli(
        &bin,
        &[
            "run",
            "--limit",
            "8Gi",
            "--",
            "sh",
            "-c",
            "echo $LD_PRELOAD; echo $CUDABUDGET_LIMIT",
        ],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    let printed = stdout(&out);
    let lines: Vec<&str> = printed.lines().collect();
    let [preload, limit] = lines[..] else {
        panic!("unexpected output {printed:?}");
    };
    assert_eq!(Path::new(preload), std::fs::canonicalize(&lib).unwrap());
    assert_eq!(limit, "8Gi");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[cfg_attr(
    cudabudget_embed,
    ignore = "this build carries the library: tests/install/install_command.rs covers the bare binary"
)]
fn without_a_library_beside_the_binary_or_cudabudget_lib_nothing_runs() {
    let dir = crate::util::test_dir().join("bare");
    std::fs::create_dir_all(&dir).unwrap();
    let bin = dir.join("cudabudget");
    std::fs::copy(BIN, &bin).unwrap();
    let marker = marker("bare");
    let out = output(cli(&bin, &["run", "--limit", "8Gi", "--", "touch"]).arg(&marker));
    assert_eq!(out.status.code(), Some(RUN_FAILED), "{}", stderr(&out));
    assert!(!marker.exists());
    assert!(stderr(&out).contains("CUDABUDGET_LIB"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn limit_device_sets_the_per_device_variable() {
    let out = output(cudabudget(&[
        "run",
        "--limit-device",
        "1=4Gi",
        "--limit-device",
        "0=40%",
        "--",
        "sh",
        "-c",
        "echo $CUDABUDGET_LIMIT_1 $CUDABUDGET_LIMIT_0 ${CUDABUDGET_LIMIT-unset}",
    ]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "4Gi 40% unset\n");
}

#[test]
fn scope_and_policy_are_passed_when_given() {
    let out = output(cudabudget(&[
        "run",
        "--limit",
        "1Gi",
        "--scope",
        "process",
        "--on-exceed",
        "fail",
        "--",
        "sh",
        "-c",
        "echo $CUDABUDGET_SCOPE $CUDABUDGET_ON_EXCEED",
    ]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "process fail\n");
}

#[test]
fn the_command_may_follow_without_a_double_dash() {
    let out = output(cudabudget(&[
        "run", "--limit", "1Gi", "sh", "-c", "echo ran",
    ]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "ran\n");
}

#[test]
fn an_existing_preload_is_kept_after_ours() {
    let out = output(cudabudget(RUN_PRINTING_PRELOAD).env("LD_PRELOAD", "/lib/other.so"));
    // ld.so only warns about a missing preload, so the child still runs.
    assert!(out.status.success(), "{}", stderr(&out));
    let printed = stdout(&out);
    let Some((ours, theirs)) = printed.trim_end().split_once(':') else {
        panic!("unexpected LD_PRELOAD {printed:?}");
    };
    assert_is_fresh_library(ours);
    assert_eq!(theirs, "/lib/other.so");
}

#[test]
fn the_library_is_not_preloaded_twice() {
    let ours = fresh_library();
    let out = output(cudabudget(RUN_PRINTING_PRELOAD).env("LD_PRELOAD", &ours));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{}\n", ours.display()));
}

#[test]
fn a_budget_from_the_environment_is_enough() {
    let out = output(
        cudabudget(&["run", "--", "sh", "-c", "echo $CUDABUDGET_LIMIT"])
            .env("CUDABUDGET_LIMIT", "40%"),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "40%\n");
}

#[test]
fn a_bad_quantity_is_refused_before_anything_runs() {
    let message = assert_refused_before_running("bad-quantity", &["--limit", "10XB"], &[]);
    assert_eq!(
        message.trim_end(),
        "cudabudget: --limit \"10XB\": unknown unit \"XB\" (examples: 20Gi, 512Mi, 8GB, 40%)"
    );
}

#[test]
fn a_negative_or_missing_budget_is_refused_naming_what_was_given() {
    // A value that starts with '-' is the option's: refused as what it is, never taken
    // for an option nor answered with clap's tip of passing it after `--`.
    for (test, options, said) in [
        (
            "negative",
            &["--limit", "-1G"][..],
            "cudabudget: --limit \"-1G\": negative values are not allowed",
        ),
        (
            "negative-device",
            &["--limit-device", "1=-1G"],
            "cudabudget: --limit-device \"1=-1G\": negative values are not allowed",
        ),
        (
            "negative-ordinal",
            &["--limit-device", "-1=1G"],
            "cudabudget: --limit-device \"-1=1G\": \"-1\" is not a device ordinal",
        ),
        (
            "missing",
            &["--limit", "--scope", "job:a"],
            "cudabudget: --limit needs a value before \"--scope\"",
        ),
        (
            "missing-device",
            &["--limit-device", "--limit", "1Gi"],
            "cudabudget: --limit-device needs a value before \"--limit\"",
        ),
    ] {
        let message = assert_refused_before_running(test, options, &[]);
        assert!(message.starts_with(said), "{test}: {message}");
    }
}

#[test]
fn a_bad_device_option_is_refused_before_anything_runs() {
    for (test, option) in [
        ("device-quantity", "1=8Gb"),
        ("device-no-equals", "1"),
        ("device-ordinal", "x=1Gi"),
        // The ledger budgets devices 0..=63: a budget for 64 could never be enforced.
        ("device-64", "64=1Gi"),
        ("device-1023", "1023=1Gi"),
    ] {
        let message = assert_refused_before_running(test, &["--limit-device", option], &[]);
        assert!(message.contains("--limit-device"), "{message}");
    }
}

#[test]
fn malformed_scope_and_policy_are_refused_before_anything_runs() {
    let message =
        assert_refused_before_running("scope", &["--limit", "1Gi", "--scope", "job:a/b"], &[]);
    // The message names the option as the user typed it, not the variable it becomes.
    assert!(
        message.starts_with("cudabudget: --scope \"job:a/b\": job name"),
        "{message}"
    );
    let message = assert_refused_before_running(
        "policy",
        &["--limit", "1Gi", "--on-exceed", "wait:forever"],
        &[],
    );
    assert!(
        message.starts_with("cudabudget: --on-exceed \"wait:forever\": duration"),
        "{message}"
    );
}

#[test]
fn a_bad_inherited_variable_is_refused_before_anything_runs() {
    let message = assert_refused_before_running(
        "inherited",
        &["--limit", "1Gi"],
        &[("CUDABUDGET_LOG", "loud")],
    );
    assert!(message.contains("CUDABUDGET_LOG=\"loud\""), "{message}");
}

#[test]
fn an_unknown_inherited_variable_runs_beside_a_budget_and_is_refused_alone() {
    // As the library: a newer release's variable beside a budget does not stop the job.
    let out = output(
        cudabudget(&[
            "run",
            "--limit",
            "1Gi",
            "--",
            "sh",
            "-c",
            "echo $CUDABUDGET_LIMIT $CUDABUDGET_NEW_KNOB",
        ])
        .env("CUDABUDGET_NEW_KNOB", "1"),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "1Gi 1\n");
    // ...but `run` names it, in one line, before the command starts.
    let said = stderr(&out);
    assert_eq!(said.lines().count(), 1, "{said}");
    assert!(
        said.starts_with("cudabudget: CUDABUDGET_NEW_KNOB is not a known variable")
            && said.contains("is ignored"),
        "{said}"
    );
    // A typo of the limit, alone, is never run unbudgeted.
    let message = assert_refused_before_running("typo", &[], &[("CUDABUDGET_LIMT", "8Gi")]);
    assert!(
        message.starts_with("cudabudget: CUDABUDGET_LIMT=\"8Gi\" is not a known variable"),
        "{message}"
    );
    assert!(
        message.contains("known variables: CUDABUDGET_LIMIT"),
        "{message}"
    );
}

#[test]
fn a_budget_of_zero_is_refused_with_the_reason() {
    for (test, options, envs, named) in [
        (
            "zero-limit",
            &["--limit", "0"][..],
            &[][..],
            "--limit \"0\"",
        ),
        ("zero-gi", &["--limit", "0Gi"], &[], "--limit \"0Gi\""),
        (
            "zero-device",
            &["--limit-device", "1=0"],
            &[],
            "--limit-device \"1=0\"",
        ),
        (
            "zero-env",
            &[],
            &[("CUDABUDGET_LIMIT", "0")],
            "CUDABUDGET_LIMIT=0",
        ),
        (
            "zero-env-device",
            &["--limit", "1Gi"],
            &[("CUDABUDGET_LIMIT_2", "0")],
            "CUDABUDGET_LIMIT_2=0",
        ),
    ] {
        let message = assert_refused_before_running(test, options, envs);
        assert!(
            message.contains(named) && message.contains("0 bytes would refuse every allocation"),
            "{test}: {message}"
        );
    }
}

#[test]
fn a_budget_smaller_than_a_context_runs_with_a_warning_saying_so() {
    // Named as the user gave it: the option, or the inherited variable.
    for (options, envs, named) in [
        (&["--limit", "100Mi"][..], &[][..], "--limit \"100Mi\""),
        (
            &["--limit", "8Gi", "--limit-device", "1=64Mi"],
            &[],
            "--limit-device \"1=64Mi\"",
        ),
        (&[], &[("CUDABUDGET_LIMIT", "100Mi")], "CUDABUDGET_LIMIT"),
        (
            &["--limit", "8Gi"],
            &[("CUDABUDGET_LIMIT_1", "64Mi")],
            "CUDABUDGET_LIMIT_1",
        ),
    ] {
        let mut args = vec!["run"];
        args.extend_from_slice(options);
        args.extend_from_slice(&["--", "true"]);
        let out = output(cudabudget(&args).envs(envs.iter().copied()));
        let said = stderr(&out);
        assert!(out.status.success(), "{said}");
        assert!(
            said.contains(&format!("{named} is less than a CUDA context takes")),
            "{said}"
        );
    }
    // A budget a context fits in runs without a word.
    let out = output(cudabudget(&["run", "--limit", "1Gi", "--", "true"]));
    assert!(
        out.status.success() && stderr(&out).is_empty(),
        "{}",
        stderr(&out)
    );
}

#[test]
fn warn_is_passed_as_the_policy() {
    let out = output(cudabudget(&[
        "run",
        "--limit",
        "1Gi",
        "--on-exceed",
        "warn",
        "--",
        "sh",
        "-c",
        "echo $CUDABUDGET_ON_EXCEED",
    ]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "warn\n");
}

#[test]
fn no_budget_at_all_is_refused() {
    let message = assert_refused_before_running("no-budget", &[], &[]);
    assert!(message.contains("--limit"), "{message}");
}

#[test]
fn a_missing_cudabudget_lib_is_refused() {
    let message = assert_refused_before_running(
        "missing-lib",
        &["--limit", "1Gi"],
        &[("CUDABUDGET_LIB", "/nonexistent/libcudabudget.so")],
    );
    assert!(message.contains("CUDABUDGET_LIB"), "{message}");
}

#[test]
fn cudabudget_lib_names_the_library_to_preload() {
    let ours = fresh_library();
    let out = output(cudabudget(RUN_PRINTING_PRELOAD).env("CUDABUDGET_LIB", &ours));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{}\n", ours.display()));
}

#[test]
fn a_command_that_does_not_exist_exits_127() {
    let out = output(cudabudget(&[
        "run",
        "--limit",
        "1Gi",
        "--",
        "/nonexistent/command",
    ]));
    assert_eq!(out.status.code(), Some(127));
    assert!(
        stderr(&out).starts_with("cudabudget: cannot run \"/nonexistent/command\": "),
        "{}",
        stderr(&out)
    );
}

#[test]
fn version_and_help_are_available() {
    let out = output(cudabudget(&["--version"]));
    assert!(out.status.success());
    assert!(stdout(&out).starts_with("cudabudget "));
    let out = output(cudabudget(&["run", "--help"]));
    assert!(out.status.success());
    assert!(stdout(&out).contains("cudabudget run --limit 20Gi -- python train.py"));
}

#[test]
fn the_commands_own_exit_status_is_run_s_exit_status() {
    for status in [0, 1, 2, 3, 124, 125, 126, 127, 200] {
        let out = output(cudabudget(&[
            "run",
            "--limit",
            "1Gi",
            "--",
            "sh",
            "-c",
            &format!("exit {status}"),
        ]));
        assert_eq!(out.status.code(), Some(status), "{}", stderr(&out));
        assert_eq!(stderr(&out), "", "run says nothing when the command ran");
    }
}

#[test]
fn run_s_own_usage_errors_exit_125_and_other_commands_keep_2() {
    let marker = marker("usage-125");
    let marker = marker.to_str().unwrap();
    for args in [
        &["run", "--limit", "1Gi"][..], // no command
        &["run", "--limit"][..],        // an option without its value
        &["run", "--limit", "1Gi", "--scope"][..],
        &["run", "--bogus", "--", "touch", marker][..],
        &[
            "run", "--limit", "1Gi", "--limit", "2Gi", "--", "touch", marker,
        ][..],
    ] {
        let out = output(cudabudget(args));
        let message = stderr(&out);
        assert_eq!(out.status.code(), Some(RUN_FAILED), "{args:?}: {message}");
        assert!(message.starts_with("cudabudget: "), "{args:?}: {message}");
        assert!(!Path::new(marker).exists(), "{args:?} ran the command");
    }
    for args in [&["status", "--bogus"][..], &["bogus"][..], &[][..]] {
        let out = output(cudabudget(args));
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    }
    // Help is not a failure.
    assert_eq!(
        output(cudabudget(&["run", "--help"])).status.code(),
        Some(0)
    );
}

#[test]
fn run_help_shows_every_form_the_library_accepts_and_the_exit_statuses() {
    let out = output(cudabudget(&["run", "--help"]));
    assert!(out.status.success(), "{}", stderr(&out));
    let help = stdout(&out);
    for form in [
        "\"process\"",
        "\"job:<name>\"",
        "\"fail\"",
        "\"wait:<duration>\"",
        "\"warn\"",
        "--scope job:train",
        "--on-exceed wait:30s",
        "--on-exceed warn",
        "125",
        "126",
        "127",
    ] {
        assert!(help.contains(form), "run --help lacks {form}:\n{help}");
    }
    // The forms shown are those the library takes: "warn" when (and only when) a
    // budget with --on-exceed warn is accepted.
    let warn = output(cudabudget(&[
        "run",
        "--limit",
        "1Gi",
        "--on-exceed",
        "warn",
        "--",
        "true",
    ]));
    assert_eq!(
        help.contains("\"warn\""),
        warn.status.success(),
        "--on-exceed warn: {}\n{help}",
        stderr(&warn)
    );
    for form in ["\"job:<name>\"", "\"wait:<duration>\""] {
        let value = form
            .trim_matches('"')
            .replace("<name>", "train")
            .replace("<duration>", "30s");
        let option = if value.starts_with("job") {
            "--scope"
        } else {
            "--on-exceed"
        };
        let out = output(cudabudget(&[
            "run", "--limit", "1Gi", option, &value, "--", "true",
        ]));
        assert!(out.status.success(), "{option} {value}: {}", stderr(&out));
    }
}

#[test]
fn a_mistyped_option_is_a_usage_error_that_names_the_right_one() {
    for (test, options, meant) in [
        (
            "typo-device",
            &["--limit-devcie", "0=1Gi"][..],
            "--limit-device",
        ),
        ("typo-limit", &["--limt", "1Gi"][..], "--limit"),
    ] {
        let marker = marker(test);
        let mut args = vec!["run"];
        args.extend_from_slice(options);
        args.extend_from_slice(&["--", "touch", marker.to_str().unwrap()]);
        let out = output(cudabudget(&args));
        let message = stderr(&out);
        assert_eq!(out.status.code(), Some(RUN_FAILED), "{message}");
        assert!(!marker.exists(), "the command ran despite: {message}");
        assert!(
            message.starts_with(&format!("cudabudget: unexpected argument '{}'", options[0])),
            "{message}"
        );
        assert!(
            message.contains(&format!("a similar argument exists: '{meant}'")),
            "{message}"
        );
    }
}

#[test]
fn after_a_double_dash_everything_is_the_command() {
    let out = output(cudabudget(&[
        "run",
        "--limit",
        "1Gi",
        "--",
        "sh",
        "-c",
        "echo $0 $1",
        "--limt",
        "x",
    ]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "--limt x\n");
}

#[test]
fn a_command_that_exists_but_cannot_be_executed_exits_126() {
    let path = marker("not-executable");
    std::fs::write(&path, "#!/bin/sh\necho ran\n").unwrap();
    let out = output(cudabudget(&[
        "run",
        "--limit",
        "1Gi",
        "--",
        path.to_str().unwrap(),
    ]));
    assert_eq!(out.status.code(), Some(126), "{}", stderr(&out));
    assert!(
        stderr(&out).starts_with("cudabudget: cannot run "),
        "{}",
        stderr(&out)
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_library_the_loader_refuses_is_never_preloaded_into_the_command() {
    let dir = crate::util::closed_test_dir().join("glibc");
    std::fs::create_dir_all(&dir).unwrap();
    // Needs GLIBC_9.x: as a library built on a newer system than this one.
    let library = util_cli::library_for_a_newer_glibc(&dir);
    let message = assert_refused_before_running(
        "newer-glibc",
        &["--limit", "1Gi"],
        &[("CUDABUDGET_LIB", library.to_str().unwrap())],
    );
    assert!(message.contains("cannot be loaded here"), "{message}");
    assert!(
        message.contains("GLIBC_9."),
        "the loader's reason: {message}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `cudabudget run --limit 1Gi -- touch <marker>` with the binary `bin` and `envs`,
/// and asserts it was refused with exit 125 and one line, without running the command.
fn assert_refused_as_changeable(test: &str, bin: &Path, envs: &[(&str, &Path)]) -> String {
    let marker = marker(test);
    let mut command = cli(bin, &["run", "--limit", "1Gi", "--", "touch"]);
    command.arg(&marker);
    for (name, value) in envs {
        command.env(name, value);
    }
    let out = output(command);
    let message = stderr(&out);
    assert_eq!(out.status.code(), Some(125), "stderr: {message}");
    assert!(!marker.exists(), "the command ran despite: {message}");
    assert_eq!(message.trim_end().lines().count(), 1, "{message}");
    message
}

#[test]
fn a_library_others_could_change_is_never_preloaded() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |path: &Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    let dir = crate::util::closed_test_dir().join("open");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    mode(&dir, 0o755);

    // CUDABUDGET_LIB in a directory anyone may write (another user could rename their
    // own library over it between the check and the exec).
    let open = dir.join("open");
    std::fs::create_dir(&open).unwrap();
    mode(&open, 0o777);
    let library = open.join("libcudabudget.so");
    std::fs::copy(fresh_library(), &library).unwrap();
    mode(&library, 0o755);
    let message =
        assert_refused_as_changeable("open-dir", Path::new(BIN), &[("CUDABUDGET_LIB", &library)]);
    assert!(message.contains("CUDABUDGET_LIB"), "{message}");
    assert!(message.contains(open.to_str().unwrap()), "{message}");

    // A library file anyone may write.
    let closed = dir.join("closed");
    std::fs::create_dir(&closed).unwrap();
    mode(&closed, 0o755);
    let library = closed.join("libcudabudget.so");
    std::fs::copy(fresh_library(), &library).unwrap();
    mode(&library, 0o666);
    let message =
        assert_refused_as_changeable("open-file", Path::new(BIN), &[("CUDABUDGET_LIB", &library)]);
    assert!(message.contains("others may write"), "{message}");

    // The library beside the binary, in a directory its group may write.
    let group = dir.join("group");
    std::fs::create_dir(&group).unwrap();
    mode(&group, 0o775);
    let bin = group.join("cudabudget");
    std::fs::copy(BIN, &bin).unwrap();
    std::fs::copy(fresh_library(), group.join("libcudabudget.so")).unwrap();
    mode(&group.join("libcudabudget.so"), 0o755);
    let message = assert_refused_as_changeable("beside", &bin, &[]);
    assert!(message.contains(group.to_str().unwrap()), "{message}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A copy of this run's library in `dir` (made, with `mode`, under a parent of ours).
fn library_in(dir: &Path, mode: u32) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir.join("lib")).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).unwrap();
    let library = dir.join("lib/libcudabudget.so");
    std::fs::copy(fresh_library(), &library).unwrap();
    std::fs::set_permissions(&library, std::fs::Permissions::from_mode(0o755)).unwrap();
    library
}

#[test]
fn a_library_under_a_directory_others_may_write_is_never_preloaded_sticky_or_not() {
    // Under the system's temporary directory: once a cleaner removes the copy, any user
    // could recreate the path, and every process that inherited LD_PRELOAD loads theirs.
    let under_tmp = library_in(&crate::util::test_dir().join("under-tmp"), 0o755);
    match crate::util::first_open_ancestor(&under_tmp) {
        Some(open) => {
            let message = assert_refused_as_changeable(
                "under-tmp",
                Path::new(BIN),
                &[("CUDABUDGET_LIB", &under_tmp)],
            );
            assert!(message.contains("CUDABUDGET_LIB"), "{message}");
            assert!(
                message.contains(&format!("{} cannot be trusted", open.display())),
                "the line names {}: {message}",
                open.display()
            );
        }
        None => crate::util::skip("the temporary directory is closed to other users here"),
    }

    // Under a sticky world-writable directory of ours, all the way closed above it.
    let sticky = crate::util::closed_test_dir().join("sticky");
    let _ = std::fs::remove_dir_all(&sticky);
    let library = library_in(&sticky, 0o1777);
    let message =
        assert_refused_as_changeable("sticky", Path::new(BIN), &[("CUDABUDGET_LIB", &library)]);
    assert!(
        message.contains(&format!("{} cannot be trusted", sticky.display())),
        "{message}"
    );
    assert!(message.contains("sticky or not"), "{message}");

    // Under another user's directory that its group may write.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        crate::util::skip("the case of another user's directory needs root to chown");
        return;
    }
    let theirs = crate::util::closed_test_dir().join("theirs");
    let _ = std::fs::remove_dir_all(&theirs);
    let library = library_in(&theirs, 0o775);
    std::os::unix::fs::chown(&theirs, Some(54321), Some(54321)).unwrap();
    let message =
        assert_refused_as_changeable("theirs", Path::new(BIN), &[("CUDABUDGET_LIB", &library)]);
    assert!(
        message.contains(&format!("{} cannot be trusted", theirs.display()))
            && message.contains("uid 54321"),
        "{message}"
    );
}
