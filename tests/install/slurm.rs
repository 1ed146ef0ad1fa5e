//! The Slurm recipe (`deploy/slurm`), run under a real Slurm: Debian's `slurmctld` and
//! `slurmd` on this machine as one node, authenticated by their own `munged`, all three
//! configured and started by the test in a temporary directory and stopped by it on every
//! way out (a guard's `Drop` also ends every process the cluster started: the steps'
//! daemons and the jobs' programs).
//!
//! The node is set up as the recipe's README tells an admin: `TaskProlog=` the recipe's
//! `taskprolog.sh` installed with `INSTALL_DIR` pointed at this build's CLI and library,
//! one GPU cut into 16 shards (`gres.conf`: `Name=gpu` and `Name=shard` on a character
//! device numbered as `/dev/nvidia0` is, 195:0; Slurm refuses a plain file). The fake
//! driver of `tests/fake_driver` (an 80 GiB card) stands in for `libcuda.so.1`, found
//! through the `LD_LIBRARY_PATH` the jobs are submitted with, and
//! `tests/install/slurm/probe.py` stands in for the PyTorch and JAX programs the sbatch
//! files start: it is placed where they are, so the sbatch files are submitted unchanged,
//! as an unprivileged user (Slurm runs the prolog and the tasks as that user).
//!
//! Skipped (with a printed reason) without root, without `slurmctld`, `slurmd`, `munged`
//! and the Slurm client commands, without a `python3` the jobs' user can run (in
//! `/usr/bin`), or where a device file cannot be made; with CB_REQUIRE_SLURM=1 (CI, which
//! installs them: `.ci/run`) any of these fails the test instead.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::util::tenants::{Tenants, User, as_user};

