//! Which `libcudabudget.so` to preload, the copy this binary carries, and whether a
//! library loads here.
//!
//! The library is `$CUDABUDGET_LIB`, else the one next to this binary (a build tree, an
//! install directory, a wheel), else the copy built into this binary (what `cargo
//! install` gives), written once per version to a per-user cache directory.
//!
//! Whatever is preloaded comes from a place no other user can change (see
//! [`check_unchangeable`] and `cudabudget_spec::place`): a library another user could
//! replace would run their code in every process of ours. The carried copy is written
//! through directory descriptors into directories of ours, none under a directory
//! another user may write (sticky or not); when a place is refused, it goes to the next
//! and one line says what was in the way.

use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cudabudget_spec::place::{self, Access, Create, Dir, FileOpen, PlaceError};

use cudabudget_cli_common::tell::{Refusal, usage};
use cudabudget_spec::{config, record};

pub const LIBRARY_NAME: &str = "libcudabudget.so";

/// The library built into this binary: the cdylib the build script built under its
/// `OUT_DIR` (`cfg(cudabudget_embed)`); empty where it built none (clippy,
/// `CUDABUDGET_NO_EMBED=1`).
#[cfg(cudabudget_embed)]
static EMBEDDED: &[u8] = include_bytes!(env!("CB_BUILD_EMBED_LIBRARY"));
#[cfg(not(cudabudget_embed))]
static EMBEDDED: &[u8] = &[];

/// The library this binary carries, if it carries one.
pub fn embedded() -> Option<&'static [u8]> {
    EMBEDDED.starts_with(b"\x7fELF").then_some(EMBEDDED)
}

/// Where the library to preload came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// `$CUDABUDGET_LIB`.
    Variable,
    /// Next to this binary.
    BesideBinary,
    /// The copy this binary carries, written to the cache directory.
    Embedded,
}

impl Origin {
    pub fn describe(self) -> &'static str {
        match self {
            Origin::Variable => "from CUDABUDGET_LIB",
            Origin::BesideBinary => "next to the cudabudget binary",
            Origin::Embedded => "carried by the cudabudget binary, written to the cache",
        }
    }
}

pub struct Library {
    /// Absolute and canonical; every directory on it is root's or this user's and
    /// nobody else may write it, so no other user can change what it names.
    pub path: PathBuf,
    pub origin: Origin,
    /// When the carried copy could not go to its usual place because another user's
    /// object holds a name on the way: that object, and where the copy went instead
    /// (one line, for `run` and `doctor`).
    pub in_the_way: Option<String>,
}

/// A library that could be preloaded from a place another user can change, or none
/// could be placed where nobody else can: nothing is run. (125, as `env` and `nohup`
/// report their own failures.)
pub const EXIT_UNSAFE_LIBRARY: u8 = 125;

fn unsafe_library(message: impl Into<String>) -> Refusal {
    Refusal {
        message: message.into(),
        status: EXIT_UNSAFE_LIBRARY,
    }
}

