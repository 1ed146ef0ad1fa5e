//! `cudabudget install DIR`: places the library (and this CLI) for an image or a node,
//! checks that it loads there, and prints the `LD_PRELOAD` line to use. `--system` also
//! adds it to `/etc/ld.so.preload`, so that every process of the machine loads it.

use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use cudabudget_spec::place::{self, Access, Create, Dir, FileOpen, PlaceError};

use crate::library::{self, EXIT_UNSAFE_LIBRARY, LIBRARY_NAME};
use cudabudget_cli_common::tell::{Refusal, outln, say, usage};
use cudabudget_spec::config;

pub const AFTER_HELP: &str = "Writes DIR/libcudabudget.so (and DIR/cudabudget, unless \
--lib-only), each to a temporary name first and then renamed over the old one, so a \
process that has the old library mapped keeps it. The library is the one `run` would \
use: $CUDABUDGET_LIB, the one next to this binary, or the copy this binary carries. \
The last line on stdout is the LD_PRELOAD line to use.

DIR and every directory above it must belong to you or root and be writable by nobody \
else, sticky or not (nothing under /tmp, /var/tmp or /dev/shm): another user who could \
change them, or recreate DIR once a cleaner removed it, could put their own code into \
every process that preloads the library (exit 125 otherwise, naming the directory).

--system (as root) also adds the library to /etc/ld.so.preload (once; other lines are \
kept; the file is replaced atomically), so that every process started on this machine \
loads it, including one that unsets LD_PRELOAD. The budget still comes from each \
process's CUDABUDGET_* variables.

Examples:
  cudabudget install /opt/cudabudget
  sudo cudabudget install --system /opt/cudabudget
  RUN cudabudget install /opt/cudabudget          (in a Dockerfile)
  eval \"export $(cudabudget install ~/.local/lib/cudabudget | tail -n 1)\"";

/// Where `--system` adds the library.
const SYSTEM_PRELOAD: &str = "/etc/ld.so.preload";

#[derive(Args)]
pub struct InstallArgs {
    /// The directory to install into (created if missing).
    dir: PathBuf,

    /// Write only the library, not this CLI.
    #[arg(long = "lib-only")]
    lib_only: bool,

    /// Also add the library to /etc/ld.so.preload: every process of this machine loads
    /// it (root only).
    #[arg(long)]
    system: bool,
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

fn refuse_place(dir: &Path, error: impl std::fmt::Display) -> Refusal {
    Refusal {
        message: format!(
            "cannot install into {}: {error}; another user could put their own code into \
             every process that preloads it: choose a directory that only you or root \
             can change",
            dir.display()
        ),
        status: EXIT_UNSAFE_LIBRARY,
    }
}

/// `dir`, created if missing, verified: it and every directory above it belong to root
/// or us and nobody else may write them, sticky or not ([`Dir::open_closed`]): under
/// /tmp a cleaner removes what is ours, and whoever recreates the path then chooses the
/// code every process preloads.
fn install_dir(dir: &Path) -> Result<Dir, Refusal> {
    let absolute = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| usage(format!("{}: {e}", dir.display())))?
            .join(dir)
    };
    // The part that exists, and the names to create below it.
    let mut existing = absolute.clone();
    let mut missing = Vec::new();
    loop {
        match std::fs::symlink_metadata(&existing) {
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let name = match existing.components().next_back() {
                    Some(Component::Normal(name)) => name.to_os_string(),
                    _ => return Err(usage(format!("cannot create {}: {e}", dir.display()))),
                };
                missing.push(name);
                existing.pop();
            }
            Err(e) => return Err(usage(format!("{}: {e}", dir.display()))),
        }
    }
    let mut verified = Dir::open_closed(&existing).map_err(|e| match e {
        // Not a place at all (`install /etc/passwd`: not a directory), rather than one
        // that others could change.
        PlaceError::Io { .. } => usage(format!("cannot install into {}: {e}", dir.display())),
        e => refuse_place(dir, e),
    })?;
    for name in missing.iter().rev() {
        let Some(name) = name.to_str() else {
            return Err(usage(format!(
                "{}: not a UTF-8 directory name",
                dir.display()
            )));
        };
        verified = verified
            .private(name, 0o755)
            .map_err(|e| refuse_place(dir, e))?;
    }
    let st = place::fstat(verified.fd()).map_err(|e| usage(format!("{}: {e}", dir.display())))?;
    if st.st_mode & 0o022 != 0 {
        return Err(refuse_place(
            dir,
            format!(
                "{} cannot be trusted: others may write it (mode {:o})",
                verified.path().display(),
                st.st_mode & 0o7777
            ),
        ));
    }
    Ok(verified)
}