const CLI: &str = env!("CARGO_BIN_EXE_cudabudget");
const GI: u64 = 1 << 30;
/// What every job may take, in all: start to end, the jobs run in a few seconds.
const JOBS_TIMEOUT: Duration = Duration::from_secs(180);
/// Where the node's programs are found: Debian puts the daemons in /usr/sbin.
const SYSTEM_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The node's count GRES `gpumem`: GiB of its one GPU's memory that jobs may ask for (an
/// H200's 141 GiB less a reserve), and the fake driver's card of that size in the jobs
/// that use it.
const GPUMEM_GIB: u64 = 140;
/// One cluster at a time: they share this machine's cores and the node's name.
static ONE_CLUSTER: Mutex<()> = Mutex::new(());

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The programs the test needs, found on [`SYSTEM_PATH`].
struct Programs {
    munged: PathBuf,
    slurmctld: PathBuf,
    slurmd: PathBuf,
    sbatch: PathBuf,
    scontrol: PathBuf,
    sinfo: PathBuf,
    squeue: PathBuf,
}

fn find(name: &str, path: &str) -> Option<PathBuf> {
    std::env::split_paths(path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// The programs, or the reason the test cannot run (printed, or a failure under
/// CB_REQUIRE_SLURM=1).
fn programs() -> Result<Programs, String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("running slurmctld, slurmd and munged for a test needs root".into());
    }
    let mut missing = Vec::new();
    let mut get = |name: &str| {
        find(name, SYSTEM_PATH).unwrap_or_else(|| {
            missing.push(name.to_owned());
            PathBuf::new()
        })
    };
    let programs = Programs {
        munged: get("munged"),
        slurmctld: get("slurmctld"),
        slurmd: get("slurmd"),
        sbatch: get("sbatch"),
        scontrol: get("scontrol"),
        sinfo: get("sinfo"),
        squeue: get("squeue"),
    };
    // The jobs' programs run as another user, who cannot reach a Python under /root.
    if find("python3", "/usr/local/bin:/usr/bin:/bin").is_none() {
        missing.push("python3 (in /usr/local/bin, /usr/bin or /bin)".into());
    }
    if missing.is_empty() {
        Ok(programs)
    } else {
        Err(format!(
            "{} not installed (Debian: apt-get install slurmctld slurmd munge)",
            missing.join(", ")
        ))
    }
}

fn required() -> bool {
    std::env::var("CB_REQUIRE_SLURM").as_deref() == Ok("1")
}

/// Says why the test does not run: a failure when CI requires Slurm, else a printed skip.
fn cannot_run(reason: &str) {
    assert!(!required(), "CB_REQUIRE_SLURM=1: {reason}");
    crate::util::skip(reason);
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn mkdir(path: &Path, mode: u32) -> PathBuf {
    std::fs::create_dir_all(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    path.to_path_buf()
}

fn write(path: &Path, contents: impl AsRef<[u8]>, mode: u32) {
    std::fs::write(path, contents).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// `from` at `to`, mode 0755: a hard link where possible (never open for writing, so no
/// ETXTBSY when it is executed while another test thread forks), else a copy.
fn place(from: &Path, to: &Path) {
    crate::util::place(from, to);
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Two different TCP ports nobody listens on now.
fn free_ports() -> (u16, u16) {
    let listen = || std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let (a, b) = (listen(), listen());
    let port = |l: &std::net::TcpListener| l.local_addr().expect("its address").port();
    (port(&a), port(&b))
}

/// The node's name as slurmd and slurmctld find it: the host name up to its first dot.
fn short_hostname() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("the host name");
    name.trim().split('.').next().unwrap().to_owned()
}

/// The pids of the processes whose environment holds `marker` (`NAME=value`) exactly,
/// but this one.
fn processes_with(marker: &str) -> Vec<libc::pid_t> {
    let me = std::process::id() as libc::pid_t;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<libc::pid_t>().ok())
        .filter(|pid| *pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|environ| {
                environ
                    .split(|b| *b == 0)
                    .any(|variable| variable == marker.as_bytes())
            })
        })
        .collect()
}

fn signal(pid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: kill has no memory preconditions; the pid is one of the cluster's processes.
    unsafe { libc::kill(pid, signal) };
}

/// Ends a child: SIGTERM, then SIGKILL if it is still there after `grace`.
fn stop(child: &mut Child, grace: Duration) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    signal(child.id() as libc::pid_t, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A one-node Slurm cluster in a directory of its own. Dropping it ends its daemons and
/// every process they started (the step daemons and the jobs' programs, found by the
/// `SLURM_CONF` they all inherit, which names this cluster's own file).
struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
    programs: Programs,
    munged: Option<Child>,
    slurmctld: Option<Child>,
    slurmd: Option<Child>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in [self.slurmd.as_mut(), self.slurmctld.as_mut()]
            .into_iter()
            .flatten()
        {
            stop(child, Duration::from_secs(10));
        }
        // What outlives the daemons (a step daemon, a job's program): killed until none is
        // left, as one may start another while it goes.
        let marker = self.marker();
        for _ in 0..50 {
            let left = processes_with(&marker);
            if left.is_empty() {
                break;
            }
            for pid in left {
                signal(pid, libc::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if let Some(munged) = self.munged.as_mut() {
            stop(munged, Duration::from_secs(10));
        }
    }
}

impl Cluster {
    /// Where the node has cudabudget (the recipe's `/opt/cudabudget`): in a directory no
    /// other user can write, all the way from `/` (`cudabudget run` preloads nothing
    /// from under `/tmp`), and not in the cluster's own, whose sockets need a short path.
    fn install(&self) -> PathBuf {
        crate::util::closed_binary_dir().join("slurm-opt-cudabudget")
    }

    fn marker(&self) -> String {
        format!("SLURM_CONF={}", self.conf.display())
    }

    /// A command for one of the cluster's programs, as root, with nothing of the test's
    /// environment but what Slurm needs.
    fn command(&self, program: &Path) -> Command {
        let mut command = Command::new(program);
        command
            .env_clear()
            .env("PATH", SYSTEM_PATH)
            .env("SLURM_CONF", &self.conf)
            .current_dir(&self.dir)
            .stdin(Stdio::null());
        command
    }

    fn start(&self, program: &Path, args: &[&str], log: &str) -> Child {
        let log = self.dir.join("log").join(log);
        let out = std::fs::File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        self.command(program)
            .args(args)
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", program.display()))
    }

    fn output(&self, program: &Path, args: &[&str]) -> Output {
        self.command(program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{}: {e}", program.display()))
    }

    /// Every log of the cluster (daemons' files and what they printed), for a failure's
    /// message.
    fn logs(&self) -> String {
        let mut all = String::new();
        if let Ok(entries) = std::fs::read_dir(self.dir.join("log")) {
            let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
            paths.sort();
            for path in paths {
                let contents = std::fs::read_to_string(&path).unwrap_or_default();
                let lines: Vec<&str> = contents.lines().collect();
                let tail = &lines[lines.len().saturating_sub(40)..];
                all += &format!("--- {} ---\n{}\n", path.display(), tail.join("\n"));
            }
        }
        all
    }

    /// Panics, with the logs, when a daemon has exited.
    fn assert_running(&mut self) {
        let mut exited = Vec::new();
        for (name, child) in [
            ("munged", self.munged.as_mut()),
            ("slurmctld", self.slurmctld.as_mut()),
            ("slurmd", self.slurmd.as_mut()),
        ] {
            if let Some(Ok(Some(status))) = child.map(Child::try_wait) {
                exited.push(format!("{name} exited ({status})"));
            }
        }
        assert!(exited.is_empty(), "{}\n{}", exited.join(", "), self.logs());
    }

    /// Waits until `done` says yes, at most `timeout`, while the daemons run; a failure
    /// names `what` and shows the logs.
    fn wait_for(&mut self, what: &str, timeout: Duration, mut done: impl FnMut(&Self) -> bool) {
        let deadline = Instant::now() + timeout;
        while !done(self) {
            self.assert_running();
            assert!(
                Instant::now() < deadline,
                "{what}: not after {timeout:?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// `slurm.conf` for one node, `host`, with everything in `dir`: one GPU of 16 shards and
/// [`GPUMEM_GIB`] of the count GRES `gpumem`, the recipe's TaskProlog, and no accounting, cgroups or MPI (none is needed to run a step).
/// The node says it has 16 CPUs whatever this machine has (`config_overrides`), so the
/// sbatch files' `--cpus-per-task` fit and jobs can run side by side.
fn slurm_conf(dir: &Path, host: &str, ports: (u16, u16), prolog: &Path) -> String {
    let d = dir.display();
    format!(
        "ClusterName=cudabudget-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/state/slurmctld.pid
SlurmdPidFile={d}/spool/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
GresTypes=gpu,shard,gpumem
TaskProlog={prolog}
NodeName={host} NodeAddr=127.0.0.1 CPUs=16 Gres=gpu:1,shard:16,gpumem:{GPUMEM_GIB} State=UNKNOWN
PartitionName=gpus Nodes={host} Default=YES MaxTime=INFINITE State=UP
",
        ctld = ports.0,
        slurmd = ports.1,
        prolog = prolog.display(),
    )
}

/// Lays out a node in a fresh directory and starts munged, slurmctld and slurmd on it:
/// this build's CLI and library installed in its `opt-cudabudget` ([`Cluster::install`]),
/// the TaskProlog with its `INSTALL_DIR` pointing there. `Err`: this machine cannot make
/// the fake GPU's device file.
fn boot(programs: Programs, name: &str) -> Result<Cluster, String> {
    let dir = crate::util::binary_dir().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    mkdir(&dir, 0o755);
    let mut cluster = Cluster {
        conf: dir.join("etc/slurm.conf"),
        dir: dir.clone(),
        programs,
        munged: None,
        slurmctld: None,
        slurmd: None,
    };
    for (name, mode) in [
        ("etc", 0o755),
        ("log", 0o755),
        ("state", 0o700),
        ("spool", 0o755),
    ] {
        mkdir(&dir.join(name), mode);
    }

    // The GPU: a character device numbered as the first NVIDIA card's.
    let device = mkdir(&dir.join("dev"), 0o755).join("nvidia0");
    let made = Command::new("mknod")
        .args(["-m", "0666"])
        .arg(&device)
        .args(["c", "195", "0"])
        .output()
        .map_err(|e| format!("mknod: {e}"))?;
    if !made.status.success() {
        return Err(format!(
            "cannot make the fake GPU's device file: {}",
            text(&made.stderr).trim()
        ));
    }
    write(
        &dir.join("etc/gres.conf"),
        format!(
            "Name=gpu File={0}\nName=shard Count=16 File={0}\nName=gpumem Count={GPUMEM_GIB}\n",
            device.display()
        ),
        0o644,
    );

    let install = mkdir(&cluster.install(), 0o755);
    place(Path::new(CLI), &install.join("cudabudget"));
    place(&crate::util::lib_path(), &install.join("libcudabudget.so"));
    // The TaskProlog as the README installs it, its site setting edited.
    let original = std::fs::read_to_string(repo().join("deploy/slurm/taskprolog.sh")).unwrap();
    let setting = "INSTALL_DIR=/opt/cudabudget\n";
    assert!(original.contains(setting), "the site setting moved");
    let prolog = dir.join("etc/cudabudget-taskprolog.sh");
    write(
        &prolog,
        original.replace(setting, &format!("INSTALL_DIR={}\n", install.display())),
        0o755,
    );
    let ports = free_ports();
    write(
        &cluster.conf,
        slurm_conf(&dir, &short_hostname(), ports, &prolog),
        0o644,
    );

    // munged with a key of its own; its socket's directory must be open to all.
    let munge = mkdir(&dir.join("munge"), 0o755);
    let mut key = [0; 128];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").unwrap(), &mut key)
        .expect("random bytes for munge's key");
    write(&munge.join("munge.key"), key, 0o600);
    let socket = munge.join("munge.socket");
    let munge_arg = |flag: &str, name: &str| format!("--{flag}={}", munge.join(name).display());
    cluster.munged = Some(cluster.start(
        &cluster.programs.munged,
        &[
            "--foreground",
            &munge_arg("key-file", "munge.key"),
            &munge_arg("socket", "munge.socket"),
            &munge_arg("pid-file", "munged.pid"),
            &munge_arg("seed-file", "munged.seed"),
            &format!("--log-file={}", dir.join("log/munged.log").display()),
        ],
        "munged.out",
    ));
    cluster.wait_for("munged's socket", Duration::from_secs(30), |_| {
        socket.exists()
    });

    cluster.slurmctld = Some(cluster.start(&cluster.programs.slurmctld, &["-D"], "slurmctld.out"));
    cluster.slurmd = Some(cluster.start(&cluster.programs.slurmd, &["-D"], "slurmd.out"));
    cluster.wait_for("the node idle", Duration::from_secs(60), |cluster| {
        let out = cluster.output(&cluster.programs.sinfo, &["-h", "-N", "-o", "%T"]);
        text(&out.stdout).trim() == "idle"
    });
    Ok(cluster)
}

/// A batch job: its id, and the file its output goes to (the sbatch files'
/// `--output=%x-%j.out`, in the directory it was submitted from).
struct Job {
    id: String,
    output: PathBuf,
}

impl Job {
    /// Asserts that the job ended `COMPLETED` with exit code 0, as `ended` says.
    fn assert_completed(&self, ended: &BTreeMap<String, (String, String)>) {
        let completed = (String::from("COMPLETED"), String::from("0:0"));
        assert_eq!(
            ended[&self.id],
            completed,
            "job {}\n{}",
            self.id,
            self.output()
        );
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.output).unwrap_or_default()
    }

    /// The `key=value` words of the line the stand-in program `name` printed.
    fn probe(&self, name: &str) -> BTreeMap<String, String> {
        let output = self.output();
        let prefix = format!("{name}: ");
        let line = output
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap_or_else(|| panic!("job {}: {name} printed nothing\n{output}", self.id));
        line.split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    /// Asserts that the stand-in program `name` saw a device of `budget` bytes, held its
    /// working set of `held` bytes, and was refused one allocation past what was left
    /// with CUDA_ERROR_OUT_OF_MEMORY (where the 80 GiB card had room for it), while the
    /// other program it was to meet ran too.
    fn assert_budgeted(&self, name: &str, budget: u64, held: u64) {
        let probe = self.probe(name);
        let expected: BTreeMap<String, String> = [
            ("total", budget.to_string()),
            ("held", "0".into()),
            ("left", (budget - held).to_string()),
            ("past", "2".into()),
            ("met", "1".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        assert_eq!(
            probe,
            expected,
            "job {}: {name}\n{}",
            self.id,
            self.output()
        );
    }
}

impl Cluster {
    /// `sbatch --parsable args...` as `user`, from `dir`, in an environment of the user's
    /// own (see [`as_user`]) with this cluster's `SLURM_CONF`, `LD_LIBRARY_PATH` at the fake
    /// driver, and `envs`. `name` is the job's name in the sbatch file.
    fn submit(
        &self,
        (tenants, user): (&Tenants, &User),
        dir: &Path,
        args: &[&str],
        envs: &[(&str, &str)],
        name: &str,
    ) -> Job {
        let fake_driver = tenants.share_dir(Path::new(crate::util::fake_dir()));
        // The jobs' records and ledgers stay in the test's directory, not the machine's
        // /dev/shm (sbatch hands the submitter's environment to the job).
        let places = dir_for(&dir.join("cudabudget-places"), user);
        let mut args = args.to_vec();
        args.insert(0, "--parsable");
        let out = as_user(tenants, user, &self.programs.sbatch, &args)
            .current_dir(dir)
            .env("SLURM_CONF", &self.conf)
            .env("LD_LIBRARY_PATH", fake_driver)
            .env("CUDABUDGET_RUNTIME_DIR", &places)
            .env("CUDABUDGET_JOB_DIR", &places)
            .envs(envs.iter().copied())
            .output()
            .expect("sbatch runs");
        assert!(
            out.status.success(),
            "sbatch {args:?}: {}{}\n{}",
            text(&out.stdout),
            text(&out.stderr),
            self.logs()
        );
        let stdout = text(&out.stdout);
        let id = stdout.trim().split(';').next().unwrap().to_owned();
        assert!(
            !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()),
            "sbatch printed {stdout:?}"
        );
        Job {
            output: dir.join(format!("{name}-{id}.out")),
            id,
        }
    }

    /// The job's `JobState` and `ExitCode` once it has ended; `None` while it has not.
    fn ended(&self, job: &Job) -> Option<(String, String)> {
        let out = self.output(&self.programs.scontrol, &["-o", "show", "job", &job.id]);
        let shown = text(&out.stdout);
        let field = |name: &str| {
            shown
                .split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .map(str::to_owned)
        };
        let state = field("JobState=")?;
        let running = [
            "PENDING",
            "CONFIGURING",
            "RUNNING",
            "COMPLETING",
            "SUSPENDED",
            "REQUEUED",
            "RESIZING",
        ];
        (!running.contains(&state.as_str()))
            .then(|| (state, field("ExitCode=").unwrap_or_default()))
    }
}

/// Copies `from` to `to` for `user` to read.
fn copy_for(from: &Path, to: &Path, user: &User) {
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("{} -> {}: {e}", from.display(), to.display()));
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::os::unix::fs::chown(to, Some(user.uid), Some(user.gid)).unwrap();
}

fn dir_for(path: &Path, user: &User) -> PathBuf {
    mkdir(path, 0o755);
    std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid)).unwrap();
    path.to_path_buf()
}

/// The cluster a test runs its jobs on, in `binary_dir()/<name>`, the only one while the
/// guard is held, and the tenants whose `alice` submits them; `None` after saying why
/// the test cannot run ([`cannot_run`]).
fn start(
    name: &str,
) -> Option<(
    &'static Tenants,
    std::sync::MutexGuard<'static, ()>,
    Cluster,
)> {
    let programs = match programs() {
        Ok(programs) => programs,
        Err(reason) => {
            cannot_run(&reason);
            return None;
        }
    };
    let Some(tenants) = Tenants::get() else {
        cannot_run("the jobs run as an unprivileged user, who cannot be made here");
        return None;
    };
    let one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    match boot(programs, name) {
        Ok(cluster) => Some((tenants, one, cluster)),
        Err(reason) => {
            cannot_run(&reason);
            None
        }
    }
}

/// The directory the user submits from, laid out as the repository the sbatch files
/// name: the recipe's `files`, and the stand-in in place of each program they start.
fn submit_dir(cluster: &Cluster, user: &User, files: &[&str]) -> PathBuf {
    let submit = dir_for(&cluster.dir.join("submit"), user);
    dir_for(&submit.join("deploy"), user);
    let slurm = dir_for(&submit.join("deploy/slurm"), user);
    let compose = dir_for(&submit.join("deploy/compose"), user);
    for file in files {
        copy_for(
            &repo().join("deploy/slurm").join(file),
            &slurm.join(file),
            user,
        );
    }
    let probe = repo().join("tests/install/slurm/probe.py");
    for program in ["trainer.py", "jax_service.py"] {
        copy_for(&probe, &compose.join(program), user);
    }
    submit
}

#[test]
fn jobs_submitted_with_the_recipes_sbatch_files_each_see_their_own_budget_and_are_refused_past_it()
{
    let Some((tenants, _one, mut cluster)) = start("slurm") else {
        return;
    };
    let user = &tenants.alice;

    let submit = submit_dir(&cluster, user, &["sharded.sbatch", "shared-gpu.sbatch"]);
    // The programs of two jobs meet (both hold their memory at once), and so do those of
    // the two steps of the shared-GPU job.
    let meet = |name: &str| format!("{}:2", dir_for(&submit.join(name), user).display());
    let (shards_meet, steps_meet) = (meet("meet-shards"), meet("meet-steps"));

    let who = (tenants, user);
    let sharded = "deploy/slurm/sharded.sbatch";
    // 4 shards, as the file asks, and 6 by sbatch's own option: 32Gi and 48Gi.
    let four = cluster.submit(
        who,
        &submit,
        &[sharded],
        &[("CB_PROBE_MEET", &shards_meet)],
        "cudabudget-sharded",
    );
    let six = cluster.submit(
        who,
        &submit,
        &["--gres=shard:6", sharded],
        &[("CB_PROBE_MEET", &shards_meet)],
        "cudabudget-sharded",
    );
    // One GPU, two steps: 40Gi and 60Gi.
    let steps = cluster.submit(
        who,
        &submit,
        &["deploy/slurm/shared-gpu.sbatch"],
        &[("CB_PROBE_MEET", &steps_meet)],
        "cudabudget-shared-gpu",
    );
    // A budget that cannot be enforced as asked (an invalid log level): not started.
    let invalid = cluster.submit(
        who,
        &submit,
        &["--gres=shard:2", sharded],
        &[("CUDABUDGET_LOG", "loud")],
        "cudabudget-sharded",
    );

    let ended = cluster.wait_ended(&[&four, &six, &steps, &invalid]);
    let completed = (String::from("COMPLETED"), String::from("0:0"));
    for job in [&four, &six, &steps] {
        assert_eq!(
            ended[&job.id],
            completed,
            "job {}\n{}",
            job.id,
            job.output()
        );
    }

    // Each shard job: its budget from its shards, the library preloaded, and its program
    // held to it (a working set of 24 GiB, as the file asks).
    let library = cluster.install().join("libcudabudget.so");
    for (job, gib) in [(&four, 32), (&six, 48)] {
        let expected = format!("budget: {gib}Gi, preloaded: {}", library.display());
        assert!(
            job.output().lines().any(|l| l == expected),
            "job {}: no line {expected:?}\n{}",
            job.id,
            job.output()
        );
        job.assert_budgeted("trainer", gib * GI, 24 * GI);
    }
    // The two steps side by side, each under the budget it was started with.
    steps.assert_budgeted("jax_service", 40 * GI, GI);
    steps.assert_budgeted("trainer", 60 * GI, 50 * GI);

    // The refused job: the prolog's reason in its output, its programs never run.
    let (state, _) = &ended[&invalid.id];
    let output = invalid.output();
    assert_eq!(state, "FAILED", "job {}\n{output}", invalid.id);
    assert!(
        output
            .lines()
            .any(|l| l.starts_with("cudabudget TaskProlog: ")
                && l.contains("CUDABUDGET_LOG")
                && l.ends_with("the task was not started")),
        "job {}\n{output}",
        invalid.id
    );
    for ran in ["budget: ", "trainer: "] {
        assert!(
            !output.lines().any(|l| l.starts_with(ran)),
            "job {}\n{output}",
            invalid.id
        );
    }
    drop(cluster);
}

impl Cluster {
    /// The job's state and squeue's reason for it (`PENDING`, `Resources`).
    fn queued(&self, job: &Job) -> (String, String) {
        let out = self.output(&self.programs.squeue, &["-h", "-j", &job.id, "-o", "%T %r"]);
        let shown = text(&out.stdout);
        let (state, reason) = shown.trim().split_once(' ').unwrap_or((shown.trim(), ""));
        (state.to_owned(), reason.to_owned())
    }

    /// Waits until every job has ended; their `JobState` and `ExitCode` by id.
    fn wait_ended(&mut self, jobs: &[&Job]) -> BTreeMap<String, (String, String)> {
        let mut ended = BTreeMap::new();
        self.wait_for("every job ended", JOBS_TIMEOUT, |cluster| {
            for job in jobs {
                if !ended.contains_key(&job.id)
                    && let Some(end) = cluster.ended(job)
                {
                    ended.insert(job.id.clone(), end);
                }
            }
            ended.len() == jobs.len()
        });
        ended
    }
}

#[test]
fn jobs_asking_for_gpumem_get_it_as_their_budget_and_slurm_never_packs_more_than_the_card() {
    let Some((tenants, _one, mut cluster)) = start("slurm-gpumem") else {
        return;
    };
    let user = &tenants.alice;
    let submit = submit_dir(&cluster, user, &["gpumem.sbatch"]);
    let who = (tenants, user);
    let card = (GPUMEM_GIB * GI).to_string();
    let gpumem = "deploy/slurm/gpumem.sbatch";
    let name = "cudabudget-gpumem";

    // 20 GiB as the file asks, twice at once (40 of 140), the second job setting its own
    // budget of 1Ti: the allocation is the budget.
    let together = format!("{}:2", dir_for(&submit.join("meet-20"), user).display());
    let meet = [
        ("CB_PROBE_MEET", together.as_str()),
        ("FAKE_CUDA_MEM", &card),
    ];
    let plain = cluster.submit(who, &submit, &[gpumem], &meet, name);
    let mut own = meet.to_vec();
    own.push(("CUDABUDGET_LIMIT", "1Ti"));
    let raised = cluster.submit(who, &submit, &[gpumem], &own, name);
    let ended = cluster.wait_ended(&[&plain, &raised]);
    let library = cluster.install().join("libcudabudget.so");
    let expected = format!("budget: 20Gi, preloaded: {}", library.display());
    for job in [&plain, &raised] {
        job.assert_completed(&ended);
        assert!(
            job.output().lines().any(|l| l == expected),
            "job {}: no line {expected:?}\n{}",
            job.id,
            job.output()
        );
        // A working set of 12 GiB, as the file asks; refused past 20 on a 140 GiB card.
        job.assert_budgeted("trainer", 20 * GI, 12 * GI);
    }

    // A step asking for part of its job's gpumem (srun --gres) gets that part; the batch
    // script, the job's.
    let show = r#"echo "$0: ${CUDABUDGET_LIMIT:-none} ${CUDABUDGET_SCOPE:-none}""#;
    let script = format!("bash -c '{show}' batch; srun --gres=gpumem:8 bash -c '{show}' step");
    let parts = cluster.submit(
        who,
        &submit,
        &[
            "--gres=gpumem:20",
            "--output=parts-%j.out",
            "--wrap",
            &script,
        ],
        &[],
        "parts",
    );
    let ended = cluster.wait_ended(&[&parts]);
    parts.assert_completed(&ended);
    let id = &parts.id;
    assert_eq!(
        parts.output(),
        format!("batch: 20Gi job:slurm-{id}.batch\nstep: 8Gi job:slurm-{id}.0\n"),
        "job {id}"
    );

    // Two jobs of 100: the second waits for the node's gpumem while the first runs (its
    // program holds its memory until the test lets it go), then runs with its 100 GiB.
    let hold = dir_for(&submit.join("hold"), user);
    let held = format!("{}:2", hold.display());
    let alone = format!("{}:1", dir_for(&submit.join("alone"), user).display());
    let big = ["--gres=gpumem:100", gpumem];
    let first = cluster.submit(
        who,
        &submit,
        &big,
        &[("CB_PROBE_MEET", &held), ("FAKE_CUDA_MEM", &card)],
        name,
    );
    let second = cluster.submit(
        who,
        &submit,
        &big,
        &[("CB_PROBE_MEET", &alone), ("FAKE_CUDA_MEM", &card)],
        name,
    );
    let holding = |_: &Cluster| std::fs::read_dir(&hold).is_ok_and(|d| d.count() == 1);
    cluster.wait_for(
        "the first job's program holding its memory",
        JOBS_TIMEOUT,
        holding,
    );
    cluster.wait_for(
        "the second job pending for resources",
        JOBS_TIMEOUT,
        |cluster| {
            let queued = cluster.queued(&second);
            assert_eq!(queued.0, "PENDING", "job {}: {queued:?}", second.id);
            queued.1 == "Resources"
        },
    );
    assert_eq!(cluster.queued(&first).0, "RUNNING");
    // The first job's program goes on.
    write(&hold.join("go"), "", 0o644);
    let ended = cluster.wait_ended(&[&first, &second]);
    for job in [&first, &second] {
        job.assert_completed(&ended);
        job.assert_budgeted("trainer", 100 * GI, 12 * GI);
    }
    drop(cluster);
}
