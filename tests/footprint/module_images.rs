//! A module or library load is admitted before the driver's call, for what its image says
//! it places on the device: a load that does not fit is refused before the driver holds
//! any of it, so a neighbour is never short of memory the budget left it. Images here are
//! small real-format ones (an ELF64 cubin whose NOBITS `.nv.global` says 3 GiB is a few
//! hundred bytes), which the fake driver reads as the real one would
//! (tests/fake_driver/README.md).

use crate::util::{GI, MI, Run, budget_run};
use std::path::PathBuf;

/// NVML listing the process under another pid: what is charged is what the hooks charged.
const NVML_BLIND: (&str, &str) = ("FAKE_NVML_PID_OFFSET", "100000");

const LIMIT_2GI: (&str, &str) = ("CUDABUDGET_LIMIT", "2Gi");

/// A cubin (ELF64, EM_CUDA) with sections of these names and sizes, plus its name table;
/// every section NOBITS, so that the image stays small whatever the sizes.
fn cubin(sections: &[(&str, u64)]) -> Vec<u8> {
    let mut names = vec![0u8];
    let mut name_at = Vec::new();
    for (name, _) in sections {
        name_at.push(names.len() as u32);
        names.extend_from_slice(name.as_bytes());
        names.push(0);
    }
    let shstrtab = names.len() as u32;
    names.extend_from_slice(b".shstrtab\0");
    let shoff = 64 + names.len() as u64;
    let shnum = sections.len() as u16 + 2;
    let mut elf = vec![0u8; 64];
    elf[..4].copy_from_slice(b"\x7fELF");
    elf[4] = 2; // ELFCLASS64
    elf[5] = 1; // little-endian
    elf[6] = 1;
    elf[0x12..0x14].copy_from_slice(&190u16.to_le_bytes()); // EM_CUDA
    elf[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
    elf[0x34..0x36].copy_from_slice(&64u16.to_le_bytes());
    elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    elf[0x3c..0x3e].copy_from_slice(&shnum.to_le_bytes());
    elf[0x3e..0x40].copy_from_slice(&(shnum - 1).to_le_bytes());
    elf.extend_from_slice(&names);
    let section = |name: u32, kind: u32, offset: u64, size: u64| {
        let mut s = [0u8; 64];
        s[0..4].copy_from_slice(&name.to_le_bytes());
        s[4..8].copy_from_slice(&kind.to_le_bytes());
        s[0x18..0x20].copy_from_slice(&offset.to_le_bytes());
        s[0x20..0x28].copy_from_slice(&size.to_le_bytes());
        s
    };
    elf.extend_from_slice(&[0u8; 64]);
    for (i, (_, size)) in sections.iter().enumerate() {
        elf.extend_from_slice(&section(name_at[i], 8, 0, *size)); // SHT_NOBITS
    }
    elf.extend_from_slice(&section(shstrtab, 3, 64, names.len() as u64)); // SHT_STRTAB
    elf
}

/// A cubin holding `globals` bytes of `__device__` globals and a little code and constants.
fn module_of(globals: u64) -> Vec<u8> {
    cubin(&[
        (".nv.global", globals),
        (".text._Z5touchPc", 256),
        (".nv.constant0._Z5touchPc", 0x170),
        (".nv.info._Z5touchPc", 1 << 20),
        (".nv.shared._Z5touchPc", 1 << 20),
    ])
}

/// What [`module_of`] places on the device.
fn footprint_of(globals: u64) -> u64 {
    globals + 256 + 0x170
}

const KIND_PTX: u16 = 1;

const KIND_ELF: u16 = 2;

const COMPRESSED: u64 = 0x8000;

/// A fatbinary of these entries: (kind, sm arch, flags, payload).
fn fatbin(entries: &[(u16, u32, u64, &[u8])]) -> Vec<u8> {
    let entries: Vec<Vec<u8>> = entries
        .iter()
        .map(|&(kind, arch, flags, payload)| entry(kind, arch, flags, payload, None))
        .collect();
    fatbin_of(&entries)
}

/// One fatbinary entry: its header, then its payload. `compressed`: the payload's
/// compressed and expanded lengths, and the payload padded to 8 bytes, as nvcc writes a
/// compressed entry.
fn entry(
    kind: u16,
    arch: u32,
    flags: u64,
    payload: &[u8],
    compressed: Option<(u32, u64)>,
) -> Vec<u8> {
    let mut payload = payload.to_vec();
    let (packed, unpacked) = compressed.unwrap_or((0, 0));
    if compressed.is_some() {
        payload.resize(payload.len().next_multiple_of(8), 0);
    }
    let mut e = vec![0u8; 64];
    e[0..2].copy_from_slice(&kind.to_le_bytes());
    e[2..4].copy_from_slice(&0x0101u16.to_le_bytes());
    e[4..8].copy_from_slice(&64u32.to_le_bytes());
    e[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    e[16..20].copy_from_slice(&packed.to_le_bytes());
    e[28..32].copy_from_slice(&arch.to_le_bytes());
    e[40..48].copy_from_slice(&(flags | 0x11).to_le_bytes());
    e[56..64].copy_from_slice(&unpacked.to_le_bytes());
    e.extend_from_slice(&payload);
    e
}

/// How nvcc compresses an entry: LZ4 (`-Xfatbin=-compress-all` before CUDA 12.8,
/// `--compress-mode=speed`), Zstandard (the default mode from CUDA 12.8, `size`).
#[derive(Clone, Copy, Debug)]
enum Codec {
    Lz4,
    Zstd,
}

/// A cubin for `arch` compressed with `codec` and framed as nvcc frames it.
fn compressed(codec: Codec, arch: u32, raw: &[u8]) -> Vec<u8> {
    let (flag, bytes) = match codec {
        Codec::Lz4 => (0x2000, lz4_flex::block::compress(raw)),
        Codec::Zstd => (
            0x8000,
            ruzstd::encoding::compress_to_vec(raw, ruzstd::encoding::CompressionLevel::Fastest),
        ),
    };
    let sizes = (bytes.len() as u32, raw.len() as u64);
    entry(KIND_ELF, arch, flag, &bytes, Some(sizes))
}

fn fatbin_of(entries: &[Vec<u8>]) -> Vec<u8> {
    let body = entries.concat();
    let mut fat = 0xBA55_ED50u32.to_le_bytes().to_vec();
    fat.extend_from_slice(&1u16.to_le_bytes());
    fat.extend_from_slice(&16u16.to_le_bytes());
    fat.extend_from_slice(&(body.len() as u64).to_le_bytes());
    fat.extend_from_slice(&body);
    fat
}

/// `bytes` written to a file of this test's own (`name`), for the client to load.
fn image_file(name: &str, bytes: &[u8]) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("module_loads-{name}"));
    std::fs::write(&path, bytes).unwrap();
    path
}

