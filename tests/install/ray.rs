//! Ray, run for real: the recipe `deploy/ray/shared_gpu.py` against a cluster of two
//! nodes that each test starts on this machine with `ray start` — a head without a GPU and
//! a second node declaring one (`--num-gpus 1`) whose driver is the fake `libcuda.so.1` of
//! `tests/fake_driver`. The recipe's two actors (`num_gpus=0.5`) share that GPU, each in a
//! worker process started with the library preloaded and its own budget (`runtime_env`);
//! their reports, made inside each actor, must show the budget as the device's total and
//! an allocation past it refused with `CUDA_ERROR_OUT_OF_MEMORY`. With the library's path
//! wrong, the actors must refuse to start.
//! With `deploy/ray`'s `cudabudget_ray` installed in the workers' Python and the second
//! node started with the library in `LD_PRELOAD`, actors of `num_gpus=0.5` and a task of
//! `resources={"cudabudget_gib": 20}` whose code names no budget must each be held to
//! the share Ray gave them.
//!
//! Ray comes from PyPI, in a virtual environment that `tests/install/ray/install.sh` makes
//! (`$CB_RAY_VENV`, else `target/ray/venv`). Without it each test prints that it is skipped
//! and passes; with CB_REQUIRE_RAY=1 (CI) a missing Ray fails it.
//!
//! Each cluster lives in a temporary directory of its own, on ports checked free (never
//! Ray's defaults), and is stopped by the test on every path (a drop guard). Only the
//! processes the test started are signalled: each `ray start` runs in a session of its
//! own, and the guard ends the members of those sessions by pid. (`ray stop` is not used:
//! it ends every Ray process of the machine, by name, whoever started it.) A test killed
//! outright (Ctrl-C) takes its `ray start --block` processes with it, and the next run
//! ends whatever of its cluster outlived them.

use std::io::Write;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

const GI: u64 = 1 << 30;
/// The fake driver's card: 80 GiB.
const GPU_GIB: u64 = 80;
const CUDA_SUCCESS: i64 = 0;
const CUDA_ERROR_OUT_OF_MEMORY: i64 = 2;

/// One cluster at a time: two at once would share a CI machine's two cores, and
/// [`free_ports`] picks a block for one cluster at a time.
static ONE_CLUSTER: Mutex<()> = Mutex::new(());

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn recipe() -> PathBuf {
    repo().join("deploy/ray/shared_gpu.py")
}

/// The virtual environment with Ray in it, or `None` after saying why the test is skipped
/// (under CB_REQUIRE_RAY=1: a failure).
fn ray_venv() -> Option<PathBuf> {
    let venv = std::env::var_os("CB_RAY_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/ray/venv"));
    if venv.join("bin/ray").is_file() && venv.join("bin/python").is_file() {
        return Some(venv);
    }
    let reason = format!(
        "no Ray in {} (make it with `bash tests/install/ray/install.sh`, or point CB_RAY_VENV at one)",
        venv.display()
    );
    assert!(
        std::env::var("CB_REQUIRE_RAY").as_deref() != Ok("1"),
        "CB_REQUIRE_RAY=1: {reason}"
    );
    crate::util::skip(&reason);
    None
}

/// The first of a block of [`Ports::SPAN`] ports below the kernel's ephemeral range, each
/// free now.
fn free_ports() -> u16 {
    const FIRST: u16 = 20_000;
    const BLOCKS: u16 = 70;
    let start = (std::process::id() % u32::from(BLOCKS)) as u16;
    (0..BLOCKS)
        .map(|i| FIRST + (start + i) % BLOCKS * Ports::SPAN)
        .find(|&base| {
            (base..base + Ports::SPAN).all(|port| TcpListener::bind(("0.0.0.0", port)).is_ok())
        })
        .expect("a free block of ports between 20000 and 31200")
}

/// Where a cluster's listeners go in its block: the GCS at 0, the dashboard at 1, the
/// head's other listeners at 2-7, the second node's at 12-17, their workers at 40-99 and
/// 100-159. Ray's defaults (6379, 8265, ...) are never used, so a Ray of someone else's
/// on this machine is left alone.
struct Ports(u16);

