//! The `cudabudget` command line: `run` a command under a budget, see the budgeted
//! processes (`status`, `exporter`), find out why a budget does not apply (`doctor`),
//! and place the library for an image (`install`).
//!
//! This binary must never link the library crate: the library exports `dlsym` and the
//! driver's names, which would interpose on the CLI itself. What it shares with the
//! library (quantities, configuration, the record layout, shared places) is the
//! `cudabudget-spec` crate. Everything that can be wrong with `run` is checked before `exec`, so
//! a bad option or a bad inherited variable fails here and the job never starts
//! unbudgeted.

mod doctor;
mod exporter;
mod gpu;
mod http;
mod install;
mod library;
mod limit;
mod probe;
mod records;
mod run;
mod status;
mod tell;
mod tls;
mod webhook;

use std::process::ExitCode;
use std::sync::LazyLock;

use clap::{Parser, Subcommand};

use tell::{EXIT_USAGE, say};

/// The commit this binary was built from: `CB_BUILD_COMMIT` at build time (a build
/// from a source archive), else what git says about the checkout cargo built.
const COMMIT: &str = match option_env!("CB_BUILD_COMMIT") {
    Some(commit) => commit,
    None => git_version::git_version!(
        args = [
            "--always",
            "--dirty=-modified",
            "--abbrev=12",
            "--exclude=*"
        ],
        fallback = ""
    ),
};

/// "0.1.0 (commit 1a2b3c4d5e6f)".
static VERSION: LazyLock<String> = LazyLock::new(|| {
    let commit = if COMMIT.is_empty() { "unknown" } else { COMMIT };
    format!("{} (commit {commit})", env!("CARGO_PKG_VERSION"))
});

#[derive(Parser)]
#[command(
    name = "cudabudget",
    version = VERSION.as_str(),
    about = "Hard device-memory budgets for CUDA jobs",
    after_help = "Examples:
  cudabudget run --limit 20Gi -- python train.py
  cudabudget run --limit 40% --limit-device 1=8Gi -- ./serve
  cudabudget status
  cudabudget limit --job train 20Gi
  cudabudget exporter --listen 0.0.0.0:9464
  cudabudget doctor
  cudabudget install /opt/cudabudget"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a command under a device-memory budget.
    #[command(after_help = run::AFTER_HELP)]
    Run(run::RunArgs),
    /// Show the budgeted processes of this machine: budget, use, peak, denials.
    #[command(after_help = status::AFTER_HELP)]
    Status(status::StatusArgs),
    /// Show or change a running job's or process's budget.
    #[command(after_help = limit::AFTER_HELP)]
    Limit(limit::LimitArgs),
    /// Serve the budgeted processes' figures as Prometheus metrics.
    #[command(after_help = exporter::AFTER_HELP)]
    Exporter(exporter::ExporterArgs),
    /// Check why a budget would not apply here: driver, library, configuration, ...
    #[command(after_help = doctor::AFTER_HELP)]
    Doctor(doctor::DoctorArgs),
    /// Write the library (and this CLI) into DIR and print the LD_PRELOAD line to use.
    #[command(after_help = install::AFTER_HELP)]
    Install(install::InstallArgs),
    /// Serve the Kubernetes admission webhook that budgets annotated pods (/mutate).
    #[command(after_help = webhook::AFTER_HELP)]
    Webhook(webhook::WebhookArgs),
    #[command(name = "__probe-preload", hide = true)]
    ProbePreload(probe::PreloadArgs),
    #[command(name = "__probe-alloc", hide = true)]
    ProbeAlloc(probe::AllocArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return clap_error(error),
    };
    // A command whose reader went away (`cudabudget doctor | head -c1`) ends quietly,
    // as `cat` does, instead of panicking at its next print: the default SIGPIPE. The
    // servers keep it ignored (a client that hangs up is their everyday business).
    if !matches!(cli.command, Command::Exporter(_) | Command::Webhook(_)) {
        // SAFETY: sets this process's disposition of one signal to the default.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    if matches!(
        cli.command,
        Command::Status(_)
            | Command::Limit(_)
            | Command::Exporter(_)
            | Command::Doctor(_)
            | Command::Install(_)
    ) {
        without_own_preload();
    }
    let outcome = match cli.command {
        Command::Run(args) => Err(run::run(args)),
        Command::Status(args) => status::status(args),
        Command::Limit(args) => limit::limit(args),
        Command::Exporter(args) => exporter::exporter(args),
        Command::Doctor(args) => doctor::doctor(args),
        Command::Install(args) => install::install(args),
        Command::Webhook(args) => webhook::webhook(args),
        Command::ProbePreload(args) => probe::preload(args),
        Command::ProbeAlloc(args) => probe::alloc(args),
    };
    match outcome {
        Ok(code) => code,
        Err(refusal) => {
            say(&refusal.message);
            ExitCode::from(refusal.status)
        }
    }
}

/// `status`, `exporter`, `doctor` and `install` ask the driver and NVML for themselves:
/// with the library preloaded into this process (an image that sets `LD_PRELOAD` for
/// everything) they would see budgets instead of devices, and be budgeted themselves. Such
/// a process starts itself again without it (the old value is kept in
/// `_CUDABUDGET_PRELOAD_BEFORE` for `doctor`).
fn without_own_preload() {
    use std::os::unix::process::CommandExt;
    let Some(preload) = std::env::var_os("LD_PRELOAD") else {
        return;
    };
    if std::env::var_os(doctor::PRELOAD_BEFORE).is_some() {
        return; // started again already
    }
    let text = preload.to_string_lossy().into_owned();
    let entries: Vec<&str> = text.split([':', ' ']).filter(|e| !e.is_empty()).collect();
    let kept: Vec<&str> = entries
        .iter()
        .copied()
        .filter(|e| {
            !std::path::Path::new(e)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libcudabudget"))
        })
        .collect();
    if kept.len() == entries.len() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let mut command = std::process::Command::new(exe);
    command
        .args(std::env::args_os().skip(1))
        .env(doctor::PRELOAD_BEFORE, &preload);
    if kept.is_empty() {
        command.env_remove("LD_PRELOAD");
    } else {
        command.env("LD_PRELOAD", kept.join(":"));
    }
    // Only returns if the exec failed: go on as we are.
    let _ = command.exec();
}

/// clap's own messages, in this tool's style: "cudabudget: unexpected argument …" with
/// clap's tip (the option that was probably meant) and usage below; exit 2 (`run`: 125,
/// its own failures' status).
fn clap_error(error: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        error.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        let _ = error.print();
        return ExitCode::from(error.exit_code() as u8);
    }
    let text = error.render().to_string();
    let text = text.strip_prefix("error: ").unwrap_or(&text);
    eprint!("cudabudget: {text}");
    if run::asked_for(std::env::args_os()) {
        return ExitCode::from(run::EXIT_RUN_FAILED);
    }
    ExitCode::from(EXIT_USAGE)
}
