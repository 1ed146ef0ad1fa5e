//! `cudabudget doctor`: each check passes where all is well and fails (or warns) with
//! what to do where it is not; the exit status is 1 exactly when a check failed.

use crate::util::cli::{
    closed_scratch, cudabudget, library_for_a_newer_glibc, output, scratch, stderr, stdout,
};
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

/// `doctor --json` with `envs` (after a budget of 1 GiB and an empty MPS pipe directory,
/// which they may override): (exit code, checks by name).
fn doctor(test: &str, envs: &[(&str, &str)]) -> (i32, Value) {
    doctor_with(test, envs, |_| {})
}

fn doctor_with(
    test: &str,
    envs: &[(&str, &str)],
    adjust: impl FnOnce(&mut Command),
) -> (i32, Value) {
    let mps = scratch(&format!("{test}-mps"));
    let mut command = cudabudget(&["doctor", "--json"]);
    command
        .env("CUDABUDGET_LIMIT", "1Gi")
        .env("CUDA_MPS_PIPE_DIRECTORY", &mps)
        .envs(envs.iter().copied());
    adjust(&mut command);
    let out = output(&mut command);
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", stdout(&out), stderr(&out)));
    let mut checks = serde_json::Map::new();
    for check in report["checks"].as_array().unwrap() {
        checks.insert(check["name"].as_str().unwrap().to_string(), check.clone());
    }
    let code = out.status.code().unwrap();
    assert_eq!(report["ok"], code == 0, "{report:#}");
    let _ = std::fs::remove_dir_all(&mps);
    (code, Value::Object(checks))
}

#[track_caller]
fn assert_status(checks: &Value, name: &str, status: &str) {
    assert_eq!(checks[name]["status"], status, "{name}: {:#}", checks[name]);
}

#[test]
fn where_all_is_well_every_check_passes_and_the_exit_status_is_0() {
    let (code, checks) = doctor("well", &[]);
    for name in [
        "driver",
        "devices",
        "nvml",
        "library",
        "glibc",
        "configuration",
        "pid-namespace",
        "runtime-dir",
        "budgets",
        "mps",
        "interposition",
    ] {
        assert_status(&checks, name, "ok");
    }
    assert_eq!(code, 0);
    assert!(
        checks["devices"]["summary"]
            .as_str()
            .unwrap()
            .contains("GPU-faceb00c-0000-0000-0000-000000000000")
    );
    assert_eq!(checks["driver"]["details"]["cuda_version"], 13000);
    assert_eq!(
        checks["configuration"]["details"]["devices"][0]["limit_bytes"],
        1u64 << 30
    );
    assert_eq!(checks["interposition"]["details"]["alloc_rc"], 2);
}

#[test]
fn doctor_help_names_every_check_doctor_runs_in_its_order() {
    let out = output(cudabudget(&["doctor", "--json"]).env("CUDABUDGET_LIMIT", "1Gi"));
    let report: Value = serde_json::from_slice(&out.stdout).expect("doctor --json");
    let help = stdout(&output(&mut cudabudget(&["doctor", "--help"])));
    let list = help
        .split_once("Checks, in order: ")
        .map(|(_, rest)| rest.split_once("\n\n").map_or(rest, |(list, _)| list))
        .unwrap_or_else(|| panic!("no list of checks: {help}"));
    let mut from = 0;
    for check in report["checks"].as_array().unwrap() {
        let name = check["name"].as_str().unwrap();
        let at = list[from..]
            .find(name)
            .unwrap_or_else(|| panic!("{name:?} is not in --help after {:?}", &list[..from]));
        from += at + name.len();
    }
}

#[test]
fn the_text_report_has_a_line_per_check_and_per_problem() {
    let out = output(cudabudget(&["doctor"]).env("CUDABUDGET_LIMIT", "10XB"));
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(
        text.lines().any(|l| l.starts_with("ok    driver")),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.starts_with("FAIL  configuration")),
        "{text}"
    );
    assert!(
        text.contains("1 problem(s):\n  configuration: CUDABUDGET_LIMIT=\"10XB\""),
        "{text}"
    );
}

