//! Shared harness for the integration tests: runs the C test clients (built from
//! `tests/fake_driver/` by the dev-dependency `cudabudget-fake-driver`) against the fake
//! driver, optionally under a preload, and reads their one-line-per-op output.
//!
//! Output format of the client: `<op> rc=<int> [key=value]...`, one line per op, then `done`.
#![allow(dead_code)]

pub mod cargo;
pub mod cli;
pub mod handoff;
pub mod scripts;
pub mod servers;
pub mod tenants;

use std::ffi::OsStr;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// This test binary's temporary directory (`cudabudget-tests-<pid>` in the system's),
/// made once; those of earlier runs whose process is gone are removed then.
pub fn binary_dir() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| per_binary_dir(&std::env::temp_dir()))
}

/// This test binary's directory that no other user can write, all the way from `/`
/// (`install` and `run` refuse a place under `/tmp`, sticky or not), and that every
/// user can enter (the tenants load what is there): in cargo's `target/tmp` when every
/// directory above it is open to all, else, as root (a build under `/root`), in
/// `/var/lib`. Made once, like [`binary_dir`].
pub fn closed_binary_dir() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        use std::os::unix::fs::MetadataExt;
        let target = Path::new(env!("CARGO_TARGET_TMPDIR"));
        std::fs::create_dir_all(target).unwrap_or_else(|e| panic!("{}: {e}", target.display()));
        let target = std::fs::canonicalize(target).unwrap();
        let closed_and_open_to_all = target.ancestors().all(|dir| {
            std::fs::metadata(dir).is_ok_and(|m| m.mode() & 0o022 == 0 && m.mode() & 0o001 != 0)
        });
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        if closed_and_open_to_all || !root {
            per_binary_dir(&target)
        } else {
            per_binary_dir(Path::new("/var/lib"))
        }
    })
}

/// Puts `from` at `to` as a hard link (a copy across file systems), replacing whatever
/// is there: never by writing through `to`, which may be a link to `from` itself (a copy
/// onto its own link would empty the build's file for every test after).
pub fn place(from: &Path, to: &Path) {
    match std::fs::remove_file(to) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("{}: {e}", to.display()),
    }
    if std::fs::hard_link(from, to).is_err() {
        std::fs::copy(from, to)
            .unwrap_or_else(|e| panic!("{} -> {}: {e}", from.display(), to.display()));
    }
}

/// The first directory from `/` to `path` that others may write (`/tmp`), if any:
/// the one `install` and `run` name when they refuse a place under it.
pub fn first_open_ancestor(path: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let path = std::fs::canonicalize(path).ok()?;
    let mut ancestors: Vec<&Path> = path.ancestors().collect();
    ancestors.reverse();
    ancestors
        .into_iter()
        .find(|dir| std::fs::metadata(dir).is_ok_and(|m| m.mode() & 0o022 != 0))
        .map(Path::to_path_buf)
}

