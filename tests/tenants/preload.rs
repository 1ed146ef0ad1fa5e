//! Tenants and the trust model: the library `cudabudget run` preloads
//! comes from a place no other user can change, a name another user took in a shared
//! directory never stops `run` nor lends it her library, `install` refuses a directory
//! another user can change, and `install --system` budgets a process that dropped
//! `LD_PRELOAD`. As root (CI); skipped otherwise.

use crate::util::cli::{BIN, carried_library, fresh_library, output, stderr, stdout};
use crate::util::tenants::{Tenants, User, as_user};
use std::ffi::CString;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The fake driver, the test client and the CLI, as the tenants can run them. The CLI
/// sits alone in its directory (no library beside it), so it uses the copy it carries.
struct Shared {
    cli: PathBuf,
    client: PathBuf,
    fake: PathBuf,
}

/// Copied once per test binary (tests run in parallel).
fn shared(t: &Tenants) -> &'static Shared {
    static SHARED: std::sync::OnceLock<Shared> = std::sync::OnceLock::new();
    SHARED.get_or_init(|| Shared {
        // Alone: the other tenants' tests share the library into the shared directory,
        // and a CLI with a library beside it would preload that one.
        cli: t.share_alone("cli-alone", Path::new(BIN)),
        client: t.share(Path::new(crate::util::client_bin("gpa"))),
        fake: t.share_dir(Path::new(crate::util::fake_dir())),
    })
}

/// `cudabudget run --limit 1Gi` as alice with her cache directory (`XDG_CACHE_HOME`) =
/// `tmp`, a shared sticky directory, and a runtime directory of her own, no HOME:
/// prints the preloaded path, then asks the fake driver for 2 GiB.
fn alice_runs(t: &Tenants, s: &Shared, tmp: &Path) -> Output {
    let script = "echo \"preload=$LD_PRELOAD\"; exec \"$0\" gpa alloc:2Gi";
    output(
        as_user(
            t,
            &t.alice,
            &s.cli,
            &["run", "--limit", "1Gi", "--", "sh", "-c", script],
        )
        .arg(&s.client)
        .env_remove("HOME")
        .env("XDG_CACHE_HOME", tmp)
        .env("TMPDIR", tmp)
        .env("XDG_RUNTIME_DIR", t.home_of(&t.alice))
        .env("LD_LIBRARY_PATH", &s.fake),
    )
}

/// The name of alice's cache directory in her cache home (what mallory plants).
fn cache_parent(tmp: &Path, _user: &User) -> PathBuf {
    tmp.join("cudabudget")
}

/// The version directory name the CLI uses under it.
fn version_name() -> String {
    let bytes = std::fs::read(carried_library()).unwrap();
    format!(
        "{}-{:016x}",
        env!("CARGO_PKG_VERSION"),
        cudabudget_spec::record::fnv1a(&bytes)
    )
}

/// `mkdir -m MODE path` as `user`.
fn mkdir_as(t: &Tenants, user: &User, mode: &str, path: &Path) {
    let out = output(&mut as_user(
        t,
        user,
        Path::new("/bin/mkdir"),
        &["-m", mode, path.to_str().unwrap()],
    ));
    assert!(out.status.success(), "mkdir: {}", stderr(&out));
}

/// Asserts the run was budgeted by a library of alice's own, in a place only she (and
/// root) can change, with no directory above it that others may write, sticky or not,
/// and returns its path.
fn assert_budgeted_by_her_own_library(t: &Tenants, out: &Output) -> PathBuf {
    let text = stdout(out);
    assert!(
        out.status.success() && text.contains("alloc rc=2"),
        "alice's command did not run budgeted:\n{text}\n{}",
        stderr(out)
    );
    let preload = text
        .lines()
        .find_map(|l| l.strip_prefix("preload="))
        .expect("the preload line");
    let path = PathBuf::from(preload);
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.is_file(), "{preload}");
    assert_eq!(meta.uid(), t.alice.uid, "{preload} is not alice's");
    assert_eq!(meta.mode() & 0o022, 0, "{preload} may be written by others");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        std::fs::read(carried_library()).unwrap(),
        "{preload} is not the library the CLI carries"
    );
    for dir in path.ancestors().skip(1) {
        let meta = std::fs::symlink_metadata(dir).unwrap();
        assert!(meta.is_dir(), "{} is not a directory", dir.display());
        assert!(
            meta.uid() == 0 || meta.uid() == t.alice.uid,
            "{} (on the way to {preload}) belongs to uid {}",
            dir.display(),
            meta.uid()
        );
        assert!(
            meta.mode() & 0o022 == 0,
            "{} (on the way to {preload}) may be changed by others (mode {:o})",
            dir.display(),
            meta.mode() & 0o7777
        );
    }
    path
}

