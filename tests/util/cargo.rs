//! Builds of this workspace's outputs that `cargo test` does not make by itself: the
//! library (a `cdylib` alone, which no test links, so cargo builds it for `cargo build`
//! only) and the node services' binary (another package's). The first test to need one
//! asks cargo for it, with the profile and target directory of this build (the CLI's);
//! cargo runs the tests after it has let go of the build directory, and an output that is
//! up to date is answered at once.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The profile directory (`<target>/<profile>/`, or `<target>/<triple>/<profile>/` for
/// a `--target` build) of this build: the CLI's, which cargo puts there whatever
/// directory the test binaries themselves are built in.
pub fn profile_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_cudabudget"))
        .parent()
        .expect("the CLI's directory")
        .to_path_buf()
}

/// `cargo build --quiet ARGS…` into `profile_dir`'s profile and target directory; panics
/// with cargo's own words unless it succeeds and `output` (a path under `profile_dir`)
/// then exists.
pub fn build(profile_dir: &Path, args: &[&str], output: &Path) {
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev",
        Some(name) => name,
        None => panic!("{}: no profile directory", profile_dir.display()),
    };
    let above = profile_dir.parent().expect("the target directory");
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or("cargo".into()));
    command.args(["build", "--quiet"]).args(args);
    command
        .arg("--manifest-path")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"));
    command.args(["--profile", profile]);
    // A `--target` build (on the command line or in cargo's configuration) lies under a
    // directory named by its triple; it is built again for that triple, into the same
    // target directory.
    let triple = env!("CB_BUILD_TARGET");
    match above.parent() {
        Some(target) if above.file_name().is_some_and(|name| name == triple) => {
            command
                .arg("--target")
                .arg(triple)
                .arg("--target-dir")
                .arg(target);
        }
        _ => {
            command.arg("--target-dir").arg(above);
        }
    }
    let out = command
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        out.status.success() && output.is_file(),
        "{command:?} ({}) did not build {}: {}",
        out.status,
        output.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}