fn op(name: &str, path: &std::path::Path) -> String {
    format!("{name}:{}", path.display())
}

fn run(ops: &[&str], envs: &[(&str, &str)]) -> Run {
    let mut all = vec![LIMIT_2GI, NVML_BLIND];
    all.extend_from_slice(envs);
    budget_run("gpa", ops, &all)
}

#[test]
fn a_module_whose_image_says_more_than_the_budget_is_refused_before_the_driver_loads_it() {
    let image = image_file("3gi.cubin", &module_of(3 * GI));
    assert!(std::fs::metadata(&image).unwrap().len() < 1024);
    let by_data = op("modimage", &image);
    let by_path = op("modfile", &image);
    let run = run(&[&by_data, &by_path, "loads", "phys", "info"], &[]);
    assert_eq!(run.rc("modimage", 0), 2, "{run:?}");
    assert_eq!(run.rc("modfile", 0), 2, "{run:?}");
    assert_eq!(
        run.num("loads", 0, "calls"),
        0,
        "the driver never saw the loads\n{run:?}"
    );
    assert_eq!(
        run.num("phys", 0, "peak"),
        0,
        "the device never held any of it\n{run:?}"
    );
    assert_eq!(run.num("info", 0, "free"), 2 * GI, "{run:?}");
    assert!(
        run.stderr.contains("cuModuleLoadData"),
        "the denial names the call\n{run:?}"
    );
}

