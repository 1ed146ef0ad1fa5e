//! `cudabudget doctor`: what a person needs to know when a budget "does not work" here,
//! one check at a time, each ok, warn (works, with a caveat), fail (a budget would not
//! apply; with what to do) or skip (nothing to check without an earlier check).

use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::Duration;

use clap::Args;
use serde::Serialize;
use serde_json::{Value, json};

use crate::library::{self, Library};
use crate::status::bytes;
use cudabudget_cli_common::gpu::{Cuda, CudaDevice, Nvml, cuda_error};
use cudabudget_cli_common::preload::PRELOAD_BEFORE;
use cudabudget_cli_common::records;
use cudabudget_cli_common::tell::{Refusal, outln};
use cudabudget_spec::config;

pub const AFTER_HELP: &str = "Checks, in order: driver (libcuda.so.1 and its version), \
devices, nvml, library (found, and loads when preloaded into a child), glibc (this \
system's against what the library needs), configuration (the budget this environment \
gives each visible device), pid-namespace, runtime-dir (where the records status and \
the exporter read go, and what is in the way), job-ledger (where a job's ledger goes, what is in the way, and \
whether this environment's job ledger is damaged), budgets (whether the budgets on a GPU \
add up to more than it has: a budget is a cap, not a reservation), mps, and interposition (a child under a 64 MiB budget asks for \
256 MiB and must be refused).

Exit status: 0 when nothing failed (warnings included), 1 otherwise; every failed \
check says what to do.

Examples:
  cudabudget doctor
  cudabudget doctor --json";

/// The budget the interposition check gives its child, and what the child asks for.
const PROOF_BUDGET: u64 = 64 << 20;
const PROOF_REQUEST: u64 = 256 << 20;

#[derive(Args)]
pub struct DoctorArgs {
    /// Print one JSON object: {"ok": bool, "checks": [{"name", "status", "summary", "remedy", "details"}]}.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Status {
    Ok,
    Warn,
    Fail,
    Skip,
}

#[derive(Serialize)]
struct Check {
    name: &'static str,
    status: Status,
    summary: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    remedy: Option<String>,
    details: Value,
}

impl Check {
    fn new(name: &'static str, status: Status, summary: impl Into<String>) -> Check {
        Check {
            name,
            status,
            summary: summary.into(),
            remedy: None,
            details: Value::Null,
        }
    }

    fn remedy(mut self, remedy: impl Into<String>) -> Check {
        self.remedy = Some(remedy.into());
        self
    }

    fn details(mut self, details: Value) -> Check {
        self.details = details;
        self
    }
}

/// What the checks found that later checks use.
#[derive(Default)]
struct Found {
    cuda: Option<Cuda>,
    devices: Vec<CudaDevice>,
    library: Option<Library>,
    library_loads: bool,
}

pub fn doctor(args: DoctorArgs) -> Result<ExitCode, Refusal> {
    let mut found = Found::default();
    let nvml = Nvml::open();
    let checks = vec![
        driver(&mut found, nvml.as_ref().ok()),
        devices(&mut found),
        nvml_check(&nvml),
        library_check(&mut found),
        glibc(&found),
        configuration(&found),
        pid_namespace(),
        runtime_dir(),
        job_ledger(),
        budgets(nvml.as_ref().ok()),
        mps(),
        interposition(&found),
    ];
    let failed = checks.iter().filter(|c| c.status == Status::Fail).count();
    if args.json {
        let report = json!({ "ok": failed == 0, "checks": checks });
        outln(format_args!("{report}"))?;
    } else {
        for check in &checks {
            let status = match check.status {
                Status::Ok => "ok",
                Status::Warn => "warn",
                Status::Fail => "FAIL",
                Status::Skip => "skip",
            };
            outln(format_args!(
                "{status:<5} {:<14} {}",
                check.name, check.summary
            ))?;
            if let Some(remedy) = &check.remedy {
                outln(format_args!("{:<20} -> {remedy}", ""))?;
            }
        }
        if failed == 0 {
            outln(format_args!("no problems found"))?;
        } else {
            outln(format_args!("{failed} problem(s):"))?;
            for check in checks.iter().filter(|c| c.status == Status::Fail) {
                outln(format_args!(
                    "  {}: {}; {}",
                    check.name,
                    check.summary,
                    check.remedy.as_deref().unwrap_or("see above")
                ))?;
            }
        }
    }
    Ok(ExitCode::from(if failed == 0 { 0 } else { 1 }))
}

fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// The kernel module's version, from NVML or `/proc/driver/nvidia/version`.
fn kernel_driver(nvml: Option<&Nvml>) -> Option<String> {
    nvml.and_then(Nvml::driver_version).or_else(|| {
        let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
        let line = text.lines().next()?;
        let at = line.find("Kernel Module")? + "Kernel Module".len();
        line[at..].split_whitespace().next().map(str::to_string)
    })
}

fn driver(found: &mut Found, nvml: Option<&Nvml>) -> Check {
    let cuda = match Cuda::open() {
        Ok(cuda) => cuda,
        Err(reason) => {
            return Check::new(
                "driver",
                Status::Fail,
                format!("libcuda.so.1 cannot be opened ({reason})"),
            )
            .remedy(
                "run where the NVIDIA driver is installed; in a container, start it with the \
                 NVIDIA container toolkit (docker --gpus all, or a GPU runtime class) so \
                 libcuda.so.1 is mounted, or add its directory to LD_LIBRARY_PATH",
            );
        }
    };
    let path = cuda.path();
    let version = cuda.driver_version();
    let kernel = kernel_driver(nvml);
    let init = cuda.init();
    let mut summary = format!(
        "libcuda.so.1 at {}",
        path.as_deref().unwrap_or("(unknown path)")
    );
    if let Ok(v) = version {
        summary.push_str(&format!(", CUDA {}", cuda_version(v)));
    }
    if let Some(kernel) = &kernel {
        summary.push_str(&format!(", driver {kernel}"));
    }
    let details = json!({
        "path": path,
        "cuda_version": version.ok(),
        "kernel_driver": kernel,
        "init": init.err().map(cuda_error),
    });
    found.cuda = Some(cuda);
    match init {
        // No device is the next check's business.
        Ok(()) | Err(100) => Check::new("driver", Status::Ok, summary).details(details),
        Err(rc) => Check::new(
            "driver",
            Status::Fail,
            format!("{summary}, but cuInit fails: {}", cuda_error(rc)),
        )
        .remedy(
            "check that the kernel module matches the user-space driver (nvidia-smi), and that \
             the device nodes (/dev/nvidia*) are present and accessible",
        )
        .details(details),
    }
}

fn devices(found: &mut Found) -> Check {
    let Some(cuda) = &found.cuda else {
        return Check::new("devices", Status::Skip, "no driver");
    };
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let devices = match cuda.init().and_then(|()| cuda.devices()) {
        Ok(devices) if !devices.is_empty() => devices,
        Ok(_) | Err(_) => {
            return Check::new(
                "devices",
                Status::Fail,
                match &visible {
                    Some(v) => format!("no CUDA device is visible (CUDA_VISIBLE_DEVICES={v:?})"),
                    None => "no CUDA device is visible".to_string(),
                },
            )
            .remedy(
                "check CUDA_VISIBLE_DEVICES (indices or UUIDs that exist), and that the \
                 container was given a GPU",
            );
        }
    };
    let list: Vec<String> = devices
        .iter()
        .map(|d| {
            format!(
                "{}: {} {} ({})",
                d.ordinal,
                d.name,
                bytes(d.total),
                d.uuid.as_deref().unwrap_or("no UUID")
            )
        })
        .collect();
    let details = json!(devices
        .iter()
        .map(|d| json!({"index": d.ordinal, "name": d.name, "total_bytes": d.total, "uuid": d.uuid}))
        .collect::<Vec<_>>());
    found.devices = devices;
    Check::new("devices", Status::Ok, list.join("; ")).details(details)
}

fn nvml_check(nvml: &Result<Nvml, String>) -> Check {
    match nvml {
        Ok(nvml) => {
            let gpus = nvml.devices();
            Check::new(
                "nvml",
                Status::Ok,
                format!(
                    "libnvidia-ml.so.1 at {}, {} GPU(s)",
                    nvml.path().as_deref().unwrap_or("(unknown path)"),
                    gpus.len()
                ),
            )
            .details(json!({"path": nvml.path(), "gpus": gpus.len()}))
        }
        Err(reason) => Check::new(
            "nvml",
            Status::Warn,
            format!(
                "NVML is not available ({reason}): budgets still hold, but each context is \
                 charged an estimate (CUDABUDGET_CONTEXT_MEMORY), memory no call names is not \
                 reconciled, and status shows no physical figures"
            ),
        )
        .remedy(
            "mount libnvidia-ml.so.1 (NVIDIA_DRIVER_CAPABILITIES=compute,utility in containers)",
        ),
    }
}