/// The library to preload (see the module's docs), as an absolute path that
/// `LD_PRELOAD` can carry and that no other user can change.
pub fn find() -> Result<Library, Refusal> {
    let library = match std::env::var_os(config::LIB) {
        Some(path) => {
            let path = std::fs::canonicalize(&path)
                .ok()
                .filter(|p| p.is_file())
                .ok_or_else(|| {
                    usage(format!(
                        "{}={:?} does not name an existing file; point it at {LIBRARY_NAME} \
                         or unset it to use the one next to this binary",
                        config::LIB,
                        path.to_string_lossy()
                    ))
                })?;
            check_unchangeable(&path).map_err(|why| {
                unsafe_library(format!(
                    "{}={}: {why}; nothing was run (another user could put their own code \
                     in your processes): use a copy only you or root can change",
                    config::LIB,
                    path.display()
                ))
            })?;
            Library {
                path,
                origin: Origin::Variable,
                in_the_way: None,
            }
        }
        None => {
            let dir = std::env::current_exe()
                .ok()
                .and_then(|exe| exe.parent().map(Path::to_path_buf));
            match dir.as_deref().and_then(beside_binary) {
                Some(path) => {
                    check_unchangeable(&path).map_err(|why| {
                        unsafe_library(format!(
                            "{}: {why}; nothing was run (another user could put their own \
                             code in your processes): reinstall it where only you or root \
                             can change it, or set {} to such a copy",
                            path.display(),
                            config::LIB
                        ))
                    })?;
                    Library {
                        path,
                        origin: Origin::BesideBinary,
                        in_the_way: None,
                    }
                }
                None => match embedded() {
                    Some(bytes) => {
                        let (path, in_the_way) = write_to_cache(bytes).map_err(|reason| {
                            unsafe_library(format!(
                                "cannot write out the {LIBRARY_NAME} this binary carries \
                                 where only you can change it: {reason}; nothing was run; \
                                 set {} to a copy of the library",
                                config::LIB
                            ))
                        })?;
                        Library {
                            path,
                            origin: Origin::Embedded,
                            in_the_way,
                        }
                    }
                    None => {
                        let place = dir.map_or_else(
                            || "next to this binary (whose location is unknown)".to_string(),
                            |d| format!("in {:?} (next to this binary)", d.display().to_string()),
                        );
                        return Err(usage(format!(
                            "cannot find {LIBRARY_NAME}: looked {place}, and this binary \
                             carries no copy; build it with `cargo build` or set {} to its path",
                            config::LIB
                        )));
                    }
                },
            }
        }
    };
    if !preloadable_path(&library.path) {
        return Err(usage(format!(
            "{:?} contains ':' or whitespace, which LD_PRELOAD cannot carry; \
             install the library under a plainer path",
            library.path.display().to_string()
        )));
    }
    Ok(library)
}

/// ld.so splits `LD_PRELOAD` at ':' and spaces: such a path cannot be expressed.
pub fn preloadable_path(path: &Path) -> bool {
    !path
        .as_os_str()
        .as_bytes()
        .iter()
        .any(|b| b" :\t\n".contains(b))
}

/// The library installed next to the binary in `dir`, canonical.
fn beside_binary(dir: &Path) -> Option<PathBuf> {
    let path = std::fs::canonicalize(dir.join(LIBRARY_NAME)).ok()?;
    std::fs::metadata(&path)
        .ok()
        .filter(|m| m.is_file())
        .map(|_| path)
}

/// `Err(why)` unless no other user can change what the canonical `path` names: every
/// directory from `/` is root's or ours and nobody else may write it, sticky or not
/// ([`Dir::open_closed`]: under /tmp the path outlives our file, and whoever recreates
/// it decides what the processes that inherit `LD_PRELOAD` load), and the file is root's
/// or ours and nobody else may write it. The loader opens the path again later; with
/// such a chain it finds the same file.
pub fn check_unchangeable(path: &Path) -> Result<(), String> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name().and_then(OsStr::to_str))
    else {
        return Err("not a plain file path".to_string());
    };
    let dir = Dir::open_closed(parent).map_err(|e| e.to_string())?;
    let st = dir
        .stat_at(name)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(format!("{} is not a regular file", path.display()));
    }
    if st.st_uid != 0 && st.st_uid != place::euid() {
        return Err(format!(
            "{} belongs to uid {}, not to you or root",
            path.display(),
            st.st_uid
        ));
    }
    if st.st_mode & 0o022 != 0 {
        return Err(format!(
            "others may write {} (mode {:o})",
            path.display(),
            st.st_mode & 0o7777
        ));
    }
    Ok(())
}

/// Whether two paths name one file, through symlinks and hard links (cargo hard-links
/// the library it copies next to the binary).
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// A variable that names an absolute directory.
fn absolute_var(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .map(PathBuf::from)
        .filter(|p| p.is_absolute() && p != Path::new("/"))
}