/// `cudabudget-tests-<pid>` in `base` (0755), made now; those of earlier runs whose
/// process is gone are removed.
fn per_binary_dir(base: &Path) -> PathBuf {
    if let Ok(entries) = std::fs::read_dir(base) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.strip_prefix("cudabudget-tests-"))
                .and_then(|p| p.parse::<libc::pid_t>().ok())
            else {
                continue;
            };
            // SAFETY: kill with signal 0 only asks whether the process exists.
            let gone = unsafe { libc::kill(pid, 0) } != 0
                && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
            if gone {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    let dir = base.join(format!("cudabudget-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    // Open to all (not writable): the tenants' tests run other users in it.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// The running test's own temporary directory, named after the test (the harness runs
/// each test on a thread of that name; threads a test starts share one directory).
pub fn test_dir() -> PathBuf {
    dir_of_this_test(binary_dir())
}

/// The running test's own directory in [`closed_binary_dir`]: no other user can write
/// it or any directory above it.
pub fn closed_test_dir() -> PathBuf {
    dir_of_this_test(closed_binary_dir())
}

fn dir_of_this_test(base: &Path) -> PathBuf {
    let thread = std::thread::current();
    let name: String = thread
        .name()
        .filter(|n| *n != "main")
        .unwrap_or("other-threads")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let dir = base.join(name);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    dir
}

/// Where a process a test starts may write, each in [`test_dir`]: job ledgers
/// (`CUDABUDGET_JOB_DIR`), records (`CUDABUDGET_RUNTIME_DIR`), and the user's own places
/// the library and the CLI fall back to or cache in (`XDG_RUNTIME_DIR`, `HOME`,
/// `XDG_CACHE_HOME`). So no test leaves anything in `/dev/shm` or a real home; a test that
/// sets one of these itself (after this) has its own value.
pub fn isolate(cmd: &mut Command) -> &mut Command {
    use std::os::unix::fs::PermissionsExt;
    let dir = test_dir();
    for (variable, name) in [
        ("CUDABUDGET_JOB_DIR", "jobs"),
        ("CUDABUDGET_RUNTIME_DIR", "runtime"),
        ("XDG_RUNTIME_DIR", "xdg-runtime"),
        ("HOME", "home"),
        ("XDG_CACHE_HOME", "home/.cache"),
    ] {
        let path = dir.join(name);
        if !path.is_dir() {
            std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if name == "xdg-runtime" {
                let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700));
            }
        }
        cmd.env(variable, path);
    }
    cmd
}

/// Says that the running test is skipped, and why, on the real standard error: the test
/// harness captures `eprintln!` of a passing test, and a skip must not be silent. Under
/// `CB_NO_SKIPS=1` (CI, `.ci/run`, where every test must run) it fails the test instead.
/// `source` (C) built with `cc` into the shared object `object`; `None`, with a visible
/// skip saying it cannot build `what`, where there is no C compiler.
pub fn shared_object(source: &Path, object: &Path, what: &str) -> Option<PathBuf> {
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(object)
        .arg(source)
        .status();
    match built {
        Ok(status) if status.success() => Some(object.to_path_buf()),
        _ => {
            skip(&format!("no C compiler to build {what}"));
            None
        }
    }
}

pub fn skip(reason: &str) {
    use std::io::Write;
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    assert!(
        std::env::var("CB_NO_SKIPS").as_deref() != Ok("1"),
        "CB_NO_SKIPS=1, and {test} would be skipped: {reason}"
    );
    let _ = writeln!(std::io::stderr().lock(), "skipped {test}: {reason}");
}

/// Directory holding the fake `libcuda.so.1` and `libnvidia-ml.so.1`.
pub fn fake_dir() -> &'static str {
    cudabudget_fake_driver::FAKE_DRIVER_DIR
}

/// The fake `libcuda.so.1` itself.
pub fn fake_cuda_lib() -> &'static str {
    cudabudget_fake_driver::FAKE_CUDA_LIB
}

/// The third-party preload that relies on `RTLD_NEXT` (exports `getpagesize`).
pub fn thirdparty_lib() -> &'static str {
    cudabudget_fake_driver::FAKE_THIRDPARTY_LIB
}

/// The executor of the property test (`tests/fake_driver/prop_client.c`).
pub fn prop_client_bin() -> &'static str {
    cudabudget_fake_driver::FAKE_PROP_CLIENT
}

/// A command for any fixture binary, set up as [`client_command`] sets up a client: the
/// scrubbed variables removed, `LD_LIBRARY_PATH` = the fake driver dir, `LD_PRELOAD` =
/// `preload` when given, the places it may write in the test's directory ([`isolate`]),
/// then `envs`.
pub fn fixture_command(bin: &str, envs: &[(&str, &str)], preload: Option<&Path>) -> Command {
    let mut cmd = Command::new(bin);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(is_scrubbed) {
            cmd.env_remove(&name);
        }
    }
    isolate(&mut cmd).env("LD_LIBRARY_PATH", fake_dir());
    if let Some(p) = preload {
        assert_preloadable(p);
        cmd.env("LD_PRELOAD", p);
    }
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd
}

/// The client binary for a mode: `client_linked` for "linked", `client` otherwise.
pub fn client_bin(mode: &str) -> &'static str {
    if mode == "linked" {
        cudabudget_fake_driver::FAKE_CLIENT_LINKED
    } else {
        cudabudget_fake_driver::FAKE_CLIENT
    }
}

/// The cdylib under test: `target/<profile>/libcudabudget.so`, which the first call in a
/// test binary has cargo build (`cargo build --lib`: a `cdylib` alone is no dependency of
/// a test, so `cargo test` does not build it, and a copy left by an earlier build would be
/// tested in its place). `CB_TEST_LIB` names another build to test instead
/// (`scripts/dist.sh` runs part of the suite against `dist/libcudabudget.so` so; not a
/// `CUDABUDGET_` name, which the library would refuse as unknown).
pub fn lib_path() -> PathBuf {
    if let Some(lib) = std::env::var_os("CB_TEST_LIB") {
        return std::fs::canonicalize(&lib)
            .unwrap_or_else(|e| panic!("CB_TEST_LIB={}: {e}", Path::new(&lib).display()));
    }
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let profile_dir = cargo::profile_dir();
            let lib = profile_dir.join("libcudabudget.so");
            cargo::build(&profile_dir, &["-p", "cudabudget", "--lib"], &lib);
            lib
        })
        .clone()
}

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const KI: u64 = KIB;
pub const MI: u64 = MIB;
pub const GI: u64 = GIB;
pub const TI: u64 = 1 << 40;

