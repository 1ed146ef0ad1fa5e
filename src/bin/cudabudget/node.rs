//! `cudabudget webhook …` and `cudabudget exporter …`: the node services live in their
//! own binary, `cudabudget-node`, so that installing this CLI compiles no Kubernetes
//! types, TLS or HTTP server. These two commands stay for the people and scripts that
//! use them: they `exec` `cudabudget-node` with the same arguments (same process, same
//! signals, its exit status), found beside this executable, else in `PATH`. Without it,
//! one line says how to get it, and the status is a shell's for a command it cannot find
//! (127; 126 when it is there but cannot be executed).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;

use cudabudget_cli_common::tell::{EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND, Refusal};

/// The node services' binary.
pub const NODE: &str = "cudabudget-node";

pub const AFTER_HELP: &str = "Runs `cudabudget-node` (the node services' binary, beside \
this cudabudget or in PATH) with the same arguments: `cudabudget-node webhook --help` and \
`cudabudget-node exporter --help` tell the options. Get it with `cargo install --path \
crates/node` from the source, or from the release archive.";

/// The arguments, passed through as they are (`--help` included).
#[derive(Args)]
#[command(disable_help_flag = true)]
pub struct PassArgs {
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "ARGS"
    )]
    args: Vec<OsString>,
}

/// Runs `cudabudget-node <service> <args>` in place of this process; returns only when
/// that cannot be done.
pub fn pass(service: &str, args: PassArgs) -> Result<ExitCode, Refusal> {
    let Some(node) = find() else {
        return Err(Refusal {
            message: format!(
                "`cudabudget {service}` runs `{NODE} {service}`, and {NODE} is neither beside \
                 this cudabudget nor in PATH: install it with `cargo install --path \
                 crates/node` (from the source), or take it from the release archive"
            ),
            status: EXIT_NOT_FOUND,
        });
    };
    let error = std::process::Command::new(&node)
        .arg(service)
        .args(args.args)
        .exec();
    Err(Refusal {
        message: format!("{}: cannot be executed: {error}", node.display()),
        status: EXIT_CANNOT_EXECUTE,
    })
}

/// `cudabudget-node` beside this executable (where an install or a release archive puts
/// both), else the first in `PATH`.
fn find() -> Option<PathBuf> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(NODE)));
    let in_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(NODE));
    beside.into_iter().chain(in_path).find(|p| is_file(p))
}

fn is_file(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file())
}
