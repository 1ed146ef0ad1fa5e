//! Lets the CLI carry the library (`src/bin/cudabudget/library.rs`), so that `cargo
//! install` gives a working `cudabudget`. Writes nothing outside `OUT_DIR`.
//!
//! The binary cannot name the cdylib that cargo builds beside it (stable cargo has no
//! artifact dependencies, and the cdylib does not exist yet when this script runs), so
//! this script builds the library itself: a nested `cargo build --lib
//! --no-default-features` of this package, in the same profile and for the same target,
//! into a target directory under `OUT_DIR`, and hands its `libcudabudget.so` to the
//! binary (`cfg(cudabudget_embed)`, `CB_BUILD_EMBED_LIBRARY`). The nested build shares
//! cargo's jobserver, uses the same rustc and target flags (`CARGO_ENCODED_RUSTFLAGS`),
//! the same `Cargo.lock` (`--locked`: it never rewrites it) and works offline when the
//! outer build does (`CARGO_NET_OFFLINE`). It compiles no C.
//!
//! Not under clippy (`RUSTC_WORKSPACE_WRAPPER` names `clippy-driver`): the CLI is then
//! checked without a carried library. `cargo check` cannot be told from `cargo build`
//! here, so it builds the library once too (in the dev profile), and again only when the
//! library's own sources change: this script reruns for those files, not for the CLI's.
//! `CUDABUDGET_NO_EMBED=1` builds a CLI that carries none.

use std::env;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Set for the nested build, whose own run of this script must not build again.
const NESTED: &str = "CUDABUDGET_NESTED_LIBRARY_BUILD";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=RUSTC_WORKSPACE_WRAPPER");
    println!("cargo:rerun-if-env-changed=CUDABUDGET_NO_EMBED");
    println!("cargo:rerun-if-env-changed={NESTED}");
    // The triple this build is for: the tests' nested builds (tests/util/cargo.rs) tell a
    // `--target` build's directory (<target>/<triple>/<profile>) by it.
    println!(
        "cargo:rustc-env=CB_BUILD_TARGET={}",
        env::var("TARGET").unwrap_or_default()
    );
    if env::var_os(NESTED).is_some()
        || env::var_os("CARGO_FEATURE_CLI").is_none()
        || env::var_os("CUDABUDGET_NO_EMBED").is_some_and(|v| v == "1")
        || under_clippy()
    {
        return;
    }
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    for watched in library_sources(&manifest_dir) {
        println!("cargo:rerun-if-changed={}", watched.display());
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let library = build_library(&manifest_dir, &out);
    println!("cargo:rustc-cfg=cudabudget_embed");
    println!(
        "cargo:rustc-env=CB_BUILD_EMBED_LIBRARY={}",
        library.display()
    );
}

/// Whether this is `cargo clippy`'s run (its driver wraps the workspace's rustc).
fn under_clippy() -> bool {
    env::var_os("RUSTC_WORKSPACE_WRAPPER").is_some_and(|wrapper| {
        Path::new(&wrapper)
            .file_name()
            .is_some_and(|name| name.to_string_lossy().starts_with("clippy-driver"))
    })
}

/// What the library is built from: the manifest and lock file, its sources (`src/`
/// without the CLI's `src/bin/`) and the shared crate's.
fn library_sources(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("Cargo.toml"), root.join("Cargo.lock")];
    let spec = root.join("crates/spec");
    files.push(spec.join("Cargo.toml"));
    walk(&root.join("src"), &root.join("src/bin"), &mut files);
    walk(&spec.join("src"), Path::new(""), &mut files);
    files
}

fn walk(dir: &Path, skip: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    // Files only: a directory would be scanned whole (`src/` holds the CLI's `src/bin/`).
    // A new module is named in a file already watched, whose change reruns this script.
    for entry in entries.flatten() {
        let path = entry.path();
        if path == skip {
            continue;
        }
        match entry.file_type() {
            Ok(t) if t.is_dir() => walk(&path, skip, files),
            Ok(t) if t.is_file() => files.push(path),
            _ => {}
        }
    }
}

/// Builds this package's library under `out` as the outer build builds it (profile,
/// target, flags, lock file), and returns its `libcudabudget.so`.
fn build_library(manifest_dir: &Path, out: &Path) -> PathBuf {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let target = env::var("TARGET").expect("TARGET");
    let release = env::var("PROFILE").is_ok_and(|p| p == "release");
    let target_dir = out.join("library");
    let mut cmd = Command::new(cargo);
    cmd.current_dir(manifest_dir)
        .args(["build", "--lib", "--no-default-features", "--quiet"])
        .arg("--manifest-path")
        .arg(manifest_dir.join("Cargo.toml"))
        .args(["--target", &target])
        .arg("--target-dir")
        .arg(&target_dir);
    if release {
        cmd.arg("--release");
    }
    if manifest_dir.join("Cargo.lock").is_file() {
        cmd.arg("--locked");
    }
    if env::var_os("CARGO_NET_OFFLINE").is_some_and(|v| v == "true" || v == "1") {
        cmd.arg("--offline");
    }
    // What cargo told this script about this package's own build means nothing to the
    // nested one's scripts (it sets its own); the target directory is ours.
    for (key, _) in env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("CARGO_FEATURE_")
            || key.starts_with("CARGO_CFG_")
            || key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_MANIFEST_")
            || key == "CARGO_TARGET_DIR"
            || key == "CARGO_BUILD_TARGET_DIR"
            || key == "OUT_DIR"
        {
            cmd.env_remove(key.as_ref());
        }
    }
    cmd.env(NESTED, "1");
    let status = cmd.status().unwrap_or_else(|e| {
        panic!("the library the CLI carries: cannot run cargo: {e}");
    });
    assert!(
        status.success(),
        "the library the CLI carries: `cargo build --lib --no-default-features` failed ({status})"
    );
    let library = target_dir
        .join(&target)
        .join(if release { "release" } else { "debug" })
        .join("libcudabudget.so");
    assert!(
        library.is_file(),
        "the library the CLI carries: {} was not built",
        library.display()
    );
    library
}