/// mallory plants `parent` (`mkdir -m MODE`, or a link to a directory of hers).
fn planted_parent_case(mode: &str) {
    let Some(t) = Tenants::get() else { return };
    let s = shared(t);
    let tmp = t.sticky_dir(&format!("cache-planted-{mode}"));
    let parent = cache_parent(&tmp, &t.alice);
    if mode == "link" {
        let hers = tmp.join("hers");
        mkdir_as(t, &t.mallory, "0777", &hers);
        let out = output(&mut as_user(
            t,
            &t.mallory,
            Path::new("/bin/ln"),
            &["-s", hers.to_str().unwrap(), parent.to_str().unwrap()],
        ));
        assert!(out.status.success(), "ln: {}", stderr(&out));
    } else {
        mkdir_as(t, &t.mallory, mode, &parent);
    }

    let out = alice_runs(t, s, &tmp);
    let path = assert_budgeted_by_her_own_library(t, &out);
    assert!(
        !path.starts_with(&parent),
        "{} is under mallory's {}",
        path.display(),
        parent.display()
    );
    // The shared directory is passed by as a whole, whatever was planted in it.
    let said = stderr(&out);
    let named = format!("{} cannot be trusted", tmp.display());
    let lines: Vec<&str> = said.lines().filter(|l| l.contains(&named)).collect();
    assert_eq!(
        lines.len(),
        1,
        "no one line names {}: {said}",
        tmp.display()
    );
    assert!(
        lines[0].contains(path.to_str().unwrap()),
        "the line says where it went: {said}"
    );

    // The next run finds its own copy again.
    let again = alice_runs(t, s, &tmp);
    assert_eq!(assert_budgeted_by_her_own_library(t, &again), path);
}

#[test]
#[cfg_attr(
    not(cudabudget_embed),
    ignore = "this build does not carry the library (the build script must set cfg(cudabudget_embed))"
)]
fn a_cache_directory_another_user_planted_open_to_all_is_passed_by_with_a_line() {
    planted_parent_case("0777");
}

#[test]
#[cfg_attr(
    not(cudabudget_embed),
    ignore = "this build does not carry the library (the build script must set cfg(cudabudget_embed))"
)]
fn a_cache_directory_another_user_planted_closed_to_her_is_passed_by_with_a_line() {
    planted_parent_case("0755");
}

#[test]
#[cfg_attr(
    not(cudabudget_embed),
    ignore = "this build does not carry the library (the build script must set cfg(cudabudget_embed))"
)]
fn a_link_another_user_planted_at_the_cache_name_is_passed_by_with_a_line() {
    planted_parent_case("link");
}

/// A library that, once loaded, creates `marker` (C, built with `cc`).
fn planted_library(t: &Tenants, marker: &Path) -> Option<PathBuf> {
    let source = t.shared.join("planted.c");
    let library = t.shared.join("planted.so");
    std::fs::write(
        &source,
        format!(
            "#include <fcntl.h>\n#include <unistd.h>\n\
             __attribute__((constructor)) static void planted(void) {{\n\
             int fd = open(\"{}\", O_WRONLY | O_CREAT | O_APPEND, 0666);\n\
             if (fd >= 0) {{ (void)write(fd, \"ran\\n\", 4); close(fd); }}\n}}\n",
            marker.display()
        ),
    )
    .unwrap();
    crate::util::shared_object(&source, &library, "the planted library")
}

