//! The glibc the shipped binaries need: `scripts/dist.sh` builds `dist/libcudabudget.so`,
//! `dist/cudabudget` and `dist/cudabudget-node` (and `dist/aarch64/…`) against glibc 2.17
//! with cargo-zigbuild;
//! this test reads their ELF version needs (`.gnu.version_r`, as `objdump -T` shows them)
//! and fails if any symbol needs a version above `GLIBC_2.17`, or a library that is not
//! part of glibc.
//!
//! Where `dist/` does not exist (a plain `cargo test`), the dist check has nothing to read
//! and says so; `CB_REQUIRE_DIST=1` makes that a failure (`.ci/run` builds `dist/` for
//! x86_64 first and sets it). `CB_DIST_DIR` names another directory. The ELF reader itself
//! is always exercised on the library `cargo test` built.

use std::path::{Path, PathBuf};

/// The newest glibc symbol version a shipped binary may need.
const MAX_GLIBC: [u32; 2] = [2, 17];

/// Libraries a shipped binary may link: glibc's own and the loader (manylinux2014's
/// list, less what Rust never needs).
const ALLOWED_NEEDED: &[&str] = &[
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "libgcc_s.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
];

const EM_X86_64: u16 = 62;

const EM_AARCH64: u16 = 183;

/// What an ELF file needs from the libraries it links.
#[derive(Debug)]
struct Needs {
    machine: u16,
    /// `DT_NEEDED` entries.
    libraries: Vec<String>,
    /// `(file, version)` of every `.gnu.version_r` entry.
    versions: Vec<(String, String)>,
    /// `(symbol, version)` of every undefined dynamic symbol that names a version.
    symbols: Vec<(String, String)>,
}

/// A minimal reader of 64-bit little-endian ELF files: enough for the dynamic section,
/// the version needs and the dynamic symbols' versions.
mod elf {
    use super::Needs;

    const SHT_DYNAMIC: u32 = 6;
    const SHT_DYNSYM: u32 = 11;
    const SHT_GNU_VERNEED: u32 = 0x6fff_fffe;
    const SHT_GNU_VERSYM: u32 = 0x6fff_ffff;
    const DT_NEEDED: u64 = 1;

    struct Section {
        kind: u32,
        offset: usize,
        size: usize,
        link: usize,
        info: usize,
    }

    fn u16_at(b: &[u8], at: usize) -> Result<u16, String> {
        b.get(at..at + 2)
            .map(|s| u16::from_le_bytes(s.try_into().unwrap()))
            .ok_or_else(|| format!("truncated at {at}"))
    }
    fn u32_at(b: &[u8], at: usize) -> Result<u32, String> {
        b.get(at..at + 4)
            .map(|s| u32::from_le_bytes(s.try_into().unwrap()))
            .ok_or_else(|| format!("truncated at {at}"))
    }
    fn u64_at(b: &[u8], at: usize) -> Result<u64, String> {
        b.get(at..at + 8)
            .map(|s| u64::from_le_bytes(s.try_into().unwrap()))
            .ok_or_else(|| format!("truncated at {at}"))
    }
    fn usize_at(b: &[u8], at: usize) -> Result<usize, String> {
        usize::try_from(u64_at(b, at)?).map_err(|e| e.to_string())
    }
    fn string_at(b: &[u8], strtab: &Section, at: usize) -> Result<String, String> {
        let start = strtab.offset + at;
        let end = strtab.offset + strtab.size;
        let bytes = b.get(start..end).ok_or("string outside its table")?;
        let len = bytes
            .iter()
            .position(|&c| c == 0)
            .ok_or("unterminated string")?;
        Ok(String::from_utf8_lossy(&bytes[..len]).into_owned())
    }

