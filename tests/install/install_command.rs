//! One file is enough: `cudabudget install DIR` places the library (and the CLI) and
//! prints the `LD_PRELOAD` line; a CLI that carries the library (what `cargo install`
//! gives) works alone; `--version` names the commit.

use crate::util::cli::{
    BIN, RUN_PRINTING_PRELOAD, cli_at, closed_scratch, cudabudget, fresh_library,
    library_for_a_newer_glibc, output, scratch, stderr, stdout,
};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

fn same_bytes(a: &Path, b: &Path) -> bool {
    std::fs::read(a).unwrap() == std::fs::read(b).unwrap()
}

/// The library the CLI carries: the one its build script built (`build.rs`).
#[cfg(cudabudget_embed)]
fn carried_library() -> &'static Path {
    Path::new(env!("CB_BUILD_EMBED_LIBRARY"))
}

#[test]
fn install_writes_the_library_and_the_cli_and_prints_the_preload_line() {
    let dir = closed_scratch("install").join("opt/cudabudget");
    let out = output(&mut cudabudget(&["install", dir.to_str().unwrap()]));
    assert!(out.status.success(), "{}", stderr(&out));
    let dir = std::fs::canonicalize(&dir).unwrap();
    let library = dir.join("libcudabudget.so");
    assert!(same_bytes(&library, &fresh_library()));
    let cli = dir.join("cudabudget");
    assert!(same_bytes(&cli, Path::new(BIN)));
    assert_eq!(
        std::fs::metadata(&cli).unwrap().permissions().mode() & 0o777,
        0o755
    );
    assert_eq!(
        stdout(&out).lines().last(),
        Some(format!("LD_PRELOAD={}", library.display()).as_str())
    );
    assert!(
        stderr(&out).starts_with("cudabudget: installed "),
        "{}",
        stderr(&out)
    );

    // The installed CLI finds the library beside it.
    let out = output(&mut cli_at(&cli, RUN_PRINTING_PRELOAD));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim_end(), library.to_str().unwrap());
    let _ = std::fs::remove_dir_all(dir.parent().unwrap().parent().unwrap());
}

