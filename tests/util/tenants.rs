//! Tenants: tests that replay what another user on the node can do. As root (CI is
//! root) they create two unprivileged users, `cbalice` (the victim) and `cbmallory`,
//! and run commands as them with `setpriv`. Not root: [`Tenants::get`] says so and the
//! test returns (skipped).
//!
//! The build under `target/` may sit under a directory other users cannot enter
//! (`/root`), so [`Tenants::share`] copies what a tenant must run or load into a
//! world-readable directory first.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// One unprivileged user.
#[derive(Clone, Debug)]
pub struct User {
    pub name: &'static str,
    pub uid: u32,
    pub gid: u32,
}

/// The two tenants, created once per test binary.
#[derive(Debug)]
pub struct Tenants {
    pub alice: User,
    pub mallory: User,
    /// World-readable (0755) scratch directory holding shared copies; no other user
    /// can write it or any directory above it.
    pub shared: PathBuf,
}

fn ensure_user(name: &'static str) -> Option<User> {
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id").arg(flag).arg(name).output().ok()?;
        String::from_utf8(out.stdout).ok()?.trim().parse().ok()
    };
    if id("-u").is_none() {
        // Another test binary may be creating it at the same moment: look again after.
        let _ = Command::new("useradd")
            .args([
                "--no-create-home",
                "--shell",
                "/bin/sh",
                "--user-group",
                name,
            ])
            .output();
    }
    Some(User {
        name,
        uid: id("-u")?,
        gid: id("-g")?,
    })
}

impl Tenants {
    /// The tenants, or `None` (with a line saying the test is skipped) when this is not
    /// root or users cannot be made.
    pub fn get() -> Option<&'static Tenants> {
        static TENANTS: OnceLock<Option<Tenants>> = OnceLock::new();
        let tenants = TENANTS.get_or_init(|| {
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } != 0 {
                return None;
            }
            let alice = ensure_user("cbalice")?;
            let mallory = ensure_user("cbmallory")?;
            // Closed to other users all the way from `/` (as an operator's install is):
            // what a tenant loads from here, `run` and `install` accept.
            let shared = super::closed_binary_dir().join("tenants");
            let _ = std::fs::remove_dir_all(&shared);
            std::fs::create_dir_all(&shared).ok()?;
            std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).ok()?;
            Some(Tenants {
                alice,
                mallory,
                shared,
            })
        });
        if tenants.is_none() {
            super::skip("the tenants' tests need root (to create users and run as them)");
        }
        tenants.as_ref()
    }

    /// A world-readable copy of `file` (a binary or library) that the tenants can run
    /// or load, under its own file name. Copied once per name.
    pub fn share(&self, file: &Path) -> PathBuf {
        self.share_to(&self.shared, file)
    }

    /// A world-readable copy of `file` alone in a directory of its own (`name`, 0755)
    /// under the shared directory: a CLI there has no library beside it.
    pub fn share_alone(&self, name: &str, file: &Path) -> PathBuf {
        let dir = self.shared.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        self.share_to(&dir, file)
    }

    fn share_to(&self, dir: &Path, file: &Path) -> PathBuf {
        let to = dir.join(file.file_name().expect("a file name"));
        if !to.exists() {
            // One partial copy per caller: tests of one binary share files at once.
            static COPIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let partial = to.with_extension(format!("partial{n}"));
            std::fs::copy(file, &partial).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o755)).unwrap();
            std::fs::rename(&partial, &to).unwrap();
        }
        to
    }

    /// A world-readable copy of a whole directory (the fake driver's); safe to call from
    /// several tests at once (each file is linked in whole).
    pub fn share_dir(&self, dir: &Path) -> PathBuf {
        let to = self.shared.join(dir.file_name().expect("a directory name"));
        {
            std::fs::create_dir_all(&to).unwrap();
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).unwrap();
            for entry in std::fs::read_dir(dir).unwrap() {
                let entry = entry.unwrap();
                if entry.file_type().unwrap().is_file() {
                    self.share(&entry.path());
                    let shared = self.shared.join(entry.file_name());
                    let target = to.join(entry.file_name());
                    if !target.exists() {
                        let _ = std::fs::hard_link(&shared, &target);
                    }
                }
            }
        }
        to
    }

    /// A directory owned by `user` (0700) under the shared scratch directory, e.g. a
    /// home or a private runtime directory.
    pub fn home_of(&self, user: &User) -> PathBuf {
        let home = self.shared.join(format!("home-{}", user.name));
        std::fs::create_dir_all(&home).unwrap();
        std::os::unix::fs::chown(&home, Some(user.uid), Some(user.gid)).unwrap();
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
        home
    }

    /// A world-writable sticky directory (like `/tmp` or `/dev/shm`) for one test, so
    /// tests do not meet each other in the real ones.
    pub fn sticky_dir(&self, name: &str) -> PathBuf {
        let dir = self.shared.join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        dir
    }
}

/// `program args…` run as `user`: real and effective ids and groups switched with
/// `setpriv`, an environment with nothing of root's but `PATH` (the caller adds what the
/// test needs), `HOME` the user's own scratch home, and job ledgers and records in
/// shared directories of the test's own (world-writable and sticky, as `/dev/shm`) unless
/// the caller names others.
pub fn as_user(tenants: &Tenants, user: &User, program: &Path, args: &[&str]) -> Command {
    let test = super::test_dir();
    let name = test.file_name().unwrap().to_string_lossy();
    let places = tenants.shared.join(format!("places-{name}"));
    for dir in ["jobs", "runtime"] {
        let dir = places.join(dir);
        if !dir.is_dir() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::set_permissions(&places, std::fs::Permissions::from_mode(0o755)).unwrap();
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        }
    }
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={}", user.uid))
        .arg(format!("--regid={}", user.gid))
        .arg("--clear-groups")
        .arg("--")
        .arg(program)
        .args(args)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", tenants.home_of(user))
        .env("CUDABUDGET_JOB_DIR", places.join("jobs"))
        .env("CUDABUDGET_RUNTIME_DIR", places.join("runtime"))
        .current_dir(&tenants.shared);
    cmd
}