fn library_check(found: &mut Found) -> Check {
    let library = match library::find() {
        Ok(library) => library,
        Err(refusal) => {
            return Check::new("library", Status::Fail, refusal.message).remedy(
                "install this CLI and the library together where only you or root can change \
                 them (cudabudget install DIR), or set CUDABUDGET_LIB to such a copy",
            );
        }
    };
    let mut summary = format!("{} ({})", library.path.display(), library.origin.describe());
    if let Some(line) = &library.in_the_way {
        summary = format!("{summary}: {line}");
    }
    let details = json!({"path": library.path, "origin": format!("{:?}", library.origin)});
    let probe = library::probe(library.path.as_os_str(), &library.path);
    found.library = Some(library);
    match probe {
        Ok(()) => {
            found.library_loads = true;
            Check::new("library", Status::Ok, format!("{summary}, loads here")).details(details)
        }
        Err(reason) => Check::new(
            "library",
            Status::Fail,
            format!("{summary} does not load here: {reason}"),
        )
        .remedy(
            "a process started here with it in LD_PRELOAD would run unbudgeted; use a library \
             built for this system (see the glibc check)",
        )
        .details(details),
    }
}

fn glibc(found: &Found) -> Check {
    let running = library::running_glibc();
    let Some(library) = &found.library else {
        return Check::new(
            "glibc",
            Status::Skip,
            format!("glibc {running} here; no library to compare with"),
        );
    };
    let needed = match std::fs::read(&library.path)
        .map_err(|e| e.to_string())
        .and_then(|elf| library::glibc_versions_needed(&elf))
    {
        Ok(needed) => needed,
        Err(reason) => {
            return Check::new(
                "glibc",
                Status::Fail,
                format!(
                    "cannot read what {} needs: {reason}",
                    library.path.display()
                ),
            )
            .remedy("reinstall the library (cudabudget install DIR)");
        }
    };
    let newest = needed.last().cloned();
    let details = json!({"running": running, "needed": needed});
    match newest {
        None => Check::new(
            "glibc",
            Status::Ok,
            format!("glibc {running} here; the library names no glibc version"),
        )
        .details(details),
        Some(newest) if library::glibc_version(&newest) <= library::glibc_version(&running) => {
            Check::new(
                "glibc",
                Status::Ok,
                format!("glibc {running} here; the library needs {newest} at most"),
            )
            .details(details)
        }
        Some(newest) => Check::new(
            "glibc",
            Status::Fail,
            format!("glibc {running} here, but the library needs {newest}"),
        )
        .remedy(
            "use a library built for an older glibc: scripts/dist.sh builds one for glibc 2.17 \
             (dist/libcudabudget.so, also in the Python wheel)",
        )
        .details(details),
    }
}

