//! Places other users can reach: `/tmp`, `/dev/shm`, a directory or file named by a
//! variable. Nothing there is trusted by its name.
//!
//! The discipline (OpenSSH's `safe_path`, systemd's `openat` walk):
//! - [`Dir::open_trusted`] resolves a directory once, then walks it from `/` with
//!   `O_NOFOLLOW`, one component at a time, and accepts it only if every component is
//!   a directory owned by root or by us that nobody else may write (a sticky
//!   world-writable directory such as `/tmp` passes: others cannot remove or rename what
//!   is ours in it). That suits the runtime files, which live and die with their
//!   processes in `/dev/shm`.
//! - [`Dir::open_closed`] is the stricter walk for what is installed or preloaded: no
//!   directory from `/` may be writable by anyone but its owner (root or us), sticky or
//!   not. A path under `/tmp` outlives what is ours there (a cleaner removes it), and
//!   whoever recreates it then decides what it names.
//! - [`Dir::private`] is our own directory inside a trusted one (`cudabudget-<uid>`),
//!   created 0700 or accepted only when we own it and nobody else may write it. Inside
//!   it, no other user can create, replace or rename anything, so names there are ours.
//! - [`Dir::open_file`] opens a file inside a verified directory by `openat` with
//!   `O_NOFOLLOW | O_NONBLOCK` and checks the descriptor (regular file, owner, mode,
//!   one link) before anything is read or written; the caller then uses the
//!   descriptor, never the name again.
//!
//! A refusal is a [`PlaceError`] whose `Display` is the one line a user gets: the path
//! in the way and why.

use std::ffi::{CString, OsStr};
use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// The effective user id: who a place must belong to.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Why a place cannot be used.
#[derive(Debug)]
pub enum PlaceError {
    /// The name is taken by something that is not ours (another user's file or
    /// directory, a link, a directory where a file belongs).
    Taken {
        path: PathBuf,
        /// What is there, in words ("a directory of uid 1001", "a symbolic link").
        what: String,
    },
    /// A directory on the way can be changed by another user.
    Untrusted { path: PathBuf, why: String },
    /// A system call failed.
    Io { path: PathBuf, error: io::Error },
}

impl PlaceError {
    /// The path the error is about.
    pub fn path(&self) -> &Path {
        match self {
            PlaceError::Taken { path, .. }
            | PlaceError::Untrusted { path, .. }
            | PlaceError::Io { path, .. } => path,
        }
    }

    /// True when someone else's object holds the name (as opposed to a failure).
    pub fn is_taken(&self) -> bool {
        matches!(self, PlaceError::Taken { .. })
    }

    /// A failure of a call on `path`.
    pub fn io(path: &Path, error: io::Error) -> PlaceError {
        PlaceError::Io {
            path: path.to_path_buf(),
            error,
        }
    }
}

impl fmt::Display for PlaceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlaceError::Taken { path, what } => {
                write!(f, "{} is taken by {what}", path.display())
            }
            PlaceError::Untrusted { path, why } => {
                write!(f, "{} cannot be trusted: {why}", path.display())
            }
            PlaceError::Io { path, error } => write!(f, "{}: {error}", path.display()),
        }
    }
}

impl std::error::Error for PlaceError {}

/// The metadata of an open descriptor.
pub fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of a plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is a live descriptor (borrowed) and `st` a valid out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// The metadata of `name` in directory `dir`, without following a link.
fn stat_nofollow(dir: BorrowedFd<'_>, name: &CString) -> io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of a plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `dir` is a live descriptor (borrowed), `name` NUL-terminated and `st` a
    // valid out-pointer.
    let rc = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

fn c_name(path: &Path, name: &OsStr) -> Result<CString, PlaceError> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes == b"." || bytes == b".." || bytes.contains(&b'/') {
        return Err(PlaceError::Untrusted {
            path: path.join(name),
            why: "not a single file name".to_string(),
        });
    }
    CString::new(bytes).map_err(|_| PlaceError::Untrusted {
        path: path.join(name),
        why: "the name holds a NUL byte".to_string(),
    })
}

