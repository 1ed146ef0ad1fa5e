//! `cudabudget run`: validates the budget, checks that the library loads here, puts it in
//! front of `LD_PRELOAD` and `exec`s the command.
//!
//! Exit status, as `docker run` has it, so that the command's own status is never
//! mistaken for `run`'s: 125 for every failure of `run` itself (usage errors included:
//! nothing ran), 126 when the command cannot be executed, 127 when it is not found;
//! otherwise the process became the command and its status is the command's.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use clap::Args;

use crate::library;
use cudabudget_cli_common::tell::{
    EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND, Refusal, ZERO_BUDGET, say, usage,
};
use cudabudget_spec::{config, quantity};

/// `run`'s own failures, bad options and usage included: the command did not run.
pub const EXIT_RUN_FAILED: u8 = 125;

const QUANTITY_EXAMPLES: &str = "examples: 20Gi, 512Mi, 8GB, 40%";

pub const AFTER_HELP: &str = "Quantities: bytes, Ki Mi Gi Ti Pi Ei (1024^n), k M G T P E \
(1000^n), KiB/kB spellings of the same units, fractions (1.5Gi), or a percentage of the \
device (40%).

The command starts after `--` or at the first argument that is not an option; a \
mistyped option is an error, never the command.

The budget is handed to CMD through LD_PRELOAD and CUDABUDGET_* variables. The library \
is $CUDABUDGET_LIB, else the libcudabudget.so next to this binary, else the copy this \
binary carries (written once to a per-user cache directory: the first of \
$XDG_CACHE_HOME, $HOME/.cache, $XDG_RUNTIME_DIR and $TMPDIR that no other user can \
change; one line says what was in the way). CMD is not started when the library would \
not load here (run `cudabudget doctor` to see why), nor when another user could change \
it or any directory above it, sticky or not (nothing under /tmp, /var/tmp or /dev/shm).

Exit status: 125 when `run` itself fails (a bad or missing option, a budget the library \
would refuse, no library that can be preloaded here): CMD did not run; 126 when CMD \
cannot be executed; 127 when CMD is not found; otherwise CMD's own status.

Examples:
  cudabudget run --limit 20Gi -- python train.py
  cudabudget run --limit 8GB --limit-device 0=40% -- ./a.out
  cudabudget run --limit-device 1=4Gi -- python serve.py
  cudabudget run --limit 40Gi --scope job:train -- torchrun --nproc-per-node 2 train.py
  cudabudget run --limit 20Gi --on-exceed wait:30s -- python infer.py
  cudabudget run --limit 20Gi --on-exceed warn -- python train.py   # measure, enforce later";

#[derive(Args)]
pub struct RunArgs {
    /// Budget for every device: bytes, 20Gi, 512Mi, 8GB or 40%.
    // A value that starts with '-' is the budget's (`--limit -1G` is refused as negative,
    // not taken for an option).
    #[arg(long, value_name = "Q", allow_hyphen_values = true)]
    limit: Option<String>,

    /// Budget for device ordinal N (as CMD numbers devices); overrides --limit there.
    #[arg(long = "limit-device", value_name = "N=Q", allow_hyphen_values = true)]
    limit_device: Vec<String>,

    /// Who shares the budget: "process" (the default: this process alone) or
    /// "job:<name>" (every process of yours that names the job shares one budget per
    /// device; name: 1 to 64 letters, digits, '.', '_' or '-').
    #[arg(long, value_name = "S")]
    scope: Option<String>,

    /// What an allocation past the budget does: "fail" (the default:
    /// CUDA_ERROR_OUT_OF_MEMORY), "wait:<duration>" (wait that long for room, then fail;
    /// e.g. wait:30s, wait:500ms, wait:2m) or "warn" (admit it, but log it, count it in
    /// cudabudget_overruns_total and write the event: to measure before enforcing).
    #[arg(long = "on-exceed", value_name = "P")]
    on_exceed: Option<String>,