/// Where the carried library may go, best first: a root directory and the names of
/// our own directories under it. `$TMPDIR` only when it is set: the shared `/tmp` is
/// never closed to other users, so it could never be used.
fn cache_places() -> Vec<(PathBuf, Vec<String>)> {
    let mut places = Vec::new();
    if let Some(cache) = absolute_var("XDG_CACHE_HOME") {
        places.push((cache, vec!["cudabudget".to_string()]));
    }
    if let Some(home) = absolute_var("HOME") {
        // An existing ~/.cache may be a link of ours (to a scratch disk): it is resolved
        // and its target checked like any other directory. A missing one is created.
        let cache = home.join(".cache");
        if std::fs::metadata(&cache).is_ok_and(|m| m.is_dir()) {
            places.push((cache, vec!["cudabudget".to_string()]));
        } else {
            places.push((home, vec![".cache".to_string(), "cudabudget".to_string()]));
        }
    }
    if let Some(runtime) = absolute_var("XDG_RUNTIME_DIR") {
        places.push((runtime, vec!["cudabudget".to_string()]));
    }
    if let Some(tmp) = absolute_var("TMPDIR") {
        places.push((tmp, vec![format!("cudabudget-cache-{}", place::euid())]));
    }
    places
}

/// Writes `bytes` (the carried library) once per version to the first cache place that
/// is closed to other users all the way from `/` ([`Dir::open_closed`]), and returns
/// the path of the copy, with a line naming what was in the way of the places before
/// it. The processes of the command inherit `LD_PRELOAD` and load the path again, maybe
/// long after: a place under `/tmp` would be someone else's to fill by then.
fn write_to_cache(bytes: &[u8]) -> Result<(PathBuf, Option<String>), String> {
    let version = format!(
        "{}-{:016x}",
        env!("CARGO_PKG_VERSION"),
        record::fnv1a(bytes)
    );
    let mut in_the_way = Vec::new();
    let mut reasons = Vec::new();
    for (root, names) in cache_places() {
        let placed = Dir::open_closed(&root).and_then(|mut dir| {
            for name in &names {
                dir = dir.private(name, 0o700)?;
            }
            write_version(&dir, &version, bytes)
        });
        match placed {
            Ok(path) => {
                let line = (!in_the_way.is_empty()).then(|| {
                    format!(
                        "{}; the library this binary carries was written to {} instead",
                        in_the_way.join("; "),
                        path.display()
                    )
                });
                return Ok((path, line));
            }
            Err(error) => {
                // What is there and should not be (another's, open to others, a file
                // where a directory belongs) is said; a place that does not exist is not.
                let absent = matches!(&error, PlaceError::Io { error: io, .. }
                    if io.kind() == std::io::ErrorKind::NotFound);
                if !absent {
                    in_the_way.push(error.to_string());
                }
                reasons.push(error.to_string());
            }
        }
    }
    if reasons.is_empty() {
        reasons.push("none of HOME, XDG_CACHE_HOME, XDG_RUNTIME_DIR or TMPDIR is set".into());
    }
    Err(reasons.join("; "))
}

/// `dir/<version>/libcudabudget.so`, our own directory and a verified copy of `bytes`.
fn write_version(dir: &Dir, version: &str, bytes: &[u8]) -> Result<PathBuf, PlaceError> {
    let dir = dir.private(version, 0o700)?;
    let path = dir.path().join(LIBRARY_NAME);
    if !preloadable_path(&path) {
        return Err(PlaceError::Untrusted {
            path,
            why: "':' or whitespace in the path, which LD_PRELOAD cannot carry".to_string(),
        });
    }
    write_verified(&dir, LIBRARY_NAME, bytes, 0o755)?;
    // Every directory from / to `dir` was walked without following links and is root's
    // or ours, writable by nobody else, and the file was verified through its
    // descriptor: no other user can change what this path names, so it is safe to hand
    // to LD_PRELOAD.
    Ok(path)
}

