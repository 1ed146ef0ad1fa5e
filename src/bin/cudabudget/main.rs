//! The `cudabudget` command line: `run` validates a budget, preloads the library and
//! `exec`s the job.
//!
//! This binary must never link the library crate: the library exports `dlsym` and the
//! driver's names, which would interpose on the CLI itself. The pure modules it needs
//! are compiled in from their source files instead. Everything that can be wrong is
//! checked before `exec`, so a bad option or a bad inherited variable fails here with
//! exit 2 and the job never starts unbudgeted.

#[allow(dead_code)]
#[path = "../quantity.rs"]
mod quantity;

#[allow(dead_code)]
#[path = "../config.rs"]
mod config;

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use clap::{Args, Parser, Subcommand};

const LIBRARY_NAME: &str = "libcudabudget.so";
const QUANTITY_EXAMPLES: &str = "examples: 20Gi, 512Mi, 8GB, 40%";
/// Usage errors, as clap reports its own.
const EXIT_USAGE: u8 = 2;
/// The command could not be started, as shells report it.
const EXIT_CANNOT_RUN: u8 = 127;

#[derive(Parser)]
#[command(
    name = "cudabudget",
    version,
    about = "Hard device-memory budgets for CUDA jobs",
    after_help = "Examples:
  cudabudget run --limit 20Gi -- python train.py
  cudabudget run --limit 40% --limit-device 1=8Gi -- ./serve
  CUDABUDGET_LIMIT=512Mi cudabudget run -- ./notebook.sh"
)]
struct Cli {
    #[command(subcommand)]
    command: Subcommands,
}

#[derive(Subcommand)]
enum Subcommands {
    /// Run a command under a device-memory budget.
    #[command(
        after_help = "Quantities: bytes, Ki Mi Gi Ti (1024^n), k M G T (1000^n), \
KiB/kB spellings of the same units, or a percentage of the device (40%).

The budget is handed to CMD through LD_PRELOAD and CUDABUDGET_* variables; \
CUDABUDGET_LIB names the library when it is not next to this binary.

Examples:
  cudabudget run --limit 20Gi -- python train.py
  cudabudget run --limit 8GB --limit-device 0=40% -- ./a.out
  cudabudget run --limit-device 1=4Gi -- python serve.py"
    )]
    Run(RunArgs),
}

#[derive(Args)]
struct RunArgs {
    /// Budget for every device: bytes, 20Gi, 512Mi, 8GB or 40%.
    #[arg(long, value_name = "Q")]
    limit: Option<String>,

    /// Budget for device ordinal N (as CMD numbers devices); overrides --limit there.
    #[arg(long = "limit-device", value_name = "N=Q")]
    limit_device: Vec<String>,

    /// Who shares the budget: "process" (the default).
    #[arg(long, value_name = "S")]
    scope: Option<String>,

    /// What a refused allocation does: "fail" (the default).
    #[arg(long = "on-exceed", value_name = "P")]
    on_exceed: Option<String>,

    /// The command to run, and its arguments.
    #[arg(
        value_name = "CMD",
        required = true,
        num_args = 1..,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    command: Vec<OsString>,
}

/// A refusal the user must act on: printed as one line, then the exit status.
struct Refusal {
    message: String,
    status: u8,
}

fn usage(message: String) -> Refusal {
    Refusal {
        message,
        status: EXIT_USAGE,
    }
}

fn main() -> ExitCode {
    let Subcommands::Run(args) = Cli::parse().command;
    // `run` only returns when something went wrong: on success it became CMD.
    let refusal = run(args);
    eprintln!("cudabudget: {}", refusal.message);
    ExitCode::from(refusal.status)
}

fn run(args: RunArgs) -> Refusal {
    let variables = match budget_variables(&args) {
        Ok(variables) => variables,
        Err(refusal) => return refusal,
    };
    let library = match find_library() {
        Ok(library) => library,
        Err(refusal) => return refusal,
    };
    let inherited: Vec<(OsString, OsString)> = std::env::vars_os().collect();
    let preload = preload_value(&library, lookup(&inherited, "LD_PRELOAD"));

    let mut environment = inherited;
    for (name, value) in variables
        .iter()
        .map(|(n, v)| (OsStr::new(n), OsStr::new(v)))
        .chain([(OsStr::new("LD_PRELOAD"), preload.as_os_str())])
    {
        environment.retain(|(n, _)| n != name);
        environment.push((name.to_os_string(), value.to_os_string()));
    }

    // The child reads exactly this environment, so whatever the library would refuse
    // (a bad inherited CUDABUDGET_LOG, say) is refused here, before CMD starts.
    match config::Config::from_vars_os(environment) {
        Err(error) => return usage(format!("{}; nothing was run", error.problem())),
        Ok(config) if config.is_unbudgeted() => {
            return usage(
                "no budget given: pass --limit Q or --limit-device N=Q \
                 (e.g. --limit 20Gi), or set CUDABUDGET_LIMIT; nothing was run"
                    .to_string(),
            );
        }
        Ok(_) => {}
    }

    let (program, program_args) = match args.command.split_first() {
        Some(split) => split,
        None => return usage("no command given after --".to_string()),
    };
    let mut command = Command::new(program);
    command.args(program_args).env("LD_PRELOAD", &preload);
    for (name, value) in &variables {
        command.env(name, value);
    }
    let error = command.exec();
    Refusal {
        message: format!("cannot run {:?}: {error}", program.to_string_lossy()),
        status: EXIT_CANNOT_RUN,
    }
}