#[test]
fn without_a_driver_the_driver_check_fails_and_says_what_to_do() {
    let empty = scratch("no-driver");
    let (code, checks) = doctor("no-driver", &[("LD_LIBRARY_PATH", empty.to_str().unwrap())]);
    if checks["driver"]["status"] == "ok" {
        crate::util::skip(
            "this machine has a CUDA driver of its own: the failing case cannot be shown",
        );
        return;
    }
    assert_status(&checks, "driver", "fail");
    assert!(
        checks["driver"]["remedy"]
            .as_str()
            .unwrap()
            .contains("container toolkit")
    );
    assert_status(&checks, "devices", "skip");
    assert_status(&checks, "interposition", "skip");
    assert_eq!(code, 1);
}

#[test]
fn no_visible_device_fails_the_devices_check() {
    let (code, checks) = doctor("no-device", &[("CUDA_VISIBLE_DEVICES", "5")]);
    assert_status(&checks, "driver", "ok");
    assert_status(&checks, "devices", "fail");
    assert!(
        checks["devices"]["summary"]
            .as_str()
            .unwrap()
            .contains("CUDA_VISIBLE_DEVICES=\"5\"")
    );
    assert_eq!(code, 1);
}

#[test]
fn without_nvml_the_nvml_check_warns_but_nothing_fails() {
    let (code, checks) = doctor("no-nvml", &[("FAKE_NVML_ABSENT", "1")]);
    assert_status(&checks, "nvml", "warn");
    assert_status(&checks, "interposition", "ok");
    assert_eq!(code, 0);
}

#[test]
fn a_missing_library_fails_the_library_check() {
    let (code, checks) = doctor(
        "no-library",
        &[("CUDABUDGET_LIB", "/nonexistent/libcudabudget.so")],
    );
    assert_status(&checks, "library", "fail");
    assert_status(&checks, "glibc", "skip");
    assert_status(&checks, "interposition", "skip");
    assert_eq!(code, 1);
}