/// `name` in `dir` holding exactly `bytes` with permissions `mode`: the existing file
/// when it is ours, has one link, nobody else may write it and it holds these bytes;
/// else written anew through the directory's descriptor (a temporary name, then a
/// rename, so no process ever maps half a library) and read back through a new
/// descriptor. Never follows a link.
pub fn write_verified(dir: &Dir, name: &str, bytes: &[u8], mode: u32) -> Result<(), PlaceError> {
    let path = dir.path().join(name);
    if let Ok(file) = dir.open_file(name, FileOpen::READ)
        && holds(&file, bytes, mode)
    {
        return Ok(());
    }
    let temporary = format!(".{name}.{}.tmp", std::process::id());
    let _ = dir.remove_file(&temporary);
    let written = (|| {
        let mut file = dir.open_file(
            &temporary,
            FileOpen {
                access: Access::ReadWrite,
                create: Create::New,
                mode: 0o600,
            },
        )?;
        let io = |error| PlaceError::Io {
            path: path.clone(),
            error,
        };
        file.write_all(bytes).map_err(io)?;
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(io)?;
        file.sync_all().map_err(io)?;
        dir.rename(&temporary, name).map_err(io)
    })();
    if written.is_err() {
        let _ = dir.remove_file(&temporary);
    }
    written?;
    let file = dir.open_file(name, FileOpen::READ)?;
    if !holds(&file, bytes, mode) {
        return Err(PlaceError::Untrusted {
            path,
            why: "it does not hold what was just written".to_string(),
        });
    }
    Ok(())
}

/// Whether the open `file` has permissions `mode` and holds exactly `bytes`.
fn holds(file: &std::fs::File, bytes: &[u8], mode: u32) -> bool {
    let Ok(meta) = file.metadata() else {
        return false;
    };
    if meta.mode() & 0o7777 != mode || meta.len() != bytes.len() as u64 {
        return false;
    }
    let mut existing = Vec::with_capacity(bytes.len());
    file.take(bytes.len() as u64 + 1)
        .read_to_end(&mut existing)
        .is_ok()
        && existing == bytes
}

/// Preloads `preload` (the whole `LD_PRELOAD` value the command would get) into a
/// child of this binary and asks it whether `library` is mapped. `Err` is the reason
/// it is not, as the loader gave it.
pub fn probe(preload: &OsStr, library: &Path) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    let mut command = Command::new(&exe);
    command
        .arg("__probe-preload")
        .arg(library)
        .env("LD_PRELOAD", preload)
        .stdin(Stdio::null());
    let output = output_within(command, Duration::from_secs(20))
        .map_err(|e| format!("cannot start a child to try it: {e}"))?;
    if output.status.success() && output.stdout.starts_with(b"loaded") {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let name = library.to_string_lossy();
    let reason = stderr
        .lines()
        .find(|line| line.contains(name.as_ref()) || line.contains("ld.so"))
        .or_else(|| stderr.lines().find(|l| !l.trim().is_empty()))
        .map(|line| {
            // A fatal loader error names the program it was loading: our probe.
            let probe = format!("{}: ", exe.display());
            line.trim().trim_start_matches(probe.as_str()).to_string()
        })
        .unwrap_or_else(|| format!("the loader did not load it ({})", output.status));
    Err(reason)
}

/// Runs `command` with its output captured, killing it after `limit`.
pub fn output_within(mut command: Command, limit: Duration) -> io::Result<std::process::Output> {
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command.spawn()?;
    fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    }
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break child.wait()?;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    Ok(std::process::Output {
        status,
        stdout,
        stderr,
    })
}

