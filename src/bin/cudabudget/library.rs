//! Which `libcudabudget.so` to preload, the copy this binary carries, and whether a
//! library loads here.
//!
//! The library is `$CUDABUDGET_LIB`, else the one next to this binary (a build tree, an
//! install directory, a wheel), else the copy built into this binary (what `cargo
//! install` gives), written once per version to a per-user cache directory.

use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Refusal, config, record, usage};

pub const LIBRARY_NAME: &str = "libcudabudget.so";

/// The library built into this binary: the cdylib cargo built beside it, when the build
/// script asked for it (`cfg(cudabudget_embed)`); empty otherwise, and in `cargo check`
/// builds, where the build script leaves an empty stand-in.
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
    /// Absolute and canonical.
    pub path: PathBuf,
    pub origin: Origin,
}

/// The library to preload (see the module's docs), as an absolute path that
/// `LD_PRELOAD` can carry.
pub fn find() -> Result<Library, Refusal> {
    let library = match std::env::var_os(config::LIB) {
        Some(path) => Library {
            path: std::fs::canonicalize(&path)
                .ok()
                .filter(|p| p.is_file())
                .ok_or_else(|| {
                    usage(format!(
                        "{}={:?} does not name an existing file; point it at {LIBRARY_NAME} \
                         or unset it to use the one next to this binary",
                        config::LIB,
                        path.to_string_lossy()
                    ))
                })?,
            origin: Origin::Variable,
        },
        None => {
            let dir = std::env::current_exe()
                .ok()
                .and_then(|exe| exe.parent().map(Path::to_path_buf));
            match dir.as_deref().and_then(beside_binary) {
                Some(path) => Library {
                    path,
                    origin: Origin::BesideBinary,
                },
                None => match embedded() {
                    Some(bytes) => Library {
                        path: write_to_cache(bytes).map_err(|reason| {
                            usage(format!(
                                "cannot write out the {LIBRARY_NAME} this binary carries: \
                                 {reason}; set {} to a copy of the library",
                                config::LIB
                            ))
                        })?,
                        origin: Origin::Embedded,
                    },
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
fn preloadable_path(path: &Path) -> bool {
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

/// Whether two paths name one file, through symlinks and hard links (cargo hard-links
/// the library it copies next to the binary).
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

fn euid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// A directory of this user that nobody else can write, created (mode 0700) if missing.
fn private_dir(dir: &Path) -> io::Result<()> {
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() || meta.uid() != euid() || meta.mode() & 0o022 != 0 {
        return Err(io::Error::other(format!(
            "{} is not a directory of this user that only it can write",
            dir.display()
        )));
    }
    Ok(())
}

/// The cache directories to try, best first.
fn cache_roots() -> Vec<PathBuf> {
    let absolute = |v: Option<std::ffi::OsString>| {
        v.map(PathBuf::from)
            .filter(|p| p.is_absolute() && !p.as_os_str().is_empty())
    };
    let mut roots = Vec::new();
    if let Some(cache) = absolute(std::env::var_os("XDG_CACHE_HOME")) {
        roots.push(cache.join("cudabudget"));
    }
    if let Some(home) = absolute(std::env::var_os("HOME")) {
        roots.push(home.join(".cache").join("cudabudget"));
    }
    if let Some(runtime) = absolute(std::env::var_os("XDG_RUNTIME_DIR")) {
        roots.push(runtime.join("cudabudget"));
    }
    roots.push(std::env::temp_dir().join(format!("cudabudget-cache-{}", euid())));
    roots
}

/// Writes `bytes` (the carried library) once per version to the first usable cache
/// directory and returns the path of the copy.
fn write_to_cache(bytes: &[u8]) -> Result<PathBuf, String> {
    let version = format!(
        "{}-{:016x}",
        env!("CARGO_PKG_VERSION"),
        record::fnv1a(bytes)
    );
    let mut reasons = Vec::new();
    for root in cache_roots() {
        let dir = root.join(&version);
        if !preloadable_path(&dir) {
            reasons.push(format!("{}: ':' or whitespace in the path", dir.display()));
            continue;
        }
        match write_once(&dir, bytes) {
            Ok(path) => return Ok(path),
            Err(e) => reasons.push(format!("{}: {e}", dir.display())),
        }
    }
    Err(reasons.join("; "))
}

/// `dir/libcudabudget.so` holding `bytes`: the existing file when it is this user's,
/// writable by nobody else and has exactly these bytes; else written anew (to a
/// temporary name, then renamed, so no process ever maps half a library).
pub fn write_once(dir: &Path, bytes: &[u8]) -> io::Result<PathBuf> {
    private_dir(dir)?;
    let path = dir.join(LIBRARY_NAME);
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
    {
        let meta = file.metadata()?;
        if meta.is_file()
            && meta.uid() == euid()
            && meta.mode() & 0o022 == 0
            && meta.len() == bytes.len() as u64
        {
            let mut existing = Vec::with_capacity(bytes.len());
            file.read_to_end(&mut existing)?;
            if existing == bytes {
                return Ok(path);
            }
        }
    }
    write_atomically(&path, bytes, 0o755)?;
    Ok(path)
}

/// Writes `bytes` to `path` through a temporary file beside it and a rename.
pub fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or(OsStr::new(LIBRARY_NAME));
    let temporary = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&temporary);
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&temporary)?;
        file.write_all(bytes)?;
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result
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