fn configuration(found: &Found) -> Check {
    let environment: Vec<(OsString, OsString)> = std::env::vars_os().collect();
    let preload = std::env::var_os(PRELOAD_BEFORE).or_else(|| std::env::var_os("LD_PRELOAD"));
    let preloaded = preload.as_ref().is_some_and(|p| {
        let library = found.library.as_ref().map(|l| l.path.as_path());
        p.to_string_lossy()
            .split([':', ' '])
            .filter(|e| !e.is_empty())
            .any(|e| {
                Path::new(e)
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("libcudabudget"))
                    || library.is_some_and(|l| library::same_file(Path::new(e), l))
            })
    });
    let config = match config::Config::from_vars_os(environment) {
        Ok(config) => config,
        Err(error) => {
            return Check::new("configuration", Status::Fail, error.problem()).remedy(
                "fix or unset the variable: a process under the library would get no CUDA",
            );
        }
    };
    if config.is_unbudgeted() {
        return Check::new(
            "configuration",
            Status::Warn,
            "no budget in this environment: a process started here runs unbudgeted unless \
             it is started with `cudabudget run --limit Q` or CUDABUDGET_LIMIT is set",
        )
        .details(json!({"preloaded": preloaded, "devices": []}));
    }
    let source = match config.source {
        config::Source::Hami => "HAMi's CUDA_DEVICE_MEMORY_LIMIT*",
        config::Source::Both => {
            "CUDABUDGET_LIMIT* and HAMi's CUDA_DEVICE_MEMORY_LIMIT* (the smaller on each device)"
        }
        _ => "CUDABUDGET_LIMIT*",
    };
    let mut budgets = Vec::new();
    let mut lines = Vec::new();
    for device in &found.devices {
        let budget = config
            .limit_for(device.ordinal)
            .map(|limit| limit.resolve(device.total));
        lines.push(format!(
            "device {}: {}",
            device.ordinal,
            budget.map_or_else(|| "no budget".to_string(), bytes)
        ));
        budgets.push(json!({"index": device.ordinal, "limit_bytes": budget}));
    }
    if found.devices.is_empty() {
        lines.push(format!(
            "every device: {}",
            match config.limit_for_others() {
                None => "no budget".to_string(),
                Some(limit) => limit.to_string(),
            }
        ));
    }
    let mut summary = format!("budgets from {source}: {}", lines.join(", "));
    summary.push_str(if preloaded {
        "; LD_PRELOAD here loads the library"
    } else {
        "; LD_PRELOAD here does not load the library (use `cudabudget run`)"
    });
    let details = json!({
        "source": source,
        "preloaded": preloaded,
        "devices": budgets,
        "unknown_variables": config.unknown,
    });
    match config.unknown_warning() {
        // The library warns the same way, and runs budgeted.
        Some(warning) => Check::new(
            "configuration",
            Status::Warn,
            format!("{summary}; {warning}"),
        )
        .remedy("unset the variables this release does not know, or fix their names")
        .details(details),
        None => Check::new("configuration", Status::Ok, summary).details(details),
    }
}

/// The inode of the kernel's initial PID namespace (`PROC_PID_INIT_INO`): every other
/// PID namespace has another one.
const INITIAL_PID_NAMESPACE: u64 = 0xEFFF_FFFC;

fn pid_namespace() -> Check {
    let Some(namespace) = records::own_pid_namespace() else {
        return Check::new(
            "pid-namespace",
            Status::Warn,
            "cannot read /proc/self/ns/pid: /proc is not mounted as the library expects",
        )
        .remedy("mount /proc (the library reads its own figures there)");
    };
    if namespace == INITIAL_PID_NAMESPACE {
        return Check::new("pid-namespace", Status::Ok, "the host's PID namespace")
            .details(json!({"nested": false, "namespace": namespace}));
    }
    // NSpid lists the pid in each namespace this /proc can see, outermost first.
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let pids: Vec<&str> = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    let here = pids.last().copied().unwrap_or("?");
    let outside = if pids.len() > 1 {
        format!(", {} outside", pids[0])
    } else {
        String::new()
    };
    Check::new(
        "pid-namespace",
        Status::Ok,
        format!(
            "in a PID namespace (a container; pid {here} here{outside}): NVML lists the host's \
             pids, and the library finds its own entry by its first context"
        ),
    )
    .details(json!({"nested": true, "namespace": namespace, "pids": pids}))
}

