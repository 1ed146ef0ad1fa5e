//! Another user cannot make alice's job write where it was never meant to, nor lose its
//! events: an events file, a FIFO or a directory that mallory planted at the path named
//! by `CUDABUDGET_EVENTS` moves alice's events to a place of her own with one line, and
//! alice's job runs on, budgeted.
//! Needs root to create the users; skipped otherwise.

use crate::util::tenants::{Tenants, as_user};
use crate::util::{client_bin, fake_dir, lib_path};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// `CUDABUDGET_EVENTS=events` for alice's client under a 2 GiB budget: denied, admitted,
/// denied. Returns (finished within 10 s, stdout, stderr).
fn alice_runs(t: &Tenants, events: &Path) -> (bool, String, String) {
    // Shared once for the whole file: `Tenants::share` run by two tests at once races
    // on its temporary name.
    static SHARED: OnceLock<(PathBuf, PathBuf, PathBuf)> = OnceLock::new();
    let (client, library, driver) = SHARED.get_or_init(|| {
        (
            t.share(Path::new(client_bin("gpa"))),
            t.share(&lib_path()),
            t.share_dir(Path::new(fake_dir())),
        )
    });
    let mut command: Command = as_user(
        t,
        &t.alice,
        client,
        &["gpa", "alloc:4Gi", "alloc:1Gi", "alloc:2Gi"],
    );
    command
        .env("LD_PRELOAD", library)
        .env("LD_LIBRARY_PATH", driver)
        .env("CUDABUDGET_LIMIT", "2Gi")
        .env("CUDABUDGET_EVENTS", events)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().expect("run as alice");
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
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
    let deadline = Instant::now() + Duration::from_secs(10);
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
    (finished, out.join().unwrap(), err.join().unwrap())
}

fn assert_budgeted(stdout: &str, stderr: &str) {
    let rcs: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("alloc "))
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    assert_eq!(
        rcs,
        ["rc=2", "rc=0", "rc=2"],
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
}

/// Asserts that alice's two denials went to the events file's name in `events/` of her
/// records directory (in the runtime directory `as_user` gives), hers and closed to
/// others, and that one line said where.
fn assert_moved_to_her_own_place(t: &Tenants, events: &Path, stderr: &str) {
    let test = crate::util::test_dir();
    let moved = t
        .shared
        .join(format!(
            "places-{}",
            test.file_name().unwrap().to_string_lossy()
        ))
        .join("runtime")
        .join(format!("cudabudget-{}", t.alice.uid))
        .join("events")
        .join(events.file_name().unwrap());
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("cannot append denial events"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains(&format!("they go to {} instead", moved.display())),
        "{stderr}"
    );
    let text =
        std::fs::read_to_string(&moved).unwrap_or_else(|e| panic!("{}: {e}", moved.display()));
    assert_eq!(text.lines().count(), 2, "{text}");
    let meta = std::fs::metadata(&moved).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), t.alice.uid);
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
}

fn chown(path: &Path, user: &crate::util::tenants::User) {
    std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid)).unwrap();
}

fn mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn alice_s_job_writes_its_own_events_file_in_a_shared_directory() {
    let Some(t) = Tenants::get() else { return };
    let dir = t.sticky_dir("events-own");
    let events = dir.join("alice.jsonl");
    let (finished, stdout, stderr) = alice_runs(t, &events);
    assert!(finished);
    assert_budgeted(&stdout, &stderr);
    let text = std::fs::read_to_string(&events).expect("alice's events file");
    assert_eq!(text.lines().count(), 2, "{text}");
    let meta = std::fs::metadata(&events).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), t.alice.uid);
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
}

#[test]
fn an_events_file_planted_by_mallory_is_not_written_by_alice_s_job() {
    let Some(t) = Tenants::get() else { return };
    let dir = t.sticky_dir("events-planted");
    let events = dir.join("events.jsonl");
    std::fs::write(&events, "mallory's\n").unwrap();
    chown(&events, &t.mallory);
    mode(&events, 0o666);
    let (finished, stdout, stderr) = alice_runs(t, &events);
    assert!(finished);
    assert_budgeted(&stdout, &stderr);
    assert_eq!(std::fs::read_to_string(&events).unwrap(), "mallory's\n");
    assert!(
        stderr.contains("cannot append denial events") && stderr.contains("uid"),
        "one line names the file and its owner: {stderr}"
    );
    assert_moved_to_her_own_place(t, &events, &stderr);
}

#[test]
fn a_directory_planted_by_mallory_on_the_events_path_is_not_used() {
    let Some(t) = Tenants::get() else { return };
    let dir = t.sticky_dir("events-dir");
    let planted: PathBuf = dir.join("logs");
    std::fs::create_dir(&planted).unwrap();
    chown(&planted, &t.mallory);
    mode(&planted, 0o777);
    let events = planted.join("events.jsonl");
    let (finished, stdout, stderr) = alice_runs(t, &events);
    assert!(finished);
    assert_budgeted(&stdout, &stderr);
    assert!(
        !events.exists(),
        "alice's job created a file in mallory's directory"
    );
    assert!(
        stderr.contains("cannot append denial events") && stderr.contains("cannot be trusted"),
        "{stderr}"
    );
    assert_moved_to_her_own_place(t, &events, &stderr);
}

#[test]
fn a_fifo_planted_by_mallory_does_not_hold_up_alice_s_job() {
    let Some(t) = Tenants::get() else { return };
    let dir = t.sticky_dir("events-fifo");
    let events = dir.join("events.jsonl");
    let c = std::ffi::CString::new(events.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
    chown(&events, &t.mallory);
    mode(&events, 0o666);
    let (finished, stdout, stderr) = alice_runs(t, &events);
    assert!(
        finished,
        "alice's job was still running after 10 s: {stdout}"
    );
    assert_budgeted(&stdout, &stderr);
    assert_moved_to_her_own_place(t, &events, &stderr);
}
