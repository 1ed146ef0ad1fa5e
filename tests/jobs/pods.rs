//! Pods: the members of one job spread over several pods, each pod in a PID namespace
//! of its own (modelled with `unshare --pid --fork --mount-proc`, as root). A pid read
//! from the job's ledger means nothing in another pod, so each pod must still count the
//! others' shares, and a killed pod's share must still come back.

use super::*;

/// `cmd` wrapped to run as PID 1 of a new PID namespace (with its own `/proc`), killed
/// with the `unshare` process that starts it; `None` where this machine cannot do that.
fn in_a_pod(cmd: Command) -> Option<Command> {
    let probe = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--kill-child", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        return None;
    }
    let mut pod = Command::new("unshare");
    pod.args(["--pid", "--fork", "--mount-proc", "--kill-child"])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (name, value) in cmd.get_envs() {
        match value {
            Some(value) => pod.env(name, value),
            None => pod.env_remove(name),
        };
    }
    pod.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    Some(pod)
}

#[test]
fn members_in_two_pid_namespaces_share_one_budget_and_a_killed_pods_share_comes_back() {
    if unsafe_uid() != 0 {
        util::skip("needs root to make PID namespaces as a pod does");
        return;
    }
    let dir = job_dir("pods");
    let e = envs(&dir, "job:pods", "8Gi");
    let Some(mut first) = in_a_pod(command(&["alloc:6Gi", "sleep:30000"], &e)) else {
        util::skip("this machine cannot create a PID namespace (unshare --pid)");
        return;
    };
    let mut pod_a = first.spawn().expect("start pod A");
    let line = util::wait_for_line(&mut pod_a, "alloc");
    assert!(line.contains("rc=0"), "pod A holds 6 GiB: {line}");

    let second = in_a_pod(command(&["alloc:4Gi", "info"], &e)).unwrap();
    let pod_b = util::run(second);
    assert_eq!(
        pod_b.rc("alloc", 0),
        2,
        "pod B is refused: pod A's 6 GiB count in the job\n{pod_b:?}"
    );
    assert_eq!(pod_b.num("info", 0, "free"), 2 * GI, "{pod_b:?}");

    // Pod A is killed (its PID 1 with it): its share comes back to pod B.
    // SAFETY: a plain signal to our own child (unshare kills its child with it).
    unsafe { libc::kill(pod_a.id() as i32, libc::SIGKILL) };
    pod_a.wait().unwrap();
    let third = in_a_pod(command(&["alloc:4Gi"], &e)).unwrap();
    let pod_c = util::run(third);
    assert_eq!(pod_c.rc("alloc", 0), 0, "{pod_c:?}");
}