/// Where this environment's budgeted processes publish their records: the user's own
/// directory under the first runtime root that gives one, found as the library's record
/// writer finds it (`src/tell/publish.rs`: [`place::first_private`] over the
/// configuration's `runtime_dirs`, a missing fallback root made 0700), what another user
/// put in the way, and whether root's `status` and the exporter look where the records
/// went instead.
fn runtime_dir() -> Check {
    use cudabudget_spec::place::{self, Access, Create, FileOpen, PlaceError};
    let roots = records::runtime_dirs();
    let (mut dir, mut in_the_way) = place::first_private(&roots, 0o700);
    if dir.is_none() && roots.iter().skip(1).any(|root| !root.exists()) {
        for root in roots.iter().skip(1).filter(|root| !root.exists()) {
            use std::os::unix::fs::DirBuilderExt;
            let _ = std::fs::DirBuilder::new().mode(0o700).create(root);
        }
        (dir, in_the_way) = place::first_private(&roots, 0o700);
    }
    let me = records::euid();
    let name = place::user_dir_name(me);
    // The name in the first root is held by something not ours: root's scan looks for
    // our records in our own places instead (`records::scan`).
    let displaced = match (roots.first().map(std::fs::canonicalize), in_the_way.first()) {
        (Some(Ok(root)), Some(error)) => {
            !matches!(error, PlaceError::Io { .. }) && error.path() == root.join(&name)
        }
        _ => false,
    };
    let words: Vec<String> = in_the_way.iter().map(ToString::to_string).collect();
    let Some(dir) = dir else {
        return Check::new(
            "runtime-dir",
            Status::Fail,
            format!(
                "no place for records ({}): `cudabudget status` and the exporter will not see \
                 processes started here",
                words.join("; ")
            ),
        )
        .remedy(
            "give the container a writable /dev/shm, remove what is in the way (another \
             user's file or directory), or set CUDABUDGET_RUNTIME_DIR, XDG_RUNTIME_DIR or \
             HOME to a directory of your own",
        )
        .details(json!({"roots": roots, "in_the_way": words}));
    };
    let details = json!({"dir": dir.path(), "in_the_way": words});
    // The library writes a new file and renames it: a directory it may not write (a
    // read-only mount) takes no record.
    const PROBE: FileOpen = FileOpen {
        access: Access::ReadWrite,
        create: Create::New,
        mode: 0o600,
    };
    let probe = format!(".doctor-{}", std::process::id());
    let written = dir.open_file(&probe, PROBE).and_then(|file| {
        drop(file);
        dir.remove_file(&probe).map_err(|error| PlaceError::Io {
            path: dir.path().join(&probe),
            error,
        })
    });
    if let Err(error) = written {
        return Check::new(
            "runtime-dir",
            Status::Fail,
            format!(
                "{} cannot hold records ({error}): `cudabudget status` and the exporter will \
                 not see processes started here",
                dir.path().display()
            ),
        )
        .remedy(
            "give the container a writable /dev/shm, or set CUDABUDGET_RUNTIME_DIR to a \
             directory the processes can write",
        )
        .details(details);
    }
    if words.is_empty() {
        return Check::new(
            "runtime-dir",
            Status::Ok,
            format!(
                "records go to {}: `cudabudget status` and the exporter read them there",
                dir.path().display()
            ),
        )
        .details(details);
    }
    // Root's scan reads every name of a user's in the first root, and looks in
    // /run/user/<uid> and <home>/.cache for a displaced user.
    let parent = dir.path().parent().map(Path::to_path_buf);
    let first_root = roots
        .first()
        .and_then(|root| std::fs::canonicalize(root).ok());
    let root_looks = (parent.is_some() && parent == first_root)
        || displaced
            && [
                Some(std::path::PathBuf::from(format!("/run/user/{me}"))),
                records::passwd(me).map(|(_, home)| home.join(".cache")),
            ]
            .into_iter()
            .flatten()
            .filter_map(|place| std::fs::canonicalize(place).ok())
            .any(|place| Some(&place) == parent.as_ref());
    let readers = if root_looks {
        "your `cudabudget status` finds them there, and root's status and the exporter \
         look there too"
            .to_string()
    } else if me == 0 {
        "your `cudabudget status` finds them there, but the exporter (and a status run \
         with another environment) does not look there"
            .to_string()
    } else {
        format!(
            "your `cudabudget status` finds them there, but root's status and the exporter \
             do not look there (they look in /run/user/{me} and your home's .cache)"
        )
    };
    Check::new(
        "runtime-dir",
        Status::Warn,
        format!(
            "records go to {} instead ({}): {readers}",
            dir.path().display(),
            words.join("; ")
        ),
    )
    .remedy(
        "remove what is in the way (another user's file or directory; root can), or set \
         CUDABUDGET_RUNTIME_DIR to a directory of your own",
    )
    .details(details)
}