#[test]
fn a_library_for_a_newer_glibc_fails_the_library_and_glibc_checks() {
    let dir = closed_scratch("newer-glibc");
    let library = library_for_a_newer_glibc(&dir);
    let (code, checks) = doctor(
        "newer-glibc",
        &[("CUDABUDGET_LIB", library.to_str().unwrap())],
    );
    assert_status(&checks, "library", "fail");
    assert!(
        checks["library"]["summary"]
            .as_str()
            .unwrap()
            .contains("GLIBC_9.")
    );
    assert_status(&checks, "glibc", "fail");
    let summary = checks["glibc"]["summary"].as_str().unwrap();
    assert!(
        summary.contains("but the library needs GLIBC_9.34"),
        "{summary}"
    );
    assert!(checks["glibc"]["remedy"].as_str().unwrap().contains("2.17"));
    assert_eq!(code, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_configuration_check_gives_each_device_its_budget_or_says_what_is_wrong() {
    let (_, checks) = doctor("percent", &[("CUDABUDGET_LIMIT", "50%")]);
    assert_status(&checks, "configuration", "ok");
    assert!(
        checks["configuration"]["summary"]
            .as_str()
            .unwrap()
            .contains("device 0: 40.00 GiB")
    );

    let (code, checks) = doctor("bad-config", &[("CUDABUDGET_LIMIT", "10XB")]);
    assert_status(&checks, "configuration", "fail");
    assert_eq!(code, 1);

    let (code, checks) = doctor_with("no-budget", &[], |c| {
        c.env_remove("CUDABUDGET_LIMIT");
    });
    assert_status(&checks, "configuration", "warn");
    // Without a budget the proof still runs, under its own.
    assert_status(&checks, "interposition", "ok");
    assert_eq!(code, 0);
}

#[test]
fn doctor_agrees_with_the_library_on_unknown_variables() {
    // Beside a budget: a warning naming it, and the budget stands.
    let (code, checks) = doctor("unknown-beside", &[("CUDABUDGET_NEW_KNOB", "1")]);
    assert_status(&checks, "configuration", "warn");
    let summary = checks["configuration"]["summary"].as_str().unwrap();
    assert!(summary.contains("device 0: 1.00 GiB"), "{summary}");
    assert!(
        summary.contains("CUDABUDGET_NEW_KNOB is not a known variable"),
        "{summary}"
    );
    assert!(
        summary.contains("known variables: CUDABUDGET_LIMIT"),
        "{summary}"
    );
    assert_eq!(
        checks["configuration"]["details"]["unknown_variables"][0],
        "CUDABUDGET_NEW_KNOB"
    );
    assert_eq!(code, 0);

    // A typo of the limit alone: a process here would get no CUDA.
    let (code, checks) = doctor_with("unknown-alone", &[("CUDABUDGET_LIMT", "8Gi")], |c| {
        c.env_remove("CUDABUDGET_LIMIT");
    });
    assert_status(&checks, "configuration", "fail");
    let summary = checks["configuration"]["summary"].as_str().unwrap();
    assert!(
        summary.starts_with("CUDABUDGET_LIMT=\"8Gi\" is not a known variable"),
        "{summary}"
    );
    assert_eq!(code, 1);
}

#[test]
fn a_preloaded_library_is_noticed_and_does_not_budget_the_doctor_itself() {
    let library = crate::util::cli::fresh_library();
    let (code, checks) = doctor("preloaded", &[("LD_PRELOAD", library.to_str().unwrap())]);
    assert_eq!(checks["configuration"]["details"]["preloaded"], true);
    // The devices are seen as they are, not as the budget.
    assert!(
        checks["devices"]["summary"]
            .as_str()
            .unwrap()
            .contains("80.00 GiB")
    );
    assert_eq!(code, 0);
}

#[test]
fn the_pid_namespace_check_tells_a_container_from_the_host() {
    let (_, checks) = doctor("host-namespace", &[]);
    assert_status(&checks, "pid-namespace", "ok");
    let nested_here = checks["pid-namespace"]["details"]["nested"] == true;
    let out = output(
        crate::util::isolate(&mut Command::new("unshare"))
            .args([
                "--pid",
                "--fork",
                "--mount-proc",
                crate::util::cli::BIN,
                "doctor",
                "--json",
            ])
            .env("LD_LIBRARY_PATH", crate::util::fake_dir())
            .env("CUDABUDGET_LIB", crate::util::cli::fresh_library()),
    );
    let Ok(report) = serde_json::from_slice::<Value>(&out.stdout) else {
        eprintln!(
            "cannot make a PID namespace here ({}): only this one is checked",
            stderr(&out)
        );
        return;
    };
    let check = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "pid-namespace")
        .unwrap()
        .clone();
    assert_eq!(check["details"]["nested"], true, "{check}");
    assert!(
        check["summary"]
            .as_str()
            .unwrap()
            .contains("in a PID namespace")
    );
    if !nested_here {
        assert_eq!(
            checks["pid-namespace"]["summary"],
            "the host's PID namespace"
        );
    }
}

/// `doctor --json` with `runtime` as `CUDABUDGET_RUNTIME_DIR`, `home` as `HOME` and no
/// `XDG_RUNTIME_DIR`: the runtime-dir check.
fn runtime_dir_check(test: &str, runtime: &Path, home: &Path) -> (i32, Value) {
    let (code, checks) = doctor_with(
        test,
        &[
            ("CUDABUDGET_RUNTIME_DIR", runtime.to_str().unwrap()),
            ("HOME", home.to_str().unwrap()),
        ],
        |c| {
            c.env_remove("XDG_RUNTIME_DIR");
        },
    );
    (code, checks["runtime-dir"].clone())
}

fn user_dir_name() -> String {
    // SAFETY: geteuid cannot fail.
    format!("cudabudget-{}", unsafe { libc::geteuid() })
}

#[test]
fn the_runtime_dir_check_names_the_directory_records_go_to() {
    let runtime = scratch("runtime-here");
    let home = scratch("runtime-here-home");
    let (code, check) = runtime_dir_check("runtime-here", &runtime, &home);
    assert_eq!(check["status"], "ok", "{check:#}");
    let dir = runtime.canonicalize().unwrap().join(user_dir_name());
    assert_eq!(check["details"]["dir"], dir.to_str().unwrap(), "{check:#}");
    assert_eq!(
        check["details"]["in_the_way"],
        serde_json::json!([]),
        "{check:#}"
    );
    let summary = check["summary"].as_str().unwrap();
    assert!(
        summary.contains(&format!("records go to {}", dir.display())),
        "{summary}"
    );
    // Made as the library makes it: ours alone.
    let mode = std::fs::symlink_metadata(&dir)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o700);
    assert_eq!(code, 0);
    let _ = std::fs::remove_dir_all(&runtime);
    let _ = std::fs::remove_dir_all(&home);
}