fn openat(
    dir: RawFd,
    name: &CString,
    flags: libc::c_int,
    mode: libc::mode_t,
) -> io::Result<OwnedFd> {
    // SAFETY: `dir` is a live directory descriptor (or AT_FDCWD), `name` is
    // NUL-terminated; flags and mode are plain integers.
    let fd = unsafe { libc::openat(dir, name.as_ptr(), flags, libc::c_uint::from(mode)) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned to us by openat and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn owner_words(uid: u32) -> String {
    if uid == 0 {
        "root".to_string()
    } else {
        format!("uid {uid}")
    }
}

fn kind_words(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => "a directory",
        libc::S_IFREG => "a file",
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR | libc::S_IFBLK => "a device",
        _ => "something else",
    }
}

/// What an object at a taken name is, in words.
fn describe(st: &libc::stat) -> String {
    format!("{} of {}", kind_words(st.st_mode), owner_words(st.st_uid))
}

/// A directory that was verified and is held open. Everything inside it is reached
/// through its descriptor.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
    owner: u32,
}

impl Dir {
    /// `path` (absolute), if every directory from `/` to it is owned by root or by us
    /// and writable by nobody else (sticky world-writable directories pass). Symbolic
    /// links on the way are resolved once, first; the walk itself follows none, so a
    /// link swapped in meanwhile fails the walk instead of redirecting it.
    pub fn open_trusted(path: &Path) -> Result<Dir, PlaceError> {
        Dir::open_trusted_for(path, euid())
    }

    /// [`Dir::open_trusted`] on behalf of user `me` (root reading a user's own places,
    /// such as `/run/user/<uid>`): every component root's or `me`'s, writable by nobody
    /// else unless sticky.
    pub fn open_trusted_for(path: &Path, me: u32) -> Result<Dir, PlaceError> {
        Dir::walk(path, me, Way::StickyPasses)
    }

    /// `path` (absolute), if every directory from `/` to it is owned by root or by us
    /// and writable by nobody else, sticky or not: a place for what other processes
    /// will load by name later (an installed library, a preloaded copy). `/tmp`,
    /// `/var/tmp`, `/dev/shm` and anything under them are refused, naming the directory.
    pub fn open_closed(path: &Path) -> Result<Dir, PlaceError> {
        Dir::walk(path, euid(), Way::Closed)
    }

    fn walk(path: &Path, me: u32, way: Way) -> Result<Dir, PlaceError> {
        if !path.is_absolute() {
            return Err(PlaceError::Untrusted {
                path: path.to_path_buf(),
                why: "not an absolute path".to_string(),
            });
        }
        let real = std::fs::canonicalize(path).map_err(|e| PlaceError::io(path, e))?;
        let root = CString::new("/").expect("no NUL");
        let mut fd = openat(
            libc::AT_FDCWD,
            &root,
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            0,
        )
        .map_err(|e| PlaceError::io(Path::new("/"), e))?;
        let mut walked = PathBuf::from("/");
        let mut st = fstat(fd.as_fd()).map_err(|e| PlaceError::io(&walked, e))?;
        check_on_the_way(&walked, &st, me, way)?;
        for component in real.components() {
            let Component::Normal(name) = component else {
                continue;
            };
            walked.push(name);
            let cname = c_name(&walked, name)?;
            fd = openat(
                fd.as_raw_fd(),
                &cname,
                libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0,
            )
            .map_err(|e| match e.raw_os_error() {
                // Not a directory (`install /etc/passwd`: the path was resolved, links
                // and all, just before), or a link or other thing put there since.
                Some(libc::ELOOP) | Some(libc::ENOTDIR) => {
                    match stat_nofollow(fd.as_fd(), &cname) {
                        Ok(st)
                            if !matches!(
                                st.st_mode & libc::S_IFMT,
                                libc::S_IFDIR | libc::S_IFLNK
                            ) =>
                        {
                            PlaceError::io(&walked, e)
                        }
                        _ => PlaceError::Untrusted {
                            path: walked.clone(),
                            why: "it changed while it was being checked".to_string(),
                        },
                    }
                }
                _ => PlaceError::io(&walked, e),
            })?;
            st = fstat(fd.as_fd()).map_err(|e| PlaceError::io(&walked, e))?;
            check_on_the_way(&walked, &st, me, way)?;
        }
        Ok(Dir {
            fd,
            path: real,
            owner: st.st_uid,
        })
    }

