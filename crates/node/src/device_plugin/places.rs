//! Where the device plugin puts things on the node and where containers see them.
//!
//! Each allocation (a set of units) gets a private runtime directory on the node,
//! `<runtime-dir>/alloc/<hash of its unit IDs>`, mounted into the container: its
//! processes publish their records (`records/`) and share their budget's ledger (`jobs/`)
//! there, and no other pod can see or touch them. `<runtime-dir>` and `alloc/` are
//! root's, 0700: nobody but root on the node reaches what is below. `records/` and
//! `jobs/` are 1777 like `/dev/shm`, since the container's processes may run as any
//! user; the library keeps a directory of its own per user under them.
//!
//! A fresh directory for each allocation: the kubelet tells a device plugin when units
//! are given, never when they come back, so the directory is named by the set of units
//! (`<hash>`) and, when that set is given again, what the previous container left there
//! (it is gone: the kubelet gives a unit to one container at a time) is removed first, so
//! that no pod sees another's records or joins another's ledger. There is at most one
//! directory per set of units the kubelet ever chose, in practice a few per container
//! size; `<runtime-dir>` is on tmpfs (`/run`) by default, so a reboot empties it.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

pub struct Places {
    /// The node's library directory (the installer's `<libraryDir>/current`).
    pub library_dir: PathBuf,
    /// Where containers see it, read-only; `LD_PRELOAD` names `libcudabudget.so` there.
    pub library_mount: String,
    /// The root of the private runtime directories.
    pub runtime_dir: PathBuf,
    /// Where a container sees its private runtime directory.
    pub runtime_mount: String,
}

/// FNV-1a, 64 bits: a name that stays the same across restarts and builds.
fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Makes `path` a directory of this user's with `mode`, or checks that it is one: opened
/// without following a link in its last component (the only one a container can change:
/// `records` and `jobs` are in its mount), checked and changed on the descriptor.
fn directory(path: &Path, mode: u32) -> io::Result<()> {
    let named = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", path.display()));
    match fs::DirBuilder::new().mode(mode).create(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(named(e)),
    }
    let directory = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            named(io::Error::new(
                e.kind(),
                format!("not a directory to use ({e})"),
            ))
        })?;
    let meta = directory.metadata().map_err(named)?;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != euid {
        return Err(io::Error::other(format!(
            "{} is not a directory of this user's (uid {euid}); remove it",
            path.display()
        )));
    }
    // The umask narrowed what mkdir made; an old one may be wider.
    if meta.mode() & 0o7777 != mode {
        directory
            .set_permissions(fs::Permissions::from_mode(mode))
            .map_err(named)?;
    }
    Ok(())
}

impl Places {
    /// Makes the runtime root (0700).
    pub fn prepare(&self) -> io::Result<()> {
        if let Some(parent) = self.runtime_dir.parent() {
            fs::create_dir_all(parent)?;
        }
        directory(&self.runtime_dir, 0o700)?;
        directory(&self.runtime_dir.join("alloc"), 0o700)
    }

    /// The private runtime directory of the allocation of `ids`, made if new.
    pub fn private_dir(&self, ids: &[String]) -> io::Result<PathBuf> {
        let mut sorted: Vec<&str> = ids.iter().map(String::as_str).collect();
        sorted.sort_unstable();
        let hash = fnv1a(sorted.join("\n").into_bytes());
        self.prepare()?;
        let alloc = self.runtime_dir.join("alloc");
        let dir = alloc.join(format!("{hash:016x}"));
        // What the previous container of these units left: renamed away at once (a
        // container's mount follows the directory, not its name), then removed, never
        // following a link (remove_dir_all does not).
        if fs::symlink_metadata(&dir).is_ok() {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let stale = alloc.join(format!(".stale-{hash:016x}-{nanos}"));
            fs::rename(&dir, &stale)?;
            if let Err(e) = fs::remove_dir_all(&stale) {
                eprintln!(
                    "cudabudget-node device-plugin: cannot remove {} ({e}); it stays",
                    stale.display()
                );
            }
        }
        directory(&dir, 0o755)?;
        directory(&dir.join("records"), 0o1777)?;
        directory(&dir.join("jobs"), 0o1777)?;
        Ok(dir)
    }

    pub fn library_in_container(&self) -> String {
        format!("{}/libcudabudget.so", self.library_mount)
    }

    pub fn records_in_container(&self) -> String {
        format!("{}/records", self.runtime_mount)
    }

    pub fn jobs_in_container(&self) -> String {
        format!("{}/jobs", self.runtime_mount)
    }
}