/// What to put in `LD_PRELOAD` for [`client`]: `Some(path)` / `None`, or `true` for the
/// cdylib under test ([`lib_path`]) / `false` for nothing.
pub trait Preload {
    fn preload(self) -> Option<PathBuf>;
}

impl Preload for Option<&Path> {
    fn preload(self) -> Option<PathBuf> {
        self.map(Path::to_path_buf)
    }
}

impl Preload for bool {
    fn preload(self) -> Option<PathBuf> {
        self.then(lib_path)
    }
}

/// What one client run printed.
#[derive(Debug)]
pub struct Run {
    pub lines: Vec<String>,
    pub status: ExitStatus,
    pub stderr: String,
}

/// Variables that must not leak from the test's environment into a client.
fn is_scrubbed(name: &str) -> bool {
    name.starts_with("CUDABUDGET_")
        || name.starts_with("CUDA_DEVICE_MEMORY_LIMIT")
        || name.starts_with("FAKE_CUDA_")
        || name == "CUDA_VISIBLE_DEVICES"
        || name == "LD_PRELOAD"
        || name == "LD_LIBRARY_PATH"
}

/// The command that runs a client: `LD_LIBRARY_PATH` = the fake driver dir, `LD_PRELOAD`
/// = `preload` when given, every `CUDABUDGET_*`, `CUDA_DEVICE_MEMORY_LIMIT*`, `FAKE_CUDA_*`
/// and `CUDA_VISIBLE_DEVICES` variable removed, the places it may write in the test's
/// directory ([`isolate`]), then `envs` applied (they win over all of it).
pub fn client_command(
    mode: &str,
    ops: &[&str],
    envs: &[(&str, &str)],
    preload: Option<&Path>,
) -> Command {
    let mut cmd = Command::new(client_bin(mode));
    cmd.arg(mode).args(ops);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(is_scrubbed) {
            cmd.env_remove(&name);
        }
    }
    isolate(&mut cmd).env("LD_LIBRARY_PATH", fake_dir());
    if let Some(p) = preload {
        cmd.env("LD_PRELOAD", p);
    }
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd
}

/// Runs a client (see [`client_command`]) and collects its output. `preload`:
/// `Option<&Path>`, or `true` for the cdylib under test.
pub fn client(mode: &str, ops: &[&str], envs: &[(&str, &str)], preload: impl Preload) -> Run {
    let preload = preload.preload();
    if let Some(p) = &preload {
        assert_preloadable(p);
    }
    run(client_command(mode, ops, envs, preload.as_deref()))
}

/// Runs a client under the cdylib under test ([`lib_path`]).
pub fn budget_run(mode: &str, ops: &[&str], envs: &[(&str, &str)]) -> Run {
    client(mode, ops, envs, true)
}

/// Runs a client with `LD_PRELOAD` set to exactly `preload` (e.g. a `:`-separated list).
pub fn client_with_preload(
    mode: &str,
    ops: &[&str],
    envs: &[(&str, &str)],
    preload: impl AsRef<OsStr>,
) -> Run {
    let mut cmd = client_command(mode, ops, envs, None);
    cmd.env("LD_PRELOAD", preload);
    run(cmd)
}

/// ld.so only warns about a missing preload and runs the program without it, which would
/// make a budget test pass or fail for the wrong reason.
fn assert_preloadable(p: &Path) {
    assert!(
        p.is_file(),
        "preload {} does not exist (is the cdylib built?)",
        p.display()
    );
}

/// Reads `child`'s piped output until its first line starting with `op`, a readiness
/// handshake: the op has run (the fake client prints a line per op as it goes). What
/// was read before is dropped; the rest stays for [`finish`].
pub fn wait_for_line(child: &mut std::process::Child, op: &str) -> String {
    use std::io::Read;
    let out = child.stdout.as_mut().expect("piped output");
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        // One byte at a time: nothing after the line is taken from the pipe.
        let n = out.read(&mut byte).expect("read the child's output");
        assert!(n > 0, "the child ended before `{op}`");
        if byte[0] != b'\n' {
            line.push(byte[0]);
            continue;
        }
        let text = String::from_utf8_lossy(&line).into_owned();
        if text.starts_with(op) {
            return text;
        }
        line.clear();
    }
}