    /// Our own directory `name` inside this one: created with `mode` (at most 0755) if
    /// missing; accepted only if it is a directory (not a link), owned by us, that
    /// nobody else may write. Anything else at the name is [`PlaceError::Taken`].
    pub fn private(&self, name: &str, mode: u32) -> Result<Dir, PlaceError> {
        let path = self.path.join(name);
        let cname = c_name(&self.path, OsStr::new(name))?;
        // SAFETY: `self.fd` is a live directory descriptor and `cname` NUL-terminated.
        let made = unsafe {
            libc::mkdirat(
                self.fd.as_raw_fd(),
                cname.as_ptr(),
                (mode & 0o755) as libc::mode_t,
            )
        };
        if made != 0 {
            let error = io::Error::last_os_error();
            if error.raw_os_error() != Some(libc::EEXIST) {
                return Err(PlaceError::io(&path, error));
            }
        }
        self.open_dir_of(name, euid())
    }

    /// The directory `name` inside this one that belongs to `owner` (another user's, for
    /// a reader such as root's exporter): opened without following a link, accepted only
    /// if it is a directory owned by `owner` that nobody else may write. Nothing is
    /// created. Anything else at the name is [`PlaceError::Taken`]; nothing there is
    /// [`PlaceError::Io`] with `NotFound`.
    pub fn open_dir_of(&self, name: &str, owner: u32) -> Result<Dir, PlaceError> {
        let path = self.path.join(name);
        let cname = c_name(&self.path, OsStr::new(name))?;
        let fd = match openat(
            self.fd.as_raw_fd(),
            &cname,
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0,
        ) {
            Ok(fd) => fd,
            Err(error)
                if matches!(
                    error.raw_os_error(),
                    Some(libc::ELOOP) | Some(libc::ENOTDIR)
                ) =>
            {
                return Err(PlaceError::Taken {
                    what: self.what_is(&cname),
                    path,
                });
            }
            Err(error) => return Err(PlaceError::io(&path, error)),
        };
        let st = fstat(fd.as_fd()).map_err(|e| PlaceError::io(&path, e))?;
        if st.st_uid != owner {
            return Err(PlaceError::Taken {
                what: describe(&st),
                path,
            });
        }
        if st.st_mode & 0o022 != 0 {
            return Err(PlaceError::Untrusted {
                path,
                why: format!("others may write it (mode {:o})", st.st_mode & 0o7777),
            });
        }
        Ok(Dir { fd, path, owner })
    }

    /// Opens `name` in this directory with `open` (see [`FileOpen`]) and checks the
    /// descriptor: a regular file with one link, owned by us, that nobody else may
    /// write. Links are never followed; a FIFO or device never blocks the open.
    pub fn open_file(&self, name: &str, open: FileOpen) -> Result<File, PlaceError> {
        self.open_file_of(name, open, euid())
    }