    pub fn read(b: &[u8]) -> Result<Needs, String> {
        if b.get(..4) != Some(b"\x7fELF") {
            return Err("not an ELF file".into());
        }
        if b[4] != 2 || b[5] != 1 {
            return Err("not a 64-bit little-endian ELF file".into());
        }
        let machine = u16_at(b, 0x12)?;
        let shoff = usize_at(b, 0x28)?;
        let shentsize = usize::from(u16_at(b, 0x3a)?);
        let shnum = usize::from(u16_at(b, 0x3c)?);
        let sections = (0..shnum)
            .map(|i| {
                let h = shoff + i * shentsize;
                Ok(Section {
                    kind: u32_at(b, h + 4)?,
                    offset: usize_at(b, h + 24)?,
                    size: usize_at(b, h + 32)?,
                    link: u32_at(b, h + 40)? as usize,
                    info: u32_at(b, h + 44)? as usize,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let linked = |s: &Section| sections.get(s.link).ok_or("bad sh_link");

        let mut libraries = Vec::new();
        for s in sections.iter().filter(|s| s.kind == SHT_DYNAMIC) {
            let strtab = linked(s)?;
            for e in (s.offset..s.offset + s.size).step_by(16) {
                if u64_at(b, e)? == DT_NEEDED {
                    libraries.push(string_at(b, strtab, usize_at(b, e + 8)?)?);
                }
            }
        }

        // Version index (vna_other) → (file, version name).
        let mut by_index = std::collections::BTreeMap::new();
        for s in sections.iter().filter(|s| s.kind == SHT_GNU_VERNEED) {
            let strtab = linked(s)?;
            let mut need = s.offset;
            for _ in 0..s.info {
                let count = u16_at(b, need + 2)?;
                let file = string_at(b, strtab, u32_at(b, need + 4)? as usize)?;
                let mut aux = need + u32_at(b, need + 8)? as usize;
                for _ in 0..count {
                    let other = u16_at(b, aux + 6)?;
                    let name = string_at(b, strtab, u32_at(b, aux + 8)? as usize)?;
                    by_index.insert(other, (file.clone(), name));
                    aux += u32_at(b, aux + 12)? as usize;
                }
                need += u32_at(b, need + 12)? as usize;
            }
        }
        let versions = by_index.values().cloned().collect();

        let mut symbols = Vec::new();
        let versym = sections.iter().find(|s| s.kind == SHT_GNU_VERSYM);
        if let (Some(dynsym), Some(versym)) =
            (sections.iter().find(|s| s.kind == SHT_DYNSYM), versym)
        {
            let strtab = linked(dynsym)?;
            for i in 0..dynsym.size / 24 {
                let sym = dynsym.offset + i * 24;
                let undefined = u16_at(b, sym + 6)? == 0;
                let index = u16_at(b, versym.offset + i * 2)? & 0x7fff;
                if let (true, Some((_, version))) = (undefined, by_index.get(&index)) {
                    let name = string_at(b, strtab, u32_at(b, sym)? as usize)?;
                    symbols.push((name, version.clone()));
                }
            }
        }
        Ok(Needs {
            machine,
            libraries,
            versions,
            symbols,
        })
    }
}

/// `GLIBC_2.3.4` → `[2, 3, 4]`; `None` for other names (`GCC_3.0`, …).
fn glibc_version(name: &str) -> Option<Vec<u32>> {
    name.strip_prefix("GLIBC_")?
        .split('.')
        .map(|p| p.parse().ok())
        .collect()
}

fn needs_of(path: &Path) -> Needs {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    elf::read(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What is wrong with one shipped binary, if anything.
fn problems(path: &Path, machine: u16) -> Vec<String> {
    let needs = needs_of(path);
    let mut problems = Vec::new();
    if needs.machine != machine {
        problems.push(format!(
            "machine {} where {machine} was expected",
            needs.machine
        ));
    }
    for lib in &needs.libraries {
        if !ALLOWED_NEEDED.contains(&lib.as_str()) {
            problems.push(format!("links {lib}, which is not part of glibc"));
        }
    }
    for (file, version) in &needs.versions {
        match glibc_version(version) {
            Some(v) if v.as_slice() > MAX_GLIBC.as_slice() => {
                let users: Vec<&str> = needs
                    .symbols
                    .iter()
                    .filter(|(_, sv)| sv == version)
                    .map(|(s, _)| s.as_str())
                    .collect();
                problems.push(format!(
                    "needs {version} from {file} (symbols: {})",
                    users.join(", ")
                ));
            }
            Some(_) => {}
            None if version.starts_with("GCC_") => {}
            None => problems.push(format!("needs {version} from {file}, not a glibc version")),
        }
    }
    problems
}

fn dist_dir() -> PathBuf {
    std::env::var_os("CB_DIST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("dist"))
}

#[test]
fn the_shipped_binaries_need_glibc_2_17_at_most() {
    let dir = dist_dir();
    let candidates = [
        ("libcudabudget.so", EM_X86_64),
        ("cudabudget", EM_X86_64),
        ("cudabudget-node", EM_X86_64),
        ("aarch64/libcudabudget.so", EM_AARCH64),
        ("aarch64/cudabudget", EM_AARCH64),
        ("aarch64/cudabudget-node", EM_AARCH64),
    ];
    let mut checked = 0;
    let mut failures = Vec::new();
    for (name, machine) in candidates {
        let path = dir.join(name);
        if !path.is_file() {
            continue;
        }
        checked += 1;
        let newest = needs_of(&path)
            .versions
            .iter()
            .filter_map(|(_, v)| glibc_version(v).map(|n| (n, v.clone())))
            .max()
            .map(|(_, v)| v)
            .unwrap_or_default();
        eprintln!("{}: newest glibc version needed: {newest}", path.display());
        for p in problems(&path, machine) {
            failures.push(format!("{}: {p}", path.display()));
        }
    }
    assert!(
        failures.is_empty(),
        "binaries that would not load on glibc 2.17:\n{}",
        failures.join("\n")
    );
    let required = std::env::var_os("CB_REQUIRE_DIST").is_some_and(|v| v != "0" && !v.is_empty());
    if checked == 0 {
        assert!(
            !required,
            "CB_REQUIRE_DIST is set but {} holds no binary: run scripts/dist.sh",
            dir.display()
        );
        eprintln!(
            "{} holds no binary: nothing shipped to check (scripts/dist.sh builds it)",
            dir.display()
        );
    } else if required {
        assert!(
            ["libcudabudget.so", "cudabudget", "cudabudget-node"]
                .iter()
                .all(|name| dir.join(name).is_file()),
            "CB_REQUIRE_DIST is set: {} must hold the x86_64 libcudabudget.so, cudabudget \
             and cudabudget-node",
            dir.display()
        );
    }
}

/// The reader on the library this `cargo test` built with the host's toolchain: it finds
/// glibc's base version and the libraries every build links, and the check reports what a
/// too-new need looks like (this host's glibc is usually newer than 2.17, and a regular
/// build needs what the host has, e.g. `GLIBC_2.34` for `dlopen`).
#[test]
fn the_reader_sees_the_needs_of_a_regular_build() {
    let lib = crate::util::lib_path();
    let needs = needs_of(&lib);
    let base = if cfg!(target_arch = "aarch64") {
        "GLIBC_2.17"
    } else {
        "GLIBC_2.2.5"
    };
    assert!(
        needs
            .versions
            .iter()
            .any(|(f, v)| f == "libc.so.6" && v == base),
        "{}: no {base} from libc.so.6 in {:?}",
        lib.display(),
        needs.versions
    );
    assert!(
        needs.libraries.iter().any(|l| l == "libc.so.6"),
        "{needs:?}"
    );
    // Every version a symbol names is one of the needs, and the symbols are the library's
    // imports (it calls dlvsym to find glibc's dlsym).
    assert!(
        needs.symbols.iter().any(|(s, _)| s == "dlvsym"),
        "{:?}",
        needs.symbols
    );
    for (symbol, version) in &needs.symbols {
        assert!(
            needs.versions.iter().any(|(_, v)| v == version),
            "{symbol}@{version} is not among the needs"
        );
    }
    let newest = needs
        .versions
        .iter()
        .filter_map(|(_, v)| glibc_version(v))
        .max()
        .expect("some glibc version");
    let too_new = problems(&lib, needs.machine);
    assert_eq!(
        newest.as_slice() > MAX_GLIBC.as_slice(),
        too_new.iter().any(|p| p.contains("needs GLIBC_")),
        "{too_new:?}"
    );
    eprintln!(
        "{} (host toolchain): newest glibc version needed {newest:?}; {}",
        lib.display(),
        if too_new.is_empty() {
            "loads on 2.17".to_string()
        } else {
            too_new.join("; ")
        }
    );
}

#[test]
fn glibc_versions_compare_by_number() {
    assert_eq!(glibc_version("GLIBC_2.3.4"), Some(vec![2, 3, 4]));
    assert!(glibc_version("GLIBC_2.34").unwrap().as_slice() > MAX_GLIBC.as_slice());
    assert!(glibc_version("GLIBC_2.3.4").unwrap().as_slice() < MAX_GLIBC.as_slice());
    assert!(glibc_version("GLIBC_2.17").unwrap().as_slice() <= MAX_GLIBC.as_slice());
    assert_eq!(glibc_version("GCC_3.0"), None);
    assert_eq!(glibc_version("GLIBC_PRIVATE"), None);
}
