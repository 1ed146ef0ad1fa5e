//! `cudabudget limit` among tenants: only a budget's owner or root may change it.

use super::records::{budgeted, kit};
use crate::util::cli::{cli_at, output, stderr, stdout};
use crate::util::tenants::{Tenants, as_user};
use std::process::Stdio;
use std::time::{Duration, Instant};

#[test]
fn another_user_cannot_change_a_process_or_job_budget_and_root_can() {
    let Some(t) = Tenants::get() else { return };
    let kit = kit(t);
    let alone = budgeted(t, &kit, &t.alice, &[], Stdio::null());
    let member = budgeted(
        t,
        &kit,
        &t.alice,
        &[("CUDABUDGET_SCOPE", "job:limit-train")],
        Stdio::null(),
    );
    let pid = alone.0.id().to_string();
    // Mallory's command line uses the same shared places as alice's processes.
    let as_mallory = |args: &[&str]| output(&mut as_user(t, &t.mallory, &kit.cli, args));
    let as_alice = |args: &[&str]| output(&mut as_user(t, &t.alice, &kit.cli, args));
    // Alice's record is up once her own `limit` shows her budget.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !stdout(&as_alice(&["limit", "--pid", &pid])).contains("budget 1.00 GiB") {
        assert!(Instant::now() < deadline, "alice's process never showed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = as_mallory(&["limit", "--pid", &pid, "100Gi"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stderr(&out).contains(&format!("belongs to uid {}", t.alice.uid)),
        "{}",
        stderr(&out)
    );
    let alice_uid = t.alice.uid.to_string();
    let out = as_mallory(&[
        "limit",
        "--job",
        "limit-train",
        "--uid",
        &alice_uid,
        "100Gi",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("only its owner or root"),
        "{}",
        stderr(&out)
    );
    let out = as_mallory(&["limit", "--job", "limit-train", "100Gi"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "her own job limit-train does not exist"
    );
    // Nothing changed.
    let shown = stdout(&as_alice(&["limit", "--job", "limit-train"]));
    assert!(shown.contains("device 0: budget 1.00 GiB"), "{shown}");
    let shown = stdout(&as_alice(&["limit", "--pid", &pid]));
    assert!(shown.contains("budget 1.00 GiB"), "{shown}");
    // Root may: with the places alice's processes use.
    let name = crate::util::test_dir()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let shared = t.shared.join(format!("places-{name}"));
    let as_root = |args: &[&str]| {
        let mut command = cli_at(&kit.cli, args);
        command
            .env("CUDABUDGET_JOB_DIR", shared.join("jobs"))
            .env("CUDABUDGET_RUNTIME_DIR", shared.join("runtime"));
        output(&mut command)
    };
    let out = as_root(&["limit", "--pid", &pid, "2Gi"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains("budget 2.00 GiB"), "{}", stdout(&out));
    let out = as_root(&["limit", "--job", "limit-train", "3Gi"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let shown = stdout(&as_alice(&["limit", "--job", "limit-train"]));
    assert!(shown.contains("device 0: budget 3.00 GiB"), "{shown}");
    drop(member);
}
