//! The `cudabudget` binary in tests: commands with a clean environment, and budgeted
//! client processes that stay alive while a test looks at them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{client_command, fake_dir, lib_path};

pub const BIN: &str = env!("CARGO_BIN_EXE_cudabudget");

/// Variables of the test's own environment that would change an answer.
fn is_scrubbed(name: &str) -> bool {
    name.starts_with("CUDABUDGET_")
        || name.starts_with("CUDA_DEVICE_MEMORY_LIMIT")
        || name.starts_with("FAKE_CUDA_")
        || name.starts_with("FAKE_NVML_")
        || name.starts_with("_CUDABUDGET_")
        || [
            "LD_PRELOAD",
            "LD_LIBRARY_PATH",
            "CUDA_VISIBLE_DEVICES",
            "CUDA_MPS_PIPE_DIRECTORY",
            "POD_NAME",
            "POD_NAMESPACE",
            "CONTAINER_NAME",
            "KUBERNETES_SERVICE_HOST",
        ]
        .contains(&name)
}

/// The CLI at `bin` with a clean environment and `LD_LIBRARY_PATH` = the fake driver's
/// directory (so NVML and the driver are the fakes), writing only in the test's own
/// directory ([`super::isolate`]).
pub fn cli_at(bin: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(bin);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(is_scrubbed) {
            command.env_remove(&name);
        }
    }
    super::isolate(&mut command)
        .env("LD_LIBRARY_PATH", fake_dir())
        .args(args);
    command
}

/// `run` under a budget of 1 GiB of a command that prints the `LD_PRELOAD` it was given.
pub const RUN_PRINTING_PRELOAD: &[&str] = &[
    "run",
    "--limit",
    "1Gi",
    "--",
    "sh",
    "-c",
    "echo $LD_PRELOAD",
];

/// The CLI cargo built, told where this run's library is ([`fresh_library`]: the one
/// [`super::lib_path`] has built, not whatever lies beside the CLI).
pub fn cudabudget(args: &[&str]) -> Command {
    let mut command = cli_at(Path::new(BIN), args);
    command.env("CUDABUDGET_LIB", fresh_library());
    command
}

/// The node services' binary (`cudabudget-node`, [`super::servers::node_bin`]) with a
/// clean environment, as [`cli_at`]: `node(&["exporter", …])`, `node(&["webhook", …])`.
pub fn node(args: &[&str]) -> Command {
    cli_at(super::servers::node_bin(), args)
}