    /// The command to run, and its arguments.
    #[arg(
        value_name = "CMD",
        required = true,
        num_args = 1..,
        trailing_var_arg = true
    )]
    command: Vec<OsString>,
}

/// Whether the command line `args` (this program's, its name first) asks for `run`:
/// its usage errors exit [`EXIT_RUN_FAILED`], not clap's 2. The top level has no
/// option that takes a value, so the subcommand is the first argument.
pub fn asked_for(mut args: impl Iterator<Item = OsString>) -> bool {
    args.nth(1).is_some_and(|first| first == "run")
}

/// Only returns when something went wrong: on success the process became CMD.
pub fn run(args: RunArgs) -> Refusal {
    let mut refusal = refusal(args);
    // Whatever stopped `run` before the exec (its own checks, the library's place)
    // is `run`'s failure; only the exec's own errors say something about CMD.
    if refusal.status != EXIT_CANNOT_EXECUTE && refusal.status != EXIT_NOT_FOUND {
        refusal.status = EXIT_RUN_FAILED;
    }
    refusal
}

fn refusal(args: RunArgs) -> Refusal {
    let variables = match budget_variables(&args) {
        Ok(variables) => variables,
        Err(refusal) => return refusal,
    };
    let library = match library::find() {
        Ok(library) => library,
        Err(refusal) => return refusal,
    };
    if let Some(line) = &library.in_the_way {
        say(line);
    }
    let inherited: Vec<(OsString, OsString)> = std::env::vars_os().collect();
    let preload = preload_value(&library.path, lookup(&inherited, "LD_PRELOAD"));

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
                 (e.g. --limit 20Gi), or set CUDABUDGET_LIMIT; nothing was run",
            );
        }
        Ok(config) => {
            if let Some(variable) = zero_budget(&config) {
                return usage(format!("{variable}=0: {}; nothing was run", zero_for_run()));
            }
            if let Some(warning) = below_a_context(&config, &variables) {
                say(warning);
            }
            // Beside a budget an unknown name is ignored (a newer release's, or a typo
            // of something that was meant): said here, before CMD, once.
            if let Some(warning) = config.unknown_warning() {
                say(warning);
            }
        }
    }

    // The loader only warns about a preload it cannot load and runs the program
    // without it: that would be the job, unbudgeted. Try it on a child first.
    if let Err(reason) = library::probe(&preload, &library.path) {
        return usage(format!(
            "{} cannot be loaded here ({reason}); nothing was run. \
             `cudabudget doctor` says more; a library built for this system's glibc \
             (or an older one) is needed",
            library.path.display()
        ));
    }

    let (program, program_args) = match args.command.split_first() {
        Some(split) => split,
        None => return usage("no command given after --"),
    };
    let mut command = Command::new(program);
    command.args(program_args).env("LD_PRELOAD", &preload);
    for (name, value) in &variables {
        command.env(name, value);
    }
    let error = command.exec();
    Refusal {
        message: format!("cannot run {:?}: {error}", program.to_string_lossy()),
        status: match error.kind() {
            std::io::ErrorKind::NotFound => EXIT_NOT_FOUND,
            _ => EXIT_CANNOT_EXECUTE,
        },
    }
}