#[test]
fn a_module_that_fits_is_charged_what_its_image_says_and_the_books_end_at_zero_after_its_unload() {
    let image = image_file("1gi.cubin", &module_of(GI));
    let by_data = op("modimage", &image);
    let by_path = op("modfile", &image);
    let run = run(
        &[
            &by_data,
            "info",
            &by_path,
            "phys",
            "alloc:1Mi",
            "unload:0",
            "info",
        ],
        &[],
    );
    assert_eq!(run.rc("modimage", 0), 0, "{run:?}");
    assert_eq!(
        run.num("info", 0, "free"),
        2 * GI - footprint_of(GI),
        "{run:?}"
    );
    // The second copy does not fit beside the first: refused before the driver's load.
    assert_eq!(run.rc("modfile", 0), 2, "{run:?}");
    assert_eq!(run.num("phys", 0, "peak"), footprint_of(GI), "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("unload", 0), 0, "{run:?}");
    assert_eq!(
        run.num("info", 1, "free"),
        2 * GI - MI,
        "only the allocation is left\n{run:?}"
    );
}

#[test]
fn a_fatbinary_is_charged_for_the_cubin_the_driver_chooses_for_the_device() {
    let sm80 = module_of(3 * GI);
    let sm86 = module_of(GI);
    let sm90 = module_of(512 * MI);
    let ptx = b".version 8.5\n.target sm_52\n.address_size 64\n.global .align 1 .b8 big[100];\n\0";
    let fat = image_file(
        "archs.fatbin",
        &fatbin(&[
            (KIND_ELF, 80, 0, &sm80),
            (KIND_ELF, 90, 0, &sm90),
            (KIND_ELF, 86, 0, &sm86),
            (KIND_PTX, 52, 0, ptx),
        ]),
    );
    let load = op("modimage", &fat);
    let ops = [load.as_str(), "loads", "info"];
    // Its own architecture,
    let h200 = run(&ops, &[("FAKE_CUDA_CC", "9.0")]);
    assert_eq!(h200.rc("modimage", 0), 0, "{h200:?}");
    assert_eq!(
        h200.num("info", 0, "free"),
        2 * GI - footprint_of(512 * MI),
        "{h200:?}"
    );
    // else the newest lower one of its major,
    let ada = run(&ops, &[("FAKE_CUDA_CC", "8.9")]);
    assert_eq!(ada.rc("modimage", 0), 0, "{ada:?}");
    assert_eq!(
        ada.num("info", 0, "free"),
        2 * GI - footprint_of(GI),
        "{ada:?}"
    );
    // which may not fit.
    let a100 = run(&ops, &[("FAKE_CUDA_CC", "8.0")]);
    assert_eq!(a100.rc("modimage", 0), 2, "{a100:?}");
    assert_eq!(a100.num("loads", 0, "calls"), 0, "{a100:?}");
}

#[test]
fn ptx_is_admitted_for_the_globals_it_declares() {
    let ptx = b"//\n// Generated by NVIDIA NVVM Compiler\n.version 8.5\n.target sm_90\n\
        .address_size 64\n\n.global .align 1 .b8 big[3221225472];\n\n\
        .visible .entry _Z5touchv()\n{\n\tmov.u64 %rd1, big;\n\tret;\n}\n";
    let image = image_file("3gi.ptx", ptx);
    let load = op("modimage", &image);
    // The fake does not compile PTX: it charges FAKE_CUDA_MODULE_BYTES for it, as much.
    let run = run(
        &[&load, "loads", "phys"],
        &[("FAKE_CUDA_MODULE_BYTES", "3221225472")],
    );
    assert_eq!(run.rc("modimage", 0), 2, "{run:?}");
    assert_eq!(run.num("loads", 0, "calls"), 0, "{run:?}");
    assert_eq!(run.num("phys", 0, "peak"), 0, "{run:?}");
}

#[test]
fn a_lazily_loaded_librarys_globals_are_admitted_before_its_first_look_up_brings_them() {
    let image = image_file("3gi-lib.cubin", &module_of(3 * GI));
    let load = op("libimage", &image);
    let lazy = run(&[&load, "libglobal:0", "phys", "unload:0", "info"], &[]);
    assert_eq!(lazy.rc("libimage", 0), 0, "nothing placed yet\n{lazy:?}");
    assert_eq!(lazy.rc("libglobal", 0), 2, "{lazy:?}");
    assert_eq!(
        lazy.num("phys", 0, "peak"),
        0,
        "the globals never arrived\n{lazy:?}"
    );
    assert_eq!(lazy.num("info", 0, "free"), 2 * GI, "{lazy:?}");
    // Loaded eagerly, the library is refused at its load, before the driver's call.
    let eager = run(
        &[&load, "loads", "phys"],
        &[("CUDA_MODULE_LOADING", "EAGER")],
    );
    assert_eq!(eager.rc("libimage", 0), 2, "{eager:?}");
    assert_eq!(eager.num("loads", 0, "calls"), 0, "{eager:?}");
    assert_eq!(eager.num("phys", 0, "peak"), 0, "{eager:?}");
}

/// A shared object carrying `image` read-only at the symbol `image` (as a program carries
/// its fatbinaries, which cudart loads as libraries at start-up), built with `cc`; `None`
/// (a visible skip) where there is no C compiler.
fn shared_object_carrying(name: &str, image: &[u8]) -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let source = dir.join(format!("module_loads-{name}.c"));
    let object = dir.join(format!("module_loads-{name}.so"));
    let bytes: Vec<String> = image.iter().map(|b| b.to_string()).collect();
    std::fs::write(
        &source,
        format!(
            "__attribute__((aligned(8))) const unsigned char image[] = {{{}}};\n",
            bytes.join(",")
        ),
    )
    .unwrap();
    crate::util::shared_object(&source, &object, "a shared object carrying an image")
}

