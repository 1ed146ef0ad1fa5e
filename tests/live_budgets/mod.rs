//! Budgets that change while jobs run (`cudabudget limit`): a job's or a process's
//! budget is raised or lowered without a restart; the next admission is measured against
//! the new value, the views and the record follow, a waiter goes through as soon as the
//! budget grows, a budget lowered below the use frees nothing and refuses until the use
//! drops, and each change is an event that names who made it.

mod job;
mod process;
use crate::util;

use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use util::Run;
use util::cli::{cudabudget, output, stderr, stdout};

/// A client under the library, its output kept for the end.
fn spawn(ops: &[&str], envs: &[(&str, &str)]) -> Child {
    let mut cmd = util::client_command("gpa", ops, envs, Some(&util::cli::fresh_library()));
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn().expect("start the client")
}

fn finish(child: Child) -> Run {
    util::finish(child)
}

/// `cudabudget limit ARGS`, run to the end.
fn limit(args: &[&str]) -> Output {
    let mut all = vec!["limit"];
    all.extend_from_slice(args);
    output(&mut cudabudget(&all))
}

/// Like [`limit`], which must succeed; its standard output.
fn limit_ok(args: &[&str]) -> String {
    let out = limit(args);
    assert!(
        out.status.success(),
        "limit {args:?}: {}{}",
        stdout(&out),
        stderr(&out)
    );
    stdout(&out)
}

/// A file the client's `waitfile:` op waits for, in a directory of the test's own.
struct Step(PathBuf);

impl Step {
    fn new(test: &str, name: &str) -> Step {
        let dir = util::cli::scratch(test);
        Step(dir.join(name))
    }
    fn op(&self) -> String {
        format!("waitfile:{}", self.0.display())
    }
    fn go(&self) {
        std::fs::write(&self.0, b"").unwrap();
    }
}

/// Waits (10 s at most) until `status --json` shows `pid` and `ready` holds for it.
fn until_shown(pid: u32, ready: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = util::cli::status_json(&[]);
        if let Some(p) = util::cli::find_process(&status, pid)
            && ready(&p)
        {
            return p;
        }
        assert!(
            Instant::now() < deadline,
            "pid {pid} never showed: {status:#}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The events file's lines about budget changes.
fn changes(events: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(events)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["outcome"] == "budget_changed")
        .collect()
}

fn my_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}