impl Ports {
    const SPAN: u16 = 160;

    /// `ray start` arguments of the head (`node` 0) or the second node (1).
    fn args(&self, node: u16) -> Vec<String> {
        let base = self.0 + 10 * node;
        let workers = self.0 + 40 + 60 * node;
        let mut args = Vec::new();
        for (i, flag) in [
            "--node-manager-port",
            "--object-manager-port",
            "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port",
            "--runtime-env-agent-port",
            "--metrics-export-port",
        ]
        .into_iter()
        .enumerate()
        {
            args.push(flag.to_string());
            args.push((base + 2 + i as u16).to_string());
        }
        args.push("--min-worker-port".into());
        args.push(workers.to_string());
        args.push("--max-worker-port".into());
        args.push((workers + 59).to_string());
        if node == 0 {
            args.push("--port".into());
            args.push(self.gcs().to_string());
            args.push("--dashboard-port".into());
            args.push((base + 1).to_string());
        }
        args
    }

    fn gcs(&self) -> u16 {
        self.0
    }
}

/// The start of each cluster's directory's name (in the system's temporary directory),
/// followed by the test process's pid.
const CLUSTER_DIR: &str = "cb-ray-";

/// A session that a `ray start` of a test leads.
#[derive(Clone, Copy, Debug)]
struct Session {
    id: libc::pid_t,
    /// When its leader started (clock ticks after boot): every member started after.
    since: u64,
}

/// What `/proc/<pid>/stat` says of a process.
struct ProcessStat {
    zombie: bool,
    session: libc::pid_t,
    /// Clock ticks after boot.
    started: u64,
}

fn process_stat(pid: libc::pid_t) -> Option<ProcessStat> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid pgrp session ... starttime (the 22nd) ...".
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(ProcessStat {
        zombie: *fields.first()? == "Z",
        session: fields.get(3)?.parse().ok()?,
        started: fields.get(19)?.parse().ok()?,
    })
}

/// The live processes of `sessions`.
fn members(sessions: &[Session]) -> Vec<libc::pid_t> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<libc::pid_t>().ok())
        .filter(|&pid| {
            process_stat(pid).is_some_and(|stat| {
                !stat.zombie
                    && sessions
                        .iter()
                        .any(|s| s.id == stat.session && stat.started >= s.since)
            })
        })
        .collect()
}

/// Signals every live process of `sessions`, then waits up to `wait` for them to go;
/// whether they did.
fn signal_sessions(sessions: &[Session], signal: libc::c_int, wait: Duration) -> bool {
    for pid in members(sessions) {
        // SAFETY: kill(2) on a pid just read as a member of a test's Ray sessions.
        unsafe { libc::kill(pid, signal) };
    }
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline {
        if members(sessions).is_empty() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    members(sessions).is_empty()
}

/// Ends what is left of the clusters of test processes that are gone (killed before
/// they could stop theirs: a node still starting may outlive its keeper, and Ray's agents
/// their raylet), from the sessions each wrote down, and removes their directories.
fn stop_clusters_of_ended_runs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(CLUSTER_DIR))
            .and_then(|n| n.split('-').next())
            .and_then(|p| p.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // SAFETY: kill with signal 0 only asks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if !gone {
            continue;
        }
        let written = std::fs::read_to_string(entry.path().join("sessions")).unwrap_or_default();
        let sessions: Vec<Session> = written
            .lines()
            .filter_map(|line| {
                let (id, since) = line.split_once(' ')?;
                Some(Session {
                    id: id.parse().ok()?,
                    since: since.parse().ok()?,
                })
            })
            .collect();
        if signal_sessions(&sessions, libc::SIGKILL, Duration::from_secs(10)) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A Ray cluster of two nodes on this machine, stopped when dropped.