#[test]
fn an_image_a_program_carries_read_only_is_read_only_at_its_first_look_up() {
    // cudart loads every fatbinary a process carries as a lazily loaded library at
    // start-up, most never looked up: those images are read at the first look-up only,
    // and what they say is admitted there all the same.
    let Some(object) = shared_object_carrying("3gi", &module_of(3 * GI)) else {
        return;
    };
    let load = format!("libso:{}:image", object.display());
    let debug = ("CUDABUDGET_LOG", "debug");
    let loaded = run(&[&load], &[debug]);
    assert_eq!(loaded.rc("libso", 0), 0, "{loaded:?}");
    assert!(
        !loaded.stderr.contains("the image places"),
        "read at its load\n{loaded:?}"
    );
    let looked_up = run(&[&load, "libglobal:0", "phys", "info"], &[debug]);
    assert_eq!(looked_up.rc("libglobal", 0), 2, "{looked_up:?}");
    assert!(
        looked_up
            .stderr
            .contains("the image places 3.00 GiB of data"),
        "{looked_up:?}"
    );
    assert_eq!(looked_up.num("phys", 0, "peak"), 0, "{looked_up:?}");
    assert_eq!(looked_up.num("info", 0, "free"), 2 * GI, "{looked_up:?}");
    // An image in the program's writable memory (which it may change or free after the
    // load) is read at the load, as before.
    let image = image_file("3gi-lib-heap.cubin", &module_of(3 * GI));
    let in_memory = run(&[&op("libimage", &image)], &[debug]);
    assert!(
        in_memory
            .stderr
            .contains("the image places 3.00 GiB of data"),
        "{in_memory:?}"
    );
}

/// What the driver holds for a compressed entry (the fake does not expand it): the
/// module's footprint, so that a load the library let through would show on the device.
fn fake_holds(globals: u64) -> (&'static str, String) {
    ("FAKE_CUDA_MODULE_BYTES", footprint_of(globals).to_string())
}