pub fn install(args: InstallArgs) -> Result<ExitCode, Refusal> {
    if args.system && place::euid() != 0 {
        return Err(usage(format!(
            "--system writes {SYSTEM_PRELOAD}: run it as root; nothing was installed"
        )));
    }
    let bytes = library_bytes()?;
    let dir = install_dir(&args.dir)?;
    if !library::preloadable_path(dir.path()) {
        return Err(usage(format!(
            "{:?} contains ':' or whitespace, which LD_PRELOAD cannot carry; \
             choose a plainer directory",
            dir.path().display().to_string()
        )));
    }
    let target = dir.path().join(LIBRARY_NAME);
    library::write_verified(&dir, LIBRARY_NAME, &bytes, 0o755)
        .map_err(|e| usage(format!("cannot write {}: {e}", target.display())))?;
    let mut written = vec![target.display().to_string()];
    if !args.lib_only {
        let exe = std::env::current_exe()
            .map_err(|e| usage(format!("cannot find this binary to copy it: {e}")))?;
        let cli = dir.path().join("cudabudget");
        if !library::same_file(&exe, &cli) {
            let binary = std::fs::read(&exe)
                .map_err(|e| usage(format!("cannot read {}: {e}", exe.display())))?;
            library::write_verified(&dir, "cudabudget", &binary, 0o755)
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
    if args.system {
        readable_by_everyone(&target)?;
        match add_to_system_preload(&target)? {
            true => say(format!(
                "added {} to {SYSTEM_PRELOAD}: every process started on this machine loads \
                 it, with or without LD_PRELOAD (its budget comes from CUDABUDGET_*)",
                target.display()
            )),
            false => say(format!(
                "{} is in {SYSTEM_PRELOAD} already",
                target.display()
            )),
        }
    }
    if !args.lib_only {
        say(format!(
            "run commands with {}/cudabudget run --limit 20Gi -- CMD, or set:",
            dir.path().display()
        ));
    }
    outln(format_args!("LD_PRELOAD={}", target.display()))?;
    Ok(ExitCode::SUCCESS)
}

/// Every user's processes load what /etc/ld.so.preload names: the file and the
/// directories above it must be open to them, else each of their processes would
/// print a loader error and run unbudgeted.
fn readable_by_everyone(target: &Path) -> Result<(), Refusal> {
    let meta =
        std::fs::metadata(target).map_err(|e| usage(format!("{}: {e}", target.display())))?;
    if meta.mode() & 0o004 == 0 {
        return Err(usage(format!(
            "other users cannot read {} (mode {:o}); nothing was added to {SYSTEM_PRELOAD}",
            target.display(),
            meta.mode() & 0o7777
        )));
    }
    for dir in target.ancestors().skip(1) {
        let meta = std::fs::metadata(dir).map_err(|e| usage(format!("{}: {e}", dir.display())))?;
        if meta.mode() & 0o001 == 0 {
            return Err(usage(format!(
                "other users cannot enter {} (mode {:o}), so their processes could not load \
                 {}; nothing was added to {SYSTEM_PRELOAD}: make it 0755 or choose another DIR",
                dir.display(),
                meta.mode() & 0o7777,
                target.display()
            )));
        }
    }
    Ok(())
}

/// Adds `library` to /etc/ld.so.preload unless an entry names it already (`false`).
/// The other entries are kept byte for byte; the new file is written beside it and
/// renamed over it, so a process starting meanwhile sees the old or the new one whole.
fn add_to_system_preload(library: &Path) -> Result<bool, Refusal> {
    let path = Path::new(SYSTEM_PRELOAD);
    let (parent, name) = (
        path.parent().unwrap_or(Path::new("/")),
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("ld.so.preload"),
    );
    let refuse =
        |error: &dyn std::fmt::Display| usage(format!("cannot update {SYSTEM_PRELOAD}: {error}"));
    let etc = Dir::open_closed(parent).map_err(|e| refuse(&e))?;
    let mut existing = Vec::new();
    match etc.open_file(name, FileOpen::READ) {
        Ok(file) => {
            file.take(1 << 20)
                .read_to_end(&mut existing)
                .map_err(|e| refuse(&e))?;
        }
        Err(PlaceError::Io { error, .. }) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(refuse(&error)),
    }
    // ld.so splits the file at whitespace and ':'.
    let present = existing
        .split(|b| b" \t\n\r:".contains(b))
        .filter(|entry| !entry.is_empty())
        .any(|entry| {
            let entry = Path::new(std::ffi::OsStr::from_bytes(entry));
            entry == library || library::same_file(entry, library)
        });
    if present {
        return Ok(false);
    }
    let mut content = existing;
    if !content.is_empty() && !content.ends_with(b"\n") {
        content.push(b'\n');
    }
    content.extend_from_slice(library.as_os_str().as_bytes());
    content.push(b'\n');
    let temporary = format!(".{name}.cudabudget-{}.tmp", std::process::id());
    let _ = etc.remove_file(&temporary);
    let written = (|| -> Result<(), PlaceError> {
        let mut file = etc.open_file(
            &temporary,
            FileOpen {
                access: Access::ReadWrite,
                create: Create::New,
                mode: 0o644,
            },
        )?;
        let io = |error| PlaceError::Io {
            path: path.to_path_buf(),
            error,
        };
        file.write_all(&content).map_err(io)?;
        file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .map_err(io)?;
        file.sync_all().map_err(io)?;
        etc.rename(&temporary, name).map_err(io)
    })();
    if let Err(error) = written {
        let _ = etc.remove_file(&temporary);
        return Err(refuse(&error));
    }
    Ok(true)
}