/// This thread becomes `user` (only this thread: the raw system calls change one
/// thread's credentials, where libc's wrappers would change the whole test process's).
fn become_user_on_this_thread(user: &User) {
    // SAFETY: plain system calls on this thread's credentials; no memory is passed
    // (setgroups gets a count of 0 and a null list).
    let rc = unsafe {
        let groups = libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>());
        let gid = libc::syscall(libc::SYS_setresgid, user.gid, user.gid, user.gid);
        let uid = libc::syscall(libc::SYS_setresuid, user.uid, user.uid, user.uid);
        groups | gid | uid
    };
    assert_eq!(rc, 0, "cannot become {}", user.name);
}

#[test]
#[cfg_attr(
    not(cudabudget_embed),
    ignore = "this build does not carry the library (the build script must set cfg(cudabudget_embed))"
)]
fn another_user_swapping_directories_in_the_cache_never_gets_her_library_loaded() {
    let Some(t) = Tenants::get() else { return };
    let s = shared(t);
    let tmp = t.sticky_dir("cache-race");
    let marker = tmp.join("mallory-was-here");
    let Some(planted) = planted_library(t, &marker) else {
        return;
    };
    // mallory's open cache directory, and in it her own version directory with her
    // library, ready to be exchanged with alice's.
    let parent = cache_parent(&tmp, &t.alice);
    mkdir_as(t, &t.mallory, "0777", &parent);
    let evil = parent.join("evil");
    mkdir_as(t, &t.mallory, "0755", &evil);
    let planted_copy = evil.join("libcudabudget.so");
    std::fs::copy(&planted, &planted_copy).unwrap();
    std::os::unix::fs::chown(&planted_copy, Some(t.mallory.uid), Some(t.mallory.gid)).unwrap();
    std::fs::set_permissions(&planted_copy, std::fs::Permissions::from_mode(0o755)).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let stop = Arc::clone(&stop);
        let mallory = t.mallory.clone();
        let parent = CString::new(parent.to_str().unwrap()).unwrap();
        let version = CString::new(version_name()).unwrap();
        let evil = CString::new("evil").unwrap();
        std::thread::spawn(move || {
            become_user_on_this_thread(&mallory);
            // SAFETY: a NUL-terminated path; the descriptor is closed below.
            let fd = unsafe {
                libc::open(
                    parent.as_ptr(),
                    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
                )
            };
            assert!(fd >= 0, "mallory cannot open her directory");
            let mut swaps = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // SAFETY: a live directory descriptor and NUL-terminated names.
                let rc = unsafe {
                    libc::renameat2(
                        fd,
                        version.as_ptr(),
                        fd,
                        evil.as_ptr(),
                        libc::RENAME_EXCHANGE,
                    )
                };
                if rc == 0 {
                    swaps += 1;
                } else {
                    std::thread::yield_now();
                }
            }
            // SAFETY: the descriptor opened above, closed once.
            unsafe { libc::close(fd) };
            swaps
        })
    };

    let mut failures = Vec::new();
    for attempt in 0..20 {
        let out = alice_runs(t, s, &tmp);
        if marker.exists() {
            failures.push(format!("run {attempt}: mallory's library ran as alice"));
            break;
        }
        let text = stdout(&out);
        if !(out.status.success() && text.contains("alloc rc=2")) {
            failures.push(format!(
                "run {attempt} was not budgeted: {}{text}",
                stderr(&out)
            ));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    assert!(
        failures.is_empty(),
        "{failures:?} ({swaps} swaps by mallory)"
    );
    assert!(!marker.exists(), "mallory's library ran as alice");
}

/// A directory of mallory's with `mode`, in a directory of root's that nobody else may
/// write (so that it is the first on the way that another user can change).
fn mallorys_dir(t: &Tenants, test: &str, mode: u32) -> PathBuf {
    let parent = t.shared.join(test);
    let _ = std::fs::remove_dir_all(&parent);
    std::fs::create_dir(&parent).unwrap();
    std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o755)).unwrap();
    let theirs = parent.join("mallory-owns-this");
    std::fs::create_dir(&theirs).unwrap();
    std::os::unix::fs::chown(&theirs, Some(t.mallory.uid), Some(t.mallory.gid)).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(mode)).unwrap();
    theirs
}

/// `cudabudget install ARGS` as root, with this run's library.
fn install(args: &[&str]) -> Output {
    let mut command = crate::util::cli::cudabudget(&["install"]);
    command.args(args);
    output(&mut command)
}