/// The library built for this run, canonical ([`closed_copy`] of it where the build lies
/// under a directory other users may write, such as a clone under `/tmp`).
pub fn fresh_library() -> PathBuf {
    let path = lib_path();
    let path = std::fs::canonicalize(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    closed_copy(&path)
}

/// The library the CLI carries and writes where it runs without one beside it: the build
/// script's own build (`build.rs`, `CB_BUILD_EMBED_LIBRARY`), not byte for byte the one
/// in `target/`; the build's own where this build carries none (a check or clippy build).
pub fn carried_library() -> PathBuf {
    #[cfg(cudabudget_embed)]
    return PathBuf::from(env!("CB_BUILD_EMBED_LIBRARY"));
    #[cfg(not(cudabudget_embed))]
    fresh_library()
}

/// `path` itself, or where it lies under a directory other users may write, a copy of it
/// with the same file name in [`super::closed_binary_dir`] (made once per test binary):
/// `run`, `install` and `doctor` refuse a library in such a place.
pub fn closed_copy(path: &Path) -> PathBuf {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static COPIES: Mutex<Option<HashMap<PathBuf, PathBuf>>> = Mutex::new(None);
    if super::first_open_ancestor(path).is_none() {
        return path.to_path_buf();
    }
    let mut copies = COPIES.lock().unwrap_or_else(|e| e.into_inner());
    let copies = copies.get_or_insert_with(HashMap::new);
    let n = copies.len();
    copies
        .entry(path.to_path_buf())
        .or_insert_with(|| {
            let dir = super::closed_binary_dir().join(format!("copy-{n}"));
            std::fs::create_dir_all(&dir).unwrap();
            let copy = dir.join(path.file_name().expect("a file"));
            std::fs::copy(path, &copy).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            copy
        })
        .clone()
}

/// Runs `command` to the end. A binary a test just copied may still be open for writing
/// in a child another test thread forked meanwhile (ETXTBSY): tried again for a while.
pub fn output(command: &mut Command) -> Output {
    let mut tries = 0;
    loop {
        match command.stdin(Stdio::null()).output() {
            Ok(output) => return output,
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 200 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("cannot run {command:?}: {e}"),
        }
    }
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A directory of its own for a test, empty.
pub fn scratch(test: &str) -> PathBuf {
    empty(super::test_dir().join(format!("scratch-{test}")))
}

/// Like [`scratch`], in a directory no other user can write, all the way from `/`
/// ([`super::closed_test_dir`]): where `install` and `run` accept a library.
pub fn closed_scratch(test: &str) -> PathBuf {
    empty(super::closed_test_dir().join(format!("scratch-{test}")))
}

fn empty(dir: PathBuf) -> PathBuf {
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The records directory of this user in the runtime directory the harness gives the
/// test's processes ([`super::isolate`]).
pub fn records_dir() -> PathBuf {
    // SAFETY: geteuid cannot fail.
    let uid = unsafe { libc::geteuid() };
    super::test_dir()
        .join("runtime")
        .join(format!("cudabudget-{uid}"))
}

/// The record file of `pid`, if there is one.
pub fn record_of(pid: u32) -> Option<PathBuf> {
    let prefix = format!("{pid}-");
    std::fs::read_dir(records_dir())
        .ok()?
        .filter_map(Result::ok)
        .find(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with(&prefix) && name.ends_with(".rec")
        })
        .map(|e| e.path())
}

/// A client under the library that runs `ops` (ending in a long `sleep:`) and is killed
/// when dropped.
pub struct Budgeted {
    pub child: Child,
}

impl Budgeted {
    /// Starts the client (see [`Budgeted::wait_for`] to wait for its record).
    pub fn start(ops: &[&str], envs: &[(&str, &str)]) -> Budgeted {
        let library = fresh_library();
        let mut command = client_command("gpa", ops, envs, Some(&library));
        for name in [
            "POD_NAME",
            "POD_NAMESPACE",
            "CONTAINER_NAME",
            "KUBERNETES_SERVICE_HOST",
        ] {
            if !envs.iter().any(|(n, _)| *n == name) {
                command.env_remove(name);
            }
        }
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = command.spawn().expect("start the client");
        Budgeted { child }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits (up to 10 s) until `status --json` shows the process with `device_count`
    /// devices and `predicate` holds for it; returns that process's JSON.
    pub fn wait_for(
        &self,
        device_count: usize,
        predicate: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let status = status_json(&[]);
            if let Some(process) = find_process(&status, self.pid()) {
                let devices = process["devices"].as_array().map_or(0, Vec::len);
                if devices == device_count && predicate(&process) {
                    return process;
                }
            }
            assert!(
                Instant::now() < deadline,
                "process {} never showed as expected; last status: {status:#}",
                self.pid()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills the process (as `kill -9` would) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Budgeted {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `cudabudget status --json` with `envs`, parsed.
pub fn status_json(envs: &[(&str, &str)]) -> serde_json::Value {
    let out = output(cudabudget(&["status", "--json"]).envs(envs.iter().copied()));
    assert!(out.status.success(), "status failed: {}", stderr(&out));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("status --json is not JSON ({e}): {}", stdout(&out)))
}

/// The process `pid` in a status object.
pub fn find_process(status: &serde_json::Value, pid: u32) -> Option<serde_json::Value> {
    status["processes"]
        .as_array()?
        .iter()
        .find(|p| p["pid"].as_u64() == Some(u64::from(pid)))
        .cloned()
}

/// A copy of the library that the loader refuses: every `GLIBC_2.` version it needs
/// becomes `GLIBC_9.`, as a library built against a newer glibc than the system's.
pub fn library_for_a_newer_glibc(dir: &Path) -> PathBuf {
    let mut bytes = std::fs::read(fresh_library()).unwrap();
    let (from, to) = (b"GLIBC_2.", b"GLIBC_9.");
    let mut at = 0;
    while let Some(found) = bytes[at..].windows(from.len()).position(|w| w == from) {
        bytes[at + found..at + found + to.len()].copy_from_slice(to);
        at += found + to.len();
    }
    let path = dir.join("libcudabudget.so");
    std::fs::write(&path, bytes).unwrap();
    path
}