#[test]
fn a_name_in_the_way_in_the_runtime_directory_warns_and_no_place_at_all_fails() {
    // Another user's directory at our name: records go to our next name in the same
    // directory (where root's readers look too), and the check says what is in the way.
    let runtime = scratch("runtime-foreign");
    let home = scratch("runtime-foreign-home");
    // SAFETY: geteuid cannot fail.
    let uid = unsafe { libc::geteuid() };
    let planted = runtime.join(user_dir_name());
    std::fs::create_dir(&planted).unwrap();
    if uid == 0 {
        std::os::unix::fs::chown(&planted, Some(12345), Some(12345)).unwrap();
    } else {
        // Not root: a directory others may write stands in for one of another user.
        std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let (code, check) = runtime_dir_check("runtime-foreign", &runtime, &home);
    assert_eq!(check["status"], "warn", "{check:#}");
    let fallback = runtime
        .canonicalize()
        .unwrap()
        .join(format!("{}.1", user_dir_name()));
    assert_eq!(
        check["details"]["dir"],
        fallback.to_str().unwrap(),
        "{check:#}"
    );
    let summary = check["summary"].as_str().unwrap();
    let planted = planted.canonicalize().unwrap();
    assert!(
        summary.contains(&format!("records go to {} instead", fallback.display()))
            && summary.contains(&planted.display().to_string()),
        "{summary}"
    );
    if uid == 0 {
        assert!(
            summary.contains("is taken by a directory of uid 12345"),
            "{summary}"
        );
    }
    assert!(fallback.is_dir());
    assert_eq!(code, 0, "a warning is not a failure");

    // No place at all: the shared directory cannot hold ours, and neither can $HOME.
    let (code, check) = runtime_dir_check("runtime-proc", Path::new("/proc"), Path::new("/proc"));
    assert_eq!(check["status"], "fail", "{check:#}");
    let summary = check["summary"].as_str().unwrap();
    assert!(
        summary.contains("no place for records") && summary.contains("will not see"),
        "{summary}"
    );
    assert!(summary.contains("/proc/cudabudget-"), "{summary}");
    assert_eq!(code, 1);
    let _ = std::fs::remove_dir_all(&runtime);
    let _ = std::fs::remove_dir_all(&home);
}

#[test]
fn an_mps_server_is_reported() {
    let pipes = scratch("mps-pipes");
    std::fs::write(pipes.join("control"), b"").unwrap();
    let (code, checks) = doctor(
        "mps",
        &[("CUDA_MPS_PIPE_DIRECTORY", pipes.to_str().unwrap())],
    );
    assert_status(&checks, "mps", "warn");
    assert!(
        checks["mps"]["summary"]
            .as_str()
            .unwrap()
            .contains("MPS server is present")
    );
    assert_eq!(code, 0);
    let _ = std::fs::remove_dir_all(&pipes);
}

#[test]
fn a_library_that_loads_but_does_not_interpose_fails_the_proof() {
    let (code, checks) = doctor(
        "no-interposition",
        &[(
            "CUDABUDGET_LIB",
            crate::util::cli::closed_copy(std::path::Path::new(crate::util::thirdparty_lib()))
                .to_str()
                .unwrap(),
        )],
    );
    assert_status(&checks, "library", "ok");
    assert_status(&checks, "interposition", "fail");
    let summary = checks["interposition"]["summary"].as_str().unwrap();
    assert!(summary.contains("did not interpose"), "{summary}");
    assert_eq!(code, 1);
}