#[test]
fn install_refuses_a_directory_under_one_another_user_owns() {
    let Some(t) = Tenants::get() else { return };
    let theirs = mallorys_dir(t, "install-under", 0o755);
    let target = theirs.join("lib");
    std::fs::create_dir(&target).unwrap(); // root's, but mallory can rename it away
    let out = install(&["--lib-only", target.to_str().unwrap()]);
    let said = stderr(&out);
    assert_eq!(out.status.code(), Some(125), "{said}");
    assert!(
        said.contains(theirs.to_str().unwrap()) && said.contains(&format!("uid {}", t.mallory.uid)),
        "{said}"
    );
    assert_eq!(said.trim_end().lines().count(), 1, "{said}");
    assert!(!target.join("libcudabudget.so").exists());
    assert!(stdout(&out).is_empty(), "no LD_PRELOAD line");
}

/// Whether this process may make a private mount namespace.
fn unshare_permitted() -> bool {
    Command::new("unshare")
        .args(["-m", "true"])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn install_system_budgets_a_process_that_dropped_ld_preload() {
    let Some(t) = Tenants::get() else { return };
    if !unshare_permitted() {
        crate::util::skip("unshare -m is not permitted here (a private mount namespace is needed)");
        return;
    }
    let real_before = std::fs::read("/etc/ld.so.preload").ok();
    let s = shared(t);
    let other = t.share(Path::new(crate::util::thirdparty_lib()));
    // A copy of /etc, bind-mounted over /etc in the namespace only: the machine's own
    // /etc/ld.so.preload is never written.
    let etc = copy_of_etc(t, "etc-copy");
    let dir = t.shared.join("system");
    let _ = std::fs::remove_dir_all(&dir);

    let script = r#"set -e
mount --make-rprivate /
mount --bind "$CB_ETC" /etc
[ "$(stat -c %d:%i /etc)" = "$(stat -c %d:%i "$CB_ETC")" ] || { echo "not bound"; exit 99; }
printf '%s\n' "$CB_OTHER" > /etc/ld.so.preload
alice() {
  setpriv --reuid="$CB_UID" --regid="$CB_GID" --clear-groups -- env -i PATH=/usr/bin:/bin \
    LD_LIBRARY_PATH="$CB_FAKE" CUDABUDGET_LIMIT=1Gi "$CB_CLIENT" gpa alloc:2Gi | grep '^alloc'
}
echo "before: $(alice)"
"$CB_CLI" install --system --lib-only "$CB_DIR"
"$CB_CLI" install --system --lib-only "$CB_DIR"
echo "after: $(alice)"
echo "preload:"
cat /etc/ld.so.preload
"#;
    let mut command = Command::new("unshare");
    command
        .args(["-m", "--", "sh", "-c", script])
        .env_remove("LD_PRELOAD")
        .env("CUDABUDGET_LIB", fresh_library())
        .env("CB_ETC", &etc)
        .env("CB_OTHER", &other)
        .env("CB_UID", t.alice.uid.to_string())
        .env("CB_GID", t.alice.gid.to_string())
        .env("CB_FAKE", &s.fake)
        .env("CB_CLIENT", &s.client)
        .env("CB_CLI", BIN)
        .env("CB_DIR", &dir);
    let out = output(&mut command);
    assert_eq!(
        std::fs::read("/etc/ld.so.preload").ok(),
        real_before,
        "the machine's own /etc/ld.so.preload changed"
    );
    let text = stdout(&out);
    let said = format!("{text}\n{}", stderr(&out));
    assert!(out.status.success(), "{said}");
    assert!(
        text.contains("before: alloc rc=0"),
        "without the system preload the process is not budgeted: {said}"
    );
    assert!(
        text.contains("after: alloc rc=2"),
        "a process without LD_PRELOAD escaped the budget: {said}"
    );
    let preload: Vec<&str> = text
        .split_once("preload:\n")
        .map(|(_, p)| p.lines().collect())
        .unwrap_or_default();
    let ours = dir.join("libcudabudget.so");
    assert_eq!(
        preload,
        [other.to_str().unwrap(), ours.to_str().unwrap()],
        "{said}"
    );
    let meta = std::fs::metadata(&ours).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o755);
    let _ = std::fs::remove_dir_all(&etc);
}

