//! Job budgets (`CUDABUDGET_SCOPE=job:<name>`, or HAMi's shared cache): what users rely
//! on when several processes share one budget. Together they never pass it, a process
//! that exits, is killed, stops or execs gives its share back, a waiting allocation goes
//! through as soon as room comes (in arrival order) and sleeps meanwhile, and a damaged
//! or foreign ledger refuses CUDA with one line instead of admitting past the budget.
//! Each test keeps its job ledgers in a directory of its own (`CUDABUDGET_JOB_DIR`).

mod leaving;
mod ledger;
mod pods;
mod sharing;
use crate::util;
mod waiting;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use util::handoff::{NEXT_TICKET_AT, THREADS_PRELUDE, python_job, python_threads};
use util::{GI, MI, Run};

/// A fresh directory for a test's ledgers.
fn job_dir(test: &str) -> String {
    let dir = util::test_dir().join(format!("jobs-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.to_str().unwrap().to_string()
}

/// NVML listing the process under another pid: nothing but the hooks charges.
fn envs<'a>(dir: &'a str, job: &'a str, limit: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("CUDABUDGET_JOB_DIR", dir),
        ("CUDABUDGET_SCOPE", job),
        ("CUDABUDGET_LIMIT", limit),
        ("FAKE_NVML_PID_OFFSET", "100000"),
        // No fallback place outside the test's directory ($HOME/.cache would be one).
        ("HOME", dir),
        ("XDG_RUNTIME_DIR", ""),
    ]
}

fn command(ops: &[&str], envs: &[(&str, &str)]) -> Command {
    let mut cmd = util::client_command("gpa", ops, envs, Some(&util::lib_path()));
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn spawn(ops: &[&str], envs: &[(&str, &str)]) -> Child {
    command(ops, envs).spawn().expect("spawn client")
}

fn finish(child: Child) -> Run {
    util::finish(child)
}

fn client(ops: &[&str], envs: &[(&str, &str)]) -> Run {
    util::run(command(ops, envs))
}

/// A member of the job that holds nothing and stays until dropped: the job's ledger
/// exists while it lives (its last member removes it on exit).
struct Member(Child);

impl Member {
    fn start(envs: &[(&str, &str)]) -> Member {
        let mut member = Member(spawn(&["info", "sleep:30000"], envs));
        util::wait_for_line(&mut member.0, "info");
        member
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A member that holds what its ops got until the test is done with it: started, and
/// returned once it has answered every op (it is in the job, its allocations made); it
/// ends when [`Holder::finish`] makes the file it waits for (or is dropped).
struct Holder {
    child: Option<Child>,
    said: Vec<String>,
    release: std::path::PathBuf,
}

impl Holder {
    fn start(ops: &[&str], envs: &[(&str, &str)]) -> Holder {
        static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let release = util::test_dir().join(format!(
            "release-{}",
            SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let _ = std::fs::remove_file(&release);
        let wait = format!("waitfile:{}", release.display());
        let mut all = ops.to_vec();
        all.push(&wait);
        let mut child = spawn(&all, envs);
        let said = ops
            .iter()
            .map(|op| util::wait_for_line(&mut child, op.split(':').next().unwrap()))
            .collect();
        Holder {
            child: Some(child),
            said,
            release,
        }
    }

    /// Lets it end, and what it printed.
    fn finish(mut self) -> Run {
        std::fs::write(&self.release, b"").unwrap();
        let mut run = finish(self.child.take().unwrap());
        let rest = std::mem::take(&mut run.lines);
        run.lines = std::mem::take(&mut self.said);
        run.lines.extend(rest);
        run
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.release, b"");
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn unsafe_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn set_mode(path: &str, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// How many waits for room on device 0 have begun in job `name`'s ledger in `dir` (its
/// queue's next ticket, never taken back).
fn waits_begun(dir: &str, name: &str) -> u64 {
    use std::os::unix::fs::FileExt;
    let Ok(file) = std::fs::File::open(ledger_file(dir, name)) else {
        return 0;
    };
    let mut word = [0u8; 8];
    file.read_exact_at(&mut word, NEXT_TICKET_AT).unwrap();
    u64::from_le_bytes(word)
}

/// Until `n` waits have begun in job `name`'s ledger: a handshake with a member that
/// asked for more than there is room for, which is then waiting (a minute at most, so
/// that one that never waits fails the test rather than hanging it).
fn until_waits_begun(dir: &str, name: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while waits_begun(dir, name) < n {
        assert!(
            Instant::now() < deadline,
            "{n} waits never began in job {name}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The job's ledger file in `dir`, wherever this build keeps it: in the user's own
/// directory there (`cudabudget-<uid>/job-<name>`), or, in builds before that, at
/// `cudabudget-<uid>-job-<name>`.
fn ledger_file(dir: &str, name: &str) -> String {
    let uid = unsafe_uid();
    let private = format!("{dir}/cudabudget-{uid}/job-{name}");
    if std::path::Path::new(&private).exists() {
        private
    } else {
        format!("{dir}/cudabudget-{uid}-job-{name}")
    }
}

/// Writes `bytes` at `offset` of `path` (in place, as a stray write would).
fn write_at(path: &str, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
}

/// Where the admission lock word of device 0 lies in the ledger at `path`, by its
/// layout (the magic's last two bytes are its version).
fn lock_offset(path: &str) -> u64 {
    let head = std::fs::read(path).unwrap();
    match &head[..8] {
        b"CBJOBv01" => 64,
        b"CBJOBv02" => 128,
        other => panic!("unknown layout {other:?}"),
    }
}

/// A Python member of job `name` in `dir` (1 GiB, `patience`), started now: `code` runs
/// after [`THREADS_PRELUDE`]; its standard output is piped.
fn python_member(dir: &str, name: &str, code: &str, patience: &str) -> Child {
    util::isolate(&mut Command::new("python3"))
        .args(["-c", &format!("{THREADS_PRELUDE}{code}")])
        .env("LD_LIBRARY_PATH", util::fake_dir())
        .env("LD_PRELOAD", util::lib_path())
        .env("CUDABUDGET_JOB_DIR", dir)
        .env("CUDABUDGET_SCOPE", format!("job:{name}"))
        .env("CUDABUDGET_LIMIT", "1Gi")
        .env("CUDABUDGET_ON_EXCEED", patience)
        .env("FAKE_NVML_PID_OFFSET", "100000")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs")
}

/// Reads one line of a member's standard output.
fn read_line(child: &mut Child) -> String {
    use std::io::BufRead;
    let mut line = String::new();
    let out = child.stdout.as_mut().unwrap();
    std::io::BufReader::new(out).read_line(&mut line).unwrap();
    line
}

/// A Python member of job `name` in `dir` that watches itself: an allocation or free
/// that takes over `limit_s` prints `stuck` and ends the process.
const WATCHDOG: &str = r#"
import os, signal
def timed(f, *a, limit_s=2.0):
    done = threading.Event()
    def watch():
        if not done.wait(limit_s):
            print("stuck", flush=True)
            os._exit(3)
    threading.Thread(target=watch, daemon=True).start()
    t = time.time()
    r = f(*a)
    done.set()
    return r, time.time() - t
"#;