/// Whether the budgets on each GPU (of the processes this user, or root, can see) add up
/// to more than the GPU has: a budget is a cap, not a reservation, so over-committed
/// processes can meet the card's own out-of-memory below their budgets.
fn budgets(nvml: Option<&Nvml>) -> Check {
    let Some(nvml) = nvml else {
        return Check::new(
            "budgets",
            Status::Skip,
            "no NVML: the GPUs' sizes are unknown",
        );
    };
    let status = cudabudget_cli_common::figures::collect(Some(nvml));
    let gpus = status.gpus.unwrap_or_default();
    let over: Vec<String> = gpus
        .iter()
        .filter(|g| g.overcommitted)
        .map(|g| {
            format!(
                "GPU {} ({}): budgets add up to {} of its {}",
                g.index,
                g.uuid.as_deref().unwrap_or("no UUID"),
                crate::status::bytes(g.budgets_bytes),
                crate::status::bytes(g.total_bytes)
            )
        })
        .collect();
    let details = json!({"gpus": gpus.iter().map(|g| json!({
        "index": g.index, "uuid": g.uuid, "total_bytes": g.total_bytes,
        "budgets_bytes": g.budgets_bytes, "overcommitted": g.overcommitted,
    })).collect::<Vec<_>>()});
    if over.is_empty() {
        return Check::new(
            "budgets",
            Status::Ok,
            format!(
                "the budgets on each of {} GPU(s) fit in it (processes this user can see)",
                gpus.len()
            ),
        )
        .details(details);
    }
    Check::new(
        "budgets",
        Status::Warn,
        format!("over-committed: {}", over.join("; ")),
    )
    .remedy(
        "lower budgets (cudabudget limit) or place jobs elsewhere; let the scheduler count \
         GPU memory (the device plugin, Slurm's gpumem, Ray's fractions)",
    )
    .details(details)
}

/// Where a job's ledger goes (the user's own directory under the first job root that
/// gives one), what another user put in the way, and, when this environment names a
/// job, whether its ledger is whole.
fn job_ledger() -> Check {
    use cudabudget_spec::job_file;
    use cudabudget_spec::place::{self, FileOpen, PlaceError};
    let Ok(config) = config::Config::from_vars_os(std::env::vars_os()) else {
        return Check::new(
            "job-ledger",
            Status::Skip,
            "the configuration does not parse",
        );
    };
    let (dir, in_the_way) = place::first_private(&config.job_dirs, 0o700);
    let in_the_way: Vec<String> = in_the_way.iter().map(ToString::to_string).collect();
    let Some(dir) = dir else {
        return Check::new(
            "job-ledger",
            Status::Warn,
            format!(
                "no place for a job's ledger ({}): a job's processes would get no CUDA",
                in_the_way.join("; ")
            ),
        )
        .remedy(
            "remove what is in the way (another user's file or directory), or set \
             CUDABUDGET_JOB_DIR to a directory only you or root can write",
        )
        .details(json!({"in_the_way": in_the_way}));
    };
    let details = json!({"dir": dir.path(), "in_the_way": in_the_way});
    let moved = if in_the_way.is_empty() {
        String::new()
    } else {
        format!(" ({} in the way)", in_the_way.join("; "))
    };
    let config::Scope::Job(name) = &config.scope else {
        return Check::new(
            "job-ledger",
            if in_the_way.is_empty() {
                Status::Ok
            } else {
                Status::Warn
            },
            format!("job ledgers go in {}{moved}", dir.path().display()),
        )
        .details(details);
    };
    let file_name = format!("job-{name}");
    let path = dir.path().join(&file_name);
    let problem = match dir.open_file(&file_name, FileOpen::READ) {
        Ok(file) => {
            use std::os::unix::fs::FileExt;
            let mut head = [0u8; job_file::HEADER_BYTES];
            let len = file.metadata().map(|m| m.len()).unwrap_or(0);
            let n = file.read_at(&mut head, 0).unwrap_or(0);
            job_file::problem(&head[..n], len)
        }
        Err(PlaceError::Io { error, .. }) if error.kind() == std::io::ErrorKind::NotFound => {
            return Check::new(
                "job-ledger",
                if in_the_way.is_empty() {
                    Status::Ok
                } else {
                    Status::Warn
                },
                format!(
                    "job {name}'s ledger will be {} (no member yet){moved}",
                    path.display()
                ),
            )
            .details(details);
        }
        Err(error) => Some(error.to_string()),
    };
    match problem {
        None => Check::new(
            "job-ledger",
            if in_the_way.is_empty() {
                Status::Ok
            } else {
                Status::Warn
            },
            format!("job {name}'s ledger {} is whole{moved}", path.display()),
        )
        .details(details),
        Some(why) => Check::new(
            "job-ledger",
            Status::Fail,
            format!(
                "job ledger {} is damaged or not a ledger ({why}): the job's members refuse \
                 new allocations and new processes of the job get no CUDA",
                path.display()
            ),
        )
        .remedy("remove the file once the job's processes have ended")
        .details(details),
    }
}