#[test]
fn a_compressed_fatbinary_whose_globals_exceed_the_budget_is_refused_before_the_driver_loads_it() {
    for codec in [Codec::Lz4, Codec::Zstd] {
        // As `nvcc -Xfatbin=-compress-all` writes it: every architecture's cubin compressed.
        let fat = fatbin_of(&[
            compressed(codec, 80, &module_of(MI)),
            compressed(codec, 90, &module_of(1536 * MI)),
        ]);
        let image = image_file(&format!("1536mi-{codec:?}.fatbin"), &fat);
        let by_data = op("modimage", &image);
        let by_path = op("modfile", &image);
        let as_library = op("libimage", &image);
        let (var, bytes) = fake_holds(1536 * MI);
        let ops = [
            by_data.as_str(),
            &by_path,
            &as_library,
            "libglobal:0",
            "loads",
            "phys",
            "info",
        ];
        let run = budget_run(
            "gpa",
            &ops,
            &[("CUDABUDGET_LIMIT", "1Gi"), NVML_BLIND, (var, &bytes)],
        );
        assert_eq!(run.rc("modimage", 0), 2, "{codec:?}\n{run:?}");
        assert_eq!(run.rc("modfile", 0), 2, "{codec:?}\n{run:?}");
        // A library loads lazily: its globals would come at its first look-up, refused.
        assert_eq!(run.rc("libimage", 0), 0, "{codec:?}\n{run:?}");
        assert_eq!(run.rc("libglobal", 0), 2, "{codec:?}\n{run:?}");
        assert_eq!(
            run.num("loads", 0, "calls"),
            1,
            "the driver saw only the library's load, which places nothing\n{codec:?}\n{run:?}"
        );
        assert_eq!(
            run.num("phys", 0, "peak"),
            0,
            "the device never held any of it\n{codec:?}\n{run:?}"
        );
        assert_eq!(run.num("info", 0, "free"), GI, "{codec:?}\n{run:?}");
    }
}

/// cudart loads every fatbinary of a process as a lazily loaded library at start-up, most
/// of them never used: a compressed entry is expanded at the library's first look-up, not
/// at its load.
#[test]
fn a_lazily_loaded_librarys_compressed_entry_is_expanded_at_its_first_look_up_only() {
    let fat = fatbin_of(&[compressed(Codec::Zstd, 90, &module_of(1536 * MI))]);
    let image = image_file("1536mi-lazy.fatbin", &fat);
    let load = op("libimage", &image);
    let debug = ("CUDABUDGET_LOG", "debug");
    let unused = run(&[&load, "unload:0"], &[debug]);
    assert_eq!(unused.rc("libimage", 0), 0, "{unused:?}");
    assert!(
        unused.stderr.contains("read at the first look-up")
            && !unused.stderr.contains("the image places"),
        "expanded at the load\n{unused:?}"
    );
    // Under 2 GiB it fits, and is charged what the expanded cubin says (the fake holds
    // nothing for it).
    let used = run(&[&load, "libglobal:0", "info"], &[debug]);
    assert_eq!(used.rc("libglobal", 0), 0, "{used:?}");
    assert_eq!(used.num("info", 0, "free"), 512 * MI, "{used:?}");
    assert!(
        used.stderr.contains("the image places 1.50 GiB of data"),
        "{used:?}"
    );
}

#[test]
fn a_compressed_fatbinary_that_fits_is_charged_what_its_cubin_says_until_its_unload() {
    for codec in [Codec::Lz4, Codec::Zstd] {
        let fat = fatbin_of(&[compressed(codec, 90, &module_of(GI))]);
        let image = image_file(&format!("1gi-{codec:?}.fatbin"), &fat);
        let load = op("modimage", &image);
        // The fake holds nothing for it: what is charged is what the image said, its
        // globals (its code comes at a kernel's first use, with lazy loading).
        let run = run(&[&load, "info", "unload:0", "info"], &[]);
        assert_eq!(run.rc("modimage", 0), 0, "{codec:?}\n{run:?}");
        assert_eq!(run.num("info", 0, "free"), GI, "{codec:?}\n{run:?}");
        assert_eq!(run.num("info", 1, "free"), 2 * GI, "{codec:?}\n{run:?}");
    }
}

#[test]
fn an_image_that_cannot_say_is_measured_at_its_load_and_undone_when_it_does_not_fit() {
    // A compressed entry whose bytes do not decode (a cubin stored as it is, flagged as
    // Zstandard): neither the library nor the fake reads inside it, and the fake charges
    // FAKE_CUDA_MODULE_BYTES for it.
    let big = module_of(3 * GI);
    let fat = image_file(
        "compressed.fatbin",
        &fatbin(&[(KIND_ELF, 90, COMPRESSED, &big)]),
    );
    let load = op("modimage", &fat);
    let run = run(
        &[&load, "loads", "phys", "info"],
        &[("FAKE_CUDA_MODULE_BYTES", "3221225472")],
    );
    assert_eq!(run.rc("modimage", 0), 2, "{run:?}");
    assert_eq!(
        run.num("loads", 0, "calls"),
        1,
        "the driver's load, then the measurement\n{run:?}"
    );
    assert_eq!(
        run.num("phys", 0, "used"),
        0,
        "and the load was undone\n{run:?}"
    );
    assert_eq!(run.num("info", 0, "free"), 2 * GI, "{run:?}");
}