    /// [`Dir::open_file`] for a file that must belong to `owner` (a reader of another
    /// user's files, such as root's exporter).
    pub fn open_file_of(&self, name: &str, open: FileOpen, owner: u32) -> Result<File, PlaceError> {
        let path = self.path.join(name);
        let cname = c_name(&self.path, OsStr::new(name))?;
        let mut flags = libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY;
        flags |= match open.access {
            Access::Read => libc::O_RDONLY,
            Access::ReadWrite => libc::O_RDWR,
            Access::Append => libc::O_WRONLY | libc::O_APPEND,
        };
        match open.create {
            Create::No => {}
            Create::IfMissing => flags |= libc::O_CREAT,
            Create::New => flags |= libc::O_CREAT | libc::O_EXCL,
        }
        let fd = match openat(
            self.fd.as_raw_fd(),
            &cname,
            flags,
            (open.mode & 0o644) as libc::mode_t,
        ) {
            Ok(fd) => fd,
            // A link (ELOOP), a FIFO without a reader (ENXIO), a directory (EISDIR),
            // another user's file (EACCES): say what is in the way.
            Err(error) => {
                return Err(match self.stat_at(name) {
                    Ok(st) if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_uid != owner => {
                        PlaceError::Taken {
                            what: describe(&st),
                            path,
                        }
                    }
                    _ => PlaceError::io(&path, error),
                });
            }
        };
        let st = fstat(fd.as_fd()).map_err(|e| PlaceError::io(&path, e))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_uid != owner {
            return Err(PlaceError::Taken {
                what: describe(&st),
                path,
            });
        }
        if st.st_nlink != 1 {
            return Err(PlaceError::Untrusted {
                path,
                why: format!("it has {} hard links", st.st_nlink),
            });
        }
        if st.st_mode & 0o022 != 0 {
            return Err(PlaceError::Untrusted {
                path,
                why: format!("others may write it (mode {:o})", st.st_mode & 0o7777),
            });
        }
        Ok(File::from(fd))
    }