struct Cluster {
    /// Ray's temporary directory, and the test's for this cluster: short, as Ray's Unix
    /// sockets are under it.
    dir: PathBuf,
    venv: PathBuf,
    /// The session of each `ray start`: every process Ray starts stays in it.
    sessions: Vec<Session>,
    /// Each node's `ray start --block`, reaped when the cluster stops.
    keepers: Vec<std::process::Child>,
    /// `ip:port` of the head's GCS.
    address: String,
}

impl Cluster {
    /// A head with no GPU and a second node with one, whose processes load the fake
    /// driver as `libcuda.so.1`. With `preload`, the second node is started as
    /// deploy/ray's README starts a node for budgets from Ray's own count: the library in
    /// `LD_PRELOAD` of `ray start`, and [`GPU_GIB`] of the resource `cudabudget_gib`.
    fn start(venv: PathBuf, name: &str, preload: Option<&Path>) -> Cluster {
        stop_clusters_of_ended_runs();
        let dir = std::env::temp_dir().join(format!("{CLUSTER_DIR}{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let mut cluster = Cluster {
            dir,
            venv,
            sessions: Vec::new(),
            keepers: Vec::new(),
            address: String::new(),
        };
        // The second node's driver directory holds libcuda.so.1 only: Ray's start reads
        // the GPU's name through NVML, which the fake libnvidia-ml.so.1 does not have.
        let drivers = cluster.dir.join("node-driver");
        std::fs::create_dir_all(&drivers).unwrap();
        std::os::unix::fs::symlink(crate::util::fake_cuda_lib(), drivers.join("libcuda.so.1"))
            .unwrap();

        let ports = Ports(free_ports());
        let mut head = vec![
            "--head".to_string(),
            "--num-cpus=1".into(),
            "--num-gpus=0".into(),
            "--include-dashboard=false".into(),
        ];
        head.extend(ports.args(0));
        cluster.ray_start("head", &head, &[]);
        cluster.address = std::fs::read_to_string(cluster.dir.join("ray_current_cluster"))
            .expect("the head wrote its address")
            .trim()
            .to_string();
        assert!(
            cluster.address.ends_with(&format!(":{}", ports.gcs())),
            "{}",
            cluster.address
        );

        let mut node = vec![
            format!("--address={}", cluster.address),
            // Each GPU actor holds a CPU while it lives: with a budget's resource, one
            // more for a task beside two.
            format!("--num-cpus={}", if preload.is_some() { 3 } else { 2 }),
            "--num-gpus=1".into(),
        ];
        node.extend(ports.args(1));
        let drivers = drivers.to_str().unwrap().to_string();
        let mut envs = vec![("LD_LIBRARY_PATH", drivers.as_str())];
        if let Some(library) = preload {
            node.push(format!("--resources={{\"cudabudget_gib\": {GPU_GIB}}}"));
            envs.push(("LD_PRELOAD", library.to_str().unwrap()));
        }
        cluster.ray_start("node", &node, &envs);
        cluster
    }

    /// A command of the virtual environment (`python`, `ray`), with an environment free
    /// of budgets, preloads, drivers and Ray settings of the developer's, and the
    /// library's and the user's places in the test's directory.
    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(self.venv.join("bin").join(program));
        for (name, _) in std::env::vars_os() {
            let text = name.to_string_lossy();
            if ["CUDABUDGET_", "CUDA_", "RAY_", "LD_", "PYTHON", "FAKE_"]
                .iter()
                .any(|prefix| text.starts_with(prefix))
            {
                command.env_remove(&name);
            }
        }
        crate::util::isolate(&mut command)
            .env("TMPDIR", &self.dir)
            .env("RAY_USAGE_STATS_ENABLED", "0")
            // A node told to stop (SIGTERM) stops at once, without first asking the GCS
            // to drain it for up to 30 s (the GCS may be gone already).
            .env("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
            .stdin(Stdio::null());
        command
    }

    /// `ray start --block ...` in a session of its own, its output in `<dir>/<name>.log`;
    /// returns once the node has started. It stays as the node's keeper: ended, it ends
    /// the node's processes, and it is ended (SIGTERM) when the thread that started it
    /// goes, so not even a test killed outright leaves a cluster behind.
    fn ray_start(&mut self, name: &str, args: &[String], envs: &[(&str, &str)]) {
        let log_path = self.dir.join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).unwrap();
        std::fs::create_dir_all(self.dir.join("plasma")).unwrap();
        let mut command = self.command("ray");
        command
            .args(["start", "--block"])
            .args(args)
            .arg(format!("--temp-dir={}", self.dir.display()))
            // Ray's objects on disk in the test's directory, not in /dev/shm.
            .arg(format!(
                "--plasma-directory={}",
                self.dir.join("plasma").display()
            ))
            .arg("--object-store-memory=100000000")
            .arg("--disable-usage-stats")
            .envs(envs.iter().copied())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        // SAFETY: getpid before the fork; in the child only async-signal-safe calls
        // (setsid, prctl, getppid) that touch no memory of this process.
        let parent = unsafe { libc::getpid() };
        unsafe {
            command.pre_exec(move || {
                if libc::setsid() == -1
                    || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) == -1
                {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    // The test went before the death signal was set.
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        let mut child = command.spawn().expect("ray start runs");
        let id = child.id() as libc::pid_t;
        let session = Session {
            id,
            since: process_stat(id).map_or(0, |stat| stat.started),
        };
        // Written down for a later run, should this one be killed before it stops them.
        let mut sessions = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("sessions"))
            .unwrap();
        writeln!(sessions, "{} {}", session.id, session.since).unwrap();
        self.sessions.push(session);
        let deadline = Instant::now() + Duration::from_secs(120);
        let problem = loop {
            let output = std::fs::read_to_string(&log_path).unwrap_or_default();
            if output.contains("will now block forever") {
                self.keepers.push(child);
                return;
            }
            if let Some(status) = child.try_wait().unwrap() {
                break format!("{status}");
            }
            if Instant::now() > deadline {
                break "not started in 120 s".to_string();
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        self.keepers.push(child);
        let output = std::fs::read_to_string(&log_path).unwrap_or_default();
        panic!("ray start ({name}): {problem}:\n{output}");
    }

    /// Runs the virtual environment's python with `args`, for at most `limit`; returns
    /// (exit code, stdout, stderr).
    fn python(&self, args: &[&str], limit: Duration) -> (Option<i32>, String, String) {
        let out = self.dir.join("python.out");
        let err = self.dir.join("python.err");
        let mut child = self
            .command("python")
            .args(args)
            .env("RAY_ADDRESS", &self.address)
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("python runs");
        let deadline = Instant::now() + limit;
        let code = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status.code();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let read = |path: &Path| std::fs::read_to_string(path).unwrap_or_default();
        (code, read(&out), read(&err))
    }

    /// Runs the recipe on the cluster with `--lib library` and `args`, for at most 240 s
    /// (it waits 120 s for each report); returns its exit code, its stdout, and both
    /// outputs for a failure's message.
    fn recipe(&self, library: &Path, args: &[&str]) -> (Option<i32>, String, String) {
        let recipe = recipe();
        let mut all = vec![
            recipe.to_str().unwrap(),
            "--address",
            &self.address,
            "--lib",
            library.to_str().unwrap(),
            "--timeout",
            "120",
        ];
        all.extend(args);
        let (code, stdout, stderr) = self.python(&all, Duration::from_secs(240));
        let context = format!("exit {code:?}\n{stdout}\n{stderr}");
        (code, stdout, context)
    }

    /// The nodes the head knows alive, once there are two (or a minute passed):
    /// (node id, whether it is the head, its GPUs).
    fn nodes(&self) -> Vec<(String, bool, f64)> {
        let script = r#"
import json, sys, time
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
deadline = time.monotonic() + 60
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= 2 or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps([[n["NodeID"], "node:__internal_head__" in n["Resources"],
                   n["Resources"].get("GPU", 0)] for n in alive]))
"#;
        let (code, stdout, stderr) =
            self.python(&["-c", script, &self.address], Duration::from_secs(120));
        assert_eq!(code, Some(0), "{stdout}{stderr}");
        let nodes: Vec<(String, bool, f64)> =
            serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
        nodes
    }

    /// Signals every process of the cluster, then waits up to `wait` for them to go;
    /// whether they did.
    fn signal_all(&self, signal: libc::c_int, wait: Duration) -> bool {
        signal_sessions(&self.sessions, signal, wait)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // As `ray stop` does, but to this cluster's processes only: SIGTERM, and SIGKILL
        // to what is left shortly after (the GCS and the raylets take seconds otherwise).
        let gone = self.signal_all(libc::SIGTERM, Duration::from_secs(2))
            || self.signal_all(libc::SIGKILL, Duration::from_secs(10));
        if !gone {
            let _ = writeln!(
                std::io::stderr(),
                "Ray processes left running: {:?}",
                members(&self.sessions)
            );
        }
        for keeper in &mut self.keepers {
            // Gone, it is a zombie until reaped here; otherwise not waited for.
            let _ = if gone {
                keeper.wait().ok()
            } else {
                keeper.try_wait().ok().flatten()
            };
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The actors' reports the recipe printed (its JSON lines), and its verdict lines.
fn reports(stdout: &str) -> (Vec<Value>, Vec<&str>) {
    let reports = stdout
        .lines()
        .filter(|line| line.starts_with('{'))
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    let verdicts = stdout
        .lines()
        .filter(|line| line.starts_with("actor ") || line.starts_with("task "))
        .collect();
    (reports, verdicts)
}

/// Asserts that a report shows a device of `budget` bytes, an allocation that fitted and
/// one past the budget refused with CUDA_ERROR_OUT_OF_MEMORY.
fn assert_held_to(report: &Value, budget: u64, context: &str) {
    assert_eq!(
        report["total"], budget,
        "the device's total is the budget: {context}"
    );
    assert_eq!(report["alloc_fitting_rc"], CUDA_SUCCESS, "{context}");
    assert_eq!(
        report["alloc_over_rc"], CUDA_ERROR_OUT_OF_MEMORY,
        "past the budget: {context}"
    );
}

/// Asserts that the first two reports came from two workers, that the recipe's verdict
/// on every report is "ok" and that it exited 0.
fn assert_all_ok(reports: &[Value], verdicts: &[&str], code: Option<i32>, context: &str) {
    assert_ne!(
        reports[0]["pid"], reports[1]["pid"],
        "a worker each: {context}"
    );
    assert_eq!(verdicts.len(), reports.len(), "{context}");
    assert!(verdicts.iter().all(|v| v.ends_with(": ok")), "{context}");
    assert_eq!(code, Some(0), "{context}");
}

#[test]
fn ray_actors_sharing_one_gpu_on_a_second_node_each_see_and_are_held_to_their_own_budget() {
    let Some(venv) = ray_venv() else { return };
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let cluster = Cluster::start(venv, "budgets", None);

    let nodes = cluster.nodes();
    assert_eq!(nodes.len(), 2, "a head and a second node: {nodes:?}");
    let head = nodes.iter().find(|n| n.1).expect("a head");
    let gpu_node = nodes.iter().find(|n| !n.1).expect("a second node");
    assert_eq!((head.2, gpu_node.2), (0.0, 1.0), "{nodes:?}");

    let library = crate::util::lib_path();
    let (code, stdout, context) = cluster.recipe(&library, &["--budgets", "6Gi", "4Gi"]);
    let (reports, verdicts) = reports(&stdout);
    assert_eq!(reports.len(), 2, "{context}");
    let fake = Path::new(crate::util::fake_cuda_lib())
        .canonicalize()
        .unwrap();
    for (report, budget) in reports.iter().zip([6 * GI, 4 * GI]) {
        // What each actor saw, from inside its own worker process.
        assert_eq!(report["library_mapped"], true, "{context}");
        assert_eq!(report["driver"], serde_json::json!([fake]), "{context}");
        assert_eq!(report["node_id"], gpu_node.0.as_str(), "{context}");
        assert_eq!(report["CUDA_VISIBLE_DEVICES"], "0", "{context}");
        assert_eq!(report["gpu_ids"], serde_json::json!([0]), "{context}");
        assert_held_to(report, budget, &context);
    }
    assert_all_ok(&reports, &verdicts, code, &context);

    drop(cluster);
    let _ = writeln!(
        std::io::stderr(),
        "Ray cluster started, recipe run and cluster stopped in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn ray_actors_refuse_to_start_when_the_library_is_not_at_the_path_the_recipe_names() {
    let Some(venv) = ray_venv() else { return };
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = Cluster::start(venv, "no-library", None);
    let missing = cluster.dir.join("nowhere/libcudabudget.so");
    let (code, stdout, context) = cluster.recipe(&missing, &[]);
    let (reports, verdicts) = reports(&stdout);
    assert_eq!(reports.len(), 2, "{context}");
    for report in &reports {
        let error = report["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("is not loaded in this worker; refusing to run unbudgeted"),
            "{context}"
        );
        assert!(report.get("total").is_none(), "{context}");
    }
    assert_eq!(verdicts.len(), 2, "{context}");
    assert!(
        verdicts.iter().all(|v| v.ends_with(": FAILED")),
        "{context}"
    );
    assert_eq!(code, Some(1), "{context}");
}

/// Installs `deploy/ray`'s `cudabudget_ray.py` and `cudabudget-ray.pth` in the virtual
/// environment's site-packages, as its README tells an admin to install them in the
/// workers' Python. They stay: they do nothing in a process without the library in
/// `LD_PRELOAD`, nor in one started with a budget of its own (the other tests' actors).
fn install_cudabudget_ray(venv: &Path) {
    let out = Command::new(venv.join("bin/python"))
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()
        .expect("python runs");
    assert!(out.status.success(), "{out:?}");
    let site = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    for file in ["cudabudget_ray.py", "cudabudget-ray.pth"] {
        // Whole or not at all for a Python starting meanwhile: written aside, renamed.
        let partial = site.join(format!(".{file}.{}", std::process::id()));
        std::fs::copy(repo().join("deploy/ray").join(file), &partial)
            .unwrap_or_else(|e| panic!("{}: {e}", partial.display()));
        std::fs::rename(&partial, site.join(file)).unwrap();
    }
}

#[test]
fn ray_actors_and_tasks_whose_code_names_no_budget_get_the_share_of_the_gpu_ray_gave_them() {
    let Some(venv) = ray_venv() else { return };
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    install_cudabudget_ray(&venv);
    let library = crate::util::lib_path();
    let cluster = Cluster::start(venv, "shares", Some(&library));
    let nodes = cluster.nodes();
    let gpu_node = nodes.iter().find(|n| !n.1).expect("a second node");

    // Two actors of num_gpus=0.5 and a task of resources={"cudabudget_gib": 20}, none
    // with a budget (or anything of ours) in its options.
    let (code, stdout, context) =
        cluster.recipe(&library, &["--shares", "0.5", "0.5", "--gib", "20"]);
    let (reports, verdicts) = reports(&stdout);
    assert_eq!(reports.len(), 3, "{context}");
    let expected = [
        ("50.00%", GPU_GIB * GI / 2, serde_json::json!([0])),
        ("50.00%", GPU_GIB * GI / 2, serde_json::json!([0])),
        ("20Gi", 20 * GI, serde_json::json!([])),
    ];
    for (report, (limit, total, gpus)) in reports.iter().zip(expected) {
        assert_eq!(report["library_mapped"], true, "{context}");
        assert_eq!(report["node_id"], gpu_node.0.as_str(), "{context}");
        assert_eq!(report["gpu_ids"], gpus, "{context}");
        assert_eq!(report["CUDABUDGET_LIMIT"], limit, "{context}");
        assert_held_to(report, total, &context);
    }
    assert_all_ok(&reports, &verdicts, code, &context);
}

/// Runs `script` with `python3`, `deploy/ray` on its path, the library preloaded when
/// `preload`, and the fake driver's `libcuda.so.1` in `FAKE_CUDA_LIB`; its stdout, asserting it
/// exited 0.
fn python_with_cudabudget_ray(script: &str, preload: bool) -> String {
    let mut command = Command::new("python3");
    crate::util::isolate(&mut command)
        .arg("-c")
        .arg(script)
        .env("PYTHONPATH", repo().join("deploy/ray"))
        .env("FAKE_CUDA_LIB", crate::util::fake_cuda_lib())
        .env_remove("LD_PRELOAD")
        .env_remove("CUDABUDGET_LIMIT");
    if preload {
        command.env("LD_PRELOAD", crate::util::lib_path());
    }
    let out = command.output().expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn a_ray_worker_that_cannot_hold_a_task_to_its_share_refuses_the_task() {
    // The worker's decisions, task after task, in a process like a Ray worker's: the
    // library preloaded, CUDA loaded by the first task's code.
    let script = r#"
import ctypes, os
import cudabudget_ray as m
def refused(budgets, resources, env):
    try:
        budgets.apply(resources, env)
    except RuntimeError as error:
        return str(error)
    return None
fresh, fresh_env = m.Budgets({}), {}
fresh.apply({"GPU": 1.0 / 3}, fresh_env)
print("third:", fresh_env["CUDABUDGET_LIMIT"])
fresh.apply({"GPU": 2}, fresh_env)
print("whole:", fresh_env.get("CUDABUDGET_LIMIT"))
own, own_env = m.Budgets({"CUDABUDGET_LIMIT": "6Gi"}), {"CUDABUDGET_LIMIT": "6Gi"}
own.apply({"GPU": 0.5}, own_env)
print("own:", own_env["CUDABUDGET_LIMIT"])
b, env = m.Budgets({}), {}
b.apply({"GPU": 0.25, "CPU": 1}, env)
print("first:", env.get("CUDABUDGET_LIMIT"))
ctypes.CDLL(os.environ["FAKE_CUDA_LIB"])
print("same:", refused(b, {"GPU": 0.25}, env), env.get("CUDABUDGET_LIMIT"))
print("other:", refused(b, {"GPU": 0.5}, env))
print("gib:", refused(b, {"GPU": 0.25, "cudabudget_gib": 20}, env))
print("none:", refused(b, {"CPU": 1}, env), env.get("CUDABUDGET_LIMIT"))
"#;
    let printed = python_with_cudabudget_ray(script, true);
    let lines: Vec<&str> = printed.lines().collect();
    assert_eq!(lines[0], "third: 33.33%", "{printed}");
    // Nothing loaded CUDA yet: a later task of whole GPUs runs without a budget.
    assert_eq!(lines[1], "whole: None", "{printed}");
    assert_eq!(lines[2], "own: 6Gi", "{printed}");
    assert_eq!(lines[3], "first: 25.00%", "{printed}");
    assert_eq!(lines[4], "same: None 25.00%", "{printed}");
    assert!(
        lines[5].starts_with("other: cudabudget: this task's budget (50.00%) cannot be enforced")
            && lines[5].contains("an earlier task (budget 25.00%)"),
        "{printed}"
    );
    assert!(
        lines[6].starts_with("gib: cudabudget: this task's budget (20Gi)"),
        "{printed}"
    );
    // A task asking for no budget in a process that may have read one: it keeps it.
    assert_eq!(lines[7], "none: None 25.00%", "{printed}");

    // Without the library, a budgeted task is refused.
    let script = r#"
import cudabudget_ray as m
try:
    m.Budgets({}).apply({"GPU": 0.5}, {})
except RuntimeError as error:
    print(error)
"#;
    let printed = python_with_cudabudget_ray(script, false);
    assert!(
        printed.contains("(50.00%) cannot be enforced: libcudabudget.so is not loaded"),
        "{printed}"
    );
}