fn mps() -> Check {
    let pipes = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| OsString::from("/tmp/nvidia-mps"));
    let control = Path::new(&pipes).join("control");
    let socket = std::fs::metadata(&control).is_ok();
    let daemons: Vec<String> = std::fs::read_dir("/proc")
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .bytes()
                        .all(|b| b.is_ascii_digit())
                })
                .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
                .map(|comm| comm.trim().to_string())
                .filter(|comm| comm.starts_with("nvidia-cuda-mps"))
                .collect()
        })
        .unwrap_or_default();
    if !socket && daemons.is_empty() {
        return Check::new("mps", Status::Ok, "no MPS server");
    }
    Check::new(
        "mps",
        Status::Warn,
        format!(
            "an MPS server is present ({}): CUDA processes here are MPS clients; cudabudget \
             budgets each client process, and MPS's own limits apply besides (not measured \
             under MPS yet)",
            if socket {
                format!("control pipe {}", control.display())
            } else {
                daemons.join(", ")
            }
        ),
    )
    .details(json!({"pipe_directory": pipes.to_string_lossy(), "processes": daemons}))
}

fn interposition(found: &Found) -> Check {
    let (Some(library), true) = (&found.library, found.library_loads) else {
        return Check::new("interposition", Status::Skip, "no library that loads here");
    };
    if found.devices.is_empty() {
        return Check::new("interposition", Status::Skip, "no device to allocate on");
    }
    let Ok(exe) = std::env::current_exe() else {
        return Check::new("interposition", Status::Skip, "cannot find this binary");
    };
    let mut command = Command::new(exe);
    // This environment's own budget variables would change the proof: the child gets
    // only the proof's. Where it keeps its record stays this environment's choice.
    for (name, _) in std::env::vars_os() {
        let text = name.to_string_lossy();
        let place = text == config::RUNTIME_DIR || text == config::JOB_DIR;
        if !place
            && (text.starts_with("CUDABUDGET_") || text.starts_with("CUDA_DEVICE_MEMORY_LIMIT"))
        {
            command.env_remove(&name);
        }
    }
    command
        .args(["__probe-alloc", "--request", &PROOF_REQUEST.to_string()])
        .env("LD_PRELOAD", &library.path)
        .env(config::LIMIT, PROOF_BUDGET.to_string())
        .env(config::LOG, "warn");
    let output = match library::output_within(command, Duration::from_secs(60)) {
        Ok(output) => output,
        Err(e) => {
            return Check::new(
                "interposition",
                Status::Fail,
                format!("cannot start the child that proves it: {e}"),
            )
            .remedy("run doctor where it can start processes");
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let field = |key: &str| -> Option<i64> {
        stdout
            .split_whitespace()
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
    };
    let (alloc, total) = (field("alloc"), field("total"));
    let denied_line = stderr.lines().any(|l| l.contains("denied"));
    let details = json!({
        "budget_bytes": PROOF_BUDGET,
        "request_bytes": PROOF_REQUEST,
        "alloc_rc": alloc,
        "total_bytes": total,
        "child_stdout": stdout.trim(),
        "child_stderr": stderr.trim(),
    });
    let proved = alloc == Some(2) && total.is_some_and(|t| t as u64 <= PROOF_BUDGET) && denied_line;
    if proved {
        return Check::new(
            "interposition",
            Status::Ok,
            format!(
                "a child under a {} budget was refused {} (CUDA_ERROR_OUT_OF_MEMORY) and saw a \
                 {} device",
                bytes(PROOF_BUDGET),
                bytes(PROOF_REQUEST),
                bytes(total.unwrap_or(0) as u64)
            ),
        )
        .details(details);
    }
    let what = match (alloc, field("init")) {
        (Some(0), _) => format!(
            "a child under a {} budget was given {}: the library did not interpose",
            bytes(PROOF_BUDGET),
            bytes(PROOF_REQUEST)
        ),
        (Some(rc), _) => format!(
            "a child under a {} budget got {} for {}, not the library's refusal",
            bytes(PROOF_BUDGET),
            cuda_error(rc as i32),
            bytes(PROOF_REQUEST)
        ),
        (None, Some(rc)) => format!(
            "the child under the library could not start CUDA: {}",
            cuda_error(rc as i32)
        ),
        (None, None) => format!("the child under the library failed ({})", output.status),
    };
    Check::new("interposition", Status::Fail, what)
        .remedy(
            "make sure LD_PRELOAD reaches the process (setuid programs and static binaries \
             ignore it) and that no other library interposes dlsym before it; the child's \
             output is in `doctor --json`",
        )
        .details(details)
}