#[test]
fn install_replaces_an_old_library_by_renaming_a_new_file_over_it() {
    let dir = closed_scratch("reinstall");
    let library = dir.join("libcudabudget.so");
    std::fs::write(&library, b"an old library").unwrap();
    let old_inode = std::fs::metadata(&library).unwrap().ino();
    let out = output(&mut cudabudget(&[
        "install",
        "--lib-only",
        dir.to_str().unwrap(),
    ]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(same_bytes(&library, &fresh_library()));
    assert_ne!(
        std::fs::metadata(&library).unwrap().ino(),
        old_inode,
        "a process that has the old library mapped keeps it"
    );
    assert!(!dir.join("cudabudget").exists(), "--lib-only");
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn install_refuses_a_directory_ld_preload_cannot_name() {
    let dir = closed_scratch("install-space").join("with space");
    let out = output(&mut cudabudget(&["install", dir.to_str().unwrap()]));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("LD_PRELOAD cannot carry"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn install_into_a_file_says_it_is_not_a_directory() {
    let scratch = closed_scratch("install-file");
    let file = scratch.join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let out = output(&mut cudabudget(&["install", file.to_str().unwrap()]));
    let said = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert_eq!(
        said.trim_end(),
        format!(
            "cudabudget: cannot install into {0}: {0}: Not a directory (os error 20)",
            file.display()
        )
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"not a directory");
    let _ = std::fs::remove_dir_all(&scratch);
}

#[test]
fn install_says_when_the_library_does_not_load_where_it_was_installed() {
    let dir = closed_scratch("install-glibc");
    let newer = library_for_a_newer_glibc(&dir);
    let target = dir.join("target");
    let out = output(
        cudabudget(&["install", "--lib-only", target.to_str().unwrap()])
            .env("CUDABUDGET_LIB", &newer),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("does not load here"),
        "{}",
        stderr(&out)
    );
    assert!(stdout(&out).is_empty(), "no LD_PRELOAD line for it");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn version_names_the_commit_it_was_built_from() {
    let out = output(&mut cudabudget(&["--version"]));
    assert!(out.status.success());
    let version = stdout(&out);
    let expected_start = format!("cudabudget {} (commit ", env!("CARGO_PKG_VERSION"));
    assert!(version.starts_with(&expected_start), "{version}");
    let git = Command::new("git")
        .args([
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "rev-parse",
            "--short=12",
            "HEAD",
        ])
        .output();
    match git {
        Ok(git) if git.status.success() => {
            let head = String::from_utf8_lossy(&git.stdout).trim().to_string();
            assert!(
                version.contains(&format!("(commit {head}")),
                "{version:?} does not name HEAD {head}"
            );
        }
        _ => assert!(version.contains("(commit "), "{version}"),
    }
}

/// A copy of the CLI alone in a directory, as `cargo install` leaves it, with a home of
/// its own for the cache.
#[cfg(cudabudget_embed)]
fn bare_cli(test: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = closed_scratch(test);
    let bin = dir.join("bin/cudabudget");
    std::fs::create_dir_all(bin.parent().unwrap()).unwrap();
    std::fs::copy(BIN, &bin).unwrap();
    (dir, bin)
}

#[cfg(cudabudget_embed)]
fn bare(bin: &Path, home: &Path, args: &[&str]) -> Command {
    std::fs::create_dir_all(home).unwrap();
    let mut command = cli_at(bin, args);
    command
        .env("HOME", home)
        .env_remove("XDG_CACHE_HOME")
        .env_remove("XDG_RUNTIME_DIR");
    command
}

#[test]
#[cfg_attr(
    not(cudabudget_embed),
    ignore = "this build does not carry the library (the build script must set cfg(cudabudget_embed))"
)]
fn a_cli_alone_writes_the_library_it_carries_once_and_runs_under_it() {
    #[cfg(cudabudget_embed)]
    {
        let (dir, bin) = bare_cli("bare-run");
        let home = dir.join("home");
        let out = output(&mut bare(&bin, &home, RUN_PRINTING_PRELOAD));
        assert!(out.status.success(), "{}", stderr(&out));
        let preloaded = std::path::PathBuf::from(stdout(&out).trim_end());
        let cache = home.join(".cache/cudabudget");
        assert!(preloaded.starts_with(&cache), "{preloaded:?}");
        assert!(same_bytes(&preloaded, carried_library()));
        let meta = std::fs::metadata(&preloaded).unwrap();

        // Once per version: the second run uses the same file.
        let out = output(&mut bare(
            &bin,
            &home,
            &["run", "--limit", "1Gi", "--", "true"],
        ));
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(std::fs::metadata(&preloaded).unwrap().ino(), meta.ino());

        // A damaged copy is written again.
        std::fs::write(&preloaded, b"damaged").unwrap();
        let out = output(&mut bare(
            &bin,
            &home,
            &["run", "--limit", "1Gi", "--", "true"],
        ));
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(same_bytes(&preloaded, carried_library()));

        // And the command is budgeted by it.
        let out = output(&mut bare(
            &bin,
            &home,
            &[
                "run",
                "--limit",
                "1Gi",
                "--",
                crate::util::client_bin("gpa"),
                "gpa",
                "alloc:2Gi",
            ],
        ));
        assert!(
            stdout(&out).contains("alloc rc=2"),
            "{}{}",
            stdout(&out),
            stderr(&out)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
#[cfg_attr(
    not(cudabudget_embed),
    ignore = "this build does not carry the library (the build script must set cfg(cudabudget_embed))"
)]
fn a_cli_alone_installs_the_library_it_carries() {
    #[cfg(cudabudget_embed)]
    {
        let (dir, bin) = bare_cli("bare-install");
        let target = dir.join("opt");
        let out = output(&mut bare(
            &bin,
            &dir.join("home"),
            &["install", target.to_str().unwrap()],
        ));
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(same_bytes(
            &target.join("libcudabudget.so"),
            carried_library()
        ));
        assert!(!dir.join("home/.cache").exists(), "install writes no cache");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn install_refuses_a_directory_others_can_write() {
    let scratch = closed_scratch("install-open");
    for mode in [0o777, 0o1777, 0o775] {
        let dir = scratch.join(format!("open-{mode:o}"));
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
        let out = output(&mut cudabudget(&["install", dir.to_str().unwrap()]));
        let said = stderr(&out);
        assert_eq!(out.status.code(), Some(125), "{mode:o}: {said}");
        assert!(said.contains(dir.to_str().unwrap()), "{said}");
        assert!(said.contains("others may write it"), "{said}");
        assert_eq!(said.trim_end().lines().count(), 1, "{said}");
        assert!(stdout(&out).is_empty(), "no LD_PRELOAD line");
        assert!(!dir.join("libcudabudget.so").exists(), "{mode:o}");
        assert!(!dir.join("cudabudget").exists(), "{mode:o}");
    }
    let _ = std::fs::remove_dir_all(&scratch);
}

/// What a CLI without a library beside it (`bin`, `$HOME` at `home`, `XDG_CACHE_HOME` at
/// `cache` if given) preloads into `run --limit 1Gi`'s command, and what it said; the run
/// must succeed.
#[cfg(cudabudget_embed)]
fn preloaded_by_a_bare_cli(
    bin: &Path,
    home: &Path,
    cache: Option<&Path>,
) -> (std::path::PathBuf, String) {
    let mut command = bare(bin, home, RUN_PRINTING_PRELOAD);
    if let Some(cache) = cache {
        command.env("XDG_CACHE_HOME", cache);
    }
    let out = output(&mut command);
    assert!(out.status.success(), "{}", stderr(&out));
    let preloaded = std::path::PathBuf::from(stdout(&out).trim_end());
    (preloaded, stderr(&out))
}

#[test]
#[cfg_attr(
    not(cudabudget_embed),
    ignore = "this build does not carry the library (the build script must set cfg(cudabudget_embed))"
)]
fn a_cache_directory_linked_to_a_place_of_ours_is_used_without_a_word() {
    #[cfg(cudabudget_embed)]
    {
        let (dir, bin) = bare_cli("bare-linked-cache");
        let home = dir.join("home");
        let elsewhere = dir.join("scratch-disk/cache");
        std::fs::create_dir_all(&home).unwrap();
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, home.join(".cache")).unwrap();
        let (preloaded, said) = preloaded_by_a_bare_cli(&bin, &home, None);
        assert!(said.is_empty(), "{said}");
        assert!(
            preloaded.starts_with(std::fs::canonicalize(&elsewhere).unwrap()),
            "{preloaded:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
#[cfg_attr(
    not(cudabudget_embed),
    ignore = "this build does not carry the library (the build script must set cfg(cudabudget_embed))"
)]
fn a_cache_place_that_is_a_file_is_named_and_the_next_place_is_used() {
    #[cfg(cudabudget_embed)]
    {
        let (dir, bin) = bare_cli("bare-cache-file");
        let home = dir.join("home");
        let file = dir.join("cache-file");
        std::fs::write(&file, b"not a directory").unwrap();
        let (preloaded, said) = preloaded_by_a_bare_cli(&bin, &home, Some(&file));
        let file = std::fs::canonicalize(&file).unwrap();
        assert!(
            said.starts_with(&format!("cudabudget: {}: Not a directory", file.display())),
            "{said}"
        );
        // The next place: $HOME/.cache.
        assert!(
            preloaded.starts_with(std::fs::canonicalize(&home).unwrap().join(".cache")),
            "{preloaded:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Asserts `install DIR` was refused (125, one line naming `open` and saying `words`)
/// and wrote nothing.
fn assert_install_refused(dir: &Path, open: &Path, words: &str) {
    let out = output(&mut cudabudget(&["install", dir.to_str().unwrap()]));
    let said = stderr(&out);
    assert_eq!(out.status.code(), Some(125), "{said}");
    assert!(
        said.contains(&format!("{} cannot be trusted", open.display())) && said.contains(words),
        "the line names {}: {said}",
        open.display()
    );
    assert_eq!(said.trim_end().lines().count(), 1, "{said}");
    assert!(stdout(&out).is_empty(), "no LD_PRELOAD line");
    assert!(!dir.join("libcudabudget.so").exists());
    assert!(!dir.join("cudabudget").exists());
}

#[test]
fn install_refuses_a_directory_under_one_others_may_write_sticky_or_not_naming_it() {
    // Under the system's temporary directory: once a cleaner removes the install, any
    // user could recreate the path with their own library.
    let under_tmp = scratch("install-under-tmp");
    match crate::util::first_open_ancestor(&under_tmp) {
        Some(open) => assert_install_refused(&under_tmp.join("opt/cudabudget"), &open, ""),
        None => crate::util::skip("the temporary directory is closed to other users here"),
    }

    // Under a sticky world-writable directory, closed all the way above it.
    let sticky = closed_scratch("install-sticky").join("shared");
    std::fs::create_dir(&sticky).unwrap();
    std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
    assert_install_refused(&sticky.join("opt/cudabudget"), &sticky, "sticky or not");

    // Under another user's directory that its group may write.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        crate::util::skip("the case of another user's directory needs root to chown");
        return;
    }
    let theirs = closed_scratch("install-theirs").join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o775)).unwrap();
    std::os::unix::fs::chown(&theirs, Some(54321), Some(54321)).unwrap();
    assert_install_refused(&theirs.join("lib"), &theirs, "uid 54321");
}

#[test]
#[cfg_attr(
    not(cudabudget_embed),
    ignore = "this build does not carry the library (the build script must set cfg(cudabudget_embed))"
)]
fn a_cli_alone_never_writes_the_library_it_carries_under_a_directory_others_may_write() {
    #[cfg(cudabudget_embed)]
    {
        let (dir, bin) = bare_cli("bare-sticky");
        let sticky = dir.join("shared");
        std::fs::create_dir(&sticky).unwrap();
        std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let home = sticky.join("home");
        let marker = dir.join("ran");
        // Every place it could use is under the sticky directory: nothing runs.
        let mut command = bare(&bin, &home, &["run", "--limit", "1Gi", "--", "touch"]);
        command.arg(&marker).env("TMPDIR", &sticky);
        let out = output(&mut command);
        let said = stderr(&out);
        assert_eq!(out.status.code(), Some(125), "{said}");
        assert!(
            said.contains(&format!("{} cannot be trusted", sticky.display())),
            "{said}"
        );
        assert_eq!(said.trim_end().lines().count(), 1, "{said}");
        assert!(!marker.exists(), "the command ran despite: {said}");

        // With a runtime directory of its own, the copy goes there, and one line says
        // what was in the way.
        let runtime = dir.join("runtime");
        std::fs::create_dir(&runtime).unwrap();
        std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o700)).unwrap();
        let mut command = bare(&bin, &home, RUN_PRINTING_PRELOAD);
        command
            .env("TMPDIR", &sticky)
            .env("XDG_RUNTIME_DIR", &runtime);
        let out = output(&mut command);
        let said = stderr(&out);
        assert!(out.status.success(), "{said}");
        let preloaded = std::path::PathBuf::from(stdout(&out).trim_end());
        assert!(preloaded.starts_with(&runtime), "{preloaded:?}");
        assert!(
            said.contains(&format!("{} cannot be trusted", sticky.display()))
                && said.contains(preloaded.to_str().unwrap()),
            "{said}"
        );
        assert_eq!(said.trim_end().lines().count(), 1, "{said}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