#[test]
fn a_load_that_grows_the_device_more_than_its_image_said_is_charged_what_it_grew() {
    // PTX saying 100 MiB, which the fake (not compiling PTX) loads for 300 MiB: the
    // measurement after the load is the correction.
    let ptx = b".version 8.5\n.target sm_90\n.address_size 64\n\
        .global .align 8 .u64 table[13107200];\n";
    let image = image_file("100mi.ptx", ptx);
    let load = op("modimage", &image);
    let module_300mi = ("FAKE_CUDA_MODULE_BYTES", "314572800");
    let fits = run(&[&load, "info"], &[module_300mi]);
    assert_eq!(fits.rc("modimage", 0), 0, "{fits:?}");
    assert_eq!(fits.num("info", 0, "free"), 2 * GI - 300 * MI, "{fits:?}");
    // Under 250 MiB the image's 100 MiB are admitted, the 300 MiB it grew are not: undone.
    let undone = budget_run(
        "gpa",
        &[&load, "loads", "phys", "info"],
        &[("CUDABUDGET_LIMIT", "250Mi"), NVML_BLIND, module_300mi],
    );
    assert_eq!(undone.rc("modimage", 0), 2, "{undone:?}");
    assert_eq!(undone.num("loads", 0, "calls"), 1, "{undone:?}");
    assert_eq!(undone.num("phys", 0, "used"), 0, "{undone:?}");
    assert_eq!(undone.num("info", 0, "free"), 250 * MI, "{undone:?}");
}

#[test]
fn a_modules_code_is_admitted_before_its_load_where_modules_load_eagerly() {
    // 1.5 GiB of globals and 768 MiB of code: with lazy loading (CUDA's default) the code
    // arrives with each kernel's first use, so only the globals are admitted before the
    // load, and the growth the fake makes at once is the correction (undone: it does not
    // fit); loading eagerly, the code is placed at the load and admitted before it.
    let image = image_file(
        "code.cubin",
        &cubin(&[(".nv.global", 1536 * MI), (".text._Z5touchPc", 768 * MI)]),
    );
    let load = op("modimage", &image);
    let lazy = run(&[&load, "loads", "info"], &[]);
    assert_eq!(lazy.rc("modimage", 0), 2, "{lazy:?}");
    assert_eq!(lazy.num("loads", 0, "calls"), 1, "{lazy:?}");
    assert_eq!(lazy.num("info", 0, "free"), 2 * GI, "{lazy:?}");
    let eager = run(
        &[&load, "loads", "phys"],
        &[("CUDA_MODULE_LOADING", "EAGER")],
    );
    assert_eq!(eager.rc("modimage", 0), 2, "{eager:?}");
    assert_eq!(eager.num("loads", 0, "calls"), 0, "{eager:?}");
    assert_eq!(eager.num("phys", 0, "peak"), 0, "{eager:?}");
}

#[test]
fn a_module_goes_with_the_context_it_was_loaded_in() {
    // Loaded in a created context, which is destroyed while the primary context lives
    // on: the driver unloads the module with it, and its charge goes too.
    let image = image_file("512mi.cubin", &module_of(512 * MI));
    let load = op("modimage", &image);
    let run = run(
        &[
            "ctxcreate:0",
            &load,
            "ctxdestroy:0",
            "ctx:0",
            "info",
            "phys",
        ],
        &[],
    );
    assert_eq!(run.rc("modimage", 0), 0, "{run:?}");
    assert_eq!(run.rc("ctxdestroy", 0), 0, "{run:?}");
    assert_eq!(
        run.num("phys", 0, "used"),
        0,
        "the driver unloaded it\n{run:?}"
    );
    assert_eq!(run.num("info", 0, "free"), 2 * GI, "{run:?}");
}