/// Waits for a child started with piped output and collects what it printed.
pub fn finish(child: std::process::Child) -> Run {
    let out = child.wait_with_output().expect("wait for the child");
    Run {
        lines: String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect(),
        status: out.status,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs any command with piped output and a time limit (`FAKE_CLIENT_TIMEOUT_S`, default
/// 120 s): a hung child is killed and reported as a failure.
pub fn run(mut cmd: Command) -> Run {
    let limit = std::env::var("FAKE_CLIENT_TIMEOUT_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(limit);
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for client") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let st = child.wait().expect("wait for killed client");
            let stdout = out_t.join().unwrap_or_default();
            let stderr = err_t.join().unwrap_or_default();
            panic!(
                "{cmd:?} ran over {limit} s and was killed ({st})\nstdout:\n{stdout}\nstderr:\n{stderr}"
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    Run {
        lines: stdout.lines().map(str::to_owned).collect(),
        status,
        stderr,
    }
}

impl Run {
    /// Everything the run printed, for assertion messages.
    pub fn dump(&self) -> String {
        format!(
            "status: {}\nstdout:\n{}\nstderr:\n{}",
            self.status,
            self.lines.join("\n"),
            self.stderr
        )
    }

    /// All lines of op `op` (matched on the first word), in order.
    pub fn lines_of(&self, op: &str) -> Vec<&str> {
        self.lines
            .iter()
            .filter(|l| l.split(' ').next() == Some(op))
            .map(String::as_str)
            .collect()
    }

    /// The `nth` (from 0) line printed by op `op`; panics with the whole output if absent.
    pub fn line(&self, op: &str, nth: usize) -> &str {
        match self.lines_of(op).get(nth) {
            Some(l) => l,
            None => panic!("no line #{nth} for op '{op}'\n{}", self.dump()),
        }
    }

    /// The `nth` line of `op` if it exists.
    pub fn line_opt(&self, op: &str, nth: usize) -> Option<&str> {
        self.lines_of(op).get(nth).copied()
    }

    /// Value of `key=` in the `nth` line of `op`; panics if missing.
    pub fn field(&self, op: &str, nth: usize, key: &str) -> String {
        let line = self.line(op, nth);
        let prefix = format!("{key}=");
        match line
            .split(' ')
            .skip(1)
            .find_map(|w| w.strip_prefix(prefix.as_str()))
        {
            Some(v) => v.to_owned(),
            None => panic!("no '{key}=' in line {line:?}\n{}", self.dump()),
        }
    }

    /// The `rc=` of the `nth` line of `op`.
    pub fn rc(&self, op: &str, nth: usize) -> i64 {
        let v = self.field(op, nth, "rc");
        v.parse()
            .unwrap_or_else(|_| panic!("rc={v:?} is not a number\n{}", self.dump()))
    }

    /// A numeric field (decimal, or hex with `0x`).
    pub fn num(&self, op: &str, nth: usize, key: &str) -> u64 {
        let v = self.field(op, nth, key);
        let parsed = match v.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => v.parse(),
        };
        parsed.unwrap_or_else(|_| panic!("{key}={v:?} is not a number\n{}", self.dump()))
    }

    /// True when the client ran every op and exited 0.
    pub fn completed(&self) -> bool {
        self.status.success() && self.lines.last().map(String::as_str) == Some("done")
    }

    /// Panics with the whole output unless the client ran every op and exited 0.
    #[track_caller]
    pub fn assert_completed(&self) -> &Self {
        assert!(self.completed(), "client did not complete\n{}", self.dump());
        self
    }
}

/// Runs a Python `ctypes` script against the fake driver with the library preloaded
/// (60 s at most); returns (success, stdout, stderr).
pub fn python_under_library(script: &str, envs: &[(&str, &str)]) -> (bool, String, String) {
    let out = isolate(&mut Command::new("timeout"))
        .args(["60", "python3", "-c", script])
        .env("LD_LIBRARY_PATH", fake_dir())
        .env("LD_PRELOAD", lib_path())
        .envs(envs.iter().copied())
        .output()
        .expect("python3 runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Standard base64 as Kubernetes writes it (a Secret's data, an admission patch; padding
/// and line breaks allowed); panics on anything else.
pub fn base64_decode(text: &str) -> Vec<u8> {
    use base64::Engine;
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    const STANDARD_ANY_PADDING: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    let compact: String = text.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    STANDARD_ANY_PADDING
        .decode(compact)
        .unwrap_or_else(|e| panic!("not base64 ({e}): {text}"))
}