    /// Removes `name` (a file) from this directory. Only what is inside a verified
    /// directory is ever removed, by name relative to its descriptor.
    pub fn remove_file(&self, name: &str) -> io::Result<()> {
        let cname = c_name(&self.path, OsStr::new(name)).map_err(io::Error::other)?;
        // SAFETY: `self.fd` is a live directory descriptor and `cname` NUL-terminated.
        if unsafe { libc::unlinkat(self.fd.as_raw_fd(), cname.as_ptr(), 0) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Renames `from` to `to`, both in this directory (an atomic replace).
    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let a = c_name(&self.path, OsStr::new(from)).map_err(io::Error::other)?;
        let b = c_name(&self.path, OsStr::new(to)).map_err(io::Error::other)?;
        let fd = self.fd.as_raw_fd();
        // SAFETY: both descriptors are this live directory; both names NUL-terminated.
        if unsafe { libc::renameat(fd, a.as_ptr(), fd, b.as_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The names in this directory (without `.` and `..`), at most `limit` of them, so
    /// that a directory filled with junk costs a bounded look.
    pub fn names(&self, limit: usize) -> io::Result<Vec<std::ffi::OsString>> {
        self.names_where(limit, |_| true)
    }

    /// The names in this directory that `keep` accepts, at most `limit` of them: every
    /// entry is looked at, so names another user piles up in a shared directory cannot
    /// push those we look for past the limit (each costs one look, nothing is kept).
    pub fn names_where(
        &self,
        limit: usize,
        keep: impl Fn(&[u8]) -> bool,
    ) -> io::Result<Vec<std::ffi::OsString>> {
        let dot = CString::new(".").expect("no NUL");
        let fd = openat(
            self.fd.as_raw_fd(),
            &dot,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            0,
        )?;
        let raw = fd.as_raw_fd();
        // SAFETY: `raw` is an open directory descriptor we own; fdopendir takes it over
        // (closedir below closes it), so the OwnedFd must not close it too.
        let dir = unsafe { libc::fdopendir(raw) };
        if dir.is_null() {
            return Err(io::Error::last_os_error());
        }
        std::mem::forget(fd);
        let mut names = Vec::new();
        while names.len() < limit {
            // SAFETY: `dir` is the open stream from fdopendir, used by this thread only.
            let entry = unsafe { libc::readdir(dir) };
            if entry.is_null() {
                break;
            }
            // SAFETY: readdir returned a valid entry whose d_name is NUL-terminated and
            // lives until the next readdir on `dir`; it is copied out at once.
            let name = unsafe { std::ffi::CStr::from_ptr((*entry).d_name.as_ptr()) };
            let bytes = name.to_bytes();
            if bytes != b"." && bytes != b".." && keep(bytes) {
                names.push(OsStr::from_bytes(bytes).to_os_string());
            }
        }
        // SAFETY: `dir` came from fdopendir and is closed once.
        unsafe { libc::closedir(dir) };
        Ok(names)
    }

    /// The metadata of `name` in this directory, without following a link.
    pub fn stat_at(&self, name: &str) -> io::Result<libc::stat> {
        let cname = c_name(&self.path, OsStr::new(name)).map_err(io::Error::other)?;
        stat_nofollow(self.fd.as_fd(), &cname)
    }

    /// The path this directory was verified at (for messages, and for a path that must
    /// be handed to another program: every directory on it is root's or ours and
    /// nobody else may write it, so nobody else can change what it names).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The same directory on a second descriptor (for a holder that outlives this one).
    pub fn try_clone(&self) -> io::Result<Dir> {
        Ok(Dir {
            fd: self.fd.try_clone()?,
            path: self.path.clone(),
            owner: self.owner,
        })
    }

    /// Who owns the directory.
    pub fn owner(&self) -> u32 {
        self.owner
    }

    /// The directory's descriptor (`O_PATH`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn what_is(&self, name: &CString) -> String {
        match stat_nofollow(self.fd.as_fd(), name) {
            Ok(st) => describe(&st),
            Err(_) => "something that cannot be looked at".to_string(),
        }
    }
}

/// How strict a walk from `/` is with the directories on the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    /// Sticky world-writable directories pass (`/dev/shm`, for runtime files).
    StickyPasses,
    /// Nobody but the owner may write any of them ([`Dir::open_closed`]).
    Closed,
}

/// A directory on the way to a trusted one: root's or ours, and writable by nobody else
/// (unless sticky, where `way` lets that pass).
fn check_on_the_way(path: &Path, st: &libc::stat, me: u32, way: Way) -> Result<(), PlaceError> {
    if st.st_uid != 0 && st.st_uid != me {
        return Err(PlaceError::Untrusted {
            path: path.to_path_buf(),
            why: format!("it belongs to {}", owner_words(st.st_uid)),
        });
    }
    let others_write = st.st_mode & 0o022 != 0;
    let sticky = st.st_mode & libc::S_ISVTX != 0;
    let mode = st.st_mode & 0o7777;
    match way {
        Way::StickyPasses if others_write && !sticky => Err(PlaceError::Untrusted {
            path: path.to_path_buf(),
            why: format!("others may write it and it is not sticky (mode {mode:o})"),
        }),
        Way::Closed if others_write => Err(PlaceError::Untrusted {
            path: path.to_path_buf(),
            why: if sticky {
                format!(
                    "others may write it (mode {mode:o}): sticky or not, another user can \
                     create a name there once ours is gone"
                )
            } else {
                format!("others may write it (mode {mode:o})")
            },
        }),
        _ => Ok(()),
    }
}

/// How [`Dir::open_file`] opens.
#[derive(Clone, Copy, Debug)]
pub struct FileOpen {
    pub access: Access,
    pub create: Create,
    /// The mode of a created file (at most 0644).
    pub mode: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    ReadWrite,
    Append,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Create {
    /// The file must exist.
    No,
    /// Created if missing.
    IfMissing,
    /// Created; an existing file is an error.
    New,
}

impl FileOpen {
    /// An existing file, to read.
    pub const READ: FileOpen = FileOpen {
        access: Access::Read,
        create: Create::No,
        mode: 0,
    };
    /// Read and write, created 0600 if missing.
    pub const SHARED_RW: FileOpen = FileOpen {
        access: Access::ReadWrite,
        create: Create::IfMissing,
        mode: 0o600,
    };
    /// Append, created 0600 if missing.
    pub const APPEND: FileOpen = FileOpen {
        access: Access::Append,
        create: Create::IfMissing,
        mode: 0o600,
    };
}

/// How many names a user's directory may have in one shared root: `cudabudget-<uid>`,
/// then `cudabudget-<uid>.1` to `.15` when another user holds the ones before.
pub const USER_DIR_NAMES: u32 = 16;

/// The per-user directory name in a shared root: `cudabudget-<uid>` (the first of
/// [`user_dir_names`]).
pub fn user_dir_name(uid: u32) -> String {
    format!("cudabudget-{uid}")
}

/// The names a user's directory may have in a shared root, in the order every process
/// of the user tries them: `cudabudget-<uid>`, then `cudabudget-<uid>.1` … `.15`. A name
/// another user planted is passed over for the next one; every process of the user, and
/// root's readers, find the same one (a name that is ours stays ours: nobody else can
/// remove or rename it in a sticky directory), whatever its environment says.
pub fn user_dir_names(uid: u32) -> impl Iterator<Item = String> {
    (0..USER_DIR_NAMES).map(move |k| match k {
        0 => user_dir_name(uid),
        k => format!("cudabudget-{uid}.{k}"),
    })
}

/// The user a directory named by [`user_dir_names`] belongs to.
pub fn uid_of_dir_name(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("cudabudget-")?;
    let (digits, k) = match rest.split_once('.') {
        Some((digits, k)) => (digits, Some(k)),
        None => (rest, None),
    };
    let number = |s: &str| {
        (!s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<u64>().ok())
            .flatten()
    };
    if let Some(k) = k
        && !number(k).is_some_and(|k| k >= 1 && k < u64::from(USER_DIR_NAMES))
    {
        return None;
    }
    u32::try_from(number(digits)?).ok()
}

/// Our own directory under `root`: the first of [`user_dir_names`] that is ours or can
/// be made (created with `mode`); what another user holds is passed over and pushed to
/// `in_the_way`. `None` when the root itself cannot be used or every name is taken.
pub fn private_in(root: &Path, mode: u32, in_the_way: &mut Vec<PlaceError>) -> Option<Dir> {
    let dir = match Dir::open_trusted(root) {
        Ok(dir) => dir,
        Err(error) => {
            in_the_way.push(error);
            return None;
        }
    };
    let mut passed = Vec::new();
    for name in user_dir_names(euid()) {
        match dir.private(&name, mode) {
            Ok(mine) => {
                in_the_way.append(&mut passed);
                return Some(mine);
            }
            Err(error) if error.is_taken() || matches!(error, PlaceError::Untrusted { .. }) => {
                passed.push(error)
            }
            Err(error) => {
                in_the_way.append(&mut passed);
                in_the_way.push(error);
                return None;
            }
        }
    }
    // Every name passed over: the first said, the rest in one (a user's line stays short).
    let mut passed = passed.into_iter();
    in_the_way.extend(passed.next());
    if passed.len() > 0 {
        in_the_way.push(PlaceError::Taken {
            path: root.join(format!(
                "{}.1 to .{}",
                user_dir_name(euid()),
                USER_DIR_NAMES - 1
            )),
            what: "other users too (every other name the directory may have)".to_string(),
        });
    }
    None
}

/// Every directory of `owner`'s under `dir` that [`user_dir_names`] names (nothing is
/// created): where a reader (the user, or root for them) finds what the user's processes
/// wrote, whichever name they had to take.
pub fn user_dirs_of(dir: &Dir, owner: u32) -> Vec<Dir> {
    user_dir_names(owner)
        .filter_map(|name| dir.open_dir_of(&name, owner).ok())
        .collect()
}

/// Our own directory for `purpose` under the first root that gives one: each root is
/// tried with [`private_in`]; the roots after the first are the fallbacks a user can
/// always reach and nobody else can take (see [`fallback_roots`]). Returns the directory
/// and what was in the way before it (for the one line a user gets, and `doctor`).
pub fn first_private(roots: &[PathBuf], mode: u32) -> (Option<Dir>, Vec<PlaceError>) {
    let mut in_the_way = Vec::new();
    for root in roots {
        if let Some(dir) = private_in(root, mode, &mut in_the_way) {
            return (Some(dir), in_the_way);
        }
    }
    (None, in_the_way)
}

/// The places a user's private directory can fall back to when the shared root's name
/// is taken: `$XDG_RUNTIME_DIR` (the user's own tmpfs) and `$HOME/.cache`. `var` reads
/// a variable (the configuration passes the environment it parsed).
pub fn fallback_roots<'a>(var: impl Fn(&str) -> Option<&'a str>) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    if let Some(dir) = var("XDG_RUNTIME_DIR").filter(|d| d.starts_with('/')) {
        roots.push(PathBuf::from(dir));
    }
    if let Some(home) = var("HOME").filter(|d| d.starts_with('/') && *d != "/") {
        roots.push(Path::new(home).join(".cache"));
    }
    roots
}

impl AsFd for Dir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cb-place-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    #[test]
    fn a_private_directory_is_created_0700_and_found_again() {
        let root = scratch("private");
        let dir = Dir::open_trusted(&root)
            .unwrap()
            .private("mine", 0o700)
            .unwrap();
        assert_eq!(
            std::fs::metadata(dir.path()).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let again = Dir::open_trusted(&root)
            .unwrap()
            .private("mine", 0o700)
            .unwrap();
        assert_eq!(again.path(), dir.path());
    }

    #[test]
    fn a_link_at_a_private_name_is_taken_not_followed() {
        let root = scratch("link");
        std::fs::create_dir(root.join("elsewhere")).unwrap();
        symlink(root.join("elsewhere"), root.join("mine")).unwrap();
        let error = Dir::open_trusted(&root)
            .unwrap()
            .private("mine", 0o700)
            .unwrap_err();
        assert!(error.is_taken(), "{error}");
        assert!(error.to_string().contains("a symbolic link"), "{error}");
    }

    #[test]
    fn a_directory_others_may_write_is_not_trusted_unless_sticky() {
        let root = scratch("open");
        let open = root.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let error = Dir::open_trusted(&open).unwrap_err();
        assert!(error.to_string().contains("not sticky"), "{error}");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(Dir::open_trusted(&open).is_ok());
    }

    #[test]
    fn a_closed_walk_refuses_a_sticky_directory_on_the_way_naming_it() {
        let root = scratch("closed");
        let sticky = root.join("shared");
        std::fs::create_dir(&sticky).unwrap();
        std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let lib = sticky.join("lib");
        std::fs::create_dir(&lib).unwrap();
        std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(
            Dir::open_trusted(&lib).is_ok(),
            "the runtime walk lets sticky pass"
        );
        let error = Dir::open_closed(&lib).unwrap_err();
        // The first directory on the way that others may write: the system's temporary
        // directory when it is one (/tmp), else the sticky one made here.
        let tmp = std::fs::canonicalize(std::env::temp_dir()).unwrap();
        let first_open = tmp
            .ancestors()
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .find(|d| std::fs::metadata(d).unwrap().permissions().mode() & 0o022 != 0)
            .map_or_else(
                || std::fs::canonicalize(&sticky).unwrap(),
                Path::to_path_buf,
            );
        assert_eq!(error.path(), first_open, "{error}");
        assert!(error.to_string().contains("others may write it"), "{error}");
    }

    #[test]
    fn a_fifo_or_link_in_place_of_a_file_is_refused_without_blocking() {
        let root = scratch("fifo");
        let dir = Dir::open_trusted(&root).unwrap();
        let fifo = CString::new(root.join("events").as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let error = dir.open_file("events", FileOpen::APPEND).unwrap_err();
        assert!(error.to_string().contains("a FIFO"), "{error}");
        symlink("/etc/passwd", root.join("other")).unwrap();
        let error = dir.open_file("other", FileOpen::APPEND).unwrap_err();
        assert!(error.is_taken(), "{error}");
        let mut file = dir.open_file("new", FileOpen::APPEND).unwrap();
        std::io::Write::write_all(&mut file, b"x").unwrap();
    }

    #[test]
    fn names_past_the_limit_are_still_found_when_only_those_sought_count() {
        // Another user's junk in a shared directory: only the names sought count toward
        // the limit, so one of ours behind any number of others is found.
        let root = scratch("junk-names");
        for i in 0..200 {
            std::fs::write(root.join(format!("junk-{i}")), b"").unwrap();
        }
        std::fs::create_dir(root.join("cudabudget-7")).unwrap();
        let dir = Dir::open_trusted(&root).unwrap();
        assert_eq!(dir.names(10).unwrap().len(), 10, "a plain look is bounded");
        let ours = |n: &[u8]| std::str::from_utf8(n).is_ok_and(|n| uid_of_dir_name(n).is_some());
        assert_eq!(
            dir.names_where(10, ours).unwrap(),
            vec![std::ffi::OsString::from("cudabudget-7")]
        );
    }

    #[test]
    fn a_users_directory_names_are_read_back_strictly() {
        for name in user_dir_names(1000) {
            assert_eq!(uid_of_dir_name(&name), Some(1000), "{name}");
        }
        assert_eq!(user_dir_names(7).last().unwrap(), "cudabudget-7.15");
        for junk in [
            "cudabudget-",
            "cudabudget-1x",
            "cudabudget-1000.0",
            "cudabudget-1000.16",
            "cudabudget-1000.",
            "cudabudget-.1",
            "cudabudget-99999999999",
            "cudabudget-1000.1.2",
        ] {
            assert_eq!(uid_of_dir_name(junk), None, "{junk}");
        }
    }

    #[test]
    fn a_name_another_user_planted_is_passed_over_for_the_next_and_found_again() {
        if euid() != 0 {
            eprintln!("skipped: needs root to give a directory to another user");
            return;
        }
        let root = scratch("planted");
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let theirs = root.join(user_dir_name(0));
        std::fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(54321), Some(54321)).unwrap();
        let (dir, in_the_way) = first_private(std::slice::from_ref(&root), 0o700);
        let dir = dir.expect("a place in the same root");
        assert_eq!(dir.path(), root.join("cudabudget-0.1"));
        assert_eq!(in_the_way.len(), 1, "{in_the_way:?}");
        assert!(in_the_way[0].to_string().contains("uid 54321"));
        // Once the planted name is gone, a reader still finds the place already made.
        std::fs::remove_dir(&theirs).unwrap();
        let found = user_dirs_of(&Dir::open_trusted(&root).unwrap(), 0);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].path(), root.join("cudabudget-0.1"));
    }

    #[test]
    fn a_directory_of_another_user_at_the_name_is_taken() {
        if euid() != 0 {
            eprintln!("skipped: needs root to give a directory to another user");
            return;
        }
        let root = scratch("taken");
        let theirs = root.join("mine");
        std::fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(54321), Some(54321)).unwrap();
        let error = Dir::open_trusted(&root)
            .unwrap()
            .private("mine", 0o700)
            .unwrap_err();
        assert!(error.is_taken(), "{error}");
        assert!(error.to_string().contains("uid 54321"), "{error}");
        let (dir, in_the_way) = first_private(&[root.clone(), scratch("fallback")], 0o700);
        assert!(dir.is_some());
        assert_eq!(
            in_the_way.len(),
            0,
            "the test's own name is not cudabudget-<uid>"
        );
    }
}