/// The `GLIBC_*` versions an ELF shared object needs (its `.gnu.version_r`), e.g.
/// `["GLIBC_2.2.5", "GLIBC_2.34"]`. `Err` when the file is not a 64-bit little-endian
/// ELF file or its tables are out of bounds.
pub fn glibc_versions_needed(elf: &[u8]) -> Result<Vec<String>, String> {
    let u16_at = |at: usize| -> Option<u16> {
        Some(u16::from_le_bytes(elf.get(at..at + 2)?.try_into().ok()?))
    };
    let u32_at = |at: usize| -> Option<u32> {
        Some(u32::from_le_bytes(elf.get(at..at + 4)?.try_into().ok()?))
    };
    let u64_at = |at: usize| -> Option<u64> {
        Some(u64::from_le_bytes(elf.get(at..at + 8)?.try_into().ok()?))
    };
    if !elf.starts_with(b"\x7fELF\x02\x01") {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let bad = || "its section tables are out of bounds".to_string();
    let shoff = u64_at(0x28).ok_or_else(bad)? as usize;
    let shentsize = u16_at(0x3a).ok_or_else(bad)? as usize;
    let shnum = u16_at(0x3c).ok_or_else(bad)? as usize;
    if shentsize < 64 {
        return Err(bad());
    }
    let section = |i: usize| shoff.checked_add(i.checked_mul(shentsize)?);
    const SHT_GNU_VERNEED: u32 = 0x6fff_fffe;
    let mut versions = Vec::new();
    for i in 0..shnum {
        let at = section(i).ok_or_else(bad)?;
        if u32_at(at + 4).ok_or_else(bad)? != SHT_GNU_VERNEED {
            continue;
        }
        let offset = u64_at(at + 24).ok_or_else(bad)? as usize;
        let count = u32_at(at + 44).ok_or_else(bad)? as usize;
        let strtab = u32_at(at + 40).ok_or_else(bad)? as usize;
        let strtab_at = section(strtab).ok_or_else(bad)?;
        let strings = u64_at(strtab_at + 24).ok_or_else(bad)? as usize;
        let strings_size = u64_at(strtab_at + 32).ok_or_else(bad)? as usize;
        let string = |name: usize| -> Option<String> {
            if name >= strings_size {
                return None;
            }
            let bytes = elf.get(strings.checked_add(name)?..strings.checked_add(strings_size)?)?;
            let end = bytes.iter().position(|&b| b == 0)?;
            Some(String::from_utf8_lossy(&bytes[..end]).into_owned())
        };
        let mut need = offset;
        for _ in 0..count.min(1024) {
            let aux_count = u16_at(need + 2).ok_or_else(bad)? as usize;
            let mut aux = need + u32_at(need + 8).ok_or_else(bad)? as usize;
            for _ in 0..aux_count.min(1024) {
                let name = string(u32_at(aux + 8).ok_or_else(bad)? as usize).ok_or_else(bad)?;
                if name.starts_with("GLIBC_") && !versions.contains(&name) {
                    versions.push(name);
                }
                let next = u32_at(aux + 12).ok_or_else(bad)? as usize;
                if next == 0 {
                    break;
                }
                aux += next;
            }
            let next = u32_at(need + 12).ok_or_else(bad)? as usize;
            if next == 0 {
                break;
            }
            need += next;
        }
    }
    versions.sort_by_key(|v| glibc_version(v));
    Ok(versions)
}

/// "GLIBC_2.34" or "2.34" → [2, 34]; "GLIBC_2.2.5" → [2, 2, 5].
pub fn glibc_version(text: &str) -> Vec<u32> {
    let text = text.strip_prefix("GLIBC_").unwrap_or(text);
    text.split('.')
        .map_while(|part| part.parse().ok())
        .collect()
}

/// The glibc this process runs on ("2.36").
pub fn running_glibc() -> String {
    // SAFETY: returns a pointer to a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(libc::gnu_get_libc_version()) }
        .to_string_lossy()
        .into_owned()
}