/// The CUDABUDGET_* variables the options ask for, each validated by the same code
/// the library will use to read it.
fn budget_variables(args: &RunArgs) -> Result<Vec<(String, String)>, Refusal> {
    let mut variables = Vec::new();
    if let Some(quantity) = &args.limit {
        value_given("--limit", quantity, "20Gi")?;
        check_quantity("--limit", quantity, quantity)?;
        variables.push((config::LIMIT.to_string(), quantity.clone()));
    }
    let mut devices = Vec::new();
    for option in &args.limit_device {
        value_given("--limit-device", option, "1=8Gi")?;
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
        check_quantity("--limit-device", option, quantity)?;
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

/// Whether `option` was given a value: the budget options take one that starts with '-'
/// (so that `--limit -1G` is refused as negative, not taken for an option), so an option
/// in its place (`--limit --scope …`) means the value was left out.
fn value_given(option: &str, value: &str, example: &str) -> Result<(), Refusal> {
    if value.starts_with("--") {
        return Err(usage(format!(
            "{option} needs a value before {value:?} (e.g. {option} {example})"
        )));
    }
    Ok(())
}

/// `quantity`, the value of `option` as given (`given`: all of it, `1=8Gi` for
/// `--limit-device`), if it is a budget `run` accepts.
fn check_quantity(option: &str, given: &str, quantity: &str) -> Result<(), Refusal> {
    match quantity::parse_limit(quantity) {
        Ok(quantity::Limit::Bytes(0)) => {
            Err(usage(format!("{option} {given:?}: {}", zero_for_run())))
        }
        Ok(_) => Ok(()),
        Err(e) => Err(usage(format!(
            "{option} {given:?}: {e} ({QUANTITY_EXAMPLES})"
        ))),
    }
}

/// `run`'s refusal of a budget of 0 bytes ([`ZERO_BUDGET`]), and what to do instead.
fn zero_for_run() -> String {
    format!("{ZERO_BUDGET}; give a size such as 8Gi, or leave the budget out to run unbudgeted")
}

/// The budget variable that sets a budget of 0 bytes, if one does.
fn zero_budget(config: &config::Config) -> Option<String> {
    if config.default_limit == Some(quantity::Limit::Bytes(0)) {
        return Some(config::LIMIT.to_string());
    }
    config
        .device_limits
        .iter()
        .find(|(_, limit)| *limit == quantity::Limit::Bytes(0))
        .map(|(device, _)| format!("{}_{device}", config::LIMIT))
}

/// Less than any CUDA context takes (about 518 MiB on an H200 with lazy loading, 300
/// MiB or more on smaller cards): a budget under it refuses the first allocations.
const SMALLEST_CONTEXT: u64 = 256 << 20;

/// A warning for a budget in bytes smaller than a context: the context alone (charged
/// at its creation) leaves nothing, so the command's first allocations are refused. A
/// warning, not a refusal: a command may mean to show exactly that.
/// The budget is named as the user gave it: the option (`--limit "100Mi"`) when `run`'s
/// own `from_options` set its variable, else the inherited variable.
fn below_a_context(config: &config::Config, from_options: &[(String, String)]) -> Option<String> {
    let small = |limit: &quantity::Limit| matches!(limit, quantity::Limit::Bytes(b) if *b < SMALLEST_CONTEXT);
    let (variable, device) = if config.default_limit.as_ref().is_some_and(small) {
        (config::LIMIT.to_string(), None)
    } else {
        let (device, _) = config.device_limits.iter().find(|(_, l)| small(l))?;
        (format!("{}_{device}", config::LIMIT), Some(*device))
    };
    let named = match (
        from_options.iter().find(|(name, _)| *name == variable),
        device,
    ) {
        (None, _) => variable,
        (Some((_, value)), None) => format!("--limit {value:?}"),
        (Some((_, value)), Some(device)) => {
            format!("--limit-device {:?}", format!("{device}={value}"))
        }
    };
    Some(format!(
        "{named} is less than a CUDA context takes (0.5 GiB on an H200; the context is \
         charged to the budget): the command's first allocations will be refused"
    ))
}

fn lookup<'a>(environment: &'a [(OsString, OsString)], name: &str) -> Option<&'a OsStr> {
    environment
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_os_str())
}

/// `library` first (so its hooks see the process before anything else preloaded),
/// then whatever was preloaded already; not added twice.
pub fn preload_value(library: &Path, existing: Option<&OsStr>) -> OsString {
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
            entry == library || library::same_file(entry, library)
        });
    if already {
        return existing.to_os_string();
    }
    let mut value = library.as_os_str().to_os_string();
    value.push(":");
    value.push(existing);
    value
}
