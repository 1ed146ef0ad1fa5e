//! `cudabudget install DIR`: places the library (and this CLI) for an image or a node,
//! checks that it loads there, and prints the `LD_PRELOAD` line to use.

use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use crate::library::{self, LIBRARY_NAME};
use crate::{Refusal, config, say, usage};

pub const AFTER_HELP: &str = "Writes DIR/libcudabudget.so (and DIR/cudabudget, unless \
--lib-only), each to a temporary name first and then renamed over the old one, so a \
process that has the old library mapped keeps it. The library is the one `run` would \
use: $CUDABUDGET_LIB, the one next to this binary, or the copy this binary carries. \
The last line on stdout is the LD_PRELOAD line to use.

Examples:
  cudabudget install /opt/cudabudget
  RUN cudabudget install /opt/cudabudget          (in a Dockerfile)
  eval \"export $(cudabudget install ~/.local/lib/cudabudget | tail -n 1)\"";

#[derive(Args)]
pub struct InstallArgs {
    /// The directory to install into (created if missing).
    dir: PathBuf,

    /// Write only the library, not this CLI.
    #[arg(long = "lib-only")]
    lib_only: bool,
}

/// The bytes of the library `run` would preload, without writing the carried copy
/// anywhere.
fn library_bytes() -> Result<Vec<u8>, Refusal> {
    let from_file = std::env::var_os(config::LIB).is_some()
        || library::embedded().is_none()
        || std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|d| d.join(LIBRARY_NAME)))
            .is_some_and(|p| p.is_file());
    if !from_file {
        return Ok(library::embedded().unwrap_or_default().to_vec());
    }
    let found = library::find()?;
    std::fs::read(&found.path)
        .map_err(|e| usage(format!("cannot read {}: {e}", found.path.display())))
}

pub fn install(args: InstallArgs) -> Result<ExitCode, Refusal> {
    let bytes = library_bytes()?;
    std::fs::create_dir_all(&args.dir)
        .map_err(|e| usage(format!("cannot create {}: {e}", args.dir.display())))?;
    let dir = std::fs::canonicalize(&args.dir)
        .map_err(|e| usage(format!("{}: {e}", args.dir.display())))?;
    if dir
        .as_os_str()
        .as_bytes()
        .iter()
        .any(|b| b" :\t\n".contains(b))
    {
        return Err(usage(format!(
            "{:?} contains ':' or whitespace, which LD_PRELOAD cannot carry; \
             choose a plainer directory",
            dir.display().to_string()
        )));
    }
    let target = dir.join(LIBRARY_NAME);
    library::write_atomically(&target, &bytes, 0o755)
        .map_err(|e| usage(format!("cannot write {}: {e}", target.display())))?;
    let mut written = vec![target.display().to_string()];
    if !args.lib_only {
        let exe = std::env::current_exe()
            .map_err(|e| usage(format!("cannot find this binary to copy it: {e}")))?;
        let cli = dir.join("cudabudget");
        if !library::same_file(&exe, &cli) {
            let binary = std::fs::read(&exe)
                .map_err(|e| usage(format!("cannot read {}: {e}", exe.display())))?;
            library::write_atomically(&cli, &binary, 0o755)
                .map_err(|e| usage(format!("cannot write {}: {e}", cli.display())))?;
        }
        written.push(cli.display().to_string());
    }
    say(format!("installed {}", written.join(" and ")));
    if let Err(reason) = library::probe(target.as_os_str(), &target) {
        say(format!(
            "{} does not load here ({reason}): a process started here with it in \
             LD_PRELOAD would run unbudgeted; `cudabudget doctor` says more",
            target.display()
        ));
        return Ok(ExitCode::from(1));
    }
    if !args.lib_only {
        say(format!(
            "run commands with {}/cudabudget run --limit 20Gi -- CMD, or set:",
            dir.display()
        ));
    }
    println!("LD_PRELOAD={}", target.display());
    Ok(ExitCode::SUCCESS)
}