/// The CUDABUDGET_* variables the options ask for, each validated by the same code
/// the library will use to read it.
fn budget_variables(args: &RunArgs) -> Result<Vec<(String, String)>, Refusal> {
    let mut variables = Vec::new();
    if let Some(quantity) = &args.limit {
        check_quantity("--limit", quantity)?;
        variables.push((config::LIMIT.to_string(), quantity.clone()));
    }
    let mut devices = Vec::new();
    for option in &args.limit_device {
        let Some((ordinal, quantity)) = option.split_once('=') else {
            return Err(usage(format!(
                "--limit-device {option:?}: expected N=Q, a device ordinal and a quantity \
                 (e.g. --limit-device 1=8Gi)"
            )));
        };
        let Some(device) = config::parse_ordinal(ordinal) else {
            return Err(usage(format!(
                "--limit-device {option:?}: {ordinal:?} is not a device ordinal \
                 (0..={}, as the command numbers its devices)",
                config::MAX_ORDINAL
            )));
        };
        if devices.contains(&device) {
            return Err(usage(format!(
                "--limit-device {option:?}: device {device} is given more than once"
            )));
        }
        check_quantity("--limit-device", quantity)?;
        devices.push(device);
        variables.push((format!("{}_{device}", config::LIMIT), quantity.to_string()));
    }
    if let Some(scope) = &args.scope {
        config::validate_scope(scope)
            .map_err(|reason| usage(format!("--scope {scope:?}: {reason}")))?;
        variables.push((config::SCOPE.to_string(), scope.clone()));
    }
    if let Some(policy) = &args.on_exceed {
        config::validate_on_exceed(policy)
            .map_err(|reason| usage(format!("--on-exceed {policy:?}: {reason}")))?;
        variables.push((config::ON_EXCEED.to_string(), policy.clone()));
    }
    Ok(variables)
}

fn check_quantity(option: &str, quantity: &str) -> Result<(), Refusal> {
    quantity::parse_limit(quantity)
        .map(drop)
        .map_err(|e| usage(format!("{option} {quantity:?}: {e} ({QUANTITY_EXAMPLES})")))
}

/// The library to preload, as an absolute path: `$CUDABUDGET_LIB`, else the one next
/// to this binary (where `cargo build` and the install layout put it).
fn find_library() -> Result<PathBuf, Refusal> {
    let library = match std::env::var_os(config::LIB) {
        Some(path) => std::fs::canonicalize(&path)
            .ok()
            .filter(|p| p.is_file())
            .ok_or_else(|| {
                usage(format!(
                    "{}={:?} does not name an existing file; point it at {LIBRARY_NAME} \
                     or unset it to use the one next to this binary",
                    config::LIB,
                    path.to_string_lossy()
                ))
            })?,
        None => {
            let dir = std::env::current_exe()
                .ok()
                .and_then(|exe| exe.parent().map(Path::to_path_buf));
            let Some(dir) = dir else {
                return Err(usage(format!(
                    "cannot find {LIBRARY_NAME}: this binary's location is unknown; \
                     set {} to the library's path",
                    config::LIB
                )));
            };
            beside_binary(&dir).ok_or_else(|| {
                usage(format!(
                    "cannot find {LIBRARY_NAME}: looked in {:?} (next to this binary); \
                     build it with `cargo build` or set {} to its path",
                    dir.display().to_string(),
                    config::LIB
                ))
            })?
        }
    };
    // ld.so splits LD_PRELOAD at ':' and spaces; such a path cannot be expressed.
    if library
        .as_os_str()
        .as_bytes()
        .iter()
        .any(|b| b" :\t\n".contains(b))
    {
        return Err(usage(format!(
            "{:?} contains ':' or whitespace, which LD_PRELOAD cannot carry; \
             install the library under a plainer path",
            library.display().to_string()
        )));
    }
    Ok(library)
}

/// The library installed next to the binary in `dir`, canonical.
fn beside_binary(dir: &Path) -> Option<PathBuf> {
    let path = std::fs::canonicalize(dir.join(LIBRARY_NAME)).ok()?;
    std::fs::metadata(&path)
        .ok()
        .filter(|m| m.is_file())
        .map(|_| path)
}

fn lookup<'a>(environment: &'a [(OsString, OsString)], name: &str) -> Option<&'a OsStr> {
    environment
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_os_str())
}

/// Whether two paths name one file, through symlinks and hard links (cargo hard-links
/// the library it copies next to the binary).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// `library` first (so its hooks see the process before anything else preloaded),
/// then whatever was preloaded already; not added twice.
fn preload_value(library: &Path, existing: Option<&OsStr>) -> OsString {
    let existing = existing.filter(|e| !e.as_bytes().iter().all(u8::is_ascii_whitespace));
    let Some(existing) = existing else {
        return library.as_os_str().to_os_string();
    };
    let already = existing
        .as_bytes()
        .split(|b| b" :\t\n".contains(b))
        .filter(|entry| !entry.is_empty())
        .any(|entry| {
            let entry = Path::new(OsStr::from_bytes(entry));
            entry == library || same_file(entry, library)
        });
    if already {
        return existing.to_os_string();
    }
    let mut value = library.as_os_str().to_os_string();
    value.push(":");
    value.push(existing);
    value
}
