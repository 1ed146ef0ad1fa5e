//! The `cudabudget` command line: `run` a command under a budget, see the budgeted
//! processes (`status`), change a budget (`limit`), find out why a budget does not apply
//! (`doctor`), and place the library for an image (`install`). The node services
//! (`exporter`, `webhook`) are the binary `cudabudget-node`, which these two commands run
//! ([`node`]).
//!
//! This binary must never link the library crate: the library exports `dlsym` and the
//! driver's names, which would interpose on the CLI itself. What it shares with the
//! library (quantities, configuration, the record layout, shared places) is the
//! `cudabudget-spec` crate; what it shares with `cudabudget-node` (the records, the
//! figures, the GPUs, how a message is told) is `cudabudget-cli-common`, whose modules
//! are named here as this crate's own. Everything that can be wrong with `run` is
//! checked before `exec`, so a bad option or a bad inherited variable fails here and the
//! job never starts unbudgeted.

mod doctor;
mod install;
mod library;
mod limit;
mod node;
mod probe;
mod run;
mod status;

use cudabudget_cli_common::{preload, tell};

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
    /// Serve the budgeted processes' figures as Prometheus metrics (runs
    /// `cudabudget-node exporter`).
    #[command(after_help = node::AFTER_HELP)]
    Exporter(node::PassArgs),
    /// Check why a budget would not apply here: driver, library, configuration, ...
    #[command(after_help = doctor::AFTER_HELP)]
    Doctor(doctor::DoctorArgs),
    /// Write the library (and this CLI) into DIR and print the LD_PRELOAD line to use.
    #[command(after_help = install::AFTER_HELP)]
    Install(install::InstallArgs),
    /// Serve the Kubernetes admission webhook that budgets annotated pods (/mutate;
    /// runs `cudabudget-node webhook`).
    #[command(after_help = node::AFTER_HELP)]
    Webhook(node::PassArgs),
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
    // servers keep it ignored (a client that hangs up is their everyday business): the
    // disposition goes through `exec` to `cudabudget-node`.
    if !matches!(cli.command, Command::Exporter(_) | Command::Webhook(_)) {
        // SAFETY: sets this process's disposition of one signal to the default.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    if matches!(
        cli.command,
        Command::Status(_) | Command::Limit(_) | Command::Doctor(_) | Command::Install(_)
    ) {
        preload::without_own_preload();
    }
    let outcome = match cli.command {
        Command::Run(args) => Err(run::run(args)),
        Command::Status(args) => status::status(args),
        Command::Limit(args) => limit::limit(args),
        Command::Exporter(args) => node::pass("exporter", args),
        Command::Doctor(args) => doctor::doctor(args),
        Command::Install(args) => install::install(args),
        Command::Webhook(args) => node::pass("webhook", args),
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

/// clap's own messages, in this tool's style ([`tell::clap_error`]); exit 2 (`run`: 125,
/// its own failures' status).
fn clap_error(error: clap::Error) -> ExitCode {
    let status = if run::asked_for(std::env::args_os()) {
        run::EXIT_RUN_FAILED
    } else {
        EXIT_USAGE
    };
    tell::clap_error(&error, status)
}