/// A copy of /etc (`name` in the shared directory), for a mount namespace to bind over
/// its /etc.
fn copy_of_etc(t: &Tenants, name: &str) -> PathBuf {
    let etc = t.shared.join(name);
    let _ = std::fs::remove_dir_all(&etc);
    let copied = Command::new("cp")
        .args(["-a", "/etc"])
        .arg(&etc)
        .status()
        .unwrap();
    assert!(copied.success());
    etc
}

/// `cudabudget install --system --lib-only DIR` as root, in a private mount namespace
/// whose /etc is a copy (the machine's own /etc/ld.so.preload is never written). Returns
/// its output, and whether the copy's ld.so.preload stayed as it was.
fn install_system_sandboxed(t: &Tenants, name: &str, dir: &Path) -> (Output, bool) {
    let real_before = std::fs::read("/etc/ld.so.preload").ok();
    let etc = copy_of_etc(t, &format!("etc-copy-{name}"));
    let copy_before = std::fs::read(etc.join("ld.so.preload")).ok();
    let script = r#"set -e
mount --make-rprivate /
mount --bind "$CB_ETC" /etc
[ "$(stat -c %d:%i /etc)" = "$(stat -c %d:%i "$CB_ETC")" ] || { echo "not bound" >&2; exit 99; }
exec "$CB_CLI" install --system --lib-only "$CB_DIR"
"#;
    let out = output(
        Command::new("unshare")
            .args(["-m", "--", "sh", "-c", script])
            .env_remove("LD_PRELOAD")
            .env("CUDABUDGET_LIB", fresh_library())
            .env("CB_ETC", &etc)
            .env("CB_CLI", BIN)
            .env("CB_DIR", dir),
    );
    assert_eq!(
        std::fs::read("/etc/ld.so.preload").ok(),
        real_before,
        "the machine's own /etc/ld.so.preload changed"
    );
    let unchanged = std::fs::read(etc.join("ld.so.preload")).ok() == copy_before;
    let _ = std::fs::remove_dir_all(&etc);
    (out, unchanged)
}

#[test]
fn install_system_refuses_a_directory_under_one_others_may_write_naming_it() {
    let Some(t) = Tenants::get() else { return };
    if !unshare_permitted() {
        crate::util::skip("unshare -m is not permitted here (a private mount namespace is needed)");
        return;
    }
    let mut cases = Vec::new();
    // Under the system's temporary directory.
    let under_tmp = crate::util::test_dir().join("system-under-tmp/lib");
    std::fs::create_dir_all(&under_tmp).unwrap();
    match crate::util::first_open_ancestor(under_tmp.parent().unwrap()) {
        Some(open) => cases.push(("tmp", under_tmp, open, String::new())),
        None => crate::util::skip("the temporary directory is closed to other users here"),
    }
    // Under a sticky world-writable directory (as /tmp, /var/tmp, /dev/shm are).
    let sticky = t.sticky_dir("system-sticky");
    cases.push(("sticky", sticky.join("opt/lib"), sticky, String::new()));
    // Under a directory of mallory's that her group may write.
    let theirs = mallorys_dir(t, "system-theirs", 0o775);
    let owner = format!("uid {}", t.mallory.uid);
    cases.push(("theirs", theirs.join("lib"), theirs, owner));
    for (name, dir, open, words) in cases {
        std::fs::create_dir_all(&dir).unwrap();
        let (out, unchanged) = install_system_sandboxed(t, name, &dir);
        let said = stderr(&out);
        assert_eq!(out.status.code(), Some(125), "{name}: {said}");
        assert!(
            said.contains(&format!("{} cannot be trusted", open.display()))
                && said.contains(&words),
            "{name}: the line names {}: {said}",
            open.display()
        );
        assert_eq!(said.trim_end().lines().count(), 1, "{name}: {said}");
        assert!(stdout(&out).is_empty(), "{name}: no LD_PRELOAD line");
        assert!(unchanged, "{name}: ld.so.preload was written");
        assert!(!dir.join("libcudabudget.so").exists(), "{name}");
    }
}
